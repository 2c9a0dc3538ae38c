"""GPU tests (skipped without CUDA; run on the GPU machine): the capacity step's kernel (csrc/capacity.cu) returns
the reference's fitted plan (topoep.planners.capacity) bit for bit, with the same report, on random and
adversarial plans of every policy (R up to 128), never synchronises the host, and replays in a CUDA graph."""

import random

import pytest
import torch
from cuda_checks import captured, without_host_sync

from topoep import Topology, solve
from topoep.plan import Plan
from topoep.planners.capacity import fit_capacity
from topoep.planners.cuda import capacity_info, fit_capacity_cuda
from topoep.workloads import biased_routing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

POLICIES = ("static", "topoep", "topoep_plus", "deepseek", "flexmoe")
CASES = 100


def case(rng: random.Random):
    """(omega, topology, slots, capacity): the shapes of tests/test_capacity.py's property test, drawn from rng."""
    R = rng.choice([2, 4, 8, 16, 32, 64, 128])
    E = R * rng.randint(1, max(1, 640 // R))
    rpd = rng.choice([d for d in range(1, R + 1) if R % d == 0])
    k, T = rng.randint(1, min(8, E)), rng.choice([0, 7, 64, 256, 1024])
    kind = rng.choice(["biased", "biased", "one_expert", "one_rank", "one_domain", "ragged"])
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    if kind == "biased":
        om = biased_routing(R, E, T, k, rng.choice([0.0, -1.0, -2.0, -4.0, -8.0]), seed=rng.randrange(100),
                            layout=rng.choice(["random", "clustered", "scattered", "concentrated"]))
    else:
        hi = {"one_expert": 1, "one_rank": E // R, "one_domain": E // R * rpd, "ragged": E}[kind]
        om = torch.zeros(R, E, dtype=torch.int64)
        for s in range(R):
            n = T * k if kind != "ragged" else rng.randint(0, T * k)
            om[s].index_add_(0, torch.randint(0, hi, (n,), generator=g), torch.ones(n, dtype=torch.int64))
    om[rng.sample(range(R), rng.randint(0, R // 4))] = 0
    cap = max(1, int(rng.choice([1.0, 1.1, 1.25, 2.0]) * T * k))
    return om, Topology(num_domains=R // rpd, ranks_per_domain=rpd), rng.choice([0, 1, 2, 4]), cap


def _same(ref, got):
    """The same fitted plan and report (the kernel flags the new replicas' slots; the reference lists them in the
    order it placed them)."""
    want = {k: ref.info["capacity"][k] for k in ("moves", "overflow", "refit")}
    have = {k: v for k, v in capacity_info(got).items() if k in want}
    want["new_replicas"] = sorted(ref.info["capacity"]["new_replicas"])
    have["new_replicas"] = sorted(capacity_info(got)["new_replicas"])
    return (torch.equal(ref.slot_expert, got.slot_expert.cpu()) and torch.equal(ref.route, got.route.cpu())
            and want == have)


@pytest.mark.parametrize("seed", range(4))
def test_cuda_fit_equals_reference(seed):
    """CASES random cases per seed, every policy's plan, new replicas allowed and not."""
    rng = random.Random(1000 + seed)
    mismatches = []
    for i in range(CASES):
        om, topo, N, cap = case(rng)
        for policy in POLICIES:
            plan = solve(om, topo, num_slots=N, policy=policy, expert_bytes=200_000, token_bytes=4096,
                         backend="reference")
            gpu = Plan(omega=om.cuda(), topology=topo, num_slots=N, main_rank=plan.main_rank.cuda(),
                       slot_expert=plan.slot_expert.cuda(), route=plan.route.cuda(), policy=policy,
                       expert_bytes=plan.expert_bytes, token_bytes=plan.token_bytes)
            for allow in (True, False):
                ref = fit_capacity(plan, cap, allow_new=allow)
                got = fit_capacity_cuda(gpu, cap, allow_new=allow)
                if not _same(ref, got):
                    mismatches.append((i, policy, allow, tuple(om.shape), topo.ranks_per_domain, N, cap))
    assert not mismatches, f"{len(mismatches)} fitted plans differ from the reference, e.g. {mismatches[:5]}"


def test_solve_with_capacity_on_the_gpu_equals_the_reference():
    topo = Topology(num_domains=4, ranks_per_domain=8)
    for layout in ("random", "clustered", "concentrated"):
        om = biased_routing(32, 640, 1024, 8, -2.0, seed=3, layout=layout)
        cap = int(1.1 * 1024 * 8)
        for policy in ("static", "topoep", "topoep_plus"):
            got = solve(om.cuda(), topo, num_slots=2, policy=policy, capacity=cap, backend="cuda")
            ref = solve(om, topo, num_slots=2, policy=policy, capacity=cap, backend="reference")
            assert _same(ref, got), (layout, policy)


def test_no_host_synchronisation_and_graph_replay():
    topo = Topology(num_domains=2, ranks_per_domain=8)
    om = biased_routing(16, 128, 512, 8, -4.0, seed=5, layout="concentrated").cuda()
    cap = int(1.25 * 512 * 8)
    fit_capacity_cuda(solve(om, topo, num_slots=2, policy="static", backend="cuda"), cap)  # build, allocate
    without_host_sync(lambda: fit_capacity_cuda(solve(om, topo, num_slots=2, policy="static", backend="cuda"), cap))
    buf = om.clone()
    graph, out = captured(lambda: fit_capacity_cuda(solve(buf, topo, num_slots=2, policy="topoep", backend="cuda"), cap))
    for seed in (6, 7):
        new = biased_routing(16, 128, 512, 8, -4.0, seed=seed, layout="clustered")
        buf.copy_(new.cuda())
        graph.replay()
        ref = solve(new, topo, num_slots=2, policy="topoep", capacity=cap, backend="reference")
        assert torch.equal(out.slot_expert.cpu(), ref.slot_expert) and torch.equal(out.route.cpu(), ref.route)
