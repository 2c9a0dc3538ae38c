"""A balanced MoE layer's forward and backward as CUDA graphs the caller replays (backend cuda).

Backend cuda never synchronises the host, and every size it launches is fixed by the shapes, so a whole layer call
can be captured. `graph_layer(layer, x, topk_idx, topk_weights)` captures the forward and the backward once
(`torch.cuda.make_graphed_callables`) and makes every later `layer(x, topk_idx, topk_weights)` of the same shapes a
replay of the two graphs. The expert weights are inputs of the graphs, so their gradients come out of the backward
graph whether the layer owns them or megatron's expert module does. A replay runs no host code of the layer: the
host's time per call drops to the two launches and the copies of the inputs into the captured buffers.
`LayerConfig.layer_graphs=True` does the same on the layer's first call, with that call's inputs as the samples.

What a replay does is what the captured call did, with the new inputs: the counts, the plan and the guard are
computed on the device from this call's routing (the capture takes the planning path: the slot hint, a host-side
memory of earlier calls, never leaves a captured call's replica machinery out); the replica fetch always reloads.
The layer's statistics keep working: each replay adds its statistics to the layer's device sums and is counted on
the host (`ExpertParallelMoE.count_replay`), so `pop_stats` averages eager and replayed calls alike; a replay spends
no host time planning (planner_ms 0). A caller that captures the layer inside a larger graph of its own calls
`layer.count_replay()` once per replay instead.

Limits:
- every replayed call has the captured shapes (T tokens, k choices) and dtypes, and, with grad enabled, the same
  tensors requiring grad; a call in the other training mode than the capture's runs eagerly;
- the expert weights stay the tensors of the capture; no replica prefetch (`LayerConfig.prefetch`) in flight;
- a replay keeps what its backward reads in the graphs' own buffers, so each call's backward must run before the
  layer's next call with grad: a second call before it raises (a pipeline schedule with several micro-batches in
  flight, or an output whose gradient is never computed);
- the output of a replay is the forward graph's output buffer, overwritten by the next replay: use it (e.g. add the
  residual) before calling the layer again.

Gradients: a replay's backward hands out the backward graph's own buffers, which the next replay overwrites. Where a
weight had no gradient yet, autograd would keep that buffer as the weight's `.grad`, and the next replay would
overwrite it (gradient accumulation over micro-batches would give twice the last one). So a buffer that became a
weight's `.grad` is copied out before the next replay (`_GradBuffers`: nothing to copy where megatron moves `.grad`
into its main_grad and clears it), and the inputs' gradients are copies.
"""

from __future__ import annotations

import torch

# the capture (torch's); backend cuda's CPU harness tests replace it with an eager stand-in to check the wrapper
_capture = torch.cuda.make_graphed_callables


class _GradBuffers(torch.autograd.Function):
    """Identity on (inputs..., weights...) in front of a replay. Backward: the inputs' gradients as copies; the
    weights' as they come (the backward graph's buffers), their storage remembered in `seen` so that the next replay
    can copy out a buffer that became a weight's .grad (`keep_grads`)."""

    @staticmethod
    def forward(ctx, n_inputs: int, seen: list, *tensors):
        ctx.n_inputs, ctx.seen = n_inputs, seen
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        out = []
        for i, g in enumerate(grads):
            if g is not None and i < ctx.n_inputs:
                g = g.clone()
            elif g is not None:
                ctx.seen[i - ctx.n_inputs] = g.data_ptr()
            out.append(g)
        return (None, None, *out)


def keep_grads(weights: list, seen: list) -> None:
    """Before a replay: a weight whose .grad is the backward graph's buffer (its storage in `seen`) gets a copy."""
    for i, w in enumerate(weights):
        g = w.grad
        if g is not None and seen[i] is not None and g.data_ptr() == seen[i]:
            w.grad = g.clone()


def graph_layer(layer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                num_warmup_iters: int = 3):
    """Capture `layer`'s forward and backward as CUDA graphs on these sample inputs (module docstring) and return the
    layer, whose calls now replay them. The warm-up calls (num_warmup_iters, eager, on the sample inputs) run the
    layer for real: they count as calls in its statistics."""
    from topoep.runtime.moe import ExpertParallelMoE

    if not isinstance(layer, ExpertParallelMoE):
        raise ValueError(f"graph_layer captures a topoep.ExpertParallelMoE, got {type(layer).__name__}")
    if layer.backend.name != "cuda":
        raise ValueError(f"graph_layer needs backend 'cuda', got {layer.backend.name!r}: backend torch reads the "
                         "routing's sizes on the host in every call, which a CUDA graph cannot replay "
                         "(LayerConfig.backend='cuda')")
    harness = getattr(layer.backend, "transport", None) == "gloo" and _capture is not torch.cuda.make_graphed_callables
    if not x.is_cuda and not harness:  # (the CPU harness's tests replace the capture)
        raise ValueError(f"graph_layer captures CUDA graphs: x is on {x.device}, move the layer's inputs to the GPU")
    if layer._graphed is not None:
        raise ValueError("this layer is already captured (graph_layer was called on it before); build a new layer "
                         "to capture other shapes")
    if not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(f"num_warmup_iters={num_warmup_iters!r}: at least 1 (the layer's own buffers, Triton kernels "
                         "and metadata must exist before the capture)")
    if not torch.is_grad_enabled():
        raise ValueError("graph_layer captures the layer's forward and backward: call it with grad enabled (not "
                         "under torch.no_grad or inference_mode), on inputs as a training call passes them")
    layer._validate(x, topk_idx, topk_weights)
    # the captured graphs read their inputs from the samples' buffers (later calls copy theirs in): never the
    # caller's own tensors
    x, topk_idx, topk_weights = (t.detach().clone().requires_grad_(t.requires_grad)
                                 for t in (x, topk_idx, topk_weights))
    sample = tuple((t.shape, t.dtype, t.requires_grad) for t in (x, topk_idx, topk_weights))
    # the expert weights are inputs of the graphs, so that their gradients come out of the backward graph whoever
    # owns them (the layer's parameters, or megatron's expert module through expert_weights). The capture runs on
    # leaf aliases of them (the same storage, new autograd leaves): a weight's own gradient accumulator may have been
    # made on another stream and be kept alive by its owner (megatron's DDP keeps every parameter's, made on the
    # default stream at its start), and the backward capture, which computes gradients for its inputs, would then
    # make that stream wait for the capturing one, which CUDA refuses. A replay takes the weights themselves, and
    # their gradients accumulate outside the graphs as usual.
    fc1, fc2 = layer._weights()
    weights = [*fc1, *fc2]
    aliases = [w.detach().requires_grad_(w.requires_grad) for w in weights]
    n1 = len(fc1)

    def call(x, topk_idx, topk_weights, *w):
        return layer._forward_with(x, topk_idx, topk_weights, list(w[:n1]), list(w[n1:]))

    training = layer.training  # a call in the other mode runs eagerly
    graphed = _capture(call, (x, topk_idx, topk_weights, *aliases), num_warmup_iters=num_warmup_iters)
    pending = [False]  # a replay whose backward has not run yet: its saved tensors live in the graphs' buffers
    seen = [None] * len(weights)  # the storage of each weight's gradient buffer in the backward graph

    def backward_started(grad):
        pending[0] = False

    def forward(x, topk_idx, topk_weights):
        layer._validate(x, topk_idx, topk_weights)
        now = layer._weights()
        if layer.training != training:
            return layer._forward_with(x, topk_idx, topk_weights, *now)
        got = tuple((t.shape, t.dtype, t.requires_grad) for t in (x, topk_idx, topk_weights))
        if not torch.is_grad_enabled():  # e.g. a recompute's first pass: the forward graph alone, no autograd
            got = tuple((s, d, g) for (s, d, _), (_, _, g) in zip(got, sample))
        if got != sample:
            raise ValueError("a captured layer replays the captured shapes, dtypes and requires_grad of "
                             f"(x, topk_idx, topk_weights): captured {_describe(sample)}, got {_describe(got)}; "
                             "pad the call to the captured shapes or build another layer for these")
        w = [*now[0], *now[1]]
        if len(w) != len(weights) or any(a is not b for a, b in zip(w, weights)):
            raise ValueError("the layer's expert weights are not the tensors it was captured with (the model was "
                             "cast, moved or rebuilt after the capture): capture after the model is final")
        if pending[0]:
            raise RuntimeError("a captured layer (topoep.graph_layer, LayerConfig.layer_graphs) was called again "
                               "before the backward of its previous call: both calls share the graphs' buffers, "
                               "so the earlier call's gradients would be wrong. Run each call's backward before the "
                               "next call (no pipeline schedule with several micro-batches in flight), or set "
                               "LayerConfig.layer_graphs=false")
        keep_grads(w, seen)
        if torch.is_grad_enabled():
            x, topk_weights, *w = _GradBuffers.apply(2, seen, x, topk_weights, *w)
        y = graphed(x, topk_idx, topk_weights, *w)
        layer.count_replay()
        if y.requires_grad:
            pending[0] = True
            y.register_hook(backward_started)
        return y

    layer.forward = forward
    layer._graphed = sample
    return layer


def _describe(spec) -> str:
    return ", ".join(f"{list(s)} {str(d).replace('torch.', '')}{' grad' if g else ''}" for s, d, g in spec)
