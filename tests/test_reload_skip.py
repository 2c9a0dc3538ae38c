"""CPU test of backend cuda's bookkeeping for the backward reload and prefetch (cuda_function.start_fetch,
prefetch_after_backward, pool.SlotBanks): the pool counts its fills on the host; a backward leaves the reload out
only when its bank still holds its replicas, never after a fetch was captured in a CUDA graph, and never with
the pool's reload_always (benchmarks); with two banks, the end of a backward refills the bank it releases for the backward after the
next. A stand-in pool records the fetches and what each bank holds (the copies themselves run in
tests/test_cuda_backend_cpu.py over gloo and on the GPU in tests/test_cuda_backend_gpu.py)."""

import contextlib
import random
import types

import pytest

import torch

from topoep.runtime import cuda_function as cf
from topoep.runtime.pool import SlotBanks


class _Pool(SlotBanks):
    async_fetch = False

    def __init__(self, banks=1):
        self.init_banks(banks)
        self.log = []
        self.content = [None] * banks  # the layer whose replicas each bank holds

    def fetch(self, se, W1, W2, e_loc, bank=0, relay=None):
        self.log.append(int(se[0, 0]))
        self.content[bank] = int(se[0, 0])

    def publish(self):
        raise AssertionError("a CPU pool never has a prefetch in flight")


def _call(pool, tag, se=None, grad=True):
    plan = types.SimpleNamespace(slot_expert=torch.full((1, 1), tag) if se is None else se)
    return cf.CudaLayerCall(plan=plan, workspace=None, pool=pool, chunks=[], num_tokens=0, top_k=1,
                            experts_per_rank=1, grad=grad)


STACKED = torch.zeros(1, 1, 1)  # a layer's stacked expert weights, as keep_for_prefetch gets them (stack_experts)


def _run(pool, script):
    """"fwd": a layer's forward fetch (and, as the autograd function does, the call is kept for a prefetch);
    "bwd": its backward: the reload, the slots used (they must hold the layer's replicas), then the prefetch."""
    calls = {}
    for step, tag in script:
        if step == "fwd":
            calls[tag] = _call(pool, tag)
        call = calls[tag]
        cf.start_fetch(call, None, None, reload=step == "bwd")
        assert pool.content[call.bank] == tag, (step, tag, pool.content)
        if step == "fwd":
            cf.keep_for_prefetch(call, (STACKED,), (STACKED,))
        else:
            cf.prefetch_after_backward(call)
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


def test_reload_always():
    pool = _Pool()
    pool.reload_always = True
    assert _run(pool, [("fwd", 1), ("bwd", 1)]) == [1, 1]


def test_two_banks_prefetch_every_reload_of_a_model_away():
    pool = _Pool(banks=2)
    fwd = [("fwd", i) for i in range(1, 6)]
    bwd = [("bwd", i) for i in range(5, 0, -1)]
    # 5 layers: fills 1-5 alternate banks; 5 and 4 find their replicas; the end of 5's backward refills its bank
    # with 3's replicas, 4's with 2's, 3's with 1's
    assert _run(pool, fwd + bwd) == [1, 2, 3, 4, 5, 3, 2, 1]
    assert (pool.fills, pool.reloads_skipped, pool.prefetches) == (8, 5, 3)
    one = _Pool(banks=1)
    assert _run(one, fwd + bwd) == [1, 2, 3, 4, 5, 4, 3, 2, 1] and one.reloads_skipped == 1


def test_two_banks_never_use_stale_slots_in_any_order():
    """Random interleavings of forwards and backwards (micro-batches overlapping as in 1F1B, backwards out of the
    forward order, recomputed forwards): every backward computes with a bank that holds its own replicas (the
    check in _run), with one bank or two, and each reload left out is one fetch less."""
    rng = random.Random(0)
    for trial in range(300):
        banks = 1 + trial % 2
        pool = _Pool(banks=banks)
        script, alive, nxt = [], [], 0
        for _ in range(rng.randrange(2, 24)):
            if alive and (rng.random() < 0.5 or nxt >= 12):
                # usually the latest forward's backward (autograd's order), sometimes another one
                tag = alive[-1] if rng.random() < 0.7 else rng.choice(alive)
                alive.remove(tag)
                script.append(("bwd", tag))
            else:
                script.append(("fwd", nxt))
                alive.append(nxt)
                nxt += 1
        log = _run(pool, script)
        assert len(log) == pool.fills == len(script) - pool.reloads_skipped + pool.prefetches
        if banks == 1:
            assert pool.prefetches == 0


def test_prefetch_stays_off_in_graphs_and_with_reload_always(monkeypatch):
    script = [("fwd", i) for i in range(1, 5)] + [("bwd", i) for i in range(4, 0, -1)]
    pool = _Pool(banks=2)
    pool.graphed = True
    assert _run(pool, script) == [1, 2, 3, 4, 4, 3, 2, 1] and pool.prefetches == 0 and pool.reloads_skipped == 0
    pool = _Pool(banks=2)
    pool.reload_always = True
    assert _run(pool, script) == [1, 2, 3, 4, 4, 3, 2, 1] and pool.prefetches == 0


def test_a_pool_has_one_or_two_banks():
    with pytest.raises(ValueError, match="1 or 2 banks"):
        _Pool(banks=3)


def test_the_pending_list_is_bounded_and_skips_calls_without_grad(monkeypatch):
    monkeypatch.setattr(cf, "PENDING_MAX", 3)
    pool = _Pool(banks=2)
    script = [("fwd", i) for i in range(1, 6)] + [("bwd", i) for i in range(5, 0, -1)]
    # only 3, 4, 5 are kept: 5's backward prefetches 3; 2 and 1 (pushed out) reload
    assert _run(pool, script) == [1, 2, 3, 4, 5, 3, 2, 1]
    assert (pool.reloads_skipped, pool.prefetches, pool.pending) == (3, 1, [])
    pool = _Pool(banks=2)
    cf.keep_for_prefetch(_call(pool, 7, grad=False), None, None)  # made with grad mode off: no backward comes
    assert pool.pending == []


class _FakeStream:
    def __init__(self, name, log):
        self.name, self.log = name, log

    def wait_stream(self, other):
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, ev):
        self.log.append(("wait_event", self.name, ev.tag))


class _SE:
    """A slot table that says it is on a GPU (the prefetch's side-stream path), holding one tag."""
    is_cuda, device = True, "cuda:0"

    def __init__(self, tag, log):
        self.tag, self.log = tag, log

    def __getitem__(self, i):
        return self.tag

    def record_stream(self, stream):
        self.log.append(("record_stream", stream.name))


class _W(_SE):
    """A stacked weight (only its record_stream is used; 3-D, so stack_experts takes it as it is)."""

    def __init__(self, log):
        super().__init__(None, log)

    def dim(self):
        return 3


def test_the_side_stream_prefetch_is_waited_for_and_published(monkeypatch):
    """The GPU path of the prefetch with stand-in streams and events: the prefetched call's reload is left out and
    hands the prefetch's event to its dispatch; a fill into a bank that a prefetch is still writing waits for it and
    publishes it (a barrier) first; nothing else publishes."""
    log, events = [], []
    streams = {}

    def stream(name):
        return streams.setdefault(name, _FakeStream(name, log))

    class _Event:
        def __init__(self):
            self.tag = len(events)
            events.append(self)

        def record(self, s):
            log.append(("record", s.name, self.tag))

    monkeypatch.setattr(cf, "side_stream", lambda dev, role="side": stream(role))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: stream("main"))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)

    class _AsyncPool(_Pool):
        async_fetch = True

        def publish(self):
            log.append(("publish",))

    pool = _AsyncPool(banks=2)
    calls = {t: _call(pool, t, se=_SE(t, log)) for t in (1, 2, 3, 4)}
    for t in (1, 2, 3, 4):
        cf.start_fetch(calls[t], None, None)
        cf.keep_for_prefetch(calls[t], (_W(log),), (_W(log),))
    assert [c.bank for c in calls.values()] == [0, 1, 0, 1]
    log.clear()
    # layer 4's backward: its replicas are in place; its end refills bank 1 with layer 2's on the prefetch stream
    assert cf.start_fetch(calls[4], None, None, reload=True) is None
    cf.prefetch_after_backward(calls[4])
    assert log == [("wait_stream", "prefetch", "main")] + [("record_stream", "prefetch")] * 3 + [("record", "prefetch", 0)]
    assert pool.unpublished == [None, events[0]] and calls[2].prefetched is events[0] and pool.content == [3, 2]
    # layer 3 (bank 0, in place); then layer 2's reload is left out and returns the prefetch's event
    assert cf.start_fetch(calls[3], None, None, reload=True) is None
    assert cf.start_fetch(calls[2], None, None, reload=True) is events[0]
    assert pool.unpublished == [None, None] and calls[2].prefetched is None
    # a prefetch that nobody consumed: the next fill into its bank waits for it and publishes it first
    calls[1].weights = ((_W(log),), (_W(log),))
    pool.pending = [calls[1], calls[3], calls[4]]  # as if 4's backward came again with 1 and 3 pending
    calls[4].bank = calls[1].bank = 0
    pool.holds[0] = -1
    cf.prefetch_after_backward(calls[4])  # 1's replicas into bank 0
    assert pool.unpublished[0] is events[1]
    log.clear()
    new = _call(pool, 5, se=_SE(5, log))
    pool.last = 1  # the next forward fill goes to bank 0
    cf.start_fetch(new, None, None)
    assert log[:2] == [("wait_event", "main", 1), ("publish",)] and pool.unpublished == [None, None]
    assert pool.content[0] == 5 and pool.holds[0] == new.fill


def test_a_capture_cannot_wait_for_a_prefetch_in_flight(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    pool = _Pool(banks=2)
    pool.unpublished[0] = object()
    with pytest.raises(RuntimeError, match="capture with prefetch=False"):
        cf._fill(_call(pool, 1), 0)


def test_a_kept_call_holds_the_experts_weights_not_a_stacked_copy(monkeypatch):
    """keep_for_prefetch keeps the per-expert weights as the layer passed them (megatron's parameters: no stacked copy
    is kept for a forward whose backward may never come); the prefetch stacks them when it runs."""
    pool = _Pool(banks=2)
    w1 = [torch.nn.Parameter(torch.full((4, 2), float(e))) for e in range(2)]
    w2 = [torch.nn.Parameter(torch.full((2, 2), float(e))) for e in range(2)]
    calls = {t: _call(pool, t) for t in (1, 2, 3)}
    for t in (1, 2, 3):
        cf.start_fetch(calls[t], None, None)
        cf.keep_for_prefetch(calls[t], tuple(w1), tuple(w2))
    assert all(a is b for a, b in zip(calls[1].weights[0], w1)) and all(a is b for a, b in zip(calls[1].weights[1], w2))
    fetched = []
    monkeypatch.setattr(cf, "_fetch", lambda call, W1, W2, *rest: fetched.append((call, W1, W2)))
    cf.start_fetch(calls[3], None, None, reload=True)
    cf.prefetch_after_backward(calls[3])  # refills bank 0 with call 1's replicas
    (call, W1, W2), = fetched
    assert call is calls[1] and torch.equal(W1, torch.stack([w.detach() for w in w1]))
    assert torch.equal(W2, torch.stack([w.detach() for w in w2]))
