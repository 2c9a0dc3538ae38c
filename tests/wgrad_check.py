"""Run by tests/test_grouped_gemm.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the kernel on
CPU tensors; it must be set before triton is imported), and by its GPU test as main("cuda"): the experts' weight
gradient kernel (topoep_research.grouped_gemm.grouped_wgrad) against wgrad_reference on groups of many sizes (empty,
shorter than a step, ragged tails, a region whose rows past the last offset hold garbage) and tile shapes. Prints one
line per case; exits 1 on the first difference beyond bf16 rounding."""

import sys

import torch

from topoep_research.grouped_gemm import WgradConfig, grouped_wgrad, wgrad_reference


def cases(device: str):
    """(name, a, b, offs, config)"""
    g = torch.Generator().manual_seed(0)
    small = WgradConfig(block_p=16, block_q=32, block_k=16, num_warps=4, num_stages=2)
    for name, sizes, P, Q, tail, cfg in [
        ("even", [32, 32, 32], 48, 40, 0, small),
        ("ragged", [0, 5, 17, 33, 1, 0, 16], 32, 64, 0, small),
        ("all empty", [0, 0, 0], 16, 16, 0, small),
        ("garbage past the end", [7, 20], 40, 24, 13, small),
        ("one group", [50], 17, 33, 0, small),
        ("default tiles", [70, 0, 130], 136, 200, 9, WgradConfig()),
    ]:
        M = sum(sizes) + tail
        a = torch.randn(M, P, generator=g).to(torch.bfloat16)
        b = torch.randn(M, Q, generator=g).to(torch.bfloat16)
        if tail:  # rows past the last offset are never read: make any read visible
            a[sum(sizes):] = float("nan")
        offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32)
        yield name, a.to(device), b.to(device), offs.to(device), cfg
    # strided rows: views of wider buffers, as the layer's regions are
    a = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    b = torch.randn(40, 96, generator=g).to(torch.bfloat16)
    offs = torch.tensor([10, 25, 40], dtype=torch.int32)
    yield "strided views", a[:, 8:40].to(device), b[:, :48].to(device), offs.to(device), small


def main(device: str = "cpu") -> int:
    n = 0
    for name, a, b, offs, cfg in cases(device):
        out = grouped_wgrad(a, b, offs, cfg)
        ref = wgrad_reference(a, b, offs)
        # both sum in fp32 and round once to bf16; the sums' order differs: within 2 bf16 ulps of the reference
        err = (out.float() - ref.float()).abs()
        tol = 2.0 ** -7 * ref.float().abs() + 1e-3
        ok = bool((err <= tol).all()) and not out.isnan().any()
        print(f"case {name}: G={offs.numel()} P={a.shape[1]} Q={b.shape[1]} max_err={err.max().item():.3g} "
              f"{'equal' if ok else 'DIFFERENT'}")
        n += 1
        if not ok:
            return 1
    print(f"{n} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
