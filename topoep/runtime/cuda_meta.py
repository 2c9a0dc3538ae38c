"""The per-call metadata of backend `cuda` (routing counts, their all-gather, the planner, the net-benefit
guard, the statistics, the receive layout), replayed as one CUDA graph.

This work is a chain of small kernels on tensors of a few thousand elements (about 150 before the send and
receive layout became two Triton kernels, layout_triton.py; 43 after it, in a profile at EP 2): run eagerly,
the host spends longer launching them than the GPU spends running them, and the layer becomes host-bound. None of it synchronises the host and every shape is fixed by (T, k), so each layer captures
it once per input shape (on the second call: the first one compiles the kernels and creates the
workspaces) and afterwards copies topk_idx (and the replica-machinery flag) into the graph's inputs, replays
it, and clones its outputs (the next replay overwrites them while this call's backward still needs them).

`LayerConfig.cuda_graphs=False` runs it eagerly (debugging); when the caller is itself capturing a CUDA
graph, it runs eagerly inside that capture. Policies without a GPU planner (deepseek, fastermoe, flexmoe:
their reference planners read sizes on the host) also run eagerly: `enabled=False`.
"""

from __future__ import annotations

from typing import Callable

import torch


class MetadataGraphs:
    """Per-layer cache: input shape -> (graph, static input, static outputs)."""

    def __init__(self, enabled: bool = True):
        self._graphs: dict = {}
        self.enabled = enabled
        self.replays = 0

    def __call__(self, fn: Callable[..., tuple], topk_idx: torch.Tensor, *inputs: torch.Tensor) -> tuple:
        """fn(topk_idx, *inputs) -> tuple of tensors, through the graph when possible. Every input is a device
        tensor whose shape is fixed by topk_idx's (the graph copies it into its own before each replay)."""
        if not self.enabled or not topk_idx.is_cuda or torch.cuda.is_current_stream_capturing():
            return fn(topk_idx, *inputs)
        key = (tuple(topk_idx.shape), topk_idx.device)
        entry = self._graphs.get(key)
        if entry is None:  # first call: eager (compiles kernels, creates workspaces)
            self._graphs[key] = "warm"
            return fn(topk_idx, *inputs)
        if entry == "warm":
            static_in = [t.clone() for t in (topk_idx, *inputs)]
            graph = torch.cuda.CUDAGraph()
            # thread_local: the NCCL watchdog thread may query events while we capture
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                outs = fn(*static_in)
            self._graphs[key] = entry = (graph, static_in, outs)
        graph, static_in, outs = entry
        for dst, src in zip(static_in, (topk_idx, *inputs)):
            dst.copy_(src)
        graph.replay()
        self.replays += 1
        return tuple(t.clone() for t in outs)
