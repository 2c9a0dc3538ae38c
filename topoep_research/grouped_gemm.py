"""The experts' weight gradients as one Triton kernel (`wgrad_reference`, its torch form, beside it): a measured
candidate for backend cuda's weight gradients. On the layer's shapes it is slower than `torch._grouped_mm`
(`results/grouped_gemm.md`), so the layer does not use it; it stays here with its checks as the baseline of that
comparison.

For groups of rows g = 0 .. G-1 given by their end offsets (the rows of group g are offs[g-1] .. offs[g] - 1 of the
inputs, offs[-1] = 0), `grouped_wgrad(a, b, offs)` writes out[g] = a[rows of g]^T b[rows of g]: a [M, P], b [M, Q],
out [G, P, Q] in bf16, summed in fp32. It is the weight gradient of a grouped GEMM: `torch._grouped_mm(a.t(), b,
offs=offs)` computes the same, summing over a group's rows; a group without rows gets zeros. Rows past offs[-1] are
never read.

Why a kernel of our own: at 4096 tokens per rank a group has about 256 rows (128 experts, top-8), so each output tile
sums over a short K, and the kernel's time goes to starting and finishing tiles rather than to the tensor cores.
One program here computes one BLOCK_P x BLOCK_Q tile of one group's output over all of the group's rows, with the
programs of a group adjacent in launch order (the group's rows stay in L2 while its tiles run); the output is
written once, in bf16. The tile shape is a `WgradConfig`; `bench/grouped_gemm.py` measures them against
`torch._grouped_mm` on the layer's shapes. What it lacks against CUTLASS's kernel: TMA loads and a persistent
schedule that overlaps one tile's epilogue with the next tile's loads.

Under Triton's interpreter (CPU checks) the row loop is a while loop, which the interpreter runs; compiled, it is a
`tl.range` loop, which Triton software-pipelines. Both run the same step (`_wgrad_step`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only environments: the module imports, the kernel is unavailable
    triton = None


@dataclass(frozen=True)
class WgradConfig:
    """One tile shape of the weight-gradient kernel: an output tile of block_p x block_q, block_k rows per step."""

    block_p: int = 128
    block_q: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_p", "block_q", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"WgradConfig.{name}={v}: must be a power of two >= 16 (a tensor-core tile)")
        if self.num_warps not in (4, 8) or not 1 <= self.num_stages <= 6:
            raise ValueError(f"WgradConfig: num_warps={self.num_warps} (4 or 8), num_stages={self.num_stages} "
                             "(1..6)")


DEFAULT_WGRAD = WgradConfig()


if triton is not None:

    @triton.jit
    def _wgrad_step(acc, a, b, k, end, rk, rp, rq, P, Q, stride_a, stride_b, UPCAST: tl.constexpr):
        rows = k + rk
        am = (rows[:, None] < end) & (rp[None, :] < P)
        bm = (rows[:, None] < end) & (rq[None, :] < Q)
        at = tl.load(a + rows[:, None].to(tl.int64) * stride_a + rp[None, :], mask=am, other=0.0)
        bt = tl.load(b + rows[:, None].to(tl.int64) * stride_b + rq[None, :], mask=bm, other=0.0)
        if UPCAST:  # the interpreter's dot takes bf16 tiles for integers: it gets them exactly in fp32
            at, bt = at.to(tl.float32), bt.to(tl.float32)
        return tl.dot(tl.trans(at), bt, acc)

    @triton.jit
    def _wgrad_kernel(a, b, out, offs, P, Q, stride_a, stride_b, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr,
                      BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, INTERPRET: tl.constexpr):
        """out [G, P, Q] (contiguous): program (tile, g) writes tile `tile` of group g's a^T b over its rows."""
        tile = tl.program_id(0)
        g = tl.program_id(1)
        tiles_q = tl.cdiv(Q, BLOCK_Q)
        rp = (tile // tiles_q) * BLOCK_P + tl.arange(0, BLOCK_P)
        rq = (tile % tiles_q) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        rk = tl.arange(0, BLOCK_K)
        start = tl.load(offs + g - 1, mask=g > 0, other=0)
        end = tl.load(offs + g)
        acc = tl.zeros([BLOCK_P, BLOCK_Q], dtype=tl.float32)
        if INTERPRET:
            k = start
            while k < end:
                acc = _wgrad_step(acc, a, b, k, end, rk, rp, rq, P, Q, stride_a, stride_b, True)
                k += BLOCK_K
        else:
            for k in tl.range(start, end, BLOCK_K, num_stages=NUM_STAGES):
                acc = _wgrad_step(acc, a, b, k, end, rk, rp, rq, P, Q, stride_a, stride_b, False)
        o = out + g.to(tl.int64) * P * Q + rp[:, None].to(tl.int64) * Q + rq[None, :]
        tl.store(o, acc.to(out.dtype.element_ty), mask=(rp[:, None] < P) & (rq[None, :] < Q))


def usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The kernel applies: Triton, CUDA bf16 inputs whose rows are contiguous."""
    return (triton is not None and a.is_cuda and a.dtype == b.dtype == torch.bfloat16 and a.stride(1) == 1
            and b.stride(1) == 1)


def grouped_wgrad(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, config: WgradConfig = DEFAULT_WGRAD,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """out [G, P, Q] = per group g, a[rows of g]^T @ b[rows of g] (module docstring); a [M, P], b [M, Q] with rows
    contiguous, offs int32 [G] (non-decreasing, offs[-1] <= M)."""
    if triton is None:
        raise RuntimeError("grouped_wgrad needs Triton (pip install triton); use wgrad_reference without it")
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"grouped_wgrad: a {tuple(a.shape)} and b {tuple(b.shape)} must be [M, P] and [M, Q]")
    if a.stride(1) != 1 or b.stride(1) != 1:
        raise ValueError("grouped_wgrad: the rows of a and b must be contiguous (stride 1 in the last dimension)")
    G, (P, Q) = offs.numel(), (a.shape[1], b.shape[1])
    if out is None:
        out = torch.empty(G, P, Q, dtype=a.dtype, device=a.device)
    elif out.shape != (G, P, Q) or not out.is_contiguous():
        raise ValueError(f"grouped_wgrad: out {tuple(out.shape)} must be a contiguous ({G}, {P}, {Q})")
    c = config
    grid = (triton.cdiv(P, c.block_p) * triton.cdiv(Q, c.block_q), G)
    _wgrad_kernel[grid](a, b, out, offs, P, Q, a.stride(0), b.stride(0), BLOCK_P=c.block_p, BLOCK_Q=c.block_q,
                        BLOCK_K=c.block_k, NUM_STAGES=c.num_stages,
                        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1", num_warps=c.num_warps,
                        num_stages=c.num_stages)
    return out


def wgrad_reference(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """grouped_wgrad's torch form: each group's a^T b in fp32, rounded once to a's dtype."""
    G, (P, Q) = offs.numel(), (a.shape[1], b.shape[1])
    out = torch.zeros(G, P, Q, dtype=a.dtype, device=a.device)
    ends = offs.tolist()
    for g in range(G):
        s, e = (ends[g - 1] if g else 0), ends[g]
        if e > s:
            out[g] = (a[s:e].float().t() @ b[s:e].float()).to(a.dtype)
    return out
