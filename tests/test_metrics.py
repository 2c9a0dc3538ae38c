"""Unit tests (CPU): topoep.metrics against hand-computed values."""

import pytest
import torch

from topoep import Topology, metrics, plan_stats, solve
from topoep.metrics import STAT_NAMES


def test_hand_computed_metrics():
    topo = Topology(num_domains=2, ranks_per_domain=1, intra_cost=1e-12, inter_cost=1e-10)
    # two ranks = two domains, one expert each; rank 0 sends 6 to expert 1 (on rank 1), 2 to expert 0
    om = torch.tensor([[2, 6], [0, 4]])
    W, S = 100, 10  # 2 * D[0, 1] * S = 120 > W: the replica of expert 1 on rank 0 pays
    plan = solve(om, topo, num_slots=1, policy="topoep", expert_bytes=W, token_bytes=S).check()
    assert plan.slot_expert.tolist() == [[1], [-1]]
    m = metrics(plan, t_ffn=1e-9)
    assert plan.rank_load.tolist() == [8, 4]
    assert m["imbalance"] == pytest.approx(8 / 6)
    assert m["static_imbalance"] == pytest.approx(10 / 6)
    assert m["internode_fraction"] == 0.0
    assert m["replica_fraction"] == pytest.approx(6 / 12)
    assert m["num_replicas"] == 1
    assert m["token_bytes_inter"] == 0 and m["token_bytes_intra"] == 0
    assert m["replica_bytes_inter"] == 3 * W and m["replica_bytes_intra"] == 0
    assert m["t_comp"] == pytest.approx(8e-9)
    assert m["t_token"] == 0
    assert m["t_replica"] == pytest.approx(W * 1e-10)
    assert m["t_total"] == pytest.approx(8e-9 + W * 1e-10)

    static = solve(om, topo, num_slots=1, policy="static", expert_bytes=W, token_bytes=S)
    ms = metrics(static, t_ffn=1e-9)
    assert ms["internode_fraction"] == pytest.approx(6 / 12)
    assert ms["token_bytes_inter"] == 4 * S * 6
    assert ms["t_token"] == pytest.approx(2 * S * 6 * 1e-10)
    assert ms["t_comp"] == pytest.approx(10e-9)


def test_plan_stats_is_a_device_tensor_in_name_order():
    topo = Topology(num_domains=1, ranks_per_domain=2)
    plan = solve(torch.tensor([[3, 1], [2, 2]]), topo, num_slots=1)
    t = plan_stats(plan)
    assert t.dtype == torch.float64 and t.shape == (len(STAT_NAMES),)
    m = metrics(plan)
    assert dict(zip(STAT_NAMES, t.tolist())) == {k: m[k] for k in STAT_NAMES}
