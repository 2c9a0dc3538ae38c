"""Unit tests (CPU): the exact MILP of problem (8) and every heuristic's gap to it on small instances."""

import pytest
import torch

from topoep import OFFLINE_POLICIES, POLICIES, Topology, metrics, solve
from topoep.workloads import biased_routing
from topoep_research.milp import solve_milp

W, S = 200_000, 4096


def test_milp_is_optimal_and_its_objective_is_the_metric():
    topo = Topology(num_domains=2, ranks_per_domain=2)
    om = biased_routing(4, 8, 64, 2, -2.0, seed=3)
    res = solve_milp(om, topo, num_slots=1, expert_bytes=W, token_bytes=S)
    assert res.optimal and res.gap < 1e-6
    res.plan.check(c4=True)
    assert metrics(res.plan)["t_total"] == pytest.approx(res.objective, rel=1e-6)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("slots", [0, 1, 2])
def test_no_heuristic_beats_the_optimum(seed, slots):
    topo = Topology(num_domains=2, ranks_per_domain=2)
    om = biased_routing(4, 8, 48, 2, -3.0, seed=seed, layout=["random", "clustered"][seed % 2])
    res = solve_milp(om, topo, num_slots=slots, expert_bytes=W, token_bytes=S)
    assert res.optimal
    for policy in POLICIES + OFFLINE_POLICIES:
        plan = solve(om, topo, num_slots=slots, policy=policy, expert_bytes=W, token_bytes=S)
        t = metrics(plan)["t_total"]
        assert t >= res.objective * (1 - 1e-9), (policy, t, res.objective)
        if slots == 0:  # no slots: every policy is the static plan, which is optimal
            assert t == pytest.approx(res.objective, rel=1e-9)


def test_topoep_gap_on_small_instances_is_reported():
    # the paper's heuristic is not exact; record its gap distribution on small instances (C4 enforced)
    topo = Topology(num_domains=2, ranks_per_domain=2)
    gaps = []
    for seed in range(6):
        om = biased_routing(4, 8, 48, 2, -2.0, seed=seed)
        res = solve_milp(om, topo, num_slots=1, expert_bytes=W, token_bytes=S)
        t = metrics(solve(om, topo, num_slots=1, policy="topoep", expert_bytes=W, token_bytes=S))["t_total"]
        gaps.append(t / res.objective - 1)
    assert min(gaps) >= -1e-9
    assert sum(gaps) / len(gaps) < 0.5  # topoep is a sensible heuristic, far from the 2x of no balancing


def test_makespan_objective_and_limits():
    topo = Topology(num_domains=1, ranks_per_domain=4)
    om = torch.zeros(4, 8, dtype=torch.int64)
    om[:, 0] = 10
    om[:, 1:] = 1
    res = solve_milp(om, topo, num_slots=1, expert_bytes=W, token_bytes=S, objective="makespan", enforce_c4=False)
    assert res.optimal and res.objective == pytest.approx(om.sum().item() / 4)
    with pytest.raises(ValueError, match="small instances"):
        solve_milp(torch.zeros(16, 32, dtype=torch.int64), Topology(num_domains=2, ranks_per_domain=8),
                   num_slots=1, expert_bytes=W, token_bytes=S)


@pytest.mark.parametrize("seed", range(3))
def test_compact_formulation_matches_the_full_one(seed):
    # the tree form of the routing cost (exact on two-level topologies) gives the same optimum with
    # E * R instead of R * E * R integer variables, and a valid plan whose metric is that optimum
    topo = Topology(num_domains=2, ranks_per_domain=2)
    om = biased_routing(4, 8, 48, 2, -2.5, seed=seed, layout=["random", "clustered", "scattered"][seed])
    full = solve_milp(om, topo, num_slots=1 + seed % 2, expert_bytes=W, token_bytes=S)
    compact = solve_milp(om, topo, num_slots=1 + seed % 2, expert_bytes=W, token_bytes=S, formulation="compact")
    assert full.optimal and compact.optimal
    assert compact.objective == pytest.approx(full.objective, rel=1e-9)
    compact.plan.check(c4=True)
    assert metrics(compact.plan)["t_total"] == pytest.approx(compact.objective, rel=1e-9)
    mk = solve_milp(om, topo, num_slots=1, expert_bytes=W, token_bytes=S, objective="makespan", formulation="compact")
    assert mk.objective == pytest.approx(solve_milp(om, topo, num_slots=1, expert_bytes=W, token_bytes=S,
                                                    objective="makespan").objective)


def test_compact_formulation_needs_two_level_costs():
    c = torch.tensor([[0, 1, 4, 5], [1, 0, 6, 4], [4, 6, 0, 2], [5, 4, 2, 0]], dtype=torch.float64) * 1e-12
    topo = Topology(num_domains=2, ranks_per_domain=2, cost=c)
    with pytest.raises(ValueError, match="two-level"):
        solve_milp(torch.ones(4, 8, dtype=torch.int64), topo, num_slots=1, expert_bytes=W, token_bytes=S,
                   formulation="compact")
