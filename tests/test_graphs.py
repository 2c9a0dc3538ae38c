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


def _two_layers(rank, world):
    """Two identical backend-cuda layers on the CPU harness whose per-expert weights are read through expert_weights
    (as under megatron): (layers, their weight lists, inputs(seed) -> (x, topk_idx, topk_weights))."""
    from topoep import ExpertParallelMoE, Topology
    from topoep.runtime import NetBenefitGuard

    E_LOC, H, FD, T, K = 4, 16, 8, 12, 2
    E = world * E_LOC
    layers, weights = [], []
    for _ in range(2):
        g = torch.Generator().manual_seed(rank)
        w1 = [torch.nn.Parameter((torch.randn(2 * FD, H, generator=g) * 0.1).to(torch.bfloat16)) for _ in range(E_LOC)]
        w2 = [torch.nn.Parameter((torch.randn(H, FD, generator=g) * 0.1).to(torch.bfloat16)) for _ in range(E_LOC)]
        weights.append(w1 + w2)
        layers.append(ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=FD,
                                        topology=Topology(num_domains=1, ranks_per_domain=world), num_slots=1,
                                        policy="topoep", backend="cuda", dtype=torch.bfloat16, device="cpu",
                                        guard=NetBenefitGuard(skip_lag=None), _cpu_harness=True,
                                        expert_weights=lambda w1=w1, w2=w2: (w1, w2)))

    def inputs(seed):
        g = torch.Generator().manual_seed(100 * seed + rank)
        x = torch.randn(T, H, generator=g).to(torch.bfloat16).requires_grad_()
        idx = torch.randn(T, E, generator=g).topk(K, dim=1).indices
        w = torch.rand(T, K, generator=g).to(torch.bfloat16).requires_grad_()
        return x, idx, w
    return layers, weights, inputs


def _wrapper_on_the_harness(rank, world):
    """graph_layer's wrapper on backend cuda's CPU harness, the capture replaced by an eager stand-in that warms up
    as torch's does: a layer reading per-expert weights through expert_weights (as under megatron) gives the eager
    layer's outputs and weight gradients, counts its calls, and refuses a second call before the backward, other
    shapes and other weight tensors; in eval mode it runs eagerly."""
    import topoep.runtime.graphs as graphs

    captured = {}

    def stand_in(fn, sample, num_warmup_iters):
        captured["weights"] = sample[3:]
        for _ in range(num_warmup_iters):
            fn(*sample).sum().backward()

        def replay(*args):  # a replay adds its statistics on the device and runs none of the layer's host code
            layer = captured["layer"]
            calls, ms = layer._stats_calls, layer._planner_ms_sum
            y = fn(*args)
            layer._stats_calls, layer._planner_ms_sum = calls, ms
            return y
        return replay

    graphs._capture = stand_in
    layers, weights, inputs = _two_layers(rank, world)
    eager, graphed = layers
    captured["layer"] = graphed

    graph_layer(graphed, *inputs(0))
    # the capture's weights: leaf aliases of the expert weights (their storage, new autograd leaves)
    out = {"weights_are_aliases": all(a is not b and a.is_leaf and a.data_ptr() == b.data_ptr() and a.requires_grad
                                      for a, b in zip(captured["weights"], weights[1]))}
    eager.pop_stats(), graphed.pop_stats()
    same = []
    for seed in (1, 2):
        res = []
        for layer, ws in zip(layers, weights):
            for p in ws:
                p.grad = None
            y = layer(*inputs(seed))
            y.float().sum().backward()
            res.append([y.detach(), *[p.grad for p in ws]])
        same.append(all(torch.equal(a, b) for a, b in zip(*res)))
    out["same"] = same
    out["calls"] = (eager.pop_stats()[1], graphed.pop_stats()[1])
    errors = []
    y = graphed(*inputs(3))
    for bad in (lambda: graphed(*inputs(4)), lambda: graphed(inputs(4)[0][:6], *inputs(4)[1:])):
        try:
            bad()
        except (RuntimeError, ValueError) as e:
            errors.append(type(e).__name__)
    y.float().sum().backward()
    try:
        graphed(inputs(4)[0][:6], inputs(4)[1][:6], inputs(4)[2][:6])
    except ValueError as e:
        errors.append("shapes" if "captured shapes" in str(e) else str(e))
    w1 = graphed._expert_weights()[0]  # the list the layer reads: its first expert's fc1 becomes another tensor
    w1[0] = torch.nn.Parameter(w1[0].detach().clone())
    try:
        graphed(*inputs(5))
    except ValueError as e:
        errors.append("weights" if "expert weights are not the tensors" in str(e) else str(e))
    out["errors"] = errors
    return out


def test_graph_layer_wrapper_on_the_cpu_harness():
    from distributed import run_ranks

    for out in run_ranks(_wrapper_on_the_harness, 2):
        assert out["weights_are_aliases"]
        assert out["same"] == [True, True]
        assert out["calls"] == (2, 2)
        # before the backward: a second call, and one of other shapes (its shapes are checked first); after it, a
        # call of other shapes, and other weight tensors
        assert out["errors"] == ["RuntimeError", "ValueError", "shapes", "weights"], out["errors"]


def _static_buffers_capture(fn, sample, num_warmup_iters):
    """A capture stand-in whose backward, as torch's graphed callables do, hands out the same gradient buffers at
    every call (overwritten by the next call's backward)."""
    bufs = {}

    class Replay(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            with torch.enable_grad():
                ins = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
                y = fn(*ins)
            ctx.ins, ctx.y = ins, y
            return y.detach()

        @staticmethod
        def backward(ctx, gy):
            need = [t for t in ctx.ins if t.requires_grad]
            grads = iter(torch.autograd.grad(ctx.y, need, gy, allow_unused=True))
            out = []
            for i, t in enumerate(ctx.ins):
                g = next(grads) if t.requires_grad else None
                if g is not None:
                    bufs.setdefault(i, torch.zeros_like(g)).copy_(g)
                    g = bufs[i].detach()
                out.append(g)
            return tuple(out)

    return Replay.apply


def _accumulation_on_the_harness(rank, world):
    """Two replays' backwards accumulate into the weights' .grad (no zeroing between them, the first starting from
    None) as two eager calls do, and the first call's input gradient survives the second replay."""
    import topoep.runtime.graphs as graphs

    graphs._capture = _static_buffers_capture
    layers, weights, inputs = _two_layers(rank, world)

    graph_layer(layers[1], *inputs(0))
    for ws in weights:
        for p in ws:
            p.grad = None
    res = []
    for layer, ws in zip(layers, weights):
        xs = []
        for seed in (1, 2):  # two micro-batches, their gradients accumulated
            x, idx, w = inputs(seed)
            layer(x, idx, w).float().sum().backward()
            xs.append(x.grad)
        res.append([*xs, *[p.grad for p in ws]])
    return all(torch.equal(a, b) for a, b in zip(*res))


def test_replayed_gradients_accumulate_as_eager_ones():
    from distributed import run_ranks

    assert run_ranks(_accumulation_on_the_harness, 2) == [True, True]


def _harness_without_a_gpu(rank, world):
    from topoep import ExpertParallelMoE, Topology

    layer = ExpertParallelMoE(num_experts=8, hidden_size=16, ffn_hidden_size=8, topology=Topology(num_domains=1,
                              ranks_per_domain=world), num_slots=1, policy="topoep", backend="cuda",
                              dtype=torch.bfloat16, device="cpu", _cpu_harness=True, layer_graphs=True)
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    try:
        layer(x, torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2, dtype=torch.bfloat16))
    except ValueError as e:
        return str(e)
    return "no error"


def test_layer_graphs_on_the_cpu_names_the_gpu():
    from distributed import run_ranks

    for msg in run_ranks(_harness_without_a_gpu, 2):
        assert "captures CUDA graphs: x is on cpu" in msg, msg


def _first_calls_without_grad(rank, world):
    """layer_graphs: calls under no_grad or in eval mode before the first training call run eagerly and capture
    nothing; the first training call with grad captures (on its inputs) and trains; graph_layer itself refuses to
    capture under no_grad."""
    import topoep.runtime.graphs as graphs

    captured = []

    def stand_in(fn, sample, num_warmup_iters):
        captured.append(tuple(t.requires_grad for t in sample[:3]))
        for _ in range(num_warmup_iters):
            fn(*sample).float().sum().backward()
        return fn

    graphs._capture = stand_in
    layers, weights, inputs = _two_layers(rank, world)
    layer = layers[1]
    layer.config = layer.config.replace(layer_graphs=True)
    with torch.no_grad():
        layer(*inputs(1))
    layer.eval()
    layer(*inputs(2))
    layer.train()
    before = (layer._graphed is None, len(captured))
    x, idx, w = inputs(3)
    layer(x, idx, w).float().sum().backward()
    refused = ""
    with torch.no_grad():
        try:
            graphs.graph_layer(layers[0], *inputs(4))
        except ValueError as e:
            refused = str(e)
    return before, captured, x.grad is not None and all(p.grad is not None for p in weights[1]), refused


def test_layer_graphs_capture_the_first_training_call_with_grad():
    from distributed import run_ranks

    for before, captured, trained, refused in run_ranks(_first_calls_without_grad, 2):
        assert before == (True, 0)  # the no_grad call and the eval call captured nothing
        assert captured == [(True, False, True)]  # the training call's inputs (x and the weights need grad)
        assert trained
        assert "call it with grad enabled" in refused
