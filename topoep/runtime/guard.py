"""Net-benefit guard (paper eq. 2): execute the balanced plan only when it pays for itself.

Balancing saves expert compute on the straggler rank and costs planning and replica transfers. Per
layer call the guard predicts, from the balanced plan and the routing counts alone,

    T_saved    = t_ffn * (L_max(static) - L_max(balanced))      straggler expert time saved (fwd + bwd)
    T_plan     = plan_s                                         planning estimate (a constant)
    T_transfer = n * (max over ranks of sum of W * c[main(e), r] over the replicas the rank
                      receives (r) or sends (main(e))  +  transfer_latency_s)   (0 without replicas)

with n the replica transfers the critical path waits for, W = expert_bytes and c the topology's
seconds per byte (or 1 / bytes_per_s). Transfers of different ranks run in parallel, so the busiest
rank's bytes set the time. The balanced plan is used iff T_saved > T_plan + T_transfer; otherwise the
call executes the static plan (no replicas: every assignment on its expert's main rank). T_plan counts
as in eq. 2 although the plan exists by the time the guard decides: it is the margin balancing must
clear to pay on such routing (and a later version may skip planning on its strength).

Backend cuda also skips the replica machinery of a call whose guard will fire (`skip_lag`, `SlotSkipHint`):
with the decision on the device, the host still launches the slot fetch, the slot GEMMs and the gradient
return, which then move nothing but cost their launches and barriers (a few % of a layer at 4096 tokens per
rank). The host cannot know this call's decision without a sync, so it uses the decision of the same layer
`skip_lag` calls earlier, made on the same all-gathered counts on every rank: every rank takes the same
branch. When it skips, this call's plan is forced static on the device (the model's math is unchanged), and
the guard's own decision on the balanced plan is recorded for the calls after.

No host synchronisation: the decision is a 0-d bool device tensor and the executed plan's tensors are
`torch.where(use_balanced, balanced, static)` (both plans have the same shapes), so the guard stays
CUDA-graph friendly. The decision is a deterministic function of omega (the same on every rank) and
of constants, never of measured times: every rank must execute the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from topoep.plan import Plan, static_route
from topoep.planners.common import static_rank_load


@dataclass(frozen=True, kw_only=True)
class NetBenefitGuard:
    """Constants of the guard's cost prediction (module docstring). Defaults model one H200/H800 node."""

    plan_s: float = 1e-4
    """T_plan, seconds: the planner's latency. 100 us: the CUDA planner measured on an H200 at EP 8-128,
    E 64-640 took 43-61 us for a whole eager call and 28-47 us on the GPU (results/planner_latency.md)."""
    transfer_latency_s: float = 2e-5
    """Seconds added per exposed replica transfer when the plan has a replica: a collective's launch and
    synchronisation (about 20 us for a small NCCL all-to-all inside a node)."""
    bytes_per_s: float | None = None
    """Replica-transfer bandwidth of one rank (bytes/s). None: the topology's per-byte costs, the
    planner's own model (eq. 7; by default NVLink 200 GB/s and RDMA 50 GB/s per direction)."""
    exposed_transfers: int | None = None
    """Replica transfers per layer call (forward + backward) that the critical path waits for. None:
    the backend's `exposed_replica_transfers` (backend torch: 3, the forward fetch, the backward reload
    and the gradient return are blocking collectives; the paper's pipeline (3.3) exposes only the
    forward fetch: 1)."""

    skip_lag: int | None = 2
    """Backend cuda: leave out the replica machinery of a call when the guard did not want replicas in the
    call of the same layer `skip_lag` calls earlier (module docstring; `SlotSkipHint`). None: never."""

    def __post_init__(self):
        for name in ("plan_s", "transfer_latency_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")):
                raise ValueError(f"NetBenefitGuard.{name} must be a finite number of seconds >= 0, got {v!r}")
        b = self.bytes_per_s
        if b is not None and not (isinstance(b, (int, float)) and not isinstance(b, bool) and 0 < b < float("inf")):
            raise ValueError(f"NetBenefitGuard.bytes_per_s must be a positive number of bytes/s or None (the "
                             f"topology's costs), got {b!r}")
        n = self.exposed_transfers
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
            raise ValueError(f"NetBenefitGuard.exposed_transfers must be an integer >= 0 or None (the backend's), "
                             f"got {n!r}")

        lag = self.skip_lag
        if lag is not None and (not isinstance(lag, int) or isinstance(lag, bool) or lag < 1):
            raise ValueError(f"NetBenefitGuard.skip_lag must be an integer >= 1 (calls) or None (never skip the "
                             f"replica machinery), got {lag!r}")

    @staticmethod
    def build(guard) -> "NetBenefitGuard | None":
        """The layer's `guard` argument: True (default constants), False/None (off) or a NetBenefitGuard."""
        if isinstance(guard, NetBenefitGuard):
            return guard
        if guard is True:
            return NetBenefitGuard()
        if guard is False or guard is None:
            return None
        raise ValueError(f"guard must be True, False or a topoep.runtime.NetBenefitGuard, got {guard!r}")

    def transfer_time(self, plan: Plan, exposed_transfers: int) -> torch.Tensor:
        """float64 0-d: T_transfer of `plan` (seconds) on the plan's device."""
        dev = plan.omega.device
        E = plan.num_experts
        R = plan.num_ranks
        se = plan.slot_expert.reshape(-1)
        occupied = se >= 0
        dst = plan.instance_rank[E:]  # rank of each slot
        src = plan.main_rank[se.clamp(min=0)]  # main rank of each slot's expert
        if self.bytes_per_s is None:
            per_byte = plan.topology.on(dev).cost[src, dst]
        else:
            per_byte = torch.full_like(dst, 1.0 / self.bytes_per_s, dtype=torch.float64)
        t = float(plan.expert_bytes) * per_byte * occupied
        zero = torch.zeros(R, dtype=torch.float64, device=dev)
        busiest = torch.maximum(zero.index_add(0, dst, t).max(), zero.index_add(0, src, t).max())
        return exposed_transfers * (busiest + self.transfer_latency_s * occupied.any().to(torch.float64))

    def select(self, plan: Plan, t_ffn: float, exposed_transfers: int, allow: torch.Tensor | None = None):
        """(executed plan, fired bool 0-d, T_saved float64 0-d, T_plan + T_transfer float64 0-d).

        `plan` is the balanced plan; `fired` is True when the static plan is executed instead. `allow`
        (bool 0-d, optional): False forces the static plan (the host left out the replica machinery);
        `T_saved > T_plan + T_transfer` is the guard's own decision either way."""
        static_load = static_rank_load(plan.omega, plan.main_rank, plan.num_ranks)
        saved = t_ffn * (static_load.max() - plan.rank_load.max()).to(torch.float64)
        cost = self.plan_s + self.transfer_time(plan, exposed_transfers)
        use = saved > cost
        if allow is not None:
            use = use & allow
        executed = Plan(omega=plan.omega, topology=plan.topology, num_slots=plan.num_slots, main_rank=plan.main_rank,
                        slot_expert=torch.where(use, plan.slot_expert, torch.full_like(plan.slot_expert, -1)),
                        route=torch.where(use, plan.route, static_route(plan.omega, plan.num_slots)), policy=plan.policy,
                        expert_bytes=plan.expert_bytes, token_bytes=plan.token_bytes, info=dict(plan.info))
        return executed, ~use, saved, cost


class SlotSkipHint:
    """The host's memory of one layer's guard decisions (module docstring), for backend cuda.

    `allow()` says whether this call launches the replica machinery: True for the first `lag` calls, during
    CUDA-graph capture (a captured branch must serve every replay), and whenever the guard wanted replicas
    `lag` calls earlier. `record(wanted)` keeps this call's decision (a bool 0-d device tensor) by an
    asynchronous copy into pinned host memory. The copy of the call `lag` calls back has long finished when
    the next call reads it (the GPU would have to be `lag` whole layer calls behind the host); if it has not,
    the host waits for it (counted in `waits`) rather than guess: every rank must take the same branch.

    A recomputed forward (activation checkpointing) is one more call: it may take the other branch than the
    original forward. Megatron's reentrant recompute is fine with that (same math); torch.utils.checkpoint's
    non-reentrant mode checks that the recomputation saves the same tensors, so use skip_lag=None with it."""

    def __init__(self, lag: int):
        self.lag = lag
        self._host: list[torch.Tensor | None] = [None] * lag
        self._done: list[torch.cuda.Event | None] = [None] * lag
        self.calls = 0  # recorded calls
        self.skipped = 0  # calls that left the replica machinery out
        self.waits = 0  # reads that had to wait for the decision's copy

    def allow(self, device: torch.device) -> bool:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return True
        if self.calls < self.lag:
            return True
        i = self.calls % self.lag  # the slot of call (this call - lag)
        ev = self._done[i]
        if ev is not None and not ev.query():
            self.waits += 1
            ev.synchronize()
        ok = bool(self._host[i].item())  # a host tensor: no device access
        self.skipped += not ok
        return ok

    def record(self, wanted: torch.Tensor) -> None:
        if wanted.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        i = self.calls % self.lag
        if self._host[i] is None:
            self._host[i] = torch.empty((), dtype=torch.bool, pin_memory=wanted.is_cuda)
        self._host[i].copy_(wanted, non_blocking=wanted.is_cuda)
        if wanted.is_cuda:
            ev = self._done[i] = self._done[i] or torch.cuda.Event()
            ev.record()
        self.calls += 1
