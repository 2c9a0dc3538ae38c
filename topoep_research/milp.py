"""Problem (8) of the paper as a mixed-integer program, solved exactly with HiGHS (scipy.optimize.milp).

Only for small instances (R <= 8, E <= 32: R*E*R integer routing variables): it measures how far each
heuristic is from the optimum, in tests and in bench/plan_quality.py.

Variables: x[e, r] binary (rank r hosts an instance of e), q[s, e, r] integer >= 0, L_max continuous.
    minimise  t_ffn L_max + 2 S_tok sum c[s, r] q[s, e, r] + W sum_{r != main(e)} c[main(e), r] x[e, r]
    s.t.      C1 sum_r q[s, e, r] = omega[s, e]        C2 q[s, e, r] <= omega[s, e] x[e, r]
              C3 sum_{e: main(e) != r} x[e, r] <= N     C5 x[e, main(e)] = 1
              C4 (optional) x[e, r] = 0 if dom(r) != dom(main(e)) and W >= 2 D[dom(r), e] S_tok
              L_max >= sum_{s, e} q[s, e, r] for every r
With objective="makespan" only L_max is minimised (pure balance, the one-domain benchmark).

formulation="compact" solves the same problem with E * R integer instance loads instead of R * E * R
routing variables. It is exact when the cost matrix is two-level (one per-byte cost inside a domain,
one between domains, as every `Topology` built from scalars): routing on a tree metric is a
transportation problem whose optimum, for given instance loads U[e, r], is

    T_token = 2 S_tok (a sum_{e,r} (omega[r, e] - U[e, r])^+ + (b - a) sum_{e,d} (D[d, e] - U_d[e])^+)

(a, b: intra- and inter-domain cost; U_d[e] = sum of U[e, r] over the ranks of d): every instance
first serves its own rank, then its own domain (`topoep.planners.common.hierarchical_route` builds
that routing). The model keeps the captured amounts z[e, r] <= min(omega[r, e] x[e, r], U[e, r]) and
y[e, d] <= min(D[d, e], U_d[e]) and maximises them; it is several times smaller, which is what makes
the 500-instance study of bench/plan_quality.py affordable. `compact_model` is also the LP that
`topoep_research.bound` relaxes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from topoep.metrics import DEFAULT_T_FFN
from topoep.plan import Plan, default_main_rank, domain_demand
from topoep.topology import Topology

MAX_RANKS, MAX_EXPERTS = 8, 32


@dataclass
class MilpResult:
    plan: Plan | None
    objective: float  # seconds (time) or assignments (makespan); inf when no solution was found
    bound: float  # HiGHS dual bound, same unit
    optimal: bool
    status: str
    seconds: float

    @property
    def gap(self) -> float:
        """Relative gap between the solution and the dual bound (0 when proven optimal)."""
        if not np.isfinite(self.objective) or self.objective <= 0:
            return 0.0 if self.objective == self.bound else float("inf")
        return max(0.0, (self.objective - self.bound) / self.objective)


def solve_milp(omega: torch.Tensor, topology: Topology, *, num_slots: int, expert_bytes: int, token_bytes: int,
               main_rank: torch.Tensor | None = None, t_ffn: float = DEFAULT_T_FFN, objective: str = "time",
               enforce_c4: bool = True, time_limit: float = 60.0, allow_large: bool = False,
               formulation: str = "full") -> MilpResult:
    """Exact optimum of problem (8) (or of the makespan) for a small instance; see module docstring."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_matrix

    omega = omega.cpu().to(torch.int64)
    R, E = omega.shape
    if not allow_large and (R > MAX_RANKS or E > MAX_EXPERTS):
        raise ValueError(f"the MILP is for small instances (R <= {MAX_RANKS}, E <= {MAX_EXPERTS}); got R={R}, "
                         f"E={E}. Pass allow_large=True to try anyway")
    if objective not in ("time", "makespan"):
        raise ValueError(f"objective must be 'time' or 'makespan', got {objective!r}")
    if formulation not in ("full", "compact"):
        raise ValueError(f"formulation must be 'full' or 'compact', got {formulation!r}")
    main = default_main_rank(E, R) if main_rank is None else main_rank.cpu()
    if formulation == "compact":
        return _solve_compact(omega, topology, num_slots, expert_bytes, token_bytes, main, t_ffn, objective,
                              enforce_c4, time_limit)
    om = omega.numpy()
    c = topology.cost.numpy()
    dom = topology.domain_of.numpy()
    mr = main.numpy()
    D = domain_demand(omega, topology).numpy()
    nx, nq = E * R, R * E * R
    n = nx + nq + 1
    ix = lambda e, r: e * R + r  # noqa: E731
    iq = lambda s, e, r: nx + (s * E + e) * R + r  # noqa: E731
    il = nx + nq

    # objective, scaled by 1 / t_ffn (units of "assignments") for numerical comfort
    cost = np.zeros(n)
    cost[il] = 1.0
    if objective == "time":
        scale = 1.0 / t_ffn
        for s in range(R):
            for e in range(E):
                for r in range(R):
                    cost[iq(s, e, r)] = 2 * token_bytes * c[s, r] * scale
        for e in range(E):
            for r in range(R):
                if r != mr[e]:
                    cost[ix(e, r)] = expert_bytes * c[mr[e], r] * scale

    lb, ub = np.zeros(n), np.zeros(n)
    ub[:nx] = 1.0
    for e in range(E):
        lb[ix(e, mr[e])] = 1.0
        if enforce_c4:
            for r in range(R):
                if dom[r] != dom[mr[e]] and not expert_bytes < 2 * D[dom[r], e] * token_bytes:
                    ub[ix(e, r)] = 0.0
    for s in range(R):
        for e in range(E):
            ub[iq(s, e, 0):iq(s, e, 0) + R] = om[s, e]
    ub[il] = np.inf
    integrality = np.ones(n)
    integrality[il] = 0

    rows, cols, vals, lo, hi = [], [], [], [], []
    row = 0

    def add(entries, low, high):
        nonlocal row
        for col, v in entries:
            rows.append(row)
            cols.append(col)
            vals.append(v)
        lo.append(low)
        hi.append(high)
        row += 1

    for s in range(R):  # C1
        for e in range(E):
            add([(iq(s, e, r), 1.0) for r in range(R)], om[s, e], om[s, e])
    for s in range(R):  # C2
        for e in range(E):
            if om[s, e] > 0:
                for r in range(R):
                    if r != mr[e]:
                        add([(iq(s, e, r), 1.0), (ix(e, r), -float(om[s, e]))], -np.inf, 0.0)
    for r in range(R):  # C3
        add([(ix(e, r), 1.0) for e in range(E) if mr[e] != r], -np.inf, num_slots)
    for r in range(R):  # load
        add([(iq(s, e, r), 1.0) for s in range(R) for e in range(E)] + [(il, -1.0)], -np.inf, 0.0)

    A = coo_matrix((vals, (rows, cols)), shape=(row, n)).tocsr()
    t0 = time.perf_counter()
    res = milp(cost, constraints=LinearConstraint(A, lo, hi), integrality=integrality, bounds=Bounds(lb, ub),
               options={"time_limit": time_limit, "disp": False, "mip_rel_gap": 1e-9})
    seconds = time.perf_counter() - t0
    unit = t_ffn if objective == "time" else 1.0
    bound = getattr(res, "mip_dual_bound", None)
    bound = float(bound) * unit if bound is not None and np.isfinite(bound) else 0.0
    if res.x is None:
        return MilpResult(None, float("inf"), bound, False, res.message, seconds)
    sol = np.round(res.x).astype(np.int64)
    x = torch.from_numpy(sol[:nx].reshape(E, R).astype(bool))
    q = torch.from_numpy(sol[nx:nx + nq].reshape(R, E, R))
    plan = Plan.from_dense(x & (q.sum(0) > 0) | _main_mask(mr, E, R), q, omega, topology, num_slots=num_slots,
                           main_rank=main, policy="milp", expert_bytes=expert_bytes, token_bytes=token_bytes)
    return MilpResult(plan, float(res.fun) * unit, bound, res.status == 0, res.message, seconds)


def _main_mask(mr, E, R) -> torch.Tensor:
    m = torch.zeros(E, R, dtype=torch.bool)
    m[torch.arange(E), torch.as_tensor(mr)] = True
    return m


@dataclass
class CompactModel:
    """The compact MILP (module docstring) in scipy.optimize.milp form. Columns: U[e, r] (E * R), x[e, r]
    (E * R), z[e, r] (E * R), y[e, d] (E * M), L_max. Objective in units of t_ffn (time) or assignments
    (makespan); `const` is the constant to add (same unit)."""
    cost: np.ndarray
    A: object
    lo: np.ndarray
    hi: np.ndarray
    lb: np.ndarray
    ub: np.ndarray
    integrality: np.ndarray
    const: float
    num_experts: int
    num_ranks: int

    @property
    def lmax_col(self) -> int:
        return self.cost.size - 1


def compact_model(omega, topology, num_slots, expert_bytes, token_bytes, main, t_ffn=DEFAULT_T_FFN,
                  objective="time", enforce_c4=True) -> CompactModel:
    """Build the compact model; raises ValueError unless the topology's costs are two-level."""
    from scipy.sparse import coo_matrix

    from topoep.planners.common import two_level_costs
    from topoep.topology import FEMTO

    R, E = omega.shape
    M, rpd = topology.num_domains, topology.ranks_per_domain
    a_fs, b_fs, exact = two_level_costs(topology)
    if not exact:
        raise ValueError("the compact formulation needs a two-level cost matrix (one intra-domain and one "
                         "inter-domain cost); use formulation='full'")
    a, b = a_fs / FEMTO, b_fs / FEMTO
    om = omega.numpy()
    D = domain_demand(omega, topology).numpy()
    tot = om.sum(0)
    dom = topology.domain_of.numpy()
    mr = main.numpy()
    c = topology.cost.numpy()
    nU = E * R
    iU = lambda e, r: e * R + r  # noqa: E731
    ix = lambda e, r: nU + e * R + r  # noqa: E731
    iz = lambda e, r: 2 * nU + e * R + r  # noqa: E731
    iy = lambda e, d: 3 * nU + e * M + d  # noqa: E731
    il = 3 * nU + E * M
    n = il + 1
    cost = np.zeros(n)
    cost[il] = 1.0
    const = 0.0
    if objective == "time":
        sc = 1.0 / t_ffn
        for e in range(E):
            for r in range(R):
                cost[iz(e, r)] = -2 * token_bytes * a * sc
                if r != mr[e]:
                    cost[ix(e, r)] = expert_bytes * c[mr[e], r] * sc
            for d in range(M):
                cost[iy(e, d)] = -2 * token_bytes * (b - a) * sc
        const = 2 * token_bytes * b * float(tot.sum()) * sc
    lb, ub = np.zeros(n), np.full(n, np.inf)
    for e in range(E):
        for r in range(R):
            ub[iU(e, r)] = tot[e]
            ub[ix(e, r)] = 1.0
            ub[iz(e, r)] = om[r, e]
            if r == mr[e]:
                lb[ix(e, r)] = 1.0
            elif enforce_c4 and dom[r] != dom[mr[e]] and not expert_bytes < 2 * D[dom[r], e] * token_bytes:
                ub[ix(e, r)] = 0.0
        for d in range(M):
            ub[iy(e, d)] = D[d, e]
    integrality = np.zeros(n)
    integrality[:2 * nU] = 1
    rows, cols, vals, lo, hi = [], [], [], [], []

    def add(entries, low, high):
        r_ = len(lo)
        for col, v in entries:
            rows.append(r_)
            cols.append(col)
            vals.append(v)
        lo.append(low)
        hi.append(high)

    for e in range(E):
        add([(iU(e, r), 1.0) for r in range(R)], tot[e], tot[e])
        for r in range(R):
            if r != mr[e]:
                add([(iU(e, r), 1.0), (ix(e, r), -float(tot[e]))], -np.inf, 0.0)
                add([(iz(e, r), 1.0), (ix(e, r), -float(om[r, e]))], -np.inf, 0.0)
            add([(iz(e, r), 1.0), (iU(e, r), -1.0)], -np.inf, 0.0)
        for d in range(M):
            ranks = range(d * rpd, (d + 1) * rpd)
            add([(iy(e, d), 1.0)] + [(iU(e, r), -1.0) for r in ranks], -np.inf, 0.0)
            if dom[mr[e]] != d:
                add([(iy(e, d), 1.0)] + [(ix(e, r), -float(D[d, e])) for r in ranks], -np.inf, 0.0)
    for r in range(R):
        add([(ix(e, r), 1.0) for e in range(E) if mr[e] != r], -np.inf, num_slots)
        add([(iU(e, r), 1.0) for e in range(E)] + [(il, -1.0)], -np.inf, 0.0)
    A = coo_matrix((vals, (rows, cols)), shape=(len(lo), n)).tocsr()
    return CompactModel(cost, A, np.array(lo, dtype=float), np.array(hi, dtype=float), lb, ub, integrality, const,
                        E, R)


def _solve_compact(omega, topology, num_slots, expert_bytes, token_bytes, main, t_ffn, objective, enforce_c4,
                   time_limit) -> MilpResult:
    from scipy.optimize import Bounds, LinearConstraint, milp

    from topoep.planners.common import hierarchical_route

    R, E = omega.shape
    m = compact_model(omega, topology, num_slots, expert_bytes, token_bytes, main, t_ffn, objective, enforce_c4)
    t0 = time.perf_counter()
    res = milp(m.cost, constraints=LinearConstraint(m.A, m.lo, m.hi), integrality=m.integrality,
               bounds=Bounds(m.lb, m.ub), options={"time_limit": time_limit, "disp": False, "mip_rel_gap": 1e-9})
    seconds = time.perf_counter() - t0
    unit = t_ffn if objective == "time" else 1.0
    bound = getattr(res, "mip_dual_bound", None)
    bound = (float(bound) + m.const) * unit if bound is not None and np.isfinite(bound) else 0.0
    if res.x is None:
        return MilpResult(None, float("inf"), bound, False, res.message, seconds)
    nU = E * R
    U = torch.from_numpy(np.round(res.x[:nU]).astype(np.int64).reshape(E, R))
    x = torch.from_numpy(np.round(res.x[nU:2 * nU]).astype(np.int64).reshape(E, R)).bool() & (U > 0)
    x[torch.arange(E), main] = False
    slot_expert = torch.full((R, num_slots), -1, dtype=torch.int64)
    for r in range(R):
        ex = torch.nonzero(x[:, r]).flatten()
        slot_expert[r, :ex.numel()] = ex
    inst_load = torch.cat([U[torch.arange(E), main],
                           torch.where(slot_expert >= 0, U[slot_expert.clamp(min=0), torch.arange(R)[:, None]], 0).reshape(-1)])
    route = hierarchical_route(omega, topology, main, slot_expert, inst_load)
    plan = Plan(omega=omega, topology=topology, num_slots=num_slots, main_rank=main, slot_expert=slot_expert,
                route=route, policy="milp", expert_bytes=expert_bytes, token_bytes=token_bytes)
    # the objective as the model states it (with the plan's own integer L_max)
    return MilpResult(plan, (float(res.fun) + m.const) * unit, bound, res.status == 0, res.message, seconds)
