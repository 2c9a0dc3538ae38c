"""Unit tests (CPU) of the grouped-expert helpers: runs of weights that are consecutive slices of one buffer
(one grouped GEMM per run on the GPU) and the grouped SwiGLU against a per-group loop."""

import torch

from topoep.runtime.experts import _runs, stacked_view, swiglu_forward, weight_runs


def spans(runs):
    return [(g0, g1, tuple(w1.shape), tuple(w2.shape)) for g0, g1, w1, w2 in runs]


def test_runs_follow_buffers_in_one_pass():
    main1, main2 = torch.randn(4, 6, 3), torch.randn(4, 3, 3)
    pool1, pool2 = torch.randn(2, 6, 3), torch.randn(2, 3, 3)
    ws1, ws2 = list(main1.unbind(0)) + list(pool1.unbind(0)), list(main2.unbind(0)) + list(pool2.unbind(0))
    assert spans(_runs(ws1, ws2)) == [(0, 4, (4, 6, 3), (4, 3, 3)), (4, 6, (2, 6, 3), (2, 3, 3))]
    runs = weight_runs(ws1, ws2)
    assert torch.equal(runs[0][2], main1) and torch.equal(runs[1][3], pool2)  # views, same values
    assert runs[0][2].data_ptr() == main1.data_ptr()


def test_runs_split_where_either_list_breaks():
    a1, a2 = torch.randn(5, 4, 2), torch.randn(5, 2, 2)
    ws1 = list(a1.unbind(0))
    ws2 = list(a2.unbind(0))
    ws2[2] = torch.randn(2, 2)  # a separate allocation in the second list only
    assert [(g0, g1) for g0, g1, *_ in _runs(ws1, ws2)] == [(0, 2), (2, 3), (3, 5)]
    ws1[4] = a1[4].t()  # a non-contiguous view: alone
    assert [(g0, g1) for g0, g1, *_ in _runs(ws1, ws2)] == [(0, 2), (2, 3), (3, 4), (4, 5)]


def test_stacked_view():
    a = torch.randn(3, 2, 2)
    assert torch.equal(stacked_view(list(a.unbind(0))), a)
    assert stacked_view([a[0], a[2]]) is None  # not adjacent
    assert stacked_view([torch.randn(2, 2), torch.randn(2, 2)]) is None
    assert stacked_view([]) is None


def test_swiglu_forward_matches_per_group_loop_with_given_runs():
    torch.manual_seed(0)
    H, F, sizes = 6, 4, [3, 0, 2, 5]
    fc1 = list(torch.randn(4, 2 * F, H).unbind(0))
    fc2 = list(torch.randn(4, H, F).unbind(0))
    x = torch.randn(sum(sizes), H)
    y, h = swiglu_forward(x, sizes, fc1, fc2, weight_runs(fc1, fc2))
    r = 0
    for g, n in enumerate(sizes):
        hg = x[r:r + n] @ fc1[g].t()
        assert torch.allclose(h[r:r + n], hg)
        assert torch.allclose(y[r:r + n], (torch.nn.functional.silu(hg[:, :F]) * hg[:, F:]) @ fc2[g].t(), atol=1e-5)
        r += n


def test_grouped_copies_only_where_the_grouped_gemm_applies():
    """On the CPU (no grouped GEMM) the per-expert loop is the only path: no copies are made; the GPU side
    (separate tensors stacked, the layer bitwise unchanged) is tests/test_runtime_gpu.py."""
    from topoep.runtime.experts import grouped_copies

    ws1 = [torch.randn(16, 8, dtype=torch.bfloat16) for _ in range(3)]
    ws2 = [torch.randn(8, 8, dtype=torch.bfloat16) for _ in range(3)]
    assert grouped_copies(ws1, ws2, torch.randn(4, 8, dtype=torch.bfloat16)) is None
