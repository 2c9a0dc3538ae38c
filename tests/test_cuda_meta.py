"""The metadata graph's output packing (cuda_meta._Packed): every output comes back with its values, dtype and shape,
as a view starting at an ALIGN-byte boundary of one buffer per dtype. (The graph capture itself runs on the GPU:
tests/test_cuda_backend_gpu.py.)"""

import torch

from topoep.runtime.cuda_meta import ALIGN, _Packed


def test_outputs_round_trip_through_one_buffer_per_dtype():
    g = torch.Generator().manual_seed(0)
    outs = (torch.randint(0, 9, (3, 5), generator=g), torch.randn(7, dtype=torch.float64, generator=g),
            torch.tensor(True), torch.randint(0, 9, (0,), generator=g), torch.randint(-4, 4, (11,), generator=g).int(),
            torch.randint(0, 9, (2, 3, 1), generator=g), torch.rand(3, generator=g) > 0.5,
            torch.zeros(1, dtype=torch.int64))
    packed = _Packed(outs)
    assert len(packed.buffers) == 4  # int64, float64, bool, int32
    copies = [b.clone() for b in packed.buffers]
    back = packed.unpack(copies)
    for a, b in zip(outs, back):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    bases = {b.data_ptr() for b in copies}
    for t in back:
        if not t.numel():
            continue
        base = max(p for p in bases if p <= t.data_ptr())
        assert (t.data_ptr() - base) % ALIGN == 0
    back[0][0, 0] += 1  # views of the copies: the packed buffers (the graph's) are untouched
    assert torch.equal(packed.unpack(packed.buffers)[0], outs[0])


def test_metadata_graphs_keep_at_most_max_graphs_keys(monkeypatch):
    """A layer called with ever new token counts keeps at most MAX_GRAPHS graphs: a new key beyond them runs eagerly
    and is counted, taking no graph (its memory pool) for the layer's lifetime."""
    import types

    from topoep.runtime import cuda_meta

    monkeypatch.setattr(cuda_meta, "MAX_GRAPHS", 3)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (no GPU here)
    graphs = cuda_meta.MetadataGraphs()
    calls = []

    def fn(idx):
        calls.append(idx.shape)
        return (idx.shape,)

    for t in range(1, 6):  # first calls of 5 token counts: each runs eagerly; only 3 take a key
        idx = types.SimpleNamespace(shape=(t, 8), device="cuda:0", is_cuda=True)
        assert graphs(fn, idx) == ((t, 8),)
    assert len(calls) == 5 and len(graphs._graphs) == 3 and graphs.eager_beyond == 2
