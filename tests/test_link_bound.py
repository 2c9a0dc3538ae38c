"""topoep_research.bound.link_lower_bound: the per-link LP bounds the guard's per-link objective (`link_objective`)
of every policy's plan on random instances (one domain and several); it is exact where nothing can move (no slots:
the static plan is the only plan) and where nothing crosses a link (one rank)."""

import itertools

import pytest
import torch

from topoep import Topology, solve
from topoep.metrics import DEFAULT_T_FFN
from topoep.runtime.guard import NetBenefitGuard
from topoep.workloads import biased_routing, scenario
from topoep_research.bound import link_lower_bound, link_objective

KW = dict(expert_bytes=9437184, token_bytes=4096)
POLICIES = ("static", "topoep", "topoep_plus", "topoep_plus_local", "deepseek", "fastermoe", "flexmoe")


@pytest.mark.parametrize("domains,rpd", [(1, 4), (2, 2), (2, 4), (4, 2)])
def test_the_bound_is_below_every_policys_plan(domains, rpd):
    topo = Topology(num_domains=domains, ranks_per_domain=rpd)
    R = domains * rpd
    guard = NetBenefitGuard()
    for (skew, layout), slots, seed in itertools.product([(0.0, "random"), (-2.0, "random"), (-4.0, "clustered")],
                                                          (1, 2), range(2)):
        omega = biased_routing(R, 4 * R, 256, 4, skew, seed=seed, layout=layout)
        bound = link_lower_bound(omega, topo, num_slots=slots, **KW).bound
        assert bound > 0
        for policy in POLICIES:
            plan = solve(omega, topo, num_slots=slots, policy=policy, **KW)
            assert bound <= link_objective(plan, guard, DEFAULT_T_FFN) * (1 + 1e-7), (policy, skew, slots, seed)


def test_without_slots_the_bound_is_the_static_plan():
    guard = NetBenefitGuard()
    for name in ("random_bias", "hot_domain", "source_ragged"):
        topo = Topology(num_domains=2, ranks_per_domain=4)
        omega = scenario(name, 8, 64, 1024, 8, ranks_per_domain=4)
        static = solve(omega, topo, num_slots=0, policy="static", **KW)
        bound = link_lower_bound(omega, topo, num_slots=0, **KW).bound
        assert bound == pytest.approx(link_objective(static, guard, DEFAULT_T_FFN), rel=1e-6)


def test_one_rank_is_its_compute():
    omega = torch.tensor([[5, 0, 7, 3]])
    bound = link_lower_bound(omega, Topology(num_domains=1, ranks_per_domain=1), num_slots=2, **KW).bound
    assert bound == pytest.approx(15 * DEFAULT_T_FFN, rel=1e-6)
