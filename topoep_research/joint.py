"""`joint`: replica placement and token split chosen together to minimise the modelled exposed time of
eq. 5-8, T_comp + T_token + T_replica, for the given topology costs, expert and token sizes and t_ffn.

An offline planner (`topoep.planners.OFFLINE_POLICIES`): `import topoep_research` registers it, then use it
through `topoep.solve(policy="joint")` or bench/plan_quality.py, not in the training runtime. The reference
takes 3.8-7.4 s per plan at the Fig. 10 scale (32 ranks x 640 experts, 1-4 slots, one CPU core;
results/plan_quality.md), synchronises the host hundreds of times per plan, and its search holds K x R^3
tensors (about 100 GB at EP 1024).

Unlike `topoep` (paper 4.3), nothing here keeps tokens inside their domain at any price: load moves
between domains whenever the model says it pays, and a replica slot goes to whichever use (locality or
balance) lowers the modelled time. The contract is every policy's: C1-C3, C5, no duplicate instance,
C4 (plan.C4_POLICIES binds `joint` like `topoep`), integer decisions, lowest-index ties, deterministic.

The cost model in integers
--------------------------
All decisions use femtoseconds (fs): t = t_ffn per assignment, a2 = 2 S_tok a (an assignment that
leaves its source rank inside the domain), bb = 2 S_tok (b - a) (extra when it leaves the domain),
rho[e, r] = W c[main(e), r] (a replica), with a, b the intra- and inter-domain cost per byte
(`common.two_level_costs`). On such a two-level topology the routing cost of eq. 6 is a transport
cost on a tree (rank - domain - root), so for given instance loads U[e, r] its optimum is

    T_token = a2 sum_{e,r} (omega[r, e] - U[e, r])^+ + bb sum_{e,d} (D[d, e] - U_d[e])^+

(every instance serves its own rank first, then its domain; `common.hierarchical_route` builds that
split). The planner therefore works on U (E x R) only, never on the R x E x R routing. A general cost
matrix is approximated by its mean intra- and inter-domain costs for the decisions; the final guard
compares the plans' true modelled time (`modelled_fs`, from the full cost matrix) instead. All of it is
int64: `check_fs_range` rejects inputs whose modelled times could reach 2^62 fs.

Algorithm (choices made; every loop has a fixed bound)
------------------------------------------------------
1. Threshold search (UltraEP's idea, generalised to costs). T_comp only depends on L_max, so for a
   candidate cap T the rest is "minimise T_token + T_replica with every rank load <= T"; J(T) =
   t L_max + that cost is evaluated for K caps at once (a batch dimension), K spread between
   ceil(total / R) and the static maximum (cubically denser near the bottom, plus the paper plan's
   L_max), then K more between the best cap's neighbours. Three starting points per cap, also batched:
     "L": locality first (`locality_start`). Per target rank the candidates are the domain's best
          cross-domain replicas (gain bb D + a2 omega - rho) and the rank's best local ones
          (a2 omega - rho); the best move (largest gain, room permitting) is applied until none gains.
     "T": the `topoep` plan (so joint is never worse than the paper's heuristic at the same cap).
     "B": static, with relief moves chosen by amount first (UltraEP's "hottest expert to the ranks
          with slack"), for balance-dominated settings.
2. Moves on a rank graph until no plan improves (`joint_search.search`).
3. Destroy and repair from the best plan (`joint_search.lns`), at most `lns_rounds` rounds.
   On small instances (a 4x denser grid of caps fits one batch: EP <= 16 or so) steps 1-3 run twice, from
   the default and the dense grid, and the better plan is kept (`dense_caps`): the later stages follow the
   first round's best cap, so a denser first round alone is better on some instances and worse on others.
4. Pareto guard (pareto_guard=True, the default): a plan with both a larger L_max and more inter-domain
   assignments than the paper's plan is never chosen. The exact optimum of eq. 8 is sometimes such a
   plan (it saves replica transfers instead, see results/plan_quality.md); users watch imbalance and
   inter-node share, so the shipped policy gives up those few percent of modelled time.
5. Replicas with no load are dropped, the routing is `hierarchical_route`, and the plan is guarded:
   never worse than `static` or `topoep` in modelled time (integer fs), and never `static` when that
   is worse than `topoep` in both L_max and inter-domain assignments (with the Pareto guard).
6. Two fill-to-cap packings (`fill_to_cap`: the smallest cap by bisection, replicas inside their main's
   domain, rules "D" and "A") are candidates too, under the same guard: where balance dominates they
   reach caps the move search does not reach from its starts (e.g. moving the two hottest experts whole
   to the ranks with the most room, and letting a relieved hot rank take a replica itself).

Work is bounded by `work_budget` (batched tensor elements processed by the move search, summed over
steps, plus a fixed cost per step). The batch sizes follow the instance size: K = min(num_caps,
2^20 // (R^2 (Q + R))) caps per round but at least 4 (Q = main experts + slots per rank), so a step
exceeds 2^20 elements once R^2 (Q + R) > 2^18, i.e. for every R >= 64; LNS batches of min(512,
2^22 // plan size) plans, at least 4. Small instances are searched thoroughly; large ones are bounded
by the work budget, not by the batch sizes.
"""

from __future__ import annotations

import torch

from topoep.metrics import DEFAULT_T_FFN
from topoep.plan import Plan
from topoep.planners.common import hierarchical_route, max_load_and_inter, modelled_fs, top_k
from topoep.topology import FEMTO, Topology
from topoep_research.joint_search import (BIG, EXCLUDED, Data, State, breakpoints, dominated, lns, move_cost,
                                          search)

DEFAULT_WORK_BUDGET = 2 * 10 ** 8
# How far the int64 fs arithmetic may go: the objective of a plan stays below it (EXCLUDED marks plans
# that must not be chosen), with room for the search's gains (see `check_fs_range`).
FS_LIMIT = EXCLUDED


def check_fs_range(omega: torch.Tensor, topology: Topology, num_slots: int, expert_bytes: int, token_bytes: int,
                   t_ffn: float) -> None:
    """Raise ValueError unless joint's int64 femtosecond arithmetic is safe for this input.

    Bound: t_fs total + 4 x 2 S_tok c_max total + W c_max R N < 2^62, with total the assignments and
    c_max the largest cost per byte: the first and last terms bound T_comp and T_replica of any plan,
    the token term T_token, and its factor 4 the search's gains (a new replica's amount plus its
    overflow along two arcs). A t_ffn given in the wrong unit (e.g. milliseconds) is the usual cause."""
    R = omega.shape[0]
    total = int(omega.sum())
    c_max = int(topology.cost_fs.max())
    t_fs = int(round(t_ffn * FEMTO))
    bound = t_fs * total + 4 * (2 * token_bytes * c_max * total) + expert_bytes * c_max * R * num_slots
    if bound >= FS_LIMIT:
        raise ValueError(
            f"policy 'joint' computes modelled times in int64 femtoseconds, and for this input they could reach "
            f"{bound:.3g} fs >= 2^62 (t_ffn={t_ffn!r} s = {t_fs} fs per assignment, {total} assignments, "
            f"token_bytes={token_bytes}, expert_bytes={expert_bytes}, {num_slots} slots, up to {c_max} fs per "
            "byte). t_ffn is seconds of expert time per assignment (topoep.metrics.DEFAULT_T_FFN is "
            f"{DEFAULT_T_FFN:.3g}): check its unit, or plan fewer assignments at once")


# ---------------------------------------------------------------------------------------------------
# Starting points.

def _seed_from_plan(d: Data, st: State, plan: Plan) -> None:
    """Every plan of st starts from `plan` (slot table and instance loads)."""
    K, R, N, E, dev = st.K, d.R, d.N, d.E, d.dev
    il = plan.instance_load
    se = plan.slot_expert
    occ = se >= 0
    rr = torch.arange(R, device=dev)[:, None].expand(R, N)
    U = torch.zeros(E, R, dtype=torch.int64, device=dev)
    U[torch.arange(E, device=dev), d.main] = il[:E]
    U.index_put_((se[occ], rr[occ]), il[E:].view(R, N)[occ], accumulate=True)
    host = torch.zeros(E, R, dtype=torch.bool, device=dev)
    host[torch.arange(E, device=dev), d.main] = True
    host[se[occ], rr[occ]] = True
    st.U = U[None].repeat(K, 1, 1)
    st.host = host[None].repeat(K, 1, 1)
    st.L = st.U.sum(1)
    st.Ud = torch.zeros(K, E, d.M, dtype=torch.int64, device=dev).index_add_(2, d.dom, st.U)
    st.slot = se.gather(1, torch.sort((~occ).long(), dim=1, stable=True).indices)[None].repeat(K, 1, 1)
    st.free = (st.slot < 0).sum(2)
    st.release_empty(d)


def locality_start(d: Data, st: State, cand: torch.Tensor, max_iters: int) -> None:
    """Start "L": apply the best locality move (largest gain, room permitting) until none gains.

    cand: int64[R, C] candidate experts per target rank (-1 padded); the source is the hosting rank
    with the largest load."""
    K, R = st.K, d.R
    kk = torch.arange(K, device=d.dev)[:, None]
    rr = torch.arange(R, device=d.dev)
    r2 = rr[:, None].expand(R, cand.shape[1] + d.N).reshape(-1)  # [Z]
    for _ in range(max_iters):
        tab = torch.cat([cand[None].expand(K, -1, -1), st.slot], 2).view(K, -1)  # [K, Z]
        e_ = tab.clamp(min=0)
        Ue = st.U[kk, e_]  # [K, Z, R]
        key = torch.where(st.host[kk, e_] & (Ue > 0) & (rr[None, None, :] != r2[None, :, None]), st.L[:, None, :], -1)
        r1 = torch.argmax(key, 2)
        Us = Ue.gather(2, r1[..., None])[..., 0]
        Ut = Ue.gather(2, r2[None, :, None].expand(K, -1, 1))[..., 0]
        new = ~st.host[kk, e_, r2[None, :]] & (st.free[:, r2] > 0) & d.c4ok[e_, r2[None, :]]
        room = st.T[:, None] - st.L[:, r2]
        valid = (tab >= 0) & (key.gather(2, r1[..., None])[..., 0] >= 0) & (st.host[kk, e_, r2[None, :]] | new) & (room > 0)
        dmax = torch.minimum(Us, room).clamp(min=1)
        w1, w2 = d.omt[e_, r1], d.omt[e_, r2[None, :]]
        d1, d2 = d.dom[r1], d.dom[r2][None, :].expand_as(e_)
        cross = d1 != d2
        Ud = st.Ud[kk, e_]
        s_d1 = torch.where(cross, (Ud.gather(2, d1[..., None])[..., 0] - d.Dt[e_, d1]).clamp(min=0), BIG)
        g_d2 = torch.where(cross, (d.Dt[e_, d2] - Ud.gather(2, d2[..., None])[..., 0]).clamp(min=0), 0)
        bp = breakpoints(Us, Ut, w1, w2, s_d1, g_d2, dmax)
        cost = move_cost(d, Us[..., None], Ut[..., None], w1[..., None], w2[..., None], s_d1[..., None],
                         g_d2[..., None], cross[..., None], torch.where(new, d.rho[e_, r2[None, :]], 0)[..., None], bp)
        cb = cost.min(-1).values
        db = torch.where(cost == cb[..., None], bp, BIG).min(-1).values  # smallest amount at the best cost
        cb = torch.where(valid, cb, BIG)
        idx = torch.argmin(cb, 1)
        k1 = kk[:, 0]
        ok = cb[k1, idx] < 0
        if not bool(ok.any()):
            return
        st.apply(d, e_[k1, idx], r1[k1, idx], r2[idx], torch.where(ok, db[k1, idx], 0), ok & new[k1, idx])


def _locality_candidates(d: Data, topology: Topology) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cand int64[R, C] for `locality_start`, gdom, grank [E, R]): the value in fs of a replica of e on
    r, for the domain's demand when r is in another domain than main(e) (gdom) or for r's own demand
    in main(e)'s domain (grank), -1 where C4 forbids it. Per rank: the rpd N + N best of gdom and the
    N best of grank, largest first, lowest expert on ties."""
    E, N = d.E, d.N
    cross = d.dom[d.main][:, None] != d.dom[None, :]
    gdom = torch.where(cross & d.c4ok, d.bb * d.Dt[:, d.dom] + d.a2 * d.omt - d.rho, -1)
    grank = torch.where(~cross & d.c4ok, d.a2 * d.omt - d.rho, -1)
    v1, i1 = top_k(gdom.t(), min(E, topology.ranks_per_domain * N + N))
    v2, i2 = top_k(grank.t(), min(E, N))
    return torch.cat([torch.where(v1 > 0, i1, -1), torch.where(v2 > 0, i2, -1)], 1), gdom, grank


# ---------------------------------------------------------------------------------------------------
# Caps and the policy.

def thresholds(d: Data, K: int, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
    """K caps lo + (hi - lo) i^3 // (K - 1)^3 for i < K (cubically denser near lo), duplicates removed;
    lo defaults to ceil(total / R), hi to the static maximum."""
    lo = -(-int(d.tot.sum()) // d.R) if lo is None else lo
    hi = int(d.L0.max()) if hi is None else hi
    n3 = max(K - 1, 1) ** 3
    return torch.tensor(sorted({lo + (hi - lo) * i ** 3 // n3 for i in range(K)}), dtype=torch.int64, device=d.dev)


def even_caps(d: Data, K: int, lo: int, hi: int) -> torch.Tensor:
    """K caps evenly from lo to hi (each the nearest integer, halves up), duplicates removed."""
    n = max(K - 1, 1)
    return torch.tensor(sorted({lo + (2 * (hi - lo) * i + n) // (2 * n) for i in range(K)}), dtype=torch.int64,
                        device=d.dev)


def _fill_attempt(T: int, L0: list, D: list, dom: list, experts_of: list, N: int, rule: str):
    """One fill-to-cap pass at cap T (Python ints): while a rank is above T, the rank with the most room
    below T (and a free slot, in the domain of a rank above T) gets a replica of an expert whose main
    is above T in its domain, and takes as much of its load as fits. rule "A": the largest expert of
    the most loaded rank; rule "D": the smallest expert that fills the room (else the largest), which
    keeps the big experts for the big rooms. A rank relieved below T may receive in turn (its main may
    give away more than it must). Returns (slots [R] of [(expert, amount)], main loads [E]) or None."""
    R = len(L0)
    L, U, free = list(L0), list(D), [N] * R
    hosted = [set() for _ in range(R)]
    slots = [[] for _ in range(R)]
    for _ in range(R * N + 1):
        over = [r for r in range(R) if L[r] > T]
        if not over:
            return slots, U
        over_dom = {dom[r] for r in over}
        recv = [q for q in range(R) if free[q] > 0 and L[q] < T and dom[q] in over_dom]
        if not recv:
            return None
        q = max(recv, key=lambda q: (T - L[q], -q))  # most room; lowest rank on ties
        room = T - L[q]
        donors = [r for r in over if dom[r] == dom[q]]
        if rule == "A":
            donors = [max(donors, key=lambda r: (L[r], -r))]
        cands = [(e, r) for r in donors for e in experts_of[r] if U[e] > 0 and e not in hosted[q]]
        if not cands:
            return None
        fill = [c for c in cands if U[c[0]] >= room] if rule == "D" else []
        e, r = (min(fill, key=lambda c: (U[c[0]], c[0])) if fill else max(cands, key=lambda c: (U[c[0]], -c[0])))
        a = min(U[e], room)
        L[r] -= a
        L[q] += a
        U[e] -= a
        free[q] -= 1
        hosted[q].add(e)
        slots[q].append((e, a))
    return None


def fill_to_cap(omega: torch.Tensor, topology: Topology, num_slots: int, main_rank: torch.Tensor, common: dict,
                rule: str = "D") -> Plan:
    """A pure-balance candidate of `joint` (MoonEP's fill-to-cap pairing, with the smallest cap found by
    bisection): replicas only inside their main's domain (so the inter-domain traffic is static's), the
    load moved as `_fill_attempt` says. 4-9 ms at the Fig. 10 scale (one CPU core); on the one-domain study of
    results/plan_quality.md it reaches the best bound known on most instances. Deterministic."""
    R, E = omega.shape
    D = omega.sum(0).tolist()
    main = main_rank.tolist()
    dom = topology.domain_of.tolist()
    L0 = [0] * R
    experts_of = [[] for _ in range(R)]
    for e in range(E):
        L0[main[e]] += D[e]
        experts_of[main[e]].append(e)
    lo, hi = -(-sum(D) // R), max(L0)
    best = _fill_attempt(hi, L0, D, dom, experts_of, num_slots, rule)  # no rank above the static maximum
    while lo < hi:  # the smallest cap the pass reaches (it is not monotone in T: a found cap is kept)
        mid = (lo + hi) // 2
        got = _fill_attempt(mid, L0, D, dom, experts_of, num_slots, rule)
        if got is None:
            lo = mid + 1
        else:
            hi, best = mid, got
    slots, U = best
    se = torch.full((R, num_slots), -1, dtype=torch.int64)
    load = torch.zeros(R, num_slots, dtype=torch.int64)
    for q, row in enumerate(slots):
        for j, (e, a) in enumerate(row):
            se[q, j], load[q, j] = e, a
    dev = omega.device
    se, load = se.to(dev), load.to(dev)
    inst_load = torch.cat([torch.tensor(U, dtype=torch.int64, device=dev), load.reshape(-1)])
    route = hierarchical_route(omega, topology, main_rank, se, inst_load)
    return Plan(omega=omega, topology=topology, num_slots=num_slots, main_rank=main_rank, slot_expert=se,
                route=route, policy="joint", **common)


def _plan(d: Data, st: State, omega, topology, main_rank, common, info) -> Plan:
    R, E = d.R, d.E
    U, slot = st.U[0], st.slot[0]
    rr = torch.arange(R, device=d.dev)[:, None]
    load = torch.where(slot >= 0, U[slot.clamp(min=0), rr], 0)
    slot = torch.where(load > 0, slot, -1)
    slot = slot.gather(1, torch.sort((slot < 0).long(), dim=1, stable=True).indices)
    load = torch.where(slot >= 0, U[slot.clamp(min=0), rr], 0)
    inst_load = torch.cat([U[torch.arange(E, device=d.dev), main_rank], load.reshape(-1)])
    route = hierarchical_route(omega, topology, main_rank, slot, inst_load)
    return Plan(omega=omega, topology=topology, num_slots=d.N, main_rank=main_rank, slot_expert=slot, route=route,
                policy="joint", info=info, **common)


def solve_joint(omega, topology, *, num_slots, main_rank, expert_bytes, token_bytes, t_ffn,
                num_caps: int = 16, lns_rounds: int = 8, work_budget: int = DEFAULT_WORK_BUDGET,
                pareto_guard: bool = True, refine_caps: bool = True, dense_caps: int = 4, **kw) -> Plan:
    """The `joint` policy (module docstring); `topoep.solve(policy="joint")` calls it with the defaults.

    t_ffn: seconds of expert time (forward + backward) per assignment. num_caps: caps per threshold
    round (fewer on large instances). lns_rounds: destroy-and-repair rounds. work_budget: bound on the
    move search (see module docstring). pareto_guard: never return a plan worse than the paper's in both
    L_max and inter-domain assignments (False: problem (8) alone). refine_caps: the second round of
    caps between the best cap's neighbours. dense_caps: on instances small enough that dense_caps x
    num_caps caps fit one batch, the search runs a second time from that many caps and the better plan is
    kept (1: off). info of the plan: the cap, the modelled time in fs, whether
    the costs are exactly two-level, the work left, and "fallback" when static or topoep was better.
    Raises ValueError when the modelled times could overflow int64 (`check_fs_range`).
    """
    from topoep.planners.plus import solve_topoep_plus
    from topoep.planners.reference import solve_static, solve_topoep

    R, E = omega.shape
    N = num_slots
    check_fs_range(omega, topology, N, expert_bytes, token_bytes, t_ffn)
    common = dict(expert_bytes=expert_bytes, token_bytes=token_bytes, **kw)
    static = solve_static(omega, topology, num_slots=N, main_rank=main_rank, **common)
    static.policy = "joint"
    if N == 0 or int(omega.sum()) == 0:
        return static
    d = Data(omega, topology, N, main_rank, expert_bytes, token_bytes, t_ffn, work_budget)
    paper = solve_topoep(omega, topology, num_slots=N, main_rank=main_rank, **common)
    # batch sizes from the instance size: small instances get every cap and many LNS variants
    Q = d.mains_tab.shape[1] + N
    fits = (1 << 20) // (R * R * (Q + R))  # caps per batch of the move search
    K = int(max(4, min(num_caps, fits)))
    max_batch = int(max(4, min(512, (1 << 22) // d.plan_size())))
    max_steps = 4 * R * (N + 1) + 32
    cand, gdom, grank = _locality_candidates(d, topology)

    def run(T):
        """Three starts at every cap of T: the state and its objective [3K] (EXCLUDED where the Pareto
        guard rejects the plan). "L": locality first; "T": the paper's plan; "B": from static,
        relief moves as large as possible first."""
        n = T.numel()
        st = State(d, torch.cat([T, T, T]))
        part = torch.arange(n, device=d.dev)
        loc = st.select(part)
        locality_start(d, loc, cand, 2 * R * (N + 1))
        st.assign(part, loc)
        seeded = st.select(part + n)
        _seed_from_plan(d, seeded, paper)
        st.assign(part + n, seeded)
        st.amount_first[2 * n:] = True
        search(d, st, max_steps)
        return st, torch.where(dominated(d, st, ref), EXCLUDED, st.objective(d))

    # the paper's plan is a start at every cap, and no plan worse than it in both L_max and inter-domain
    # assignments is chosen (the two numbers users watch; T_replica can make such a plan cheaper)
    paper_max, paper_inter = max_load_and_inter(paper)
    ref = (paper_max, paper_inter) if pareto_guard else (EXCLUDED, EXCLUDED)
    if lns_rounds > 0:
        val = torch.maximum(gdom, grank).flatten()  # [E * R]
        flat = torch.sort(-val, stable=True).indices  # best first, lowest (e, r) on ties
        flat = flat[val[flat] > 0][:4 * R * N]
        opens = torch.stack([flat // R, flat % R], 1)

    def pipeline(T):
        """Threshold rounds from the caps T, then destroy and repair: the best state."""
        st, J = run(T)
        k = int(torch.argmin(J))
        best = st.select(torch.tensor([k], device=d.dev))
        if refine_caps:
            j = int((T == st.T[k]).nonzero()[0])
            st2, J2 = run(even_caps(d, K, int(T[max(j - 1, 0)]), int(T[min(j + 1, T.numel() - 1)])))
            k2 = int(torch.argmin(J2))
            if int(J2[k2]) < int(J[k]):
                best = st2.select(torch.tensor([k2], device=d.dev))
        if lns_rounds > 0:
            best = lns(d, best, lns_rounds, max_batch, max_steps, ref, opens)
        return best

    paper_cap = torch.tensor([paper_max], device=d.dev)
    best = pipeline(torch.unique(torch.cat([thresholds(d, K), paper_cap])))
    if dense_caps > 1 and fits >= dense_caps * K:
        # small instance: the whole search again from a denser grid of caps, the better plan kept (ties: the
        # first). A portfolio, not one bigger search: the later stages follow the first round's best cap,
        # so a denser first round alone is better on some instances and worse on others.
        other = pipeline(torch.unique(torch.cat([thresholds(d, dense_caps * K), paper_cap])))
        def score(st):
            """The search's objective (EXCLUDED where the Pareto guard rejects the plan); on a general cost
            matrix the objective uses mean costs, so the true modelled time of the plan decides."""
            if int(dominated(d, st, ref)[0]):
                return EXCLUDED
            if d.exact:
                return int(st.objective(d)[0])
            return modelled_fs(_plan(d, st, omega, topology, main_rank, common, {}), d.t)

        if score(other) < score(best):
            best = other
    info = dict(threshold=int(best.T[0]), objective_fs=int(best.objective(d)[0]), exact_costs=d.exact,
                work_left=d.work_left)
    plan = _plan(d, best, omega, topology, main_rank, common, info)
    # guard: never worse than static or the paper's plan in modelled time (integer fs, full cost
    # matrix; ties to the earlier candidate), and static only if the Pareto guard allows it
    def allowed(p: Plan) -> bool:  # the Pareto guard
        p_max, p_inter = max_load_and_inter(p)
        return not (pareto_guard and p_max > paper_max and p_inter > paper_inter)

    cands = [(modelled_fs(plan, d.t), 0, plan), (modelled_fs(paper, d.t), 2, paper)]
    if allowed(static):
        cands.append((modelled_fs(static, d.t), 1, static))
    # fill-to-cap (two rules): where balance dominates, a packing the move search does not reach from its starts
    for k, rule in enumerate(("D", "A")):
        fill = fill_to_cap(omega, topology, N, main_rank, common, rule)
        if allowed(fill):
            cands.append((modelled_fs(fill, d.t), 3 + k, fill))
    # topoep_plus: the paper's plan, routed own rank first, with free moves across domains (its L_max is never
    # larger than the paper's, so the Pareto guard never rejects it)
    plus = solve_topoep_plus(omega, topology, num_slots=N, main_rank=main_rank, paper=paper, **common)
    if allowed(plus):
        cands.append((modelled_fs(plus, d.t), 5, plus))
    _, which, out = min(cands, key=lambda c: (c[0], c[1]))
    if which:
        out.policy = "joint"
        out.info = {**info, "fallback": ("static", "topoep", "fill_to_cap", "fill_to_cap_a", "topoep_plus")[which - 1]}
    return out
