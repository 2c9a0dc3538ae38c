"""Grouped SwiGLU expert compute over variable-size groups (never padded to a capacity).

Weights follow megatron's layout: fc1 [2F, H] (first F rows gate, next F rows up), fc2 [H, F];
y = fc2 @ (silu(x fc1_gate^T) * (x fc1_up^T)). Forward returns the pre-activation h [A, 2F] for the
backward pass; backward computes the data gradient of every group before any weight gradient (so
token gradients can leave early and the replica weights can be released), as in paper 3.3.2.

On CUDA with bf16 and weights that are views into one stacked buffer, `torch._grouped_mm` runs all
groups in one kernel; otherwise a loop over groups (CPU, fp32 tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _silu_grad(g: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(g)
    return s * (1 + g * (1 - s))


def _bounds(sizes: list[int]) -> list[tuple[int, int]]:
    out, a = [], 0
    for s in sizes:
        out.append((a, a + s))
        a += s
    return out


def stacked_view(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """[n, *shape] view over tensors that are consecutive equal-size slices of one buffer (e.g. the
    unbind() of a stacked parameter, or the slots of the replica pool); None if they are not."""
    if not ws:
        return None
    w0 = ws[0]
    step = w0.numel()
    if not w0.is_contiguous() or any(w.shape != w0.shape or w.dtype != w0.dtype or not w.is_contiguous() or
                                     w.untyped_storage().data_ptr() != w0.untyped_storage().data_ptr() or
                                     w.data_ptr() != w0.data_ptr() + i * step * w0.element_size()
                                     for i, w in enumerate(ws)):
        return None
    return torch.as_strided(w0, (len(ws), *w0.shape), (step, *w0.stride()))


def _runs(fc1, fc2):
    """Maximal runs of groups whose fc1 and fc2 weights are stacked views: [(g0, g1, W1, W2)]."""
    runs, g0 = [], 0
    while g0 < len(fc1):
        g1 = len(fc1)
        while g1 > g0:
            w1, w2 = stacked_view(fc1[g0:g1]), stacked_view(fc2[g0:g1])
            if w1 is not None and w2 is not None:
                break
            g1 -= 1
        if g1 == g0:  # a group that is not a view of anything: stack it alone
            w1, w2, g1 = fc1[g0][None], fc2[g0][None], g0 + 1
        runs.append((g0, g1, w1, w2))
        g0 = g1
    return runs


def use_grouped_mm(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def _offsets(sizes: list[int], device) -> torch.Tensor:
    return torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def swiglu_forward(x: torch.Tensor, sizes: list[int], fc1: list[torch.Tensor], fc2: list[torch.Tensor]):
    """x: [A, H] rows sorted by group; sizes: rows per group (len G); fc1[g]: [2F, H]; fc2[g]: [H, F].
    Returns (y [A, H], h [A, 2F])."""
    A, H = x.shape
    Fdim = fc2[0].shape[1] if fc2 else 0
    h = x.new_empty(A, 2 * Fdim)
    y = x.new_empty(A, H)
    if use_grouped_mm(x):
        bounds = _bounds(sizes)
        for g0, g1, w1, w2 in _runs(fc1, fc2):
            a0, a1 = bounds[g0][0], bounds[g1 - 1][1] if g1 > g0 else bounds[g0][0]
            if a1 == a0:
                continue
            offs = _offsets(sizes[g0:g1], x.device)
            hg = torch._grouped_mm(x[a0:a1], w1.transpose(1, 2), offs=offs)
            h[a0:a1] = hg
            act = F.silu(hg[:, :Fdim]) * hg[:, Fdim:]
            y[a0:a1] = torch._grouped_mm(act, w2.transpose(1, 2), offs=offs)
        return y, h
    for g, (a0, a1) in enumerate(_bounds(sizes)):
        if a1 == a0:
            continue
        hg = x[a0:a1] @ fc1[g].t()
        h[a0:a1] = hg
        y[a0:a1] = (F.silu(hg[:, :Fdim]) * hg[:, Fdim:]) @ fc2[g].t()
    return y, h


def swiglu_dgrad(grad_y: torch.Tensor, h: torch.Tensor, sizes: list[int], fc1: list[torch.Tensor],
                 fc2: list[torch.Tensor]):
    """Data gradient. Returns (grad_x [A, H], grad_h [A, 2F]) - grad_h feeds the weight gradient."""
    A, H = grad_y.shape
    Fdim = h.shape[1] // 2
    grad_x = grad_y.new_empty(A, H)
    grad_h = h.new_empty(h.shape)
    for g, (a0, a1) in enumerate(_bounds(sizes)):
        if a1 == a0:
            continue
        gate, up = h[a0:a1, :Fdim], h[a0:a1, Fdim:]
        grad_act = grad_y[a0:a1] @ fc2[g]  # [n, F]
        grad_h[a0:a1, :Fdim] = grad_act * up * _silu_grad(gate)
        grad_h[a0:a1, Fdim:] = grad_act * F.silu(gate)
        grad_x[a0:a1] = grad_h[a0:a1] @ fc1[g]
    return grad_x, grad_h


def swiglu_wgrad(x: torch.Tensor, h: torch.Tensor, grad_y: torch.Tensor, grad_h: torch.Tensor, sizes: list[int],
                 out_fc1: list[torch.Tensor], out_fc2: list[torch.Tensor]) -> None:
    """Weight gradients, *accumulated* into out_fc1[g] [2F, H] and out_fc2[g] [H, F] (group by group)."""
    Fdim = h.shape[1] // 2
    for g, (a0, a1) in enumerate(_bounds(sizes)):
        if a1 == a0:
            continue
        act = F.silu(h[a0:a1, :Fdim]) * h[a0:a1, Fdim:]
        out_fc2[g].add_(grad_y[a0:a1].t() @ act)
        out_fc1[g].add_(grad_h[a0:a1].t() @ x[a0:a1])
