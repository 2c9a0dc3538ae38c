"""Unit tests (CPU): hand-worked planner cases, including the paper's Fig. 9 example."""

import pytest
import torch

from topoep import POLICIES, Topology, metrics, solve
from topoep_research import POLICIES as RESEARCH_POLICIES


def fig9_omega():
    # Two domains {GPU0, GPU1} and {GPU2, GPU3}; two experts per GPU (E0,E1 on GPU0, E4,E5 on GPU2, ...).
    # GPU 0 sends 8 assignments to E4 (main on GPU 2) and has 6 for its own E0; GPU 1 has 6 for E2;
    # GPU 2 has 10 for its own E5.
    om = torch.zeros(4, 8, dtype=torch.int64)
    om[0, 4] = 8
    om[0, 0] = 6
    om[1, 2] = 6
    om[2, 5] = 10
    return om


def test_fig9_two_stage_example():
    topo = Topology(num_domains=2, ranks_per_domain=2)
    # one replica transfer (W) costs less than the exposed bidirectional token traffic (2 * 8 * S)
    plan = solve(fig9_omega(), topo, num_slots=1, policy="topoep", expert_bytes=1000, token_bytes=100).check()
    # stage 1 replicates E4 on GPU 0 (loads 14 / 6); refinement adds E4'' on GPU 1 and moves 4 of E4
    assert plan.slot_expert[0].tolist() == [4]
    assert plan.slot_expert[1].tolist() == [4]
    L = plan.rank_load.tolist()
    assert L[0] == 10 and L[1] == 10
    x, q = plan.to_dense()
    assert q[0, 4, 0] + q[0, 4, 1] == 8  # all of GPU 0's E4 assignments stay in its domain
    assert q[0, 4, 2] == 0
    assert metrics(plan)["internode_fraction"] == 0.0
    # domain 1: E5 (10 assignments on GPU 2) is spread to GPU 3
    assert L[2] == 5 and L[3] == 5


def test_fig9_without_benefit_keeps_tokens_on_the_main():
    topo = Topology(num_domains=2, ranks_per_domain=2)
    # now the expert is too large: W >= 2 * D * S, so C4 forbids the cross-domain replica
    plan = solve(fig9_omega(), topo, num_slots=1, policy="topoep", expert_bytes=1600, token_bytes=100).check()
    assert 4 not in plan.slot_expert[:2].reshape(-1).tolist()
    _, q = plan.to_dense()
    assert q[0, 4, 2:].sum() == 8


def test_static_is_megatron_placement():
    topo = Topology(num_domains=1, ranks_per_domain=4)
    om = torch.arange(32).view(4, 8)
    plan = solve(om, topo, num_slots=3, policy="static").check()
    assert plan.num_replicas == 0
    assert plan.rank_load.tolist() == om.sum(0).view(4, 2).sum(1).tolist()


def test_single_domain_refinement_spreads_a_hot_expert():
    topo = Topology(num_domains=1, ranks_per_domain=4)
    om = torch.zeros(4, 4, dtype=torch.int64)
    om[:, 0] = 10  # 40 assignments for expert 0 (rank 0)
    om[:, 1:] = 2  # 8 for each other expert
    plan = solve(om, topo, num_slots=1, policy="topoep").check()
    # 64 assignments over 4 ranks: perfect balance is 16 each
    assert plan.rank_load.tolist() == [16, 16, 16, 16]
    assert plan.num_replicas == 3 and (plan.slot_expert == 0).sum() == 3


def test_zero_demand_and_zero_slots():
    topo = Topology(num_domains=2, ranks_per_domain=2)
    om = torch.zeros(4, 8, dtype=torch.int64)
    for policy in POLICIES + RESEARCH_POLICIES:
        for n in (0, 2):
            plan = solve(om, topo, num_slots=n, policy=policy).check()
            assert plan.rank_load.sum() == 0 and plan.num_replicas == 0
            assert metrics(plan)["imbalance"] == 1.0


def test_even_split_rotates_remainder_by_source():
    # 3 instances of expert 0 in one domain, every source sends 1 assignment: the remainders go to
    # different instances rather than all to the main.
    from topoep.planners.common import even_split, instance_tables

    topo = Topology(num_domains=1, ranks_per_domain=3)
    om = torch.zeros(3, 3, dtype=torch.int64)
    om[:, 0] = 1
    slot_expert = torch.tensor([[-1], [0], [0]])
    ie, ir = instance_tables(torch.tensor([0, 1, 2]), slot_expert)
    route = even_split(om, ie, ir, topo, "none")
    assert route[:, [0, 4, 5]].tolist() == [[1, 0, 0], [0, 1, 0], [0, 0, 1]]


def test_interval_route_matches_loads():
    from topoep.planners.common import interval_route

    amount = torch.tensor([[3], [5], [0], [2]])  # four sources, one group
    group = torch.tensor([0, -1, 0, 0])
    load = torch.tensor([4, 0, 4, 2])
    route = interval_route(amount, group, load)
    assert route.tolist() == [[3, 0, 0, 0], [1, 0, 4, 0], [0, 0, 0, 0], [0, 0, 0, 2]]


@pytest.mark.parametrize("policy", POLICIES + RESEARCH_POLICIES)
def test_every_policy_on_fig9(policy):
    topo = Topology(num_domains=2, ranks_per_domain=2)
    plan = solve(fig9_omega(), topo, num_slots=2, policy=policy, expert_bytes=1000, token_bytes=100).check()
    assert int(plan.rank_load.sum()) == 30
