"""bench/grouped_gemm.py on the CPU (the timing needs a GPU): the groups it builds, the call forms it times (each the
grouped GEMM of one layer call, checked against a loop over the groups), its FLOP count, its report, and that
without CUDA it says where to run."""

import pytest
import torch

from bench.grouped_gemm import flops_of, gemms, group_offsets, main, operands, parse_args, report


def test_groups_cover_every_assignment():
    for routing in ("balanced", "uniform"):
        offs = group_offsets(routing, 64, 4, 8, "cpu")
        assert offs.dtype == torch.int32 and offs.shape == (8,) and int(offs[-1]) == 64 * 4
        assert bool((torch.diff(offs) >= 0).all())
    assert torch.equal(torch.diff(group_offsets("balanced", 64, 4, 8, "cpu"), prepend=torch.zeros(1, dtype=torch.int32)),
                       torch.full((8,), 32, dtype=torch.int32))


def _loop(a, b, offs):
    """The grouped GEMM as a loop over the groups: M-grouped ([A, K] x [G, K, N]) or K-grouped ([P, A] x [A, Q])."""
    ends = [0] + offs.tolist()
    if b.dim() == 3:
        return torch.cat([a[s:e].double() @ b[g].double() for g, (s, e) in enumerate(zip(ends, ends[1:]))])
    return torch.stack([a[:, s:e].double() @ b[s:e].double() for s, e in zip(ends, ends[1:])])


def test_call_forms_are_the_layers_gemms():
    T, k, E, H, Fd = 8, 2, 4, 16, 8
    t = {n: v.float() for n, v in operands(T, k, E, H, Fd, "cpu").items()}
    offs = group_offsets("uniform", T, k, E, "cpu")
    names = [g[0] for g in gemms(t)]
    assert names == ["fwd fc1", "fwd fc2", "dgrad fc2", "dgrad fc1", "wgrad fc2", "wgrad fc1"]
    A = T * k
    shapes = {"fwd fc1": (A, 2 * Fd), "fwd fc2": (A, H), "dgrad fc2": (A, Fd), "dgrad fc1": (A, H),
              "wgrad fc2": (E, H, Fd), "wgrad fc1": (E, 2 * Fd, H)}
    for name, (a, b), ours in gemms(t):
        out = _loop(a, b, offs)
        assert tuple(out.shape) == shapes[name], name
        assert flops_of(a, b) == 2 * A * a.shape[1 if b.dim() == 3 else 0] * b.shape[-1], name
        if ours is not None:  # the weight gradient's operands, untransposed: a^T b per group
            assert torch.allclose(_loop(ours[0].t(), ours[1], offs), out), name


def test_report_names_the_best_kernel():
    args = parse_args(["--tokens", "64", "--routings", "uniform"])
    rows = []
    for name in ("fwd fc1", "fwd fc2", "dgrad fc2", "dgrad fc1", "wgrad fc2", "wgrad fc1"):
        rows.append(dict(tokens=64, routing="uniform", gemm=name, kernel="aten", gpu_ms=2.0, host_us=30.0,
                         tflops_per_s=100.0, rel_diff=0.0))
        rows.append(dict(tokens=64, routing="-", gemm=name, kernel="dense", gpu_ms=1.0, host_us=10.0,
                         tflops_per_s=200.0, rel_diff=None))
    rows.append(dict(tokens=64, routing="uniform", gemm="wgrad fc1", kernel="triton 128x128x64 w8 s3", gpu_ms=1.6,
                     host_us=40.0, tflops_per_s=125.0, rel_diff=1e-3))
    text = report(args, rows, ["- note"])
    best = [ln for ln in text.splitlines() if ln.startswith("| 64 | uniform | wgrad fc1 |")][0]
    assert "triton 128x128x64 w8 s3 | 1.600 | 125 | 1.25 |" in best, best
    assert "| 64 | uniform | fwd fc1 | 1.000 | 2.000 | 100 | aten | 2.000 | 100 | 1.00 |" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="what it does without a GPU")
def test_without_a_gpu_it_says_so(capsys):
    assert main(["--tokens", "64"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_cutlass_kernels_are_an_option():
    assert parse_args([]).cutlass is False and parse_args(["--cutlass"]).cutlass is True
