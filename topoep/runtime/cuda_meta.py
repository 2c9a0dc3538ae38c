"""The per-call metadata of backend `cuda` (routing counts, their all-gather, the planner, the net-benefit
guard, the statistics, the receive layout), replayed as one CUDA graph.

This work is a chain of small kernels on tensors of a few thousand elements (the counts, the layout, the spill
work and the statistics are Triton kernels: layout_triton.py, spill.py, stats_triton.py; the planner and the guard
CUDA kernels): run eagerly, the host spends longer launching them than the GPU spends running them, and the layer
becomes host-bound; in a graph each costs its own run time, a microsecond or more however small
(`bench/layer_limit.py --meta-profile` lists them). None of it synchronises the host and every shape is fixed by
(T, k), so each layer captures
it once per input shape (on the second call: the first one compiles the kernels and creates the
workspaces) and afterwards copies topk_idx (and the replica-machinery flag) into the graph's inputs, replays
it, and copies its outputs out (the next replay overwrites them while this call's backward still needs them).
The graph ends by packing its outputs into one buffer per dtype (`_Packed`), so that copy is a clone per dtype
and a view per output instead of a clone (an allocation and a launch) per output: the host's time per call
stays short of the GPU's.

`LayerConfig.cuda_graphs=False` runs it eagerly (debugging); when the caller is itself capturing a CUDA
graph, it runs eagerly inside that capture. Policies without a GPU planner (deepseek, fastermoe, flexmoe:
their reference planners read sizes on the host) also run eagerly: `enabled=False`.
"""

from __future__ import annotations

from typing import Callable

import torch


# graphs one layer keeps at most (input shapes x variants): each holds its memory pool and static buffers for the
# layer's lifetime, so a key beyond them (calls of ever new token counts below max_tokens) runs eagerly instead
MAX_GRAPHS = 8
ALIGN = 16  # bytes: each output starts at a multiple of it in its packed buffer (as an allocation of its own would)


class _Packed:
    """The outputs of a captured function, packed into one flat buffer per dtype inside the capture, each output
    padded to ALIGN bytes; `unpack` turns copies of the buffers back into the outputs (views: one split per
    buffer, and a view per output of more or less than one dimension)."""

    def __init__(self, outs: tuple):
        groups: dict = {}
        for i, t in enumerate(outs):
            groups.setdefault(t.dtype, []).append(i)
        self.n = len(outs)
        self.buffers, self.layout = [], []  # per dtype: (split sizes, [(output index, piece, shape or None)])
        for dtype, members in groups.items():
            step = max(1, ALIGN // outs[members[0]].element_size())
            filler = torch.empty(step, dtype=dtype, device=outs[members[0]].device)  # padding: never read, no fill
            parts, sizes, places = [], [], []
            for i in members:
                t = outs[i].reshape(-1)
                places.append((i, len(sizes), None if outs[i].dim() == 1 else tuple(outs[i].shape)))
                parts.append(t)
                sizes.append(t.numel())
                pad = -t.numel() % step
                if pad:
                    parts.append(filler[:pad])
                    sizes.append(pad)
            self.buffers.append(torch.cat(parts))
            self.layout.append((sizes, places))

    def unpack(self, buffers: list[torch.Tensor]) -> tuple:
        out = [None] * self.n
        for flat, (sizes, places) in zip(buffers, self.layout):
            pieces = flat.split(sizes)
            for i, piece, shape in places:
                out[i] = pieces[piece] if shape is None else pieces[piece].view(shape)
        return tuple(out)


class MetadataGraphs:
    """Per-layer cache: (input shape, variant) -> (graph, static input, static outputs); variant: a host value that
    changes the work (one graph per value). At most MAX_GRAPHS keys; calls of other keys run eagerly."""

    def __init__(self, enabled: bool = True):
        self._graphs: dict = {}
        self.enabled = enabled
        self.replays = 0
        self.eager_beyond = 0  # calls run eagerly because MAX_GRAPHS keys were taken

    def __call__(self, fn: Callable[..., tuple], topk_idx: torch.Tensor, *inputs: torch.Tensor, variant=None) -> tuple:
        """fn(topk_idx, *inputs) -> tuple of tensors, through the graph when possible. Every input is a device
        tensor whose shape is fixed by topk_idx's (the graph copies it into its own before each replay); fn's work
        may depend on `variant` (hashable), which selects the graph."""
        if not self.enabled or not topk_idx.is_cuda or torch.cuda.is_current_stream_capturing():
            return fn(topk_idx, *inputs)
        key = (tuple(topk_idx.shape), topk_idx.device, variant)
        entry = self._graphs.get(key)
        if entry is None and len(self._graphs) >= MAX_GRAPHS:
            self.eager_beyond += 1
            return fn(topk_idx, *inputs)
        if entry is None:  # first call: eager (compiles kernels, creates workspaces)
            self._graphs[key] = "warm"
            return fn(topk_idx, *inputs)
        if entry == "warm":
            static_in = [t.clone() for t in (topk_idx, *inputs)]
            graph = torch.cuda.CUDAGraph()
            # thread_local: the NCCL watchdog thread may query events while we capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                packed = _Packed(fn(*static_in))
            self._graphs[key] = entry = (graph, static_in, packed)
        graph, static_in, packed = entry
        for dst, src in zip(static_in, (topk_idx, *inputs)):
            dst.copy_(src)
        graph.replay()
        self.replays += 1
        return packed.unpack([b.clone() for b in packed.buffers])
