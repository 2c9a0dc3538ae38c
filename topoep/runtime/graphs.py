"""A balanced MoE layer's forward and backward as CUDA graphs the caller replays (backend cuda).

Backend cuda never synchronises the host, and every size it launches is fixed by the shapes, so a whole layer call
can be captured: `graph_layer(layer, x, topk_idx, topk_weights)` captures the forward and the backward once
(`torch.cuda.make_graphed_callables`) and makes every later `layer(x, topk_idx, topk_weights)` of the same shapes a
replay of the two graphs. A replay runs no host code of the layer: the host's time per call drops to the two
launches and the copies of the inputs into the captured buffers.

What a replay does is what the captured call did, with the new inputs: the counts, the plan and the guard are
computed on the device from this call's routing (the capture takes the planning path: the slot hint, a host-side
memory of earlier calls, never leaves a captured call's replica machinery out); the replica fetch always reloads.
The layer's statistics keep working: each replay adds its statistics to the layer's device sums, and the replay
wrapper counts the call on the host (`ExpertParallelMoE.count_replay`), so `pop_stats` averages eager and replayed
calls alike. A caller that captures the layer inside a larger graph of its own calls `layer.count_replay()` once per
replay instead.

Limits: every replayed call has the captured shapes (T tokens, k choices) and dtypes, and the same tensors
requiring grad; the layer stays in the training mode it was captured in (a call in the other mode runs eagerly, as
`make_graphed_callables` does); the replica prefetch (`LayerConfig.prefetch`) cannot be in flight at capture.
"""

from __future__ import annotations

import torch


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
    if not x.is_cuda:
        raise ValueError(f"graph_layer captures CUDA graphs: x is on {x.device}, move the layer's inputs to the GPU")
    if getattr(layer, "_graphed", None) is not None:
        raise ValueError("this layer is already captured (graph_layer was called on it before); build a new layer "
                         "to capture other shapes")
    if not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(f"num_warmup_iters={num_warmup_iters!r}: at least 1 (the layer's own buffers, Triton kernels "
                         "and metadata must exist before the capture)")
    layer._validate(x, topk_idx, topk_weights)
    sample = tuple((t.shape, t.dtype, t.requires_grad) for t in (x, topk_idx, topk_weights))
    training = layer.training  # a call in the other mode runs eagerly (make_graphed_callables) and counts itself
    torch.cuda.make_graphed_callables(layer, (x, topk_idx, topk_weights), num_warmup_iters=num_warmup_iters)
    replay = layer.forward  # make_graphed_callables put the replay there

    def forward(x, topk_idx, topk_weights):
        got = tuple((t.shape, t.dtype, t.requires_grad) for t in (x, topk_idx, topk_weights))
        if got != sample:
            raise ValueError("a captured layer replays the captured shapes, dtypes and requires_grad of "
                             f"(x, topk_idx, topk_weights): captured {_describe(sample)}, got {_describe(got)}; "
                             "pad the call to the captured shapes or build another layer for these")
        y = replay(x, topk_idx, topk_weights)
        if layer.training == training:
            layer.count_replay()
        return y

    layer.forward = forward
    layer._graphed = sample
    return layer


def _describe(spec) -> str:
    return ", ".join(f"{list(s)} {str(d).replace('torch.', '')}{' grad' if g else ''}" for s, d, g in spec)
