"""The experts' weight-gradient kernel (topoep_research.grouped_gemm) against its torch form: under Triton's
interpreter (CPU) and on the GPU, where it is also compared with torch._grouped_mm, which computes the same."""

import sys
from pathlib import Path

import pytest
import torch

from interpreter import interpreted_cases


def test_wgrad_kernel_equals_the_reference_in_the_interpreter():
    lines = interpreted_cases("wgrad_check.py")
    assert len(lines) == 7 and all(ln.endswith("equal") for ln in lines), lines


def test_reference_is_the_grouped_weight_gradient():
    from topoep_research.grouped_gemm import wgrad_reference

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(9, 3, generator=g), torch.randn(9, 4, generator=g)
    offs = torch.tensor([2, 2, 9], dtype=torch.int32)
    out = wgrad_reference(a, b, offs)
    assert torch.allclose(out[0], a[:2].t() @ b[:2]) and torch.equal(out[1], torch.zeros(3, 4))
    assert torch.allclose(out[2], a[2:].t() @ b[2:])


def test_bad_input_is_named():
    from topoep_research.grouped_gemm import WgradConfig, grouped_wgrad, triton

    with pytest.raises(ValueError, match="block_k=24"):
        WgradConfig(block_k=24)
    with pytest.raises(ValueError, match="num_warps=3"):
        WgradConfig(num_warps=3)
    if triton is not None:
        with pytest.raises(ValueError, match=r"\[M, P\] and \[M, Q\]"):
            grouped_wgrad(torch.zeros(4, 2), torch.zeros(5, 2), torch.tensor([4], dtype=torch.int32))
        with pytest.raises(ValueError, match="contiguous"):
            grouped_wgrad(torch.zeros(2, 4).t(), torch.zeros(4, 2), torch.tensor([4], dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_wgrad_kernel_on_the_gpu():
    sys.path.insert(0, str(Path(__file__).parent))
    import wgrad_check

    assert wgrad_check.main("cuda") == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"), reason="needs a GPU")
def test_wgrad_kernel_equals_grouped_mm_on_the_layer_shape():
    from topoep_research.grouped_gemm import grouped_wgrad

    g = torch.Generator(device="cuda").manual_seed(0)
    counts = torch.randint(200, 320, (128,), device="cuda", generator=g)
    counts[5] = 0
    offs = counts.cumsum(0).to(torch.int32)
    A = int(offs[-1])
    gh = torch.randn(A + 64, 1536, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(A + 64, 2048, device="cuda", generator=g).to(torch.bfloat16)
    ref = torch._grouped_mm(gh.t(), x, offs=offs)
    out = grouped_wgrad(gh, x, offs)
    assert torch.equal(out[5], torch.zeros_like(out[5]))
    err = (out.float() - ref.float()).abs()
    assert bool((err <= 2 ** -7 * ref.float().abs() + 1e-3).all()), err.max()
