"""Backend cuda's send and receive layout in three Triton kernels: what `layout.send_layout` followed by
`layout.receive_positions` and `layout.received_sizes` compute with about 100 small torch kernels (two argsorts of
the instances, a stable sort of the assignments, searchsorted, scans, gathers and scatters), bit for bit the same;
and the routing counts with their range check (`checked_counts`).

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
TABLE_EXPERTS = 16  # experts per program of _tables_kernel's block-count scans
TABLE_COLS = 256  # block counts per step of those scans
TABLE_SLOTS = 64  # slots per step of _tables_kernel's slot x slot comparisons

if triton is not None:

    @triton.jit
    def _block_counts_kernel(e_ptr, counts_ptr, ok_ptr, A, E, nb, B: tl.constexpr, EB: tl.constexpr,
                             CHECK: tl.constexpr):
        """counts[x, b] = assignments of expert x among a in [b * B, (b + 1) * B), b < nb (expert-major, so
        that the sum over blocks is a scan along the last dimension). EB: a power of two > E (bin E takes
        the lanes past A). With CHECK, values outside [0, E) count nowhere and ok[b] says whether block b had none
        (`checked_counts`); without, every value is taken to lie in [0, E) and ok_ptr is not read."""
        b = tl.program_id(0)
        a = b * B + tl.arange(0, B)
        if CHECK:
            e = tl.load(e_ptr + a, mask=a < A, other=0)
            bad = (a < A) & ((e < 0) | (e >= E))
            h = tl.histogram(tl.where((a < A) & ~bad, e, E).to(tl.int32), EB)
            tl.store(ok_ptr + b, tl.sum(bad.to(tl.int32), 0) == 0)
        else:
            h = tl.histogram(tl.load(e_ptr + a, mask=a < A, other=E).to(tl.int32), EB)
        x = tl.arange(0, EB)
        tl.store(counts_ptr + x.to(tl.int64) * nb + b, h.to(tl.int64), mask=x < E)

    @triton.jit
    def _slot_step(inst_expert_ptr, route_ptr, E, S, q0, QB: tl.constexpr):
        """Slots [q0, q0 + QB) of the instance order (instances E + q): (q, q < S, each one's expert, -2 past S,
        each one's rows in the route row)."""
        q = q0 + tl.arange(0, QB)
        qv = q < S
        return q, qv, tl.load(inst_expert_ptr + E + q, mask=qv, other=-2), tl.load(route_ptr + E + q, mask=qv, other=0)

    @triton.jit
    def _tables_kernel(C_ptr, route_ptr, inst_expert_ptr, counts_ptr, key_start_ptr, recv_start_ptr, inst_start_ptr,
                       rep_first_ptr, rep_count_ptr, rep_list_ptr, first_ptr, offs_main_ptr, offs_slot_ptr, n_ptr,
                       ok_ptr, me, rows, A, R, E, E_loc, G, S, nb, RB: tl.constexpr, GB: tl.constexpr,
                       SB: tl.constexpr, EB: tl.constexpr, QB: tl.constexpr, EC: tl.constexpr, NB: tl.constexpr):
        """Program 0: key_start and recv_start [R * G] from C int64[R, R, G]; inst_start [E + S], rep_first,
        rep_count [E], rep_list [S + 1] (`instance_tables`; rep_list[S], a spare entry, is 0) from this rank's
        route row and the instances' experts; offs_main int32[E_loc], offs_slot int32[G - E_loc] and n int64[2]
        (main, slot) of the rows this rank receives, each clamped to `rows`; ok[0]: the route row routes A
        assignments. Program p > 0, experts x in [(p - 1) EC, p EC): first[x, b] = the sum of counts[x, :b]
        (counts int64[E, nb]) and ok[p]: the route gives each x as many assignments as the blocks hold.
        RB, GB, SB, EB: powers of two above R, G, S, E; QB, NB: steps of the slot comparisons and the scans."""
        pid = tl.program_id(0)
        if pid == 0:
            rv = tl.arange(0, RB)[:, None]
            gv = tl.arange(0, GB)[None, :]
            km = (rv < R) & (gv < G)
            per = tl.zeros([RB, GB], dtype=tl.int64)  # [d, g]: rows d receives in group g from every source
            before = tl.zeros([RB, GB], dtype=tl.int64)  # ... from the sources before this rank
            s = 0
            while s < R:  # (a while loop: Triton's interpreter runs it, not a range over a runtime bound)
                x = tl.load(C_ptr + s * R * G + rv * G + gv, mask=km, other=0)
                per += x
                before += tl.where(s < me, x, 0)
                s += 1
            mine = tl.load(C_ptr + me * R * G + rv * G + gv, mask=km, other=0)
            row_total = tl.sum(mine, 1)
            key_start = (tl.cumsum(row_total, 0) - row_total)[:, None] + tl.cumsum(mine, 1) - mine
            tl.store(key_start_ptr + rv * G + gv, key_start, mask=km)
            start = tl.cumsum(per, 1) - per  # group-major per destination; slot groups: their own buffer from 0
            main_total = tl.sum(tl.where(gv < E_loc, per, 0), 1)
            start = tl.where(gv >= E_loc, start - main_total[:, None], start)
            tl.store(recv_start_ptr + rv * G + gv, start + before, mask=km)
            got = tl.sum(tl.where(rv == me, per, 0), 0)  # [G]: rows this rank receives per group
            g1 = tl.arange(0, GB)
            is_main = g1 < E_loc
            is_slot = (g1 >= E_loc) & (g1 < G)
            cm = tl.minimum(tl.cumsum(tl.where(is_main, got, 0), 0), rows)
            cs = tl.minimum(tl.cumsum(tl.where(is_slot, got, 0), 0), rows)
            tl.store(offs_main_ptr + g1, cm.to(tl.int32), mask=is_main)
            tl.store(offs_slot_ptr + g1 - E_loc, cs.to(tl.int32), mask=is_slot)
            tl.store(n_ptr, tl.minimum(tl.sum(tl.where(is_main, got, 0), 0), rows))
            tl.store(n_ptr + 1, tl.minimum(tl.sum(tl.where(is_slot, got, 0), 0), rows))
            # the slots: each one's first ordinal and its rank among the earlier slots of its expert
            sp = tl.arange(0, SB)
            sv = sp < S
            se = tl.load(inst_expert_ptr + E + sp, mask=sv, other=-1)
            valid = sv & (se >= 0)
            e_of = tl.maximum(se, 0)
            n_before = tl.zeros([SB], dtype=tl.int64)
            rows_before = tl.zeros([SB], dtype=tl.int64)
            q0 = 0
            while q0 < S:
                q, qv, sq, cq = _slot_step(inst_expert_ptr, route_ptr, E, S, q0, QB)
                same = (se[:, None] == sq[None, :]) & (q[None, :] < sp[:, None]) & qv[None, :]
                n_before += tl.sum(same.to(tl.int64), 1)
                rows_before += tl.sum(tl.where(same, cq[None, :], 0), 1)
                q0 += QB
            main_rows = tl.load(route_ptr + e_of, mask=sv, other=0)
            tl.store(inst_start_ptr + E + sp, tl.where(valid, main_rows + rows_before, 0), mask=sv)
            xe = tl.arange(0, EB)
            tl.store(inst_start_ptr + xe, tl.zeros([EB], dtype=tl.int64), mask=xe < E)
            rep_count = tl.histogram(tl.where(valid, se, E).to(tl.int32), EB).to(tl.int64)
            rep_first = tl.cumsum(rep_count, 0) - rep_count
            tl.store(rep_count_ptr + xe, rep_count, mask=xe < E)
            tl.store(rep_first_ptr + xe, rep_first, mask=xe < E)
            tl.store(rep_list_ptr + sp, tl.zeros([SB], dtype=tl.int64), mask=sp <= S)
            tl.store(rep_list_ptr + S, 0)
            tl.debug_barrier()  # rep_first and the zeros of rep_list, read back and overwritten per slot below
            at = tl.load(rep_first_ptr + e_of, mask=valid, other=0) + n_before
            tl.store(rep_list_ptr + at, E + sp.to(tl.int64), mask=valid)
            total = tl.zeros([QB], dtype=tl.int64)
            p0 = 0
            while p0 < E + S:
                p = p0 + tl.arange(0, QB)
                total += tl.load(route_ptr + p, mask=p < E + S, other=0)
                p0 += QB
            tl.store(ok_ptr, tl.sum(total, 0) == A)
        else:
            xv = (pid - 1) * EC + tl.arange(0, EC)
            xm = xv < E
            held = tl.zeros([EC], dtype=tl.int64)  # this rank's assignments of each expert, over the blocks
            b0 = 0
            while b0 < nb:
                b = b0 + tl.arange(0, NB)
                m = xm[:, None] & (b[None, :] < nb)
                c = tl.load(counts_ptr + xv[:, None] * nb + b[None, :], mask=m, other=0)
                tl.store(first_ptr + xv[:, None] * nb + b[None, :], held[:, None] + tl.cumsum(c, 1) - c, mask=m)
                held += tl.sum(c, 1)
                b0 += NB
            routed = tl.load(route_ptr + xv, mask=xm, other=0)  # the main instance's rows, then its slots'
            q0 = 0
            while q0 < S:
                q, qv, sq, cq = _slot_step(inst_expert_ptr, route_ptr, E, S, q0, QB)
                routed += tl.sum(tl.where(sq[None, :] == xv[:, None], cq[None, :], 0), 1)
                q0 += QB
            tl.store(ok_ptr + pid, tl.sum((xm & (routed != held)).to(tl.int32), 0) == 0)

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


def checked_counts(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64[E]: occurrences of each expert in topk_idx (`layout.count_keys`), with every value checked to lie in
    [0, E) on the device (a failed check raises at the next synchronisation): three kernels instead of the eight of
    a min/max check and count_keys."""
    if triton is None:
        raise RuntimeError("checked_counts needs Triton (backend cuda)")
    e = topk_idx.reshape(-1)
    A, E = e.numel(), num_experts
    nb = triton.cdiv(A, BLOCK) if A else 0
    if not nb:
        return torch.zeros(E, dtype=torch.int64, device=e.device)
    counts = torch.empty(E, nb, dtype=torch.int64, device=e.device)
    ok = torch.empty(nb, dtype=torch.bool, device=e.device)
    _block_counts_kernel[(nb,)](e, counts, ok, A, E, nb, B=BLOCK, EB=_pow2(E + 1), CHECK=True)
    torch._assert_async(ok.all(), f"topk_idx out of range: values must be in [0, {E})")
    return counts.sum(1)


def _tables(e: torch.Tensor, plan: Plan, rank: int, C: torch.Tensor, rows: int) -> tuple:
    """Launch `_block_counts_kernel` and `_tables_kernel` on this rank's assignments e (flat): (first, key_start,
    recv_start, inst_start, rep_first, rep_count, rep_list, offs_main, offs_slot, n, ok), as that kernel's
    docstring, the offsets clamped to `rows`."""
    A, E, R, N = e.numel(), plan.num_experts, plan.num_ranks, plan.num_slots
    E_loc, G, S, dev = E // R, C.shape[2], R * N, e.device
    nb = triton.cdiv(A, BLOCK) if A else 0
    new = lambda *shape: torch.empty(shape, dtype=torch.int64, device=dev)  # noqa: E731
    counts, first = new(E, max(nb, 1)), new(E, max(nb, 1))  # [E, blocks]: scanned along the contiguous blocks
    tables = (new(R * G), new(R * G), new(E + S), new(E), new(E), new(S + 1))
    offs = (torch.empty(E_loc, dtype=torch.int32, device=dev), torch.empty(G - E_loc, dtype=torch.int32, device=dev),
            new(2))
    programs = 1 + triton.cdiv(E, TABLE_EXPERTS)
    ok = torch.empty(programs, dtype=torch.bool, device=dev)
    if nb:
        _block_counts_kernel[(nb,)](e, counts, counts, A, E, nb, B=BLOCK, EB=_pow2(E + 1), CHECK=False)
    _tables_kernel[(programs,)](C.contiguous(), plan.route[rank].contiguous(), plan.instance_expert.contiguous(),
                                counts, *tables, first, *offs, ok, rank, rows, A, R, E, E_loc, G, S, nb,
                                RB=max(2, _pow2(R)), GB=max(2, _pow2(G)), SB=max(2, _pow2(S)), EB=_pow2(E + 1),
                                QB=TABLE_SLOTS, EC=TABLE_EXPERTS, NB=TABLE_COLS)
    return (first, *tables, *offs, ok)


def fused_layout(topk_idx: torch.Tensor, plan: Plan, rank: int, C: torch.Tensor, region_rows: int | None = None,
                 offsets_rows: int | None = None):
    """(send_key, order, dest, pos, is_slot) of this rank's assignments, all in send order: the same
    tensors as `layout.send_layout(topk_idx, plan, rank)[1:]` followed by `layout.receive_positions(C, key,
    rank, E_loc)`, with C = `layout.group_counts(plan)`; with region_rows, then inv int64[A] (per assignment, as
    `layout.own_rows`); with offsets_rows, then offs_main int32[E_loc], offs_slot int32[G - E_loc], n_main and
    n_slot int64[1]: the cumulative sums and totals of `layout.received_sizes(C, rank, E_loc)`, each clamped to
    offsets_rows (the grouped GEMMs' offsets and row counts in a region of that many rows). No host
    synchronisation; graph-capturable."""
    if triton is None:
        raise RuntimeError("fused_layout needs Triton (backend cuda)")
    e = topk_idx.reshape(-1)
    A = e.numel()
    R, E, N = plan.num_ranks, plan.num_experts, plan.num_slots
    E_loc, G = E // R, C.shape[2]
    dev = e.device
    first, key_start, recv_start, inst_start, rep_first, rep_count, rep_list, offs_main, offs_slot, n, ok = _tables(
        e, plan, rank, C, offsets_rows if offsets_rows is not None else A)
    # the positions are a permutation only if the plan routes exactly this rank's assignments of every expert
    # (C1) and nothing to an empty slot (which would shift the later keys): checked on the device (the kernel
    # leaves out positions outside [0, A) rather than write there)
    torch._assert_async(ok.all(), "fused_layout: the plan's route does not match this rank's assignments of every "
                        "expert (or routes some to an empty slot)")
    order, key, dest, pos = (torch.empty(A, dtype=torch.int64, device=dev) for _ in range(4))
    is_slot = torch.empty(A, dtype=torch.int8, device=dev)
    inv = torch.empty(A if region_rows is not None else 0, dtype=torch.int64, device=dev)
    nb = triton.cdiv(A, BLOCK) if A else 0
    if nb:
        _layout_kernel[(nb,)](e, first, plan.route[rank].contiguous(), plan.instance_rank.contiguous(), inst_start,
                              rep_first, rep_count, rep_list, key_start, recv_start, order, key, dest, pos, is_slot,
                              inv if region_rows is not None else order, rank, region_rows or 0, A, E, E_loc,
                              max(N, 1), G, nb, B=BLOCK, INV=region_rows is not None)
    out = (key, order, dest, pos, is_slot.view(torch.bool))
    if region_rows is not None:
        out += (inv,)
    if offsets_rows is not None:
        out += (offs_main, offs_slot, n[0:1], n[1:2])
    return out


def tables_triton(topk_idx: torch.Tensor, plan: Plan, rank: int, C: torch.Tensor) -> tuple:
    """`_tables_kernel`'s tables alone, as `tables_reference` returns them (tests/layout_triton_check.py)."""
    e = topk_idx.reshape(-1)
    first, *tables, _, _, _, ok = _tables(e, plan, rank, C, e.numel())
    tables[5] = tables[5][:-1]
    return (*tables, first[:, :triton.cdiv(e.numel(), BLOCK)], bool(ok.all()))


def tables_reference(topk_idx: torch.Tensor, plan: Plan, rank: int, C: torch.Tensor) -> tuple:
    """What `_tables_kernel` makes, in torch: (key_start, recv_start, inst_start, rep_first, rep_count, rep_list[:S],
    first int64[E, blocks of BLOCK assignments]: each block's first ordinal of each expert, ok: the route routes
    exactly this rank's assignments of every expert, and nothing to an empty slot)."""
    e = topk_idx.reshape(-1)
    A, E, R = e.numel(), plan.num_experts, plan.num_ranks
    route, inst_expert = plan.route[rank], plan.instance_expert
    mine = C[rank].reshape(-1)
    inst_start, rep_first, rep_count, rep_list = instance_tables(route, inst_expert, E)
    nb = (A + BLOCK - 1) // BLOCK
    blocks = torch.cat([e, e.new_full((nb * BLOCK - A,), E)]).view(nb, BLOCK)
    counts = (blocks[:, :, None] == torch.arange(E, device=e.device)).sum(1).t()  # [E, nb]
    routed = torch.zeros(E, dtype=torch.int64, device=e.device).index_add_(
        0, inst_expert.clamp(min=0), torch.where(inst_expert >= 0, route, 0))
    ok = bool((routed == counts.sum(1)).all()) and int(route.sum()) == A
    return (torch.cumsum(mine, 0) - mine, receive_starts(C, rank, E // R), inst_start, rep_first, rep_count,
            rep_list[:-1], torch.cumsum(counts, 1) - counts, ok)
