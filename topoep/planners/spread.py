"""`topoep_plus_spread`: load balancing across the whole EP group, priced on the busiest replica link.

Why: `topoep`'s stage 1 places a replica of expert e in domain d wherever 2 D[d, e] S_tok > W (eq. 9), a trade of
summed bytes. It picks experts by their demand, not by the load of their rank, and all copies of a rank's experts
leave through that rank's NIC. Where a whole domain is warm (every rank of it overloaded), the stage fills the
other domains' slots with copies of the one rank whose experts have the largest demand, and the domain's other
ranks keep their load (`warm_domain` at EP 64, 1 slot: 56 copies from one rank, imbalance 6.5). Its local variant
(`topoep_plus_local`) cannot move load out of the domain at all. Real time is set by the straggler's compute and
by the busiest link; this planner trades exactly these two.

Algorithm (integers only, lowest-index ties, deterministic; a, b = `common.two_level_costs` in fs per byte, t =
t_ffn in fs, W = expert_bytes, S = token_bytes; every instance starts as the static plan: all of e's demand on its
main rank):

  objective = t L_max + R + K, the straggler's compute and two busiest-link terms:
  R = REPLICA_TRANSFERS W max(b max NIC count, a max NVLink count): a rank's NIC (NVLink) count is the replica
      copies it sends plus those it receives across domains (inside its domain), each copy fetched from its expert's
      main rank;
  K = max(TOKEN_TRANSFERS S b max_d max(out_d, in_d) / ranks_per_domain, INGRESS_TRANSFERS S b max_r xin_r):
      out_d = sum_e (D[d, e] - U_d[e])^+ the assignments domain d's sources must send to other domains, in_d =
      sum_e (U_d[e] - D[d, e])^+ those its instances receive from them (U_d[e] the load of e's instances in d),
      spread evenly over d's NICs; xin_r = sum over r's instances of e of floor(U_r[e] (U_d[e] - D[d, e])^+ /
      U_d[e]), rank r's share of its domain's inflow (each instance in proportion to its load): the busiest NIC
      ingress, where one rank's instances draw most of the inflow.

1. Greedy moves. rb = the busiest rank (ties: lowest id). For every instance of an expert e on rb with load u > 0
   and every other rank rt with floor((L[rb] - L[rt]) / 2) > 0 that hosts e, or has a free slot (a new replica of
   e, fetched from e's main rank; into another domain only where C4 allows it, 2 D[d(rt), e] S > W):
   delta = min(u, floor((L[rb] - L[rt]) / 2)); extra = the rise of R a new copy causes (0 for an existing
   instance); score = t delta - extra. The largest score wins; ties: rt in rb's domain, then an existing
   instance, then lower L[rt], lower rt, lower e. A new replica takes rt's lowest free slot. Stop when the best
   score is <= g, the planner's own time per move (`move_cost_fs`, default MOVE_COST_US: a move that gains less
   than it costs to plan is not worth making), or after `max_moves` moves (default 4 R (E / R + N)).
2. Roll back to the best prefix: the objective after every move; the plan keeps the moves up to the first prefix
   with the smallest objective (the empty prefix is the static plan). So the plan's objective is never above
   static's.
3. Replicas left with no load are dropped; the route is `common.hierarchical_route` (each instance serves its own
   rank first, then its domain, then any source).

The token term is a proxy (a domain's NIC traffic, and each rank's share of its inflow, without the route): the
net-benefit guard compares this plan with the others by its full per-link prediction (`topoep.runtime.guard`) and
keeps the fastest or static.

The contract is every policy's: C1-C3, C5 and C4 (plan.C4_POLICIES), no duplicate instance, integer decisions,
lowest-index ties. `csrc/spread.cu` runs steps 1-3 on the GPU bit for bit, the route included
(`topoep.planners.cuda.solve_spread_cuda`: no host synchronisation); this reference runs on any device (the host
reads omega).
"""

from __future__ import annotations

import math

import torch

from topoep.plan import Plan
from topoep.planners.common import hierarchical_route
from topoep.topology import FEMTO

# Replica transfers per layer call the objective charges: the forward fetch, the backward reload and the gradient
# return (all three exposed: backend torch; the guard, which knows the backend, has the final word).
REPLICA_TRANSFERS = 3
# Token transfers per layer call the objective charges at the busiest domain's NIC share: the dispatch and the combine
# of one pass (the chunked pipeline runs about as much of the other pass beside the expert compute). A proxy: the guard
# prices every token transfer on its busiest link.
TOKEN_TRANSFERS = 2
# Token transfers per layer call the objective charges at the busiest rank's NIC ingress (forward and backward each
# dispatch and combine: the guard's token_transfers). Where one rank's instances draw most of their domain's inflow,
# its own NIC, not the domain's average, is the busiest link.
INGRESS_TRANSFERS = 4

# The CUDA spread planner's latency (us, 640 experts, 2 slots, the planner-latency workload) on one H200, from
# results/spread_latency.md (CUDA-graph replay on a busy stream): this planner alone, and the four plans of a relayed
# topoep_plus layer (topoep_plus, its local plan, this one and topoep_plus_spread_tree) at once; the greedy's moves
# on that workload (alone; the set: the more of the two spread planners'); the planner's fixed part (max_moves=0:
# the greedy's state, the rollback and the route). The spread gate (NetBenefitGuard.worth_spreading) reads the
# latency through `measured_latency_s`; the simulator, which knows a call's moves, shifts it by MOVE_US per move.
LATENCY_US = ((8, 41.4), (16, 95.3), (32, 199.6), (64, 310.7), (128, 433.7))
LATENCY_SET_US = ((8, 91.3), (16, 98.6), (32, 203.3), (64, 376.8), (128, 776.5))
LATENCY_MOVES = ((8, 6), (16, 23), (32, 61), (64, 93), (128, 112))
LATENCY_SET_MOVES = ((8, 6), (16, 23), (32, 61), (64, 115), (128, 212))
FIXED_US = ((8, 22.5), (16, 29.9), (32, 35.4), (64, 49.7), (128, 76.5))
# and its time per greedy move (us): every move that gains anything (move_cost_fs=0) less the fixed part, per move
MOVE_US = ((8, 3.17), (16, 2.85), (32, 2.68), (64, 2.79), (128, 3.13))
# The greedy's stopping threshold (us): about the planner's own time per move at EP 32-64 (MOVE_US), so a move must
# save more layer time than it adds to the planner's.
MOVE_COST_US = 2.7


def interpolated_s(pts, num_ranks: int) -> float:
    """Seconds at num_ranks from measured (ranks, us) points: the first point's below them, linear in log2(ranks)
    between them, linear in ranks beyond the last (the last segment's slope)."""
    if num_ranks <= pts[0][0]:
        return pts[0][1] * 1e-6
    for (r0, u0), (r1, u1) in zip(pts, pts[1:]):
        if num_ranks <= r1:
            w = (math.log2(num_ranks) - math.log2(r0)) / (math.log2(r1) - math.log2(r0))
            return (u0 + w * (u1 - u0)) * 1e-6
    (r0, u0), (r1, u1) = pts[-2], pts[-1]
    return (u1 + (num_ranks - r1) * (u1 - u0) / (r1 - r0)) * 1e-6


def measured_latency_s(num_ranks: int, trees: bool = False, moves: int | None = None) -> float:
    """The CUDA spread planner's measured latency at num_ranks (LATENCY_US), or with `trees` the relayed layer's four
    plans at once (LATENCY_SET_US). With `moves` (the greedy moves of the call; with trees the more of the two
    spread planners'): that latency shifted by MOVE_US per move more or fewer than the measured workload's
    (LATENCY_MOVES, LATENCY_SET_MOVES), never below the planner's fixed part (FIXED_US)."""
    t = interpolated_s(LATENCY_SET_US if trees else LATENCY_US, num_ranks)
    if moves is None:
        return t
    if isinstance(moves, bool) or not isinstance(moves, int) or moves < 0:
        raise ValueError(f"moves must be an integer >= 0 (the greedy's moves), got {moves!r}")
    measured = 1e6 * interpolated_s(LATENCY_SET_MOVES if trees else LATENCY_MOVES, num_ranks)
    return max(interpolated_s(FIXED_US, num_ranks), t + interpolated_s(MOVE_US, num_ranks) * (moves - measured))


class _State:
    """The greedy's loads and replica-copy counters on Python ints."""

    def __init__(self, omega: list, main_rank: list, num_slots: int, rpd: int, trees: bool = False):
        R = len(omega)
        self.rpd, self.trees = rpd, trees
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
        self.first = {}  # (expert, domain) -> the rank of its first copy there (trees: the later copies fetch from it)
        # per domain d and expert e: the load of e's instances in d (Ud) against d's demand for e (D); out[d] = sum_e
        # (D - Ud)^+ assignments d's sources send to other domains, inn[d] = sum_e (Ud - D)^+ those it receives
        M = R // rpd
        self.D = [[0] * len(main_rank) for _ in range(M)]
        for s in range(R):
            for e, x in enumerate(omega[s]):
                self.D[s // rpd][e] += x
        self.Ud = [[0] * len(main_rank) for _ in range(M)]
        for e, r in enumerate(main_rank):
            self.Ud[r // rpd][e] = self.U[r][e]
        self.out = [sum(max(d - u, 0) for d, u in zip(self.D[m], self.Ud[m])) for m in range(M)]
        self.inn = [sum(max(u - d, 0) for d, u in zip(self.D[m], self.Ud[m])) for m in range(M)]
        # per rank r: the assignments its instances receive from other domains, each instance (r, e) its share of
        # its domain's inflow for e: floor(U[r][e] (Ud - D)^+ / Ud); xin[r] their sum
        self.part = [dict() for _ in range(R)]
        self.xin = [0] * R
        for r in range(R):
            for e in self.U[r]:
                self._share(r, e)

    def _share(self, r: int, e: int) -> None:
        m = r // self.rpd
        ud, u = self.Ud[m][e], self.U[r].get(e, 0)
        new = u * max(ud - self.D[m][e], 0) // ud if ud > 0 else 0
        self.xin[r] += new - self.part[r].get(e, 0)
        self.part[r][e] = new

    def source(self, e: int, rt: int, home: int) -> tuple[int, bool]:
        """(the rank a new copy of e on rt fetches from, whether over the NIC): its home; with trees, a remote
        domain's later copies from the domain's first copy, over NVLink."""
        if home // self.rpd == rt // self.rpd:
            return home, False
        first = self.first.get((e, rt // self.rpd)) if self.trees else None
        return (home, True) if first is None else (first, False)

    def apply(self, rb: int, rt: int, e: int, delta: int, home: int) -> None:
        if e not in self.U[rt]:
            self.slots[rt][self.used[rt]] = e
            self.used[rt] += 1
            self.U[rt][e] = 0
            src, nic = self.source(e, rt, home)
            self.first.setdefault((e, rt // self.rpd), rt)
            if nic:
                self.nic_out[src] += 1
                self.nic_in[rt] += 1
            else:
                self.nvl_out[src] += 1
                self.nvl_in[rt] += 1
        self.U[rb][e] -= delta
        self.U[rt][e] += delta
        self.L[rb] -= delta
        self.L[rt] += delta
        for m, x in ((rb // self.rpd, -delta), (rt // self.rpd, delta)):
            d, u = self.D[m][e], self.Ud[m][e]
            self.Ud[m][e] = u + x
            self.out[m] += max(d - u - x, 0) - max(d - u, 0)
            self.inn[m] += max(u + x - d, 0) - max(u - d, 0)
        for m in {rb // self.rpd, rt // self.rpd}:  # every instance of e in the two domains shares anew
            for r in range(m * self.rpd, (m + 1) * self.rpd):
                if e in self.U[r]:
                    self._share(r, e)

    def objective(self, t: int, a: int, b: int, W: int, S: int) -> int:
        """t L_max + the replica term + the token term (module docstring)."""
        rep = _replica_fs(max(max(self.nic_out), max(self.nic_in)), max(max(self.nvl_out), max(self.nvl_in)), a, b, W)
        tok = max(TOKEN_TRANSFERS * S * b * max(max(self.out), max(self.inn)) // self.rpd,
                  INGRESS_TRANSFERS * S * b * max(self.xin))
        return t * max(self.L) + rep + tok


def _replica_fs(nic: int, nvl: int, a: int, b: int, W: int) -> int:
    """R: the replica term of the objective for the busiest NIC / NVLink copy counts."""
    return REPLICA_TRANSFERS * W * max(b * nic, a * nvl)


def solve_topoep_plus_spread(omega, topology, *, num_slots, main_rank, expert_bytes, token_bytes, t_ffn=None,
                             max_moves: int | None = None, trees: bool = False, move_cost_fs: int | None = None,
                             **kw) -> Plan:
    """The `topoep_plus_spread` policy (module docstring); with `trees`, `topoep_plus_spread_tree`: the replica term
    counts each remote domain's copies of an expert as a relay tree fetches them, approximately: the first over the
    NIC from the home, the others over NVLink from that first copy (`topoep.relay`'s trees are heaps, and the domains'
    first copies form a tree of their own across the NIC; the guard prices the fetch as it runs). info: "moves" (kept after the rollback),
    "greedy_moves" (made before it), "objective_fs" and "static_objective_fs" (the objective of the kept prefix and
    of static), "dropped" (replicas of the kept prefix left with no load, step 3)."""
    R, E = omega.shape
    N = num_slots
    rpd = topology.ranks_per_domain
    W, S = int(expert_bytes), int(token_bytes)
    t, a, b = spread_constants(topology, t_ffn)
    if max_moves is None:
        max_moves = default_max_moves(R, E, N)
    g = move_cost_or_default(move_cost_fs)
    om = omega.tolist()
    mr = main_rank.tolist()
    st = _State(om, mr, N, rpd, trees)
    D = st.D
    static_obj = st.objective(t, a, b, W, S)
    best_obj, best_len, history = static_obj, 0, []
    dom = [r // rpd for r in range(R)]
    while N > 0 and len(history) < max_moves:
        L = st.L
        rb = max(range(R), key=lambda r: (L[r], -r))
        mx_nic = max(max(st.nic_out), max(st.nic_in))
        mx_nvl = max(max(st.nvl_out), max(st.nvl_in))
        cur = _replica_fs(mx_nic, mx_nvl, a, b, W)
        best = None
        for rt in range(R):
            half = (L[rb] - L[rt]) // 2
            if half <= 0:
                continue
            free = st.used[rt] < N
            for e, u in st.U[rb].items():
                if u <= 0:
                    continue
                existing = e in st.U[rt]
                home = mr[e]
                extra = 0
                if not existing:
                    if not free:
                        continue
                    if dom[home] != dom[rt] and not 2 * D[dom[rt]][e] * S > W:  # C4
                        continue
                    src, over_nic = st.source(e, rt, home)
                    if over_nic:
                        nic = max(mx_nic, st.nic_out[src] + 1, st.nic_in[rt] + 1)
                        extra = _replica_fs(nic, mx_nvl, a, b, W) - cur
                    else:
                        nvl = max(mx_nvl, st.nvl_out[src] + 1, st.nvl_in[rt] + 1)
                        extra = _replica_fs(mx_nic, nvl, a, b, W) - cur
                delta = min(u, half)
                key = (extra - t * delta, dom[rt] != dom[rb], not existing, L[rt], rt, e)
                if best is None or key < best[0]:
                    best = (key, rt, e, delta)
        if best is None or best[0][0] >= -g or best[3] <= 0:
            break
        _, rt, e, delta = best
        st.apply(rb, rt, e, delta, mr[e])
        history.append((rb, rt, e, delta))
        obj = st.objective(t, a, b, W, S)
        if obj < best_obj:
            best_obj, best_len = obj, len(history)

    # 2. the best prefix, replayed from static
    kept = _State(om, mr, N, rpd, trees)
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
    info = {"moves": best_len, "greedy_moves": len(history), "objective_fs": best_obj,
            "static_objective_fs": static_obj, "dropped": dropped}
    return routed_plan(omega, topology, main_rank, slot_expert, load, trees, W, S, info, **kw)


def routed_plan(omega, topology, main_rank, slot_expert, load, trees: bool, W: int, S: int, info: dict, **kw) -> Plan:
    """The plan of the greedy's slot table and instance loads (replicas without load already dropped): its route is
    `common.hierarchical_route` of those loads (device ops only: the CUDA planner's plans route here too)."""
    route = hierarchical_route(omega, topology, main_rank, slot_expert, load)
    return Plan(omega=omega, topology=topology, num_slots=slot_expert.shape[1], main_rank=main_rank,
                slot_expert=slot_expert, route=route, policy="topoep_plus_spread_tree" if trees else "topoep_plus_spread",
                expert_bytes=W, token_bytes=S, info=info, **kw)


def spread_constants(topology, t_ffn: float | None) -> tuple[int, int, int]:
    """(t, a, b) of the objective in fs: t_ffn per assignment and the two-level costs per byte."""
    from topoep.metrics import DEFAULT_T_FFN
    from topoep.planners import cached_two_level_costs

    a, b, _ = cached_two_level_costs(topology)
    return int(round((DEFAULT_T_FFN if t_ffn is None else t_ffn) * FEMTO)), a, b


def default_move_cost_fs() -> int:
    """The greedy's default stopping threshold in fs: MOVE_COST_US."""
    return int(round(MOVE_COST_US * 1e-6 * FEMTO))


def move_cost_or_default(move_cost_fs: int | None) -> int:
    """The greedy's stopping threshold as given (an integer >= 0, fs), or the default for None; ValueError otherwise."""
    if move_cost_fs is None:
        return default_move_cost_fs()
    if isinstance(move_cost_fs, bool) or not isinstance(move_cost_fs, int) or move_cost_fs < 0:
        raise ValueError(f"move_cost_fs must be an integer >= 0 (femtoseconds a greedy move must save), got "
                         f"{move_cost_fs!r}")
    return move_cost_fs


def default_max_moves(R: int, E: int, N: int) -> int:
    """The greedy's bound on moves, 4 R (E / R + N)."""
    return 4 * R * (E // R + N)
