"""Grouped SwiGLU expert compute over variable-size groups (never padded to a capacity).

Weights follow megatron's layout: fc1 [2F, H] (first F rows gate, next F rows up), fc2 [H, F];
y = fc2 @ (silu(x fc1_gate^T) * (x fc1_up^T)). Forward returns the pre-activation h [A, 2F] for the
backward pass; backward computes the data gradient of every group before any weight gradient (so
token gradients can leave early and the replica weights can be released), as in paper 3.3.2.

Groups whose weights are consecutive slices of one buffer (the main experts' stacked parameter, the
replica pool) form a *run*. On CUDA in bf16 with 16-byte aligned rows, each run is one
`torch._grouped_mm` call; otherwise (CPU, fp32, odd sizes) a loop over the groups of the run.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _silu_grad(g: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(g)
    return s * (1 + g * (1 - s))


def _follows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b is the equal-size slice right after a in the same buffer."""
    return (b.shape == a.shape and b.dtype == a.dtype and a.is_contiguous() and b.is_contiguous()
            and b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()  # adjacent allocations differ
            and b.data_ptr() == a.data_ptr() + a.numel() * a.element_size())


def _stack(ws: list[torch.Tensor]) -> torch.Tensor:
    """[n, *shape] view over a run of consecutive slices (checked by the caller)."""
    w0 = ws[0]
    return torch.as_strided(w0, (len(ws), *w0.shape), (w0.numel(), *w0.stride()))


def stacked_view(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """[n, *shape] view over tensors that are consecutive equal-size slices of one buffer (e.g. the
    unbind() of a stacked parameter, or the slots of the replica pool); None if they are not."""
    if not ws or not ws[0].is_contiguous() or not all(_follows(a, b) for a, b in zip(ws, ws[1:])):
        return None
    return _stack(ws)


def _runs(ws1: list[torch.Tensor], ws2: list[torch.Tensor]) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Maximal runs of groups whose two weight lists are both stacked views: [(g0, g1, W1, W2)], found in
    one pass (each neighbour pair is checked once: this runs on the host at every grouped call)."""
    runs, g0, G = [], 0, len(ws1)
    while g0 < G:
        g1 = g0 + 1
        if ws1[g0].is_contiguous() and ws2[g0].is_contiguous():
            while g1 < G and _follows(ws1[g1 - 1], ws1[g1]) and _follows(ws2[g1 - 1], ws2[g1]):
                g1 += 1
        runs.append((g0, g1, _stack(ws1[g0:g1]) if g1 > g0 + 1 else ws1[g0][None],
                     _stack(ws2[g0:g1]) if g1 > g0 + 1 else ws2[g0][None]))
        g0 = g1
    return runs


def _grouped_ok(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> bool:
    """torch._grouped_mm needs CUDA, bf16 and 16-byte aligned rows (feature sizes multiples of 8)."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and x.shape[-1] % 8 == 0 and all(s % 8 == 0 for w in (w1, w2) for s in w.shape[-2:]))


class _Segments:
    """Row ranges of the groups, and of the runs of groups, of one grouped computation."""

    def __init__(self, sizes: list[int], ws1: list[torch.Tensor], ws2: list[torch.Tensor], runs=None,
                 sizes_dev: torch.Tensor | None = None):
        self.sizes = sizes
        self.sizes_dev = sizes_dev
        self.starts = [0]
        for s in sizes:
            self.starts.append(self.starts[-1] + s)
        self.runs = _runs(ws1, ws2) if runs is None else runs

    def rows(self, g0: int, g1: int) -> tuple[int, int]:
        return self.starts[g0], self.starts[g1]

    def offsets(self, g0: int, g1: int, device) -> torch.Tensor:
        """int32 end row of each group of [g0, g1), relative to the run's first row (grouped_mm's offs)."""
        if self.sizes_dev is not None and self.sizes_dev.device == torch.device(device):  # no host-to-device copy
            return torch.cumsum(self.sizes_dev[g0:g1], 0, dtype=torch.int32)
        base = self.starts[g0]
        return torch.tensor([self.starts[g + 1] - base for g in range(g0, g1)], dtype=torch.int32).to(device)


def grouped_copies(fc1: list[torch.Tensor], fc2: list[torch.Tensor],
                   x: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
    """Stacked copies of per-expert weights that are separate tensors (megatron's `local_experts.{i}`
    parameters), as views of one buffer each, where the grouped GEMM applies (CUDA, bf16, aligned):
    otherwise every expert with rows would be a loop iteration of its own (several kernels and host work
    each), whose cost grows with the number of active experts. None where nothing is to gain (the
    weights already form one run, or the loop is the only path, as on the CPU)."""
    if len(fc1) < 2 or not _grouped_ok(x, fc1[0][None], fc2[0][None]):
        return None
    if stacked_view(fc1) is not None and stacked_view(fc2) is not None:
        return None
    return (list(torch.stack([w.detach() for w in fc1]).unbind(0)),
            list(torch.stack([w.detach() for w in fc2]).unbind(0)))


def weight_runs(fc1: list[torch.Tensor], fc2: list[torch.Tensor]) -> list:
    """The runs of a weight list pair (module docstring), to pass as `runs=` when several grouped calls
    share the same weights (each computation of them walks every weight on the host)."""
    return _runs(fc1, fc2)


def swiglu_forward(x: torch.Tensor, sizes: list[int], fc1: list[torch.Tensor], fc2: list[torch.Tensor], runs=None,
                   sizes_dev: torch.Tensor | None = None):
    """x: [A, H] rows sorted by group; sizes: rows per group (len G); fc1[g]: [2F, H]; fc2[g]: [H, F];
    runs: `weight_runs(fc1, fc2)` if already known; sizes_dev: the same sizes on x's device (the grouped
    GEMM offsets are then computed there). Returns (y [A, H], h [A, 2F])."""
    A, H = x.shape
    Fd = fc2[0].shape[1]
    h = x.new_empty(A, 2 * Fd)
    y = x.new_empty(A, H)
    seg = _Segments(sizes, fc1, fc2, runs, sizes_dev)
    for g0, g1, w1, w2 in seg.runs:
        a0, a1 = seg.rows(g0, g1)
        if a1 == a0:
            continue
        if _grouped_ok(x, w1, w2):
            offs = seg.offsets(g0, g1, x.device)
            h[a0:a1] = torch._grouped_mm(x[a0:a1], w1.transpose(1, 2), offs=offs)
            act = F.silu(h[a0:a1, :Fd]) * h[a0:a1, Fd:]
            y[a0:a1] = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
            continue
        for g in range(g0, g1):
            b0, b1 = seg.rows(g, g + 1)
            if b1 > b0:
                h[b0:b1] = x[b0:b1] @ fc1[g].t()
                y[b0:b1] = (F.silu(h[b0:b1, :Fd]) * h[b0:b1, Fd:]) @ fc2[g].t()
    return y, h


def swiglu_act_reference(h: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of h [A, 2F] (the reference of the cuda backend's fused Triton activation)."""
    Fd = h.shape[1] // 2
    return F.silu(h[:, :Fd]) * h[:, Fd:]


def _act_grads(grad_act: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    Fd = h.shape[1] // 2
    gate, up = h[:, :Fd], h[:, Fd:]
    return torch.cat([grad_act * up * _silu_grad(gate), grad_act * F.silu(gate)], 1)


def swiglu_dgrad(grad_y: torch.Tensor, h: torch.Tensor, sizes: list[int], fc1: list[torch.Tensor],
                 fc2: list[torch.Tensor], runs=None, sizes_dev: torch.Tensor | None = None):
    """Data gradient. Returns (grad_x [A, H], grad_h [A, 2F]) - grad_h feeds the weight gradient."""
    A, H = grad_y.shape
    grad_x = grad_y.new_empty(A, H)
    grad_h = h.new_empty(h.shape)
    seg = _Segments(sizes, fc1, fc2, runs, sizes_dev)
    for g0, g1, w1, w2 in seg.runs:
        a0, a1 = seg.rows(g0, g1)
        if a1 == a0:
            continue
        if _grouped_ok(grad_y, w1, w2):
            offs = seg.offsets(g0, g1, grad_y.device)
            grad_h[a0:a1] = _act_grads(torch._grouped_mm(grad_y[a0:a1], w2, offs=offs), h[a0:a1])
            grad_x[a0:a1] = torch._grouped_mm(grad_h[a0:a1], w1, offs=offs)
            continue
        for g in range(g0, g1):
            b0, b1 = seg.rows(g, g + 1)
            if b1 > b0:
                grad_h[b0:b1] = _act_grads(grad_y[b0:b1] @ fc2[g], h[b0:b1])
                grad_x[b0:b1] = grad_h[b0:b1] @ fc1[g]
    return grad_x, grad_h


def swiglu_wgrad(x: torch.Tensor, h: torch.Tensor, grad_y: torch.Tensor, grad_h: torch.Tensor, sizes: list[int],
                 out_fc1: list[torch.Tensor], out_fc2: list[torch.Tensor], runs=None,
                 sizes_dev: torch.Tensor | None = None) -> None:
    """Weight gradients, *accumulated* into out_fc1[g] [2F, H] and out_fc2[g] [H, F]."""
    Fd = h.shape[1] // 2
    act = F.silu(h[:, :Fd]) * h[:, Fd:]
    seg = _Segments(sizes, out_fc1, out_fc2, runs, sizes_dev)
    for g0, g1, o1, o2 in seg.runs:
        a0, a1 = seg.rows(g0, g1)
        if a1 == a0:
            continue
        if _grouped_ok(x, o1, o2) and o1.shape[0] == g1 - g0:
            offs = seg.offsets(g0, g1, x.device)
            o2 += torch._grouped_mm(grad_y[a0:a1].t(), act[a0:a1], offs=offs)
            o1 += torch._grouped_mm(grad_h[a0:a1].t(), x[a0:a1], offs=offs)
            continue
        for g in range(g0, g1):
            b0, b1 = seg.rows(g, g + 1)
            if b1 > b0:
                out_fc2[g].add_(grad_y[b0:b1].t() @ act[b0:b1])
                out_fc1[g].add_(grad_h[b0:b1].t() @ x[b0:b1])
