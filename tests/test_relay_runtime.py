"""Backend torch with relayed replica fetches (LayerConfig.relay_fanout, topoep.relay) on gloo processes, 8 ranks as
2 domains of 4 under a strong skew: the same outputs bit for bit as fetching every copy from its home, the same
gradients up to float summation order (and equal to the dense reference), bit-identical from run to run, and the
trees really relay (copies fetched from other copies, more than one level)."""

import pytest
import torch

from distributed import run_ranks
from test_runtime_multirank import dense_reference, make_inputs
from topoep import ExpertParallelMoE, LayerConfig, Topology
from topoep.relay import relay_sources


def _relay(rank, world, rpd):
    E_loc, T, k, H, Fd, N = 2, 32, 2, 8, 6, 3
    R, E = world, world * E_loc
    topo = Topology(num_domains=world // rpd, ranks_per_domain=rpd)
    x, idx, w, fc1, fc2, gy = make_inputs(R, E, T, k, H, Fd, 4.0, seed=11)
    # expert 0 in every token's choices (once): a hot expert with copies on many ranks of both domains
    idx[..., 0] = torch.where(idx[..., 1] == 0, idx[..., 0], torch.zeros_like(idx[..., 0]))
    ref = dense_reference(x, idx, w, fc1, fc2, gy)
    lo, hi = rank * E_loc, (rank + 1) * E_loc
    out = {}
    for name, fanout in (("direct", None), ("relay1", 1), ("relay2", 2), ("relay2_again", 2)):
        layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo,
                                  config=LayerConfig(policy="topoep_plus", num_slots=N, guard=False,
                                                     relay_fanout=fanout))
        with torch.no_grad():
            layer.fc1.copy_(fc1[lo:hi])
            layer.fc2.copy_(fc2[lo:hi])
        xr, wr = x[rank].clone().requires_grad_(), w[rank].clone().requires_grad_()
        y = layer(xr, idx[rank], wr)
        (y * gy[rank]).sum().backward()
        got = [y.detach(), xr.grad, wr.grad, layer.fc1.grad.clone(), layer.fc2.grad.clone()]
        want = [ref[0][rank], ref[1][rank], ref[2][rank], ref[3][lo:hi], ref[4][lo:hi]]
        for a, b in zip(got, want):
            torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)
        source, level = relay_sources(layer.last_plan, fanout or 1)
        home = layer.last_plan.main_rank[layer.last_plan.slot_expert.clamp(min=0)]
        relayed = int(((source >= 0) & (source != home)).sum())
        out[name] = (got, relayed, int(level.max()))
    return out


def test_relayed_fetch_and_tree_return_match_the_direct_path():
    for out in run_ranks(_relay, 8, 4):
        direct, relay1, relay2, again = (out[k][0] for k in ("direct", "relay1", "relay2", "relay2_again"))
        for got in (relay1, relay2):
            assert torch.equal(got[0], direct[0])  # forward: the same weights in the same slots
            for a, b in zip(got[1:], direct[1:]):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # gradients: another summation order
        assert all(torch.equal(a, b) for a, b in zip(relay2, again))  # a fixed order: bit-reproducible
        assert out["relay1"][1] >= 4 and out["relay1"][2] >= 3  # chains: copies sent on by other copies


def test_relay_fanout_is_checked():
    with pytest.raises(ValueError, match="LayerConfig.relay_fanout must be an integer >= 1, got 0"):
        LayerConfig(relay_fanout=0)
    with pytest.raises(ValueError, match="backend cuda does not relay replica fetches yet"):
        LayerConfig(backend="cuda", relay_fanout=2)
