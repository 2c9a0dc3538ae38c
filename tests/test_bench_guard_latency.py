"""bench/guard_latency.py on the CPU (the measurement needs a GPU): its table shows each EP's four timings (reference
and kernel, without and with relays) and the kernel's share, the reference variants do the guard's work, and without
CUDA it says where to run it."""

import pytest
import torch

from bench.guard_latency import VARIANTS, _chain, _decide, _gate_chain, _hint_chain, chain_table, main, table
from bench.planner_latency import workload
from topoep import solve
from topoep.runtime.guard import SpreadGate
from topoep.runtime.moe import plus_policies


def test_table_shows_the_four_timings_and_the_kernels_share():
    text = table([dict(ep=8, domains=1, experts=640, slots=2, guard_us=30.0, guard_relay_us=42.5, guard_cuda_us=3.0,
                       guard_relay_cuda_us=8.5, floor_us=2.0)])
    row = next(ln for ln in text.splitlines() if ln.startswith("| 8 "))
    assert [c.strip() for c in row.split("|")[1:-1]] == ["8", "1", "640", "2", "30.0", "3.0", "42.5", "8.5", "0.200", "2.0"]


def test_the_variants_return_the_executed_plan_and_its_trees():
    topo, omega = workload(16, 64)
    kw = dict(num_slots=2, expert_bytes=10 ** 7, token_bytes=4096)
    plan, local = (solve(omega, topo, policy=p, **kw) for p in ("topoep_plus", "topoep_plus_local"))
    assert VARIANTS == ("guard", "guard_relay", "guard_cuda", "guard_relay_cuda")
    plain, relayed = (_decide(v, plan, local) for v in VARIANTS[:2])  # the kernel variants need a GPU
    assert len(plain) == 1 and len(relayed) == 3 and plain[0].shape == relayed[0].shape == plan.route.shape
    assert relayed[1].shape == plan.slot_expert.shape == relayed[2].shape


def test_chain_table_and_the_chain_on_uniform_routing_runs_static():
    text = chain_table([dict(ep=32, chain_skip_us=4.0, chain_skip_relay_us=5.5, chain_plan_us=60.0,
                             chain_plan_relay_us=70.25, chain_gate_off_us=66.0, workload_planned=True,
                             chain_hint_us=3.0, chain_hint_relay_us=3.5, static_plan_us=2.25)])
    row = next(ln for ln in text.splitlines() if ln.startswith("| 32 "))
    assert [c.strip() for c in row.split("|")[1:-1]] == ["32", "4.0", "5.5", "60.0", "70.2", "66.0", "yes", "3.0",
                                                          "3.5", "2.2"]
    topo, omega = workload(16, 64)
    uniform = torch.full_like(omega, int(omega.sum()) // omega.numel())
    static = solve(uniform, topo, num_slots=2, policy="static").route
    for relay in (False, True):
        out = _chain(relay, uniform, topo, 2)  # the bound leaves planning out: the static plan, no trees
        assert torch.equal(out[0], static) and len(out) == (3 if relay else 1)
        if relay:
            assert (out[1] == -1).all() and (out[2] == 0).all()
    for relay in (False, True):  # a call the hint left out: the bound's verdict and the static plan, no trees
        out = _hint_chain(relay, uniform, topo, 2)
        assert not bool(out[0]) and torch.equal(out[1], static) and len(out) == (4 if relay else 2)
        if relay:
            assert (out[2] == -1).all() and (out[3] == 0).all()
    assert bool(_hint_chain(False, omega, topo, 2)[0])  # the workload: a plan may pay
    skewed = _chain(False, omega, topo, 2)[0]  # the workload is planned
    assert not torch.equal(skewed, solve(omega, topo, num_slots=2, policy="static").route)
    # a plus_spread layer's call whose spread gate is off: the same plan as the layer without the spread candidate
    gate = SpreadGate(probe=1 << 40, spread_s=1.0)
    gate.enable(torch.ones((), dtype=torch.bool))
    gate.state.copy_(torch.tensor([0.0, 0.0, float("nan"), float("nan")]))
    assert torch.equal(_gate_chain(gate, omega, topo, 2)[0], skewed)
    assert gate.state[0] == 0 and gate.state[1] == 1 and not bool(gate.flag)


def test_on_one_domain_the_chains_plan_topoep_plus_alone():
    """--rpd at least the EP size: one NVLink domain, where the layer plans no local candidate (moe.py
    `plus_policies`); the chains then make the plan a layer with both would keep (the local plan is the same)."""
    topo, omega = workload(16, 64, rpd=16)
    assert topo.num_domains == 1 and plus_policies(topo) == ("topoep_plus",)
    assert plus_policies(workload(16, 64)[0], spread=True) == ("topoep_plus", "topoep_plus_local", "topoep_plus_spread")
    assert plus_policies(topo, peers=True, spread=True, tree=True) == ("topoep_plus", "flexmoe", "deepseek",
                                                                     "topoep_plus_spread", "topoep_plus_spread_tree")
    kw = dict(num_slots=2, expert_bytes=10 ** 7, token_bytes=4096)
    plan, local = (solve(omega, topo, policy=p, **kw) for p in ("topoep_plus", "topoep_plus_local"))
    for relay in (False, True):
        alone, both = (_decide(VARIANTS[relay], plan, other) for other in (None, local))
        assert all(torch.equal(a, b) for a, b in zip(alone, both))
    chained = _chain(True, omega, topo, 2)
    assert torch.equal(chained[0], _decide("guard_relay", plan, None)[0]) and len(chained) == 3
    gate = SpreadGate(probe=1 << 40, spread_s=1.0)
    gate.enable(torch.ones((), dtype=torch.bool))
    gate.state.copy_(torch.tensor([0.0, 0.0, float("nan"), float("nan")]))
    assert torch.equal(_gate_chain(gate, omega, topo, 2)[0], _chain(False, omega, topo, 2)[0])


def test_rpd_must_fit_the_ep_sizes():
    with pytest.raises(SystemExit, match="--rpd must be >= 1 and divide"):
        main(["--eps", "16", "32", "--rpd", "24"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_a_gpu_it_says_where_to_run():
    with pytest.raises(SystemExit, match="run it on a machine with a GPU"):
        main(["--eps", "8"])


def test_baseline_table_shows_each_ratio_where_measured():
    from bench.guard_latency import baseline_table

    text = baseline_table([dict(ep=8, domains=1, chain_plan_relay_us=60.0, chain_plan_relay_separate_us=64.0,
                                chain_plan_us=50.0, chain_plan_pair_us=55.0, chain_plan_relay_pair_us=66.0),
                           dict(ep=32, domains=4, chain_plan_relay_us=62.0, chain_plan_relay_separate_us=65.0,
                                chain_plan_us=58.0)])
    rows = [[c.strip() for c in ln.split("|")[1:-1]] for ln in text.splitlines() if ln.startswith("| 8 ")
            or ln.startswith("| 32 ")]
    assert rows[0] == ["8", "1", "60.0", "64.0", "0.938", "50.0", "55.0", "0.909", "60.0", "66.0", "0.909"]
    assert rows[1] == ["32", "4", "62.0", "65.0", "0.954", "58.0", "-", "-", "62.0", "-", "-"]
