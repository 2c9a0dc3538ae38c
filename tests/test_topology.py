"""Unit tests (CPU): topoep.Topology - domains, cost matrix, constructors."""

import pytest
import torch

from topoep import Topology
from topoep.topology import DEFAULT_INTER_COST, DEFAULT_INTRA_COST


def test_default_cost_matrix_is_two_level_and_symmetric():
    t = Topology(num_domains=2, ranks_per_domain=2)
    assert t.num_ranks == 4
    assert t.domain_of.tolist() == [0, 0, 1, 1]
    c = t.cost
    assert torch.equal(c, c.T)
    assert c.diagonal().eq(0).all()
    assert c[0, 1] == DEFAULT_INTRA_COST and c[2, 3] == DEFAULT_INTRA_COST
    assert c[0, 2] == DEFAULT_INTER_COST and c[1, 3] == DEFAULT_INTER_COST
    # paper fabric: NVLink 200 GB/s per direction, 2 x 200 Gb/s IB = 50 GB/s
    assert DEFAULT_INTER_COST / DEFAULT_INTRA_COST == pytest.approx(4.0)
    assert t.cost_fs[0, 1].item() == 5000 and t.cost_fs[0, 2].item() == 20000


def test_virtual_topology_is_just_config():
    t = Topology(num_domains=2, ranks_per_domain=2, intra_cost=1e-12, inter_cost=1e-9)
    assert list(t.domain_ranks(1)) == [2, 3]
    assert t.cost_fs[0, 3].item() == 1_000_000


def test_from_cost_matrix_infers_domains():
    base = Topology(num_domains=4, ranks_per_domain=8)
    t = Topology.from_cost_matrix(base.cost)
    assert (t.num_domains, t.ranks_per_domain) == (4, 8)
    assert t == base
    single = Topology.from_cost_matrix(torch.full((4, 4), 1e-11).fill_diagonal_(0))
    assert (single.num_domains, single.ranks_per_domain) == (1, 4)


@pytest.mark.parametrize("bad, msg", [
    (torch.ones(3, 4), "square"),
    (torch.tensor([[0.0, 1.0], [2.0, 0.0]]), "symmetric"),
    (torch.tensor([[1.0, 1.0], [1.0, 0.0]]), "diagonal"),
    (torch.tensor([[0.0, -1.0], [-1.0, 0.0]]), ">= 0"),
])
def test_from_cost_matrix_rejects_bad_matrices(bad, msg):
    with pytest.raises(ValueError, match=msg):
        Topology.from_cost_matrix(bad, ranks_per_domain=1 if bad.shape[0] == bad.shape[1] else None)


def test_bad_config_raises():
    with pytest.raises(ValueError, match="num_domains"):
        Topology(num_domains=0, ranks_per_domain=2)
    with pytest.raises(ValueError, match="inter_cost"):
        Topology(num_domains=1, ranks_per_domain=2, inter_cost=-1.0)
    with pytest.raises(ValueError, match="divide"):
        Topology.from_cost_matrix(torch.zeros(6, 6), ranks_per_domain=4)


def test_from_env_torchrun_and_slurm(monkeypatch):
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "32")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    t = Topology.from_env()
    assert (t.num_domains, t.ranks_per_domain) == (4, 8)
    assert Topology.from_env(ep_size=16).num_domains == 2
    assert Topology.from_env(ep_size=4, ranks_per_domain=2).num_domains == 2  # virtual domains on one host
    monkeypatch.setenv("TOPOEP_RANKS_PER_DOMAIN", "2")  # not a setting: the environment never changes the domains
    assert Topology.from_env(ep_size=4).num_domains == 1
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "TOPOEP_RANKS_PER_DOMAIN"):
        monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "8(x2)")
    t = Topology.from_env()
    assert (t.num_domains, t.ranks_per_domain) == (2, 8)
    with pytest.raises(ValueError, match="ranks_per_domain"):
        Topology.from_env(ep_size=12)
    with pytest.raises(ValueError, match="ranks_per_domain must be an integer >= 1 or None, got 0"):
        Topology.from_env(ranks_per_domain=0)
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "eight")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE / SLURM_NTASKS_PER_NODE must be a positive integer"):
        Topology.from_env()


def test_costs_are_seconds_per_byte():
    """A bandwidth passed for a cost (200e9 for 200 GB/s) is refused, not wrapped around in the integer costs."""
    with pytest.raises(ValueError, match=r"seconds per byte \(e.g. 1 / 200e9 for 200 GB/s\)"):
        Topology(num_domains=2, ranks_per_domain=2, intra_cost=200e9, inter_cost=50e9)
    with pytest.raises(ValueError, match="seconds per byte"):
        Topology.from_cost_matrix(torch.full((2, 2), 1e3).fill_diagonal_(0))


def test_from_cost_matrix_needs_contiguous_domains():
    c = torch.tensor([[0, 2, 1, 2], [2, 0, 2, 1], [1, 2, 0, 2], [2, 1, 2, 0]], dtype=torch.float64) * 1e-12
    with pytest.raises(ValueError, match=r"rank 0's cheapest links go to ranks \[2\]"):
        Topology.from_cost_matrix(c)
    with pytest.raises(ValueError, match="does not have domains of 2 contiguous ranks"):
        Topology.from_cost_matrix(c, ranks_per_domain=2)
    order = [0, 2, 1, 3]  # the same machine, its ranks numbered domain by domain
    assert Topology.from_cost_matrix(c[order][:, order]).ranks_per_domain == 2


def test_device_copies_are_made_once():
    t = Topology(num_domains=2, ranks_per_domain=2)
    assert t.on("cpu") is t
    m = t.on("meta")
    assert m is t.on(torch.device("meta"))  # cached per device
    assert m.cost_fs.device.type == "meta" and m.cost_fs.shape == (4, 4) and m.num_ranks == 4
