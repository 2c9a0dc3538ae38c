"""Run by tests/test_weighting.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the kernels
on CPU tensors; it must be set before triton is imported), and by tests/test_cuda_backend_gpu.py as main("cuda"):
topoep/runtime/weighting.py's kernels against their torch references on random shapes (odd H, H above one
block, k = 1, T = 0, weights of zero and mixed sign). weighted_sum and sum_choices do the same fp32 products and
sums in the same order as their references, but the compiler may fuse a product and a sum into one rounding:
they must agree to 1 bf16 rounding step (and the copy made in the same pass bit for bit); row_dots sums in another
order: 1e-5 relative. Prints one line per case; exits 1 on the first difference."""

import sys

import torch

from topoep.runtime.weighting import (row_dots, row_dots_reference, sum_choices, sum_choices_reference, weighted_sum,
                                      weighted_sum_reference)


def cases():
    # (tokens, top-k, hidden, extra rows past T k in the buffer)
    yield 37, 4, 96, 0
    yield 5, 1, 20, 3
    yield 64, 8, 2048, 5  # H of two blocks
    yield 9, 3, 1100, 0  # a partial second block
    yield 0, 2, 64, 4  # no tokens


def _close_bf16(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to one bf16 rounding step of the values' magnitude."""
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= 2.0 ** -7 * torch.maximum(a.abs(), b.abs()) + 1e-30).all())


def main(device: str = "cpu") -> int:
    for n, (T, k, H, extra) in enumerate(cases()):
        g = torch.Generator().manual_seed(n)
        rows = torch.randn(T * k + extra, H, generator=g).to(torch.bfloat16).to(device)
        w = torch.randn(T, k, generator=g)
        if T:
            w[0, 0] = 0.0
        w = w.to(torch.bfloat16).to(device)
        gy = torch.randn(T, H, generator=g).to(torch.bfloat16).to(device)
        save = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16, device=device)
        y = weighted_sum(rows, w, save=save)
        ok = {"weighted_sum": _close_bf16(y, weighted_sum_reference(rows, w)),
              "copy": torch.equal(save, rows[:T * k]),
              "no copy": torch.equal(weighted_sum(rows, w), y),
              "sum_choices": _close_bf16(sum_choices(rows, k, T), sum_choices_reference(rows, k, T))}
        d, r = row_dots(gy, rows, k), row_dots_reference(gy, rows, k)
        ok["row_dots"] = d.dtype == torch.float32 and bool(((d - r).abs() <= 1e-5 * (r.abs() + 1)).all())
        bad = [name for name, v in ok.items() if not v]
        print(f"case {n}: T={T} k={k} H={H}: " + ("equal" if not bad else "DIFFERENT: " + ", ".join(bad)), flush=True)
        if bad:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
