"""Per-step MoE statistics for logging, for baseline and TopoEP layers alike.

Each MoE layer's router is hooked to count its local assignments per expert and micro-batch (on the device). Once
per step the counts are all-gathered over the EP group into omega[R, E] per layer and micro-batch, from which the
no-balancing ("before") imbalance follows, averaged over the micro-batches as the layers average their plans'
("after"), and the inter-node share and the token bytes of megatron's own layer (`eplb=none`); TopoEP layers add
their plans' statistics ("after") and the share of their calls in which the net-benefit guard fired
(executed the static plan), the share in which its pre-plan bound left planning out (`plan_skip`: no plan could
pay) and the shares that ran topoep_plus's local plan (`plan_local`), a spread plan (`plan_spread`,
eplb.plus_spread) and a peer's plan (`plan_peer`, eplb.plus_peers) and the share that ran the spread planner (`spread_planned`: eplb.spread_gate); with backend cuda also the share of calls that left the replica machinery out
(`slot_skip`), the share that did so although their own pre-plan bound let a plan pay (`slot_skip_missed`: an upper
bound of the cost of deciding from the guard `skip_lag` calls earlier) and how often the host waited for that earlier decision
(`slot_waits`, a count on the ranks that report each stage), and the rows the capacity step could not fit into the
receive regions (`capacity_overflow`, summed over the step's micro-batches: backend cuda computed them on the spill
path). The bytes (`token_bytes_inter`, `token_bytes_intra`, `replica_bytes_inter`, `replica_bytes_intra`,
`topoep.metrics.STAT_NAMES`) are summed over the step's calls: tokens dispatched and combined, forward and backward,
across domains and between the ranks of one domain; replica fetches, reloads and gradient returns. One small
all-reduce brings every pipeline stage's layers, and backend cuda's replica-pool counters, to rank 0.
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
           "capacity_overflow", "token_bytes_inter", "token_bytes_intra", "replica_bytes_inter", "replica_bytes_intra")
BYTES = ("token_bytes_inter", "token_bytes_intra", "replica_bytes_inter", "replica_bytes_intra")
SUMMED = ("planner_ms", "slot_waits", "capacity_overflow", *BYTES)  # summed over the layers (the others: averaged)
POOL_COUNTS = ("replica_fetches", "reloads_skipped", "prefetches")  # backend cuda's pools, summed over the stages
COUNTS = ("slot_waits", "capacity_overflow", *POOL_COUNTS)  # events of a step (trainer.log_interval adds them up)
_IDX = {n: i for i, n in enumerate(LAYER_STAT_NAMES)}


class MoEStats:
    def __init__(self, layers, topology: Topology, num_moe_layers: int, num_experts: int, first_k_dense: int,
                 device, num_microbatches: int = 1, token_bytes: int = 0):
        self.layers = layers  # this pipeline stage's MoE layers (a stage may have none)
        self.topology = topology
        self.num_moe_layers = num_moe_layers
        self.device = device
        self.token_bytes = token_bytes  # bytes of one token row (megatron's own layer's token bytes)
        E = self.num_experts = num_experts
        self.index = [layer.layer_number - 1 - first_k_dense for layer in layers]  # global MoE-layer index
        # per layer and micro-batch (a layer's router calls in order, modulo the step's micro-batches)
        self.counts = torch.zeros(len(layers), num_microbatches, E, dtype=torch.int64, device=device)
        self._calls = [0] * len(layers)
        self._waits: dict[int, int] = {}  # layer -> its slot hint's waits at the last collect
        self._pools: dict[int, tuple] = {}  # id of a backend cuda pool -> its counters at the last pool_counts
        for i, layer in enumerate(layers):
            layer.router.register_forward_hook(self._hook(i))

    def _hook(self, i):
        def hook(module, inputs, output):
            with torch.no_grad():
                self.counts[i, self._calls[i] % self.counts.shape[1]] += output[1].sum(0).to(torch.int64)
            self._calls[i] += 1
        return hook

    def _pool_counts(self) -> list[float]:
        """Backend cuda's replica fetches since the last call, summed over this stage's pools (host counters, alike
        on every rank of the stage), in POOL_COUNTS order: forward fills, backward reloads and prefetches; backward
        reloads left out (the slots still held the replicas); prefetches (eplb.prefetch); then 1 where this stage
        has such a pool (backend cuda with slots), else 0."""
        pools = {}
        for layer in self.layers:
            pool = getattr(getattr(layer, "balancer", None), "pool", None)
            if pool is not None and hasattr(pool, "fills"):
                pools[id(pool)] = pool
        out = [0.0, 0.0, 0.0]
        for key, pool in pools.items():
            now = (pool.fills, pool.reloads_skipped, pool.prefetches)
            for j, (a, b) in enumerate(zip(now, self._pools.get(key, (0, 0, 0)))):
                out[j] += a - b
            self._pools[key] = now
        return out + [1.0 if pools else 0.0]

    @torch.no_grad()
    def collect(self) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """(stats float64[num_moe_layers, len(COLUMNS)], loads float64[num_moe_layers, E], backend cuda's pool
        counters {POOL_COUNTS: count}, empty without such pools) on rank 0 (other ranks get partial sums); resets
        the counters. Collective: every rank must call it."""
        L, E = self.num_moe_layers, self.num_experts
        topo = self.topology
        R = topo.num_ranks
        nmb = self.counts.shape[1]
        ep_group = ps.get_expert_model_parallel_group()
        gathered = torch.empty(R * self.counts.numel(), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(gathered, self.counts.reshape(-1), group=ep_group)
        omega = gathered.view(R, len(self.layers), nmb, E).permute(1, 2, 0, 3).double()  # [L_local, nmb, R, E]
        stats = torch.zeros(L, len(COLUMNS), dtype=torch.float64, device=self.device)
        loads = torch.zeros(L, E, dtype=torch.float64, device=self.device)
        dom = topo.domain_of.to(self.device)
        main_rank = torch.arange(E, device=self.device) // (E // R)
        cross = (dom[:, None] != dom[main_rank][None, :]).double()  # [R, E]
        near = ((dom[:, None] == dom[main_rank][None, :])
                & (torch.arange(R, device=self.device)[:, None] != main_rank[None, :])).double()
        for i, layer in enumerate(self.layers):
            om = omega[i].sum(0)  # the step's assignments [R, E]
            load = om.sum(0)
            # per micro-batch, as the layers' plans are made: max / mean rank load (1 without load), averaged
            rank_loads = omega[i].sum(1).view(nmb, R, E // R).sum(2)  # [nmb, R]
            means = rank_loads.mean(1)
            ratios = torch.where(means > 0, rank_loads.amax(1) / means.clamp(min=1e-30), torch.ones_like(means))
            before = ratios[: max(1, min(self._calls[i], nmb))].mean()
            total = load.sum().clamp(min=1)
            inter = (om * cross).sum() / total
            S = 4.0 * self.token_bytes  # dispatch and combine, forward and backward (topoep.metrics.STAT_NAMES)
            row = dict(imbalance_before=before, imbalance_after=before, internode_before=inter,
                       internode_after=inter, replica_fraction=0.0, planner_ms=0.0, num_replicas=0.0,
                       guard_fired=0.0, plan_skip=0.0, plan_local=0.0, plan_spread=0.0, plan_peer=0.0,
                       spread_planned=0.0,
                       slot_skip=0.0, slot_skip_missed=0.0,
                       slot_waits=0.0, capacity_overflow=0.0,
                       token_bytes_inter=S * (om * cross).sum(), token_bytes_intra=S * (om * near).sum(),
                       replica_bytes_inter=0.0, replica_bytes_intra=0.0)
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
                           capacity_overflow=s[_IDX["capacity_overflow"]] * calls,
                           **{b: s[_IDX[b]] * calls for b in BYTES})
            hint = getattr(balancer, "slot_hint", None)
            if hint is not None:  # host counter: the waits since the last step
                row.update(slot_waits=float(hint.waits - self._waits.get(i, 0)))
                self._waits[i] = hint.waits
            stats[self.index[i]] = torch.stack([torch.as_tensor(row[c], dtype=torch.float64, device=self.device)
                                                for c in COLUMNS])
            loads[self.index[i]] = load
        self.counts.zero_()
        self._calls = [0] * len(self.layers)
        # one contribution per pipeline stage: the EP/DP/TP rank 0 of each stage
        contributes = (ps.get_expert_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
                       and ps.get_tensor_model_parallel_rank() == 0)
        pools = torch.tensor(self._pool_counts(), dtype=torch.float64, device=self.device)
        packed = torch.cat([stats.reshape(-1), loads.reshape(-1), pools]) * (1.0 if contributes else 0.0)
        dist.all_reduce(packed)
        n, m = stats.numel(), loads.numel()
        pool = packed[n + m:].tolist()
        counts = dict(zip(POOL_COUNTS, pool[:3])) if pool[3] > 0 else {}
        return packed[:n].view_as(stats), packed[n:n + m].view_as(loads), counts
