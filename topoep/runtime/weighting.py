"""Backend cuda's top-k weighting around dispatch and combine, fused into Triton kernels.

The layer's output is y[t] = sum_j w[t, j] out[t k + j] (out: the expert result of assignment t k + j, back
from the combine). Written with torch ops this is a broadcast multiply and a sum over [T, k, H] tensors in
forward, and two more broadcast multiplies and two sums in backward, plus copies: about a quarter of the
layer's GPU time at 16384 tokens per rank (one H200, EP 1, results/gpu/README.md). Here:

    forward    y[t] = sum_j w[t, j] out[t k + j]            `weighted_sum`: one pass over out, fp32 sums,
               (and a copy of out for backward, same pass)   one rounding
    backward   grad out[t k + j] = w[t, j] grad_y[t]        not materialised: the backward dispatch scales
                                                            each row as it sends it (dispatch `scale=`)
               grad w[t, j] = <grad_y[t], out[t k + j]>     `row_dots` (fp32)
               grad x[t] = sum_j grad_assign[t k + j]       `sum_choices` (the same kernel unweighted)

Where the expert results of this rank's own assignments never left it (backend cuda's peer workspace, one chunk:
`local`), the sums read those rows in place, from the GEMM outputs, instead of from the combine's buffer:
`local` = (inv int64[T k], main [cap, H], slot [cap, H] or None): assignment a's row is main[inv[a]] for
0 <= inv[a] < cap, slot[inv[a] - cap] for inv[a] >= cap, and rows[a] for inv[a] < 0 (`local_rows_reference`).

Each kernel has a torch reference beside it (`*_reference`, the same arithmetic: fp32 products and sums in
choice order); tests/weighting_check.py compares them under Triton's interpreter on the CPU and on the GPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only environments: the module imports, the kernels are unavailable
    triton = None

BLOCK_H = 1024  # columns per step of a row (H is looped over in blocks of this, or of H's power of two)
PROGRAMS = 1024  # grid of the token loops (each program strides over tokens)

if triton is not None:

    @triton.jit
    def _weighted_sum_kernel(rows, w, y, save, inv, lmain, lslot, lcap, T, K: tl.constexpr, H: tl.constexpr,
                             BLOCK: tl.constexpr, SAVE: tl.constexpr, WEIGHTED: tl.constexpr, LOCAL: tl.constexpr):
        """y[t] = sum_j w[t, j] rows[t K + j] (sum_j rows[t K + j] without WEIGHTED; fp32, one rounding);
        with SAVE, save[t K + j] = rows[t K + j]. With LOCAL, row t K + j is read where inv says (module docstring)."""
        offs = tl.arange(0, BLOCK)
        t = tl.program_id(0).to(tl.int64)
        while t < T:
            for h0 in tl.static_range(0, H, BLOCK):
                m = h0 + offs < H
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for j in tl.static_range(K):
                    src = rows + (t * K + j) * H
                    if LOCAL:
                        q = tl.load(inv + t * K + j)
                        src = tl.where(q < 0, src, tl.where(q < lcap, lmain + q * H, lslot + (q - lcap) * H))
                    r = tl.load(src + h0 + offs, mask=m)
                    if SAVE:
                        tl.store(save + (t * K + j) * H + h0 + offs, r, mask=m)
                    if WEIGHTED:
                        acc += tl.load(w + t * K + j).to(tl.float32) * r.to(tl.float32)
                    else:
                        acc += r.to(tl.float32)
                tl.store(y + t * H + h0 + offs, acc.to(y.dtype.element_ty), mask=m)
            t += tl.num_programs(0)

    @triton.jit
    def _row_dots_kernel(g, rows, out, T, K: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr):
        """out[t, j] = sum_h g[t, h] rows[t K + j, h] in fp32."""
        offs = tl.arange(0, BLOCK)
        t = tl.program_id(0).to(tl.int64)
        while t < T:
            for j in tl.static_range(K):
                acc = tl.zeros([BLOCK], dtype=tl.float32)
                for h0 in tl.static_range(0, H, BLOCK):
                    m = h0 + offs < H
                    gv = tl.load(g + t * H + h0 + offs, mask=m, other=0.0).to(tl.float32)
                    acc += gv * tl.load(rows + (t * K + j) * H + h0 + offs, mask=m, other=0.0).to(tl.float32)
                tl.store(out + t * K + j, tl.sum(acc, axis=0))
            t += tl.num_programs(0)


def _block(H: int) -> int:
    p = 1
    while p < min(H, BLOCK_H):
        p <<= 1
    return p


def _grid(T: int) -> tuple[int]:
    return (max(1, min(T, PROGRAMS)),)


def _check(rows: torch.Tensor, T: int, k: int) -> int:
    if rows.dim() != 2 or rows.shape[0] < T * k:
        raise ValueError(f"rows must be [>= T*k = {T * k}, H], got {list(rows.shape)}")
    if not rows.is_contiguous():
        raise ValueError("rows must be contiguous")
    return rows.shape[1]


def _local_args(rows: torch.Tensor, T: int, k: int, local: tuple | None) -> tuple:
    """The kernel's (inv, lmain, lslot, lcap) for `local` (module docstring), placeholders without it."""
    if local is None:
        return rows, rows, rows, 0
    inv, main, slot = local
    if inv.dtype != torch.int64 or inv.numel() != T * k or not inv.is_contiguous():
        raise ValueError(f"local: inv must be a contiguous int64[T*k={T * k}], got {inv.dtype} {list(inv.shape)}")
    for name, t in (("main", main), ("slot", slot)):
        if t is not None and (t.dim() != 2 or t.shape[1] != rows.shape[1] or t.dtype != rows.dtype
                              or not t.is_contiguous()):
            raise ValueError(f"local: {name} must be a contiguous [cap, H={rows.shape[1]}] {rows.dtype} tensor, got "
                             f"{list(t.shape)} {t.dtype}")
    return inv, main, main if slot is None else slot, main.shape[0]


def local_rows_reference(rows: torch.Tensor, T: int, k: int, local: tuple | None) -> torch.Tensor:
    """[T k, H]: the row of every assignment, from rows or, with `local`, from where inv says (module docstring)."""
    out = rows[:T * k]
    if local is None:
        return out
    inv, main, slot = local
    out = out.clone()
    cap = main.shape[0]
    for q, src, shift in ((inv >= 0) & (inv < cap), main, 0), ((inv >= cap), slot, cap):
        if bool(q.any()):
            out[q] = src[inv[q] - shift]
    return out


def weighted_sum(rows: torch.Tensor, w: torch.Tensor, save: torch.Tensor | None = None,
                 local: tuple | None = None) -> torch.Tensor:
    """[T, H] in rows' dtype: y[t] = sum_j w[t, j] rows[t k + j] for w [T, k] (rows: the first T k rows of
    a [>= T k, H] tensor; with `local`, the rows of this rank's own assignments read in place: module docstring).
    With `save` ([T k, H]), every assignment's row is copied into it in the same pass."""
    T, k = w.shape
    H = _check(rows, T, k)
    if save is not None and (tuple(save.shape) != (T * k, H) or save.dtype != rows.dtype or not save.is_contiguous()):
        raise ValueError(f"save must be a contiguous [T*k={T * k}, H={H}] {rows.dtype} tensor, got {list(save.shape)} "
                         f"{save.dtype}")
    y = rows.new_empty(T, H)
    if T:
        _weighted_sum_kernel[_grid(T)](rows, w.contiguous(), y, save if save is not None else rows,
                                       *_local_args(rows, T, k, local), T, K=k, H=H, BLOCK=_block(H),
                                       SAVE=save is not None, WEIGHTED=True, LOCAL=local is not None)
    return y


def weighted_sum_reference(rows: torch.Tensor, w: torch.Tensor, local: tuple | None = None) -> torch.Tensor:
    T, k = w.shape
    r = local_rows_reference(rows, T, k, local).view(T, k, rows.shape[1]).float()
    acc = torch.zeros(T, rows.shape[1], dtype=torch.float32, device=rows.device)
    for j in range(k):
        acc += w[:, j, None].float() * r[:, j]
    return acc.to(rows.dtype)


def row_dots(g: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    """fp32 [T, k]: <g[t], rows[t k + j]> for g [T, H]."""
    T = g.shape[0]
    H = _check(rows, T, k)
    if g.dim() != 2 or g.shape[1] != H:
        raise ValueError(f"g must be [T, H={H}] like the rows, got {list(g.shape)}")
    out = torch.empty(T, k, dtype=torch.float32, device=g.device)
    if T:
        _row_dots_kernel[_grid(T)](g.contiguous(), rows, out, T, K=k, H=H, BLOCK=_block(H))
    return out


def row_dots_reference(g: torch.Tensor, rows: torch.Tensor, k: int) -> torch.Tensor:
    T = g.shape[0]
    return (g.float()[:, None, :] * rows[:T * k].view(T, k, rows.shape[1]).float()).sum(-1)


def sum_choices(rows: torch.Tensor, k: int, T: int, local: tuple | None = None) -> torch.Tensor:
    """[T, H] in rows' dtype: sum_j rows[t k + j] (with `local`: as weighted_sum reads them)."""
    H = _check(rows, T, k)
    y = rows.new_empty(T, H)
    if T:
        _weighted_sum_kernel[_grid(T)](rows, rows, y, rows, *_local_args(rows, T, k, local), T, K=k, H=H,
                                       BLOCK=_block(H), SAVE=False, WEIGHTED=False, LOCAL=local is not None)
    return y


def sum_choices_reference(rows: torch.Tensor, k: int, T: int, local: tuple | None = None) -> torch.Tensor:
    """weighted_sum_reference with weights 1 (exact in fp32), as the kernel is the weighted one unweighted."""
    return weighted_sum_reference(rows, torch.ones(T, k, dtype=torch.float32, device=rows.device), local)
