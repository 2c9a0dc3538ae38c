"""The net-benefit guard (paper eq. 2). CPU unit tests on a hand-worked plan (prediction, selection,
no host synchronisation: the guard runs on meta tensors, which have no values to read), and multi-rank
tests (gloo, 4 ranks as 2 domains x 2): balanced routing makes the guard fire and the layer equal the
static one bit for bit; skewed routing does not, and the layer equals the unguarded one bit for bit.
"""

import pytest
import torch

from distributed import run_ranks
from topoep import ExpertParallelMoE, Plan, Topology, solve
from topoep.runtime import LAYER_STAT_NAMES
from topoep.runtime.guard import NetBenefitGuard, SlotSkipHint
from topoep.workloads import balanced_topk, biased_topk

IDX = {n: i for i, n in enumerate(LAYER_STAT_NAMES)}


def hand_plan():
    """R=2 (one domain), E=4, 1 slot: rank 0's experts 0 and 1 take all 16 assignments; topoep puts a
    replica of expert 0 on rank 1 and balances 8 / 8."""
    topo = Topology(num_domains=1, ranks_per_domain=2)  # 200 GB/s inside the domain
    omega = torch.tensor([[6, 2, 0, 0], [5, 3, 0, 0]])
    plan = solve(omega, topo, num_slots=1, policy="topoep", expert_bytes=1000, token_bytes=10)
    assert plan.slot_expert.tolist() == [[-1], [0]] and plan.rank_load.tolist() == [8, 8]
    return plan


def test_prediction_and_selection_on_a_hand_worked_plan():
    plan = hand_plan()
    g = NetBenefitGuard()  # plan 100 us, 20 us per exposed transfer, the topology's 200 GB/s
    # one replica of 1000 B over 200 GB/s = 5 ns, 3 exposed transfers (backend torch)
    cost = 1e-4 + 3 * (1000 / 200e9 + 2e-5)
    assert g.transfer_time(plan, 3).item() == pytest.approx(3 * (1000 / 200e9 + 2e-5), rel=1e-12)
    # t_ffn 1 us: saving 8 assignments x 1 us = 8 us < 160 us -> static plan
    executed, fired, saved, c = g.select(plan, 1e-6, 3)
    assert fired.item() and saved.item() == pytest.approx(8e-6) and c.item() == pytest.approx(cost)
    static = solve(plan.omega, plan.topology, num_slots=1, policy="static", expert_bytes=1000, token_bytes=10)
    assert torch.equal(executed.slot_expert, static.slot_expert) and torch.equal(executed.route, static.route)
    executed.check()
    # t_ffn 100 us: saving 800 us > 160 us -> the balanced plan, unchanged
    executed, fired, saved, _ = g.select(plan, 1e-4, 3)
    assert not fired.item() and saved.item() == pytest.approx(8e-4)
    assert torch.equal(executed.slot_expert, plan.slot_expert) and torch.equal(executed.route, plan.route)
    # a slow link moves the decision: 1000 B at 10 B/s = 100 s per transfer
    assert NetBenefitGuard(bytes_per_s=10.0).select(plan, 1e-4, 1)[1].item()
    # no planning cost, one exposed transfer: 8 us saved < 5 ns + 20 us latency; without the latency > 5 ns
    assert NetBenefitGuard(plan_s=0.0).select(plan, 1e-6, 1)[1].item()
    assert not NetBenefitGuard(plan_s=0.0, transfer_latency_s=0.0).select(plan, 1e-6, 1)[1].item()


def test_allow_false_forces_the_static_plan():
    """The host left the replica machinery out: the static plan runs even where the guard wants replicas."""
    plan = hand_plan()
    g = NetBenefitGuard()
    static = solve(plan.omega, plan.topology, num_slots=1, policy="static", expert_bytes=1000, token_bytes=10)
    executed, fired, saved, cost = g.select(plan, 1e-4, 3, torch.tensor(False))
    assert fired.item() and (saved > cost).item()  # forced, although the guard itself wants the plan
    assert torch.equal(executed.slot_expert, static.slot_expert) and torch.equal(executed.route, static.route)
    executed, fired, _, _ = g.select(plan, 1e-4, 3, torch.tensor(True))
    assert not fired.item() and torch.equal(executed.route, plan.route)


def test_slot_skip_hint_follows_the_decision_lag_calls_back():
    for lag in (1, 2, 3):
        hint = SlotSkipHint(lag)
        wanted = [True, False, False, True, False, True, True, False, False, False]
        got = []
        for w in wanted:
            got.append(hint.allow(torch.device("cpu")))
            hint.record(torch.tensor(w))
        assert got == [True] * lag + wanted[:-lag], (lag, got)
        assert hint.skipped == got.count(False) and hint.calls == len(wanted) and hint.waits == 0
    with pytest.raises(ValueError, match="skip_lag must be an integer >= 1"):
        NetBenefitGuard(skip_lag=0)
    topo = Topology(num_domains=1, ranks_per_domain=1)
    # backend torch reads its sizes on the host anyway: no hint there
    assert ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo).slot_hint is None


def test_guard_reads_no_tensor_values():
    """No host synchronisation: every input on the meta device, where reading a value raises."""
    p = hand_plan()
    meta = Plan(omega=p.omega.to("meta"), topology=p.topology, num_slots=1, main_rank=p.main_rank.to("meta"),
                slot_expert=p.slot_expert.to("meta"), route=p.route.to("meta"), policy="topoep",
                expert_bytes=1000, token_bytes=10)
    executed, fired, saved, cost = NetBenefitGuard().select(meta, 1e-6, 3)
    assert executed.route.is_meta and executed.route.shape == p.route.shape and fired.shape == ()
    assert NetBenefitGuard(bytes_per_s=1e9).transfer_time(meta, 3).is_meta


def test_bad_guard_arguments():
    for kw, match in [(dict(plan_s=-1.0), "plan_s"), (dict(transfer_latency_s=float("inf")), "transfer_latency_s"),
                      (dict(bytes_per_s=0), "bytes_per_s"), (dict(exposed_transfers=-1), "exposed_transfers")]:
        with pytest.raises(ValueError, match=match):
            NetBenefitGuard(**kw)
    topo = Topology(num_domains=1, ranks_per_domain=1)
    with pytest.raises(ValueError, match="LayerConfig.guard must be true or false, got 'on'"):
        ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo, guard="on")
    with pytest.raises(ValueError, match="LayerConfig.t_ffn must be a positive"):
        ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo, t_ffn=0.0)


def _guarded_layers(rank, world):
    topo = Topology(num_domains=2, ranks_per_domain=2)
    E, T, k, H, Fd = 16, 64, 2, 8, 4
    g = torch.Generator().manual_seed(3)
    fc1 = torch.randn(E, 2 * Fd, H, generator=g) * 0.2
    fc2 = torch.randn(E, H, Fd, generator=g) * 0.2
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(10 + rank))
    w = torch.softmax(torch.randn(T, k, generator=torch.Generator().manual_seed(20 + rank)), -1)
    workloads = {"balanced": balanced_topk(world, E, T, k)[rank],
                 "skewed": biased_topk(world, E, T, k, -4.0, seed=1, layout="concentrated")[rank]}
    lo, hi = rank * 4, rank * 4 + 4

    def layer(policy, guard):
        # t_ffn 1 us per assignment: the saving of a skewed plan (hundreds of assignments) beats the
        # default 100 us planning estimate; a balanced one saves nothing
        m = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo, num_slots=2,
                              policy=policy, t_ffn=1e-6, guard=guard)
        with torch.no_grad():
            m.fc1.copy_(fc1[lo:hi])
            m.fc2.copy_(fc2[lo:hi])
        return m

    def run(m, idx):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = m(xr, idx, wr)
        y.backward(torch.ones_like(y))
        return [y.detach(), xr.grad, wr.grad, m.fc1.grad.clone(), m.fc2.grad.clone()]

    guarded, out = layer("topoep", True), {}
    for name, idx in workloads.items():
        guarded.zero_grad(set_to_none=True)
        res = run(guarded, idx)
        s = guarded.stats_dict()
        ref = run(layer("static" if name == "balanced" else "topoep", False), idx)
        out[name] = dict(fired=s["guard_fired"], replicas=s["num_replicas"], saved=s["guard_saved_ms"],
                         cost=s["guard_cost_ms"], wanted=s["guard_wanted"],
                         skip=(s["slot_skipped"], s["slot_skip_missed"]),
                         bit_equal=all(torch.equal(a, b) for a, b in zip(res, ref)))
    unguarded = layer("topoep", False)
    run(unguarded, workloads["skewed"])
    out["unguarded_replicas"] = unguarded.stats_dict()["num_replicas"]
    run(guarded, workloads["balanced"])  # 3 calls since the last pop: balanced, skewed, balanced
    stats, calls = guarded.pop_stats()
    out["pop"] = (stats[IDX["guard_fired"]].item() * calls, calls)
    return out


def test_balanced_routing_fires_the_guard_and_skewed_routing_does_not():
    results = run_ranks(_guarded_layers, 4)
    for r in results:
        bal, skew = r["balanced"], r["skewed"]
        assert bal["fired"] == 1.0 and bal["replicas"] == 0 and bal["saved"] == 0.0 and bal["cost"] > 0
        assert bal["bit_equal"], "guard fired: the layer must compute exactly what the static layer computes"
        assert skew["fired"] == 0.0 and skew["replicas"] > 0 and skew["saved"] > skew["cost"]
        assert skew["bit_equal"], "guard did not fire: the layer must compute exactly what it computes unguarded"
        assert r["unguarded_replicas"] == skew["replicas"]
        assert (bal["wanted"], skew["wanted"]) == (0.0, 1.0)  # the guard's own decision
        assert bal["skip"] == skew["skip"] == (0.0, 0.0)  # backend torch never leaves the replicas out
        assert r["pop"] == (pytest.approx(2.0), 3)  # fired in 2 of 3 calls
    assert len({(r["skewed"]["replicas"], r["balanced"]["fired"]) for r in results}) == 1  # one decision
