"""bench/layer_limit.py on the CPU (the measurement needs a GPU): the plain PyTorch layer it compares against
computes the MoE layer (forward against a loop over tokens, backward through autograd), the limit's FLOPs and bytes
follow the docstring's formulas, and without CUDA it says where to run."""

import pytest
import torch

from bench.layer_limit import (gemm_bytes, gemm_flops, gemm_shapes, limit_parts, main, plain_moe, plain_moe_reference,
                               row_bytes)


def _case(T=16, k=2, E=4, H=8, Fd=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    idx = torch.randint(0, E, (T, k), generator=g)
    idx[0] = torch.arange(k)  # experts 0 and 1 have rows; some expert may have none
    w = torch.rand(T, k, generator=g)
    return x, idx, w, torch.randn(E, 2 * Fd, H, generator=g), torch.randn(E, H, Fd, generator=g)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_layer_equals_the_token_loop(seed):
    x, idx, w, fc1, fc2 = _case(seed=seed)
    got = plain_moe(x, idx, w, fc1, fc2)
    want = plain_moe_reference(x, idx, w, fc1, fc2)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-4), (got - want).abs().max()


def test_plain_layer_backward_matches_the_loop():
    x, idx, w, fc1, fc2 = _case(T=6, E=3)
    leaves = [t.clone().requires_grad_() for t in (x, w, fc1, fc2)]
    leaves_ref = [t.clone().requires_grad_() for t in (x, w, fc1, fc2)]
    gy = torch.randn(6, 8, generator=torch.Generator().manual_seed(5))
    plain_moe(leaves[0], idx, *leaves[1:]).backward(gy)
    plain_moe_reference(leaves_ref[0], idx, *leaves_ref[1:]).backward(gy)
    for a, b in zip(leaves, leaves_ref):
        assert torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-4), (a.grad - b.grad).abs().max()


def test_limit_counts():
    A, H, Fd = 32, 16, 8
    shapes = gemm_shapes(A, H, Fd)
    assert len(shapes) == 6 and gemm_flops(A, H, Fd) == 3 * 2 * A * H * 3 * Fd  # forward, dgrad, wgrad
    T, k = 4, 8
    A = T * k
    # forward 2TH + 2AH + 3AF; backward 3TH + 3AH + 6AF (docstring), 2 bytes each
    assert row_bytes(T, k, H, Fd) == 2 * (5 * T * H + 5 * A * H + 9 * A * Fd)


def test_gemm_bytes_count_the_rows_and_every_experts_weights():
    A, E, H, Fd = 32, 4, 16, 8
    b = gemm_bytes(A, E, H, Fd)
    assert b["fwd fc1"] == 2 * (A * H + E * H * 2 * Fd + A * 2 * Fd)  # x read, E fc1 read, h written
    assert b["dgrad fc2"] == 2 * (A * H + E * H * Fd + A * Fd)
    assert b["wgrad fc1"] == 2 * (2 * Fd * A + A * H + E * 2 * Fd * H)  # both operands read, E results written
    assert b["wgrad fc2"] == 2 * (H * A + A * Fd + E * H * Fd)


def test_each_gemm_of_the_limit_is_the_slower_of_its_flops_and_its_bytes():
    T, k, E, H, Fd = 4, 8, 4, 16, 8
    names = [n for n, *_ in gemm_shapes(1, 1, 1)]
    gb = gemm_bytes(T * k, E, H, Fd)
    bw = 1.0  # GB/s: ms = bytes / 1e6
    dense = {n: 1e-3 for n in names}
    dense["fwd fc1"] = 10.0  # slower than its bytes: kept
    lim = limit_parts(dense, {n: 2e-3 for n in names}, bw, T, k, E, H, Fd)
    want = {n: gb[n] / 1e6 for n in names} | {"fwd fc1": 10.0}
    assert lim["roofline_ms"] == pytest.approx(want) and all(want[n] > 1e-3 for n in names if n != "fwd fc1")
    assert lim["gemm_dense_ms"] == pytest.approx(10.005) and lim["gemm_roofline_ms"] == pytest.approx(sum(want.values()))
    assert lim["limit_ms"] == pytest.approx(sum(want.values()) + row_bytes(T, k, H, Fd) / 1e6)
    assert lim["limit_even_ms"] == pytest.approx(12e-3 + row_bytes(T, k, H, Fd) / 1e6)


def test_from_json_writes_the_report_again_without_a_gpu(tmp_path):
    import json

    names = [n for n, *_ in gemm_shapes(1, 1, 1)]
    config = dict(tokens=[4096], routings=["balanced"], slots=2, iters=10, profile_iters=5, no_megatron=True,
                  graphed=False, cutlass=False, cutlass_config=[0, 0], name="layer_limit", hidden=2048, ffn=768,
                  experts=128, topk=8)
    lim = {"dense_ms": {n: 0.2 for n in names}, "even_ms": {n: 0.3 for n in names}, "copy_gb_per_s": 3000.0,
           "limit_ms": 99.0}  # an older limit: computed again
    row = dict(tokens=4096, routing="balanced", layer="cuda/static", ms=3.0, gpu_ms=2.5, host_ms=1.0, max_diff=0.0,
               vs_limit=9.9, vs_limit_even=9.9, gpu_vs_limit=9.9)
    failed = dict(tokens=4096, routing="balanced", layer="cuda/static graphed", error="capture failed: x")
    src = tmp_path / "run.json"
    src.write_text(json.dumps({"date": "2026-01-01 00:00 UTC", "commit": "abc", "hardware": "1 x GPU",
                               "config": config, "limits": {"4096": lim}, "rows": [row, failed]}))
    assert main(["--from-json", str(src), "--out", str(tmp_path), "--name", "again"]) == 0
    text = (tmp_path / "again.md").read_text()
    out = json.loads((tmp_path / "again.json").read_text())
    want = limit_parts(lim["dense_ms"], lim["even_ms"], 3000.0, 4096, 8, 128, 2048, 768)
    assert out["limits"]["4096"]["limit_ms"] == pytest.approx(want["limit_ms"]) != 99.0
    assert out["rows"][0]["vs_limit"] == pytest.approx(3.0 / want["limit_ms"]) and out["rows"][1] == failed
    assert out["date"] == "2026-01-01 00:00 UTC" and out["commit"] == "abc" and "1 x GPU" in text
    assert "--tokens 4096 --iters 10 --routings balanced --no-megatron" in text and "did not run: capture failed" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_cuda_it_says_where_to_run():
    with pytest.raises(SystemExit, match="CUDA"):
        main(["--tokens", "16"])


def test_layers_table_shows_each_layer_and_says_which_did_not_run():
    from bench.layer_limit import layers_table

    row = dict(tokens=4096, routing="balanced", layer="cuda/static", ms=3.0, vs_limit=1.8, vs_limit_even=1.3, gpu_ms=2.5,
               gpu_vs_limit=1.5, host_ms=3.3, plan_ms=0.5, dispatch_combine_ms=0.9, experts_ms=2.1, meta_gpu_us=120.4,
               meta_host_us=30.2, max_diff=0.0)
    failed = dict(tokens=4096, routing="balanced", layer="cuda/static graphed", error="capture failed: x")
    text = layers_table([row, failed, dict(row, layer="plain torch", gpu_clean=False)])
    line = next(ln for ln in text.splitlines() if ln.startswith("| 4096 "))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[2] == "cuda/static" and cells[9] == "yes" and cells[13] == "120 / 30"  # host 3.3 > GPU 2.5
    assert "- 4096 tokens, balanced, cuda/static graphed: did not run: capture failed: x" in text
    assert "- 4096 tokens, balanced, plain torch: the host outlasted the sleep" in text
    assert "cuda/static: the host outlasted" not in text


def test_cutlass_layers_swap_the_grouped_gemm_around_each_call(monkeypatch):
    import topoep_research.cutlass_wgrad as cw
    from bench.layer_limit import gemm_kernel, parse_args
    from topoep.runtime import cuda_function

    default = cuda_function.GROUPED_MM
    seen = []
    monkeypatch.setattr(cw, "as_grouped_mm", lambda wgrad, mm: seen.append((wgrad, mm)) or "cutlass kernel")
    args = parse_args(["--cutlass", "--cutlass-config", "2", "1"])
    assert args.cutlass and args.cutlass_config == [2, 1]
    with gemm_kernel("cuda/static", args)():
        assert cuda_function.GROUPED_MM is default
    with pytest.raises(RuntimeError, match="inside"):
        with gemm_kernel("cuda/topoep cutlass", args)():
            assert cuda_function.GROUPED_MM == "cutlass kernel" and seen == [(2, 1)]
            raise RuntimeError("inside")
    assert cuda_function.GROUPED_MM is default  # restored, also after an error
    with pytest.raises(SystemExit):
        parse_args(["--cutlass", "--cutlass-config", "9", "0"])
