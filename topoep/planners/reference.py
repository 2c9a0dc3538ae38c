"""Reference planners in pure PyTorch: `static` and `topoep` (paper 4.3). This is the executable spec:
the CUDA planner must return exactly these plans (`torch.equal` on slot_expert and route).

Decisions use integers only (counts, bytes, femtoseconds per byte) and break every tie by the lowest
index, so a plan is a pure function of (omega, topology, num_slots, expert_bytes, token_bytes,
main_rank).

`topoep`, stage by stage, with the choices made where the paper is silent:

1. Inter-node placement. D[d, e] = sum of omega over the ranks of domain d. For every domain d, the
   candidates are the experts whose main instance lies outside d with benefit
   b[d, e] = 2 D[d, e] S_tok - W > 0 (eq. 9; exactly criterion C4). They are taken in descending
   benefit (equivalently descending D; ties: lower expert id) and each gets one replica in d, on the
   *least occupied* rank of d with a free slot. Choice: "occupied" counts used replica slots; ties go
   to the rank with the lower static load (its main instances' total demand), then the lower rank id.
   Since every rank starts empty this is a round robin over d's ranks sorted by static load: the k-th
   candidate goes to the (k mod ranks_per_domain)-th of them, slot k // ranks_per_domain. Domains are
   independent; candidates beyond a domain's ranks_per_domain * N slots are dropped.
2. Routing. Every omega[s, e] is split evenly over e's instances in the source's domain if there are
   any, else over all of e's instances (`common.even_split`, locality "domain"; the remainder is
   rotated by s). This gives per-instance loads U and rank loads L.
3. Intra-node refinement, per domain, until no move helps: rb = the busiest rank of the domain (ties:
   lowest id). For every instance p of an expert e on rb with U[p] > 0 and every other rank rt of the
   domain that hosts e or has a free slot, delta = min(U[p], floor((L[rb] - L[rt]) / 2)) (eq. 10).
   The move with the largest delta wins; ties: lower L[rt], then lower cost_fs[rb, rt], then an
   existing instance before a new replica, then the more loaded source instance (split the hottest
   instance, as in the paper's Fig. 9), then lower rt, then lower e. A new replica takes rt's
   lowest free slot. Stop when the best delta is 0. Refinement works on loads only (U and L); the
   per-source split is derived afterwards (step 5).
4. Replicas left with no load are removed (their slots become empty): nothing is fetched for them.
5. Per-source routing: every (expert, domain) pair whose domain hosts an instance is a group; each
   source keeps the amount it sent to the group in step 2, and `common.interval_route` splits the
   group's amounts over its instances to match the refined loads. Tokens therefore never change
   domain during refinement (the paper's guarantee).
6. Guard: if the plan's maximum rank load exceeds the static plan's (possible when a cross-domain
   replica lands on a domain with no room to spread it, e.g. one rank per domain), the static plan is
   returned instead, with info["fallback"] = "static". This keeps `topoep` never worse than no
   balancing in imbalance; it never triggers on the paper's workloads (see results/plan_quality.md).
"""

from __future__ import annotations

import torch

from topoep.plan import Plan, domain_demand, static_route
from topoep.planners.common import even_split, instance_tables, interval_route, static_rank_load
from topoep.topology import Topology


def solve_static(omega, topology, *, num_slots, main_rank, **kw) -> Plan:
    """Main instances only: megatron's behaviour, the no-EPLB baseline."""
    slot_expert = torch.full((omega.shape[0], num_slots), -1, dtype=torch.int64, device=omega.device)
    return Plan(omega=omega, topology=topology, num_slots=num_slots, main_rank=main_rank,
                slot_expert=slot_expert, route=static_route(omega, num_slots), policy="static", **kw)


def internode_placement(omega: torch.Tensor, topology: Topology, num_slots: int, main_rank: torch.Tensor,
                        expert_bytes: int, token_bytes: int) -> torch.Tensor:
    """Stage 1: slot_expert int64[R, N] with one replica per positive-benefit (domain, expert) pair."""
    R, E = omega.shape
    M, rpd = topology.num_domains, topology.ranks_per_domain
    N = num_slots
    dev = omega.device
    slot_expert = torch.full((R, N), -1, dtype=torch.int64, device=dev)
    if N == 0 or M == 1:
        return slot_expert
    D = domain_demand(omega, topology)  # [M, E]
    dom = topology.domain_of.to(dev)
    L0 = static_rank_load(omega, main_rank, R)
    remote = dom[main_rank][None, :] != torch.arange(M, device=dev)[:, None]  # [M, E]
    positive = remote & (2 * D * token_bytes > expert_bytes)
    # descending benefit == descending D; ties -> lower e (stable sort of a key with e in the low bits)
    key = torch.where(positive, D, -1) * E + (E - 1 - torch.arange(E, device=dev))
    order = torch.argsort(key, dim=1, descending=True)  # [M, E]
    num_pos = positive.sum(1)  # [M]
    cap = rpd * N
    for d in range(M):
        k = min(int(num_pos[d]), cap)
        if k == 0:
            continue
        ranks = torch.arange(d * rpd, (d + 1) * rpd, device=dev)
        # ranks of d by static load, ties by id (stable)
        by_load = ranks[torch.argsort(L0[ranks] * R + ranks)]
        i = torch.arange(k, device=dev)
        slot_expert[by_load[i % rpd], i // rpd] = order[d, :k]
    return slot_expert


def refine_domain(d: int, topology: Topology, num_experts: int, num_slots: int, hosted: list[dict],
                  free_slots: list[list], U: list, L: list, slot_expert: list[list]) -> int:
    """Stage 3 for one domain, on Python ints (state mutated in place). Returns the iteration count.

    hosted[r]: {expert: instance p} for every instance on rank r; free_slots[r]: free slot indices in
    increasing order; U: per-instance loads (list over P); L: per-rank loads (list over R).
    """
    ranks = list(topology.domain_ranks(d))
    cost = topology.cost_fs
    E, N = num_experts, num_slots
    iters = 0
    while True:
        rb = max(ranks, key=lambda r: (L[r], -r))
        best = None
        for rt in ranks:
            if rt == rb:
                continue
            half = (L[rb] - L[rt]) // 2
            if half <= 0:
                continue
            c = int(cost[rb, rt])
            has_free = bool(free_slots[rt])
            for e, p in hosted[rb].items():
                if U[p] <= 0:
                    continue
                existing = e in hosted[rt]
                if not existing and not has_free:
                    continue
                delta = min(U[p], half)
                key = (-delta, L[rt], c, 0 if existing else 1, -U[p], rt, e)
                if best is None or key < best[0]:
                    best = (key, rt, e, p)
        if best is None:
            return iters
        (neg_delta, *_), rt, e, p = best
        delta = -neg_delta
        if e not in hosted[rt]:
            j = free_slots[rt].pop(0)
            p_new = E + rt * N + j
            slot_expert[rt][j] = e
            hosted[rt][e] = p_new
        q = hosted[rt][e]
        U[p] -= delta
        U[q] += delta
        L[rb] -= delta
        L[rt] += delta
        iters += 1


def solve_topoep(omega, topology, *, num_slots, main_rank, expert_bytes, token_bytes, inter_domain: bool = True,
                 **kw) -> Plan:
    """The paper's two-stage algorithm (module docstring). inter_domain=False leaves stage 1 out (no replica in
    another domain than its main's; every slot is the refinement's): `topoep_plus_local`'s starting plan."""
    R, E = omega.shape
    N = num_slots
    dev = omega.device
    common = dict(expert_bytes=expert_bytes, token_bytes=token_bytes, **kw)
    static = solve_static(omega, topology, num_slots=N, main_rank=main_rank, **common)
    if N == 0:
        static.policy = "topoep"
        return static

    # 1. inter-node placement
    if inter_domain:
        slot_expert = internode_placement(omega, topology, N, main_rank, expert_bytes, token_bytes)
    else:
        slot_expert = torch.full((R, N), -1, dtype=torch.int64, device=dev)
    stage1_replicas = int((slot_expert >= 0).sum())
    # 2. routing with same-domain preference
    inst_expert0, inst_rank0 = instance_tables(main_rank, slot_expert)
    route0 = even_split(omega, inst_expert0, inst_rank0, topology, "domain")
    U0 = route0.sum(0)

    # 3. intra-node refinement on Python ints
    U = U0.tolist()
    L = torch.zeros(R, dtype=torch.int64).index_add_(0, inst_rank0.cpu(), U0.cpu()).tolist()
    se = slot_expert.tolist()
    hosted = [dict() for _ in range(R)]
    for e, r in enumerate(main_rank.tolist()):
        hosted[r][e] = e
    free_slots = [[] for _ in range(R)]
    for r in range(R):
        for j in range(N):
            if se[r][j] >= 0:
                hosted[r][se[r][j]] = E + r * N + j
            else:
                free_slots[r].append(j)
    iters = [refine_domain(d, topology, E, N, hosted, free_slots, U, L, se) for d in range(topology.num_domains)]
    slot_expert = torch.tensor(se, dtype=torch.int64, device=dev).view(R, N)
    U = torch.tensor(U, dtype=torch.int64, device=dev)

    # 4. drop replicas that serve nothing
    slot_load = U[E:].view(R, N)
    slot_expert = torch.where(slot_load > 0, slot_expert, -1)

    # 5. per-source routing inside each (expert, domain) group
    inst_expert, inst_rank = instance_tables(main_rank, slot_expert)
    M = topology.num_domains
    dom = topology.domain_of.to(dev)
    # amounts per source and group from step 2; refinement only moves load inside a group
    group0 = torch.where(inst_expert0 >= 0, inst_expert0 * M + dom[inst_rank0], -1)
    amount = torch.zeros(R, E * M, dtype=torch.int64, device=dev).index_add_(1, group0.clamp(min=0),
                                                                              torch.where(group0 >= 0, route0, 0))
    group = torch.where(inst_expert >= 0, inst_expert * M + dom[inst_rank], -1)
    route = interval_route(amount, group, torch.where(inst_expert >= 0, U, 0))

    info = {"refine_iters": iters, "stage1_replicas": stage1_replicas}
    plan = Plan(omega=omega, topology=topology, num_slots=N, main_rank=main_rank, slot_expert=slot_expert,
                route=route, policy="topoep", info=info, **common)
    # 6. never worse than static in the bottleneck
    if int(plan.rank_load.max()) > int(static.rank_load.max()):
        static.policy = "topoep"
        static.info = {**info, "fallback": "static"}
        return static
    return plan
