"""Backend `cuda`'s DeepEP transport (transport="deepep"): token dispatch and combine through DeepEP's buffers
(`deep_ep.ElasticBuffer`, DeepEP's V2 API), with TopoEP's plan deciding where every assignment runs.

DeepEP routes each (token, choice) to an *expert id* and places expert ids on ranks in contiguous blocks
(id // (ids per rank)). TopoEP's plan has physical instances instead: the main experts and the replica slots. So the
layer renumbers them: on rank d, local group g (its E_loc main experts, then its N slots: layout.local_group) is
DeepEP expert `d * G + g` of R * G, and every assignment gets the id of the instance its route gives it
(`deepep_expert_ids`, from layout.assignment_instances: the assignments of one expert split over its instances in
instance order, plan.route[rank, p] at a time). DeepEP then counts, per rank, exactly the plan's C[s, d, g].

Per call (`DeepEPExpertParallelFunction`), in DeepEP's expanded layout (one received row per assignment, grouped
by local group, no host synchronisation: `do_expand=True, do_cpu_sync=False`, worst-case-sized outputs whose valid
prefix the device counts give):
    fetch       the replica weights, by TopoEP's own transfers (the peer pool on one host, the NVSHMEM pool across
                hosts), then a barrier of the pool
    dispatch    DeepEP dispatch of x with the renumbered ids and the top-k weights (one weight per received row)
    experts     torch._grouped_mm over the main groups in place; the slot groups' rows (after the main ones, at a
                device offset) gathered into a buffer of their own and computed with the slot weights
    combine     every row times its top-k weight, then DeepEP combine (a plain sum per token)
Backward: DeepEP's cached dispatch brings every token's output gradient to its rows; the rows' weight gradients are
dot products there, and travel back in the combine beside the input gradients (DeepEP carries one value per
assignment through it); the replica weight gradients return home by TopoEP's transfers.

Call `release_buffers()` before destroying the process group (the trainer and the benchmarks do).
DeepEP is optional: `import_deep_ep` names how to install it (tools/build_deepep.sh) when it is missing. The CPU
tests run this layer over `ReferenceElasticBuffer`, a torch stand-in over gloo that keeps the part of DeepEP's
contract the layer relies on (module docstring of that class).

Known limits: DeepEP sizes its receive buffers for the worst case (EP size x T x min(top_k, G) rows), so this
transport takes no capacity (capacity_factor=None) and its memory grows with the EP size; one token chunk; no
whole-layer CUDA graphs (DeepEP allocates its outputs per call).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from topoep.plan import Plan
from topoep.runtime.cuda_function import (grouped_swiglu, grouped_swiglu_dgrad, grouped_swiglu_wgrad, keep_for_prefetch,
                                          prefetch_after_backward, return_grads, stack_experts, start_fetch)
from topoep.runtime.layout import assignment_instances, group_counts, local_group
from topoep.runtime.timing import phase

INSTALL_HINT = ("transport 'deepep' needs DeepEP (the `deep_ep` package, DeepEP's V2 API with ElasticBuffer) built "
                "against this torch: run `bash tools/build_deepep.sh /path/to/DeepEP` on a machine with nvcc (README, "
                "'DeepEP transport'), or use transport='peer' (one host) or 'a2a' (NVSHMEM, across hosts)")


def import_deep_ep():
    """The `deep_ep` module, or an ImportError that says how to install it."""
    try:
        import deep_ep
    except ImportError as err:
        raise ImportError(f"{INSTALL_HINT} ({err})") from err
    if not hasattr(deep_ep, "ElasticBuffer"):
        raise ImportError(f"{INSTALL_HINT} (the installed deep_ep {getattr(deep_ep, '__version__', '?')} has no "
                          "ElasticBuffer: it is DeepEP's V1, e.g. PyPI's deep-ep 1.0.0)")
    return deep_ep


def deepep_num_experts(plan: Plan) -> int:
    """DeepEP's expert count for this plan's layer: R x G (every rank's E_loc main experts and N slots)."""
    R = plan.num_ranks
    return R * (plan.num_experts // R + plan.num_slots)


def deepep_expert_ids(topk_idx: torch.Tensor, plan: Plan, rank: int) -> torch.Tensor:
    """int64[T, k]: the DeepEP expert id of every assignment of source `rank` (module docstring): rank d's local
    group g is id d * G + g, and each assignment goes to the instance the plan's route gives it. Device tensors
    only (no host synchronisation). Assumes the default placement (main_rank[e] = e // E_loc)."""
    if topk_idx.dim() != 2:
        raise ValueError(f"topk_idx must be [T, top_k], got shape {tuple(topk_idx.shape)}")
    G = plan.num_experts // plan.num_ranks + plan.num_slots
    inst = assignment_instances(topk_idx, plan, rank)
    ids = plan.instance_rank.index_select(0, inst) * G + local_group(inst, plan)
    return ids.view(topk_idx.shape)


def deepep_expert_counts(plan: Plan) -> torch.Tensor:
    """int64[R * G]: the rows every DeepEP expert id receives from all sources under the plan (C[s, d, g] summed over
    the sources s): what DeepEP's counts per local expert must equal."""
    return group_counts(plan).sum(0).reshape(-1)


class ReferenceElasticBuffer:
    """A torch stand-in for `deep_ep.ElasticBuffer` over any process group (gloo on the CPU): the CPU tests' DeepEP.
    It keeps the part of DeepEP's contract that DeepEPExpertParallelFunction relies on, and only that:
      - dispatch(x, topk_idx=, topk_weights=, num_experts=, expert_alignment=1, do_expand=True, do_cpu_sync=False)
        returns (recv_x, None, recv_topk_weights, handle, event): recv_x [cap, H] with one row per assignment to
        this rank, grouped by local expert (ids rank * L + l for l < L, L = num_experts / R), in local expert order;
        recv_topk_weights [cap] (fp32) the row's top-k weight; handle.psum_num_recv_tokens_per_expert (int32 [L])
        the inclusive prefix sums of the rows per local expert; cap the worst case, R x T_max x min(top_k, L), its
        rows past the valid ones NaN (a layer that reads them fails the tests).
      - dispatch(x, handle=handle, do_expand=True) (cached) returns x's rows at the same positions.
      - combine(rows, handle, topk_weights=w) returns (y [T, H] bf16: each token's rows summed in fp32, w [T, k]
        fp32: each assignment's value of w, event).
    Within a local expert, rows come in (source rank, token, choice) order here; DeepEP's order may differ, which
    the layer must not depend on. Every call is a host collective (all-gathers)."""

    def __init__(self, group=None, num_max_tokens_per_rank: int = 0, hidden: int = 0, num_topk: int = 0):
        self.group = group
        self.R, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_max_tokens_per_rank = num_max_tokens_per_rank

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        """[R, T_max, ...]: every rank's t padded to T_max rows."""
        pad = t.new_zeros((self.num_max_tokens_per_rank,) + tuple(t.shape[1:]))
        pad[: t.shape[0]] = t
        out = [torch.empty_like(pad) for _ in range(self.R)]
        dist.all_gather(out, pad, group=self.group)
        return torch.stack(out)

    def dispatch(self, x, topk_idx=None, topk_weights=None, num_experts=None, expert_alignment=1, handle=None,
                 do_expand=False, do_cpu_sync=None, **_):
        if not do_expand or expert_alignment != 1 or do_cpu_sync:
            raise ValueError("ReferenceElasticBuffer models the expanded layout only (do_expand=True, "
                             "expert_alignment=1, do_cpu_sync=False)")
        if x.shape[0] > self.num_max_tokens_per_rank:
            raise ValueError(f"{x.shape[0]} tokens > num_max_tokens_per_rank={self.num_max_tokens_per_rank}")
        if handle is None:
            ids = self._gather(topk_idx.to(torch.int64) + 1) - 1  # padding rows: -1, no expert
            L = num_experts // self.R
            k = ids.shape[2]
            src, tok, j = torch.meshgrid(torch.arange(self.R), torch.arange(ids.shape[1]), torch.arange(k),
                                         indexing="ij")
            flat = ids.reshape(-1)
            mine = (flat >= self.rank * L) & (flat < (self.rank + 1) * L)
            local = torch.where(mine, flat - self.rank * L, L)
            order = torch.sort(local, stable=True).indices[: int(mine.sum())]  # grouped by local expert
            meta = torch.stack([src.reshape(-1)[order], tok.reshape(-1)[order], j.reshape(-1)[order]], 1)
            counts = torch.bincount(local[order], minlength=L)
            cap = self.R * self.num_max_tokens_per_rank * min(k, L)
            handle = _ReferenceHandle(meta, torch.cumsum(counts, 0).to(torch.int32), cap, T=x.shape[0], k=k,
                                      num_experts=num_experts)
        rows = self._rows(self._gather(x), handle)
        w = None
        if topk_weights is not None:
            w = self._rows(self._gather(topk_weights.float()).unsqueeze(-1), handle, j=True).squeeze(-1)
        return rows, None, w, handle, None

    def _rows(self, gathered: torch.Tensor, h: "_ReferenceHandle", j: bool = False) -> torch.Tensor:
        """[cap, ...]: the gathered tokens' (or, j: the gathered [R, T, k] per-choice values') rows of this rank."""
        s, t, c = h.meta.unbind(1)
        vals = gathered[s, t, c] if j else gathered[s, t]
        out = torch.full((h.cap,) + tuple(vals.shape[1:]), float("nan"), dtype=vals.dtype)
        out[: vals.shape[0]] = vals
        return out

    def combine(self, x, handle, topk_weights=None, **_):
        h = handle
        s, t, c = h.meta.unbind(1)
        n = h.meta.shape[0]
        T_max = self.num_max_tokens_per_rank
        part = torch.zeros(self.R * T_max, x.shape[1], dtype=torch.float32)
        part.index_add_(0, s * T_max + t, x[:n].float())
        parts = [torch.empty_like(part) for _ in range(self.R)]
        dist.all_gather(parts, part, group=self.group)
        mine = slice(self.rank * T_max, self.rank * T_max + h.T)
        y = torch.stack([p[mine] for p in parts]).sum(0).to(x.dtype)  # summed in rank order
        w = None
        if topk_weights is not None:
            wp = torch.zeros(self.R * T_max * h.k, dtype=torch.float32)
            wp.index_add_(0, (s * T_max + t) * h.k + c, topk_weights[:n].float())
            wps = [torch.empty_like(wp) for _ in range(self.R)]
            dist.all_gather(wps, wp, group=self.group)
            w = torch.stack([p.view(self.R * T_max, h.k)[mine] for p in wps]).sum(0)
        return y, w, None


class _ReferenceHandle:
    def __init__(self, meta, psum, cap, T, k, num_experts):
        self.meta, self.psum_num_recv_tokens_per_expert, self.cap = meta, psum, cap
        self.T, self.k, self.num_experts = T, k, num_experts


class DeepEPWorkspace:
    """What a call of the DeepEP transport shares with the other calls of its group and shape: the DeepEP buffer (a
    `deep_ep.ElasticBuffer`, or `ReferenceElasticBuffer` in the CPU harness) and the counts' all-gather."""

    _shared: dict = {}
    deepep = True
    in_place = False
    spills = False

    def __init__(self, group, max_tokens: int, hidden: int, top_k: int, reference: bool, deterministic: bool = False):
        self.group = group
        self.R = dist.get_world_size(group)
        self.max_tokens = max_tokens
        if reference:
            self.buffer = ReferenceElasticBuffer(group, num_max_tokens_per_rank=max_tokens, hidden=hidden,
                                                 num_topk=top_k)
        else:
            deep_ep = import_deep_ep()
            # deterministic (LayerConfig.deepep_deterministic): DeepEP sorts each expert's received rows into a fixed
            # order, so the weight gradients (sums over those rows) are the same bit for bit at every call; its sort
            # synchronises the host
            # explicitly_destroy: DeepEP's destructor frees its NCCL window through the process group's communicator,
            # which at interpreter exit is already destroyed (it aborted the process there); `release_buffers` frees
            # it while the group lives
            self.buffer = deep_ep.ElasticBuffer(group or dist.group.WORLD, num_max_tokens_per_rank=max_tokens,
                                                hidden=hidden, num_topk=top_k, deterministic=deterministic,
                                                explicitly_destroy=True)
        # nothing overflows or spills: DeepEP's buffers hold the worst case (the other workspaces' counters, for the
        # logs and tests)
        dev = torch.device("cpu") if reference else torch.device("cuda", torch.cuda.current_device())
        self.overflow = torch.zeros((), dtype=torch.int64, device=dev)
        self.spilled_rows = torch.zeros((), dtype=torch.int64, device=dev)

    @classmethod
    def shared(cls, group, max_tokens: int, hidden: int, top_k: int, reference: bool,
               deterministic: bool = False) -> "DeepEPWorkspace":
        name = (group or dist.group.WORLD).group_name
        key = (name, max_tokens, hidden, top_k, reference, deterministic)
        ws = cls._shared.get(key)
        if ws is None:  # collective: every rank builds its layers' workspaces in the same order
            ws = cls._shared[key] = cls(group, max_tokens, hidden, top_k, reference, deterministic)
        return ws

    @classmethod
    def release_buffers(cls) -> None:
        """Free every DeepEP buffer of the process (collective: every rank of their groups calls it), before
        `torch.distributed.destroy_process_group`; later calls make new ones."""
        for ws in cls._shared.values():
            if hasattr(ws.buffer, "destroy"):
                ws.buffer.destroy()
        cls._shared.clear()

    def all_gather(self, t: torch.Tensor, channel: int = 0) -> torch.Tensor:
        """[R, *t.shape]: every rank's t (NCCL on a GPU: no host synchronisation)."""
        out = t.new_empty(self.R * t.numel())
        dist.all_gather_into_tensor(out, t.contiguous().view(-1), group=self.group)
        return out.view((self.R,) + tuple(t.shape))


def _slot_rows(rows: torch.Tensor, start: torch.Tensor, cap: int) -> torch.Tensor:
    """[cap, H]: rows[start + i] for i < cap (start a device scalar; indices past the end repeat the last row,
    never read: the slot GEMMs stop at their offsets)."""
    idx = (torch.arange(cap, device=rows.device) + start).clamp(max=rows.shape[0] - 1)
    return rows.index_select(0, idx)


def _join_slots(main: torch.Tensor, slots: torch.Tensor, start: torch.Tensor, n_slot: torch.Tensor) -> torch.Tensor:
    """main [cap, H] with rows start + i replaced by slots[i] for i < n_slot (device scalars); the rest of the slot
    buffer lands in one spare row, dropped."""
    cap = main.shape[0]
    out = torch.cat([main, main.new_empty(1, main.shape[1])])
    i = torch.arange(slots.shape[0], device=main.device)
    out.index_copy_(0, torch.where(i < n_slot, start + i, cap), slots)
    return out[:cap]


class DeepEPExpertParallelFunction(torch.autograd.Function):
    """y [T, H] = sum over the k choices of topk_weights [T, k] times the expert's output, dispatched and combined by
    DeepEP (module docstring). call: a cuda_function.CudaLayerCall whose `deepep_ids` holds deepep_expert_ids and
    whose workspace is a DeepEPWorkspace."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, topk_weights: torch.Tensor, call, *weights: torch.Tensor) -> torch.Tensor:
        n = len(weights) // 2
        T, k = topk_weights.shape
        ws, pool, tm, E_loc = call.workspace, call.pool, call.timer, call.experts_per_rank
        buf = ws.buffer
        W1, W2 = stack_experts(list(weights[:n])), stack_experts(list(weights[n:]))
        _publish(call, start_fetch(call, W1, W2), x.device)
        keep_for_prefetch(call, weights[:n], weights[n:])
        with phase(tm, "dispatch_combine", collective=True):
            recv, _, recv_w, handle, _ = buf.dispatch(
                x.contiguous(), topk_idx=call.deepep_ids, topk_weights=topk_weights.float().contiguous(),
                num_experts=deepep_num_experts(call.plan), expert_alignment=1, do_expand=True, do_cpu_sync=False)
        psum = handle.psum_num_recv_tokens_per_expert
        n_main = psum[E_loc - 1:E_loc].to(torch.int64)
        with phase(tm, "experts"):
            ym, hm = grouped_swiglu(recv, W1, W2, psum[:E_loc], n_main)
            xs = hs = None
            if pool is not None:
                slot_w = pool.bank_weights(call.bank)
                n_slot = psum[-1:].to(torch.int64) - n_main
                xs = _slot_rows(recv, n_main[0], _slot_cap(call, k))
                ys, hs = grouped_swiglu(xs, *slot_w, psum[E_loc:] - psum[E_loc - 1], n_slot)
                ym = _join_slots(ym, ys, n_main[0], n_slot[0])
        with phase(tm, "dispatch_combine", collective=True):
            y, _, _ = buf.combine((ym.float() * recv_w.unsqueeze(1)).to(ym.dtype), handle)
        ctx.call, ctx.handle, ctx.num_weights, ctx.w_dtype = call, handle, n, topk_weights.dtype
        ctx.stacked = (W1, W2) if W1.data_ptr() != weights[0].data_ptr() else None  # copies: keep them
        ctx.save_for_backward(recv, hm, recv_w, ym, xs, hs, *weights)
        return y

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        call, handle, n = ctx.call, ctx.handle, ctx.num_weights
        recv, hm, recv_w, ym, xs, hs, *weights = ctx.saved_tensors
        ws, pool, tm, E_loc = call.workspace, call.pool, call.timer, call.experts_per_rank
        buf = ws.buffer
        W1, W2 = ctx.stacked or (stack_experts(list(weights[:n])), stack_experts(list(weights[n:])))
        _publish(call, start_fetch(call, W1, W2, reload=True), grad_out.device)
        with phase(tm, "dispatch_combine", collective=True):  # every row gets its token's output gradient
            # num_experts: DeepEP chooses its SM count from it before it reads the handle
            g_rows, _, _, _, _ = buf.dispatch(grad_out.contiguous(), handle=handle, do_expand=True,
                                              num_experts=deepep_num_experts(call.plan))
        psum = handle.psum_num_recv_tokens_per_expert
        n_main = psum[E_loc - 1:E_loc].to(torch.int64)
        with phase(tm, "experts"):
            grad_w_rows = (g_rows.float() * ym.float()).sum(1)  # d y / d w of each assignment
            gy = (g_rows.float() * recv_w.unsqueeze(1)).to(g_rows.dtype)
            gxm, ghm, am = grouped_swiglu_dgrad(gy, hm, W1, W2, psum[:E_loc], n_main)
            if pool is not None:
                slot_w = pool.bank_weights(call.bank)
                n_slot = psum[-1:].to(torch.int64) - n_main
                offs_slot = psum[E_loc:] - psum[E_loc - 1]
                gys = _slot_rows(gy, n_main[0], xs.shape[0])
                gxs, ghs, as_ = grouped_swiglu_dgrad(gys, hs, *slot_w, offs_slot, n_slot)
                gxm = _join_slots(gxm, gxs, n_main[0], n_slot[0])
        with phase(tm, "dispatch_combine", collective=True):
            grad_x, grad_w, _ = buf.combine(gxm, handle, topk_weights=grad_w_rows)

        def main_wgrad():
            return grouped_swiglu_wgrad(recv, am, gy, ghm, psum[:E_loc])

        if pool is None:
            with phase(tm, "experts"):
                g1, g2 = main_wgrad()
        else:  # the replicas' weight gradients first: they travel home while the main ones are computed
            with phase(tm, "experts"):
                s1, s2 = grouped_swiglu_wgrad(xs, as_, gys, ghs, offs_slot)
            g1, g2 = return_grads(call, s1, s2, main_wgrad)
            prefetch_after_backward(call)
        grad_w = grad_w.to(ctx.w_dtype) if ctx.needs_input_grad[1] else None
        if n == 1 and weights[0].dim() == 3:  # the stacked parameters themselves
            return grad_x, grad_w, None, g1, g2
        return (grad_x, grad_w, None, *g1.unbind(0), *g2.unbind(0))


def _slot_cap(call, k: int) -> int:
    """The most rows a rank's slots can receive in one call: every rank's tokens, each with at most min(k, N) choices
    on this rank's N slots."""
    ws = call.workspace
    return ws.R * ws.max_tokens * min(k, call.pool.num_slots)


def _publish(call, fetched, device) -> None:
    """After the replica fetch (cuda_function.start_fetch; `fetched` the event of a prefetch on a side stream, or None):
    wait for it, then a barrier of the pool, so that every rank's pushes into this rank's slots are complete before
    the slot GEMMs read them (the peer transport's dispatch barrier does this there). Nothing without slots."""
    if call.pool is None:
        return
    if fetched is not None:
        torch.cuda.current_stream(device).wait_event(fetched)
    call.pool.publish()


def release_buffers() -> None:
    """Free the process's DeepEP buffers before `torch.distributed.destroy_process_group` (collective; nothing
    without transport deepep)."""
    DeepEPWorkspace.release_buffers()
