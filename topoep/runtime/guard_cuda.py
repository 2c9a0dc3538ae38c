"""The net-benefit guard's selection and the relay trees on the GPU (csrc/guard.cu), bit for bit the references:
`NetBenefitGuard.select` with token rows per assignment (topoep/runtime/guard.py) and `topoep.relay.executed_sources`.

The reference is a few hundred small torch operations per layer call; the kernel is two launches, which with relay
trees also write the executed plan's trees (the separate `executed_sources` kernel is for a plan the capacity step
changed after the guard)
(results/guard_latency.md has both). Link times are exact integers (femtoseconds) and the float64 steps follow the
reference's order, so the executed plan, the kept candidate and the fetch choice are the reference's bit for bit on
every input (tests/test_guard_cuda_gpu.py). No host synchronisation; CUDA-graph capturable (the ops have fake
implementations, topoep/planners/cuda.py).
"""

from __future__ import annotations

import torch

from topoep.plan import Plan
from topoep.relay import max_level

MAX_PLANS = 6  # csrc/planner.h kMaxGuardPlans
MAX_LEVELS = 128  # csrc/planner.h kMaxRelayLevels
MAX_CHUNKS = 64  # csrc/planner.h kMaxRelayChunks
MAX_TOKEN_CHUNKS = 64  # csrc/planner.h kMaxTokenChunks: NetBenefitGuard.token_chunks


def usable(guard, plans: tuple[Plan, ...]) -> bool:
    """Whether the kernel computes `guard.select` of these plans: CUDA plans, token rows per assignment (the
    deduplicated estimate, `token_top_k`, is float and stays on the reference), at most MAX_PLANS plans and
    MAX_LEVELS relay levels of at most MAX_CHUNKS chunks (level by level, or copy by copy: relay_schedule). A
    host-side check of shapes and constants only."""
    plan = plans[0]
    if not plan.route.is_cuda or guard.token_top_k is not None or len(plans) > MAX_PLANS:
        return False
    return guard.relay_fanout is None or (max_level(plan.topology, guard.relay_fanout) <= MAX_LEVELS
                                          and guard.relay_chunks <= MAX_CHUNKS)


def select(guard, plans: tuple[Plan, ...], t_ffn: float, exposed_transfers: int, allow: torch.Tensor | None,
           planned: torch.Tensor | None = None):
    """(slot_expert int64[R, N], route int64[R, E + R N] of the executed plan, choice int64 0-d, fired bool 0-d (the
    static plan runs), relay bool 0-d, T_saved float64 0-d, T_plan + T_transfer float64 0-d, trees) of the kept plan:
    what `NetBenefitGuard.select` computes, on the plans' device. trees: with relay trees (guard.relay_fanout), the
    executed plan's int64[2, R, N] (`topoep.relay.executed_sources`: source, level), computed in the same two
    launches (the guard prices every plan's trees anyway); None without."""
    from topoep.planners.cuda import load_extension

    load_extension()
    plan = plans[0]
    dev = plan.route.device
    topo = guard._cost_topology(plan.topology).on(dev)
    R = plan.num_ranks
    fanout = guard.relay_fanout or 0
    levels = max_level(plan.topology, fanout) if fanout else 0
    ops = torch.ops.topoep
    ws = _workspace(ops, dev, len(plans), R, levels)
    route, slot = torch.empty_like(plan.route), torch.empty_like(plan.slot_expert)
    choice = torch.empty((), dtype=torch.int64, device=dev)
    use, fired, relay = (torch.empty((), dtype=torch.bool, device=dev) for _ in range(3))
    saved, cost = (torch.empty((), dtype=torch.float64, device=dev) for _ in range(2))
    trees = torch.empty(len(plans) + 1, 2, R, plan.num_slots, dtype=torch.int64, device=dev) if fanout else None
    ops.guard_select(plan.omega, plan.main_rank.to(dev), topo.cost_fs, [p.route for p in plans],
                     [p.slot_expert for p in plans], plan.topology.ranks_per_domain, int(plan.token_bytes),
                     int(plan.expert_bytes), float(t_ffn), guard.token_transfers, float(guard.token_overlap),
                     int(guard.token_chunks or 0), float(guard.plan_s), float(guard.transfer_latency_s), int(exposed_transfers), fanout, levels,
                     guard.relay_chunks if fanout else 1, bool(guard.relay_share),
                     bool(fanout) and guard.relay_schedule == "async", bool(guard.fetch_overlap),
                     allow, planned, route, slot, choice, use, fired, relay, saved, cost, ws, trees)
    return slot, route, choice, fired, relay, saved, cost, None if trees is None else trees[0]


_workspaces: dict = {}


def _workspace(ops, device: torch.device, P: int, R: int, levels: int) -> torch.Tensor:
    """The kernel's accumulators, zero between calls (its last block zeroes them again): made once per (device, plans,
    ranks, levels) and kept, so a call costs no memset. Calls that share one must be ordered (one stream, as the
    layers' metadata runs). Made during a CUDA-graph capture it belongs to that graph (its zeroing is captured with it)
    and is not kept."""
    key = (device, P, R, levels)
    ws = _workspaces.get(key)
    if ws is None:
        ws = torch.zeros(ops.guard_workspace_elems(P, R, levels), dtype=torch.int64, device=device)
        if not torch.cuda.is_current_stream_capturing():
            _workspaces[key] = ws
    return ws


def executed_sources(plan: Plan, fanout: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`topoep.relay.executed_sources(plan, fanout)` of a CUDA plan, by one kernel."""
    from topoep.planners.cuda import load_extension

    load_extension()
    source, level = torch.empty_like(plan.slot_expert), torch.empty_like(plan.slot_expert)
    torch.ops.topoep.relay_trees(plan.slot_expert, plan.main_rank.to(plan.slot_expert.device),
                                 plan.topology.ranks_per_domain, int(fanout), plan.info.get("relay"), source, level)
    return source, level
