"""`topoep_plus`: the paper's plan (`topoep`, paper 4.3) made cheaper in every term of eq. 8 by two steps that
cost nothing in the model, for runtime use (it runs per layer and microbatch like `topoep`).

Why: `topoep` keeps each source's tokens in the (expert, domain) group it chose before refinement and splits a
group's amount over its instances in index order, so a source rank that hosts an instance of the expert may
still send its tokens to another rank; and its refinement never moves load between domains, even load that
crosses the fabric anyway. On a two-level topology neither choice saves anything. Measured on the Fig. 10
workloads (results/plan_quality.md): the modelled time of eq. 8 drops by up to 2.4 % (random, 4 slots: 67.17
-> 65.56 ms), the imbalance by up to 15 % (random, 1 slot: 2.78 -> 2.37); the inter-node share never rises
(by construction, step 2).

Algorithm (integers only, lowest-index ties, deterministic; a, b = `common.two_level_costs`, a2 = 2 S_tok a,
bb = 2 S_tok (b - a), U[e, r] the load of e's instance on rank r, U_d[e] its sum over domain d, D[d, e] the
demand of domain d's sources):

1. The `topoep` plan (stages 1-4 of `reference.solve_topoep`); its slot table and instance loads U.
2. Free moves across the EP group. The token cost of eq. 6 for loads U, routed as in step 3, is
   a2 sum_{e,r} (omega[r, e] - U[e, r])^+ + bb sum_{e,d} (D[d, e] - U_d[e])^+ (exact on a two-level
   topology). Moving delta of e's load from rank r1 to another instance of e on r2 changes it by
   Delta(delta) = a2 ((delta - f1)^+ - min(delta, g2)) + bb ((delta - F1)^+ - min(delta, G2)) (the bb part
   only when r1 and r2 are in different domains), with f1 = (U[e, r1] - omega[r1, e])^+ the load on r1 that
   does not come from r1 itself, g2 = (omega[r2, e] - U[e, r2])^+ what r2 still sends away, F1 =
   (U_d1[e] - D[d1, e])^+ the load in r1's domain that comes from other domains, and G2 = (D[d2, e] -
   U_d2[e])^+ what r2's domain still sends out. Delta is convex with Delta(0) = 0, so the free amount (the
   largest delta with Delta(delta) <= 0) is exact in integers from its four breakpoints.
   Loop: rb = the busiest rank (ties: lowest id). For every instance of an expert e on rb with load and
   every other rank rt hosting e with L[rt] < L[rb]: delta = the free amount, at most U[e, rb] and
   floor((L[rb] - L[rt]) / 2), and across domains at most F1 + G2, where the bb part of Delta is <= 0 (the
   move adds no inter-domain assignment: a cheaper intra-domain route alone never buys fabric traffic).
   The largest delta wins (ties: lower L[rt], then lower rt, then lower e); stop when it is 0 or after
   `max_moves` moves (default 4 R (E / R + N), the loop's fixed bound; the Fig. 10 plans need 0-3). The
   hosts are the plan's instances when the loop starts (a replica a move empties may receive load later).
   Only existing instances receive load: no slot changes, no new transfer.
3. Replicas left with no load are dropped; the route is `common.hierarchical_route` (each instance
   serves its own rank first, then its domain, then any source): the cheapest route of these loads on a
   two-level topology.
4. Guard (any cost matrix; decisions above use its two-level means): the result is kept only if it is no
   worse than the `topoep` plan in L_max, in inter-domain assignments, and in T_token + T_replica computed
   from the full cost matrix (int64 fs), so it is never worse in any term of eq. 8 for any t_ffn nor in
   the inter-node share; otherwise the `topoep` plan is returned with info["fallback"] = "topoep". On an
   exactly two-level topology it never fires (tests/test_topoep_plus.py).

`topoep_plus_local` (inter_domain=False) is the same four steps from `topoep`'s plan without its stage 1: no replica
outside its main's domain, every slot for the refinement's balancing inside domains. The paper's stage 1 places a
replica in another domain wherever 2 D S_tok > W, a sum over transfers (eq. 6-7); on the busiest link that trade
can lose: a hot rank sends every copy of its experts through one NIC, while the token bytes it saves were spread
over many. Which of the two plans is faster depends on the routing and on how the transport sends tokens (one row
per assignment, or deduplicated per rank and domain as DeepEP does), so the layer does not guess: with the
net-benefit guard, a `topoep_plus` layer plans both at the same time (`topoep.planners.plan_concurrently`: two
streams on the GPU) and the guard keeps the one its per-link prediction says is faster, or static
(`topoep.runtime.guard`). results/link_sweep.md has the effect per workload.

The contract is every policy's: C1-C3, C5 and C4 (plan.C4_POLICIES binds it like `topoep`: step 2 adds no
replica), no duplicate instance, integer decisions, lowest-index ties. The CUDA planner (csrc/planner_kernel.cu,
phases 7-9 after topoep's refinement) returns the same plan bit for bit on exactly two-level cost matrices
(where step 4 never fires), without host synchronisation; `topoep.solve` uses it for CUDA omega there.
"""

from __future__ import annotations

import copy

import torch

from topoep.plan import Plan, domain_demand
from topoep.planners.common import hierarchical_route, max_load_and_inter, modelled_fs, two_level_costs


def free_amount(cap: int, f1: int, g2: int, F1: int, G2: int, a2: int, bb: int) -> int:
    """The largest delta in [0, cap] with Delta(delta) <= 0 (module docstring, step 2; bb = 0 inside a
    domain). Delta is convex piecewise linear with Delta(0) = 0: walk its breakpoints, then solve the
    crossing segment in integers."""

    def delta_cost(x: int) -> int:
        return a2 * (max(x - f1, 0) - min(x, g2)) + bb * (max(x - F1, 0) - min(x, G2))

    def slope_after(x: int) -> int:  # slope on (x, next breakpoint)
        return a2 * ((x >= f1) - (x < g2)) + bb * ((x >= F1) - (x < G2))

    points = sorted({p for p in (f1, g2, F1, G2) if 0 < p < cap} | {cap})
    lo = 0
    for hi in points:
        if delta_cost(hi) <= 0:
            lo = hi
            continue
        s = slope_after(lo)  # > 0 here: Delta rises from delta_cost(lo) <= 0 to delta_cost(hi) > 0
        return lo + (-delta_cost(lo)) // s
    return lo


def global_moves(omega: list, U: list[dict], D: list, rpd: int, a2: int, bb: int, max_moves: int) -> int:
    """Step 2 on Python ints, in place: U[r] = {expert: load} of the instances on rank r (every instance of
    the plan, loaded or not), omega[r][e], D[d][e]. Returns the number of moves made."""
    R = len(U)
    hosts: dict[int, list[int]] = {}
    for r in range(R):
        for e in U[r]:
            hosts.setdefault(e, []).append(r)
    Ud = [dict() for _ in range(len(D))]
    for r in range(R):
        for e, u in U[r].items():
            Ud[r // rpd][e] = Ud[r // rpd].get(e, 0) + u
    L = [sum(U[r].values()) for r in range(R)]
    moves = 0
    while moves < max_moves:
        rb = max(range(R), key=lambda r: (L[r], -r))
        d1 = rb // rpd
        best = None
        for e in sorted(U[rb]):
            u = U[rb][e]
            if u <= 0:
                continue
            f1 = max(u - omega[rb][e], 0)
            F1 = max(Ud[d1][e] - D[d1][e], 0)
            for rt in hosts[e]:
                half = (L[rb] - L[rt]) // 2
                if rt == rb or half <= 0:
                    continue
                d2 = rt // rpd
                g2 = max(omega[rt][e] - U[rt][e], 0)
                cross = d2 != d1
                G2 = max(D[d2][e] - Ud[d2][e], 0) if cross else 0
                cap = min(u, half, F1 + G2) if cross else min(u, half)  # across domains: no new inter-domain load
                delta = free_amount(cap, f1, g2, F1 if cross else 0, G2, a2, bb if cross else 0)
                if delta <= 0:
                    continue
                key = (-delta, L[rt], rt, e)
                if best is None or key < best[0]:
                    best = (key, e, rt, delta)
        if best is None:
            break
        _, e, rt, delta = best
        U[rb][e] -= delta
        U[rt][e] += delta
        L[rb] -= delta
        L[rt] += delta
        Ud[d1][e] -= delta
        Ud[rt // rpd][e] += delta
        moves += 1
    return moves


def solve_topoep_plus(omega, topology, *, num_slots, main_rank, expert_bytes, token_bytes,
                      max_moves: int | None = None, paper: Plan | None = None, inter_domain: bool = True,
                      **kw) -> Plan:
    """The `topoep_plus` policy (module docstring). info: topoep's, plus "global_moves" and, when the guard
    kept the paper's plan, "fallback" = "topoep". `paper`: the `topoep` plan of the same inputs when the caller
    has it (joint does), else it is solved here; it is not modified. inter_domain=False: the
    `topoep_plus_local` policy, the same steps from the paper's plan without its stage 1 (`solve_topoep`)."""
    from topoep.planners.reference import solve_topoep

    R, E = omega.shape
    N = num_slots
    if paper is None:
        paper = solve_topoep(omega, topology, num_slots=N, main_rank=main_rank, expert_bytes=expert_bytes,
                             token_bytes=token_bytes, inter_domain=inter_domain, **kw)
    else:
        paper = copy.copy(paper)  # policy and info are reassigned below, never changed in place
    name = "topoep_plus" if inter_domain else "topoep_plus_local"
    paper.policy = name
    if N == 0 or paper.info.get("fallback"):
        # no slots: static; topoep's own guard chose static (its plan was worse in L_max): keep it
        paper.info = {**paper.info, "global_moves": 0}
        return paper
    if max_moves is None:
        max_moves = 4 * R * (E // R + N)
    a, b, _ = two_level_costs(topology)
    a2, bb = 2 * token_bytes * a, 2 * token_bytes * (b - a)
    ie, ir, il = paper.instance_expert.tolist(), paper.instance_rank.tolist(), paper.instance_load.tolist()
    U = [dict() for _ in range(R)]
    for p, e in enumerate(ie):
        if e >= 0:
            U[ir[p]][e] = il[p]
    D = domain_demand(omega, topology).tolist()
    moves = global_moves(omega.tolist(), U, D, topology.ranks_per_domain, a2, bb, max_moves)
    load = torch.tensor([U[ir[p]][e] if e >= 0 else 0 for p, e in enumerate(ie)], dtype=torch.int64,
                        device=omega.device)
    slot_expert = torch.where(load[E:].view(R, N) > 0, paper.slot_expert, -1)  # a dropped slot has load 0
    route = hierarchical_route(omega, topology, main_rank, slot_expert, load)
    info = {**paper.info, "global_moves": moves}
    plan = Plan(omega=omega, topology=topology, num_slots=N, main_rank=main_rank, slot_expert=slot_expert,
                route=route, policy=name, expert_bytes=expert_bytes, token_bytes=token_bytes, info=info, **kw)
    (plan_max, plan_inter), (paper_max, paper_inter) = max_load_and_inter(plan), max_load_and_inter(paper)
    # modelled_fs with t = 0: T_token + T_replica
    if plan_max > paper_max or plan_inter > paper_inter or modelled_fs(plan, 0) > modelled_fs(paper, 0):
        paper.info = {**info, "fallback": "topoep"}
        return paper
    return plan
