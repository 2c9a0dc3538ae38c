"""Runtime: the balanced expert-parallel MoE layer, its replica-slot pool, execution backends, the
net-benefit guard and per-phase timing for benchmarks."""

from topoep.runtime.backend import TorchBackend, make_backend
from topoep.runtime.graphs import graph_layer
from topoep.runtime.guard import NetBenefitGuard
from topoep.runtime.moe import LAYER_STAT_NAMES, ExpertParallelMoE
from topoep.runtime.pool import ReplicaPool
from topoep.runtime.timing import PHASES, PhaseTimer

__all__ = ["LAYER_STAT_NAMES", "PHASES", "ExpertParallelMoE", "NetBenefitGuard", "PhaseTimer", "ReplicaPool",
           "TorchBackend", "graph_layer", "make_backend"]
