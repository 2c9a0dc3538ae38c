"""Per-phase timing of MoE layer calls, for benchmarks (paper Fig. 15). Off by default: a layer's hot path
only checks `timer is None`.

`PhaseTimer` serialises what it times: before a phase it waits for all queued device work (and, for a
communication phase, for every rank of the group: a barrier, so that waiting for a straggler is not
counted as transfer time), then measures the phase with CUDA events on a GPU (perf_counter on the CPU)
and waits for it to finish. Pipeline overlap is therefore lost while a timer is set: each phase is its
standalone cost, and the phases do not add up to the pipelined layer time.

Phases of `ExpertParallelMoE` (ms summed over the forward and backward of the calls since `pop`):
    plan              routing-count all-gather, planner, net-benefit guard
    fetch             replica weights into the slots (forward fetch and backward reload)
    dispatch_combine  send layouts and counts exchange, every token all-to-all (dispatch and combine,
                      forward and backward)
    experts           grouped SwiGLU forward, data and weight gradients (this rank's main and replica
                      experts; the straggler is the rank where this is largest)
    grad_return       replica weight gradients back to the main ranks
Each phase is also accounted to the forward or the backward pass (whether autograd's engine was running
it), `pop(split=True)`; work that autograd runs inside a forward (a recomputation under activation
checkpointing, an autograd.grad call) counts as backward.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

PHASES = ("plan", "fetch", "dispatch_combine", "experts", "grad_return")


class PhaseTimer:
    """Accumulates milliseconds per phase name (module docstring).

    Args:
        device: where the layer runs (CUDA: events and synchronize; else perf_counter).
        group: process group of the barrier before communication phases (None: the default group).
        barrier: False to skip those barriers.
    """

    def __init__(self, device, group=None, barrier: bool = True):
        self.cuda = torch.device(device).type == "cuda"
        self.group = group
        self.barrier = barrier and dist.is_available() and dist.is_initialized()
        self.ms: dict[str, float] = {}
        self.ms_bwd: dict[str, float] = {}
        self._open: dict[str, object] = {}

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def start(self, name: str, collective: bool = False) -> None:
        if name in self._open:
            raise RuntimeError(f"phase {name!r} started twice without stop()")
        self._sync()
        if collective and self.barrier:
            dist.barrier(group=self.group)
            self._sync()
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self._open[name] = ev
        else:
            self._open[name] = time.perf_counter()

    def stop(self, name: str) -> None:
        began = self._open.pop(name)
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            ms = began.elapsed_time(end)
        else:
            ms = 1e3 * (time.perf_counter() - began)
        self.ms[name] = self.ms.get(name, 0.0) + ms
        if torch._C._current_graph_task_id() != -1:  # inside a backward pass
            self.ms_bwd[name] = self.ms_bwd.get(name, 0.0) + ms

    @contextlib.contextmanager
    def phase(self, name: str, collective: bool = False):
        self.start(name, collective)
        try:
            yield
        finally:
            self.stop(name)

    def pop(self, split: bool = False) -> dict:
        """Milliseconds per phase since the last pop (phases never entered are absent), then reset. With
        split: {phase: (forward ms, backward ms)}."""
        out, bwd, self.ms, self.ms_bwd = self.ms, self.ms_bwd, {}, {}
        if split:
            return {p: (v - bwd.get(p, 0.0), bwd.get(p, 0.0)) for p, v in out.items()}
        return out


def phase(timer: PhaseTimer | None, name: str, collective: bool = False):
    """timer.phase(...), or a no-op context without a timer."""
    return contextlib.nullcontext() if timer is None else timer.phase(name, collective)
