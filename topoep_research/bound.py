"""Lower bounds on problem (8) for instances too large for the exact MILP (`topoep_research.milp`), so
that every heuristic's distance to the optimum is visible at the Fig. 10 scale.

`makespan_lower_bound` (combinatorial, any topology, C4 ignored so valid for every policy): the smallest
cap T for which the slot budget can possibly suffice. A plan with L_max <= T gives expert e at least
ceil(Omega_e / T) instances, and the main experts of rank r (total demand S_r) at least
ceil((S_r - T) / T) replicas between them (rank r keeps at most T); each replica belongs to one main
rank, so the sum over ranks of max(both counts) is at most R * N. A replica carries at most T and only
one expert's assignments, so the second count is the number of largest chunks (T-sized pieces of each
expert, then its remainder) whose sum reaches S_r - T. Also T >= ceil(total / R) and, with
N = 0, T >= the static maximum. Monotone in T, found by bisection.

`lp_lower_bound` (problem (8) with C4, two-level costs): the LP relaxation of the compact model of
`milp.compact_model`, strengthened per interval of L_max. For L_max in [T_i, T_{i+1}]: L_r <= T_{i+1},
U[e, r] <= min(Omega_e, T_{i+1}) x[e, r], sum_r x[e, r] >= ceil(Omega_e / T_{i+1}) and L_max >= T_i.
Each interval's LP bounds every plan whose L_max lies in it, so the minimum over intervals (the first
starting at the combinatorial makespan bound, the last unbounded above) bounds problem (8).
Without the interval cuts the LP would let a replica of weight x = U / Omega cost only x * W * c; with
them a replica that carries U assignments costs at least U / T_{i+1} of a transfer and of a slot.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch

from topoep.metrics import DEFAULT_T_FFN
from topoep.plan import default_main_rank
from topoep.topology import Topology


def _slot_need(tot: np.ndarray, mains: list[np.ndarray], T: int) -> int:
    """Fewest replicas a plan with L_max <= T needs (a lower bound; see the module docstring)."""
    need = 0
    for ex in mains:
        w = tot[ex]
        per_expert = int(np.sum(np.maximum(-(-w // T) - 1, 0)))
        excess = int(w.sum()) - T
        chunks = 0
        if excess > 0:  # replicas carry <= min(T, what is left of one expert): largest chunks first
            full = w // T
            parts = np.concatenate([np.full(int(full.sum()), T, dtype=np.int64), w % T])
            parts = np.sort(parts[parts > 0])[::-1]
            chunks = int(np.searchsorted(np.cumsum(parts), excess) + 1)
            if chunks > parts.size:
                return 1 << 62
        need += max(per_expert, chunks)
    return need


def makespan_lower_bound(omega: torch.Tensor, num_slots: int, main_rank: torch.Tensor | None = None) -> int:
    """Lower bound on L_max (assignments) of any plan with num_slots replica slots per rank."""
    omega = omega.cpu().to(torch.int64)
    R, E = omega.shape
    main = (default_main_rank(E, R) if main_rank is None else main_rank.cpu()).numpy()
    tot = omega.sum(0).numpy()
    total = int(tot.sum())
    static_max = int(np.bincount(main, weights=tot, minlength=R).max()) if total else 0
    if total == 0:
        return 0
    if num_slots == 0:
        return static_max
    mains = [np.nonzero(main == r)[0] for r in range(R)]
    lo = max(-(-total // R), int(-(-tot.max() // R)))
    hi = max(lo, static_max)
    while lo < hi:  # smallest T with slot need <= R * N
        mid = (lo + hi) // 2
        if _slot_need(tot, mains, mid) <= R * num_slots:
            hi = mid
        else:
            lo = mid + 1
    return lo


@dataclass
class LpBound:
    bound: float  # seconds: no plan (C4 respected) has a lower modelled time
    makespan_bound: int  # assignments: L_max lower bound used as the first interval's start
    intervals: list  # [(T_lo, T_hi, lp value in seconds or inf)]
    seconds: float


def lp_lower_bound(omega: torch.Tensor, topology: Topology, *, num_slots: int, expert_bytes: int,
                   token_bytes: int, t_ffn: float = DEFAULT_T_FFN, main_rank: torch.Tensor | None = None,
                   enforce_c4: bool = True, num_intervals: int = 8) -> LpBound:
    """Lower bound on the modelled time of problem (8) (see module docstring). Needs two-level costs."""
    from scipy.optimize import linprog

    from topoep_research.milp import compact_model

    t0 = time.perf_counter()
    omega = omega.cpu().to(torch.int64)
    R, E = omega.shape
    main = default_main_rank(E, R) if main_rank is None else main_rank.cpu()
    m = compact_model(omega, topology, num_slots, expert_bytes, token_bytes, main, t_ffn, "time", enforce_c4)
    tot = omega.sum(0).numpy()
    mb = makespan_lower_bound(omega, num_slots, main)
    static_max = int(np.bincount(main.numpy(), weights=tot, minlength=R).max())
    # interval ends: geometric from the makespan bound to the static maximum, then unbounded
    ends = sorted({int(round(mb * (static_max / mb) ** (i / num_intervals))) for i in range(1, num_intervals + 1)}
                  | {static_max}) if mb > 0 else [static_max]
    ends = [e for e in ends if e > mb] or [max(mb, 1)]
    nU = E * R
    il = m.lmax_col
    A = m.A.tocsr()
    # the slot-count cut: sum_r x[e, r] >= ceil(Omega_e / T_hi), as -sum_r x <= -need
    from scipy.sparse import coo_matrix, vstack

    rows = np.repeat(np.arange(E), R)
    cols = nU + np.arange(nU)
    cut = coo_matrix((-np.ones(nU), (rows, cols)), shape=(E, m.cost.size)).tocsr()
    A_all = vstack([A, cut]).tocsr()
    results = []
    lo_T = mb
    for hi_T in ends + [None]:
        lb, ub = m.lb.copy(), m.ub.copy()
        lb[il] = lo_T
        lo = np.concatenate([m.lo, np.full(E, -np.inf)])
        hi = np.concatenate([m.hi, np.zeros(E)])
        if hi_T is not None:
            ub[il] = hi_T
            ub[:nU] = np.minimum(ub[:nU], hi_T)
            need = -(-tot // hi_T)
            hi[-E:] = -need.astype(float)
            extra = _cap_rows(E, R, main.numpy(), tot, hi_T, m.cost.size)  # U <= min(Omega, T_hi) x
            A_use = vstack([A_all, extra]).tocsr()
            lo_use = np.concatenate([lo, np.full(extra.shape[0], -np.inf)])
            hi_use = np.concatenate([hi, np.zeros(extra.shape[0])])
        else:
            A_use, lo_use, hi_use = A_all, lo, hi
        # linprog wants A_ub x <= b_ub and A_eq x = b_eq: split the two-sided rows
        eq = np.isfinite(lo_use) & np.isfinite(hi_use) & (lo_use == hi_use)
        up = np.isfinite(hi_use) & ~eq
        dn = np.isfinite(lo_use) & ~eq
        A_ub = vstack([A_use[up], -A_use[dn]]).tocsr()
        b_ub = np.concatenate([hi_use[up], -lo_use[dn]])
        res = linprog(m.cost, A_ub=A_ub, b_ub=b_ub, A_eq=A_use[eq], b_eq=hi_use[eq],
                      bounds=np.stack([lb, ub], 1), method="highs")
        val = (res.fun + m.const) * t_ffn if res.status == 0 else math.inf
        results.append((lo_T, hi_T, val))
        if hi_T is not None:
            lo_T = hi_T
    best = min(v for _, _, v in results)
    return LpBound(best, mb, results, time.perf_counter() - t0)


def _cap_rows(E, R, main, tot, T, ncols):
    """Rows U[e, r] - min(Omega_e, T) x[e, r] <= 0 for r != main(e) (x of a main is fixed at 1)."""
    from scipy.sparse import coo_matrix

    nU = E * R
    rows, cols, vals = [], [], []
    k = 0
    for e in range(E):
        c = float(min(tot[e], T))
        for r in range(R):
            if r == main[e] or c >= tot[e]:
                continue
            rows += [k, k]
            cols += [e * R + r, nU + e * R + r]
            vals += [1.0, -c]
            k += 1
    return coo_matrix((vals, (rows, cols)), shape=(k, ncols)).tocsr()


# ---------------------------------------------------------------------------------------------------------------
# The per-link lower bound


def link_objective(plan, guard, t_ffn: float, exposed_transfers: int = 1) -> float:
    """The per-link time the guard predicts for `plan` (`topoep.runtime.NetBenefitGuard`, rows per assignment, its
    topology's costs), latencies and planning left out: X(plan) + n * T_fetch(plan), X = x + m t - h min(x, m t),
    x = t_ffn L_max, t = one dispatch at its busiest link, T_fetch = one direct replica fetch at its busiest link.
    What `link_lower_bound` bounds."""
    from topoep.links import replica_matrix, transfer_seconds

    x = t_ffn * float(plan.rank_load.max())
    t = float(guard.dispatch_time(plan))
    m, h = guard.token_transfers, guard.token_overlap
    fetch = float(transfer_seconds(replica_matrix(plan).double() * float(plan.expert_bytes), plan.topology))
    return x + m * t - h * min(x, m * t) + exposed_transfers * fetch


@dataclass
class LinkBound:
    bound: float  # seconds: no plan (C1-C3, direct fetches) has a smaller link_objective
    seconds: float  # the LP's solve time


def link_lower_bound(omega: torch.Tensor, topology: Topology, *, num_slots: int, expert_bytes: int, token_bytes: int,
                     guard=None, t_ffn: float = DEFAULT_T_FFN, exposed_transfers: int = 1,
                     main_rank: torch.Tensor | None = None) -> LinkBound:
    """Lower bound on `link_objective` over every plan of omega with num_slots slots per rank (C1-C3; C4 ignored, so
    valid for every policy): an LP over the plan's link loads. Variables: z[e, r] the assignments of expert e run on
    rank r, y[e, r] in [0, 1] a replica of e on r (r not e's main rank; sum_e y[e, r] <= N), f[s, r] the rows source
    s sends to rank r, and the layer's terms L_max, t, T_fetch, X.

        sum_r z[e, r] = Omega_e          z[e, r] <= Omega_e y[e, r]         sum_e z[e, r] <= L_max
        sum_r f[s, r] = rows of s        sum_s f[s, r] = sum_e z[e, r]
        f[s, r] <= sum over e held on r (main, or y[e, r]) of omega[s, e]   (a source sends to r only what r holds)
        t >= S c * (rows on each NVLink port and NIC, each direction)      T_fetch >= W c * (replicas on each link)
        X >= (1 - h) t_ffn L_max + m t,  X >= t_ffn L_max + (1 - h) m t     (X = x + m t - h min(x, m t): convex)
        minimise X + n T_fetch

    Every plan gives a feasible point with the objective it has (z, f from its route, y its replicas), so the LP's
    optimum bounds them all. Relaxed: fractional replicas, and a source's rows split over ranks without naming the
    expert behind each row."""
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    from topoep.runtime.guard import NetBenefitGuard

    t0 = time.perf_counter()
    guard = guard or NetBenefitGuard()
    omega = omega.cpu().to(torch.int64)
    R, E = omega.shape
    om = omega.numpy().astype(float)
    main = (default_main_rank(E, R) if main_rank is None else main_rank.cpu()).numpy()
    dom = np.arange(R) // topology.ranks_per_domain
    us = 1e6  # the LP's times in microseconds (better scaled than seconds next to row counts)
    c_in, c_out, t_ffn_us = us * float(topology.intra_cost), us * float(topology.inter_cost), us * t_ffn
    W, S, N, n = float(expert_bytes), float(token_bytes), num_slots, exposed_transfers
    m, h = guard.token_transfers, guard.token_overlap
    tot = om.sum(0)
    # columns
    nz = E * R
    z0, y0, f0 = 0, nz, 2 * nz
    iL, it, iF, iX = 2 * nz + R * R, 2 * nz + R * R + 1, 2 * nz + R * R + 2, 2 * nz + R * R + 3
    ncol = iX + 1
    e_of, r_of = np.repeat(np.arange(E), R), np.tile(np.arange(R), E)
    is_main = main[e_of] == r_of
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(rs, cs, vs):
        rows.append(np.asarray(rs)), cols.append(np.asarray(cs)), vals.append(np.asarray(vs, dtype=float))

    k = 0  # next row
    # sum_r z[e, r] = Omega_e
    add(k + e_of, z0 + np.arange(nz), np.ones(nz))
    lo.append(tot), hi.append(tot)
    k += E
    # z[e, r] - Omega_e y[e, r] <= 0 off the main rank
    off = np.flatnonzero(~is_main)
    add(k + np.arange(off.size), z0 + off, np.ones(off.size))
    add(k + np.arange(off.size), y0 + off, -tot[e_of[off]])
    lo.append(np.full(off.size, -np.inf)), hi.append(np.zeros(off.size))
    k += off.size
    # sum_e y[e, r] <= N
    add(k + r_of[off], y0 + off, np.ones(off.size))
    lo.append(np.full(R, -np.inf)), hi.append(np.full(R, float(N)))
    k += R
    # sum_r f[s, r] = rows of s;  sum_s f[s, r] - sum_e z[e, r] = 0
    s_of, d_of = np.repeat(np.arange(R), R), np.tile(np.arange(R), R)
    add(k + s_of, f0 + np.arange(R * R), np.ones(R * R))
    lo.append(om.sum(1)), hi.append(om.sum(1))
    k += R
    add(k + d_of, f0 + np.arange(R * R), np.ones(R * R))
    add(k + r_of, z0 + np.arange(nz), -np.ones(nz))
    lo.append(np.zeros(R)), hi.append(np.zeros(R))
    k += R
    # f[s, r] - sum_{e replicated on r} omega[s, e] y[e, r] <= sum_{e main on r} omega[s, e]
    held_main = np.zeros((R, R))
    np.add.at(held_main, (slice(None), main), om)  # [s, r]: rows of s for r's main experts
    for s in range(R):
        es = np.flatnonzero(om[s] > 0)
        cand = [(e, r) for e in es for r in range(R) if main[e] != r]
        if cand:
            ce, cr = np.array(cand).T
            add(k + s * R + cr, y0 + ce * R + cr, -om[s, ce])
    add(k + np.arange(R * R), f0 + np.arange(R * R), np.ones(R * R))
    lo.append(np.full(R * R, -np.inf)), hi.append(held_main.reshape(-1))
    k += R * R
    # sum_e z[e, r] - L_max <= 0
    add(k + r_of, z0 + np.arange(nz), np.ones(nz))
    add(k + np.arange(R), np.full(R, iL), -np.ones(R))
    lo.append(np.full(R, -np.inf)), hi.append(np.zeros(R))
    k += R
    # token links: per rank, NVLink out / in and NIC out / in, each <= t
    same = dom[s_of] == dom[d_of]
    moved = s_of != d_of
    for kind, c in ((same & moved, S * c_in), (~same, S * c_out)):
        sel = np.flatnonzero(kind)
        for side in (s_of, d_of):  # out of the source, into the destination
            add(k + side[sel], f0 + sel, np.full(sel.size, c))
            add(k + np.arange(R), np.full(R, it), -np.ones(R))
            lo.append(np.full(R, -np.inf)), hi.append(np.zeros(R))
            k += R
    # replica links: copies from the main rank main[e] to r
    m_of = main[e_of[off]]
    same_r = dom[m_of] == dom[r_of[off]]
    for kind, c in ((same_r, W * c_in), (~same_r, W * c_out)):
        sel = off[kind]
        for side in (main[e_of[sel]], r_of[sel]):
            add(k + side, y0 + sel, np.full(sel.size, c))
            add(k + np.arange(R), np.full(R, iF), -np.ones(R))
            lo.append(np.full(R, -np.inf)), hi.append(np.zeros(R))
            k += R
    # X >= (1 - h) t_ffn L + m t and X >= t_ffn L + (1 - h) m t
    for a, b in (((1 - h) * t_ffn_us, m), (t_ffn_us, (1 - h) * m)):
        add([k, k, k], [iL, it, iX], [a, b, -1.0])
        lo.append([-np.inf]), hi.append([0.0])
        k += 1
    A = coo_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(k, ncol)).tocsr()
    lo, hi = np.concatenate([np.asarray(v, dtype=float) for v in lo]), np.concatenate([np.asarray(v, dtype=float)
                                                                                       for v in hi])
    bounds = np.zeros((ncol, 2))
    bounds[:, 1] = np.inf
    bounds[y0:y0 + nz, 1] = np.where(is_main, 0.0, 1.0)
    cost = np.zeros(ncol)
    cost[iX], cost[iF] = 1.0, float(n)
    eq = lo == hi
    from scipy.sparse import vstack

    res = linprog(cost, A_ub=vstack([A[~eq & np.isfinite(hi)], -A[~eq & np.isfinite(lo)]]).tocsr(),
                  b_ub=np.concatenate([hi[~eq & np.isfinite(hi)], -lo[~eq & np.isfinite(lo)]]),
                  A_eq=A[eq], b_eq=hi[eq], bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"the per-link LP did not solve: {res.message}")
    return LinkBound(bound=float(res.fun) / us, seconds=time.perf_counter() - t0)
