"""GPU tests of the spread planner (csrc/spread.cu; skipped without CUDA, run on the GPU machine): its plans equal the
reference's (topoep.planners.spread) bit for bit, slot table, route and counters, on every workload scenario and on
random cases; it never synchronises the host; it replays in a CUDA graph; its enable flag is read on the device."""

import random

import pytest
import torch

from topoep import Topology, solve
from topoep.planners.cuda import SPREAD_POLICIES, spread_info
from topoep.workloads import SCENARIOS, biased_routing, scenario

pytestmark = pytest.mark.gpu

W, S = 9_437_184, 4096


def _random_cases(n: int, seed: int) -> list:
    """(omega, topology, slots, expert bytes, t_ffn): R 8-128 in 1-16 domains, 1-8 experts per rank, 0-4 slots,
    skews from uniform to very hot, every layout, zero rows and zero experts, expert sizes and t_ffn that make
    copies cheap or dear."""
    rng = random.Random(seed)
    cases = []
    for i in range(n):
        R = rng.choice([8, 16, 32, 64, 128])
        rpd = rng.choice([d for d in (1, 2, 4, 8, 16) if R % d == 0 and R // d <= 16])
        E = R * rng.choice([1, 2, 4, 5, 8])
        om = biased_routing(R, E, rng.choice([16, 256, 1024]), rng.choice([2, 8]), rng.choice([0.0, -1.0, -2.5, -4.0]),
                            seed=i, layout=rng.choice(["random", "concentrated"]))
        if i % 7 == 0:
            om[rng.randrange(R)] = 0  # a source with no tokens
        if i % 5 == 0:
            om[:, rng.randrange(E)] = 0  # an expert nobody chose
        cases.append((om, Topology(num_domains=R // rpd, ranks_per_domain=rpd), rng.choice([0, 1, 2, 3, 4]),
                      rng.choice([W, W // 16, 4 * W]), rng.choice([20e-9, 45e-9, 200e-9])))
    return cases


def _scenario_cases() -> list:
    return [(scenario(name, R, E, 512, 8, ranks_per_domain=8, seed=3), Topology(num_domains=R // 8, ranks_per_domain=8),
             N, W, 45e-9)
            for name in SCENARIOS for R, E in ((16, 128), (32, 640), (64, 256)) for N in (1, 2, 4)]


def _mismatches(cases) -> list:
    bad = []
    for i, (om, topo, N, w, t) in enumerate(cases):
        for policy in SPREAD_POLICIES:
            kw = dict(num_slots=N, policy=policy, expert_bytes=w, token_bytes=S, t_ffn=t)
            ref = solve(om, topo, backend="reference", **kw)
            got = solve(om.cuda(), topo, backend="cuda", **kw)
            same = (torch.equal(got.slot_expert.cpu(), ref.slot_expert) and torch.equal(got.route.cpu(), ref.route)
                    and spread_info(got) == spread_info(ref))
            if not same:
                bad.append((i, policy, tuple(om.shape), topo.num_domains, N, w, t))
    return bad


def test_spread_plan_equals_reference_on_every_scenario():
    """Every workload scenario at EP 16, 32 and 64 (domains of 8), 1, 2 and 4 slots, both policies."""
    bad = _mismatches(_scenario_cases())
    assert not bad, f"{len(bad)} plans differ from the reference, e.g. {bad[:5]}"


@pytest.mark.parametrize("seed", [0, 1])
def test_spread_plan_equals_reference_on_random_cases(seed):
    bad = _mismatches(_random_cases(120, seed))
    assert not bad, f"{len(bad)} plans differ from the reference, e.g. {bad[:5]}"


def test_spread_move_cost_equals_reference():
    """The greedy's stopping threshold as the kernel reads it (SpreadDims.stop_hi): with move_cost_fs 0 (every move
    that gains anything), the default, a dear one and one no move can pay, and with max_moves cut, the plan and
    counters equal the reference's with the same arguments."""
    from topoep.plan import default_main_rank
    from topoep.planners.cuda import solve_spread_cuda
    from topoep.planners.spread import solve_topoep_plus_spread

    bad = []
    for name in ("natural", "random_bias", "warm_domain"):
        for R, E, N in ((32, 640, 2), (64, 512, 1)):
            om = scenario(name, R, E, 4096, 8, ranks_per_domain=8, seed=5)
            topo = Topology(num_domains=R // 8, ranks_per_domain=8)
            for policy in SPREAD_POLICIES:
                for kw in ({"move_cost_fs": 0}, {}, {"move_cost_fs": 20_000_000_000}, {"move_cost_fs": 1 << 62},
                           {"move_cost_fs": 0, "max_moves": 7}):
                    args = dict(num_slots=N, expert_bytes=W, token_bytes=S, t_ffn=45e-9, **kw)
                    ref = solve_topoep_plus_spread(om, topo, main_rank=default_main_rank(E, R),
                                                   trees=policy == "topoep_plus_spread_tree", **args)
                    got = solve_spread_cuda(om.cuda(), topo, policy=policy, main_rank=default_main_rank(E, R).cuda(),
                                            **args)
                    if not (torch.equal(got.slot_expert.cpu(), ref.slot_expert) and
                            torch.equal(got.route.cpu(), ref.route) and spread_info(got) == spread_info(ref)):
                        bad.append((name, R, policy, kw))
    assert not bad, f"{len(bad)} plans differ from the reference: {bad[:5]}"


def check_sync_free_graph(policies, scenarios, info, **plan_kw) -> None:
    """Each policy plans without host synchronisation (sync debug mode "error"), on a side stream, and from a CUDA
    graph replayed on the omega of each scenario (EP 32, E 640, 4 domains of 8, 2 slots): every replay's plan the
    reference's bit for bit, `info(plan)` included, and not the static plan. Shared with tests/test_peers_cuda.py."""
    R, E, N = 32, 640, 2
    topo = Topology(num_domains=4, ranks_per_domain=8)
    omegas = [scenario(n, R, E, 512, 8, ranks_per_domain=8, seed=1).cuda() for n in scenarios]
    buf = omegas[0].clone()
    for policy in policies:
        kw = dict(num_slots=N, policy=policy, backend="cuda", **plan_kw)
        solve(buf, topo, **kw)  # builds the extension and the workspace
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            solve(buf, topo, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            solve(buf, topo, **kw)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan = solve(buf, topo, **kw)
        for om in omegas:
            buf.copy_(om)
            graph.replay()
            ref = solve(om.cpu(), topo, **{**kw, "backend": "reference"})
            assert torch.equal(plan.slot_expert.cpu(), ref.slot_expert) and torch.equal(plan.route.cpu(), ref.route)
            assert info(plan) == info(ref)
            assert int((ref.slot_expert >= 0).sum()) > 0  # the cases place replicas: the replay plans, not static


def check_enable_flag(policies, name: str) -> None:
    """Each policy's enable flag, read on the device: False gives the static plan, True the reference's (scenario
    `name`, EP 32, E 640, 4 domains of 8, 2 slots, where the policy places replicas). Shared with test_peers_cuda."""
    om = scenario(name, 32, 640, 512, 8, ranks_per_domain=8, seed=2).cuda()
    topo = Topology(num_domains=4, ranks_per_domain=8)
    static = solve(om, topo, num_slots=2, policy="static", backend="cuda")
    for policy in policies:
        for flag in (False, True):
            got = solve(om, topo, num_slots=2, policy=policy, backend="cuda", enable=torch.tensor(flag, device="cuda"))
            ref = solve(om.cpu(), topo, num_slots=2, policy=policy, backend="reference")
            want = ref if flag else static
            assert torch.equal(got.slot_expert, want.slot_expert.cuda()) and torch.equal(got.route, want.route.cuda())
        assert int((ref.slot_expert >= 0).sum()) > 0


def test_spread_plans_without_host_synchronisation_and_replays_in_a_graph():
    check_sync_free_graph(SPREAD_POLICIES, ("hot_rank", "random_bias"), spread_info, expert_bytes=W, token_bytes=S)


def test_spread_enable_flag_is_read_on_the_device():
    check_enable_flag(SPREAD_POLICIES, "random_bias")
