"""`TopoEPMoELayer`: megatron-core's MoELayer with TopoEP doing dispatch, experts and combine.

Megatron's router (top-k, expert bias, group-limited routing, aux losses, `moe_router_force_biased`),
shared experts and expert modules are kept as they are; only the token path changes. The experts'
parameters stay megatron's own (`local_experts.{i}.linear_fc1.weight` [2F, H] and
`linear_fc2.weight` [H, F] of SequentialMLP, or `weight{i}` of TEGroupedMLP), so state-dict keys,
expert-data-parallel reduction, optimizer ownership and checkpoints are those of the baseline and a
checkpoint moves freely between eplb=none and any TopoEP policy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer

from topoep.config import LayerConfig
from topoep.runtime import ExpertParallelMoE
from topoep.topology import Topology


@dataclass(frozen=True)
class TopoEPSpec:
    """What a TopoEP MoE layer needs beyond megatron's TransformerConfig: the EP group's topology and the layer's
    options (`topoep.LayerConfig`)."""

    topology: Topology
    config: LayerConfig = field(default_factory=LayerConfig)
    cpu_harness: bool = False  # tests: backend cuda's code on CPU processes over gloo (ExpertParallelMoE._cpu_harness)


def expert_weight_lists(experts) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(fc1 [2F, H] per local expert, fc2 [H, F] per local expert) of megatron's expert module."""
    if isinstance(experts, SequentialMLP):
        return ([e.linear_fc1.weight for e in experts.local_experts],
                [e.linear_fc2.weight for e in experts.local_experts])
    fc1, fc2 = getattr(experts, "linear_fc1", None), getattr(experts, "linear_fc2", None)
    n = getattr(experts, "num_local_experts", 0)
    if fc1 is not None and hasattr(fc1, "weight0"):  # TEGroupedMLP
        return [getattr(fc1, f"weight{i}") for i in range(n)], [getattr(fc2, f"weight{i}") for i in range(n)]
    raise ValueError(f"TopoEP cannot read the expert weights of {type(experts).__name__}; use megatron's local "
                     "spec (SequentialMLP) or the Transformer Engine spec (TEGroupedMLP)")


def routing_to_topk(probs: torch.Tensor, routing_map: torch.Tensor, top_k: int):
    """Megatron's dense (probs [T, E], routing_map bool [T, E]) -> (topk_idx int64 [T, k], weights [T, k]).
    No host synchronisation; a row with fewer than k selected experts gets zero-weight choices."""
    idx = torch.topk(routing_map.to(torch.int8), top_k, dim=1, sorted=False).indices.to(torch.int64)
    idx = torch.sort(idx, dim=1).values  # expert order inside a token, as megatron's permutation
    return idx, torch.gather(probs, 1, idx)


class TopoEPMoELayer(MoELayer):
    """MoELayer whose dispatch, expert compute and combine run through `topoep.ExpertParallelMoE`."""

    def __init__(self, config, submodules=None, layer_number=None, pg_collection=None, is_mtp_layer=False,
                 name=None, topoep: TopoEPSpec | None = None):
        super().__init__(config, submodules=submodules, layer_number=layer_number, pg_collection=pg_collection,
                         is_mtp_layer=is_mtp_layer, name=name)
        if topoep is None:
            raise ValueError("TopoEPMoELayer needs a TopoEPSpec (topoep=TopoEPSpec(topology, LayerConfig(...)))")
        if config.moe_expert_capacity_factor is not None:
            raise ValueError("TopoEP never drops tokens: unset moe_expert_capacity_factor")
        if config.moe_latent_size:
            raise ValueError("TopoEP does not support moe_latent_size (MoE latent projections)")
        # the layer computes SwiGLU experts without biases, each expert whole on its rank: refuse what it would
        # silently compute otherwise
        if getattr(config, "expert_tensor_parallel_size", 1) > 1:
            raise ValueError(f"TopoEP computes each expert whole on one rank: expert_tensor_parallel_size="
                             f"{config.expert_tensor_parallel_size} is not supported (in training: parallel.expert_tp=1)")
        if getattr(config, "moe_shared_expert_overlap", False):
            raise ValueError("TopoEP runs the shared experts beside its own dispatch: unset moe_shared_expert_overlap")
        if not config.gated_linear_unit or config.activation_func is not F.silu or config.add_bias_linear:
            raise ValueError("TopoEP's experts are SwiGLU without biases: set gated_linear_unit=True, "
                             "activation_func=F.silu and add_bias_linear=False")
        if getattr(config, "moe_apply_probs_on_input", False):
            raise ValueError("TopoEP weights the expert outputs by the routing probabilities: unset "
                             "moe_apply_probs_on_input")
        if self.ep_group.size() != topoep.topology.num_ranks:
            raise ValueError(f"topology covers {topoep.topology.num_ranks} ranks but the expert-parallel group has "
                             f"{self.ep_group.size()}: set the topology for the EP group")
        expert_weight_lists(self.experts)  # fail early on an unsupported expert module
        # plain attribute (not a submodule): the balancer owns no parameters or state-dict entries
        self.__dict__["balancer"] = ExpertParallelMoE(
            num_experts=config.num_moe_experts, hidden_size=config.hidden_size,
            ffn_hidden_size=config.moe_ffn_hidden_size, topology=topoep.topology, config=topoep.config,
            group=self.ep_group, dtype=config.params_dtype,
            device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu",
            expert_weights=lambda: expert_weight_lists(self.experts), _cpu_harness=topoep.cpu_harness)

    def forward(self, hidden_states: torch.Tensor, intermediate_tensors=None, padding_mask=None):
        if intermediate_tensors is not None:
            raise ValueError("TopoEPMoELayer does not support partial CUDA-graph capture of the MoE layer")
        if padding_mask is not None:
            padding_mask = padding_mask.transpose(0, 1).bool()
        shape = hidden_states.shape
        shared = self.shared_experts_compute(hidden_states)
        probs, routing_map = self.route(hidden_states, padding_mask)
        x = hidden_states.reshape(-1, shape[-1])
        topk_idx, topk_weights = routing_to_topk(probs, routing_map, self.config.moe_router_topk)
        y = self.balancer(x, topk_idx, topk_weights).view(shape)
        if shared is not None:
            y = y + shared
        return y, None
