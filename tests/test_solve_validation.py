"""Unit tests (CPU): topoep.solve rejects bad input with a ValueError that names the problem."""

import pytest
import torch

from topoep import Topology, solve
import topoep_research

TOPO = Topology(num_domains=2, ranks_per_domain=2)
OM = torch.ones(4, 8, dtype=torch.int64)


@pytest.mark.parametrize("kwargs, match", [
    (dict(omega=-OM), "negative"),
    (dict(omega=OM.int()), "int64"),
    (dict(omega=OM.float()), "int64"),
    (dict(omega=OM[0]), "2-D"),
    (dict(omega=[[1, 2]]), "torch.Tensor"),
    (dict(omega=torch.ones(4, 6, dtype=torch.int64)), "multiple of the number of ranks"),
    (dict(omega=torch.ones(3, 6, dtype=torch.int64)), "covers 4 ranks"),
    (dict(topology=Topology(num_domains=1, ranks_per_domain=8)), "covers 8 ranks"),
    (dict(num_slots=-1), "num_slots"),
    (dict(num_slots=1.5), "num_slots"),
    (dict(policy="eplb"), "unknown policy"),
    (dict(main_rank=torch.tensor([0, 0, 1, 1, 2, 2, 3, 4])), "main_rank out of range"),
    (dict(main_rank=torch.tensor([0, 0, 1, 1, 2, 2, 3, -1])), "main_rank out of range"),
    (dict(main_rank=torch.zeros(7, dtype=torch.int64)), "main_rank must be"),
    (dict(expert_bytes=0), "expert_bytes"),
    (dict(token_bytes=-5), "token_bytes"),
    (dict(topology="2x2"), "topoep.Topology"),
    (dict(policy="joint", t_ffn=-1.0), "t_ffn must be a finite positive"),
    (dict(policy="joint", t_ffn=0), "t_ffn must be a finite positive"),
    (dict(policy="joint", t_ffn=True), "t_ffn must be a finite positive"),
    (dict(policy="joint", t_ffn=float("inf")), "t_ffn must be a finite positive"),
    (dict(policy="joint", t_ffn=float("nan")), "t_ffn must be a finite positive"),
    (dict(policy="fastermoe", t_ffn="70ns"), "t_ffn must be a finite positive"),
])
def test_bad_input(kwargs, match):
    args = dict(omega=OM, topology=TOPO, num_slots=2, policy="topoep")
    args.update(kwargs)
    omega, topology = args.pop("omega"), args.pop("topology")
    with pytest.raises(ValueError, match=match):
        solve(omega, topology, **args)


def test_custom_main_rank_is_respected():
    main = torch.tensor([3, 3, 2, 2, 1, 1, 0, 0])
    plan = solve(OM, TOPO, num_slots=1, policy="topoep", main_rank=main).check()
    assert torch.equal(plan.main_rank, main)
    assert torch.equal(plan.instance_rank[:8], main)


def test_joint_rejects_inputs_whose_int64_costs_could_overflow():
    # 8 ranks x 16.8M assignments with t_ffn = 0.1 s: t_ffn L_max alone is ~2^70 fs
    om = torch.zeros(8, 8, dtype=torch.int64)
    om[:, 0] = 2 ** 21
    topo = Topology(num_domains=2, ranks_per_domain=4)
    with pytest.raises(ValueError, match=r"2\^62.*t_ffn=0.1 .*check its unit"):
        solve(om, topo, num_slots=1, policy="joint", t_ffn=0.1)
    from topoep_research.joint import check_fs_range

    check_fs_range(om, topo, 1, 9_437_184, 4096, 70e-9)  # the same input at a realistic t_ffn is fine
    with pytest.raises(ValueError, match=r"2\^62"):  # huge tokens: the token term alone
        check_fs_range(om, topo, 1, 9_437_184, 2 ** 30, 70e-9)


def test_offline_policies_are_solved_but_not_runtime_policies():
    from topoep import OFFLINE_POLICIES, POLICIES

    assert "joint" in OFFLINE_POLICIES and not set(OFFLINE_POLICIES) & set(POLICIES)
    assert solve(OM, TOPO, num_slots=1, policy="joint").check().policy == "joint"


@pytest.mark.parametrize("name, kwargs, match", [
    ("topoep", dict(offline=True, takes_t_ffn=False), "one of OFFLINE_POLICIES"),
    ("my_planner", dict(offline=True, takes_t_ffn=False), "one of OFFLINE_POLICIES"),
    ("joint", dict(offline=False, takes_t_ffn=True), "offline=True, takes_t_ffn=True"),
    ("joint", dict(offline=True, takes_t_ffn=False), "offline=True, takes_t_ffn=True"),
])
def test_register_policy_binds_only_the_offline_policies_as_the_tables_describe_them(name, kwargs, match):
    from topoep.planners import _REGISTERED, register_policy

    with pytest.raises(ValueError, match=match):
        register_policy(name, topoep_research.solve_joint, **kwargs)
    assert _REGISTERED == {"joint": topoep_research.solve_joint}


@pytest.mark.parametrize("backend", ["reference", "auto", "cuda"])
@pytest.mark.parametrize("bad", [-1, True, 2.0, "8"])
def test_planner_grid_blocks_names_the_value(bad, backend):
    """solve's grid_blocks (the CUDA planner's grid, eplb.planner_blocks) is checked on every backend before any
    planning or CUDA work (backend cuda would otherwise refuse this CPU omega), so a wrong value fails the same way
    on any machine."""
    with pytest.raises(ValueError, match=r"grid_blocks must be an integer >= 0 \(0: half the SMs\), got " + repr(bad)):
        solve(OM, TOPO, num_slots=1, backend=backend, grid_blocks=bad)


def test_planner_grid_blocks_leaves_the_reference_plan_alone():
    """The reference planners ignore grid_blocks: the plan is the one without it."""
    want = solve(OM, TOPO, num_slots=1, backend="reference")
    got = solve(OM, TOPO, num_slots=1, backend="reference", grid_blocks=7)
    assert torch.equal(got.slot_expert, want.slot_expert) and torch.equal(got.route, want.route)
