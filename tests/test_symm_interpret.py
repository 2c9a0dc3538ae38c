"""Backend cuda's copy-by-copy relay kernels (topoep/runtime/symm.py: `_push_slots_async_kernel`,
`_push_grads_async_kernel`, LayerConfig.relay_schedule "async") run on the CPU in Triton's interpreter, one process per
rank, the ranks' slots, gradient regions and flags in shared memory standing in for symmetric memory: 8 ranks as 2
domains of 4 with hot experts (trees of fanout 1 and 2, chains of 3 and more hops), two fetches in a row (the flags
keep the first fetch's epoch; the second must wait for its own). Every slot receives its expert's weights bit for
bit, and the return leaves in every region and every relay's gradient what the level-by-level return computes
(children added in slot order in fp32, rounded once to bf16; as the interpreter rounds, toward zero). The processes run concurrently, so a relay really waits
for its parent's flags. The kernels on the GPU: tools/gpu_session.sh relay_async."""

import dataclasses
import os

import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (the torch CUDA wheel's) for its interpreter")

from topoep import Topology, solve  # noqa: E402
from topoep.relay import max_level, relay_sources  # noqa: E402

R, RPD, N, E_LOC, NUMEL = 8, 4, 3, 2, 2 * 8192 + 1000  # three chunks, the last one partial
PROGRAMS = 2


def _patch_interpreter():
    """Triton 3.6's interpreter turns a loaded scalar into a one-element array, which numpy 2 will not make an int
    (range(tl.load(count))): take its element."""
    import numpy as np
    import triton.runtime.interpreter as ti

    original = ti._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    ti._patch_lang_tensor = patched


def _rank(me, fanout, plan_tensors, weights, pools, grads, rets, fetch_flags, ret_flags, out, barrier):
    _patch_interpreter()
    from topoep.runtime import symm

    se, src, lvl, levels = plan_tensors
    n_chunks = -(-NUMEL // symm.COPY_CHUNK)
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64)  # noqa: E731
    for epoch, W in enumerate(weights, start=1):  # two fetches, new weights each time
        items, count = symm.async_send_items(se, src, lvl, levels, me)
        main = torch.arange(E_LOC, dtype=torch.int64) * NUMEL * 2 + W[me].data_ptr()
        symm._push_slots_async_kernel[(PROGRAMS,)](
            items, count, se, main, pools[me], ptrs(pools), fetch_flags[me], ptrs(fetch_flags), n_chunks,
            torch.tensor([epoch], dtype=torch.int32), me, E_LOC, N, NUMEL, n_chunks, 0, CHUNK=symm.COPY_CHUNK)
        barrier.wait()  # every rank's pushes are done (the runtime's barrier after a fetch)
        out[me, epoch - 1] = pools[me].clone()
        barrier.wait()  # every rank read its slots before the next fetch writes them (the one before a fetch)
    items, count, children = symm.async_return_tables(se, src, lvl, levels, me, N, fanout)
    symm._push_grads_async_kernel[(PROGRAMS,)](
        items, count, se, src, children, grads[me], rets[me], ptrs(rets), ret_flags[me], ptrs(ret_flags), n_chunks,
        torch.ones(1, dtype=torch.int32), me, N, NUMEL, n_chunks, 0, fanout, CHUNK=symm.COPY_CHUNK)


def _plan(fanout):
    """A slot table with two hot experts (0 and 4) on most ranks of both domains: deep trees."""
    topo = Topology(num_domains=R // RPD, ranks_per_domain=RPD)
    base = solve(torch.ones(R, R * E_LOC, dtype=torch.int64), topo, num_slots=N, policy="static",
                 backend="reference")
    se = torch.full((R, N), -1, dtype=torch.int64)
    for r in range(R):
        hot = [e for e in (0, 4, 9) if e // E_LOC != r]
        se[r, :len(hot[:N])] = torch.tensor(hot[:N])
    se[3, 2] = -1  # an empty slot
    return dataclasses.replace(base, slot_expert=se)


def _to_bf16_truncated(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 as Triton 3.6's interpreter casts (the top 16 bits: rounding toward zero; the GPU rounds to
    nearest even, and its test compares against the level-by-level kernel itself)."""
    return (x.view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def _levels_return(plan, source, level, grads):
    """The level-by-level return's results: every relay's gradient (its own plus its children's, in slot order, fp32,
    one rounding) and the region each slot sends to its parent."""
    se, src, lvl = plan.slot_expert.reshape(-1), source.reshape(-1), level.reshape(-1)
    g = torch.stack([x.reshape(N, NUMEL) for x in grads]).reshape(R * N, NUMEL).clone()
    for lv in range(int(lvl.max()), 0, -1):
        for k in range(R * N):
            if int(lvl[k]) != lv or int(se[k]) < 0:
                continue
            kids = [c for c in range(R * N) if int(se[c]) == int(se[k]) and int(src[c]) == k // N and int(se[c]) >= 0]
            if kids:
                acc = g[k].float()
                for c in kids:
                    acc = acc + g[c].float()
                g[k] = _to_bf16_truncated(acc)
    return g  # row k: what slot k holds after the return, and what it sent to its parent


@pytest.mark.parametrize("fanout", [1, 2])
def test_async_relay_kernels_in_the_interpreter(fanout, monkeypatch):
    import torch.multiprocessing as mp

    plan = _plan(fanout)
    source, level = relay_sources(plan, fanout)
    assert int(level.max()) >= 3  # chains of relays
    se, src, lvl = (t.reshape(-1).contiguous() for t in (plan.slot_expert, source, level))
    levels = max_level(plan.topology, fanout)
    gen = torch.Generator().manual_seed(fanout)
    weights = [[torch.randn(E_LOC, NUMEL, generator=gen).to(torch.bfloat16).share_memory_() for _ in range(R)]
               for _ in range(2)]
    pools = [torch.zeros(N, NUMEL, dtype=torch.bfloat16).share_memory_() for _ in range(R)]
    grads = [torch.randn(N, NUMEL, generator=gen).to(torch.bfloat16).share_memory_() for _ in range(R)]
    grads_before = [g.clone() for g in grads]
    rets = [torch.zeros(R * N, NUMEL, dtype=torch.bfloat16).share_memory_() for _ in range(R)]
    n_chunks = -(-NUMEL // 8192)
    fetch_flags = [torch.zeros(N, n_chunks, dtype=torch.int32).share_memory_() for _ in range(R)]
    ret_flags = [torch.zeros(R * N, n_chunks, dtype=torch.int32).share_memory_() for _ in range(R)]
    out = torch.zeros(R, 2, N, NUMEL, dtype=torch.bfloat16).share_memory_()
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the children build their kernels for the interpreter
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(R)
    procs = [ctx.Process(target=_rank, args=(me, fanout, (se, src, lvl, levels), weights, pools, grads, rets,
                                             fetch_flags, ret_flags, out, barrier)) for me in range(R)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
    assert [p.exitcode for p in procs] == [0] * R, "a rank failed or hung"
    # the fetches: every slot holds its expert's weights of that fetch
    for f in range(2):
        for r in range(R):
            for j in range(N):
                e = int(plan.slot_expert[r, j])
                if e >= 0:
                    assert torch.equal(out[r, f, j], weights[f][e // E_LOC][e % E_LOC]), (f, r, j)
    # the return: the relays' sums in place, and each slot's region at its parent
    want = _levels_return(plan, source, level, grads_before)
    for k in range(R * N):
        r, j = divmod(k, N)
        if int(se[k]) < 0:
            continue
        assert torch.equal(grads[r][j], want[k]), (r, j)
        assert torch.equal(rets[int(src[k])][k], want[k]), (r, j)
    assert all(int(f.max()) == 2 for f, r in zip(fetch_flags, range(R)) if (se[r * N:(r + 1) * N] >= 0).any())
