"""Runtime: the balanced expert-parallel MoE layer, its replica-slot pool and execution backends."""

from topoep.runtime.backend import TorchBackend, make_backend
from topoep.runtime.moe import LAYER_STAT_NAMES, ExpertParallelMoE
from topoep.runtime.pool import ReplicaPool

__all__ = ["LAYER_STAT_NAMES", "ExpertParallelMoE", "ReplicaPool", "TorchBackend", "make_backend"]
