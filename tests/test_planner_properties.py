"""Property tests (CPU, hypothesis): every policy's plan satisfies the contract on random instances.

Shapes up to R=64 and E=1280, zero rows, skews from uniform to extreme, 0-3 slots, 1..R domains. The
offline policies of topoep_research (`joint`: seconds per plan at EP 32) have their own test on shapes up to
R=16 and E=256.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topoep import POLICIES, Topology, metrics, solve
from topoep.workloads import biased_routing
from topoep_research import POLICIES as RESEARCH_POLICIES

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    derandomize=True)


@st.composite
def instances(draw, max_ranks=64, max_experts=1280):
    # (hypothesis favours the first elements of sampled_from: meaningful cases come first)
    R = draw(st.sampled_from([r for r in (8, 16, 4, 32, 64, 2, 12, 6, 3, 1) if r <= max_ranks]))
    per_rank = draw(st.integers(1, max(1, max_experts // R)))
    E = R * per_rank
    rpd = draw(st.sampled_from(sorted((d for d in range(1, R + 1) if R % d == 0), key=lambda d: (d == R, d == 1, d))))
    skew = draw(st.sampled_from([-2.0, 0.0, -4.0, -8.0, -1.0, -0.5]))
    k = draw(st.integers(1, min(8, E)))
    tokens = draw(st.sampled_from([256, 64, 1024, 7, 1, 0]))
    seed = draw(st.integers(0, 2**16))
    layout = draw(st.sampled_from(["random", "clustered", "scattered"]))
    om = biased_routing(R, E, tokens, k, skew, seed=seed, layout=layout)
    zero = draw(st.lists(st.integers(0, R - 1), max_size=max(1, R // 4)))
    om[zero] = 0
    slots = draw(st.sampled_from([2, 1, 3, 0]))
    W = draw(st.sampled_from([200_000, 9_437_184, 4096, 1]))
    return om, Topology(num_domains=R // rpd, ranks_per_domain=rpd), slots, W


@SETTINGS
@given(instances())
def test_every_policy_satisfies_the_contract(inst):
    om, topo, slots, W = inst
    static_max = None
    for policy in POLICIES:
        plan = solve(om, topo, num_slots=slots, policy=policy, expert_bytes=W, token_bytes=4096)
        plan.check()  # C1-C3, C5, no duplicate; C4 for topoep
        assert plan.route.dtype == torch.int64 and plan.slot_expert.dtype == torch.int64
        assert int(plan.rank_load.sum()) == int(om.sum())
        if policy == "static":
            static_max = int(plan.rank_load.max())
        if policy == "topoep":
            assert int(plan.rank_load.max()) <= static_max  # never worse than no balancing


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(instances(max_ranks=32, max_experts=640))
def test_plans_are_deterministic(inst):
    om, topo, slots, W = inst
    for policy in POLICIES:
        a = solve(om.clone(), topo, num_slots=slots, policy=policy, expert_bytes=W, token_bytes=4096)
        b = solve(om.clone(), topo, num_slots=slots, policy=policy, expert_bytes=W, token_bytes=4096)
        assert torch.equal(a.slot_expert, b.slot_expert) and torch.equal(a.route, b.route)


@SETTINGS
@given(instances(max_ranks=32, max_experts=640))
def test_topoep_respects_c4_and_keeps_tokens_local(inst):
    om, topo, slots, W = inst
    plan = solve(om, topo, num_slots=slots, policy="topoep", expert_bytes=W, token_bytes=4096)
    plan.check(c4=True)
    static = solve(om, topo, num_slots=slots, policy="static", expert_bytes=W, token_bytes=4096)
    # topoep only ever moves assignments into the source's domain
    assert metrics(plan)["internode_fraction"] <= metrics(static)["internode_fraction"] + 1e-12


@pytest.mark.parametrize("policy", RESEARCH_POLICIES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(instances(max_ranks=16, max_experts=256))
def test_offline_policy_satisfies_the_contract_and_is_deterministic(policy, inst):
    om, topo, slots, W = inst
    plan = solve(om, topo, num_slots=slots, policy=policy, expert_bytes=W, token_bytes=4096)
    plan.check(c4=True)  # C1-C5, no duplicate
    assert plan.route.dtype == torch.int64 and plan.slot_expert.dtype == torch.int64
    assert int(plan.rank_load.sum()) == int(om.sum())
    again = solve(om.clone(), topo, num_slots=slots, policy=policy, expert_bytes=W, token_bytes=4096)
    assert torch.equal(plan.slot_expert, again.slot_expert) and torch.equal(plan.route, again.route)


@pytest.mark.parametrize("R,E,rpd", [(64, 1280, 8), (64, 640, 16), (48, 960, 8)])
@pytest.mark.parametrize("skew", [0.0, -4.0])
def test_large_shapes(R, E, rpd, skew):
    om = biased_routing(R, E, 512, 8, skew, seed=R + E)
    om[3] = 0
    topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
    for policy in POLICIES:
        for slots in (0, 3):
            solve(om, topo, num_slots=slots, policy=policy).check()
