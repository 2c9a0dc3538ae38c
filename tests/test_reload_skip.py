"""CPU test of backend cuda's bookkeeping for the backward reload (cuda_function.start_fetch): the pool counts its
fills on the host; a backward leaves the reload out only when no other fetch happened since its forward, never
after a fetch was captured in a CUDA graph, and never with TOPOEP_RELOAD_ALWAYS. A stand-in pool records the
fetches (the copies themselves run on the GPU: tests/test_cuda_backend_gpu.py)."""

import types

import pytest

import torch

from topoep.runtime import cuda_function as cf


class _Pool:
    async_fetch = False

    def __init__(self):
        self.fills, self.filled, self.reloads_skipped, self.graphed = 0, None, 0, False
        self.log = []

    def fetch(self, se, W1, W2, e_loc):
        self.log.append(int(se[0, 0]))


def _call(pool, tag):
    plan = types.SimpleNamespace(slot_expert=torch.full((1, 1), tag))
    return cf.CudaLayerCall(plan=plan, workspace=None, pool=pool, chunks=[], num_tokens=0, top_k=1,
                            experts_per_rank=1)


def _run(pool, script):
    calls = {}
    for step, tag in script:  # "fwd": a layer's forward fetch; "bwd": its backward reload
        if step == "fwd":
            calls[tag] = _call(pool, tag)
        cf.start_fetch(calls[tag], None, None, reload=step == "bwd")
    return pool.log


def test_the_reload_is_left_out_only_when_the_slots_still_hold_the_replicas():
    pool = _Pool()
    # two layers, then backward in reverse order; then a recomputed forward of layer 1 right before its backward
    log = _run(pool, [("fwd", 1), ("fwd", 2), ("bwd", 2), ("bwd", 1), ("fwd", 3), ("bwd", 3)])
    assert log == [1, 2, 1, 3]  # layer 2's reload left out (nothing fetched since its forward), layer 1's done
    assert pool.reloads_skipped == 2 and pool.fills == 4


def test_interleaved_micro_batches_reload():
    pool = _Pool()  # 1F1B-like: the forward of micro-batch b comes before the backward of micro-batch a
    log = _run(pool, [("fwd", 1), ("fwd", 2), ("bwd", 1), ("bwd", 2)])
    assert log == [1, 2, 1, 2] and pool.reloads_skipped == 0


def test_a_pool_seen_in_a_graph_capture_always_reloads(monkeypatch):
    pool = _Pool()
    pool.graphed = True  # what start_fetch sets when it runs under torch.cuda graph capture
    assert _run(pool, [("fwd", 1), ("bwd", 1)]) == [1, 1] and pool.reloads_skipped == 0


def test_reload_always_switch(monkeypatch):
    monkeypatch.setattr(cf, "RELOAD_ALWAYS", True)
    pool = _Pool()
    assert _run(pool, [("fwd", 1), ("bwd", 1)]) == [1, 1]


def test_switches_take_0_or_1(monkeypatch):
    monkeypatch.setenv("TOPOEP_RELOAD_ALWAYS", "yes")
    with pytest.raises(ValueError, match="TOPOEP_RELOAD_ALWAYS='yes': set it to 0 or 1"):
        cf.env_switch("TOPOEP_RELOAD_ALWAYS", False)
    monkeypatch.setenv("TOPOEP_RELOAD_ALWAYS", "1")
    assert cf.env_switch("TOPOEP_RELOAD_ALWAYS", False)
    monkeypatch.delenv("TOPOEP_RELOAD_ALWAYS")
    assert not cf.env_switch("TOPOEP_RELOAD_ALWAYS", False) and cf.env_switch("TOPOEP_RELOAD_ALWAYS", True)
