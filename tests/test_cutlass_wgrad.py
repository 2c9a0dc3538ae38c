"""The CUTLASS weight-gradient kernel (topoep_research.cutlass_wgrad): its input checks and build errors on the CPU;
on a GPU with the library built, its outputs against its torch form and torch._grouped_mm on the layer's shapes."""

import importlib.util

import pytest
import torch

from topoep_research import cutlass_wgrad
from topoep_research.cutlass_wgrad import (MM_CONFIGS, WGRAD_CONFIGS, check_config, cutlass_include, grouped_mm,
                                          grouped_wgrad)


def test_configs_are_named_by_index_or_name():
    for configs in (WGRAD_CONFIGS, MM_CONFIGS):
        assert [check_config(i, configs) for i in range(len(configs))] == list(range(len(configs)))
        assert check_config(configs[1], configs) == 1
        for bad in (-1, len(configs), True, "pingpong", 1.0):
            with pytest.raises(ValueError, match="none of the compiled configurations"):
                check_config(bad, configs)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match=r"\[A, P\] and \[A, Q\]"):
        grouped_wgrad(torch.zeros(4, 8), torch.zeros(5, 8), torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="runs on a GPU"):
        grouped_wgrad(torch.zeros(4, 8), torch.zeros(4, 8), torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="config 7"):
        grouped_wgrad(torch.zeros(4, 8), torch.zeros(4, 8), torch.tensor([4], dtype=torch.int32), config=7)
    with pytest.raises(ValueError, match=r"\[A, K\], \[G, K, N\] and \[G\]"):
        grouped_mm(torch.zeros(4, 8), torch.zeros(2, 16, 8), torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="runs on a GPU"):
        grouped_mm(torch.zeros(4, 8), torch.zeros(2, 8, 16), torch.tensor([1, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="config 4"):
        grouped_mm(torch.zeros(4, 8), torch.zeros(2, 8, 16), torch.tensor([1, 4], dtype=torch.int32), config=4)


def test_missing_headers_and_build_say_how_to_get_them(monkeypatch, tmp_path):
    monkeypatch.delenv("CUTLASS_HOME", raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps nvidia-cutlass==4.2.0"):
        cutlass_include()
    monkeypatch.setenv("CUTLASS_HOME", str(tmp_path))
    with pytest.raises(RuntimeError, match="CUTLASS_HOME"):
        cutlass_include()
    (tmp_path / "include").mkdir()
    (tmp_path / "tools" / "util" / "include").mkdir(parents=True)
    assert cutlass_include() == [str(tmp_path / "include"), str(tmp_path / "tools" / "util" / "include")]
    monkeypatch.setattr(cutlass_wgrad, "_module", None)
    monkeypatch.setattr(cutlass_wgrad, "build_dir", lambda: tmp_path / "nothing")
    with pytest.raises(RuntimeError, match="not built"):
        cutlass_wgrad.load(build=False)


def _groups(seed: int):
    """(generator, int32 end offsets of 128 groups of 200-319 rows as at 4096 tokens of random routing, groups 5 and 77
    without rows, their total rows)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    counts = torch.randint(200, 320, (128,), device="cuda", generator=g)
    counts[5] = counts[77] = 0
    offs = counts.cumsum(0).to(torch.int32)
    return g, offs, int(offs[-1])


def _built() -> bool:
    return torch.cuda.is_available() and cutlass_wgrad.library_path().exists()


@pytest.mark.gpu
@pytest.mark.skipif(not _built(), reason="needs a GPU and the built library (topoep_research.cutlass_wgrad.load)")
@pytest.mark.parametrize("config", range(len(WGRAD_CONFIGS)))
def test_wgrad_equals_the_reference_and_grouped_mm_on_the_layer_shapes(config):
    from topoep_research.grouped_gemm import wgrad_reference

    g, offs, A = _groups(config)
    for P, Q in ((1536, 2048), (2048, 768)):  # wgrad fc1 (gh, x) and fc2 (gy, act); rows past offs[-1] never read
        a = torch.randn(A + 64, P, device="cuda", generator=g).to(torch.bfloat16)
        b = torch.randn(A + 64, Q, device="cuda", generator=g).to(torch.bfloat16)
        a[A:], b[A:] = float("nan"), float("nan")
        out = grouped_wgrad(a, b, offs, config)
        assert out.shape == (128, P, Q) and out.dtype == torch.bfloat16
        assert torch.equal(out[5], torch.zeros_like(out[5])) and torch.equal(out[77], torch.zeros_like(out[77]))
        for ref in (wgrad_reference(a, b, offs), torch._grouped_mm(a.t(), b, offs=offs)):
            err = (out.float() - ref.float()).abs()  # fp32 sums in another order: within two bf16 ulps
            assert bool((err <= 2 ** -7 * ref.float().abs() + 1e-3).all()), (config, P, Q, err.max())


@pytest.mark.gpu
@pytest.mark.skipif(not _built(), reason="needs a GPU and the built library (topoep_research.cutlass_wgrad.load)")
@pytest.mark.parametrize("config", range(len(MM_CONFIGS)))
def test_mm_equals_grouped_mm_on_the_layer_shapes(config):
    g, offs, A = _groups(config)
    for K, N, k_major in ((2048, 1536, True), (768, 2048, True), (2048, 768, False), (1536, 2048, False)):
        # forward fc1, fc2 (x w1[g]^T: b the transpose of [G, N, K]) and data gradients fc2, fc1 (gy w2[g]: b [G, K, N])
        a = torch.randn(A + 64, K, device="cuda", generator=g).to(torch.bfloat16)
        a[A:] = float("nan")  # rows past the last group are never read
        w = torch.randn(128, N, K, device="cuda", generator=g).to(torch.bfloat16) * K ** -0.5
        b = w.transpose(1, 2) if k_major else w.reshape(128, K, N)
        out = grouped_mm(a, b, offs, config)[:A]
        ref = torch._grouped_mm(a, b, offs=offs)[:A]
        loop = torch.cat([a[s:e].float() @ b[i].float() for i, (s, e) in
                          enumerate(zip([0] + offs[:-1].tolist(), offs.tolist()))])
        for want in (ref.float(), loop):
            err = (out.float() - want).abs()
            assert bool((err <= 2 ** -7 * want.abs() + 1e-2).all()), (config, K, N, err.max())


def test_the_layers_call_forms_reach_the_right_kernel():
    from bench.grouped_gemm import gemms, operands
    from topoep_research.cutlass_wgrad import call_form

    t = operands(8, 2, 4, 16, 8, "cpu")
    forms = {name: call_form(a, b) for name, (a, b), _ in gemms(t)}
    assert forms == {"fwd fc1": "mm", "fwd fc2": "mm", "dgrad fc2": "mm", "dgrad fc1": "mm", "wgrad fc2": "wgrad",
                     "wgrad fc1": "wgrad"}
    x = torch.zeros(6, 8)
    assert call_form(x[:, :4], torch.zeros(2, 4, 8)) is None  # rows not contiguous: torch._grouped_mm
    assert call_form(x.t(), torch.zeros(6, 4).t()) is None
    assert call_form(torch.zeros(2, 6, 8), torch.zeros(2, 8, 4)) is None


def _layer_on_both(rank, world):
    """Backend cuda's layer at EP 1, forward and backward, with the default grouped GEMM and with these kernels
    (cuda_function.GROUPED_MM swapped as bench/layer_limit.py --cutlass does): (output, input, weight and expert
    gradients) of each, as fp32 CPU tensors."""
    from topoep import ExpertParallelMoE, Topology
    from topoep.runtime import cuda_function
    from topoep_research.cutlass_wgrad import as_grouped_mm, swapped_grouped_mm

    dev = torch.device("cuda", torch.cuda.current_device())
    T, E, H, Fd, k = 1024, 16, 256, 128, 4
    layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd,
                              topology=Topology(num_domains=1, ranks_per_domain=1), num_slots=2, policy="static",
                              backend="cuda", dtype=torch.bfloat16, device=dev, max_tokens=T)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16).requires_grad_()
    idx = torch.rand(T, E, device=dev, generator=g).topk(k, dim=1).indices
    w = torch.softmax(torch.randn(T, k, device=dev, generator=g), -1).to(torch.bfloat16).requires_grad_()
    gy = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    outs = []
    for kernel in (cuda_function.GROUPED_MM, as_grouped_mm(0, 0)):
        with swapped_grouped_mm(kernel):
            x.grad = w.grad = None
            layer.zero_grad(set_to_none=True)
            y = layer(x, idx, w)
            y.backward(gy)
        outs.append([t.float().cpu() for t in (y, x.grad, w.grad, layer.fc1.grad, layer.fc2.grad)])
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not _built(), reason="needs a GPU and the built library (topoep_research.cutlass_wgrad.load)")
def test_layer_on_cutlass_equals_the_layer_on_torch():
    """Output and every gradient of the layer on these kernels within bf16 error of the layer on torch's."""
    from distributed import run_ranks

    torch_run, cutlass_run = run_ranks(_layer_on_both, 1, backend="nccl")[0]
    for got, want in zip(cutlass_run, torch_run):
        assert bool(((got - want).abs() <= 2 ** -6 * want.abs() + 1e-2).all()), (got - want).abs().max()
