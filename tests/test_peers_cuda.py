"""GPU tests of the peers' planners (csrc/peers.cu; skipped without CUDA, run on the GPU machine): `deepseek` and
`flexmoe` plans equal the reference's (topoep.planners.baselines) bit for bit, slot table, route and flexmoe's step
count, on every workload scenario and on random cases; they never synchronise the host; they replay in a CUDA graph;
their enable flag is read on the device; the GPU flexmoe planner refuses more than 256 ranks by name."""

import pytest
import torch
from test_spread_cuda import S, W, _random_cases, _scenario_cases, check_enable_flag, check_sync_free_graph

from topoep import Topology, solve
from topoep.planners.cuda import PEER_POLICIES
from topoep.workloads import scenario

pytestmark = pytest.mark.gpu


def _steps(plan) -> int:
    """flexmoe's steps (0 for deepseek), from either planner (the CUDA one's is on the device)."""
    if "device" in plan.info:
        return int(plan.info["device"][0])
    return int(plan.info.get("steps", 0))


def _mismatches(cases) -> list:
    bad = []
    for i, (om, topo, N, w, _) in enumerate(cases):
        for policy in PEER_POLICIES:
            kw = dict(num_slots=N, policy=policy, expert_bytes=w, token_bytes=S)
            ref = solve(om, topo, backend="reference", **kw)
            got = solve(om.cuda(), topo, backend="cuda", **kw)
            same = (torch.equal(got.slot_expert.cpu(), ref.slot_expert) and torch.equal(got.route.cpu(), ref.route)
                    and _steps(got) == _steps(ref))
            if not same:
                bad.append((i, policy, tuple(om.shape), topo.num_domains, N))
    return bad


def test_peer_plans_equal_reference_on_every_scenario():
    """Every workload scenario at EP 16, 32 and 64 (domains of 8), 1, 2 and 4 slots, both policies."""
    bad = _mismatches(_scenario_cases())
    assert not bad, f"{len(bad)} plans differ from the reference, e.g. {bad[:5]}"


@pytest.mark.parametrize("seed", [0, 1])
def test_peer_plans_equal_reference_on_random_cases(seed):
    bad = _mismatches(_random_cases(120, seed))
    assert not bad, f"{len(bad)} plans differ from the reference, e.g. {bad[:5]}"


def test_peer_plans_equal_reference_on_large_domains_and_256_ranks():
    """Domains of 64 ranks (an NVL72 rack's share at EP 128: the deepseek kernel's lanes hold two ranks each) and 256
    ranks (the flexmoe kernel's most: eight rank words per lane)."""
    cases = [(scenario(name, R, R * 8, 512, 8, ranks_per_domain=rpd, seed=5), Topology(num_domains=R // rpd,
                                                                                       ranks_per_domain=rpd), N, W, 0)
             for name in ("hot_domain", "warm_domain", "random_bias") for R, rpd in ((128, 64), (256, 8)) for N in (1, 4)]
    bad = _mismatches(cases)
    assert not bad, f"{len(bad)} plans differ from the reference, e.g. {bad[:5]}"


def test_peer_plans_without_host_synchronisation_and_replay_in_a_graph():
    check_sync_free_graph(PEER_POLICIES, ("hot_domain", "random_bias"), _steps)


def test_peer_enable_flag_is_read_on_the_device():
    check_enable_flag(PEER_POLICIES, "hot_domain")


def test_flexmoe_kernel_refuses_more_than_256_ranks():
    om = torch.ones(512, 512, dtype=torch.int64, device="cuda")
    topo = Topology(num_domains=64, ranks_per_domain=8)
    with pytest.raises(ValueError, match="at most 256 ranks"):
        solve(om, topo, num_slots=1, policy="flexmoe", backend="cuda")
    plan = solve(om, topo, num_slots=1, policy="deepseek", backend="cuda")  # deepseek has no such limit
    assert torch.equal(plan.slot_expert.cpu(), solve(om.cpu(), topo, num_slots=1, policy="deepseek").slot_expert)
