"""Unit tests (CPU): Plan representation, dense views and the invariant checker (C1-C5)."""

import pytest
import torch

from topoep import Plan, Topology, solve
from topoep.planners.reference import solve_static

TOPO = Topology(num_domains=2, ranks_per_domain=2)


def small_plan(policy="topoep"):
    om = torch.tensor([[9, 0, 1, 0, 8, 0, 0, 0],
                       [0, 0, 6, 0, 0, 1, 0, 0],
                       [0, 0, 0, 0, 2, 10, 0, 0],
                       [0, 1, 0, 0, 0, 0, 0, 3]])
    return solve(om, TOPO, num_slots=2, policy=policy, expert_bytes=1000, token_bytes=100)


def test_compact_layout_and_dense_round_trip():
    plan = small_plan().check()
    R, E, N = 4, 8, 2
    assert plan.route.shape == (R, E + R * N) and plan.slot_expert.shape == (R, N)
    x, q = plan.to_dense()
    assert x.shape == (E, R) and q.shape == (R, E, R)
    assert torch.equal(q.sum(2), plan.omega)  # C1 in the dense view
    assert x[torch.arange(E), plan.main_rank].all()  # C5
    assert torch.equal(q.sum((0, 1)), plan.rank_load)
    back = Plan.from_dense(x, q, plan.omega, TOPO, num_slots=N, policy="topoep", expert_bytes=1000,
                           token_bytes=100).check()
    x2, q2 = back.to_dense()
    assert torch.equal(x, x2) and torch.equal(q, q2)


def _broken(plan, **changes):
    fields = dict(omega=plan.omega, topology=plan.topology, num_slots=plan.num_slots, main_rank=plan.main_rank,
                  slot_expert=plan.slot_expert.clone(), route=plan.route.clone(), policy=plan.policy,
                  expert_bytes=plan.expert_bytes, token_bytes=plan.token_bytes)
    fields.update(changes)
    return Plan(**fields)


def test_checker_names_each_violated_constraint():
    plan = small_plan().check()
    E, N = 8, 2
    # C1: drop one assignment
    r = plan.route.clone()
    r[0, 0] -= 1
    with pytest.raises(ValueError, match="C1"):
        _broken(plan, route=r).check()
    # C2: send to an empty slot
    se = plan.slot_expert.clone()
    r = plan.route.clone()
    empty = torch.nonzero(se.reshape(-1) < 0)[0].item()
    r[0, E + empty] += 1
    r[0, 0] -= 1
    with pytest.raises(ValueError, match="C2"):
        _broken(plan, route=r).check()
    # duplicate: a rank replicating its own main expert
    se = torch.full_like(plan.slot_expert, -1)
    se[0, 0] = 0  # expert 0's main is rank 0
    with pytest.raises(ValueError, match="duplicate"):
        _broken(plan, slot_expert=se, route=solve_static(plan.omega, TOPO, num_slots=N, main_rank=plan.main_rank,
                                                         expert_bytes=1, token_bytes=1).route).check()
    # duplicate: the same expert in two slots of one rank
    se = torch.full_like(plan.slot_expert, -1)
    se[1, :] = 4
    with pytest.raises(ValueError, match="duplicate"):
        _broken(plan, slot_expert=se).check()
    # C3: more slots than num_slots is unrepresentable; from_dense reports it
    x, q = plan.to_dense()
    x[:, 3] = True
    with pytest.raises(ValueError, match="C3"):
        Plan.from_dense(x, q, plan.omega, TOPO, num_slots=N)
    # C4: a cross-domain replica with too little demand in that domain
    se = torch.full_like(plan.slot_expert, -1)
    se[0, 0] = 7  # expert 7 lives on rank 3 (domain 1); domain 0 has no demand for it
    static = solve_static(plan.omega, TOPO, num_slots=N, main_rank=plan.main_rank, expert_bytes=1, token_bytes=1)
    bad = _broken(plan, slot_expert=se, route=static.route)
    with pytest.raises(ValueError, match="C4"):
        bad.check()
    bad.check(c4=False)  # the topology-unaware baselines are exempt
    # C5 / representation: main_rank out of range
    with pytest.raises(ValueError, match="C5"):
        _broken(plan, main_rank=torch.full((E,), 9)).check()


def test_derived_loads():
    plan = small_plan("static").check()
    # experts 0,1 on rank 0; 2,3 on rank 1; 4,5 on rank 2; 6,7 on rank 3
    assert plan.rank_load.tolist() == [9 + 1, 1 + 6, 8 + 2 + 1 + 10, 3]
    assert plan.num_replicas == 0
