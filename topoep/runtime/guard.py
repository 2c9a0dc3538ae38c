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

No host synchronisation: the decision is a 0-d bool device tensor and the executed plan's tensors are
`torch.where(use_balanced, balanced, static)` (both plans have the same shapes), so the guard stays
CUDA-graph friendly. The decision is a deterministic function of omega (the same on every rank) and
of constants, never of measured times: every rank must execute the same plan.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from topoep.plan import Plan
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

    def select(self, plan: Plan, t_ffn: float, exposed_transfers: int):
        """(executed plan, fired bool 0-d, T_saved float64 0-d, T_plan + T_transfer float64 0-d).

        `plan` is the balanced plan; `fired` is True when the static plan is executed instead."""
        E = plan.num_experts
        static_load = static_rank_load(plan.omega, plan.main_rank, plan.num_ranks)
        saved = t_ffn * (static_load.max() - plan.rank_load.max()).to(torch.float64)
        cost = self.plan_s + self.transfer_time(plan, exposed_transfers)
        use = saved > cost
        static_route = torch.zeros_like(plan.route)
        static_route[:, :E] = plan.omega
        executed = Plan(omega=plan.omega, topology=plan.topology, num_slots=plan.num_slots, main_rank=plan.main_rank,
                        slot_expert=torch.where(use, plan.slot_expert, torch.full_like(plan.slot_expert, -1)),
                        route=torch.where(use, plan.route, static_route), policy=plan.policy,
                        expert_bytes=plan.expert_bytes, token_bytes=plan.token_bytes, info=dict(plan.info))
        return executed, ~use, saved, cost
