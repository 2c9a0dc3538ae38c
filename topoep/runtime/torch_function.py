"""The autograd function of one balanced MoE layer: replica fetch, dispatch, grouped experts, combine,
and in backward the replica reload, data gradients, weight gradients and gradient return, scheduled
explicitly in a two-chunk pipeline (paper 3.3).

Pipeline: the assignments are split into chunks of consecutive tokens. Forward issues the dispatch of
every chunk, then for each chunk waits for its rows, computes its experts and issues its combine, so
the communication of one chunk overlaps the expert compute of the other (asynchronous collectives on
GPU and gloo alike; the results do not depend on the overlap). Backward mirrors it: token gradients go
out and come back per chunk, every chunk's data gradient is computed before any weight gradient, so
the replica weights are no longer needed and the pool's storage receives the replica weight
gradients, which then travel to their main ranks.

Routing weights are applied outside (plain PyTorch in `ExpertParallelMoE.forward`), so autograd owns
their gradient; this function maps x[T, H] to per-assignment expert outputs [T * k, H].

With a `PhaseTimer` in the call (benchmarks only), every phase is timed on its own (`timing.py`): each
token all-to-all is waited for inside its phase, which serialises the pipeline; results are unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from topoep.plan import Plan
from topoep.runtime.backend import _Done
from topoep.runtime.experts import grouped_copies, swiglu_dgrad, swiglu_forward, swiglu_wgrad, weight_runs
from topoep.runtime.layout import ChunkLayout
from topoep.runtime.pool import ReplicaPool
from topoep.runtime.timing import PhaseTimer, phase


@dataclass
class LayerCall:
    """Everything one call needs besides tensors with gradients (kept for the backward pass)."""

    plan: Plan
    chunks: list[ChunkLayout]
    backend: object
    pool: ReplicaPool
    num_tokens: int
    top_k: int
    timer: PhaseTimer | None = None
    relay_fanout: int | None = None  # LayerConfig.relay_fanout: replica fetches down relay trees
    relay_chunks: int = 1  # LayerConfig.relay_chunks: the chunks each relayed copy travels in
    relay_schedule: str = "levels"  # LayerConfig.relay_schedule: the trees level by level, or copy by copy


def _comm(timer: PhaseTimer | None, start, *args):
    """start(*args): a token all-to-all; with a timer it is waited for inside its timed phase."""
    if timer is None:
        return start(*args)
    with timer.phase("dispatch_combine", collective=True):
        out = start(*args).wait()
    return _Done(out)


def _scatter_rows(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Inverse of rows[order]: out[order] = rows."""
    out = torch.empty_like(rows)
    out[order] = rows
    return out


def _splits(ch: ChunkLayout) -> tuple:
    """(send, recv) split sizes of a chunk for the backend: host lists when copied, else the tensors."""
    if ch.send_split is not None:
        return ch.send_split, ch.recv_split
    return ch.send_counts, ch.recv_counts


def _group_split(ch: ChunkLayout) -> list[int]:
    return ch.group_split if ch.group_split is not None else ch.group_sizes.tolist()


class ExpertParallelFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, call: LayerCall, *weights: torch.Tensor) -> torch.Tensor:
        n = len(weights) // 2
        fc1, fc2 = list(weights[:n]), list(weights[n:])
        be, pool, tm = call.backend, call.pool, call.timer
        with phase(tm, "fetch", collective=True):
            be.fetch_replicas(call.plan, fc1, fc2, pool, call.relay_fanout, call.relay_chunks,
                            call.relay_schedule)
        s1, s2 = pool.slot_weights()
        m1, m2 = grouped_copies(fc1, fc2, x) or (fc1, fc2)  # megatron's separate experts: one grouped GEMM
        W1, W2 = m1 + s1, m2 + s2
        runs = weight_runs(W1, W2)  # once for both chunks (a host walk over every weight)
        k = call.top_k
        out = x.new_empty(call.num_tokens * k, x.shape[1])
        sent = [_comm(tm, be.dispatch, x[ch.send_idx // k], *_splits(ch)) for ch in call.chunks]
        back, saved = [], []
        for ch, handle in zip(call.chunks, sent):
            xin = handle.wait()[ch.group_order]
            with phase(tm, "experts"):
                y, h = swiglu_forward(xin, _group_split(ch), W1, W2, runs, ch.group_sizes)
            back.append(_comm(tm, be.combine, _scatter_rows(y, ch.group_order), *_splits(ch)[::-1]))
            saved += [xin, h]
        for ch, handle in zip(call.chunks, back):
            out[ch.send_idx] = handle.wait()
        ctx.call = call
        ctx.num_weights = n
        ctx.save_for_backward(*weights, *saved)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        call: LayerCall = ctx.call
        n = ctx.num_weights
        tensors = ctx.saved_tensors
        fc1, fc2 = list(tensors[:n]), list(tensors[n:2 * n])
        saved = tensors[2 * n:]
        be, pool, tm = call.backend, call.pool, call.timer
        k = call.top_k
        # slots were reused by later layers: reload this layer's replicas
        with phase(tm, "fetch", collective=True):
            be.fetch_replicas(call.plan, fc1, fc2, pool, call.relay_fanout, call.relay_chunks,
                            call.relay_schedule)
        s1, s2 = pool.slot_weights()
        # stacked again rather than kept from forward: a copy of every local expert per layer would stay
        # in memory until backward
        m1, m2 = grouped_copies(fc1, fc2, grad_out) or (fc1, fc2)
        W1, W2 = m1 + s1, m2 + s2
        runs = weight_runs(W1, W2)
        grad_out = grad_out.contiguous()
        sent = [_comm(tm, be.dispatch, grad_out[ch.send_idx], *_splits(ch)) for ch in call.chunks]
        back, wgrad_inputs = [], []
        for c, (ch, handle) in enumerate(zip(call.chunks, sent)):
            xin, h = saved[2 * c], saved[2 * c + 1]
            gy = handle.wait()[ch.group_order]
            sizes = _group_split(ch)
            with phase(tm, "experts"):
                gx, gh = swiglu_dgrad(gy, h, sizes, W1, W2, runs, ch.group_sizes)  # dgrad first: token gradients leave early
            back.append(_comm(tm, be.combine, _scatter_rows(gx, ch.group_order), *_splits(ch)[::-1]))
            wgrad_inputs.append((xin, h, gy, gh, sizes, ch.group_sizes))
        # every data gradient is done: the pool's weights are free and receive the replica wgrads
        with phase(tm, "experts"):
            g1 = list(fc1[0].new_zeros(n, *fc1[0].shape).unbind(0))  # stacked: one grouped wgrad per run
            g2 = list(fc2[0].new_zeros(n, *fc2[0].shape).unbind(0))
            pool.fc1.zero_()
            pool.fc2.zero_()
            o1, o2 = g1 + s1, g2 + s2
            out_runs = weight_runs(o1, o2)
            for xin, h, gy, gh, sizes, sizes_dev in wgrad_inputs:
                swiglu_wgrad(xin, h, gy, gh, sizes, o1, o2, out_runs, sizes_dev)
        with phase(tm, "grad_return", collective=True):
            be.return_grads(call.plan, pool, g1, g2, call.relay_fanout, call.relay_chunks,
                            call.relay_schedule)
        grad_assign = grad_out.new_empty(call.num_tokens * k, grad_out.shape[1])
        for ch, handle in zip(call.chunks, back):
            grad_assign[ch.send_idx] = handle.wait()
        grad_x = grad_assign.view(call.num_tokens, k, grad_assign.shape[1]).sum(1)  # fixed order over the k choices
        return (grad_x, None, *g1, *g2)
