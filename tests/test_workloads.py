"""Unit tests (CPU): routing workload generators, calibration and trace I/O."""

import pytest
import torch

from topoep import workloads as wl


def test_fig10_calibration_matches_the_paper_no_balancing_ratio():
    om = wl.fig10_workload()
    assert om.shape == (32, 640)
    assert om.sum().item() == 32 * 4096 * 8
    assert wl.static_imbalance(om) == pytest.approx(8.39, abs=0.01)


def test_layouts_share_bias_values_and_move_hot_experts():
    b = {lay: wl.expert_bias(640, -2.5, num_ranks=32, seed=13, layout=lay) for lay in wl.LAYOUTS}
    for lay in ("clustered", "scattered"):
        assert torch.equal(b[lay].sort().values, b["random"].sort().values)
    assert torch.equal(b["clustered"], b["random"].sort(descending=True).values)
    hottest = torch.topk(b["scattered"], 32).indices // 20  # ranks of the 32 hottest experts
    assert sorted(hottest.tolist()) == list(range(32))
    om_c = wl.fig10_workload(layout="clustered")
    om_s = wl.fig10_workload(layout="scattered")
    assert wl.static_imbalance(om_c) > wl.static_imbalance(wl.fig10_workload()) > wl.static_imbalance(om_s)


def test_skew_zero_is_uniform_in_expectation_and_skew_concentrates():
    om0 = wl.biased_routing(8, 64, 2048, 4, 0.0, seed=1)
    load = om0.sum(0).double()
    assert (load.max() / load.mean()).item() < 1.15
    om4 = wl.biased_routing(8, 64, 2048, 4, -4.0, seed=1)
    top8 = torch.topk(om4.sum(0), 8).values.sum() / om4.sum()
    assert top8 > 0.5
    # each token picks k distinct experts
    one = wl.biased_routing(1, 16, 1, 4, -2.0, seed=3)
    assert one.sum() == 4 and one.max() == 1


def test_concentrated_layout_puts_the_hot_experts_on_rank_0():
    # EP 2, Qwen3-like 128 experts top-8: megatron's random bias spreads hot experts over both ranks
    for seed in range(3):
        rand = wl.static_imbalance(wl.biased_routing(2, 128, 1024, 8, -4.0, seed=seed))
        conc = wl.static_imbalance(wl.biased_routing(2, 128, 1024, 8, -4.0, seed=seed, layout="concentrated"))
        assert conc > rand + 0.5 and conc > 1.9, (seed, rand, conc)
    a = wl.biased_routing(2, 128, 256, 8, -4.0, seed=3, layout="concentrated")
    assert torch.equal(a, wl.biased_routing(2, 128, 256, 8, -4.0, seed=3, layout="concentrated"))
    # skew 0: no bias, near uniform rank and expert loads
    uni = wl.biased_routing(2, 128, 4096, 8, 0.0, seed=0, layout="concentrated")
    assert wl.static_imbalance(uni) < 1.05
    assert torch.equal(uni, wl.biased_routing(2, 128, 4096, 8, 0.0, seed=0))
    # same bias values; rank 0 gets the E/R largest, the other ranks keep the drawn order
    rnd = wl.expert_bias(32, -4.0, num_ranks=4, seed=1)
    conc = wl.expert_bias(32, -4.0, num_ranks=4, seed=1, layout="concentrated")
    assert torch.equal(conc.sort().values, rnd.sort().values)
    top8 = torch.topk(rnd, 8).indices
    assert torch.equal(conc[:8], rnd[top8])
    keep = torch.ones(32, dtype=torch.bool)
    keep[top8] = False
    assert torch.equal(conc[8:], rnd[keep])


@pytest.mark.parametrize("R,E,T,k", [(2, 128, 4096, 8), (4, 8, 3, 1), (4, 12, 5, 3), (8, 64, 7, 8), (2, 4, 2, 4)])
def test_balanced_routing_gives_every_rank_exactly_the_mean_load(R, E, T, k):
    idx = wl.balanced_topk(R, E, T, k)
    assert idx.shape == (R, T, k)
    assert (idx.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts per token
    om = wl.balanced_routing(R, E, T, k)
    assert torch.equal(om, wl.routing_counts(idx, E))
    assert torch.equal(om.sum(0).view(R, E // R).sum(1), torch.full((R,), T * k))  # rank load = mean, exactly
    load = om.sum(0)
    assert load.max() - load.min() <= 1
    assert wl.static_imbalance(om) == 1.0
    with pytest.raises(ValueError, match="multiple"):
        wl.balanced_topk(3, 8, 4, 2)


def test_token_level_routing_counts_to_omega():
    for layout in wl.LAYOUTS:
        idx = wl.biased_topk(3, 24, 50, 4, -2.0, seed=2, layout=layout)
        assert idx.shape == (3, 50, 4)
        assert torch.equal(wl.routing_counts(idx, 24), wl.biased_routing(3, 24, 50, 4, -2.0, seed=2, layout=layout))
    z = wl.zipf_routing(4, 64, 512, 2, alpha=1.2, seed=0, layout="concentrated").sum(0)
    assert z.view(4, 16).sum(1).argmax() == 0


def test_deterministic_for_a_seed():
    a = wl.biased_routing(4, 32, 100, 2, -1.0, seed=5)
    b = wl.biased_routing(4, 32, 100, 2, -1.0, seed=5)
    c = wl.biased_routing(4, 32, 100, 2, -1.0, seed=6)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_zipf():
    om = wl.zipf_routing(4, 64, 4096, 2, alpha=1.2, seed=0, layout="clustered")
    load = om.sum(0)
    assert om.sum() == 4 * 4096 * 2
    assert load[0] > load[10] > load[60]
    u = wl.zipf_routing(4, 64, 4096, 2, alpha=0.0, seed=0).sum(0).double()
    assert (u.max() / u.mean()).item() < 1.15


def test_drift_rate_controls_hot_set_changes():
    tr = wl.drifting_trace(4, 64, 512, 4, -3.0, num_layers=2, num_steps=12, drift=0.2, seed=0)
    assert tr.shape == (12, 2, 4, 64)
    assert 0.05 < wl.topk_change_fraction(tr, k=4) < 0.45
    still = wl.drifting_trace(4, 64, 512, 4, -3.0, num_layers=1, num_steps=6, drift=0.0, seed=0)
    # no drift: the hot set only changes by sampling noise (none at this skew and size)
    assert wl.topk_change_fraction(still, k=4) < 0.1
    with pytest.raises(ValueError, match="drift"):
        wl.drifting_trace(4, 64, 8, 2, -1.0, drift=1.5)


def test_trace_round_trip(tmp_path):
    tr = wl.drifting_trace(2, 8, 16, 2, -1.0, num_layers=3, num_steps=2)
    wl.save_trace(tmp_path / "t.pt", tr, {"model": "tiny"})
    back, meta = wl.load_trace(tmp_path / "t.pt")
    assert torch.equal(back, tr) and meta == {"model": "tiny"}
    torch.save({"x": 1}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="not a TopoEP routing trace"):
        wl.load_trace(tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="int64"):
        wl.save_trace(tmp_path / "f.pt", tr.float())


def test_bad_arguments():
    with pytest.raises(ValueError, match="layout"):
        wl.expert_bias(8, -1.0, layout="diagonal")
    with pytest.raises(ValueError, match="top_k"):
        wl.biased_routing(2, 8, 4, 9, -1.0)
    with pytest.raises(ValueError, match="multiple"):
        wl.expert_bias(10, -1.0, num_ranks=4)


def test_scenarios_of_the_link_aware_work():
    """Every scenario: omega int64[R, E], each source's assignments T x k (source_ragged: its own T), the same for
    the same seed, and the property its name promises."""
    from topoep.workloads import SCENARIOS, scenario

    R, E, T, k, d = 8, 64, 64, 4, 4
    loads = {}
    for name in SCENARIOS:
        om = scenario(name, R, E, T, k, ranks_per_domain=d, seed=3)
        assert om.shape == (R, E) and om.dtype == torch.int64 and (om >= 0).all(), name
        assert torch.equal(om, scenario(name, R, E, T, k, ranks_per_domain=d, seed=3)), name
        sent = om.sum(1).tolist()
        if name == "source_ragged":
            assert sent == [T * (R - 1 + 3 * s) // (4 * (R - 1)) * k for s in range(R)]
        else:
            assert sent == [T * k] * R, name
        loads[name] = om.sum(0).double()
    per_domain = E // R * d
    assert (loads["zero_load"][::4] == 0).all() and (loads["zero_load"][1::4] > 0).any()
    hot = loads["hot_domain"]
    assert hot[:per_domain].topk(4).values.min() > 5 * hot.mean()  # 4 very hot experts, all in domain 0
    assert hot[per_domain:].max() < 2 * hot.mean()
    warm = loads["warm_domain"]
    assert warm[:per_domain].sum() > 3 * warm[per_domain:].sum() and warm[:per_domain].min() > warm[per_domain:].mean()
    rank_loads = loads["hot_rank"].view(R, -1).sum(1)
    assert rank_loads.argmax() == 0 and rank_loads[0] > 2 * rank_loads.mean()
    assert not torch.equal(loads["burst"], loads["random_bias"])
    with pytest.raises(ValueError, match="unknown scenario 'hot'"):
        scenario("hot", R, E, T, k, ranks_per_domain=d)
