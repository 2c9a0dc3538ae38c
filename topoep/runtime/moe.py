"""`ExpertParallelMoE`: the framework-agnostic balanced expert-parallel MoE layer (no megatron import).

Per call: all-gather the local routing counts into omega, plan with `topoep.solve`, let the
net-benefit guard (`guard.py`, paper eq. 2) fall back to the static plan when balancing would not pay,
fetch replica weights into the shared slot pool, dispatch every assignment to the instance the plan
gives, run the experts (main and replica, grouped), combine, and weight by topk_weights. Backward
returns replica weight gradients to the main ranks (see `torch_function.py` and `cuda_function.py`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from typing import Callable

import torch
from torch import nn

from topoep.config import LayerConfig
from topoep.metrics import DEFAULT_T_FFN, STAT_NAMES, plan_stats
from topoep.planners import has_cuda_kernel, plan_concurrently, solve
from topoep.planners.cuda import FLEXMOE_MAX_RANKS, SPREAD_POLICIES, device_flag
from topoep.planners.capacity import fit_capacity
from topoep.topology import Topology
from topoep.runtime.backend import GLOO_HARNESS, capacity_rows, harness_transport, make_backend
from topoep.runtime.torch_function import ExpertParallelFunction, LayerCall
from topoep.runtime.graphs import graph_layer
from topoep.runtime.guard import SERIAL_TOKEN_OVERLAP, NetBenefitGuard, SlotSkipHint, SpreadGate
from topoep.plan import Plan, default_main_rank
from topoep.relay import RelayTrees, executed_sources, max_level
from topoep.runtime.cuda_function import CudaChunk, CudaExpertParallelFunction, CudaLayerCall, side_stream
from topoep.runtime.cuda_meta import MetadataGraphs
from topoep.runtime.deepep import DeepEPExpertParallelFunction, deepep_expert_ids
from topoep.runtime.layout import (assignment_instances, chunk_layouts, chunk_route_row, copy_splits_to_host,
                                   count_keys, group_counts, local_group, own_rows, receive_positions, received_sizes,
                                   send_layout)
from topoep.runtime import guard_cuda, layout_triton, stats_triton
from topoep.runtime.pool import ReplicaPool
from topoep.runtime.spill import SpillWork, spill_work, spill_work_triton
from topoep.runtime.timing import PhaseTimer, phase

LAYOUT = 9 + len(dataclasses.fields(SpillWork))  # tensors per chunk of _cuda_layout

GUARD_STATS = 9  # guard_fired .. spread_planned in LAYER_STAT_NAMES
PEER_CANDIDATES = ("flexmoe", "deepseek")  # LayerConfig.plus_peers: the peers' plans the guard may keep
LAYER_STAT_NAMES = STAT_NAMES + (
    "planner_ms",  # host time of planning and the guard (on a GPU: launch time, no sync)
    "guard_fired",  # 1 if the call executed the static plan instead of the balanced one: the guard decided so,
    # or (backend cuda, skip_lag) the host had left the call's replica machinery out
    "guard_saved_ms",  # the guard's predicted T_saved of the balanced plan (0 when no guard runs or plan_skipped)
    "guard_cost_ms",  # its predicted T_plan + T_transfer (likewise)
    "guard_wanted",  # 1 if the guard itself wanted the balanced plan (T_saved > T_plan + T_transfer); in a call that
    # planned nothing (backend cuda's slot hint left the replica machinery out) the pre-plan bound's verdict
    "plan_skipped",  # 1 if the guard's pre-plan bound left planning out (no plan could pay: NetBenefitGuard.worth_planning)
    "plan_local",  # 1 if the executed plan was topoep_plus's local candidate (topoep_plus_local; the guard chose it)
    "plan_spread",  # 1 if it was a spread candidate (topoep_plus_spread or _tree: LayerConfig.plus_spread)
    "plan_peer",  # 1 if it was a peer's plan (flexmoe or deepseek: LayerConfig.plus_peers)
    "spread_planned",  # 1 if the gated planners ran (plus_spread, plus_peers: the pre-plan bound and the spread gate let them)
    "slot_skipped",  # 1 if backend cuda left the call's replica machinery out (the guard had fired: skip_lag)
    "slot_skip_missed",  # 1 if it did although this call's pre-plan bound let a plan pay (the guard, which did not
    # run, might not have wanted it either: an upper bound of the cost of the lag)
    "capacity_overflow",  # rows beyond the capacity after the capacity step, all ranks, against one region per rank
    # (backend cuda spills the rows beyond each chunk's own region: with 2 chunks, fewer or more than this)
    "capacity_moves",  # moves of the capacity step (0: the plan fitted as the policy and the guard made it)
)

_UNSET = object()


def plus_policies(topology: Topology, peers: bool = False, spread: bool = False, tree: bool = False,
                  plan_domain: int | None = None) -> tuple[str, ...]:
    """The plans a guarded topoep_plus layer makes at once, the policy's own first (the guard's choice 0), then its
    local candidate (1), with `peers` FlexMoE's and DeepSeek EPLB's plans (LayerConfig.plus_peers), with `spread` the
    spread candidate (plus_spread) and with `tree` also its relay-tree variant (relay_fanout). The local candidate
    only where the planners see more than one domain (NVLink domains, or the planning groups of `plan_domain`,
    LayerConfig.plan_domain): on one, the paper's stage 1 places nothing (no other domain), so topoep_plus_local's
    plan equals topoep_plus's bit for bit (tests/test_topoep_plus.py) and planning and pricing it twice would only
    cost time."""
    groups = topology.planning_groups(plan_domain)
    names = ("topoep_plus",) + (("topoep_plus_local",) if groups.num_domains > 1 else ())
    if peers:
        names += PEER_CANDIDATES
    if spread:
        names += ("topoep_plus_spread",) + (("topoep_plus_spread_tree",) if tree else ())
    return names


@dataclasses.dataclass
class GuardOutcome:
    """What one call's net-benefit guard decided, as device tensors (0-d): the pre-plan bound's verdict (`worth`), and
    unless `unplanned` (the slot hint left planning out: the bound alone ran) the guard's `fired`, T_saved, T_plan +
    T_transfer, the kept plan's index (`choice`), the spread planners' enable flag (`spread_run`, None without
    them) and the layer's spread gate (None without one), with the indices of the plans by kind (local: -1 where
    the layer planned no local candidate). `finish` turns it into the call's statistics and the guard's own decision
    and updates the spread gate: nothing of that feeds the plan, so backend cuda runs it on the metadata's side
    stream beside the receive layout, off the plan's path (the next call's gate flag is read after the two streams
    join)."""

    worth: torch.Tensor | None
    fired: torch.Tensor | None = None
    saved: torch.Tensor | None = None
    cost: torch.Tensor | None = None
    choice: torch.Tensor | None = None
    spread_run: torch.Tensor | None = None
    gate: SpreadGate | None = None
    local: int = -1
    first_gated: int = 0
    first_spread: int = 0
    unplanned: bool = False

    def finish(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64[GUARD_STATS] statistics: guard_fired .. spread_planned of LAYER_STAT_NAMES, wanted: bool 0-d,
        True when the guard itself wants the balanced plan; in an unplanned call the bound's verdict). Call it once
        per call: it records the call in the spread gate."""
        worth = self.worth
        f64 = torch.float64
        if self.unplanned:
            zero = torch.zeros((), dtype=f64, device=worth.device)
            return torch.stack([zero + 1, zero, zero, worth.to(f64), (~worth).to(f64), zero, zero, zero, zero]), worth
        fired, choice = self.fired, self.choice
        kept = ~fired
        wanted = (self.saved > self.cost) & worth
        local = (choice == self.local) & kept
        spread = (choice >= self.first_spread) & kept
        peer = (choice >= self.first_gated) & (choice < self.first_spread) & kept
        ran = torch.zeros_like(worth) if self.spread_run is None else self.spread_run
        if self.gate is not None:
            self.gate.record(worth, self.spread_run, fired, self.saved, self.cost, choice, self.first_gated)
        flags = torch.stack([fired, wanted, ~worth, local, spread, peer, ran]).to(f64)
        return torch.cat([flags[:1], 1e3 * torch.stack([self.saved, self.cost]), flags[1:]]), wanted


class ExpertParallelMoE(nn.Module):
    """Balanced expert-parallel MoE layer.

    Args:
        num_experts: E (a multiple of the EP size R = topology.num_ranks).
        hidden_size, ffn_hidden_size: H and the expert FFN size F (SwiGLU: fc1 [2F, H], fc2 [H, F]).
        topology: the EP group's domains; its num_ranks must equal the group's size.
        config: the layer's options, a `topoep.LayerConfig` (policy, slots, backend, transport, chunks, capacity,
            guard, ...; docs/config.md). Its fields may also be given as keywords, which override `config`'s:
            `ExpertParallelMoE(..., policy="topoep_plus", backend="cuda")`. `guard` may also be a
            `NetBenefitGuard` with its own constants.
        group: the EP process group (None: the default group, or a single process).
        dtype, device: of the expert weights and the pool.
        expert_weights: optional callable returning (fc1 list, fc2 list) of this rank's E/R main experts
            (e.g. megatron's own parameters); when given, the layer owns no expert parameters.
        pool: an explicit `ReplicaPool` (backend torch); default: the process-wide pool of this shape, dtype and
            device.

    Attributes:
        timer: a `PhaseTimer` to time the phases of every call (benchmarks; serialises the pipeline),
            or None (default).
    """

    def __init__(self, *, num_experts: int, hidden_size: int, ffn_hidden_size: int, topology: Topology,
                 config: LayerConfig | None = None, group=None, dtype=None, device=None,
                 expert_weights: Callable | None = None, pool: ReplicaPool | None = None, **fields):
        super().__init__()
        guard = fields.pop("guard", _UNSET)
        if isinstance(guard, NetBenefitGuard):  # a guard with its own constants (library only)
            fields["guard"] = True
        elif guard is not _UNSET:
            fields["guard"] = False if guard is None else guard
        cpu_harness = fields.pop("_cpu_harness", False)  # tests: backend cuda's logic over gloo (a2a.GlooExchange)
        config = (config or LayerConfig()).replace(**fields)
        self.config = config
        if not isinstance(topology, Topology):
            raise ValueError(f"topology must be a topoep.Topology, got {type(topology).__name__}")
        R = topology.num_ranks
        for name, v in (("num_experts", num_experts), ("hidden_size", hidden_size), ("ffn_hidden_size", ffn_hidden_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if num_experts % R:
            raise ValueError(f"num_experts={num_experts} must be a multiple of the EP size {R} (topology.num_ranks)")
        num_slots, policy, num_chunks = config.num_slots, config.policy, config.chunks
        self.t_ffn = DEFAULT_T_FFN if config.t_ffn is None else config.t_ffn
        self.guard = NetBenefitGuard.build(guard if isinstance(guard, NetBenefitGuard) else config.guard)
        if self.guard is not None and not isinstance(guard, NetBenefitGuard):
            # both backends run a call's dispatch, expert compute and combine one after another (no chunk pipeline
            # beside the compute), so the layer's guard prices them serially (SERIAL_TOKEN_OVERLAP); the guard's own
            # default, 0.8, models paper 3.3's overlapped pipeline, which the simulator's `topoep` execution runs
            self.guard = dataclasses.replace(self.guard, token_overlap=SERIAL_TOKEN_OVERLAP)
        if self.guard is not None and config.relay_fanout is not None:  # it prices the fetch that runs
            self.guard = self.guard.pricing_relays(config.relay_fanout, config.relay_chunks, config.relay_share,
                                                   config.relay_schedule)
        if self.guard is not None and config.fetch_overlap:  # and the forward fetch beside the dispatch
            self.guard = dataclasses.replace(self.guard, fetch_overlap=True)
        self.capacity_factor = config.capacity_factor
        self.backend = make_backend(config.backend, group, config.max_tokens,
                                    harness_transport(config.transport) if cpu_harness else config.transport)
        if self.backend.world_size != R:
            raise ValueError(f"the EP group has {self.backend.world_size} ranks but the topology covers {R}: "
                             "build the topology for the EP group (e.g. Topology.from_env(ep_size=...))")
        if config.plus_peers and config.backend == "cuda" and R > FLEXMOE_MAX_RANKS:
            raise ValueError(f"plus_peers=true with backend cuda plans flexmoe on the GPU, which takes at most "
                             f"{FLEXMOE_MAX_RANKS} ranks (the EP group has {R}): set plus_peers=false")
        self.num_experts, self.hidden_size, self.ffn_hidden_size = num_experts, hidden_size, ffn_hidden_size
        self.topology, self.num_slots, self.policy, self.num_chunks = topology, num_slots, policy, num_chunks
        self.rank = self.backend.rank
        self.experts_per_rank = num_experts // R
        dtype = dtype or torch.get_default_dtype()
        self._expert_weights = expert_weights
        if expert_weights is None:
            E_loc, F, H = self.experts_per_rank, ffn_hidden_size, hidden_size
            self.fc1 = nn.Parameter(torch.empty(E_loc, 2 * F, H, dtype=dtype, device=device))
            self.fc2 = nn.Parameter(torch.empty(E_loc, H, F, dtype=dtype, device=device))
            self.reset_parameters()
        if pool is not None and (pool.num_slots != num_slots or tuple(pool.fc1.shape[1:]) != (2 * ffn_hidden_size,
                                                                                           hidden_size)):
            raise ValueError(f"pool has {pool.num_slots} slots of fc1 {list(pool.fc1.shape[1:])}, but the layer needs "
                             f"{num_slots} of [{2 * ffn_hidden_size}, {hidden_size}]: pass a matching ReplicaPool (or "
                             f"none: the layers of a process share one)")
        self.pool = pool or ReplicaPool.shared(num_slots, hidden_size, ffn_hidden_size, dtype, device)
        self.last_plan = None
        self.workspace = None  # backend cuda: the (shared) workspace of the last call
        self.timer: PhaseTimer | None = None
        self._last_stats = None  # (the last call's statistics without planner_ms, its planner_ms): `stats`
        self._stats_sum, self._planner_ms_sum, self._stats_calls = None, 0.0, 0
        self._graphed = None  # graphs.graph_layer: the captured calls' shapes, dtypes and requires_grad
        # backend cuda: the metadata CUDA graphs (cuda_meta.py); a policy without a GPU planner synchronises
        # the host, so its metadata runs eagerly
        self._meta_graphs = MetadataGraphs(enabled=config.cuda_graphs and has_cuda_kernel(policy, topology))
        # backend cuda: leave out the replica machinery of calls whose guard will fire (guard.py, skip_lag)
        lag = self.guard.skip_lag if self.guard is not None else None
        # backend cuda: static places replicas only for the capacity (the capacity step), so its slots follow the
        # same hint: left out while no recent call needed a replica
        self._uses_slots = policy != "static" or self.capacity_factor is not None
        if policy == "static" and lag is None:  # no guard: the hint's default lag
            lag = NetBenefitGuard.skip_lag
        self.slot_hint = (SlotSkipHint(lag) if lag is not None and self.backend.name == "cuda" and num_slots > 0
                          and self._uses_slots else None)
        # plus_spread, plus_peers: the gated planners (spread, peers) run where they pay for themselves (guard.SpreadGate)
        self._spread_gate = (SpreadGate(config.spread_probe,
                                        self.guard.gated_s(R, num_slots, config.plus_spread, config.relay_fanout is not None,
                                                           config.plus_peers))
                             if (config.plus_spread or config.plus_peers) and config.spread_gate else None)

    def reset_parameters(self, std: float = 0.02) -> None:
        if self._expert_weights is None:
            with torch.no_grad():
                self.fc1.normal_(0.0, std)
                self.fc2.normal_(0.0, std / math.sqrt(2.0))

    def main_weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(fc1 [2F, H] x E_loc, fc2 [H, F] x E_loc): this rank's main experts."""
        if self._expert_weights is not None:
            fc1, fc2 = self._expert_weights()
            return list(fc1), list(fc2)
        return list(self.fc1.unbind(0)), list(self.fc2.unbind(0))

    @property
    def expert_bytes(self) -> int:
        return 3 * self.hidden_size * self.ffn_hidden_size * self.pool.fc1.element_size()

    def _validate(self, x, topk_idx, topk_weights):
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x must be [T, hidden_size={self.hidden_size}], got {list(x.shape)}")
        if topk_idx.dtype != torch.int64:
            raise ValueError(f"topk_idx must be int64, got {topk_idx.dtype}")
        if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
            raise ValueError(f"topk_idx must be [T={x.shape[0]}, k], got {list(topk_idx.shape)} "
                             "(T must match x)")
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"topk_weights must match topk_idx's shape {list(topk_idx.shape)} "
                             f"(one weight per choice, same k), got {list(topk_weights.shape)}")
        if not topk_weights.is_floating_point():
            raise ValueError(f"topk_weights must be floating point, got {topk_weights.dtype}")
        if self.backend.name == "cuda" and topk_idx.is_cuda:  # reading the values would synchronise: _cuda_metadata
            return  # checks them on the device (in its CUDA graph)
        if topk_idx.numel():
            lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()  # one read of the device
            if lo < 0 or hi >= self.num_experts:
                raise ValueError(f"topk_idx out of range: values must be in [0, {self.num_experts}), got [{lo}, {hi}]")

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x: [T, H]; topk_idx: int64[T, k]; topk_weights: [T, k] -> y: [T, H] (x's dtype)."""
        self._validate(x, topk_idx, topk_weights)
        # the capture takes the first training call with grad on (forward and backward graphs); calls before it (an
        # eval pass, no_grad, a full recompute's first pass) run eagerly
        if self.config.layer_graphs and self._graphed is None and self.training and torch.is_grad_enabled():
            graph_layer(self, x, topk_idx, topk_weights)  # its warm-up calls and capture run _forward_with
            return self.forward(x, topk_idx, topk_weights)  # graph_layer's: this call is the first replay
        return self._forward_with(x, topk_idx, topk_weights, *self._weights())

    def _weights(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(fc1, fc2) as the call takes them: the stacked parameters with backend cuda (no per-expert views, no host
        work per expert), else one tensor per local expert."""
        if self.backend.name == "cuda" and self._expert_weights is None:
            return [self.fc1], [self.fc2]
        return self.main_weights()

    def _forward_with(self, x, topk_idx, topk_weights, fc1: list, fc2: list) -> torch.Tensor:
        if fc1[0].dtype != x.dtype:
            raise ValueError(f"x has dtype {x.dtype} but the expert weights are {fc1[0].dtype}: run the layer in "
                             "the weights' dtype (e.g. under megatron's Float16Module for bf16)")
        if self.backend.name == "cuda":
            return self._experts_cuda(x, topk_idx, topk_weights, fc1, fc2)  # weighted inside (weighting.py)
        out = self._experts_torch(x, topk_idx, fc1, fc2)
        T, k = topk_idx.shape
        return (out.view(T, k, self.hidden_size) * topk_weights.unsqueeze(-1).to(out.dtype)).sum(1)

    def _solve(self, omega: torch.Tensor, token_bytes: int) -> tuple[Plan, torch.Tensor]:
        """Backend torch: (the plan of this call after the net-benefit guard and the capacity step, its statistics
        without planner_ms). The capacity is capacity_factor x the largest rank's rows of this call (read on the
        host: backend torch synchronises anyway)."""
        cap = None
        if self.capacity_factor is not None:
            cap = capacity_rows(max(1, int(omega.sum(1).max())), self.capacity_factor, omega.shape[0])
        plan, outcome, fit_stats = self._guarded_plan(omega, token_bytes, capacity=cap)
        guard_stats = self._guard_stats(outcome, omega.device)[0]
        # slot_skipped, slot_skip_missed: backend cuda's
        no_hint = torch.zeros(2, dtype=torch.float64, device=guard_stats.device)
        fit = self._fit_stats(fit_stats, omega.device)
        return plan, torch.cat([plan_stats(plan, self.t_ffn), guard_stats, no_hint, fit])

    @staticmethod
    def _guard_stats(outcome: GuardOutcome | None, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(float64[GUARD_STATS], wanted bool 0-d) of a call: `GuardOutcome.finish`, zeros and False without a guard."""
        if outcome is None:
            return (torch.zeros(GUARD_STATS, dtype=torch.float64, device=device),
                    torch.zeros((), dtype=torch.bool, device=device))
        return outcome.finish()

    @staticmethod
    def _fit_stats(fit_stats: torch.Tensor | None, device: torch.device) -> torch.Tensor:
        """float64[2] capacity statistics: the step's, or zeros where no capacity step ran."""
        return torch.zeros(2, dtype=torch.float64, device=device) if fit_stats is None else fit_stats

    def _guarded_plan(self, omega: torch.Tensor, token_bytes: int, allow: torch.Tensor | None = None,
                      capacity: int | None = None,
                      planning: bool = True) -> tuple[Plan, GuardOutcome | None, torch.Tensor | None]:
        """(the plan after the net-benefit guard and the capacity step, what the guard decided (`GuardOutcome`: its
        `finish` makes the statistics; None without a guard), float64[2] capacity statistics: rows beyond the
        capacity, the step's moves, None without a capacity step). `allow` False (a bool 0-d tensor) forces the static
        plan and keeps the capacity step off the slots: the host left this call's replica machinery out. `planning`
        False (host; backend cuda, where the slot hint left the replica machinery out, so the static plan runs
        anyway): no planner and no guard run, only the pre-plan bound, whose verdict stands in for the guard's
        decision (`wanted`: the hint brings the machinery back `skip_lag` calls after the bound says a plan may pay;
        the guard then decides in full). On one NVLink domain a topoep_plus layer plans no local candidate: there
        topoep_plus_local's plan is topoep_plus's (`_plus_policies`)."""
        N = self.num_slots
        guarded = self.guard is not None and self.policy != "static" and N > 0
        worth = None
        if guarded:  # no plan can pay on routing this even: leave planning out (guard.py)
            n = self.guard.exposed_transfers
            n = self.backend.exposed_replica_transfers if n is None else n
            main_rank = default_main_rank(self.num_experts, self.topology.num_ranks, omega.device)
            worth = self.guard.worth_planning(omega, self.topology, main_rank, self.t_ffn, self.expert_bytes, n)
        kw = dict(num_slots=N, expert_bytes=self.expert_bytes, token_bytes=token_bytes, t_ffn=self.t_ffn,
                  grid_blocks=self.config.planner_blocks, enable=worth, plan_domain=self.config.plan_domain)
        if guarded and not planning:
            return self._unplanned(omega, worth, kw, allow, capacity)
        candidates, spread_run = (), None
        names = self._plus_policies() if guarded and self.policy == "topoep_plus" else (self.policy,)
        # the candidates' kinds by index: topoep_plus's own (0), its local plan (1, on more than one domain), then the
        # gated ones: the peers', the spread plans
        first_gated = next((i for i, name in enumerate(names) if name in SPREAD_POLICIES + PEER_CANDIDATES), len(names))
        first_spread = next((i for i, name in enumerate(names) if name in SPREAD_POLICIES), len(names))
        gate = self._spread_gate if first_gated < len(names) else None
        if first_gated < len(names):  # every plan at once, the gated planners behind the spread gate
            spread_run = worth if gate is None else gate.enable(worth)
            kws = [kw] * first_gated + [{**kw, "enable": spread_run}] * (len(names) - first_gated)
            plan, *candidates = plan_concurrently(omega, self.topology, names, kws)
        elif len(names) > 1:  # topoep_plus and its local plan at once; the guard keeps the best
            plan, *candidates = plan_concurrently(omega, self.topology, names, kw)
        else:
            plan = solve(omega, self.topology, policy=self.policy, **kw)
        outcome = None
        if guarded:
            plan, fired, saved, cost = self.guard.select(plan, self.t_ffn, n, allow, candidates=tuple(candidates),
                                                         planned=worth)
            outcome = GuardOutcome(worth, fired, saved, cost, plan.info["guard_choice"], spread_run, gate,
                                   names.index("topoep_plus_local") if "topoep_plus_local" in names else -1,
                                   first_gated, first_spread)
        plan, fit_stats = self._fit(plan, capacity, allow)
        return plan, outcome, fit_stats

    def _plus_policies(self) -> tuple[str, ...]:
        """`plus_policies` of this layer's topology and options."""
        return plus_policies(self.topology, peers=self.config.plus_peers, spread=self.config.plus_spread,
                             tree=bool(self.config.relay_fanout), plan_domain=self.config.plan_domain)

    def _unplanned(self, omega: torch.Tensor, worth: torch.Tensor, kw: dict, allow: torch.Tensor | None,
                   capacity: int | None) -> tuple[Plan, GuardOutcome, torch.Tensor | None]:
        """`_guarded_plan` of a call that plans nothing: the static plan (then the capacity step, without new slots
        where `allow` is False), the guard's statistics as fired with nothing priced, wanted = the bound's verdict."""
        plan = solve(omega, self.topology, policy="static", num_slots=kw["num_slots"], expert_bytes=kw["expert_bytes"],
                     token_bytes=kw["token_bytes"])
        plan.info["guard_choice"] = torch.zeros((), dtype=torch.int64, device=omega.device)
        if self.guard.relay_fanout is not None:
            plan.info["relay"] = torch.zeros((), dtype=torch.bool, device=omega.device)
        plan, fit_stats = self._fit(plan, capacity, allow)
        return plan, GuardOutcome(worth, unplanned=True), fit_stats

    def _fit(self, plan: Plan, capacity: int | None,
             allow: torch.Tensor | None) -> tuple[Plan, torch.Tensor | None]:
        """The capacity step on the GPU (no host synchronisation) or on the CPU; (plan, float64[2] statistics). The
        guard's choice of fetch (info["relay"]) holds for the fitted plan. No capacity: the plan as it is, None."""
        if capacity is None:
            return plan, None
        relay = plan.info.get("relay")
        plan, stats = self._fit_capacity(plan, capacity, allow)
        plan.info.pop("relay_trees", None)  # the guard's trees are the unfitted plan's
        if relay is not None:
            plan.info["relay"] = relay
        return plan, stats

    def _fit_capacity(self, plan: Plan, capacity: int, allow: torch.Tensor | None) -> tuple[Plan, torch.Tensor]:
        if plan.route.is_cuda:
            from topoep.planners.cuda import fit_capacity_cuda

            plan = fit_capacity_cuda(plan, capacity, allow_new=True if allow is None else allow)
            info = plan.info["capacity"]["device"]  # (no list index: a host tensor would be copied in a capture)
            return plan, torch.stack([info[1], info[0]]).to(torch.float64)
        plan = fit_capacity(plan, capacity, allow_new=True if allow is None else bool(allow))
        info = plan.info["capacity"]
        return plan, torch.tensor([info["overflow"], info["moves"]], dtype=torch.float64)

    def _record(self, plan: Plan, stats: torch.Tensor, planner_ms: float) -> None:
        """Keep the call's plan and statistics for pop_stats / stats_dict: stats is LAYER_STAT_NAMES without
        planner_ms (the plan's STAT_NAMES, the guard's GUARD_STATS: guard_fired .. spread_planned; the
        slot hint's 2: skipped, skipped and wanted; the capacity step's 2), on the device; planner_ms stays on the host
        until it is read (two device operations per call: the sums and the count)."""
        self.last_plan = plan
        capturing = stats.is_cuda and torch.cuda.is_current_stream_capturing()
        # a captured call runs no host code when replayed: no host planning time, and the replays are counted by
        # whoever replays the graph (graphs.graph_layer: count_replay)
        self._last_stats = (stats, 0.0 if capturing else planner_ms)
        if self._stats_sum is None:  # the sums and the number of calls, in place: a captured call adds to them too
            self._stats_sum = torch.zeros(stats.numel() + 1, dtype=stats.dtype, device=stats.device)
        self._stats_sum[:-1].add_(stats)
        self._stats_sum[-1:].add_(1.0)
        if not capturing:
            self._planner_ms_sum += planner_ms
            self._stats_calls += 1

    def count_replay(self) -> None:
        """One more call, replayed from a CUDA graph the caller captured (graphs.graph_layer calls it): its statistics
        were added on the device by the replay; the host counts the call, with no host planning time."""
        self._stats_calls += 1

    @staticmethod
    def _with_planner_ms(stats: torch.Tensor, planner_ms: float) -> torch.Tensor:
        n = len(STAT_NAMES)
        return torch.cat([stats[:n], torch.full((1,), planner_ms, dtype=stats.dtype, device=stats.device), stats[n:]])

    @property
    def stats(self) -> torch.Tensor | None:
        """The last call's statistics, float64[len(LAYER_STAT_NAMES)] on the device (None before the first call)."""
        return None if self._last_stats is None else self._with_planner_ms(*self._last_stats)

    def _experts_torch(self, x, topk_idx, fc1, fc2) -> torch.Tensor:
        """Backend torch: [T * k, H] expert outputs per assignment (torch_function.py)."""
        T, k = topk_idx.shape
        R, E, N = self.topology.num_ranks, self.num_experts, self.num_slots
        be, tm = self.backend, self.timer
        if self.pool.fc1.dtype != x.dtype or self.pool.fc1.device != x.device:
            # the model was cast or moved after construction (e.g. megatron's Float16Module): the slots follow it,
            # before planning (the plan prices the replicas at the slots' dtype); the old pool goes with its last layer
            self.pool = ReplicaPool.shared(N, self.hidden_size, self.ffn_hidden_size, x.dtype, x.device)
        with phase(tm, "plan", collective=True):
            omega = be.all_gather_counts(count_keys(topk_idx, E))
            t0 = time.perf_counter()
            plan, stats = self._solve(omega, self.hidden_size * x.element_size())
            self._record(plan, stats, 1e3 * (time.perf_counter() - t0))
        with phase(tm, "dispatch_combine", collective=True):
            inst = assignment_instances(topk_idx, plan, self.rank)
            G = self.experts_per_rank + N
            chunks = chunk_layouts(plan.instance_rank[inst], local_group(inst, plan), T, k, R, G, self.num_chunks)
            for ch in chunks:
                ch.set_received(be.exchange_counts(ch.send_group_counts))
            if be.host_splits:
                copy_splits_to_host(chunks)  # one device-to-host copy for every collective and GEMM below
        call = LayerCall(plan=plan, chunks=chunks, backend=be, pool=self.pool, num_tokens=T, top_k=k, timer=tm,
                         relay_fanout=self.config.relay_fanout, relay_chunks=self.config.relay_chunks,
                         relay_schedule=self.config.relay_schedule)
        return ExpertParallelFunction.apply(x, call, *fc1, *fc2)

    def _experts_cuda(self, x, topk_idx, topk_weights, fc1, fc2) -> torch.Tensor:
        """Backend cuda: y [T, H], the expert outputs weighted and summed, with no host synchronisation
        (cuda_function.py); the metadata (counts, plan, guard, statistics, receive layout) is one CUDA graph
        replay (cuda_meta.py)."""
        T, k = topk_idx.shape
        N, E_loc = self.num_slots, self.experts_per_rank
        be, tm = self.backend, self.timer
        cpu_harness = getattr(be, "transport", None) in GLOO_HARNESS
        if x.is_cuda == cpu_harness or x.dtype != torch.bfloat16:
            where = "on the CPU (transport 'gloo')" if cpu_harness else "on a GPU"
            raise ValueError(f"backend 'cuda' runs bf16 tensors {where}, got x {x.dtype} on {x.device}")
        ws = self.workspace = be.workspace(T, k, self.num_experts, N, self.hidden_size, x.dtype, x.device,
                                           chunks=self.num_chunks, capacity_factor=self.capacity_factor,
                                           deepep_deterministic=self.config.deepep_deterministic)
        # static uses a slot only for the capacity, and neither does a call whose guard will fire (slot_hint): no
        # fetch, no slot GEMMs, no gradient return
        use_slots = self._uses_slots and (self.slot_hint is None or self.slot_hint.allow(x.device))
        pool = (be.replica_pool(N, self.hidden_size, self.ffn_hidden_size, x.dtype, x.device, banks=2 if self.config.prefetch else 1)
                if use_slots else None)
        if pool is not None:
            self.pool = pool
        token_bytes = self.hidden_size * x.element_size()
        with phase(tm, "plan", collective=True):  # with backend cuda: plan and receive layout
            t0 = time.perf_counter()
            # a call whose replica machinery the host left out plans nothing (`_guarded_plan`'s `planning`)
            planning = self.slot_hint is None or use_slots
            omega, slot_expert, route, stats, wanted, relay, *layout = self._meta_graphs(
                lambda idx, allow: self._cuda_metadata(ws, idx, allow, token_bytes, planning), topk_idx,
                device_flag(use_slots, x.device), variant=planning)
            if self.slot_hint is not None:
                self.slot_hint.record(wanted)
            main_rank = default_main_rank(self.num_experts, self.topology.num_ranks, omega.device)
            plan = Plan(omega=omega, topology=self.topology, num_slots=N, main_rank=main_rank, slot_expert=slot_expert,
                        route=route, policy=self.policy, expert_bytes=self.expert_bytes, token_bytes=token_bytes)
            self._record(plan, stats, 1e3 * (time.perf_counter() - t0))
        deepep = getattr(ws, "deepep", False)
        chunks = [] if deepep else [CudaChunk(*layout[i:i + 9], spill=SpillWork(*layout[i + 9:i + LAYOUT]))
                                    for i in range(0, len(layout), LAYOUT)]
        for c, ch in enumerate(chunks):  # regions fixed by the workspace, so that every rank agrees on them
            ch.base, ch.cap = sum(ws.regions[:c]), ws.regions[c]
        if len(chunks) == 2:
            chunks[1].first = ((T + 1) // 2) * k
        fanout = self.config.relay_fanout
        call = CudaLayerCall(plan=plan, workspace=ws, pool=pool, chunks=chunks, num_tokens=T, top_k=k,
                             experts_per_rank=E_loc, timer=tm, grad=torch.is_grad_enabled(),
                             combine_side_stream=self.config.combine_side_stream,
                             fetch_overlap=self.config.fetch_overlap,
                             relay=RelayTrees(relay[0], relay[1], max_level(self.topology, fanout),
                                              self.config.relay_chunks, self.config.relay_schedule,
                                              fanout) if fanout else None)
        if deepep:  # transport deepep: DeepEP's dispatch and combine (deepep.py)
            call.deepep_ids = layout[0]
            return DeepEPExpertParallelFunction.apply(x, topk_weights, call, *fc1, *fc2)
        return CudaExpertParallelFunction.apply(x, topk_weights, call, *fc1, *fc2)

    def _cuda_metadata(self, ws, topk_idx: torch.Tensor, allow: torch.Tensor, token_bytes: int,
                       planning: bool = True) -> tuple:
        """Counts -> omega -> plan (guarded; static unless `allow`) -> statistics -> receive layout, as tensors
        (graph-capturable): (omega, slot_expert, route, stats, wanted, relay, then per chunk order, dest, pos, is_slot,
        offs_main, offs_slot, n_main, n_slot, inv and the SpillWork's fields), wanted: the guard's own decision (False
        without a guard); relay: the plan's relay trees with LayerConfig.relay_fanout (int64[2, R, N]: topoep.relay.executed_sources' source and
        level, the direct fetch where the guard found it faster; empty without); the grouped-GEMM offsets and row
        counts are made here once for forward and backward."""
        E = self.num_experts
        # on a GPU the values are checked there (_validate leaves them to the device)
        counts = layout_triton.checked_counts(topk_idx, E) if topk_idx.is_cuda else count_keys(topk_idx, E)
        omega = ws.all_gather(counts, 0)
        cap = None
        if self.capacity_factor is not None:
            cap = capacity_rows(ws.a_cap, self.capacity_factor, omega.shape[0])
        plan, outcome, fit_stats = self._guarded_plan(omega, token_bytes, allow, cap, planning)
        # the statistics, the guard's own decision (wanted) and the spread gate's update do not feed the plan: on a GPU
        # they run on a side stream beside the layout, into buffers of this stream (so the allocator needs no
        # record_stream), and the streams join before the metadata ends
        stats = torch.empty(len(LAYER_STAT_NAMES) - 1, dtype=torch.float64, device=omega.device)
        wanted = torch.empty((), dtype=torch.bool, device=omega.device)
        plan.instance_expert, plan.instance_rank  # noqa: B018 - cached on this stream: the layout reads them
        main = side = None
        if omega.is_cuda:
            main, side = torch.cuda.current_stream(omega.device), side_stream(omega.device)
            side.wait_stream(main)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            guard_stats, wanted_ = self._guard_stats(outcome, omega.device)
            fit = self._fit_stats(fit_stats, omega.device)
            if cap is not None:  # the slots are needed again when the capacity step placed a replica, or would have
                # placed one but for the slot hint (rows spilled while the slots were left out)
                wanted_ = wanted_ | (plan.slot_expert >= 0).any() | ((fit[0] > 0) & ~allow)
            wanted.copy_(wanted_)
            # the slot hint's: this call's replica machinery left out (the host's flag `allow` False), and the guard
            # wanting the balanced plan all the same
            skipped = ((~allow).to(torch.float64) if self.slot_hint is not None else
                       torch.zeros((), dtype=torch.float64, device=omega.device))
            hint = torch.stack([skipped, skipped * guard_stats[3]])
            # a copy of the plan, so that what plan_stats caches (made on the side stream) never reaches the main stream
            stats.copy_(torch.cat([stats_triton.stats(copy.copy(plan), self.t_ffn), guard_stats, hint, fit]))
        T = topk_idx.shape[0]
        if getattr(ws, "deepep", False):  # transport deepep: each assignment's DeepEP expert id is its whole layout
            layouts = (deepep_expert_ids(topk_idx, plan, self.rank),)
        elif len(ws.regions) == 1:
            layouts = self._cuda_layout(topk_idx, plan, ws.regions[0], in_place=getattr(ws, "in_place", False))
        else:  # two chunks of tokens (cuda_function.py): the route row split at the boundary, one all-gather
            T1 = (T + 1) // 2
            inst_expert = plan.instance_expert
            first = chunk_route_row(plan.route[self.rank], inst_expert, count_keys(topk_idx[:T1], E))
            route1 = ws.all_gather(first, 1)
            layouts, prev = (), None
            for c, (rows, route) in enumerate(((topk_idx[:T1], route1), (topk_idx[T1:], plan.route - route1))):
                omega_c = torch.zeros_like(plan.omega).index_add_(1, inst_expert.clamp(min=0), route)
                layouts += self._cuda_layout(rows, dataclasses.replace(plan, route=route, omega=omega_c),
                                             ws.regions[c], prev)
                prev = route1.sum(1)  # every source's rows in chunk 0: where its chunk-1 rows are staged
        if side is not None:
            main.wait_stream(side)
        fanout = self.config.relay_fanout
        relay = plan.slot_expert.new_empty(0)
        if fanout:  # the guard kernel's trees where no capacity step changed the plan after it
            relay = plan.info.get("relay_trees")
            if relay is None:  # one kernel on the GPU (guard_cuda), the reference elsewhere
                trees = guard_cuda.executed_sources if plan.slot_expert.is_cuda else executed_sources
                relay = torch.stack(trees(plan, fanout))
        return (plan.omega, plan.slot_expert, plan.route, stats, wanted, relay, *layouts)

    def _cuda_layout(self, topk_idx: torch.Tensor, plan: Plan, region_rows: int, prev: torch.Tensor | None = None,
                     in_place: bool = False) -> tuple:
        """(order, dest, pos, is_slot, offs_main, offs_slot, n_main, n_slot, inv, then the SpillWork's fields) of these
        assignments under a plan whose route is theirs, received into regions of region_rows rows: the grouped
        GEMMs' offsets and row counts stop at the region's end, the rest spills (spill.spill_work; prev: each
        source's rows in earlier chunks). inv (with `in_place`, one chunk; else empty): for each assignment of this
        rank that stays here, its row in the region (+ region_rows for a slot's), -1 for the others: where the
        weighting reads it in place (weighting.py's `local`)."""
        E_loc = self.experts_per_rank
        inv = topk_idx.new_empty(0)
        if topk_idx.is_cuda:  # three Triton kernels instead of about 110 small torch ones (inv and offsets too)
            C = group_counts(plan)  # from the plan's route: no exchange
            key, order, dest, pos, is_slot, *rest = layout_triton.fused_layout(
                topk_idx, plan, self.rank, C, region_rows if in_place else None, offsets_rows=region_rows)
            inv = rest[0] if in_place else inv
            offs_main, offs_slot, n_main, n_slot = rest[-4:]
        else:
            C, key, order = send_layout(topk_idx, plan, self.rank)
            dest, pos, is_slot = receive_positions(C, key, self.rank, E_loc)
            if in_place:
                inv = own_rows(order, dest, pos, is_slot, self.rank, region_rows)
            sizes = received_sizes(C, self.rank, E_loc)
            offs_main, offs_slot = (torch.cumsum(s, 0).clamp(max=region_rows).to(torch.int32) for s in sizes)
            n_main, n_slot = (s.sum().clamp(max=region_rows).view(1) for s in sizes)
        work = (spill_work_triton if C.is_cuda else spill_work)(C, self.rank, E_loc, region_rows, prev)  # 1 kernel
        return (order, dest, pos, is_slot, offs_main, offs_slot, n_main, n_slot, inv,
                *(getattr(work, f.name) for f in dataclasses.fields(SpillWork)))

    def pop_stats(self) -> tuple[torch.Tensor | None, int]:
        """(mean statistics over the calls since the last pop, on the device; number of calls), then
        reset. A trainer calls it once per step to log every micro-batch's plans without a sync per layer.
        The mean of "guard_fired" is the fraction of calls in which the guard fired (times calls: how often)."""
        calls = self._stats_calls
        out = None
        if calls:  # the device's own count of the calls divides the device sums (replays included)
            acc = self._stats_sum
            out = self._with_planner_ms(acc[:-1] / acc[-1:].clamp(min=1), self._planner_ms_sum / calls)
            acc.zero_()  # in place: a captured call keeps adding to this buffer
        self._planner_ms_sum, self._stats_calls = 0.0, 0
        return out, calls

    def stats_dict(self) -> dict[str, float]:
        """The last call's statistics as Python floats (synchronises: call it every N steps)."""
        return dict(zip(LAYER_STAT_NAMES, self.stats.tolist())) if self.stats is not None else {}
