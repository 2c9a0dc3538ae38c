"""TopoEP: GPU-native, topology-aware load balancing for expert-parallel MoE training."""

from topoep import links, workloads
from topoep.config import LayerConfig
from topoep.metrics import DEFAULT_T_FFN, ffn_time_per_assignment, metrics, plan_stats
from topoep.plan import Plan
from topoep.planners import OFFLINE_POLICIES, POLICIES, solve
from topoep.runtime import ExpertParallelMoE, ReplicaPool, graph_layer
from topoep.topology import Topology

__all__ = ["DEFAULT_T_FFN", "OFFLINE_POLICIES", "POLICIES", "ExpertParallelMoE", "LayerConfig", "Plan", "ReplicaPool", "Topology",
           "ffn_time_per_assignment", "graph_layer", "links", "metrics", "plan_stats", "solve", "workloads"]
