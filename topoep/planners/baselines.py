"""Baseline policies: each published balancer's core placement idea, applied per microbatch with fixed
main instances, the same replica-slot budget N per rank, and the same token-split mechanism as every
policy (`common.even_split`). Written from the algorithm descriptions (shared/notes/peers.md and the
papers); integer decisions, lowest-index ties, no duplicate instance of an expert on a rank.

All three are topology-unaware (exempt from C4, as in the paper). Their token split follows what each
system assumes when it places replicas: DeepSeek EPLB and FlexMoE size replicas by load / count, so
each omega[s, e] is split evenly over all instances of e (locality "none"); FasterMoE's shadowed
experts compute every worker's tokens on that worker, so a source uses its own instance when it has
one (locality "rank").
"""

from __future__ import annotations

import torch

from topoep.plan import Plan
from topoep.planners.common import even_split, instance_tables
from topoep.topology import FEMTO


# The peers' CUDA planners (csrc/peers.cu) on one H200, results/peer_latency.md (`bench/planner_latency.py --peers`):
# topoep_plus, topoep_plus_local, flexmoe and deepseek planned at once on four streams (what a guarded topoep_plus
# layer with LayerConfig.plus_peers plans), graph replay on a busy stream, hot_domain routing (flexmoe's most steps),
# 8 experts per rank; (EP, us) with 2 and with 4 slots. FlexMoE's greedy is a chain of dependent steps (about one per
# replica slot in all), so it sets the time.
PEER_SET_LATENCY_US = {2: ((16, 155.6), (32, 133.0), (64, 222.1), (128, 494.0), (256, 1092.0)),
                       4: ((16, 179.9), (32, 228.4), (64, 240.3), (128, 648.2), (256, 1154.7))}


# each peer's CUDA planner alone (csrc/peers.cu), us, on the hot_domain workload of results/peer_latency.md (one H200):
# the time a layer that plans that policy on the GPU spends planning, per EP size, for 2 and 4 slots
PEER_SOLO_LATENCY_US = {
    "deepseek": {2: ((16, 39.1), (32, 40.0), (64, 41.4), (128, 44.5), (256, 53.7)),
                 4: ((16, 73.2), (32, 73.9), (64, 75.3), (128, 78.7), (256, 88.8))},
    "flexmoe": {2: ((16, 153.5), (32, 131.0), (64, 217.0), (128, 486.9), (256, 1065.0)),
                4: ((16, 178.1), (32, 226.5), (64, 235.2), (128, 644.7), (256, 1127.0))}}


def peer_solo_s(policy: str, num_ranks: int, num_slots: int) -> float:
    """PEER_SOLO_LATENCY_US of `policy` (deepseek or flexmoe) at num_ranks (seconds): the 2-slot points for up to 2
    slots, else the 4-slot points."""
    from topoep.planners.spread import interpolated_s

    if policy not in PEER_SOLO_LATENCY_US:
        raise ValueError(f"no measured GPU planner for policy {policy!r}; one of {', '.join(PEER_SOLO_LATENCY_US)}")
    return interpolated_s(PEER_SOLO_LATENCY_US[policy][2 if num_slots <= 2 else 4], num_ranks)


def peer_set_s(num_ranks: int, num_slots: int) -> float:
    """PEER_SET_LATENCY_US at num_ranks (seconds): the 2-slot points for up to 2 slots, else the 4-slot points."""
    from topoep.planners.spread import interpolated_s

    return interpolated_s(PEER_SET_LATENCY_US[2 if num_slots <= 2 else 4], num_ranks)


def _finish(omega, topology, num_slots, main_rank, slot_expert, locality, policy, info=None, **kw) -> Plan:
    slot_expert = torch.tensor(slot_expert, dtype=torch.int64, device=omega.device).view(omega.shape[0], num_slots)
    inst_expert, inst_rank = instance_tables(main_rank, slot_expert)
    route = even_split(omega, inst_expert, inst_rank, topology, locality)
    return Plan(omega=omega, topology=topology, num_slots=num_slots, main_rank=main_rank,
                slot_expert=slot_expert, route=route, policy=policy, info=info or {}, **kw)


def solve_deepseek(omega, topology, *, num_slots, main_rank, **kw) -> Plan:
    """DeepSeek EPLB, hierarchical policy with fixed main instances.

    The expert groups of a node are the experts whose main instance is in that domain (mains do not
    move). Per node, the node's R_d * N replica slots are handed out one at a time to the expert with
    the largest load / instance count (load = total demand over all sources; at most one instance per
    rank of the node), then the replicas, heaviest (load // count) first, are packed greedily onto the
    node's least-loaded rank that has a free slot and no instance of that expert yet. A replica that
    finds no such rank is dropped.
    """
    R, E = omega.shape
    N, rpd = num_slots, topology.ranks_per_domain
    T = omega.sum(0).tolist()
    mr = main_rank.tolist()
    slot_expert = [[-1] * N for _ in range(R)]
    for d in range(topology.num_domains):
        ranks = list(topology.domain_ranks(d))
        experts = [e for e in range(E) if d * rpd <= mr[e] < (d + 1) * rpd]
        count = {e: 1 for e in experts}
        for _ in range(rpd * N):
            best = None
            for e in experts:
                if count[e] < rpd and T[e] > 0 and (best is None or T[e] * count[best] > T[best] * count[e]):
                    best = e
            if best is None:
                break
            count[best] += 1
        load = {r: 0 for r in ranks}
        hosted = {r: set() for r in ranks}
        for e in experts:
            load[mr[e]] += T[e] // count[e]
            hosted[mr[e]].add(e)
        items = sorted(((T[e] // count[e], e) for e in experts for _ in range(count[e] - 1)), key=lambda t: (-t[0], t[1]))
        used = {r: 0 for r in ranks}
        for w, e in items:
            cands = [r for r in ranks if used[r] < N and e not in hosted[r]]
            if not cands:
                continue
            r = min(cands, key=lambda r: (load[r], r))
            slot_expert[r][used[r]] = e
            used[r] += 1
            hosted[r].add(e)
            load[r] += w
    return _finish(omega, topology, N, main_rank, slot_expert, "none", "deepseek", **kw)


def solve_fastermoe(omega, topology, *, num_slots, main_rank, expert_bytes, token_bytes, t_ffn, **kw) -> Plan:
    """FasterMoE dynamic shadowing.

    Experts are considered by popularity (total demand, descending). Shadowing expert e broadcasts it
    to every rank (one replica slot on each rank other than its main), and every source then computes
    its own tokens of e locally. FasterMoE's performance model decides, with one uniform bandwidth
    (topology-unaware: the mean off-diagonal per-byte cost c): shadow e while the predicted saving
    t_ffn * (max rank load before - after) + 2 * S_tok * c * (assignments that stop travelling)
    exceeds the broadcast of the parameters plus the reduction of their gradients, 2 * W * c.
    Stops at the first expert that does not pay or when some rank has no free slot. All in integer
    femtoseconds.
    """
    R, E = omega.shape
    N = num_slots
    T = omega.sum(0).tolist()
    mr = main_rank.tolist()
    om = omega.t().tolist()  # [E][R]
    c = topology.cost_fs
    cbar = int(c.sum()) // max(R * (R - 1), 1)
    t_fs = int(round(t_ffn * FEMTO))
    L = [0] * R
    for e in range(E):
        L[mr[e]] += T[e]
    used = [0] * R
    slot_expert = [[-1] * N for _ in range(R)]
    shadowed = []
    for e in sorted(range(E), key=lambda e: (-T[e], e)):
        m = mr[e]
        if T[e] == 0 or any(used[r] >= N for r in range(R) if r != m):
            break
        L_new = [L[r] + om[e][r] for r in range(R)]
        L_new[m] = L[m] - T[e] + om[e][m]
        saving = t_fs * (max(L) - max(L_new)) + 2 * token_bytes * cbar * (T[e] - om[e][m])
        if saving <= 2 * expert_bytes * cbar:
            break
        for r in range(R):
            if r != m:
                slot_expert[r][used[r]] = e
                used[r] += 1
        L = L_new
        shadowed.append(e)
    return _finish(omega, topology, N, main_rank, slot_expert, "rank", "fastermoe",
                   info={"shadowed": shadowed}, expert_bytes=expert_bytes, token_bytes=token_bytes, **kw)


def solve_flexmoe(omega, topology, *, num_slots, main_rank, **kw) -> Plan:
    """FlexMoE expand / shrink / migrate, per microbatch from the static placement.

    Loads are modelled with each expert's total demand split evenly over its instances. Repeatedly take
    the busiest rank and try its experts, heaviest instance first: *expand* the expert with a replica on
    the least-loaded rank that has a free slot and no copy of it; when no such rank has a free slot,
    *migrate* the lightest replica elsewhere (shrinking its expert) to serve this expert instead. The
    first change that makes the busiest rank lighter without raising the maximum load is kept; stop
    when none of the busiest rank's experts yields one (or after 4 * R * N steps).
    """
    R, E = omega.shape
    N = num_slots
    T = omega.sum(0).tolist()
    mr = main_rank.tolist()
    slot_expert = [[-1] * N for _ in range(R)]
    inst = [[(e, mr[e])] for e in range(E)]  # per expert: (instance index p, rank), in p order
    hosted_on = [set() for _ in range(R)]
    for e in range(E):
        hosted_on[mr[e]].add(e)

    def shares(e):
        n = len(inst[e])
        return [(r, T[e] // n + (i < T[e] % n)) for i, (_, r) in enumerate(inst[e])]

    L = [0] * R
    for e in range(E):
        L[mr[e]] += T[e]

    def apply(e, sign):
        for r, s in shares(e):
            L[r] += sign * s

    def try_change(changes):
        """changes: list of (expert, add: (p, r) | None, remove: (p, r) | None). Returns True if kept."""
        rb = max(range(R), key=lambda r: (L[r], -r))
        before_max, before_rb = L[rb], L[rb]
        touched = sorted({e for e, _, _ in changes})
        saved = {e: list(inst[e]) for e in touched}
        for e in touched:
            apply(e, -1)
        for e, add, rem in changes:
            if rem is not None:
                inst[e].remove(rem)
                hosted_on[rem[1]].discard(e)
            if add is not None:
                inst[e].append(add)
                inst[e].sort()
                hosted_on[add[1]].add(e)
        for e in touched:
            apply(e, +1)
        if max(L) <= before_max and L[rb] < before_rb:
            return True
        for e, add, rem in changes:
            if add is not None:
                hosted_on[add[1]].discard(e)
            if rem is not None:
                hosted_on[rem[1]].add(e)
        for e in touched:
            apply(e, -1)
            inst[e] = saved[e]
            apply(e, +1)
        return False

    steps = 0
    while steps < 4 * R * N:
        steps += 1
        rb = max(range(R), key=lambda r: (L[r], -r))
        on_rb = sorted((-s, e) for e in hosted_on[rb] for (r, s) in shares(e) if r == rb and s > 0)
        changed = False
        for _, hot in on_rb:  # the busiest rank's experts, heaviest instance first
            hosts = {r for _, r in inst[hot]}
            free = [r for r in range(R) if -1 in slot_expert[r] and r not in hosts]
            if free:  # expand
                rt = min(free, key=lambda r: (L[r], r))
                j = slot_expert[rt].index(-1)
                if try_change([(hot, (E + rt * N + j, rt), None)]):
                    slot_expert[rt][j] = hot
                    changed = True
                    break
                continue
            # no free slot: migrate the lightest replica (shrinking its expert) to serve `hot`
            reps = [(dict(shares(f))[r], r, j, f) for r in range(R) for j, f in enumerate(slot_expert[r])
                    if f >= 0 and f != hot and r not in hosts]
            if reps:
                _, r, j, f = min(reps)
                p = E + r * N + j
                if try_change([(f, None, (p, r)), (hot, (p, r), None)]):
                    slot_expert[r][j] = hot
                    changed = True
                    break
        if not changed:
            break
    return _finish(omega, topology, N, main_rank, slot_expert, "none", "flexmoe", info={"steps": steps}, **kw)
