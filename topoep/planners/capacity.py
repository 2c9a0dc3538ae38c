"""The capacity step: make a plan fit fixed-size receive buffers, after any policy (and after the guard).

Backend `cuda` receives rows into two fixed-size regions per rank: one for its main experts' rows and one for its
replica slots' rows (the grouped GEMMs read each from its first row). Each region holds `capacity` rows, so every
buffer and every tensor kept for backward is sized by the capacity instead of by the worst case `R * T * k`. This
step changes a plan, when it must, so that no region receives more than `capacity` rows:

    region (r, 0)   rows executed by rank r's main instances   (p = e, main_rank[e] = r)
    region (r, 1)   rows executed by rank r's replica slots    (p = E + r * N + j)

Loop (integers only, lowest-index ties, deterministic; U[p] the load of instance p, X the excess of a region):

1. The source region is the one with the largest excess X = load - capacity > 0 that is not stuck (ties: lower
   rank, then main before slot). None: done.
2. Candidate moves out of it: every instance p of the region with U[p] > 0 (expert e) to
   a. another instance q of e in another region with room (capacity - its load > 0), or
   b. a new replica of e in the lowest free slot of a rank t whose slots do not hold e (t may be the source rank
      itself when p is a main instance: a *self-replica* moves rows from the main region to the slot region of
      the same rank), when new replicas are allowed and t's slot region has room.
   A move carries delta = min(X, U[p], room) rows. The best has the smallest key (target on the source rank, new
   replica, target rank's load (both regions), target outside the source rank's domain, -delta, -U[p], p, q):
   another rank before the source rank itself (a move to another rank also lowers the source rank's load, the
   straggler's; a self-replica only frees its main region), an existing instance before a new replica (no
   weight transfer), then the least loaded rank (the step runs when a region overflows, where balance is what
   time is lost to), the source's domain, and the largest move. No candidate: the region is stuck (step 1
   skips it from then on).
3. The rows move from route[:, p] to route[:, q], taken from the sources in the order (s != t, domain of s !=
   domain of t, s == rank of p, s): rows already on t first, then t's domain, rows that never left p's rank last.
4. Stop when no region is over (or after 4 R + P moves, which the loop cannot exceed: every move fixes a
   region, fills a target region, or empties an instance, and each happens once).
5. If rows still do not fit and the plan has replicas, steps 1-4 run once more from the static plan (every slot
   free: a policy may have spent its slots on replicas that serve few rows), and the result with fewer rows
   beyond the capacity is kept (ties: the policy's); info["capacity"]["refit"] says which.

Replicas the step emptied are dropped (nothing is fetched for them); replicas it placed are exempt from C4 (they
serve the capacity, not the cost model) and may be self-replicas. A plan that fits is returned unchanged. What does
not fit (no free slot anywhere, say) stays where it is and is reported as `overflow` (rows beyond the capacity,
summed over regions): backend cuda then executes those rows on the spill path (`topoep.runtime.spill`), so no
row is ever dropped.

info["capacity"] of the returned plan: capacity, moves, new_replicas [(rank, slot)], overflow, stuck regions.
The CUDA planner's `fit_capacity` kernel (csrc/capacity.cu) returns the same plan bit for bit.
"""

from __future__ import annotations

import bisect
import dataclasses

import torch

from topoep.plan import Plan, static_route


def region_loads(plan: Plan) -> torch.Tensor:
    """int64[R, 2]: rows of each rank's main region (column 0) and slot region (column 1)."""
    R, E, N = plan.num_ranks, plan.num_experts, plan.num_slots
    U = plan.instance_load
    main = torch.zeros(R, dtype=torch.int64, device=U.device).index_add_(0, plan.main_rank.to(U.device), U[:E])
    slot = U[E:].view(R, N).sum(1) if N else torch.zeros(R, dtype=torch.int64, device=U.device)
    return torch.stack([main, slot], 1)


def overflow_rows(plan: Plan, capacity: int, loads: torch.Tensor | None = None) -> int:
    """Rows beyond `capacity` summed over every rank's two regions (0: the plan fits); loads: region_loads(plan)
    when already at hand."""
    loads = region_loads(plan) if loads is None else loads
    return int((loads - capacity).clamp(min=0).sum())


def max_moves(num_ranks: int, num_instances: int) -> int:
    """The loop's bound (module docstring, step 4)."""
    return 4 * num_ranks + num_instances


def check_capacity(capacity) -> int:
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise ValueError(f"capacity must be a positive integer number of rows per receive region, got {capacity!r}")
    return capacity


def fit_capacity(plan: Plan, capacity: int, *, allow_new: bool = True) -> Plan:
    """The capacity step (module docstring) on the reference side: a new Plan (the same tensors when the plan
    already fits). allow_new=False: only existing instances may take rows (the runtime left the replica slots
    out)."""
    capacity = check_capacity(capacity)
    fitted = _fit(plan, capacity, allow_new)
    info = fitted.info["capacity"]
    if info["overflow"] and allow_new and bool((plan.slot_expert >= 0).any()):
        static = dataclasses.replace(plan, slot_expert=torch.full_like(plan.slot_expert, -1),
                                     route=static_route(plan.omega, plan.num_slots))
        alt = _fit(static, capacity, allow_new)
        if alt.info["capacity"]["overflow"] < info["overflow"]:
            alt.info["capacity"]["refit"] = "static"
            return alt
    info["refit"] = None
    return fitted


def _fit(plan: Plan, capacity: int, allow_new: bool) -> Plan:
    """Steps 1-4 of the module docstring."""
    R, E, N = plan.num_ranks, plan.num_experts, plan.num_slots
    P = E + R * N
    loads = region_loads(plan)
    if overflow_rows(plan, capacity, loads) == 0:
        info = {"capacity": capacity, "moves": 0, "new_replicas": [], "overflow": 0, "stuck": []}
        return dataclasses.replace(plan, info={**plan.info, "capacity": info})
    dom = plan.topology.domain_of.tolist()
    route = plan.route.tolist()  # [R][P]
    se = plan.slot_expert.tolist()
    main = plan.main_rank.tolist()
    U = plan.instance_load.tolist()
    before = list(U)
    load = loads.tolist()  # [R][2]
    inst_rank = main + [r for r in range(R) for _ in range(N)]
    inst_expert = list(range(E)) + [e for row in se for e in row]
    hosts: dict[int, list[int]] = {}  # expert -> its instances (ascending p)
    for p in range(P):
        if inst_expert[p] >= 0:
            hosts.setdefault(inst_expert[p], []).append(p)
    region_insts = [[[], []] for _ in range(R)]
    for p in range(P):
        if inst_expert[p] >= 0:
            region_insts[inst_rank[p]][0 if p < E else 1].append(p)
    slot_held = [set(e for e in se[r] if e >= 0) for r in range(R)]
    free = [[j for j in range(N) if se[r][j] < 0] for r in range(R)]
    stuck: set = set()
    new_replicas, moves = [], 0
    C = capacity
    while moves < max_moves(R, P):
        src, X = None, 0
        for r in range(R):
            for k in (0, 1):
                x = load[r][k] - C
                if x > X and (r, k) not in stuck:
                    src, X = (r, k), x
        if src is None:
            break
        r, k = src
        best = None
        for p in region_insts[r][k]:
            u = U[p]
            if u <= 0:
                continue
            e = inst_expert[p]
            for q in hosts[e]:
                t, kq = inst_rank[q], 0 if q < E else 1
                room = C - load[t][kq]
                if q == p or room <= 0 or (t, kq) == (r, k):
                    continue
                key = (t == r, 0, load[t][0] + load[t][1], dom[t] != dom[r], -min(X, u, room), -u, p, q)
                if best is None or key < best:
                    best = key
            if not allow_new:
                continue
            for t in range(R):
                room = C - load[t][1]
                if not free[t] or e in slot_held[t] or room <= 0 or (t, 1) == (r, k):
                    continue
                key = (t == r, 1, load[t][0] + load[t][1], dom[t] != dom[r], -min(X, u, room), -u, p,
                       E + t * N + free[t][0])
                if best is None or key < best:
                    best = key
        if best is None:
            stuck.add(src)
            continue
        _, new, _, _, neg_delta, _, p, q = best
        delta, e = -neg_delta, inst_expert[p]
        t = inst_rank[q] if q < E else (q - E) // N
        if new:
            j = (q - E) % N
            free[t].remove(j)
            se[t][j] = e
            slot_held[t].add(e)
            inst_expert[q] = e
            bisect.insort(hosts[e], q)
            bisect.insort(region_insts[t][1], q)
            new_replicas.append((t, j))
        kq = 0 if q < E else 1
        U[p] -= delta
        U[q] += delta
        load[r][k] -= delta
        load[t][kq] += delta
        rest = delta
        for s in sorted(range(R), key=lambda s: (s != t, dom[s] != dom[t], s == r, s)):
            m = min(route[s][p], rest)
            if m:
                route[s][p] -= m
                route[s][q] += m
                rest -= m
                if not rest:
                    break
        moves += 1
    for r in range(R):  # replicas the step emptied serve nothing: no fetch, no gradient return
        for j in range(N):
            p = E + r * N + j
            if se[r][j] >= 0 and U[p] == 0 and before[p] > 0:
                se[r][j] = -1
    dev = plan.route.device
    overflow = sum(max(0, load[r][k] - C) for r in range(R) for k in (0, 1))
    info = {"capacity": C, "moves": moves, "new_replicas": new_replicas, "overflow": overflow,
            "stuck": sorted(stuck)}
    return dataclasses.replace(plan, slot_expert=torch.tensor(se, dtype=torch.int64, device=dev).view(R, N),
                               route=torch.tensor(route, dtype=torch.int64, device=dev).view(R, P),
                               info={**plan.info, "capacity": info})
