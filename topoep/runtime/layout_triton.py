"""Backend cuda's send and receive layout in two Triton kernels: what `layout.send_layout` followed by
`layout.receive_positions` compute with about 60 small torch kernels (two argsorts of the instances, a
stable sort of the assignments, searchsorted, gathers and scatters), bit for bit the same.

An assignment a (token t, choice j; expert e = topk_idx[t, j]) is the o-th of this rank's assignments of e
(its ordinal, in assignment order). The plan's route row of this rank gives each instance p of e a count,
and the instances of e serve consecutive ordinals in instance order: the main instance (p = e) the first
route[e], then e's replica slots in slot order. So a's instance is the one whose range holds o, and a's
place in the send order is the start of its (destination, group) key plus o minus the instance's first
ordinal (layout.send_layout's docstring). The kernels:

1. `_block_counts_kernel`: per block of B assignments, how many of each expert it holds
   (torch: the exclusive sum of those over blocks: each block's first ordinal of every expert);
2. `_layout_kernel`: per block, each assignment's ordinal (the block's offset plus the earlier
   assignments of the same expert inside the block, from a B x B comparison), its instance (among its
   expert's replicas only: a per-expert list), its key, and its send position; it writes order, key,
   destination, receive position and is_slot at that position.

`fused_layout` prepares the small per-instance and per-key tables with torch and launches both. The torch
functions in layout.py stay the reference (and the CPU path); tests/layout_triton_check.py compares the
two under Triton's interpreter on the CPU, and tests/test_cuda_backend_gpu.py on the GPU.
Default placement only (main_rank[e] = e // E_loc), like layout.py.
"""

from __future__ import annotations


import torch

from topoep.plan import Plan
from topoep.runtime.layout import receive_starts
from topoep.runtime.symm import _pow2

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only environments: the module imports, the kernels are unavailable
    triton = None

BLOCK = 128  # assignments per program (the in-block ordinal compares BLOCK x BLOCK pairs)

if triton is not None:

    @triton.jit
    def _block_counts_kernel(e_ptr, counts_ptr, A, E, nb, B: tl.constexpr, EB: tl.constexpr):
        """counts[x, b] = assignments of expert x among a in [b * B, (b + 1) * B), b < nb (expert-major, so
        that the sum over blocks is a scan along the last dimension). EB: a power of two > E (bin E takes
        the lanes past A)."""
        b = tl.program_id(0)
        a = b * B + tl.arange(0, B)
        e = tl.load(e_ptr + a, mask=a < A, other=E).to(tl.int32)
        h = tl.histogram(e, EB)
        x = tl.arange(0, EB)
        tl.store(counts_ptr + x.to(tl.int64) * nb + b, h.to(tl.int64), mask=x < E)

    @triton.jit
    def _layout_kernel(e_ptr, first_ptr, route_ptr, inst_rank_ptr, inst_start_ptr, rep_first_ptr, rep_count_ptr,
                       rep_list_ptr, key_start_ptr, recv_start_ptr, order_ptr, key_ptr, dest_ptr, pos_ptr, slot_ptr,
                       inv_ptr, me, region_rows, A, E, E_loc, N, G, nb, B: tl.constexpr, INV: tl.constexpr):
        """The send position of each assignment of block b, and what goes there (module docstring).
        first[x, b]: the ordinal of block b's first assignment of expert x; route: this rank's row of the
        plan's route [P]; inst_start [P]: each instance's first ordinal; rep_list[rep_first[x] + j], j <
        rep_count[x]: expert x's replica instances in slot order; key_start / recv_start [R * G]: where each
        (destination, group) key starts in the send order / in the destination's buffer. A position outside
        [0, A) (only a plan that does not route this rank's assignments, which fused_layout asserts against)
        is not written. With INV, inv[a] for every assignment a (layout.own_rows, its reference): its row in
        rank me's region when it stays on me within the region's region_rows rows (+ region_rows for a slot's),
        else -1."""
        b = tl.program_id(0)
        i = tl.arange(0, B)
        a = b * B + i
        m = a < A
        e = tl.load(e_ptr + a, mask=m, other=0)
        # the earlier assignments of the same expert inside the block
        same = (e[:, None] == e[None, :]) & (i[None, :] < i[:, None]) & m[None, :]
        o = tl.load(first_ptr + e * nb + b, mask=m, other=0) + tl.sum(same.to(tl.int32), axis=1).to(tl.int64)
        inst = e  # the main instance serves ordinals [0, route[e])
        st = tl.zeros([B], dtype=tl.int64)
        rn = tl.load(rep_count_ptr + e, mask=m, other=0)
        rf = tl.load(rep_first_ptr + e, mask=m, other=0)
        n_max = tl.max(rn, axis=0)
        j = 0
        while j < n_max:  # the replicas of each lane's expert (a while loop: Triton's interpreter runs it too)
            v = m & (j < rn)
            p = tl.load(rep_list_ptr + rf + j, mask=v, other=0)
            ps = tl.load(inst_start_ptr + p, mask=v, other=0)
            pc = tl.load(route_ptr + p, mask=v, other=0)
            hit = v & (o >= ps) & (o < ps + pc)
            inst = tl.where(hit, p, inst)
            st = tl.where(hit, ps, st)
            j += 1
        group = tl.where(inst < E, inst % E_loc, E_loc + (inst - E) % N)
        key = tl.load(inst_rank_ptr + inst, mask=m, other=0) * G + group
        at = tl.load(key_start_ptr + key, mask=m, other=0) + o - st
        pos = tl.load(recv_start_ptr + key, mask=m, other=0) + o - st
        ok = m & (at >= 0) & (at < A)
        tl.store(order_ptr + at, a.to(tl.int64), mask=ok)
        tl.store(key_ptr + at, key, mask=ok)
        tl.store(dest_ptr + at, key // G, mask=ok)
        tl.store(pos_ptr + at, pos, mask=ok)
        tl.store(slot_ptr + at, (group >= E_loc).to(tl.int8), mask=ok)
        if INV:
            stays = ok & (key // G == me) & (pos < region_rows)
            tl.store(inv_ptr + a, tl.where(stays, tl.where(group >= E_loc, pos + region_rows, pos), -1), mask=m)


def instance_tables(route_row: torch.Tensor, inst_expert: torch.Tensor, num_experts: int):
    """(inst_start int64[P], rep_first int64[E], rep_count int64[E], rep_list int64[S + 1]) for the default
    instance order (mains p = e first, then the S replica slots of all ranks):

    inst_start: each instance's first ordinal of its expert (planners.common.group_exclusive_cumsum of the
    route row over the instances' experts): 0 for a main, the main's count plus the counts of the expert's
    earlier slots for a slot, 0 for an empty slot; rep_list[rep_first[x] + j] for j < rep_count[x]: the
    replica instances of expert x in slot order. Slot x slot comparisons instead of argsorts."""
    E = num_experts
    se, sc = inst_expert[E:], route_row[E:]
    S = se.numel()
    dev = se.device
    valid = se >= 0
    e_of = se.clamp(min=0)
    earlier = torch.ones(S, S, dtype=torch.bool, device=dev).tril(-1)  # [p, q]: q before p
    same = (se[:, None] == se[None, :]) & earlier
    slot_start = route_row.index_select(0, e_of) + (same * sc[None, :]).sum(1)
    inst_start = torch.cat([torch.zeros(E, dtype=route_row.dtype, device=dev), torch.where(valid, slot_start, 0)])
    rep_count = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(0, e_of, valid.long())
    rep_first = torch.cumsum(rep_count, 0) - rep_count
    at = torch.where(valid, rep_first.index_select(0, e_of) + same.sum(1), S)  # empty slots: the spare entry S
    rep_list = torch.zeros(S + 1, dtype=torch.int64, device=dev).index_put_(
        (at,), E + torch.arange(S, device=dev))
    return inst_start, rep_first, rep_count, rep_list


def fused_layout(topk_idx: torch.Tensor, plan: Plan, rank: int, C: torch.Tensor, region_rows: int | None = None):
    """(send_key, order, dest, pos, is_slot) of this rank's assignments, all in send order: the same
    tensors as `layout.send_layout(topk_idx, plan, rank)[1:]` followed by `layout.receive_positions(C, key,
    rank, E_loc)`, with C = `layout.group_counts(plan)`; with region_rows, then inv int64[A] (per assignment, as
    `layout.own_rows`). No host synchronisation; graph-capturable."""
    if triton is None:
        raise RuntimeError("fused_layout needs Triton (backend cuda)")
    e = topk_idx.reshape(-1)
    A = e.numel()
    R, E, N = plan.num_ranks, plan.num_experts, plan.num_slots
    E_loc, G = E // R, C.shape[2]
    dev = e.device
    route = plan.route[rank].contiguous()
    inst_expert = plan.instance_expert.contiguous()
    inst_rank = plan.instance_rank.contiguous()
    mine = C[rank].reshape(-1)
    key_start = torch.cumsum(mine, 0) - mine
    recv_start = receive_starts(C, rank, E_loc)
    inst_start, rep_first, rep_count, rep_list = instance_tables(route, inst_expert, E)
    nb = triton.cdiv(A, BLOCK) if A else 0
    order, key, dest, pos = (torch.empty(A, dtype=torch.int64, device=dev) for _ in range(4))
    is_slot = torch.empty(A, dtype=torch.int8, device=dev)
    inv = torch.empty(A if region_rows is not None else 0, dtype=torch.int64, device=dev)
    total = torch.zeros(E, dtype=torch.int64, device=dev)  # this rank's assignments of each expert
    if nb:
        counts = torch.empty(E, nb, dtype=torch.int64, device=dev)
        _block_counts_kernel[(nb,)](e, counts, A, E, nb, B=BLOCK, EB=_pow2(E + 1))
        # [E, blocks]: the scan runs along the last, contiguous dimension (a scan along the first is many times slower)
        csum = torch.cumsum(counts, 1)
        first, total = csum - counts, csum[:, -1]
        _layout_kernel[(nb,)](e, first, route, inst_rank, inst_start, rep_first, rep_count, rep_list, key_start,
                              recv_start, order, key, dest, pos, is_slot, inv if region_rows is not None else order,
                              rank, region_rows or 0, A, E, E_loc, max(N, 1), G, nb, B=BLOCK,
                              INV=region_rows is not None)
    # the positions are a permutation only if the plan routes exactly this rank's assignments of every expert
    # (C1) and nothing to an empty slot (which would shift the later keys): checked on the device (the kernel
    # leaves out positions outside [0, A) rather than write there)
    routed = torch.zeros(E, dtype=torch.int64, device=dev).index_add_(
        0, inst_expert.clamp(min=0), torch.where(inst_expert >= 0, route, 0))
    torch._assert_async((routed == total).all() & (route.sum() == A), "fused_layout: the plan's route does not "
                        "match this rank's assignments of every expert (or routes some to an empty slot)")
    out = (key, order, dest, pos, is_slot.view(torch.bool))
    return out + (inv,) if region_rows is not None else out
