"""topoep.graph_layer's checks, and the statistics it relies on: device sums updated in place (a captured call keeps
adding to the same buffer) with the device's own count of the calls. The capture itself needs a GPU:
tests/test_cuda_backend_gpu.py::test_graphed_layer_replays_equal_the_eager_layer."""

import pytest
import torch

from topoep import ExpertParallelMoE, Topology, graph_layer


def _layer(policy="topoep"):
    torch.manual_seed(0)
    return ExpertParallelMoE(num_experts=8, hidden_size=16, ffn_hidden_size=8, topology=Topology(num_domains=1, ranks_per_domain=1), num_slots=1,
                             policy=policy, backend="torch", dtype=torch.float32)


def _call(layer, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 16, generator=g)
    idx = torch.randn(12, 8, generator=g).topk(2, dim=1).indices
    w = torch.rand(12, 2, generator=g)
    layer(x, idx, w).sum().backward()
    return layer.stats.clone()


def test_pop_stats_averages_every_call_and_keeps_its_buffer():
    layer = _layer()
    calls = [_call(layer, s) for s in range(3)]
    buf = layer._stats_sum.data_ptr()
    mean, n = layer.pop_stats()
    assert n == 3
    from topoep.runtime import LAYER_STAT_NAMES

    keep = [i for i, name in enumerate(LAYER_STAT_NAMES) if name != "planner_ms"]
    assert torch.allclose(mean[keep], torch.stack(calls).mean(0)[keep], rtol=1e-12, atol=1e-12)
    assert layer._stats_sum.data_ptr() == buf and not layer._stats_sum.any()  # zeroed in place
    assert layer.pop_stats() == (None, 0)
    later = _call(layer, 7)
    mean, n = layer.pop_stats()
    assert n == 1 and torch.allclose(mean[keep], later[keep])


def test_count_replay_counts_a_call_without_host_planning_time():
    layer = _layer()
    _call(layer, 0)
    layer.count_replay()  # as a replay's wrapper does; its statistics were added on the device by the replay
    assert layer._stats_calls == 2


def test_graph_layer_rejects_what_it_cannot_capture():
    x, idx, w = torch.zeros(4, 16), torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="backend 'cuda'"):
        graph_layer(_layer(), x, idx, w)
    with pytest.raises(ValueError, match="ExpertParallelMoE"):
        graph_layer(torch.nn.Linear(2, 2), x, idx, w)


def test_layer_graphs_config_is_checked():
    from topoep import LayerConfig

    assert LayerConfig(backend="cuda", layer_graphs=True).layer_graphs
    with pytest.raises(ValueError, match="LayerConfig.layer_graphs=true captures backend cuda"):
        LayerConfig(layer_graphs=True)
    with pytest.raises(ValueError, match="prefetch"):
        LayerConfig(backend="cuda", layer_graphs=True, prefetch=True)
    with pytest.raises(ValueError, match="layer_graphs must be true or false"):
        LayerConfig(backend="cuda", layer_graphs="yes")


def test_trainer_refuses_layer_graphs_with_pipeline_parallelism():
    from app.config import register_configs
    from app.loop import job_from_config
    from bench.eval_worker import compose

    register_configs()
    graphs = ["eplb=topoep", "eplb.backend=cuda", "eplb.layer_graphs=true"]
    with pytest.raises(ValueError, match="eplb.layer_graphs=true with parallel.pp=2"):
        job_from_config(compose([*graphs, "parallel.pp=2"]))
    job, resolved = job_from_config(compose(graphs))  # pp 1: accepted, and recorded in the run's config
    assert job.eplb.layer_graphs and resolved["eplb"]["layer_graphs"] is True
