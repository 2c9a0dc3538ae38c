"""CPU tests of the capacity step (topoep.planners.capacity): hand-worked cases, the contract of the fitted plans
on random and adversarial inputs (R up to 128), what the step reports, and the planners' integer range."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topoep import POLICIES, Topology, solve
from topoep.planners import max_assignments
from topoep.planners.capacity import fit_capacity, overflow_rows, region_loads
from topoep.workloads import biased_routing


def _fits_or_reports(plan, fitted, capacity):
    """The contract of a fitted plan: valid (C1-C3, C5, no duplicate but self-replicas of the step), what does
    not fit is exactly info["overflow"], and a plan that fitted before is returned unchanged."""
    fitted.check()
    info = fitted.info["capacity"]
    assert info["overflow"] == overflow_rows(fitted, capacity)
    if overflow_rows(plan, capacity) == 0:
        assert info["moves"] == 0 and torch.equal(fitted.route, plan.route)
        assert torch.equal(fitted.slot_expert, plan.slot_expert)
    for r, j in info["new_replicas"]:
        assert int(fitted.slot_expert[r, j]) >= 0
        assert info["refit"] == "static" or int(plan.slot_expert[r, j]) < 0


def test_hand_worked_hot_rank_moves_to_a_new_replica_on_the_least_loaded_rank():
    # 3 ranks, 1 expert each, one slot each; rank 0's expert has 10 rows, capacity 6
    topo = Topology(num_domains=1, ranks_per_domain=3)
    omega = torch.tensor([[4, 1, 0], [3, 0, 2], [3, 1, 1]])
    plan = solve(omega, topo, num_slots=1, policy="static")
    fitted = fit_capacity(plan, 6)
    # rank 2 holds 3 rows, rank 1 holds 2: the 4 extra rows of expert 0 go to a new replica on rank 1 (least loaded),
    # taken from the sources in the order: rank 1 itself, its domain (all), never-left rows (source 0) last
    assert fitted.slot_expert.tolist() == [[-1], [0], [-1]]
    assert fitted.route.tolist() == [[4, 1, 0, 0, 0, 0], [0, 0, 2, 0, 3, 0], [2, 1, 1, 0, 1, 0]]
    assert region_loads(fitted).tolist() == [[6, 0], [2, 4], [3, 0]]
    assert fitted.info["capacity"] == {"capacity": 6, "moves": 1, "new_replicas": [(1, 0)], "overflow": 0,
                                       "stuck": [], "refit": None}
    fitted.check()


def test_a_self_replica_when_no_other_rank_exists():
    # one rank, two experts, one slot: 9 rows in its main region, capacity 5. The 4 extra rows of the larger
    # expert move to a replica of it in the rank's own slot region
    topo = Topology(num_domains=1, ranks_per_domain=1)
    fitted = fit_capacity(solve(torch.tensor([[7, 2]]), topo, num_slots=1, policy="static"), 5)
    assert fitted.slot_expert.tolist() == [[0]]
    assert fitted.route.tolist() == [[3, 2, 4]]
    assert region_loads(fitted).tolist() == [[5, 4]]
    fitted.check()  # a self-replica placed by the capacity step is valid


def test_another_rank_before_a_self_replica():
    # rank 1's main region is full but its slot region has room: the rows go there, not to rank 0's own slots
    topo = Topology(num_domains=1, ranks_per_domain=2)
    fitted = fit_capacity(solve(torch.tensor([[5, 3], [4, 2]]), topo, num_slots=1, policy="static"), 5)
    assert fitted.slot_expert.tolist() == [[-1], [0]]
    assert region_loads(fitted).tolist() == [[5, 0], [5, 4]]
    assert fitted.route[:, 3].tolist() == [0, 4]  # rank 1's own rows first
    fitted.check()


def test_no_slot_left_is_reported_not_dropped():
    topo = Topology(num_domains=1, ranks_per_domain=2)
    omega = torch.tensor([[8, 0], [8, 0]])
    plan = solve(omega, topo, num_slots=0, policy="static")
    fitted = fit_capacity(plan, 10)
    assert fitted.info["capacity"]["overflow"] == 6 and fitted.info["capacity"]["stuck"] == [(0, 0)]
    assert torch.equal(fitted.route, plan.route)  # nothing could move: every row is still routed
    fitted.check()
    # the same with a slot allowed nowhere (the runtime left the slots out)
    one = fit_capacity(solve(omega, topo, num_slots=1, policy="static"), 10, allow_new=False)
    assert one.info["capacity"]["overflow"] == 6


def test_refit_from_static_when_the_policy_spent_its_slots():
    # EP 32 as 4 x 8, 640 experts, a warm domain: topoep's replicas fill every slot and ranks 1-3 stay over
    topo = Topology(num_domains=4, ranks_per_domain=8)
    omega = biased_routing(32, 640, 4096, 8, -1.0, seed=0, layout="clustered")
    cap = int(1.25 * 4096 * 8)
    plan = solve(omega, topo, num_slots=2, policy="topoep")
    fitted = fit_capacity(plan, cap)
    assert fitted.info["capacity"]["refit"] == "static" and fitted.info["capacity"]["overflow"] == 0
    assert int(region_loads(fitted).max()) <= cap
    fitted.check()


@st.composite
def instances(draw, max_ranks=128):
    R = draw(st.sampled_from([r for r in (8, 16, 4, 32, 2, 64, 128, 1, 3) if r <= max_ranks]))
    E = R * draw(st.integers(1, max(1, 640 // R)))
    rpd = draw(st.sampled_from(sorted((d for d in range(1, R + 1) if R % d == 0), key=lambda d: (d == R, d == 1, d))))
    k = draw(st.integers(1, min(8, E)))
    T = draw(st.sampled_from([256, 64, 1024, 7, 0]))
    kind = draw(st.sampled_from(["biased", "one_expert", "one_rank", "one_domain", "ragged"]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if kind == "biased":
        om = biased_routing(R, E, T, k, draw(st.sampled_from([-2.0, 0.0, -4.0, -8.0])), seed=draw(st.integers(0, 99)),
                            layout=draw(st.sampled_from(["random", "clustered", "scattered"])))
    else:  # adversarial: every assignment of every rank on one expert / one rank's experts / one domain's experts
        lo, hi = {"one_expert": (0, 1), "one_rank": (0, E // R), "one_domain": (0, E // R * rpd),
                  "ragged": (0, E)}[kind]
        om = torch.zeros(R, E, dtype=torch.int64)
        for s in range(R):
            n = T * k if kind != "ragged" else int(torch.randint(0, T * k + 1, (1,), generator=g))
            om[s].index_add_(0, torch.randint(lo, hi, (n,), generator=g), torch.ones(n, dtype=torch.int64))
    zero = draw(st.lists(st.integers(0, R - 1), max_size=max(1, R // 4)))
    om[zero] = 0
    cf = draw(st.sampled_from([1.25, 1.0, 1.1, 2.0]))
    cap = max(1, int(cf * T * k))
    return om, Topology(num_domains=R // rpd, ranks_per_domain=rpd), draw(st.sampled_from([2, 1, 0, 4])), cap


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(instances())
def test_every_policy_fits_or_reports_what_does_not(inst):
    om, topo, slots, cap = inst
    for policy in POLICIES:
        plan = solve(om, topo, num_slots=slots, policy=policy, expert_bytes=200_000, token_bytes=4096)
        fitted = fit_capacity(plan, cap)
        _fits_or_reports(plan, fitted, cap)
        again = solve(om.clone(), topo, num_slots=slots, policy=policy, expert_bytes=200_000, token_bytes=4096,
                      capacity=cap)
        assert torch.equal(again.route, fitted.route) and torch.equal(again.slot_expert, fitted.slot_expert)


@pytest.mark.parametrize("R, rpd, E", [(8, 8, 128), (8, 4, 128), (32, 8, 128), (32, 8, 640), (128, 8, 640)])
def test_realistic_routing_fits_with_two_slots_at_the_default_factor(R, rpd, E):
    """Megatron's biased router from uniform to skew -4, every layout: with 2 slots and capacity 1.25 T k every
    policy's plan fits after the step (no spill)."""
    topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
    T, k = 1024, 8
    cap = int(1.25 * T * k)
    for skew in (0.0, -1.0, -4.0):
        for layout in ("random", "clustered", "concentrated"):
            om = biased_routing(R, E, T, k, skew, seed=1, layout=layout)
            for policy in ("static", "topoep", "topoep_plus"):
                fitted = solve(om, topo, num_slots=2, policy=policy, capacity=cap)
                assert fitted.info["capacity"]["overflow"] == 0, (skew, layout, policy)
                assert int(region_loads(fitted).max()) <= cap


@pytest.mark.parametrize("policy", ["topoep", "topoep_plus", "static", "deepseek"])
def test_counts_beyond_the_integer_range_are_refused(policy):
    topo = Topology(num_domains=2, ranks_per_domain=2)
    limit = max_assignments(topo, 4096, 9_437_184, 2, policy)
    with pytest.raises(ValueError, match=f"at most {limit}"):
        solve(torch.full((4, 16), 2**62, dtype=torch.int64), topo, policy=policy)
    with pytest.raises(ValueError, match="int64 arithmetic"):
        solve(torch.full((4, 16), 2**58, dtype=torch.int64), topo, policy=policy)
    om = torch.zeros(4, 16, dtype=torch.int64)
    om[0, 0] = limit
    solve(om, topo, policy=policy).check()  # at the limit: planned
    om[0, 1] = 1
    with pytest.raises(ValueError, match="int64 arithmetic"):
        solve(om, topo, policy=policy)


def test_the_range_holds_the_stage_1_sort_key():
    """topoep's stage 1 sorts a domain's experts by demand, then expert index, in one int64 key (demand x E): counts
    whose key would wrap around are refused, where they used to put a replica on its own main rank."""
    topo = Topology(num_domains=2, ranks_per_domain=1)
    om = torch.zeros(2, 16, dtype=torch.int64)
    om[0, 8] = 2**59 + 2**58
    with pytest.raises(ValueError, match="int64 arithmetic"):
        solve(om, topo, num_slots=1, policy="topoep", token_bytes=1, expert_bytes=1)
    om[0, 8] = 2**58
    assert int(solve(om, topo, num_slots=1, policy="topoep", token_bytes=1, expert_bytes=1).slot_expert[0, 0]) == 8


def test_the_cost_comparing_policies_have_the_smallest_range():
    topo = Topology(num_domains=2, ranks_per_domain=2)
    limits = {p: max_assignments(topo, 4096, 9_437_184, 2, p) for p in ("static", "topoep", "topoep_plus")}
    assert limits["topoep_plus"] < limits["topoep"] < limits["static"] == 2**62
    assert limits["topoep_plus"] > 10**10  # far beyond a real layer: 1024 ranks x 65536 tokens x top-8 is 5.4e8


@pytest.mark.parametrize("bad", [0, -3, 1.5, True, "10"])
def test_bad_capacity(bad):
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        solve(torch.ones(2, 4, dtype=torch.int64), Topology(num_domains=1, ranks_per_domain=2), capacity=bad)
