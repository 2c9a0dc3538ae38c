"""The per-expert route steps of csrc/spread.cu (route_expert), written out in Python, give
common.hierarchical_route's route bit for bit: the GPU test (tests/test_spread_cuda.py) compares the kernel itself."""

import random

import torch

from topoep import Topology, solve
from topoep.planners.common import hierarchical_route
from topoep.workloads import biased_routing


def route_steps(om, rpd, slot, U):
    """csrc/spread.cu route_expert's steps in Python: per expert, its instances in index order; 1. own rank; 2. per
    domain, the sources' and instances' prefix fills of m and their intervals' overlaps; 3. the rest, over all
    sources and instances."""
    R, E = len(om), len(om[0])
    N = len(slot[0])
    Eloc = E // R
    P = E + R * N
    route = [[0] * P for _ in range(R)]
    for e in range(E):
        I = [e] + [E + r * N + j for r in range(R) for j in range(N) if slot[r][j] == e]
        rank_of = lambda p: p // Eloc if p < E else (p - E) // N
        inst = {rank_of(p): p for p in I}
        u1, w = {}, [0] * R
        for s in range(R):                       # 1. own rank
            x = om[s][e]
            p = inst.get(s)
            loc = min(x, U[p]) if p is not None else 0
            w[s] = x - loc
            if p is not None:
                u1[p] = U[p] - loc
                route[s][p] = loc
        u2 = dict(u1)
        for d in range(R // rpd):                # 2. own domain
            src = range(d * rpd, (d + 1) * rpd)
            Id = [p for p in I if rank_of(p) // rpd == d]
            m = min(sum(u1[p] for p in Id), sum(w[s] for s in src))
            if m == 0:
                continue
            acc, a, alo = 0, {}, {}
            for s in src:
                alo[s] = min(acc, m); a[s] = min(max(m - acc, 0), w[s]); acc += w[s]
            acc, c, clo = 0, {}, {}
            for p in Id:
                clo[p] = min(acc, m); c[p] = min(max(m - acc, 0), u1[p]); acc += u1[p]
            for s in src:
                for p in Id:
                    ov = min(alo[s] + a[s], clo[p] + c[p]) - max(alo[s], clo[p])
                    if ov > 0:
                        route[s][p] += ov
            for s in src:
                w[s] -= a[s]
            for p in Id:
                u2[p] = u1[p] - c[p]
        acc, lo = 0, {}                          # 3. any source
        for s in range(R):
            lo[s] = acc; acc += w[s]
        acc, plo = 0, {}
        for p in I:
            plo[p] = acc; acc += u2[p]
        for s in range(R):
            if w[s] == 0: continue
            for p in I:
                ov = min(lo[s] + w[s], plo[p] + u2[p]) - max(lo[s], plo[p])
                if ov > 0:
                    route[s][p] += ov
    return torch.tensor(route)


def test_route_steps_equal_the_hierarchical_route():
    rng = random.Random(0)
    for i in range(40):
        R = rng.choice([4, 8, 16])
        rpd = rng.choice([d for d in (1, 2, 4, 8) if R % d == 0])
        E = R * rng.choice([1, 2, 5])
        om = biased_routing(R, E, rng.choice([16, 256]), 2, rng.choice([0.0, -2.5, -4.0]), seed=i,
                            layout=rng.choice(["random", "concentrated"]))
        if i % 5 == 0:
            om[rng.randrange(R)] = 0
        topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
        N = rng.choice([1, 2, 3])
        for policy in ("topoep_plus_spread", "topoep_plus_spread_tree", "topoep_plus"):
            p = solve(om, topo, num_slots=N, policy=policy, expert_bytes=rng.choice([9_437_184, 200_000]),
                      token_bytes=4096)
            ref = hierarchical_route(om, topo, p.main_rank, p.slot_expert, p.instance_load)
            got = route_steps(om.tolist(), rpd, p.slot_expert.tolist(), p.instance_load.tolist())
            assert torch.equal(ref, got), (i, policy)
