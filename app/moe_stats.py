"""Per-step MoE statistics for logging, for baseline and TopoEP layers alike.

Each MoE layer's router is hooked to count its local assignments per expert (on the device, summed
over micro-batches). Once per step the counts are all-gathered over the EP group into omega[R, E] per
layer, from which the no-balancing ("before") imbalance and inter-node share follow; TopoEP layers add
their plans' statistics ("after") and the share of their calls in which the net-benefit guard fired
(executed the static plan), the share in which its pre-plan bound left planning out (`plan_skip`: no plan could
pay) and the shares that ran topoep_plus's local plan (`plan_local`), a spread plan (`plan_spread`,
eplb.plus_spread) and a peer's plan (`plan_peer`, eplb.plus_peers) and the share that ran the spread planner (`spread_planned`: eplb.spread_gate); with backend cuda also the share of calls that left the replica machinery out
(`slot_skip`), the share that did so although their own guard wanted replicas (`slot_skip_missed`: the cost
of deciding from the guard `skip_lag` calls earlier) and how often the host waited for that earlier decision
(`slot_waits`, a count on the ranks that report each stage), and the rows the capacity step could not fit into the
receive regions (`capacity_overflow`, summed over the step's micro-batches: backend cuda computed them on the spill
path). One small all-reduce brings every pipeline stage's layers to rank 0.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from topoep.runtime import LAYER_STAT_NAMES
from topoep.topology import Topology

COLUMNS = ("imbalance_before", "imbalance_after", "internode_before", "internode_after", "replica_fraction",
           "planner_ms", "num_replicas", "guard_fired", "plan_skip", "plan_local", "plan_spread", "plan_peer",
           "spread_planned",
           "slot_skip", "slot_skip_missed", "slot_waits",
           "capacity_overflow")
_IDX = {n: i for i, n in enumerate(LAYER_STAT_NAMES)}


class MoEStats:
    def __init__(self, layers, topology: Topology, num_moe_layers: int, num_experts: int, first_k_dense: int,
                 device):
        self.layers = layers  # this pipeline stage's MoE layers (a stage may have none)
        self.topology = topology
        self.num_moe_layers = num_moe_layers
        self.device = device
        E = self.num_experts = num_experts
        self.index = [layer.layer_number - 1 - first_k_dense for layer in layers]  # global MoE-layer index
        self.counts = torch.zeros(len(layers), E, dtype=torch.int64, device=device)
        self._waits: dict[int, int] = {}  # layer -> its slot hint's waits at the last collect
        self._pools: dict[int, tuple] = {}  # id of a backend cuda pool -> its counters at the last pool_counts
        for i, layer in enumerate(layers):
            layer.router.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, inputs, output):
            with torch.no_grad():
                self.counts[i] += output[1].sum(0).to(torch.int64)
        return hook

    def pool_counts(self) -> dict[str, int]:
        """Backend cuda's replica fetches since the last call, summed over this stage's pools (host counters, alike
        on every rank of the stage): `replica_fetches` (forward fills, backward reloads and prefetches),
        `reloads_skipped` (backward reloads left out: the slots still held the replicas) and `prefetches`
        (eplb.prefetch). Empty when no layer has such a pool (backend torch, or no slots)."""
        pools = {}
        for layer in self.layers:
            pool = getattr(getattr(layer, "balancer", None), "pool", None)
            if pool is not None and hasattr(pool, "fills"):
                pools[id(pool)] = pool
        out = dict(replica_fetches=0, reloads_skipped=0, prefetches=0) if pools else {}
        for key, pool in pools.items():
            now = (pool.fills, pool.reloads_skipped, pool.prefetches)
            for name, a, b in zip(out, now, self._pools.get(key, (0, 0, 0))):
                out[name] += a - b
            self._pools[key] = now
        return out

    @torch.no_grad()
    def collect(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(stats float64[num_moe_layers, len(COLUMNS)], loads float64[num_moe_layers, E]) on rank 0 (other
        ranks get partial sums); resets the counters. Collective: every rank must call it."""
        L, E = self.num_moe_layers, self.num_experts
        topo = self.topology
        R = topo.num_ranks
        ep_group = ps.get_expert_model_parallel_group()
        gathered = torch.empty(R * self.counts.numel(), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(gathered, self.counts.reshape(-1), group=ep_group)
        omega = gathered.view(R, len(self.layers), E).transpose(0, 1).double()  # [L_local, R, E]
        stats = torch.zeros(L, len(COLUMNS), dtype=torch.float64, device=self.device)
        loads = torch.zeros(L, E, dtype=torch.float64, device=self.device)
        dom = topo.domain_of.to(self.device)
        main_dom = dom[torch.arange(E, device=self.device) // (E // R)]
        cross = (dom[:, None] != main_dom[None, :]).double()  # [R, E]
        for i, layer in enumerate(self.layers):
            om = omega[i]
            load = om.sum(0)
            rank_load = load.view(R, E // R).sum(1)
            total = load.sum().clamp(min=1)
            before = rank_load.max() / rank_load.mean().clamp(min=1e-30)
            inter = (om * cross).sum() / total
            row = dict(imbalance_before=before, imbalance_after=before, internode_before=inter,
                       internode_after=inter, replica_fraction=0.0, planner_ms=0.0, num_replicas=0.0,
                       guard_fired=0.0, plan_skip=0.0, plan_local=0.0, plan_spread=0.0, plan_peer=0.0,
                       spread_planned=0.0,
                       slot_skip=0.0, slot_skip_missed=0.0,
                       slot_waits=0.0, capacity_overflow=0.0)
            balancer = getattr(layer, "balancer", None)
            s, calls = balancer.pop_stats() if balancer is not None else (None, 0)
            if s is not None:  # TopoEP layer: its plans' statistics, averaged over the micro-batches
                row.update(imbalance_after=s[_IDX["imbalance"]], internode_after=s[_IDX["internode_fraction"]],
                           replica_fraction=s[_IDX["replica_fraction"]], planner_ms=s[_IDX["planner_ms"]] * calls,
                           num_replicas=s[_IDX["num_replicas"]], guard_fired=s[_IDX["guard_fired"]],
                           plan_skip=s[_IDX["plan_skipped"]], plan_local=s[_IDX["plan_local"]],
                           plan_spread=s[_IDX["plan_spread"]], plan_peer=s[_IDX["plan_peer"]],
                           spread_planned=s[_IDX["spread_planned"]],
                           slot_skip=s[_IDX["slot_skipped"]], slot_skip_missed=s[_IDX["slot_skip_missed"]],
                           capacity_overflow=s[_IDX["capacity_overflow"]] * calls)
            hint = getattr(balancer, "slot_hint", None)
            if hint is not None:  # host counter: the waits since the last step
                row.update(slot_waits=float(hint.waits - self._waits.get(i, 0)))
                self._waits[i] = hint.waits
            stats[self.index[i]] = torch.stack([torch.as_tensor(row[c], dtype=torch.float64, device=self.device)
                                                for c in COLUMNS])
            loads[self.index[i]] = load
        self.counts.zero_()
        # one contribution per pipeline stage: the EP/DP/TP rank 0 of each stage
        contributes = (ps.get_expert_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
                       and ps.get_tensor_model_parallel_rank() == 0)
        packed = torch.cat([stats.reshape(-1), loads.reshape(-1)]) * (1.0 if contributes else 0.0)
        dist.all_reduce(packed)
        return packed[:stats.numel()].view_as(stats), packed[stats.numel():].view_as(loads)
