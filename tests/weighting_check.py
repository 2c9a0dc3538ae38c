"""Run by tests/test_weighting.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the kernels
on CPU tensors; it must be set before triton is imported), and by tests/test_cuda_backend_gpu.py as main("cuda"):
topoep/runtime/weighting.py's kernels against their torch references on random shapes (odd H, H above one
block, k = 1, T = 0, weights of zero and mixed sign), each also with rows read in place (`local`). weighted_sum and sum_choices do the same fp32 products and
sums in the same order as their references, but the compiler may fuse a product and a sum into one rounding:
they must agree to 1 bf16 rounding step (and the copy made in the same pass bit for bit); row_dots sums in another
order: 1e-5 relative. Prints one line per case; exits 1 on the first difference."""

import sys

import torch

from topoep.runtime.weighting import (local_rows_reference, row_dots, row_dots_reference, sum_choices,
                                      sum_choices_reference, weighted_sum, weighted_sum_reference)


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
        # rows read in place (`local`): a third from the main outputs, a third from the slots', the rest from rows
        cap = T * k + 2
        main = torch.randn(cap, H, generator=g).to(torch.bfloat16).to(device)
        slot = torch.randn(cap, H, generator=g).to(torch.bfloat16).to(device)
        perm = torch.randperm(cap, generator=g)[:T * k]
        which = torch.arange(T * k) % 3
        inv = torch.where(which == 0, perm, torch.where(which == 1, perm + cap, torch.full_like(perm, -1)))
        local = (inv.to(device), main, slot)
        save2 = torch.full((T * k, H), float("nan"), dtype=torch.bfloat16, device=device)
        y2 = weighted_sum(rows, w, save=save2, local=local)
        ok["local weighted_sum"] = _close_bf16(y2, weighted_sum_reference(rows, w, local))
        ok["local copy"] = torch.equal(save2, local_rows_reference(rows, T, k, local))
        ok["local sum_choices"] = _close_bf16(sum_choices(rows, k, T, local), sum_choices_reference(rows, k, T, local))
        d, r = row_dots(gy, rows, k), row_dots_reference(gy, rows, k)
        ok["row_dots"] = d.dtype == torch.float32 and bool(((d - r).abs() <= 1e-5 * (r.abs() + 1)).all())
        bad = [name for name, v in ok.items() if not v]
        print(f"case {n}: T={T} k={k} H={H}: " + ("equal" if not bad else "DIFFERENT: " + ", ".join(bad)), flush=True)
        if bad:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
