"""Planning a large NVLink domain as groups (`Topology.planning_groups`, `solve`'s plan_domain,
LayerConfig.plan_domain): the groups' topology, the plans it gives on the real topology, and what the simulator
charges for them. The layer's multi-rank test is tests/test_runtime_guard.py::test_plan_domain_plans_a_large_domain_as_groups."""

import pytest
import torch

from topoep import LayerConfig, Topology, solve
from topoep.planners import POLICIES, REFINED_POLICIES
from topoep.runtime.moe import plus_policies
from topoep.workloads import scenario

NVLINK, NIC = 1 / 200e9, 1 / 50e9


def test_planning_groups_split_each_domain():
    one = Topology(num_domains=1, ranks_per_domain=24, intra_cost=NVLINK, inter_cost=NIC)
    g = one.planning_groups(8)
    assert (g.num_domains, g.ranks_per_domain) == (3, 8)
    assert torch.equal(g.cost, torch.full((24, 24), NVLINK, dtype=torch.float64).fill_diagonal_(0))  # all NVLink
    assert one.planning_groups(16).ranks_per_domain == 12  # the largest divisor of 24 not above 16
    assert one.planning_groups(5).ranks_per_domain == 4 and one.planning_groups(1).ranks_per_domain == 1
    assert one.planning_groups(8) is g  # cached: the runtime asks in every call
    for whole in (None, 24, 64):
        assert one.planning_groups(whole) is one
    two = Topology(num_domains=2, ranks_per_domain=16, intra_cost=NVLINK, inter_cost=NIC)
    g2 = two.planning_groups(8)
    assert (g2.num_domains, g2.ranks_per_domain) == (4, 8)
    # one price between groups (the CUDA planner's two-level model): the NIC's where there are several domains
    assert g2.cost[0, 1] == NVLINK and g2.cost[0, 8] == NIC and g2.cost[0, 16] == NIC
    for bad in (0, -1, 2.0, True, "8"):
        with pytest.raises(ValueError, match="ranks per planning group"):
            one.planning_groups(bad)


@pytest.mark.parametrize("policy", REFINED_POLICIES)
def test_solve_plans_on_the_groups_and_returns_the_real_topology(policy):
    topo = Topology(num_domains=2, ranks_per_domain=16, intra_cost=NVLINK, inter_cost=NIC)
    omega = scenario("natural", 32, 256, 512, 8, ranks_per_domain=16, seed=1)
    groups = topo.planning_groups(8)
    plan = solve(omega, topo, num_slots=2, policy=policy, plan_domain=8)
    on_groups = solve(omega, groups, num_slots=2, policy=policy)
    assert torch.equal(plan.slot_expert, on_groups.slot_expert) and torch.equal(plan.route, on_groups.route)
    assert plan.topology is topo and plan.info["plan_domain"] == 8
    plan.check()  # C1-C5 on the real domains (C4: a group's demand is at most its domain's)
    whole = solve(omega, topo, num_slots=2, policy=policy)
    assert "plan_domain" not in whole.info
    assert not torch.equal(whole.slot_expert, plan.slot_expert)  # the groups plan differently
    same = solve(omega, topo, num_slots=2, policy=policy, plan_domain=16)  # groups as large as the domains
    assert torch.equal(same.slot_expert, whole.slot_expert) and torch.equal(same.route, whole.route)


def test_plan_domain_leaves_the_other_policies_alone_and_keeps_the_capacity_step():
    topo = Topology(num_domains=1, ranks_per_domain=16)
    omega = scenario("random_bias", 16, 128, 512, 8, ranks_per_domain=16, seed=2)
    for policy in set(POLICIES) - set(REFINED_POLICIES):
        a = solve(omega, topo, num_slots=2, policy=policy, plan_domain=4)
        b = solve(omega, topo, num_slots=2, policy=policy)
        assert torch.equal(a.slot_expert, b.slot_expert) and torch.equal(a.route, b.route), policy
    cap = 300
    fitted = solve(omega, topo, num_slots=2, policy="topoep_plus", plan_domain=4, capacity=cap)
    fitted.check()
    assert fitted.topology is topo and fitted.info["plan_domain"] == 4 and "capacity" in fitted.info
    for bad in (0, 2.5, True):
        with pytest.raises(ValueError, match="plan_domain must be an integer >= 1"):
            solve(omega, topo, num_slots=2, policy="topoep", plan_domain=bad)


def test_the_layer_plans_a_local_candidate_only_where_the_planners_see_domains():
    one = Topology(num_domains=1, ranks_per_domain=16)
    assert plus_policies(one) == ("topoep_plus",)
    assert plus_policies(one, plan_domain=8) == ("topoep_plus", "topoep_plus_local")
    assert plus_policies(one, plan_domain=16) == ("topoep_plus",)
    assert LayerConfig().plan_domain == 32 and LayerConfig(plan_domain=None).plan_domain is None
    for bad in (0, 1.5, "8"):
        with pytest.raises(ValueError, match="LayerConfig.plan_domain"):
            LayerConfig(plan_domain=bad)


def test_the_simulator_times_the_refinement_at_the_groups_size():
    import topoep_research.sim as sim

    cl, model = sim.CLUSTERS["gb200_nvl72"], sim.MODELS["qwen3"].with_experts(512)
    omega = scenario("natural", 64, 512, 4096, 8, ranks_per_domain=64, seed=0)
    r = {pd: sim.simulate(omega, cl, model=model, policy="topoep", num_slots=2,
                          execution=sim.Execution(plan_domain=pd)) for pd in (8, None)}
    # one domain of 64 refines for about 0.6 ms more than domains of 8 (GPU_DOMAIN_EXTRA_US)
    extra = r[None].terms["plan"] - r[8].terms["plan"]
    assert extra == pytest.approx(sim.GPU_DOMAIN_EXTRA_US[-1][1] * 1e-6, rel=1e-6)
    assert sim.Execution().plan_domain == 32
    with pytest.raises(ValueError, match="Execution.plan_domain"):
        sim.Execution(plan_domain=0)
