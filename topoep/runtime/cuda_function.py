"""Backend `cuda`: the balanced MoE layer with no host synchronisation (paper 3.2-3.3 on the GPU).

Per call, every size the host needs is fixed by the shapes (tokens T, top-k, the workspace capacity),
never by the routing:
    counts      count_keys + a symmetric all-gather (omega), the GPU planner, the guard (torch.where)
    layout      instance of every assignment, send order and counts C[s, d, g] read off the plan's
                route (layout.send_layout: no sort, no second exchange), receive positions
                (layout.receive_positions): all device tensors; the plan statistics on a side stream
    fetch       each main rank pushes its replicated experts into the peers' slots (symm.py)
    dispatch    one kernel stores every row straight into its destination's receive buffer, already
                grouped by expert; a barrier publishes the rows
    experts     torch._grouped_mm over the receive regions with device offsets (rows past the last offset are
                never read); rows that did not fit a region (spill.py) by the spill kernels, from their sources'
                staging
    combine     one kernel stores every result row into its source's buffer at its assignment index; one
                more (weighting.py) sums each token's k rows with its top-k weights
A rank's own rows stay in place (the peer workspace, one chunk: `_in_place`): the dispatch writes them into the
tensor kept for backward, the copy out of the receive buffers and the combine leave them out, and the weighting reads
their results where the GEMM wrote them (CudaChunk.inv; weighting.py's `local`); the same in backward.
With two chunks (LayerConfig.num_chunks=2) the tokens are split in two halves, each with its own route (the plan's route row
split at the boundary), layout and region of the receive buffers; on a GPU with the peer transport, dispatch and
combine then run on a comm stream, the second half's dispatch beside the first half's GEMMs and the first half's
combine beside the second's (paper 3.3's two-chunk pipeline; tested on one GPU with the ranks sharing it, its
overlap not yet measured across GPUs).
Backward runs the same steps for the token gradients (the dispatch scales each row by its top-k weight as it
sends it; the weights' gradient is one kernel over the kept expert outputs), computes every data gradient before the weight
gradients, and returns the replica weight gradients to their main ranks (summed there in source, slot
order). Memory: the received rows and the pre-activations kept for backward fill regions of a fixed size: the
capacity (`capacity_factor` x T x k rows per region and chunk, which the planner's capacity step fits the plan to),
or without one the worst case, R x T x k rows; nothing of the rows that spill is kept (backward recomputes them).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from topoep.plan import Plan
from topoep.runtime.symm import swiglu_act, swiglu_act_grad
from topoep.runtime.timing import PhaseTimer, phase
from topoep.runtime.experts import _act_grads, swiglu_act_reference
from topoep.runtime.weighting import (local_rows_reference, row_dots, row_dots_reference, sum_choices,
                                      sum_choices_reference, weighted_sum, weighted_sum_reference)


@dataclass
class CudaChunk:
    """One chunk of a call's tokens: its send and receive layout (device tensors), in its own region of the
    receive buffers. order holds assignment indices within the chunk; `first` turns them into the call's."""

    order: torch.Tensor  # int64[A_c]: the chunk's assignment index of send row i
    dest: torch.Tensor  # int64[A_c]: destination rank of send row i
    pos: torch.Tensor  # int64[A_c]: its row in the destination's region
    is_slot: torch.Tensor  # bool[A_c]: main buffer or slot buffer
    offs_main: torch.Tensor  # int32[E_loc]: end row of each main expert's group (grouped GEMM offsets)
    offs_slot: torch.Tensor  # int32[N]: end row of each slot's group
    n_main: torch.Tensor  # int64[1]: rows received for the main experts (at most the region's rows)
    n_slot: torch.Tensor  # int64[1]: rows received for the slots (likewise)
    inv: torch.Tensor  # int64[T k] or empty: each own assignment's row in the region (moe._cuda_layout), in place
    spill: object = None  # spill.SpillWork: the rows received beyond the region
    first: int = 0  # the call's index of the chunk's first assignment (its first token x top_k)
    base: int = 0  # the region's first row in the receive buffers
    cap: int | None = None  # the region's rows (None: to the buffers' end)


@dataclass
class CudaLayerCall:
    """One call's device-side layout (all tensors on the GPU) and the shared buffers."""

    plan: Plan
    workspace: object  # symm.SymmWorkspace
    pool: object | None  # symm.SymmReplicaPool, None without slots
    chunks: list  # [CudaChunk]: one, or two (tokens split in halves)
    num_tokens: int
    top_k: int
    experts_per_rank: int
    timer: PhaseTimer | None = None
    fill: int = -1  # which fill of the pool holds this call's replicas (start_fetch)
    bank: int = 0  # which bank of the pool's slots (pool.SlotBanks)
    prefetched: object = None  # event of a prefetch of this call's replicas on a side stream (prefetch_after_backward)
    weights: tuple | None = None  # (W1, W2) stacked, kept for a prefetch (two banks only)
    grad: bool = True  # grad mode was on at the call, so its backward may come (the pool keeps it for a prefetch)
    combine_side_stream: bool = False  # LayerConfig.combine_side_stream
    fetch_overlap: bool = False  # LayerConfig.fetch_overlap: fetch and reload beside the dispatch and main GEMMs
    slot_ready: object = None  # fetch_overlap: event of the published fetch (or reload) that the slot GEMMs wait for
    relay: object = None  # topoep.relay.RelayTrees: replica fetches and gradient returns down / up relay trees
    deepep_ids: torch.Tensor | None = None  # transport deepep: int64[T, k] DeepEP expert ids (deepep.deepep_expert_ids)


def _send(ch: CudaChunk) -> tuple[torch.Tensor, torch.Tensor]:
    """(the chunk's send order as the call's assignment indices, its receive positions in the buffers)."""
    return ch.order + ch.first if ch.first else ch.order, ch.pos + ch.base if ch.base else ch.pos


def _region_end(ch: CudaChunk) -> int | None:
    """The end of the chunk's region in the receive buffers: a row at or beyond it spills."""
    return None if ch.cap is None else ch.base + ch.cap


def _region(buf: torch.Tensor | None, ch: CudaChunk) -> torch.Tensor | None:
    return None if buf is None else buf[ch.base: None if ch.cap is None else ch.base + ch.cap]


def stack_experts(ws: list[torch.Tensor]) -> torch.Tensor:
    """[E_loc, ...] over the experts' weights: the stacked parameter itself when one 3-D tensor is given
    (our own layer), a view when they are consecutive slices of one buffer, else a copy (megatron's
    per-expert parameters)."""
    from topoep.runtime.experts import stacked_view

    if len(ws) == 1 and ws[0].dim() == 3:
        return ws[0]
    v = stacked_view(ws)
    return v if v is not None else torch.stack([w.detach() for w in ws])


# Grouped SwiGLU over worst-case-sized row buffers: x [cap, H] holds the groups' rows first (n = offs[-1]
# of them, a device value); rows past n are never computed on (the activations are Triton kernels that
# read n on the device) and never read. w1 [G, 2F, H], w2 [G, H, F].
# References: experts.swiglu_act_reference, experts._act_grads.

# On the CPU (transport "gloo", the test harness) the Triton kernels' torch references stand in for them.

def _act(h, n):
    return swiglu_act(h, n) if h.is_cuda else swiglu_act_reference(h)


def _act_grad(grad_act, h, n):
    """(gradient of h, the activation): one pass over h on the GPU."""
    return swiglu_act_grad(grad_act, h, n) if h.is_cuda else (_act_grads(grad_act, h), swiglu_act_reference(h))


def _weighted_sum(rows, w, save, local=None):
    if rows.is_cuda:
        return weighted_sum(rows, w, save=save, local=local)
    if save is not None:
        save.copy_(local_rows_reference(rows, *w.shape, local))
    return weighted_sum_reference(rows, w, local)


def _row_dots(g, rows, k):
    return row_dots(g, rows, k) if g.is_cuda else row_dots_reference(g, rows, k)


def _sum_choices(rows, k, T, local=None):
    return sum_choices(rows, k, T, local) if rows.is_cuda else sum_choices_reference(rows, k, T, local)


# The grouped GEMM of every expert computation below, with torch._grouped_mm's contract (a, b, offs=...): a module
# attribute, so that a benchmark can time the layer on another kernel of the same contract
# (bench/layer_limit.py --cutlass swaps in topoep_research.cutlass_wgrad.as_grouped_mm).
GROUPED_MM = getattr(torch, "_grouped_mm", None)


def grouped_swiglu(x, w1, w2, offs, n):
    h = GROUPED_MM(x, w1.transpose(1, 2), offs=offs)
    return GROUPED_MM(_act(h, n), w2.transpose(1, 2), offs=offs), h


def grouped_swiglu_dgrad(gy, h, w1, w2, offs, n):
    """(input gradient, gradient of h, the activation: the weight gradient's input, made in the same pass)."""
    gh, act = _act_grad(GROUPED_MM(gy, w2, offs=offs), h, n)
    return GROUPED_MM(gh, w1, offs=offs), gh, act


def grouped_swiglu_wgrad(x, act, gy, gh, offs):
    """The weight gradients of every group, (g1 [G, 2F, H], g2 [G, H, F]), written once by the GEMMs (no
    zero fill, no accumulation pass); a group with no rows gets zeros. act: the activation (grouped_swiglu_dgrad's)."""
    return GROUPED_MM(gh.t(), x, offs=offs), GROUPED_MM(gy.t(), act, offs=offs)


_SIDE_STREAMS: dict = {}
# roles whose streams have CUDA's high priority: their kernels' blocks are scheduled before the other streams'
HIGH_PRIORITY_ROLES = ("fetch",)


def side_stream(device, role: str = "side") -> torch.cuda.Stream:
    """A stream of the layer's on a device, created once per role: "side" (gradient push, plan statistics), "comm"
    (dispatch and combine beside the GEMMs), "prefetch" (the backward prefetch, which nothing on the other streams
    waits for but the prefetched layer) or "fetch" (the forward fetch of LayerConfig.fetch_overlap, at high
    priority: its pushes go before the dispatch's rows where they share SMs and links)."""
    key = (torch.device(device), role)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(key[0], priority=-1 if role in HIGH_PRIORITY_ROLES else 0)
    return _SIDE_STREAMS[key]


def _fill(call: "CudaLayerCall", bank: int) -> None:
    """Host bookkeeping of a fetch of call's replicas into `bank`; first, a prefetch into that bank that no
    barrier has published yet is waited for and published (its pushes must not race with this fill's)."""
    pool = call.pool
    ev = pool.unpublished[bank]
    if ev is not None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "a replica prefetch (LayerConfig.prefetch) into the slots this captured fetch writes is still in "
                "flight: a CUDA graph cannot wait for it. Run the backward of every layer before capturing a forward, "
                "or capture with prefetch=False")
        torch.cuda.current_stream(call.plan.slot_expert.device).wait_event(ev)
        pool.publish()
        pool.unpublished[bank] = None
    pool.fills += 1
    call.fill, call.bank = pool.fills, bank
    pool.holds[bank] = call.fill


def start_fetch(call: "CudaLayerCall", W1: torch.Tensor, W2: torch.Tensor, reload: bool = False):
    """Fill the replica slots for this call, here on the layer's stream (the a2a pool's all-to-alls must keep their
    order with the dispatch's), except with `call.fetch_overlap` on the peer-pointer pool: then the fetch (or the
    backward reload) runs on the high-priority "fetch" stream beside the dispatch and the main experts' GEMMs and
    ends with its own barrier of the group, which publishes the slots (`_fetch(publish=True)`); its event goes to
    `call.slot_ready`, which the slot GEMMs wait for (None otherwise). Returns None, or, in backward, the event of a
    prefetch of this call's replicas that the dispatch waits for before its publishing barrier. Without a pool
    (no slots, or policy static) there is nothing to fetch.

    The pool remembers which fill each bank of slots holds (`pool.SlotBanks`: host counters; every rank issues
    the same calls in the same order, so every rank decides alike). A forward fills the bank it did not fill last
    (one bank: always the same). A backward `reload` is left out when the call's bank still holds its replicas:
    no fetch into that bank happened since its forward (the last MoE layer of a model, or a lone layer; with two
    banks the last two), or a prefetch at the end of an earlier backward refilled it (then the prefetch's event is
    returned for the dispatch to wait for). Nothing else writes the slots (the gradients return from separate
    buffers). A pool whose fetch was ever captured in a CUDA graph always reloads (a replay refills the slots
    without the host knowing); a pool with `reload_always` (benchmarks of a single layer) always reloads."""
    pool, se, tm = call.pool, call.plan.slot_expert, call.timer
    call.slot_ready = None
    if pool is None:
        return None
    # a fetch captured in a CUDA graph refills the slots at every replay, unseen by these counters: once the
    # pool has been captured, nothing is ever left out again
    if se.is_cuda and torch.cuda.is_current_stream_capturing():
        pool.graphed = True
    if reload and not pool.reload_always and not pool.graphed and pool.holds[call.bank] == call.fill:
        pool.reloads_skipped += 1
        ev, call.prefetched = call.prefetched, None
        if ev is not None:  # the dispatch waits for it before its closing barrier, which publishes it
            pool.unpublished[call.bank] = None
        return ev
    if reload:
        _fill(call, call.bank)
    else:
        pool.last = (pool.last + 1) % pool.banks
        _fill(call, pool.last)
    call.prefetched = None
    if call.fetch_overlap:
        call.slot_ready = _fetch(call, W1, W2, "fetch", tm, publish=True)
        return None
    return _fetch(call, W1, W2, None, tm)


def _fetch(call: "CudaLayerCall", W1: torch.Tensor, W2: torch.Tensor, role: str | None, tm: PhaseTimer | None,
           publish: bool = False):
    """pool.fetch of call's replicas into call.bank: on the device's stream of `role` after the layer's stream,
    returning the event of its end, where a role is given and the pool allows it (`async_fetch`: the peer-pointer
    pool, whose pushes need no collective of their own) on a GPU without a timer `tm`; otherwise here, in phase
    "fetch" of `tm` (None), for the dispatch's barriers to publish. `publish`: the side stream's fetch ends with the
    pool's barrier of that bank (`publish_fetch`), so the event marks slots that every rank has filled."""
    pool, se = call.pool, call.plan.slot_expert
    if role is None or tm is not None or not getattr(pool, "async_fetch", False) or not se.is_cuda:
        with phase(tm, "fetch", collective=True):
            pool.fetch(se, W1, W2, call.experts_per_rank, call.bank, relay=call.relay)
        return None
    main, stream = torch.cuda.current_stream(se.device), side_stream(se.device, role)
    stream.wait_stream(main)
    for t in (se, W1, W2):  # made on the layer's stream, read there: not reused before the pushes are done
        t.record_stream(stream)
    with torch.cuda.stream(stream):
        pool.fetch(se, W1, W2, call.experts_per_rank, call.bank, relay=call.relay)
        if publish:
            pool.publish_fetch(call.bank)
        done = torch.cuda.Event()
        done.record(stream)
    return done


# forward calls a pool keeps for a prefetch at most: beyond it the oldest is forgotten (a forward whose backward
# never came, say); a count every rank keeps alike, so every rank forgets the same calls
PENDING_MAX = 512


def keep_for_prefetch(call: "CudaLayerCall", w1, w2) -> None:
    """A forward call made with grad mode on: with two banks, kept (with its experts' weights as the layer passed
    them, `stack_experts` applied at the prefetch: a copy of megatron's per-expert weights is never kept here) for
    `prefetch_after_backward`, until its backward comes or PENDING_MAX newer calls push it out. Strong references:
    what a rank decides must never depend on when its garbage collector runs."""
    pool = call.pool
    if pool is None or pool.banks < 2 or not call.grad:
        return
    call.weights = (w1, w2)
    pool.pending.append(call)
    if len(pool.pending) > PENDING_MAX:
        pool.pending.pop(0).weights = None


def prefetch_after_backward(call: "CudaLayerCall") -> None:
    """The end of call's backward (after its gradient return, whose barrier every rank passed after its last
    use of call's bank): call leaves the pool's pending list, and its bank is refilled with the replicas of the call
    two places before it there, whose backward comes after the next one when autograd runs this micro-batch's layers
    in reverse, when that call's forward used this bank and the bank no longer holds them. On the peer-pointer
    pool without a timer the pushes run on a stream of their own beside the next backward, whose bank they do not
    touch; the prefetched call's dispatch waits for them (start_fetch). Otherwise the fetch runs here, on the
    layer's stream. Nothing happens with one bank, after a CUDA-graph capture of a fetch, or with the pool's
    `reload_always`. Other orders stay correct: a call whose bank lost its replicas reloads."""
    pool = call.pool
    if pool is None or pool.banks < 2:
        return
    pending = pool.pending
    at = next((i for i in range(len(pending) - 1, -1, -1) if pending[i] is call), None)
    if at is None:  # not a call this pool keeps (one pushed out, or made with grad mode off)
        return
    del pending[at]
    call.weights = None
    later = pending[at - 2] if at >= 2 else None
    if (later is None or pool.reload_always or pool.graphed or later.bank != call.bank
            or pool.holds[call.bank] == later.fill):
        return
    _fill(later, call.bank)
    pool.prefetches += 1
    # timed with this call's phases; on the prefetch stream after this rank's gradient-return barrier, when every
    # rank is done with the bank
    W1, W2 = (stack_experts(list(ws)) for ws in later.weights)
    later.prefetched = pool.unpublished[later.bank] = _fetch(later, W1, W2, "prefetch", call.timer)


def return_grads(call: "CudaLayerCall", s1: torch.Tensor, s2: torch.Tensor, main_wgrad) -> tuple:
    """The replica weight gradients s1 [N, 2F, H], s2 [N, H, F] go home while `main_wgrad()` computes this
    rank's own weight gradients (g1, g2), which then receive them; returns (g1, g2). With the peer transport
    (`pool.push_grads`) and no timer the pushes run on a side stream beside the main weight-gradient GEMMs;
    otherwise (a timer serialises the phases; the a2a pool's collectives) the return follows them on this stream.
    With relays (call.relay) the slots' gradients go up the relay trees, relays adding their children's into s1, s2
    in place."""
    pool, se, tm, e_loc, relay = call.pool, call.plan.slot_expert, call.timer, call.experts_per_rank, call.relay
    s1, s2 = s1.contiguous(), s2.contiguous()
    if tm is not None or not hasattr(pool, "push_grads"):
        with phase(tm, "experts"):
            g1, g2 = main_wgrad()
        with phase(tm, "grad_return", collective=True):
            pool.return_grads(se, g1, g2, e_loc, src=(s1, s2), relay=relay)
        return g1, g2
    main, side = torch.cuda.current_stream(se.device), side_stream(se.device)
    side.wait_stream(main)  # s1, s2 are made; every rank's previous return was summed before this call
    with torch.cuda.stream(side):
        pool.push_grads(se, s1, s2, e_loc, relay)
    g1, g2 = main_wgrad()
    main.wait_stream(side)  # s1, s2 stay referenced until here: their memory is not reused before the pushes
    pool.reduce_grads(se, g1, g2, e_loc, relay)
    return g1, g2


def _comm(call: "CudaLayerCall", t: torch.Tensor, wanted: bool):
    """The comm stream of the device (created once) when dispatch and combine should run there: `wanted`,
    on a GPU, without a timer (which serialises the phases), with a workspace whose dispatch and combine keep
    no host state between them (the peer-pointer one); else None. Joins the layer's stream first."""
    if not (wanted and t.is_cuda and call.timer is None and getattr(call.workspace, "async_combine", False)):
        return None
    comm = side_stream(t.device, "comm")
    comm.wait_stream(torch.cuda.current_stream(t.device))
    return comm


def _in_place(call: "CudaLayerCall") -> bool:
    """This rank's own rows stay on it in place (never copied through the workspace's buffers): a workspace that
    allows it (the peer-pointer one), one chunk (the weighting then reads one tensor of expert outputs)."""
    return getattr(call.workspace, "in_place", False) and len(call.chunks) == 1 and call.chunks[0].inv.numel() > 0


def _on(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def _record(stream):
    """An event recorded on `stream` now (None for None)."""
    if not stream:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _wait(ev, device) -> None:
    """The device's current stream waits for the event (None: nothing to wait for)."""
    if ev is not None:
        torch.cuda.current_stream(device).wait_event(ev)


class CudaExpertParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, topk_weights: torch.Tensor, call: CudaLayerCall,
                *weights: torch.Tensor) -> torch.Tensor:
        """y [T, H] = sum over the k choices of topk_weights [T, k] times the expert's output (weighting.py).
        With two chunks (and the peer transport, no timer), dispatch and combine run on the comm stream: the
        second chunk's dispatch beside the first chunk's GEMMs, the first chunk's combine beside the second's."""
        n = len(weights) // 2
        T, k = topk_weights.shape
        wq = topk_weights.to(x.dtype).contiguous()  # the weights in the layer's dtype, as a torch layer multiplies
        ws, pool, tm = call.workspace, call.pool, call.timer
        W1, W2 = stack_experts(list(weights[:n])), stack_experts(list(weights[n:]))
        fetched = start_fetch(call, W1, W2)
        slot_ready = call.slot_ready  # fetch_overlap: only the slot GEMMs (and the spill path's) wait for the fetch
        keep_for_prefetch(call, weights[:n], weights[n:])
        slot_w = pool.bank_weights(call.bank) if pool is not None else None
        comm = _comm(call, x, len(call.chunks) > 1)
        in_place = _in_place(call)

        def dispatch(i, ch):
            with _on(comm), phase(tm, "dispatch_combine", collective=True):
                order, pos = _send(ch)
                local = None
                if in_place:  # this rank's own rows go straight into the tensors kept for backward
                    rows_ = _region(ws.recv_main.tensor, ch).shape[0]
                    local = (x.new_empty(rows_, x.shape[1]), x.new_empty(rows_, x.shape[1]) if pool is not None
                             else None, ch.base)
                rm, rs = ws.dispatch(x, order, k, ch.dest, pos, ch.is_slot, join=fetched if i == 0 else None,
                                     region_end=_region_end(ch), stage_base=ch.first,
                                     **({"local": local} if local is not None else {}))
                return _region(rm, ch), _region(rs, ch), _record(comm), local

        def compute(ch, rm, rs, ready, local):
            _wait(ready, x.device)
            with phase(tm, "dispatch_combine"):  # kept for backward: the buffers are reused
                if local is not None:  # the other ranks' rows join this rank's own
                    xm = ws.copy_rows(rm, ch.n_main, local[0], _region(ws.meta_main.tensor, ch))
                    xs = (ws.copy_rows(rs, ch.n_slot, local[1], _region(ws.meta_slot.tensor, ch)) if pool is not None
                          else None)
                else:
                    xm = ws.copy_rows(rm, ch.n_main)
                    xs = ws.copy_rows(rs, ch.n_slot) if pool is not None else None
            with phase(tm, "experts"):
                ym, hm = grouped_swiglu(xm, W1, W2, ch.offs_main, ch.n_main)
                ys = hs = None
                _wait(slot_ready, x.device)
                if pool is not None:
                    ys, hs = grouped_swiglu(xs, *slot_w, ch.offs_slot, ch.n_slot)
                ws.spill(ch.spill, (W1, W2), slot_w)  # rows beyond the regions (none: a launch that finds none)
            return (xm, hm, xs, hs), (ym, ys), _record(comm and torch.cuda.current_stream(x.device))

        def combine(ch, ym, ys, done, rows):
            with _on(comm), phase(tm, "dispatch_combine", collective=True):
                _wait(done, x.device)
                return ws.combine(ym, ys, ch.n_main, ch.n_slot, T * k, copy=False, base=ch.base, out=rows,
                                  **({"skip_local": True} if in_place else {}))

        rows, saved, outputs = None, [], []  # outputs: every chunk's expert outputs, alive until the join
        local_out = None  # in place: (inv, ym, ys), read by the weighting
        if comm is None:  # in turn: each chunk dispatched, computed and combined before the next
            for i, ch in enumerate(call.chunks):
                keep, ys_, done = compute(ch, *dispatch(i, ch))
                rows = combine(ch, *ys_, done, rows)
                saved.append(keep)
                if in_place:
                    local_out = (ch.inv, *ys_)
                del ys_  # combined on this stream: the memory is free for the next chunk (in place: local_out keeps it)
        else:
            received = [dispatch(i, ch) for i, ch in enumerate(call.chunks)]
            for ch, got in zip(call.chunks, received):
                keep, ys_, done = compute(ch, *got)
                rows = combine(ch, *ys_, done, rows)
                saved.append(keep)
                outputs.append(ys_)
            torch.cuda.current_stream(x.device).wait_stream(comm)
        del outputs
        with phase(tm, "dispatch_combine"):
            # the expert outputs stay for the weights' gradient: copied in the same pass as the weighted sum
            kept = rows.new_empty(T * k, rows.shape[1]) if ctx.needs_input_grad[1] else None
            y = _weighted_sum(rows, wq, kept, local_out)
        del local_out
        ctx.call, ctx.num_weights, ctx.w_dtype = call, n, topk_weights.dtype
        ctx.stacked = (W1, W2) if W1.data_ptr() != weights[0].data_ptr() else None  # copies: keep them
        # the backward restages spilled rows' inputs: keep x
        ctx.save_for_backward(wq, kept, x if ws.spills else None, *weights,
                              *(t for keep in saved for t in keep if t is not None))
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        call: CudaLayerCall = ctx.call
        n = ctx.num_weights
        wq, kept, x, *t = ctx.saved_tensors
        weights, saved = t[:2 * n], t[2 * n:]
        T, k = wq.shape
        grad_y = grad_out.contiguous()
        grad_w = _row_dots(grad_y, kept, k).to(ctx.w_dtype) if kept is not None else None
        W1, W2 = ctx.stacked or (stack_experts(list(weights[:n])), stack_experts(list(weights[n:])))
        ws, pool, tm = call.workspace, call.pool, call.timer
        per = 4 if pool is not None else 2
        # reload this layer's replicas unless the slots still hold them (start_fetch)
        fetched = start_fetch(call, W1, W2, reload=True)
        slot_ready = call.slot_ready  # fetch_overlap: only the slot data gradients (and the spill path's) wait for it
        slot_w = pool.bank_weights(call.bank) if pool is not None else None
        # dispatch and combine on the comm stream: with two chunks, or with combine_side_stream (the token
        # gradients go home beside the weight-gradient GEMMs)
        comm = _comm(call, grad_y, len(call.chunks) > 1 or call.combine_side_stream)
        in_place, grad_x, local_grads = _in_place(call), None, None

        def dispatch(i, ch):
            with _on(comm), phase(tm, "dispatch_combine", collective=True):
                # the gradient of each choice's output, w[t, j] grad_y[t], made as the rows are sent
                order, pos = _send(ch)
                gm, gs = ws.dispatch(grad_y, order, k, ch.dest, pos, ch.is_slot, join=fetched if i == 0 else None,
                                     scale=wq.view(-1), region_end=_region_end(ch), stage_base=ch.first, src2=x)
                return _region(gm, ch), _region(gs, ch), _record(comm)

        received = [dispatch(i, ch) for i, ch in enumerate(call.chunks)] if comm is not None else None
        grad_assign, wgrad_inputs, data_grads = None, [], []  # data_grads: alive until the comm stream's join
        for i, ch in enumerate(call.chunks):
            xm, hm, *rest = saved[i * per:(i + 1) * per]
            gm, gs, ready = received[i] if comm is not None else dispatch(i, ch)
            _wait(ready, grad_y.device)
            with phase(tm, "experts"):  # data gradients first: token gradients leave early
                gxm, ghm, am = grouped_swiglu_dgrad(gm, hm, W1, W2, ch.offs_main, ch.n_main)
                gxs = ghs = as_ = None
                _wait(slot_ready, grad_y.device)
                if pool is not None:
                    xs, hs = rest
                    gxs, ghs, as_ = grouped_swiglu_dgrad(gs, hs, *slot_w, ch.offs_slot, ch.n_slot)
                ws.spill(ch.spill, (W1, W2), slot_w, backward=True)
            done = _record(comm and torch.cuda.current_stream(grad_y.device))
            with _on(comm), phase(tm, "dispatch_combine", collective=True):
                _wait(done, grad_y.device)
                grad_assign = ws.combine(gxm, gxs, ch.n_main, ch.n_slot, T * k, copy=False, base=ch.base,
                                         out=grad_assign, **({"skip_local": True} if in_place else {}))
            if in_place:  # this rank's own rows are summed in place, from gxm, gxs
                local_grads = (ch.inv, gxm, gxs)
                if comm is None:  # now, so that their memory is free before the weight gradients
                    with phase(tm, "dispatch_combine"):
                        grad_x, local_grads = _sum_choices(grad_assign, k, T, local_grads), None
            if comm is not None:  # the comm stream reads them: kept until it is joined below
                data_grads.append((gxm, gxs))
            del gxm, gxs
            # gm, gs stay valid for the weight gradients: the next chunk's rows land in another region
            wgrad_inputs.append((xm, am, gm, ghm, ch.offs_main) + (
                (rest[0], as_, gs, ghs, ch.offs_slot) if pool is not None else ()))

        def summed(parts):  # the chunks' weight gradients (one chunk: no addition)
            g1, g2 = parts[0]
            for a, b in parts[1:]:
                g1, g2 = g1.add_(a), g2.add_(b)
            return g1, g2

        E_loc, G = call.experts_per_rank, call.experts_per_rank + (pool.num_slots if pool is not None else 0)

        def main_wgrad():
            g1, g2 = summed([grouped_swiglu_wgrad(*w[:5]) for w in wgrad_inputs])
            for ch in call.chunks:  # the spilled rows of the main experts
                ws.spill_wgrad(ch.spill, (W1, W2), (g1, g2), (0, E_loc))
            return g1, g2

        if pool is None:
            with phase(tm, "experts"):
                g1, g2 = main_wgrad()
        else:  # the replicas' weight gradients first: they travel home while the main ones are computed
            with phase(tm, "experts"):
                s1, s2 = summed([grouped_swiglu_wgrad(*w[5:]) for w in wgrad_inputs])
                for ch in call.chunks:  # the spilled rows of the slots, before they travel
                    ws.spill_wgrad(ch.spill, (W1, W2), (s1, s2), (E_loc, G), slot_w, (s1, s2))
            g1, g2 = return_grads(call, s1, s2, main_wgrad)
            prefetch_after_backward(call)
        if comm is not None:
            torch.cuda.current_stream(grad_y.device).wait_stream(comm)
        del data_grads
        if grad_x is None:  # on this stream, after the comm stream's join (made there, it would need record_stream)
            with phase(tm, "dispatch_combine"):
                grad_x = _sum_choices(grad_assign, k, T, local_grads)
        if n == 1 and weights[0].dim() == 3:  # the stacked parameters themselves
            return grad_x, grad_w, None, g1, g2
        return (grad_x, grad_w, None, *g1.unbind(0), *g2.unbind(0))
