"""Building blocks shared by all policies: instance tables, the token split, the group-wise interval
routing, a top-k with lowest-index ties, the two-level cost model (`two_level_costs`,
`hierarchical_route`) that the `joint` policy and the compact MILP share, and the integer measures that the
`joint` and `topoep_plus` guards compare (`modelled_fs`, `max_load_and_inter`). Pure PyTorch, integer
arithmetic only, every tie broken by the lowest index.

Shapes: R ranks, E experts, N slots per rank, P = E + R * N physical instances (see `topoep.plan`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from topoep.topology import Topology

if TYPE_CHECKING:
    from topoep.plan import Plan

LOCALITIES = ("none", "domain", "rank")


def instance_tables(main_rank: torch.Tensor, slot_expert: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(instance_expert: int64[P] with -1 for empty slots, instance_rank: int64[P])."""
    R, N = slot_expert.shape
    E = main_rank.numel()
    dev = slot_expert.device
    inst_expert = torch.cat([torch.arange(E, device=dev), slot_expert.reshape(-1)])
    inst_rank = torch.cat([main_rank, torch.arange(R, device=dev).repeat_interleave(N)])
    return inst_expert, inst_rank


def group_exclusive_cumsum(values: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """For int64[P] values and group ids (-1 = no group), the sum of the values of the elements of the
    same group that come before each element in index order. Elements with group -1 get 0."""
    P = group.numel()
    dev = group.device
    idx = torch.arange(P, device=dev)
    valid = group >= 0
    g = torch.where(valid, group, group.max().clamp(min=0) + 1)
    order = torch.argsort(g * P + idx)  # group-major, index order inside a group
    v_sorted = torch.where(valid, values, 0)[order]
    csum = torch.cumsum(v_sorted, 0) - v_sorted
    g_sorted = g[order]
    first = torch.ones(P, dtype=torch.bool, device=dev)
    first[1:] = g_sorted[1:] != g_sorted[:-1]
    seg_start = torch.cummax(torch.where(first, idx, 0), 0).values
    out = torch.empty_like(csum)
    out[order] = csum - csum[seg_start]
    return torch.where(valid, out, 0)


def rank_within_group(group: torch.Tensor) -> torch.Tensor:
    """Position of each element among the elements of its group, in index order (0 for the first)."""
    return group_exclusive_cumsum(torch.ones_like(group), group)


def even_split(omega: torch.Tensor, inst_expert: torch.Tensor, inst_rank: torch.Tensor,
               topology: Topology, locality: str) -> torch.Tensor:
    """route: int64[R, P]. Each omega[s, e] is split as evenly as possible over a selected set of e's
    instances: with locality "domain" the instances in the source's domain when there are any, with
    "rank" the instance on the source rank itself when there is one, otherwise (and for "none") all
    instances of e. Instance i of n selected (in instance order) gets omega // n, plus one if
    (i - s) mod n < omega mod n: the remainder is rotated by the source rank so that small demands
    do not all land on the main instance."""
    assert locality in LOCALITIES, locality
    R, E = omega.shape
    dev = omega.device
    valid = inst_expert >= 0
    e_of = inst_expert.clamp(min=0)
    src = torch.arange(R, device=dev)
    n_all = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, e_of, valid.long())  # instances per expert
    pos_all = rank_within_group(torch.where(valid, e_of, -1))
    if locality == "none":
        sel = valid[None, :].expand(R, -1)
        n = n_all[e_of][None, :].expand(R, -1)
        pos = pos_all[None, :].expand(R, -1)
    else:
        if locality == "domain":
            M = topology.num_domains
            unit_of_rank = topology.domain_of.to(dev)
            num_units = M
        else:
            unit_of_rank = torch.arange(R, device=dev)
            num_units = R
        p_unit = unit_of_rank[inst_rank]
        key = torch.where(valid, e_of * num_units + p_unit, -1)
        n_unit = torch.zeros(E * num_units, dtype=torch.int64, device=dev).index_add_(
            0, key.clamp(min=0), valid.long())  # instances of e in each unit
        pos_unit = rank_within_group(key)
        s_unit = unit_of_rank[src]
        n_local = n_unit.view(E, num_units)[e_of[None, :], s_unit[:, None]]  # [R, P]
        has_local = n_local > 0
        same = p_unit[None, :] == s_unit[:, None]
        sel = valid[None, :] & (same | ~has_local)
        n = torch.where(has_local, n_local, n_all[e_of][None, :])
        pos = torch.where(has_local, pos_unit[None, :], pos_all[None, :])
    w = omega[:, e_of]  # [R, P]
    n_safe = n.clamp(min=1)
    base, rem = w // n_safe, w % n_safe
    extra = ((pos - src[:, None]) % n_safe) < rem
    route = torch.where(sel, base + extra.long(), 0)
    return route


def interval_route(amount: torch.Tensor, inst_group: torch.Tensor, inst_load: torch.Tensor) -> torch.Tensor:
    """route: int64[R, P] realising per-instance loads U from per-source amounts, group by group.

    amount: int64[R, G], what source s sends to group g (a set of instances of one expert);
    inst_group: int64[P], the group of each instance (-1 for none); inst_load: int64[P] with
    sum over a group == sum over sources of amount[:, g].
    Within a group, sources in increasing rank order fill instances in increasing index order
    (the overlap of [cumA_s, cumA_s + A_s) with [cumU_p, cumU_p + U_p)), so each source talks to as
    few instances as possible and the mapping is a pure function of its inputs.
    """
    R, G = amount.shape
    valid = inst_group >= 0
    g = inst_group.clamp(min=0)
    cumA = torch.cumsum(amount, 0) - amount  # exclusive over sources, [R, G]
    cumU = group_exclusive_cumsum(inst_load, inst_group)  # exclusive over a group's instances, [P]
    a_lo = cumA[:, g]
    a_hi = a_lo + amount[:, g]
    u_lo = cumU[None, :]
    u_hi = u_lo + inst_load[None, :]
    overlap = (torch.minimum(a_hi, u_hi) - torch.maximum(a_lo, u_lo)).clamp(min=0)
    return torch.where(valid[None, :], overlap, 0)


def top_k(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest entries of each row of values [X, Y], largest first and,
    among equal values, lowest index first (torch.topk does not promise that order)."""
    idx = torch.sort(-values, dim=1, stable=True).indices[:, :k]
    return values.gather(1, idx), idx


def static_rank_load(omega: torch.Tensor, main_rank: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """int64[R]: rank loads with main instances only."""
    return torch.zeros(num_ranks, dtype=torch.int64, device=omega.device).index_add_(0, main_rank, omega.sum(0))


def two_level_costs(topology: Topology) -> tuple[int, int, bool]:
    """(a, b, exact): femtoseconds per byte between two ranks of one domain (a) and of two domains
    (b >= a), and whether the cost matrix is exactly two-level. Otherwise a and b are the integer means
    of the intra- and inter-domain entries (b raised to a if lower)."""
    c = topology.cost_fs
    R = topology.num_ranks
    dom = topology.domain_of
    same = dom[:, None] == dom[None, :]
    off = ~torch.eye(R, dtype=torch.bool)
    intra, inter = c[same & off], c[~same]
    a = int(intra.sum()) // intra.numel() if intra.numel() else 0
    b = int(inter.sum()) // inter.numel() if inter.numel() else a
    exact = bool((intra == a).all()) and bool((inter == b).all()) and b >= a
    return a, max(a, b), exact


def hierarchical_route(omega: torch.Tensor, topology: Topology, main_rank: torch.Tensor,
                       slot_expert: torch.Tensor, inst_load: torch.Tensor) -> torch.Tensor:
    """route int64[R, P] realising per-instance loads inst_load[P] (P = E + R * N) at the lowest
    routing cost on a two-level topology: each instance first serves its own rank's demand, then its
    domain's (sources and instances in index order), then any source. On such a topology the cost of
    the result is 2 S_tok (a sum_{e,r} (omega[r, e] - U[e, r])^+ + (b - a) sum_{e,d} (D[d, e] - U_d[e])^+)
    (a, b from `two_level_costs`; U[e, r] the load of e's instance on r, U_d its sum over domain d)."""
    R, E = omega.shape
    M, dev = topology.num_domains, omega.device
    ie, ir = instance_tables(main_rank, slot_expert)
    valid = ie >= 0
    e_p = ie.clamp(min=0)
    P = ie.numel()
    u = torch.where(valid, inst_load, 0)
    dom = topology.on(dev).domain_of  # (copied once per device: no copy in a CUDA graph's capture)
    # 1. own rank
    loc = torch.where(valid, torch.minimum(omega[ir, e_p], u), 0)
    route = torch.zeros(R, P, dtype=torch.int64, device=dev)
    route[ir, torch.arange(P, device=dev)] = loc
    w = omega.clone()
    w.index_put_((ir, e_p), -loc, accumulate=True)  # (loc is 0 for empty slots: no mask, no host synchronisation)
    u = u - loc
    # 2. own domain: groups (e, d); sources and instances take the matched amount in index order
    g = torch.where(valid, e_p * M + dom[ir], -1)
    src_g = torch.arange(E, device=dev)[None, :] * M + dom[:, None]  # [R, E]
    A = torch.zeros(R, E * M, dtype=torch.int64, device=dev).scatter_(1, src_g, w)
    cap = torch.zeros(E * M, dtype=torch.int64, device=dev).index_add_(0, g.clamp(min=0), torch.where(valid, u, 0))
    m = torch.minimum(cap, A.sum(0))
    a = torch.minimum((m[None, :] - (torch.cumsum(A, 0) - A)).clamp(min=0), A)
    c = torch.where(valid, torch.minimum((m[g.clamp(min=0)] - group_exclusive_cumsum(u, g)).clamp(min=0), u), 0)
    route += interval_route(a, g, c)
    w = w - a.gather(1, src_g)
    u = u - c
    # 3. any source: groups e
    return route + interval_route(w, torch.where(valid, e_p, -1), u)


def modelled_fs(plan: Plan, t_fs: int) -> int:
    """Modelled time of eq. 8 in integer fs: t_fs L_max + 2 S_tok sum_{s,p} route[s, p] c_fs[s, rank(p)]
    + W sum over replicas c_fs[main(e), r] (int64 sums; `metrics` gives it in float seconds)."""
    dev = plan.route.device
    c = plan.topology.cost_fs.to(dev)
    tok = (plan.route * c[:, plan.instance_rank]).sum()
    occ = plan.slot_expert >= 0
    rep_main = plan.main_rank[plan.slot_expert.clamp(min=0)]
    rep = torch.where(occ, c[rep_main, torch.arange(plan.num_ranks, device=dev)[:, None]], 0).sum()
    return t_fs * int(plan.rank_load.max()) + 2 * plan.token_bytes * int(tok) + plan.expert_bytes * int(rep)


def max_load_and_inter(plan: Plan) -> tuple[int, int]:
    """(L_max, assignments executed outside their source's domain)."""
    dom = plan.topology.domain_of.to(plan.route.device)
    return int(plan.rank_load.max()), int((plan.route * (dom[:, None] != dom[plan.instance_rank][None, :])).sum())
