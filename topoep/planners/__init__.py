"""`topoep.solve`: one entry point for every policy (DESIGN.md section 4)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from topoep.plan import Plan, default_main_rank
from topoep.topology import Topology

# Qwen3-30B-A3B in BF16: an expert is 3 matrices of 2048 x 768; a routed activation is 2048 values.
QWEN3_EXPERT_BYTES = 3 * 2048 * 768 * 2
QWEN3_TOKEN_BYTES = 2048 * 2


def _policies():
    from topoep.planners import baselines, plus, reference, spread

    return {
        "static": reference.solve_static,
        "topoep": reference.solve_topoep,
        "topoep_plus": plus.solve_topoep_plus,
        "topoep_plus_local": functools.partial(plus.solve_topoep_plus, inter_domain=False),
        "topoep_plus_spread": spread.solve_topoep_plus_spread,
        "topoep_plus_spread_tree": functools.partial(spread.solve_topoep_plus_spread, trees=True),
        "deepseek": baselines.solve_deepseek,
        "fastermoe": baselines.solve_fastermoe,
        "flexmoe": baselines.solve_flexmoe,
        **_REGISTERED,
    }


# Policies the runtime can run per layer and microbatch (ExpertParallelMoE, eplb.policy, the simulator).
POLICIES = ("static", "topoep", "topoep_plus", "topoep_plus_local", "topoep_plus_spread", "topoep_plus_spread_tree",
            "deepseek", "fastermoe", "flexmoe")
# Offline planners: `solve` and bench/plan_quality.py run them, the runtime does not. Their planners live
# outside the library and are bound by `register_policy`: "joint" by `import topoep_research` (seconds per
# plan on the CPU reference at EP 32; its search needs K x R^3 tensors).
OFFLINE_POLICIES = ("joint",)
# Policies whose plans refine inside NVLink domains one move at a time (`solve`'s plan_domain groups them).
REFINED_POLICIES = ("topoep", "topoep_plus", "topoep_plus_local")
# Policies that weigh expert compute against transfers, and so take t_ffn.
T_FFN_POLICIES = ("fastermoe", "joint", "topoep_plus_spread", "topoep_plus_spread_tree")
# The offline policies' planners, name -> fn, as `register_policy` bound them.
_REGISTERED: dict[str, Callable[..., Plan]] = {}


def register_policy(name: str, fn: Callable[..., Plan], *, offline: bool, takes_t_ffn: bool) -> None:
    """Bind the planner `fn` to policy `name` for `solve`. fn(omega, topology, *, num_slots, main_rank,
    expert_bytes, token_bytes[, t_ffn]) gets `validate`d inputs and returns a `Plan`. The name must be one of
    OFFLINE_POLICIES (the tables here decide validation, integer range and the runtime's refusal), so offline
    must be True and takes_t_ffn must say whether it is in T_FFN_POLICIES. Registering a name again rebinds it."""
    if name not in OFFLINE_POLICIES:
        raise ValueError(f"register_policy binds one of OFFLINE_POLICIES ({', '.join(OFFLINE_POLICIES)}), "
                         f"got {name!r}")
    if offline is not True or takes_t_ffn is not (name in T_FFN_POLICIES):
        raise ValueError(f"policy {name!r} is offline=True, takes_t_ffn={name in T_FFN_POLICIES}; "
                         f"got offline={offline!r}, takes_t_ffn={takes_t_ffn!r}")
    if not callable(fn):
        raise ValueError(f"fn must be callable, got {type(fn).__name__}")
    _REGISTERED[name] = fn


BACKENDS = ("auto", "reference", "cuda")


def _checked_t_ffn(t_ffn) -> float:
    """t_ffn, or DEFAULT_T_FFN for None, as a float; ValueError unless it is a finite positive number."""
    from topoep.metrics import DEFAULT_T_FFN

    t = DEFAULT_T_FFN if t_ffn is None else t_ffn
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not (0 < t < math.inf):
        raise ValueError(f"t_ffn must be a finite positive number of seconds of expert time per assignment "
                         f"(forward + backward), got {t!r}; omit it for DEFAULT_T_FFN ({DEFAULT_T_FFN:.3g} s) "
                         "or calibrate it with topoep.metrics.fit_t_ffn")
    return float(t)


@functools.lru_cache(maxsize=64)
def cached_two_level_costs(topology: Topology) -> tuple[int, int, bool]:
    """`common.two_level_costs(topology)`, computed once per topology: the per-call checks of backend "auto"
    and the CUDA planner's topoep_plus costs read it (the cost matrix is on the host; no device work)."""
    from topoep.planners.common import two_level_costs

    return two_level_costs(topology)


def has_cuda_kernel(policy: str, topology: Topology) -> bool:
    """Whether the CUDA planner plans `policy` on this topology (default placement): what backend "auto" uses
    for CUDA omega, and what the runtime may capture in a CUDA graph (the reference synchronises the host)."""
    from topoep.planners.cuda import CUDA_POLICIES

    from topoep.planners.cuda import FLEXMOE_MAX_RANKS, PEER_POLICIES, SPREAD_POLICIES

    if policy in SPREAD_POLICIES:  # its objective is a proxy of the two-level costs on any topology, as the reference's
        return True
    if policy in PEER_POLICIES:  # topology-unaware but for deepseek's domains
        return policy == "deepseek" or topology.num_ranks <= FLEXMOE_MAX_RANKS
    return policy in CUDA_POLICIES and (not policy.startswith("topoep_plus") or cached_two_level_costs(topology)[2])


def solve(omega: torch.Tensor, topology: Topology, *, num_slots: int = 2, policy: str = "topoep",
          expert_bytes: int = QWEN3_EXPERT_BYTES, token_bytes: int = QWEN3_TOKEN_BYTES,
          main_rank: torch.Tensor | None = None, t_ffn: float | None = None, backend: str = "auto",
          capacity: int | None = None, grid_blocks: int = 0, enable: torch.Tensor | None = None,
          move_cost_fs: int | None = None, plan_domain: int | None = None) -> Plan:
    """Plan replicas and the token split for one MoE layer and microbatch.

    Args:
        omega: int64[R, E], omega[s, e] = assignments from source rank s that selected expert e
            (the all-gathered routing counts; every rank passes the same tensor and gets the same plan).
        topology: the EP group's domains and per-byte costs; must have R ranks.
        num_slots: N, replica slots per rank besides its main experts (>= 0).
        policy: one of POLICIES or OFFLINE_POLICIES. "topoep_plus" (topoep.planners.plus) is `topoep`
            with its own-rank-first route and free load moves across domains: never worse in any term
            of eq. 8. "joint" (topoep_research.joint, offline: seconds
            per plan; `import topoep_research` registers it) chooses placement and split together to
            minimise the modelled time t_ffn L_max + T_token + T_replica of eq. 5-8.
        expert_bytes: W, bytes of one expert's parameters as transferred (default: Qwen3-30B-A3B, BF16).
        token_bytes: S_tok, bytes of one routed activation (default: hidden 2048 in BF16).
        main_rank: int64[E], rank owning each expert; default e // (E // R) (megatron's placement).
        t_ffn: seconds of expert FFN time per assignment (forward + backward) for the policies that
            weigh compute against transfers (fastermoe, joint); ignored by the others. Default
            `topoep.metrics.DEFAULT_T_FFN` (Qwen3-30B-A3B expert at 400 TFLOP/s, ~70.8 ns). Calibrate it
            from a measured MoE layer with `topoep.metrics.fit_t_ffn` (expert time of the straggler
            rank against its assignments); for joint it sets the price of one assignment of L_max
            against the bytes moved, so a larger t_ffn buys balance with more traffic.
        backend: "reference" (pure PyTorch, any device), "cuda" (the GPU planner of csrc/: policies
            static, topoep, topoep_plus (on exactly two-level costs), topoep_plus_spread,
            topoep_plus_spread_tree, deepseek and flexmoe (at most 256 ranks), default placement, CUDA
            omega; no host synchronisation, so the values of omega are not checked), or "auto": cuda when
            omega is on a GPU and the policy has a kernel for this input.
        capacity: rows each receive region of a rank may take (`topoep.planners.capacity`: a rank's main experts
            and its replica slots are two regions); the policy's plan then goes through the capacity step, which
            moves rows (to other instances, or to new replicas in free slots) until every region fits, and
            reports what could not fit in info["capacity"]["overflow"]. None (default): no capacity step.
        grid_blocks: the CUDA planner's cooperative grid for this plan: that many blocks (at most one per SM),
            0 (default) for half the SMs (`topoep.planners.cuda.CudaPlanner.plan`). A smaller grid waits less for
            kernels running beside it. The plans do not depend on it; the reference planners ignore it. An integer
            >= 0 (checked on every backend).
        enable: None (plan), or a 0-d bool tensor on omega's device: False returns the static plan without planning
            (`topoep.runtime.NetBenefitGuard.worth_planning` decides it). The CUDA planner reads it on the device (no
            host synchronisation; a CUDA graph replays either case); the reference planners read it on the host.
        move_cost_fs: topoep_plus_spread and topoep_plus_spread_tree only: the greedy stops once no move gains more
            than this (fs; `topoep.planners.spread`, default MOVE_COST_US: the GPU planner's time per move), an
            integer >= 0; None for the default. Both backends.
        plan_domain: the refining policies (REFINED_POLICIES: topoep, topoep_plus, topoep_plus_local) balance inside
            groups of at most this many ranks of each NVLink domain (`Topology.planning_groups`: a large domain's
            refinement costs far more than the groups'), and the plan comes back on `topoep.Topology` `topology`
            (its C4 holds there too: a group's demand is at most its domain's). None (default): whole domains, the
            paper's. The other policies do not refine and ignore it. An integer >= 1 or None.

    Returns:
        a `Plan` on omega's device. Raises ValueError for bad input (for "joint" also when its int64
        femtosecond arithmetic could overflow: `topoep_research.joint.check_fs_range`).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    from topoep.planners.cuda import check_grid_blocks

    check_grid_blocks(grid_blocks, "grid_blocks")
    if move_cost_fs is not None:
        from topoep.planners.cuda import SPREAD_POLICIES

        if policy not in SPREAD_POLICIES:
            raise ValueError(f"move_cost_fs is the spread planners' ({', '.join(SPREAD_POLICIES)}) stopping threshold; "
                             f"policy {policy!r} takes none: pass None")
        from topoep.planners.spread import move_cost_or_default

        move_cost_or_default(move_cost_fs)  # (checked here, before planning on either backend)
    if enable is not None and not (isinstance(enable, torch.Tensor) and enable.dtype == torch.bool
                                   and enable.numel() == 1):
        raise ValueError(f"enable must be None or a 0-d bool tensor (NetBenefitGuard.worth_planning), got {enable!r}")
    if plan_domain is not None and (isinstance(plan_domain, bool) or not isinstance(plan_domain, int)
                                    or plan_domain < 1):
        raise ValueError(f"plan_domain must be an integer >= 1 (ranks per planning group) or None (whole NVLink "
                         f"domains), got {plan_domain!r}")
    if plan_domain is not None and policy in REFINED_POLICIES and isinstance(topology, Topology):
        groups = topology.planning_groups(plan_domain)
        if groups is not topology:  # plan on the groups, return the plan on the real domains
            if capacity is not None:
                from topoep.planners.capacity import check_capacity

                check_capacity(capacity)
            plan = solve(omega, groups, num_slots=num_slots, policy=policy, expert_bytes=expert_bytes,
                         token_bytes=token_bytes, main_rank=main_rank, t_ffn=t_ffn, backend=backend,
                         grid_blocks=grid_blocks, enable=enable)
            plan = on_topology(plan, topology, groups)
            return plan if capacity is None else _fit_capacity(plan, capacity, plan.info.get("backend") == "cuda")
    if backend == "auto":
        use_cuda = (isinstance(omega, torch.Tensor) and omega.is_cuda and main_rank is None
                    and isinstance(topology, Topology) and has_cuda_kernel(policy, topology))
    else:
        use_cuda = backend == "cuda"
    omega, main_rank = validate(omega, topology, num_slots, policy, expert_bytes, token_bytes, main_rank,
                                check_values=not use_cuda)
    if capacity is not None:
        from topoep.planners.capacity import check_capacity

        check_capacity(capacity)
    if use_cuda:
        from topoep.planners.cuda import (CUDA_POLICIES, PEER_POLICIES, SPREAD_POLICIES, solve_cuda, solve_peer_cuda,
                                          solve_spread_cuda)

        if not omega.is_cuda:
            raise ValueError("backend='cuda' needs omega on a CUDA device (omega.cuda())")
        if policy not in CUDA_POLICIES:
            raise ValueError(f"backend='cuda' implements the policies {', '.join(CUDA_POLICIES)}, not {policy!r}; "
                             "use backend='reference'")
        if enable is not None and policy == "static":
            enable = None  # the static plan either way
        if policy in SPREAD_POLICIES:
            plan = solve_spread_cuda(omega, topology, num_slots=num_slots, policy=policy, main_rank=main_rank,
                                     expert_bytes=int(expert_bytes), token_bytes=int(token_bytes),
                                     t_ffn=_checked_t_ffn(t_ffn), enable=enable, move_cost_fs=move_cost_fs)
        elif policy in PEER_POLICIES:
            plan = solve_peer_cuda(omega, topology, num_slots=num_slots, policy=policy, main_rank=main_rank,
                                   expert_bytes=int(expert_bytes), token_bytes=int(token_bytes), enable=enable)
        else:
            plan = solve_cuda(omega, topology, num_slots=num_slots, policy=policy, main_rank=main_rank,
                              expert_bytes=int(expert_bytes), token_bytes=int(token_bytes), grid_blocks=grid_blocks,
                              enable=enable)
        return plan if capacity is None else _fit_capacity(plan, capacity, True)
    kw = {}
    if policy in T_FFN_POLICIES:
        kw["t_ffn"] = _checked_t_ffn(t_ffn)
    if move_cost_fs is not None:
        kw["move_cost_fs"] = move_cost_fs
    if enable is not None and not bool(enable):  # the static plan, under the policy's name (the guard's skip)
        plan = _policies()["static"](omega, topology, num_slots=num_slots, main_rank=main_rank,
                                     expert_bytes=int(expert_bytes), token_bytes=int(token_bytes))
        plan.policy = policy
    else:
        plan = _policies()[policy](omega, topology, num_slots=num_slots, main_rank=main_rank,
                                   expert_bytes=int(expert_bytes), token_bytes=int(token_bytes), **kw)
    return plan if capacity is None else _fit_capacity(plan, capacity, False)


def _fit_capacity(plan: Plan, capacity: int, use_cuda: bool) -> Plan:
    """The capacity step: csrc's kernel (use_cuda) or the reference."""
    if use_cuda:
        from topoep.planners.cuda import fit_capacity_cuda

        return fit_capacity_cuda(plan, capacity)
    from topoep.planners.capacity import fit_capacity

    return fit_capacity(plan, capacity)


def on_topology(plan: Plan, topology: Topology, groups: Topology) -> Plan:
    """`plan`, made on the planning groups `groups` of `topology` (`Topology.planning_groups`), as a plan on
    `topology`: the same slots and route (tensors shared), info["plan_domain"] the groups' size."""
    return Plan(omega=plan.omega, topology=topology, num_slots=plan.num_slots, main_rank=plan.main_rank,
                slot_expert=plan.slot_expert, route=plan.route, policy=plan.policy, expert_bytes=plan.expert_bytes,
                token_bytes=plan.token_bytes, info={**plan.info, "plan_domain": groups.ranks_per_domain})


def plan_concurrently(omega: torch.Tensor, topology: Topology, policies: tuple[str, ...],
                      kw: dict | list[dict]) -> list[Plan]:
    """`solve(omega, topology, policy=p, **kw)` for each policy p, in order (kw: one dict for all, or one per policy).
    On a GPU each plan after the first runs on a side stream of its own at the same time as the first (each policy
    has its own workspace; two default grids of the multi-block planner take half the SMs each, the spread planner
    one block), and the current stream waits for them: no host synchronisation, capturable in a CUDA graph."""
    kws = [kw] * len(policies) if isinstance(kw, dict) else list(kw)
    if len(kws) != len(policies):
        raise ValueError(f"plan_concurrently: {len(kws)} keyword dicts for {len(policies)} policies")
    if not omega.is_cuda or len(policies) < 2:
        return [solve(omega, topology, policy=p, **k) for p, k in zip(policies, kws)]
    main = torch.cuda.current_stream(omega.device)
    sides = [_plan_stream(omega.device, i) for i in range(len(policies) - 1)]
    others = []
    for side, policy, k in zip(sides, policies[1:], kws[1:]):
        side.wait_stream(main)
        with torch.cuda.stream(side):
            others.append(solve(omega, topology, policy=policy, **k))
    first = solve(omega, topology, policy=policies[0], **kws[0])
    for side in sides:
        main.wait_stream(side)
    if not torch.cuda.is_current_stream_capturing():  # (a capture's pool keeps its memory until the graph goes)
        for plan in others:  # made on a side stream, read on this one
            plan.slot_expert.record_stream(main)
            plan.route.record_stream(main)
    return [first, *others]


_PLAN_STREAMS: dict = {}


def _plan_stream(device, index: int) -> torch.cuda.Stream:
    key = (torch.device(device), index)
    if key not in _PLAN_STREAMS:
        _PLAN_STREAMS[key] = torch.cuda.Stream(key[0])
    return _PLAN_STREAMS[key]


COST_POLICIES = ("topoep_plus", "topoep_plus_local", "joint", "fastermoe")  # compare modelled transfer costs in integers


def max_assignments(topology: Topology, token_bytes: int, expert_bytes: int, num_slots: int,
                    policy: str = "topoep", num_experts: int = 1) -> int:
    """The most assignments (sum of omega) the planners' int64 arithmetic holds, kept below 2^62 with its largest
    products: static sums loads only; the other policies multiply a domain's demand by 2 S_tok (stage 1's benefit),
    by the number of experts (stage 1's sort key, demand then expert) or an expert's load by the EP size (deepseek,
    flexmoe); the cost-comparing ones (COST_POLICIES) multiply assignments by 2 S_tok and femtoseconds per byte (the
    routing cost of eq. 6) beside expert bytes times femtoseconds per byte over the replicas (eq. 7)."""
    if policy == "static":
        return 2**62
    if policy not in COST_POLICIES:
        return 2**62 // max(2 * token_bytes, topology.num_ranks, num_experts)
    c = max(1, int(topology.cost_fs.max()))
    replicas = expert_bytes * c * topology.num_ranks * max(num_slots, 1)
    return max(0, min((2**62 - replicas) // (2 * token_bytes * c), 2**62 // max(num_experts, 1)))


def validate(omega, topology, num_slots, policy, expert_bytes, token_bytes, main_rank, check_values=True):
    """Check the inputs of `solve`; returns (omega, main_rank) as int64 tensors on omega's device.
    check_values=False skips the checks that read tensor values (they would synchronise a GPU)."""
    if not isinstance(omega, torch.Tensor):
        raise ValueError(f"omega must be a torch.Tensor of int64[R, E], got {type(omega).__name__}")
    if omega.dtype != torch.int64:
        raise ValueError(f"omega must have dtype torch.int64 (integer routing counts), got {omega.dtype}; "
                         "use omega.long() if the counts are integers")
    if omega.dim() != 2:
        raise ValueError(f"omega must be 2-D [R, E] (source ranks x experts), got shape {list(omega.shape)}")
    R, E = omega.shape
    if not isinstance(topology, Topology):
        raise ValueError(f"topology must be a topoep.Topology, got {type(topology).__name__}")
    if topology.num_ranks != R:
        raise ValueError(f"topology covers {topology.num_ranks} ranks ({topology.num_domains} domains x "
                         f"{topology.ranks_per_domain}) but omega has R={R} rows")
    if E == 0 or E % R != 0:
        raise ValueError(f"the number of experts E={E} must be a positive multiple of the number of ranks "
                         f"R={R} (each rank owns E // R main experts)")
    if check_values and (omega < 0).any():
        s, e = torch.nonzero(omega < 0)[0].tolist()
        raise ValueError(f"omega has negative counts, e.g. omega[{s}, {e}] = {omega[s, e].item()}")
    if not isinstance(num_slots, int) or isinstance(num_slots, bool) or num_slots < 0:
        raise ValueError(f"num_slots must be an integer >= 0, got {num_slots!r}")
    for name, v in (("expert_bytes", expert_bytes), ("token_bytes", token_bytes)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive integer number of bytes, got {v!r}")
    if check_values and policy in POLICIES + OFFLINE_POLICIES:
        limit = max_assignments(topology, token_bytes, expert_bytes, num_slots, policy, omega.shape[1])
        # an int64 sum of huge entries may itself wrap around: a float64 sum first, exact Python ints near the limit
        total = float(omega.sum(dtype=torch.float64))
        if total > 0.999 * limit:
            total = sum(int(v) for v in omega.flatten().tolist())
        if total > limit:
            raise ValueError(f"omega holds {int(total)} assignments, more than "
                             f"policy {policy!r}'s int64 arithmetic holds for this topology and token_bytes="
                             f"{token_bytes}: at most {limit} (topoep.planners.max_assignments); a real MoE layer routes "
                             "tokens x top_k per rank, far fewer")
    if policy not in POLICIES + OFFLINE_POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES + OFFLINE_POLICIES)}")
    if policy in OFFLINE_POLICIES and policy not in _REGISTERED:
        raise ValueError(f"policy {policy!r} is an offline planner of the topoep_research package, not of the "
                         f"library: `import topoep_research` registers it (topoep.planners.register_policy)")
    if main_rank is None:
        main_rank = default_main_rank(E, R, omega.device)
    elif not check_values:
        raise ValueError("the CUDA planner supports the default placement main_rank[e] = e // (E // R) only; "
                         "use backend='reference' for a custom main_rank")
    else:
        if not isinstance(main_rank, torch.Tensor) or main_rank.dtype != torch.int64 or main_rank.shape != (E,):
            raise ValueError(f"main_rank must be an int64[{E}] tensor (rank owning each expert)")
        if ((main_rank < 0) | (main_rank >= R)).any():
            e = torch.nonzero((main_rank < 0) | (main_rank >= R))[0].item()
            raise ValueError(f"main_rank out of range: main_rank[{e}] = {main_rank[e].item()}, "
                             f"must be in [0, {R})")
        main_rank = main_rank.to(omega.device)
    return omega, main_rank
