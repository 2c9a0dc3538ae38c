"""CUDA symmetric memory (`torch.distributed._symmetric_memory`, peer pointers over NVLink) and the
Triton kernels of the `cuda` backend: every transfer is a kernel that stores straight into a peer's
buffer, every size it needs is read on the device, and a symmetric-memory barrier publishes the stores.
Nothing here reads a tensor value on the host, so the layer needs no host synchronisation and its
forward can be captured in a CUDA graph.

Buffers of one EP group (one `SymmWorkspace`, shared by every layer of the process):
    counts[2]       int64[R, n]      two all-gather buffers used alternately (one barrier per gather)
    recv_main       [cap, H]         rows for this rank's main experts, group-major (layout.py)
    recv_slot       [cap, H]         rows for its replica slots, group-major
    meta_main/slot  int64[cap]       for each received row: source rank * A_cap + its assignment index
    back            [A_cap, H]       combine target: rows come home to their assignment index
    stage, stage2   [A_cap, H]       (with a capacity) this rank's spilled rows, in its send order (spill.py)
    stage_meta      int64[A_cap]     their assignment indices
    pool fc1/fc2    [N, 2F, H], [N, H, F]   the replica slots (a symmetric `ReplicaPool`)
    ret fc1/fc2     [R * N, 2F * H], [R * N, H * F]   the gradient-return regions: slot j of source s
                                      writes region s * N + j of the expert's main rank (paper 3.2)
The receive buffers hold one region per chunk of tokens (`regions`, rows each; cap = their sum). Without a
capacity a region holds the chunk's worst case, R times its rows per rank, so no row is ever dropped. With one
(`capacity_factor`: the planner's capacity step fits the plan to it) a region holds the capacity, and a row
beyond its region's end is staged by its source instead (`stage`) and computed on the spill path (spill.py).

Peer pointers work only inside one NVLink domain (one host here). Kernels loop over rows with a
persistent grid, reading the row count from the device.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from topoep.relay import max_children
from topoep.runtime.pool import SlotBanks

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only environments: the module imports, the kernels are unavailable
    triton = None

ROW_PROGRAMS_PER_SM = 8
COPY_CHUNK = 8192  # elements per program of the weight and gradient copies
COPY_WARPS = 4  # warps per program of those copies (Triton's default); bench/replica_copy.py tries others

if triton is not None:

    @triton.jit
    def _copy_row(dst, src, H: tl.constexpr, BLOCK_H: tl.constexpr):
        """dst[:H] = src[:H] (one row, BLOCK_H elements at a time)."""
        offs = tl.arange(0, BLOCK_H)
        for h0 in tl.static_range(0, H, BLOCK_H):
            m = h0 + offs < H
            tl.store(dst + h0 + offs, tl.load(src + h0 + offs, mask=m), mask=m)

    @triton.jit
    def _copy_row_scaled(dst, src, scale, H: tl.constexpr, BLOCK_H: tl.constexpr):
        """dst[:H] = src[:H] * scale (fp32 product, one rounding to dst's type)."""
        offs = tl.arange(0, BLOCK_H)
        for h0 in tl.static_range(0, H, BLOCK_H):
            m = h0 + offs < H
            v = tl.load(src + h0 + offs, mask=m).to(tl.float32) * scale
            tl.store(dst + h0 + offs, v.to(dst.dtype.element_ty), mask=m)

    @triton.jit
    def _gather_row_kernel(src, n, bases, me, BLOCK: tl.constexpr):
        """Row `me` of every peer's buffer (int64[R, n]) <- src[:n]: program r writes rank r's copy."""
        r = tl.program_id(0)
        base = tl.load(bases + r).to(tl.pointer_type(tl.int64))
        for c in range(0, n, BLOCK):
            offs = c + tl.arange(0, BLOCK)
            m = offs < n
            tl.store(base + me * n + offs, tl.load(src + offs, mask=m), mask=m)

    @triton.jit
    def _dispatch_kernel(src, order, row_div, dest, pos, is_slot, meta_base, main_bases, slot_bases,
                         main_meta_bases, slot_meta_bases, overflow, n_rows, region_end, scale, stage, stage_meta,
                         stage_base, src2, stage2, me, local_main, local_slot, local_base, H: tl.constexpr,
                         BLOCK_H: tl.constexpr, HAS_SCALE: tl.constexpr, SPILL: tl.constexpr, HAS_SRC2: tl.constexpr,
                         LOCAL: tl.constexpr):
        """Send row i: src[order[i] // row_div] (times scale[order[i]] with HAS_SCALE) -> row pos[i] of rank
        dest[i]'s main or slot buffer, and meta_base + order[i] (the row's way home) into the matching meta
        buffer. With LOCAL, a row for this rank (`me`) goes to row pos[i] - local_base of local_main / local_slot
        (this rank's own tensors) instead. A row at or beyond region_end spills (SPILL): it goes to this rank's own
        stage[stage_base + i] instead, its assignment index to stage_meta, and with HAS_SRC2 src2's row (the input)
        to stage2."""
        for i in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            a = tl.load(order + i)
            d = tl.load(dest + i)
            p = tl.load(pos + i)
            slot = tl.load(is_slot + i) != 0
            if p < region_end:
                rows = tl.where(slot, tl.load(slot_bases + d), tl.load(main_bases + d)).to(
                    tl.pointer_type(src.dtype.element_ty))
                row = p
                if LOCAL:
                    if d == me:
                        rows = tl.where(slot, local_slot, local_main)
                        row = p - local_base
                metas = tl.where(slot, tl.load(slot_meta_bases + d), tl.load(main_meta_bases + d)).to(
                    tl.pointer_type(tl.int64))
                if HAS_SCALE:
                    _copy_row_scaled(rows + row * H, src + (a // row_div) * H, tl.load(scale + a).to(tl.float32), H,
                                     BLOCK_H)
                else:
                    _copy_row(rows + row * H, src + (a // row_div) * H, H, BLOCK_H)
                tl.store(metas + p, meta_base + a)
            elif SPILL:
                ii = (stage_base + i).to(tl.int64)  # stage + ii * H passes 2^31 elements at ~300k rows of H 7168
                if HAS_SCALE:
                    _copy_row_scaled(stage + ii * H, src + (a // row_div) * H, tl.load(scale + a).to(tl.float32), H,
                                     BLOCK_H)
                else:
                    _copy_row(stage + ii * H, src + (a // row_div) * H, H, BLOCK_H)
                if HAS_SRC2:
                    _copy_row(stage2 + ii * H, src2 + (a // row_div) * H, H, BLOCK_H)
                tl.store(stage_meta + ii, a)
            else:
                tl.atomic_add(overflow, 1)

    @triton.jit
    def _combine_kernel(y, meta, n_ptr, back_bases, a_cap, cap, me, H: tl.constexpr, BLOCK_H: tl.constexpr,
                        SKIP_LOCAL: tl.constexpr):
        """Received row r (r < n = the device count of rows) goes home: y[r] -> row a of source s's
        `back` buffer, where meta[r] = s * a_cap + a; with SKIP_LOCAL not this rank's own rows (s == me: read
        in place by the weighting)."""
        for r in range(tl.program_id(0), tl.minimum(tl.load(n_ptr), cap), tl.num_programs(0)):
            r = r.to(tl.int64)
            mv = tl.load(meta + r)
            s = mv // a_cap
            if (not SKIP_LOCAL) or s != me:
                out = tl.load(back_bases + s).to(tl.pointer_type(y.dtype.element_ty))
                _copy_row(out + (mv - s * a_cap) * H, y + r * H, H, BLOCK_H)

    @triton.jit
    def _copy_rows_kernel(dst, src, n_ptr, cap, meta, a_cap, me, H: tl.constexpr, BLOCK_H: tl.constexpr,
                          SKIP_LOCAL: tl.constexpr):
        """dst[:n] = src[:n] for a row count n read on the device (rows beyond n are left as they are); with
        SKIP_LOCAL not the rows this rank sent itself (meta[r] // a_cap == me: the dispatch wrote them to dst)."""
        for r in range(tl.program_id(0), tl.minimum(tl.load(n_ptr), cap), tl.num_programs(0)):
            r = r.to(tl.int64)
            if (not SKIP_LOCAL) or tl.load(meta + r) // a_cap != me:
                _copy_row(dst + r * H, src + r * H, H, BLOCK_H)

    @triton.jit
    def _chunk(lo, hi, c, CHUNK: tl.constexpr, ALIGN: tl.constexpr):
        """(start int64, offsets int32 [CHUNK], mask) of elements [lo + c * CHUNK, lo + (c + 1) * CHUNK) below hi: the
        start a scalar, the offsets from it 32-bit (int64 offsets per element cost a copy kernel twice the registers,
        and spills). ALIGN: the bytes every copy kernel's weight pointers are multiples of (`_aligned`: 16, or 2 for
        any bf16 pointer); with 16, lo and hi are multiples of 8 elements, the mask comes in runs of 8, and (the
        pointers declared so by tl.multiple_of where they are loaded or stored: a hint does not survive a function's
        return) a thread moves 16 bytes per access instead of 2."""
        start = lo + tl.cast(c, tl.int64) * CHUNK
        offs = tl.arange(0, CHUNK)
        lim = tl.minimum(tl.maximum(hi - start, 0), CHUNK).to(tl.int32)
        if ALIGN == 16:
            lim = tl.multiple_of(lim, 8)
        return start, offs, offs < lim

    @triton.jit
    def _copy_range(dst, src, lo, hi, c, CHUNK: tl.constexpr, ALIGN: tl.constexpr):
        """Elements [lo + c * CHUNK, lo + (c + 1) * CHUNK) of one expert weight below hi: dst <- src."""
        start, offs, m = _chunk(lo, hi, c, CHUNK, ALIGN)
        tl.store(tl.multiple_of(dst + start, ALIGN) + offs, tl.load(tl.multiple_of(src + start, ALIGN) + offs, mask=m),
                 mask=m)

    @triton.jit
    def _push_slots_kernel(slot_expert, source, level, step, chunks, span, main_ptrs, own_slots, pool_bases, me,
                           e_loc, N, numel, CHUNK: tl.constexpr, RELAY: tl.constexpr, ALIGN: tl.constexpr):
        """Replica fetch, pushed by the sender: slot (r, j) = rj of expert e gets e's weight in slot j of rank r's
        pool. Without RELAY the sender is e's main rank, sending its main weight (main_ptrs[e - me * e_loc]). With
        RELAY the sender is source[rj], and in fetch step `step` a slot of level l gets chunk k = step - (l - 1) of
        its weight if 0 <= k < chunks (elements [k span, (k + 1) span), topoep.relay.step_chunk / chunk_range): the
        sender's main weight when e is its own, else its own slot holding e (own_slots [N, numel], whose chunk k
        arrived in an earlier step)."""
        rj = tl.program_id(0)
        c = tl.program_id(1)
        e = tl.load(slot_expert + rj)
        if RELAY:
            k = step - (tl.load(level + rj) - 1)
            go = (e >= 0) & (k >= 0) & (k < chunks) & (tl.load(source + rj) == me)
        else:
            k = tl.full([], 0, tl.int32)
            go = (e >= 0) & (e // e_loc == me)
        if go:
            lo = k.to(tl.int64) * span
            hi = tl.minimum(lo + span, numel)
            dst = tl.load(pool_bases + rj // N).to(tl.pointer_type(tl.bfloat16)) + (rj % N).to(tl.int64) * numel
            if e // e_loc == me:
                src = tl.load(main_ptrs + (e - me * e_loc)).to(tl.pointer_type(tl.bfloat16))
                _copy_range(dst, src, lo, hi, c, CHUNK, ALIGN)
            else:  # a relay: my slot holding e (one at most: no duplicate instance on a rank)
                held = 0
                for j in range(N):
                    held = tl.where(tl.load(slot_expert + me * N + j) == e, j, held)
                _copy_range(dst, own_slots + held.to(tl.int64) * numel, lo, hi, c, CHUNK, ALIGN)

    @triton.jit
    def _wait_flag(flag, epoch):
        """Spin until flag (an int32 another rank sets with release semantics) reaches epoch; acquire: what the setter
        wrote before it is visible after."""
        v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
        while v < epoch:
            v = tl.atomic_add(flag, 0, sem="acquire", scope="sys")

    @triton.jit
    def _signal_flag(flag, epoch):
        """Set another rank's flag to epoch once every thread of the program stored its part (release: the stores
        before it are visible to whoever acquires the flag)."""
        tl.debug_barrier()
        tl.atomic_xchg(flag, epoch, sem="release", scope="sys")

    @triton.jit
    def _push_slots_async_kernel(items, count, slot_expert, main_ptrs, own_slots, pool_bases, flags, flag_bases,
                                 flag_row, epoch_ptr, me, e_loc, N, numel, n_chunks, chunk0,
                                 CHUNK: tl.constexpr, ALIGN: tl.constexpr):
        """Replica fetch copy by copy (LayerConfig.relay_schedule "async"): this rank's sends, items[:count] (slot
        indices r * N + j, in level order), each in chunks of CHUNK elements, chunk c by the program c % programs
        (persistent: every program walks the items in order, so it sends level l's chunks before it waits for any of
        level l + 1's, and no wait closes a cycle). A copy of one of my experts leaves from my main weight at once;
        a relayed one from my slot holding it, chunk by chunk as each arrives: flag (slot, chunk0 + c) of my flags
        (`flags`, int32 [., flag_row]) reaches this fetch's epoch. After a chunk, the receiver's flag of that slot and
        chunk is set to the epoch (its flag table: flag_bases[r])."""
        epoch = tl.load(epoch_ptr)
        n = tl.load(count)
        for i in range(n):
            rj = tl.load(items + i)
            e = tl.load(slot_expert + rj)
            r = rj // N
            j = rj % N
            dst = tl.load(pool_bases + r).to(tl.pointer_type(tl.bfloat16)) + j.to(tl.int64) * numel
            remote = tl.load(flag_bases + r).to(tl.pointer_type(tl.int32)) + j.to(tl.int64) * flag_row + chunk0
            mine = e // e_loc == me
            held = 0
            for jj in range(N):
                held = tl.where(tl.load(slot_expert + me * N + jj) == e, jj, held)
            if mine:
                src = tl.load(main_ptrs + (e - me * e_loc)).to(tl.pointer_type(tl.bfloat16))
            else:
                src = own_slots + held.to(tl.int64) * numel
            for c in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
                start, offs, m = _chunk(0, numel, c, CHUNK, ALIGN)
                if not mine:
                    _wait_flag(flags + held.to(tl.int64) * flag_row + chunk0 + c, epoch)
                    tl.debug_barrier()
                tl.store(tl.multiple_of(dst + start, ALIGN) + offs,
                         tl.load(tl.multiple_of(src + start, ALIGN) + offs, mask=m, cache_modifier=".cg"), mask=m)
                _signal_flag(remote + c, epoch)

    @triton.jit
    def _push_grads_async_kernel(items, count, slot_expert, source, children, pool, ret, ret_bases, flags,
                                 flag_bases, flag_row, epoch_ptr, me, N, numel, n_chunks, chunk0, FANOUT,
                                 CHUNK: tl.constexpr, ALIGN: tl.constexpr):
        """Gradient return copy by copy: my slots items[:count] (deepest level first), each in chunks of CHUNK
        elements (chunk c by the program c % programs, every program in item order: a copy of level l waits only
        for level l + 1's, which every rank sent first). A slot waits for each child's region of the chunk (its
        flag in my table, `flags` [R N, flag_row], set to this return's epoch), adds them in (child rank, slot)
        order onto its own gradient in fp32 (pool [N, numel], in place, as the level-by-level return adds them: the
        same bits), and sends the chunk to region me * N + t of the rank it fetched from, setting that region's flag
        there (flag_bases[parent])."""
        epoch = tl.load(epoch_ptr)
        n = tl.load(count)
        for i in range(n):
            t = tl.load(items + i)
            g = me * N + t
            to = tl.load(source + g)
            dst = tl.load(ret_bases + to).to(tl.pointer_type(tl.bfloat16)) + g.to(tl.int64) * numel
            remote = tl.load(flag_bases + to).to(tl.pointer_type(tl.int32)) + g.to(tl.int64) * flag_row + chunk0
            own = pool + t.to(tl.int64) * numel
            for c in range(tl.program_id(0), n_chunks, tl.num_programs(0)):
                start, offs, m = _chunk(0, numel, c, CHUNK, ALIGN)
                mine = tl.multiple_of(own + start, ALIGN) + offs
                out = tl.multiple_of(dst + start, ALIGN) + offs
                first = tl.load(children + t * FANOUT)
                if first >= 0:  # a relay: its subtree's sum
                    acc = tl.load(mine, mask=m).to(tl.float32)
                    for f in range(FANOUT):
                        sj = tl.load(children + t * FANOUT + f)
                        if sj >= 0:
                            _wait_flag(flags + sj.to(tl.int64) * flag_row + chunk0 + c, epoch)
                            tl.debug_barrier()
                            region = tl.multiple_of(ret + (sj.to(tl.int64) * numel + start), ALIGN)
                            acc += tl.load(region + offs, mask=m, cache_modifier=".cg").to(tl.float32)
                    tl.store(mine, acc.to(pool.dtype.element_ty), mask=m)
                    tl.store(out, acc.to(pool.dtype.element_ty), mask=m)
                else:
                    tl.store(out, tl.load(mine, mask=m), mask=m)
                _signal_flag(remote + c, epoch)

    @triton.jit
    def _push_grads_kernel(slot_expert, source, level, step, levels, chunks, span, pool, ret_bases, me, e_loc, N,
                           numel, CHUNK: tl.constexpr, RELAY: tl.constexpr, ALIGN: tl.constexpr):
        """Gradient return: my slot j's weight gradient -> region me * N + j of its expert's main rank; with RELAY
        to the rank it fetched from (source, its parent in the relay tree), in return step `step` chunk
        k = step - (levels - l) of a slot of level l, if 0 <= k < chunks (the fetch's steps, levels reversed)."""
        j = tl.program_id(0)
        c = tl.program_id(1)
        e = tl.load(slot_expert + me * N + j)
        if RELAY:
            lvl = tl.load(level + me * N + j)
            k = step - (levels - lvl)
            go = (e >= 0) & (lvl >= 1) & (k >= 0) & (k < chunks)
            to = tl.load(source + me * N + j)
        else:
            k = tl.full([], 0, tl.int32)
            go = e >= 0
            to = e // e_loc
        if go:
            lo = k.to(tl.int64) * span
            hi = tl.minimum(lo + span, numel)
            dst = tl.load(ret_bases + to).to(tl.pointer_type(tl.bfloat16)) + (me * N + j).to(tl.int64) * numel
            _copy_range(dst, pool + j.to(tl.int64) * numel, lo, hi, c, CHUNK, ALIGN)

    @triton.jit
    def _reduce_grads_kernel(slot_expert, source, level, lv, step, levels, chunks, span, ret, grad, me, e_loc, N, RN,
                             numel, CHUNK: tl.constexpr, RELAY: tl.constexpr, SLOTS: tl.constexpr,
                             ALIGN: tl.constexpr):
        """grad[t] += the returned regions of its expert, in (source, slot) order, accumulated in fp32 (a fixed
        order: the result does not depend on timing). Target t is my main expert me * e_loc + t, or with SLOTS my
        slot t (a relay node of level l, expert slot_expert[me * N + t]). Without RELAY every region of the expert
        counts; with RELAY only those of the children's level sent to me (the target's children in the relay tree):
        level lv for my main experts (whole weights), l + 1 for a slot, whose chunk k = step - (levels - l) (the one
        it sends on in return step `step`) if 0 <= k < chunks."""
        t = tl.program_id(0)
        c = tl.program_id(1)
        lo = tl.full([], 0, tl.int64)
        hi = lo + numel
        if SLOTS:
            e = tl.load(slot_expert + me * N + t)
            lvl = tl.load(level + me * N + t)
            k = step - (levels - lvl)
            e = tl.where((k >= 0) & (k < chunks), e, -1)
            child = lvl + 1
            lo = k.to(tl.int64) * span
            hi = tl.minimum(lo + span, numel)
        else:
            e = me * e_loc + t
            child = lv
        hits = 0
        for sj in range(RN):
            hit = tl.load(slot_expert + sj) == e
            if RELAY:
                hit = hit & (tl.load(level + sj) == child) & (tl.load(source + sj) == me)
            hits += hit.to(tl.int32)
        if (e >= 0) & (hits > 0):
            start, offs, m = _chunk(lo, hi, c, CHUNK, ALIGN)
            g = tl.multiple_of(grad + (t.to(tl.int64) * numel + start), ALIGN) + offs
            acc = tl.load(g, mask=m).to(tl.float32)
            for sj in range(RN):
                hit = tl.load(slot_expert + sj) == e
                if RELAY:
                    hit = hit & (tl.load(level + sj) == child) & (tl.load(source + sj) == me)
                if hit:
                    acc += tl.load(tl.multiple_of(ret + (tl.cast(sj, tl.int64) * numel + start), ALIGN) + offs,
                                   mask=m).to(tl.float32)
            tl.store(g, acc.to(grad.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_fwd_kernel(h, act, n_ptr, cap, F: tl.constexpr, BLOCK_F: tl.constexpr):
        """act[r] = silu(h[r, :F]) * h[r, F:] for rows r < n (device count), in fp32, one rounding."""
        offs = tl.arange(0, BLOCK_F)
        m = offs < F
        for r in range(tl.program_id(0), tl.minimum(tl.load(n_ptr), cap), tl.num_programs(0)):
            r = r.to(tl.int64)
            g = tl.load(h + r * 2 * F + offs, mask=m).to(tl.float32)
            u = tl.load(h + r * 2 * F + F + offs, mask=m).to(tl.float32)
            tl.store(act + r * F + offs, (g * tl.sigmoid(g) * u).to(act.dtype.element_ty), mask=m)

    @triton.jit
    def _swiglu_bwd_kernel(grad_act, h, grad_h, act, n_ptr, cap, F: tl.constexpr, BLOCK_F: tl.constexpr):
        """grad_h[r] = (d act / d gate, d act / d up) * grad_act[r] for rows r < n (device count), and act[r], the
        activation (as _swiglu_fwd_kernel computes it, bit for bit), which the weight gradient reads: h is read
        once for both."""
        offs = tl.arange(0, BLOCK_F)
        m = offs < F
        for r in range(tl.program_id(0), tl.minimum(tl.load(n_ptr), cap), tl.num_programs(0)):
            r = r.to(tl.int64)
            ga = tl.load(grad_act + r * F + offs, mask=m).to(tl.float32)
            g = tl.load(h + r * 2 * F + offs, mask=m).to(tl.float32)
            u = tl.load(h + r * 2 * F + F + offs, mask=m).to(tl.float32)
            sg = tl.sigmoid(g)
            tl.store(grad_h + r * 2 * F + offs, (ga * u * sg * (1 + g * (1 - sg))).to(grad_h.dtype.element_ty), mask=m)
            tl.store(grad_h + r * 2 * F + F + offs, (ga * g * sg).to(grad_h.dtype.element_ty), mask=m)
            tl.store(act + r * F + offs, (g * sg * u).to(act.dtype.element_ty), mask=m)


def _int8(flags: torch.Tensor) -> torch.Tensor:
    """A bool tensor as int8 (a view where it can be one: no kernel)."""
    return flags.view(torch.int8) if flags.dtype == torch.bool and flags.is_contiguous() else flags.to(torch.int8)


def _pow2(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def _row_grid(device) -> int:
    return ROW_PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count


def swiglu_act(h: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[cap, F] SwiGLU activation of h [cap, 2F] for its first n rows (n int64[1] on the device; the rest
    of the result is uninitialised). Reference: `experts.swiglu_act_reference`."""
    cap, F2 = h.shape
    act = h.new_empty(cap, F2 // 2)
    _swiglu_fwd_kernel[(_row_grid(h.device),)](h, act, n, cap, F=F2 // 2, BLOCK_F=_pow2(F2 // 2))
    return act


def swiglu_act_grad(grad_act: torch.Tensor, h: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """([cap, 2F] gradient of h, [cap, F] activation) for the first n rows, in one pass over h (the activation is
    `swiglu_act`'s, bit for bit). References: `experts._act_grads`, `experts.swiglu_act_reference`."""
    cap, F2 = h.shape
    grad_h = torch.empty_like(h)
    act = h.new_empty(cap, F2 // 2)
    _swiglu_bwd_kernel[(_row_grid(h.device),)](grad_act, h, grad_h, act, n, cap, F=F2 // 2, BLOCK_F=_pow2(F2 // 2))
    return grad_h, act


class SymmBuffer:
    """One symmetric allocation of this group: the local tensor, its handle, and a device table of the
    peers' addresses of the same tensor (for kernels)."""

    def __init__(self, shape, dtype, device, group):
        from torch.distributed import _symmetric_memory as symm_mem

        self.tensor = symm_mem.empty(*shape, dtype=dtype, device=device)
        self.handle = symm_mem.rendezvous(self.tensor, group)
        R = self.world_size = self.handle.world_size
        ptrs = [self.handle.get_remote_tensor(r, tuple(shape), dtype).data_ptr() for r in range(R)]
        if ptrs[self.handle.rank] != self.tensor.data_ptr():
            raise RuntimeError("symmetric memory: this rank's remote view does not start at its own tensor "
                               f"({ptrs[self.handle.rank]:#x} != {self.tensor.data_ptr():#x})")
        self.ptrs = torch.tensor(ptrs, dtype=torch.int64).to(device)

    def barrier(self, channel: int = 0) -> None:
        """Every rank's earlier work on its current stream is complete everywhere after it. Nothing with one rank:
        the stream's own order is the barrier (and a launch less on the host)."""
        if self.world_size > 1:
            self.handle.barrier(channel=channel)


class SymmWorkspace:
    """The symmetric buffers of one EP group (module docstring), created once per (group, sizes) and
    shared by every layer. Creating one is collective: every rank of the group must do it at the same
    point (the first forward)."""

    async_combine = True  # combine may run on a side stream (its barrier is on its own stream; no host work)
    in_place = True  # this rank's own rows can stay here: dispatch(local=), copy_rows(skip_local), combine(skip_local)

    _shared: dict = {}

    def __init__(self, group, num_groups: int, experts_per_rank: int, count_width: int, a_cap: int, hidden: int,
                 dtype, device, regions: tuple[int, ...] | None = None, spills: bool = False):
        if triton is None:
            raise RuntimeError("backend 'cuda' needs triton (pip install triton)")
        self.group = group or dist.group.WORLD
        self.R, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.G, self.e_loc, self.a_cap, self.H = num_groups, experts_per_rank, a_cap, hidden
        self.regions = tuple(regions) if regions is not None else (self.R * a_cap,)
        self.cap = sum(self.regions)
        self.device = torch.device(device)
        self.dtype = dtype
        self.count_width = count_width
        new = lambda *shape, dt=dtype: SymmBuffer(shape, dt, self.device, self.group)  # noqa: E731
        self.counts = [new(self.R, count_width, dt=torch.int64) for _ in range(2)]
        self.recv_main, self.meta_main = new(self.cap, hidden), new(self.cap, dt=torch.int64)
        has_slots = num_groups > experts_per_rank
        self.recv_slot = new(self.cap, hidden) if has_slots else None  # no slots: is_slot is never set
        self.meta_slot = new(self.cap, dt=torch.int64) if has_slots else None
        self.back = new(a_cap, hidden)
        self.spills = spills  # a region smaller than its worst case: rows may spill (staged here, spill.py)
        self.stage = new(a_cap, hidden) if self.spills else None
        self.stage2 = new(a_cap, hidden) if self.spills else None
        self.stage_meta = new(a_cap, dt=torch.int64) if self.spills else None
        self.spilled_rows = torch.zeros(1, dtype=torch.int64, device=self.device)  # received on the spill path (forward)
        self.overflow = torch.zeros(1, dtype=torch.int32, device=self.device)
        self.row_grid = _row_grid(self.device)
        self.block_h = min(4096, _pow2(hidden))

    @classmethod
    def shared(cls, group, num_groups, experts_per_rank, count_width, a_cap, hidden, dtype, device, regions=None,
               spills=False):
        name = (group or dist.group.WORLD).group_name
        key = (name, num_groups, experts_per_rank, count_width, a_cap, hidden, dtype, torch.device(device),
               tuple(regions) if regions is not None else None, spills)
        ws = cls._shared.get(key)
        if ws is None:
            ws = cls._shared[key] = cls(group, num_groups, experts_per_rank, count_width, a_cap, hidden, dtype, device,
                                        regions, spills)
        return ws

    @property
    def nbytes(self) -> int:
        """Bytes of this workspace's symmetric buffers (outside torch's caching allocator)."""
        bufs = [*self.counts, self.recv_main, self.meta_main, self.recv_slot, self.meta_slot, self.back, self.stage,
                self.stage2, self.stage_meta]
        return sum(b.tensor.numel() * b.tensor.element_size() for b in bufs if b is not None)

    # -- small metadata ------------------------------------------------------------------------
    def all_gather(self, row: torch.Tensor, which: int) -> torch.Tensor:
        """int64[n] (n <= count_width) on every rank -> int64[R, n], the same on every rank. `which` (0 or
        1) picks the buffer. A rank may write buffer b again only after every rank copied it out: callers
        either alternate buffers (each rank copies b out before the barrier of the gather in between) or,
        like the layer (omega in buffer 0 once per call), put another barrier of the group between two
        gathers into one buffer (the dispatch's). One barrier per gather."""
        n = row.numel()
        buf = self.counts[which]
        _gather_row_kernel[(self.R,)](row.contiguous(), n, buf.ptrs, self.rank, BLOCK=min(1024, _pow2(max(n, 16))))
        buf.barrier(channel=0)
        return buf.tensor.view(-1)[: self.R * n].view(self.R, n).clone()

    # -- token rows ----------------------------------------------------------------------------
    def dispatch(self, src: torch.Tensor, order: torch.Tensor, row_div: int, dest: torch.Tensor, pos: torch.Tensor,
                 is_slot: torch.Tensor, join: torch.cuda.Event | None = None,
                 scale: torch.Tensor | None = None, region_end: int | None = None, stage_base: int = 0,
                 src2: torch.Tensor | None = None, local: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Send row i (src[order[i] // row_div], times scale[order[i]] when scale is given: one fp32 product
        rounded to src's type) to row pos[i] of rank dest[i]'s main or slot buffer. A row at or beyond region_end
        (the end of its chunk's region; default the buffers' end) is staged here instead, at stage_base + i (the
        spill path, spill.py), with src2's row (the input, in backward) beside it.
        With `local` = (main [rows, H], slot [rows, H] or None, base), the rows this rank sends itself go to row
        pos[i] - base of those tensors instead of its receive buffers (`copy_rows(skip_local=True)` then adds the
        other ranks' rows).
        Returns this rank's (recv_main, recv_slot), complete (rows beyond the received counts are stale).
        join: an event of work that must be published with the rows (a replica fetch on a side stream):
        waited for before the closing barrier."""
        A = order.numel()
        slot, slot_meta = self.recv_slot or self.recv_main, self.meta_slot or self.meta_main
        self.recv_main.barrier(channel=0)  # every rank is done with the previous contents
        if A:
            stage = self.stage.tensor if self.spills else src
            lmain, lslot, lbase = local if local is not None else (src, None, 0)
            _dispatch_kernel[(min(A, self.row_grid),)](
                src.contiguous(), order, row_div, dest, pos, _int8(is_slot), self.rank * self.a_cap,
                self.recv_main.ptrs, slot.ptrs, self.meta_main.ptrs, slot_meta.ptrs, self.overflow,
                A, self.cap if region_end is None else region_end, scale if scale is not None else order,
                stage, self.stage_meta.tensor if self.spills else order, stage_base,
                src2.contiguous() if src2 is not None else src, self.stage2.tensor if self.spills else src,
                self.rank, lmain, lmain if lslot is None else lslot, lbase,
                H=self.H, BLOCK_H=self.block_h, HAS_SCALE=scale is not None, SPILL=self.spills,
                HAS_SRC2=src2 is not None and self.spills, LOCAL=local is not None)
        if join is not None:
            torch.cuda.current_stream(src.device).wait_event(join)
        self.recv_main.barrier(channel=1)
        return self.recv_main.tensor, (self.recv_slot.tensor if self.recv_slot is not None else None)

    def combine(self, y_main: torch.Tensor, y_slot: torch.Tensor | None, n_main: torch.Tensor,
                n_slot: torch.Tensor | None, num_rows: int, copy: bool = True, base: int = 0,
                out: torch.Tensor | None = None, skip_local: bool = False) -> torch.Tensor:
        """The reverse of dispatch: every received row goes back to its source's assignment index.
        n_main, n_slot: int64[1] rows received (device); y_slot None without slots; base: the first row of
        the rows' region in the receive buffers (a chunk's: y_main and y_slot hold that region). Returns a new
        [num_rows, H] tensor, or with copy=False the workspace's own rows (read them before this stream's
        next dispatch or combine: the rows of every chunk combined since). `out` is the a2a workspace's. With
        skip_local, this rank's own rows stay where they are (the weighting reads them in place: weighting.py's
        `local`); with one rank nothing moves and nothing is launched."""
        if skip_local and self.R == 1:
            rows = self.back.tensor[:num_rows]
            return rows.clone() if copy else rows
        for y, meta, n in ((y_main, self.meta_main, n_main), (y_slot, self.meta_slot, n_slot)):
            if y is None:
                continue
            _combine_kernel[(self.row_grid,)](y, meta.tensor[base:], n, self.back.ptrs, self.a_cap, self.cap - base,
                                              self.rank, H=self.H, BLOCK_H=self.block_h, SKIP_LOCAL=skip_local)
        self.back.barrier(channel=0)
        rows = self.back.tensor[:num_rows]
        return rows.clone() if copy else rows

    def spill(self, work, main: tuple, slot: tuple | None, backward: bool = False) -> None:
        """The spill path's expert compute on this rank (spill.py): every row spilled to it, read from its source's
        staging, computed with main = (W1, W2) or slot's weights, and its result (forward: the output; backward:
        the input gradient, from the staged input and output gradient) written into the source's `back` at its
        assignment index. Call it after the dispatch, before the combine's barrier. Nothing when nothing can
        spill (no capacity); a launch that finds no row when nothing did."""
        if not self.spills:
            return
        from topoep.runtime.spill import spill_rows

        if backward:  # the dispatch staged the output gradient in stage, the input in stage2
            spill_rows(work, self.stage2.ptrs, self.stage_meta.ptrs, self.back.ptrs, main, slot, gs_bases=self.stage.ptrs)
        else:
            spill_rows(work, self.stage.ptrs, self.stage_meta.ptrs, self.back.ptrs, main, slot)
            self.spilled_rows += work.rows

    def spill_wgrad(self, work, main: tuple, main_grads: tuple, groups: tuple[int, int], slot: tuple | None = None,
                    slot_grads: tuple | None = None) -> None:
        """Adds the weight gradients of the rows spilled to this rank in local groups [lo, hi) to main_grads (main
        groups) / slot_grads (slot groups): after the backward's spill, before any rank's next dispatch (which
        restages)."""
        if not self.spills:
            return
        from topoep.runtime.spill import spill_wgrad

        spill_wgrad(work, self.stage2.ptrs, self.stage.ptrs, main, main_grads, *groups, slot, slot_grads)

    def copy_rows(self, src: torch.Tensor, n: torch.Tensor, dst: torch.Tensor | None = None,
                  meta: torch.Tensor | None = None) -> torch.Tensor:
        """A non-symmetric copy of src's first n rows (n on the device) in a tensor of src's shape (or into dst).
        With `meta` (the rows' meta buffer, from the same row), the rows this rank sent itself are left out: a
        dispatch with `local=dst` already wrote them there; with one rank that is every row, and nothing is launched."""
        dst = torch.empty_like(src) if dst is None else dst
        if meta is not None and self.R == 1:
            return dst
        _copy_rows_kernel[(self.row_grid,)](dst, src, n, src.shape[0], meta if meta is not None else n, self.a_cap,
                                            self.rank, H=src.shape[1], BLOCK_H=_pow2(src.shape[1]),
                                            SKIP_LOCAL=meta is not None)
        return dst


def async_send_items(se: torch.Tensor, source: torch.Tensor, level: torch.Tensor, levels: int,
                     me: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(items int64[R N], count int64 0-d): the slots rank `me` sends to in a copy-by-copy fetch (source == me), in
    level order then slot order, first in `items` (`_push_slots_async_kernel`). On the device, no host sync."""
    RN = se.numel()
    idx = torch.arange(RN, device=se.device)
    mine = (se >= 0) & (source == me)
    return torch.argsort(torch.where(mine, level * RN + idx, (levels + 1) * RN + idx)), mine.sum()


def async_return_tables(se: torch.Tensor, source: torch.Tensor, level: torch.Tensor, levels: int, me: int, N: int,
                        fanout: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(items int64[N], count int64 0-d, children int64[N, F]) of rank `me` in a copy-by-copy gradient return
    (`_push_grads_async_kernel`): its occupied slots, deepest level first, then in slot order; and per slot the
    copies fetched from it (its children in the relay trees of `fanout`: at most F = `topoep.relay.max_children`, over
    NVLink and over the NIC), in slot order, -1 after the last. A child holds the same expert, fetched from `me` one
    level deeper (the level-by-level return's rule, `_reduce`):
    where `me` is the expert's home and also holds a copy of it in a slot (the capacity step's copy on its home rank,
    level 1 from itself), the copies fetched from the home are not that slot's children, nor is the slot itself
    (its gradient and theirs go to the home's regions, which `reduce_grads` adds). On the device, no host sync."""
    if isinstance(fanout, bool) or not isinstance(fanout, int) or fanout < 1:
        raise ValueError(f"the copy-by-copy gradient return needs the trees' fanout (RelayTrees.fanout >= 1), got "
                         f"{fanout!r}")
    dev, RN = se.device, se.numel()
    my_se, my_lvl = se[me * N:(me + 1) * N], level[me * N:(me + 1) * N]
    t = torch.arange(N, device=dev)
    occ = my_se >= 0
    items = torch.argsort(torch.where(occ, (levels - my_lvl) * N + t, (levels + 1) * N + t))
    match = (((se >= 0) & (source == me))[None, :] & (se[None, :] == my_se[:, None]) & occ[:, None]
             & (level[None, :] == my_lvl[:, None] + 1))
    pos = match.cumsum(1) - 1
    F = max_children(fanout)
    table = torch.full((N, F + 1), -1, dtype=torch.int64, device=dev)  # the last column takes the rest (none)
    table.scatter_(1, torch.where(match & (pos < F), pos, F),
                   torch.where(match, torch.arange(RN, device=dev).expand(N, RN), -1))
    return items, occ.sum(), table[:, :F].contiguous()


def _aligned(numel: int, span: int, *tensors: torch.Tensor) -> int:
    """The copy kernels' ALIGN: 16 (bytes) where every expert weight of numel elements and every chunk of span starts
    at a multiple of 8 bf16 elements of tensors that start 16-byte aligned (host metadata, no synchronisation; a
    peer's symmetric buffer sits as this rank's does), else 2 (a thread then moves one element per access)."""
    ok = numel % 8 == 0 and span % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in tensors)
    return 16 if ok else 2


def _expert_ptrs(stacked: torch.Tensor) -> torch.Tensor:
    """int64[E_loc] device addresses of each expert of a stacked weight, computed on the device."""
    n = stacked.shape[0]
    return torch.arange(n, dtype=torch.int64, device=stacked.device) * (stacked[0].numel() * stacked.element_size()) \
        + stacked.data_ptr()


class SymmReplicaPool(SlotBanks):
    """A `ReplicaPool` whose slots live in symmetric memory, with the gradient-return regions beside
    it (module docstring). Per bank b (`pool.SlotBanks`: 1, or 2 with the backward prefetch):
    `bank_weights(b)` = fc1 [N, 2F, H], fc2 [N, H, F]; ret1 [R * N, 2F * H], ret2 [R * N, H * F]."""

    _shared: dict = {}
    async_fetch = True  # fetch may run on a side stream beside the dispatch (no collective inside)

    def __init__(self, group, num_slots: int, hidden_size: int, ffn_hidden_size: int, dtype, device, banks: int = 1):
        if dtype != torch.bfloat16:
            raise ValueError(f"backend 'cuda' moves bf16 expert weights; got {dtype} (run the model in bf16)")
        self.init_banks(banks)
        self.group = group or dist.group.WORLD
        R, self.rank = self._world()
        self.num_slots = num_slots
        H, F = hidden_size, ffn_hidden_size
        for name, shape, dt in self.buffer_shapes(R, num_slots, H, F, dtype, banks):
            setattr(self, name, self._buffer(shape, dt, device))
        self._banked = [b.tensor.view(banks, num_slots, *b.tensor.shape[1:]) for b in (self._fc1, self._fc2)]
        self.fc1, self.fc2 = self.bank_weights(0)
        # the copy-by-copy fetch and return (relay_schedule "async"): a flag per (slot, chunk of fc1 then fc2), set by
        # the sender to the transfer's epoch (a counter per bank, and one for the returns, the same on every rank)
        self._flag_row = self._fetch_flags.tensor.shape[1]
        for flags in (self._fetch_flags, self._ret_flags):
            flags.tensor.zero_()
        self._fetch_flags.barrier()  # every rank zeroed its flags before any rank can set one
        self._fetch_flag_ptrs = [self._fetch_flags.ptrs + b * num_slots * self._flag_row * 4 for b in range(banks)]
        self._fetch_epoch = torch.zeros(banks, dtype=torch.int32, device=device)
        self._ret_epoch = torch.zeros(1, dtype=torch.int32, device=device)
        self._programs = self._num_programs(device)
        # the peers' addresses of each bank (made once: a fetch adds no tensor op)
        self._bank_ptrs = [[buf.ptrs + b * num_slots * buf.tensor[0].numel() * buf.tensor.element_size()
                            for b in range(banks)] for buf in (self._fc1, self._fc2)]

    @staticmethod
    def buffer_shapes(R: int, num_slots: int, hidden_size: int, ffn_hidden_size: int, dtype,
                      banks: int) -> list[tuple[str, tuple, torch.dtype]]:
        """(attribute, shape, dtype) of every symmetric buffer of a pool, in the order it makes them: the slots of
        every bank (fc1, fc2), the gradient-return regions (ret1, ret2), and the copy-by-copy flags (per slot of every
        bank, and per region), a flag per chunk of COPY_CHUNK elements of fc1 then of fc2."""
        N, H, F = num_slots, hidden_size, ffn_hidden_size
        row = -(-2 * F * H // COPY_CHUNK) + -(-H * F // COPY_CHUNK)
        return [("_fc1", (banks * N, 2 * F, H), dtype), ("_fc2", (banks * N, H, F), dtype),
                ("ret1", (R * N, 2 * F * H), dtype), ("ret2", (R * N, H * F), dtype),
                ("_fetch_flags", (banks * N, row), torch.int32), ("_ret_flags", (R * N, row), torch.int32)]

    def _world(self) -> tuple[int, int]:
        """(ranks, this rank) of the pool's group."""
        return dist.get_world_size(self.group), dist.get_rank(self.group)

    def _buffer(self, shape: tuple, dtype, device) -> "SymmBuffer":
        """One symmetric buffer of the group (collective: every rank makes the same ones in the same order)."""
        return SymmBuffer(shape, dtype, device, self.group)

    @staticmethod
    def _num_programs(device) -> int:
        """The copy-by-copy kernels' persistent grid: one program per SM (all resident at once, so a program that
        waits never keeps an earlier level's chunk from being sent)."""
        return torch.cuda.get_device_properties(device).multi_processor_count

    @classmethod
    def shared(cls, group, num_slots, hidden_size, ffn_hidden_size, dtype, device, banks: int = 1):
        name = (group or dist.group.WORLD).group_name
        key = (name, num_slots, hidden_size, ffn_hidden_size, dtype, torch.device(device), banks)
        pool = cls._shared.get(key)
        if pool is None:
            pool = cls._shared[key] = cls(group, num_slots, hidden_size, ffn_hidden_size, dtype, device, banks)
        return pool

    @property
    def nbytes(self) -> int:
        return sum(b.tensor.numel() * b.tensor.element_size() for b in (self._fc1, self._fc2))

    def fetch(self, slot_expert: torch.Tensor, W1: torch.Tensor, W2: torch.Tensor, e_loc: int, bank: int = 0,
              relay=None) -> None:
        """Every main rank pushes its replicated experts (W1 [E_loc, 2F, H], W2 [E_loc, H, F], stacked)
        into the slots of `bank` the plan gives them; with `relay` (topoep.relay.RelayTrees) every slot's copy comes
        from its source instead, in the steps of topoep.relay.relay_steps (relay.chunks chunks per copy; one chunk:
        a step per level), with a barrier of the group between steps (a chunk is sent on only after it arrived
        everywhere; channel 2 + bank of the fc2 slots, so that fetches into different banks on
        different streams never share one). No barrier at the start or the end: the layer calls it right before a
        dispatch, whose barriers publish the slots before anyone computes with them (the closing one, when the fetch
        runs on a side stream: cuda_function.start_fetch), or follows it with `publish_fetch` on its own stream
        (LayerConfig.fetch_overlap); and before it, every rank passed a barrier after its last
        use of the bank (this call's count all-gathers in forward, the gradient return of the bank's last user in
        backward; `publish` where nothing else would)."""
        se = slot_expert.reshape(-1).contiguous()
        if relay is not None and relay.schedule == "async":
            return self._fetch_async(se, W1, W2, e_loc, bank, relay)
        R_N = se.numel()
        src, lvl, levels = ((se, se, 1) if relay is None else
                            (relay.source.reshape(-1).contiguous(), relay.level.reshape(-1).contiguous(), relay.levels))
        C = relay.chunks if relay is not None else 1
        for step in range(levels + C - 1):
            if step > 0:
                self._fc2.barrier(channel=2 + bank)
            for W, buf, bases, own in zip((W1, W2), (self._fc1, self._fc2), self._bank_ptrs, self._banked):
                ptrs, numel = _expert_ptrs(W), buf.tensor[0].numel()
                span = -(-numel // C)  # topoep.relay.chunk_range
                _push_slots_kernel[(R_N, triton.cdiv(span, COPY_CHUNK))](
                    se, src, lvl, step, C, span, ptrs, own[bank], bases[bank], self.rank, e_loc, self.num_slots,
                    numel, CHUNK=COPY_CHUNK, RELAY=relay is not None, ALIGN=_aligned(numel, span, W, own, buf.tensor),
                    num_warps=COPY_WARPS)

    def _fetch_async(self, se: torch.Tensor, W1: torch.Tensor, W2: torch.Tensor, e_loc: int, bank: int,
                      relay) -> None:
        """`fetch` copy by copy (relay.schedule "async", `_push_slots_async_kernel`): one launch per weight, this
        rank's sends in level order (sorted on the device: no host synchronisation); a relay forwards each chunk of
        a copy once its flag says it arrived. The same barriers around it as the level-by-level fetch."""
        items, count = async_send_items(se, relay.source.reshape(-1), relay.level.reshape(-1), relay.levels, self.rank)
        epoch = self._fetch_epoch[bank:bank + 1]
        epoch.add_(1)
        N, row = self.num_slots, self._flag_row
        own_flags = self._fetch_flags.tensor[bank * N:(bank + 1) * N]
        chunk0 = 0
        for W, buf, bases, own in zip((W1, W2), (self._fc1, self._fc2), self._bank_ptrs, self._banked):
            numel = buf.tensor[0].numel()
            n_chunks = triton.cdiv(numel, COPY_CHUNK)
            _push_slots_async_kernel[(self._programs,)](
                items, count, se, _expert_ptrs(W), own[bank], bases[bank], own_flags, self._fetch_flag_ptrs[bank], row,
                epoch, self.rank, e_loc, N, numel, n_chunks, chunk0, CHUNK=COPY_CHUNK,
                ALIGN=_aligned(numel, numel, W, own, buf.tensor), num_warps=COPY_WARPS)
            chunk0 += n_chunks

    def _push_grads_async(self, se: torch.Tensor, srcs: tuple, relay) -> None:
        """`push_grads` copy by copy (relay.schedule "async", `_push_grads_async_kernel`): my slots deepest level
        first, each relay adding its children's regions (a table of at most relay.max_children(relay.fanout) per
        slot, made on the device) before it sends on; one launch per weight. `reduce_grads` then adds the level-1
        regions to the homes' experts after its barrier, as level by level."""
        src = relay.source.reshape(-1).contiguous()
        N, me = self.num_slots, self.rank
        items, count, children = async_return_tables(se, src, relay.level.reshape(-1), relay.levels, me, N,
                                                     relay.fanout)
        F = children.shape[1]
        epoch = self._ret_epoch
        epoch.add_(1)
        chunk0 = 0
        for s, ret in zip(srcs, (self.ret1, self.ret2)):
            numel = s[0].numel()
            n_chunks = triton.cdiv(numel, COPY_CHUNK)
            _push_grads_async_kernel[(self._programs,)](
                items, count, se, src, children, s, ret.tensor, ret.ptrs, self._ret_flags.tensor,
                self._ret_flags.ptrs, self._flag_row, epoch, me, N, numel, n_chunks, chunk0, F, CHUNK=COPY_CHUNK,
                ALIGN=_aligned(numel, numel, s, ret.tensor), num_warps=COPY_WARPS)
            chunk0 += n_chunks

    def publish(self) -> None:
        """A barrier of the group on this stream: every rank's earlier work on its stream (a prefetch it
        waited for) is complete everywhere after it."""
        self._fc1.barrier(channel=0)

    def publish_fetch(self, bank: int = 0) -> None:
        """The end of a fetch into `bank` on a side stream of its own (LayerConfig.fetch_overlap): a barrier of the
        group on that stream (channel 2 + bank of the fc1 slots, which nothing else uses), after which every rank's
        pushes into the bank are complete everywhere."""
        self._fc1.barrier(channel=2 + bank)

    def push_grads(self, slot_expert: torch.Tensor, src1: torch.Tensor, src2: torch.Tensor, e_loc: int,
                   relay=None) -> None:
        """First half of the gradient return: my slots' weight gradients src1 [N, 2F, H] / src2 [N, H, F]
        (contiguous) go to region (me, slot) of their expert's main rank. With `relay` (topoep.relay.RelayTrees) up
        the relay trees instead, deepest level first, in the fetch's steps with the levels reversed (relay.chunks
        chunks per copy): a slot of level l sends a chunk to the rank it fetched from, which after a barrier (channel
        2 of ret2) adds what its children sent of that chunk to its own slot's gradient (in src1/src2, in place:
        `_reduce`) before it sends that chunk on; this ends with level 1's sends to the homes. No
        barrier first: the previous return's regions were summed before the dispatch barriers that every rank
        passed since. May run on a side stream (its barriers are on a channel nothing else uses); `reduce_grads`
        must come after it on the layer's stream."""
        se = slot_expert.reshape(-1).contiguous()
        N = self.num_slots
        src, lvl, levels = ((se, se, 1) if relay is None else
                            (relay.source.reshape(-1).contiguous(), relay.level.reshape(-1).contiguous(), relay.levels))
        srcs = (src1, src2)
        if relay is not None and not all(s.is_contiguous() for s in srcs):
            raise ValueError("push_grads with relays adds the children's gradients into src1/src2 in place: pass "
                             "contiguous tensors")
        if relay is not None and relay.schedule == "async":
            return self._push_grads_async(se, srcs, relay)
        C = relay.chunks if relay is not None else 1
        for step in range(levels + C - 1):
            if step > 0:  # the children's chunks of the last step arrived everywhere: add them before sending on
                self.ret2.barrier(channel=2)
                self._reduce(se, src, lvl, 0, srcs, N, e_loc, slots=True, step=step, levels=levels, chunks=C)
            for s, ret in zip(srcs, (self.ret1, self.ret2)):
                numel, s = s[0].numel(), s.contiguous()
                span = -(-numel // C)  # topoep.relay.chunk_range
                _push_grads_kernel[(N, triton.cdiv(span, COPY_CHUNK))](
                    se, src, lvl, step, levels, C, span, s, ret.ptrs, self.rank, e_loc, N, numel,
                    CHUNK=COPY_CHUNK, RELAY=relay is not None, ALIGN=_aligned(numel, span, s, ret.tensor),
                    num_warps=COPY_WARPS)

    def _reduce(self, se, src, lvl, lv, grads, count, e_loc, slots, step=0, levels=1, chunks=1):
        """grads (fc1's [count, 2F, H], fc2's [count, H, F]) += their returned regions (_reduce_grads_kernel): my
        main experts' whole weights from level lv, or (slots) each slot's chunk of return step `step`."""
        for grad, ret in zip(grads, (self.ret1, self.ret2)):
            numel = grad[0].numel()
            span = -(-numel // chunks) if slots else numel
            _reduce_grads_kernel[(count, triton.cdiv(span, COPY_CHUNK))](
                se, src, lvl, lv, step, levels, chunks, span, ret.tensor, grad, self.rank, e_loc, self.num_slots,
                se.numel(), numel, CHUNK=COPY_CHUNK, RELAY=src is not se, SLOTS=slots,
                ALIGN=_aligned(numel, span, grad, ret.tensor))

    def reduce_grads(self, slot_expert: torch.Tensor, grad1: torch.Tensor, grad2: torch.Tensor, e_loc: int,
                     relay=None) -> None:
        """Second half: a barrier (every rank has pushed), then grad1 [E_loc, 2F, H] / grad2 [E_loc, H, F] of
        my experts += their returned regions in (source rank, slot) order, in fp32 (with `relay`: the regions of
        the level-1 copies, which carry their subtrees' sums)."""
        se = slot_expert.reshape(-1).contiguous()
        src, lvl = (se, se) if relay is None else (relay.source.reshape(-1).contiguous(),
                                                   relay.level.reshape(-1).contiguous())
        self.ret1.barrier(channel=1)
        self._reduce(se, src, lvl, 1, (grad1, grad2), e_loc, e_loc, slots=False)

    def return_grads(self, slot_expert: torch.Tensor, grad1: torch.Tensor, grad2: torch.Tensor, e_loc: int,
                     src: tuple[torch.Tensor, torch.Tensor], relay=None) -> None:
        """The slots' weight gradients src = (fc1 grads [N, 2F, H], fc2 grads [N, H, F]) go to their expert's
        main rank (with `relay` up the relay trees), which adds them to grad1 [E_loc, 2F, H] / grad2 [E_loc, H, F]
        in (source rank, slot) order. The slots themselves keep their weights."""
        self.push_grads(slot_expert, *src, e_loc, relay)
        self.reduce_grads(slot_expert, grad1, grad2, e_loc, relay)
