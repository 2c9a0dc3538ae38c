"""`topoep_plus_spread`: load balancing across the whole EP group, priced on the busiest replica link.

Why: `topoep`'s stage 1 places a replica of expert e in domain d wherever 2 D[d, e] S_tok > W (eq. 9), a trade of
summed bytes. It picks experts by their demand, not by the load of their rank, and all copies of a rank's experts
leave through that rank's NIC. Where a whole domain is warm (every rank of it overloaded), the stage fills the
other domains' slots with copies of the one rank whose experts have the largest demand, and the domain's other
ranks keep their load (`warm_domain` at EP 64, 1 slot: 56 copies from one rank, imbalance 6.5). Its local variant
(`topoep_plus_local`) cannot move load out of the domain at all. Real time is set by the straggler's compute and
by the busiest link; this planner trades exactly these two.

Algorithm (integers only, lowest-index ties, deterministic; a, b = `common.two_level_costs` in fs per byte, t =
t_ffn in fs, W = expert_bytes, n = REPLICA_TRANSFERS; every instance starts as the static plan: all of e's demand
on its main rank; per rank four counters of replica copies, NIC out / in and NVLink out / in):

1. Greedy moves. rb = the busiest rank (ties: lowest id). For every instance of an expert e on rb with load u > 0
   and every other rank rt with L[rt] < L[rb] that hosts e, or has a free slot (a new replica of e, fetched from
   e's main rank; into another domain only where C4 allows it, 2 D[d(rt), e] S_tok > W):
   delta = min(u, floor((L[rb] - L[rt]) / 2)); extra = the rise of the replica term R(c) = n W max(b max NIC
   count, a max NVLink count) a new copy causes (0 for an existing instance); score = t delta - extra.
   The largest score wins; ties: rt in rb's domain, then an existing instance, then lower L[rt], lower rt, lower
   e. A new replica takes rt's lowest free slot. Stop when the best score is <= 0, or after `max_moves` moves
   (default 4 R (E / R + N)).
2. Roll back to the best prefix: the objective t L_max + R(counts) after every move; the plan keeps the moves up
   to the first prefix with the smallest objective (the empty prefix is the static plan). So the per-link
   objective of the plan is never above static's.
3. Replicas left with no load are dropped; the route is `common.hierarchical_route` (each instance serves its own
   rank first, then its domain, then any source).

Token transfers are not in the objective: the net-benefit guard compares this plan with the others by its full
per-link prediction (`topoep.runtime.guard`), tokens included, and keeps the fastest or static.

The contract is every policy's: C1-C3, C5 and C4 (plan.C4_POLICIES), no duplicate instance, integer decisions,
lowest-index ties. There is no CUDA kernel yet: `topoep.solve` runs this reference on any device (the host reads
omega).
"""

from __future__ import annotations

import torch

from topoep.plan import Plan, domain_demand
from topoep.planners.common import hierarchical_route, two_level_costs
from topoep.topology import FEMTO

# Replica transfers per layer call the objective charges: the forward fetch, the backward reload and the gradient
# return (all three exposed: backend torch; the guard, which knows the backend, has the final word).
REPLICA_TRANSFERS = 3


class _State:
    """The greedy's loads and replica-copy counters on Python ints."""

    def __init__(self, omega: list, main_rank: list, num_slots: int, rpd: int):
        R = len(omega)
        self.rpd = rpd
        self.U = [dict() for _ in range(R)]  # U[r] = {expert: load of its instance on r}
        self.L = [0] * R
        for e, r in enumerate(main_rank):
            t = sum(omega[s][e] for s in range(R))
            self.U[r][e] = t
            self.L[r] += t
        self.slots = [[-1] * num_slots for _ in range(R)]
        self.used = [0] * R
        self.nic_out, self.nic_in = [0] * R, [0] * R  # replica copies sent / received over the rank's NIC
        self.nvl_out, self.nvl_in = [0] * R, [0] * R

    def apply(self, rb: int, rt: int, e: int, delta: int, home: int) -> None:
        if e not in self.U[rt]:
            self.slots[rt][self.used[rt]] = e
            self.used[rt] += 1
            self.U[rt][e] = 0
            if home // self.rpd != rt // self.rpd:
                self.nic_out[home] += 1
                self.nic_in[rt] += 1
            else:
                self.nvl_out[home] += 1
                self.nvl_in[rt] += 1
        self.U[rb][e] -= delta
        self.U[rt][e] += delta
        self.L[rb] -= delta
        self.L[rt] += delta


def _replica_fs(nic: int, nvl: int, a: int, b: int, W: int) -> int:
    """R(counts): the replica term of the objective for the busiest NIC / NVLink copy counts."""
    return REPLICA_TRANSFERS * W * max(b * nic, a * nvl)


def solve_topoep_plus_spread(omega, topology, *, num_slots, main_rank, expert_bytes, token_bytes, t_ffn=None,
                             max_moves: int | None = None, **kw) -> Plan:
    """The `topoep_plus_spread` policy (module docstring). info: "moves" (kept after the rollback), "greedy_moves"
    (made before it), "objective_fs" and "static_objective_fs" (t L_max + R(counts) of the kept prefix and of
    static), "dropped" (replicas of the kept prefix left with no load, step 3)."""
    from topoep.metrics import DEFAULT_T_FFN

    R, E = omega.shape
    N = num_slots
    rpd = topology.ranks_per_domain
    W, S = int(expert_bytes), int(token_bytes)
    t = int(round((DEFAULT_T_FFN if t_ffn is None else t_ffn) * FEMTO))
    a, b, _ = two_level_costs(topology)
    if max_moves is None:
        max_moves = 4 * R * (E // R + N)
    om = omega.tolist()
    mr = main_rank.tolist()
    D = domain_demand(omega, topology).tolist()
    st = _State(om, mr, N, rpd)
    static_obj = t * max(st.L)
    best_obj, best_len, history = static_obj, 0, []
    dom = [r // rpd for r in range(R)]
    while N > 0 and len(history) < max_moves:
        L = st.L
        rb = max(range(R), key=lambda r: (L[r], -r))
        mx_nic = max(max(st.nic_out), max(st.nic_in))
        mx_nvl = max(max(st.nvl_out), max(st.nvl_in))
        cur = _replica_fs(mx_nic, mx_nvl, a, b, W)
        order = sorted((r for r in range(R) if L[r] < L[rb]), key=lambda r: (L[r], r))
        best = None
        for e in sorted(st.U[rb]):
            u = st.U[rb][e]
            if u <= 0:
                continue
            home = mr[e]
            cands = [rt for rt in order if e in st.U[rt]]
            # for a new replica, the least loaded rank (then lowest id) of each class wins its class: rb's domain,
            # the other domains (there only where C4 allows the copy)
            for same in (True, False):
                for rt in order:
                    if ((dom[rt] == dom[rb]) == same and e not in st.U[rt] and st.used[rt] < N
                            and (dom[rt] == dom[home] or 2 * D[dom[rt]][e] * S > W)):
                        cands.append(rt)
                        break
            for rt in cands:
                existing = e in st.U[rt]
                extra = 0
                if not existing:
                    if dom[home] != dom[rt]:
                        nic = max(mx_nic, st.nic_out[home] + 1, st.nic_in[rt] + 1)
                        extra = _replica_fs(nic, mx_nvl, a, b, W) - cur
                    else:
                        nvl = max(mx_nvl, st.nvl_out[home] + 1, st.nvl_in[rt] + 1)
                        extra = _replica_fs(mx_nic, nvl, a, b, W) - cur
                delta = min(u, (L[rb] - L[rt]) // 2)
                key = (-(t * delta - extra), dom[rt] != dom[rb], not existing, L[rt], rt, e)
                if best is None or key < best[0]:
                    best = (key, rt, e, delta)
        if best is None or best[0][0] >= 0 or best[3] <= 0:
            break
        _, rt, e, delta = best
        st.apply(rb, rt, e, delta, mr[e])
        history.append((rb, rt, e, delta))
        obj = t * max(st.L) + _replica_fs(max(max(st.nic_out), max(st.nic_in)),
                                          max(max(st.nvl_out), max(st.nvl_in)), a, b, W)
        if obj < best_obj:
            best_obj, best_len = obj, len(history)

    # 2. the best prefix, replayed from static
    kept = _State(om, mr, N, rpd)
    for rb, rt, e, delta in history[:best_len]:
        kept.apply(rb, rt, e, delta, mr[e])
    load = [kept.U[mr[e]][e] for e in range(E)]
    for r in range(R):
        load += [kept.U[r][e] if e >= 0 else 0 for e in kept.slots[r]]
    dev = omega.device
    load = torch.tensor(load, dtype=torch.int64, device=dev)
    slot_expert = torch.tensor(kept.slots, dtype=torch.int64, device=dev).view(R, N)
    # 3. drop replicas that serve nothing; the cheapest route of these loads
    served = load[E:].view(R, N) > 0
    dropped = int(((slot_expert >= 0) & ~served).sum())
    slot_expert = torch.where(served, slot_expert, -1)
    route = hierarchical_route(omega, topology, main_rank, slot_expert, load)
    info = {"moves": best_len, "greedy_moves": len(history), "objective_fs": best_obj,
            "static_objective_fs": static_obj, "dropped": dropped}
    return Plan(omega=omega, topology=topology, num_slots=N, main_rank=main_rank, slot_expert=slot_expert,
                route=route, policy="topoep_plus_spread", expert_bytes=W, token_bytes=S, info=info, **kw)
