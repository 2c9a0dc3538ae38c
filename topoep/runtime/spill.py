"""Backend cuda's spill path: rows that do not fit a receive region are still computed, with no host
synchronisation and no buffer sized for the worst case.

Each rank receives rows into two regions of `capacity` rows (its main experts', its replica slots'; per chunk),
and the planner's capacity step (topoep.planners.capacity) makes the plan fit them whenever the slots allow. When
it cannot (no free slot where one is needed: a pathological routing, or the replica machinery left out), rows
beyond a region's end *spill*: they are never written into the destination's region. Instead

    dispatch   the source stages each spilled row in its own symmetric staging buffer (`stage[A, H]`, at the row's
               place in its send order, after the rows of earlier chunks) and the row's assignment index beside
               it (`stage_meta[A]`): local writes, published by the dispatch's closing barrier;
    experts    the destination, which knows from the all-gathered counts which rows of which source spilled and
               where they are staged (`spill_work`), reads them from the sources' staging buffers through peer
               pointers and computes the SwiGLU expert with its own weights (a main expert or a replica slot) in a
               Triton kernel that loops over the spilled rows (their number is a device value);
    combine    it writes each result into the source's `back` buffer at the row's assignment index, beside the
               combine of the regular rows, before the combine's barrier;
    backward   the source stages the gradient row and the input row again (nothing of the spilled rows is kept
               between forward and backward); the destination recomputes the expert's activations, writes the data
               gradient home, and adds the weight gradient of the spilled rows to its expert's gradient (main:
               before it is returned from backward; slot: before it travels home), in a fixed order.

The kernels are slow (tile GEMMs in Triton, activations recomputed per output tile) and cost almost nothing when
nothing spills: each launch finds no work on the device and returns. The layer counts spilled rows in its
statistics (`capacity_overflow`).

Transport "gloo" (the CPU harness) and "a2a" move spilled rows through their exchange instead of peer pointers and
compute them with `spill_forward_reference` / `spill_backward_reference`, the same arithmetic in torch: the fp32
products of the kernels, rounded to bf16 where the grouped GEMMs round (h, the activation, y; the activation
gradient, h's gradient, x's gradient).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only environments: the module imports, the kernels are unavailable
    triton = None

BM = 32  # spilled rows per tile
BK = 64  # inner block of the hidden dimension
BF = 64  # block of the expert FFN dimension
BH = 64  # block of the hidden dimension of an output tile
PROGRAMS_PER_SM = 4


@dataclass
class SpillWork:
    """The spilled rows one rank receives in one chunk, for each (source s, local group g): device tensors."""

    n: torch.Tensor  # int64[R, G]: spilled rows of source s in group g
    first: torch.Tensor  # int64[R, G]: staging index (on s) of the first of them; the rest follow in order
    tile_end: torch.Tensor  # int64[R * G]: inclusive prefix sum of ceil(n / BM) (tiles of the forward/dgrad kernels)
    groups: torch.Tensor  # int64[G]: the groups with spilled rows first (ascending), then the others
    num_groups: torch.Tensor  # int64[1]: how many groups have spilled rows
    rows: torch.Tensor  # int64[1]: spilled rows in all


def spill_work(C: torch.Tensor, rank: int, experts_per_rank: int, region_rows: int,
               prev_rows: torch.Tensor | None = None) -> SpillWork:
    """Which rows `rank` receives beyond its regions of `region_rows` rows, from C int64[R, R, G] (C[s, d, g]: rows
    source s sends to local group g of rank d in this chunk; every rank holds it). The receive layout is
    layout.receive_positions': per region, groups in order, inside a group sources in rank order. prev_rows
    int64[R]: each source's rows in earlier chunks (its staging index of this chunk's first row)."""
    R, _, G = C.shape
    cnt = C[:, rank, :]  # [R, G]
    per_group = cnt.sum(0)
    gstart = torch.cumsum(per_group, 0) - per_group
    gstart = torch.where(torch.arange(G, device=C.device) >= experts_per_rank, gstart - per_group[:experts_per_rank].sum(),
                         gstart)  # slot groups: their own region from row 0
    start = gstart[None, :] + (torch.cumsum(cnt, 0) - cnt)  # receive position of (s, g)'s first row
    lo = start.clamp(min=region_rows)
    n = (start + cnt - lo).clamp(min=0)
    flat = C.reshape(R, R * G)
    send_start = (torch.cumsum(flat, 1) - flat).view(R, R, G)[:, rank, :]  # (s -> rank, g)'s first row in s's order
    first = send_start + (lo - start)
    if prev_rows is not None:
        first = first + prev_rows[:, None]
    tile_end = torch.cumsum(((n + BM - 1) // BM).reshape(-1), 0)
    has = n.sum(0) > 0
    groups = torch.argsort((~has).to(torch.int8), stable=True)
    return SpillWork(n=n, first=first, tile_end=tile_end, groups=groups, num_groups=has.sum().view(1),
                     rows=n.sum().view(1))


if triton is not None:

    @triton.jit
    def _spill_work_kernel(C, prev, n_out, first_out, tile_end_out, groups_out, num_groups_out, rows_out, R, G,
                           rank, e_loc, region_rows, HAS_PREV: tl.constexpr, TILE: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr):
        """spill_work in one program (its torch form is the reference): C int64[R, R, G]; writes n, first [R, G],
        tile_end [R * G], groups [G], num_groups [1], rows [1]."""
        sv = tl.arange(0, BLOCK_R)
        gv = tl.arange(0, BLOCK_G)
        s, g = sv[:, None], gv[None, :]
        m = (s < R) & (g < G)
        cnt = tl.load(C + s * R * G + rank * G + g, mask=m, other=0)  # [R, G]: rows each source sends here
        per_group = tl.sum(cnt, 0)
        gstart = tl.cumsum(per_group, 0) - per_group
        main_rows = tl.sum(tl.where(gv < e_loc, per_group, 0), 0)
        gstart = tl.where(gv >= e_loc, gstart - main_rows, gstart)  # slot groups: their own region from row 0
        start = gstart[None, :] + (tl.cumsum(cnt, 0) - cnt)
        lo = tl.maximum(start, region_rows)
        n = tl.maximum(start + cnt - lo, 0)
        before = tl.zeros([BLOCK_R], dtype=tl.int64)  # each source's rows to the ranks before this one
        d = 0
        while d < rank:  # (a while loop: Triton's interpreter runs it, not a range over a runtime bound)
            before += tl.sum(tl.load(C + s * R * G + d * G + g, mask=m, other=0), 1)
            d += 1
        first = before[:, None] + (tl.cumsum(cnt, 1) - cnt) + (lo - start)
        if HAS_PREV:
            first += tl.load(prev + s, mask=s < R, other=0)
        tl.store(n_out + s * G + g, n, mask=m)
        tl.store(first_out + s * G + g, first, mask=m)
        tiles = (n + TILE - 1) // TILE
        row_tiles = tl.sum(tiles, 1)
        tile_end = (tl.cumsum(row_tiles, 0) - row_tiles)[:, None] + tl.cumsum(tiles, 1)
        tl.store(tile_end_out + s * G + g, tile_end, mask=m)
        has = (tl.sum(n, 0) > 0) & (gv < G)
        num = tl.sum(has.to(tl.int64), 0)
        lacks = (~has) & (gv < G)
        pos = tl.where(has, tl.cumsum(has.to(tl.int64), 0) - 1, num + tl.cumsum(lacks.to(tl.int64), 0) - 1)
        tl.store(groups_out + pos, gv.to(tl.int64), mask=gv < G)  # the groups with spilled rows first, stable
        tl.store(num_groups_out, num)
        tl.store(rows_out, tl.sum(tl.sum(n, 1), 0))


def spill_work_triton(C: torch.Tensor, rank: int, experts_per_rank: int, region_rows: int,
                      prev_rows: torch.Tensor | None = None) -> SpillWork:
    """spill_work as one Triton kernel (bit-equal: integer arithmetic): one launch in the metadata graph instead of
    about 25 small torch ones."""
    from topoep.runtime.symm import _pow2

    R, _, G = C.shape
    dev = C.device
    new = lambda *shape: torch.empty(shape, dtype=torch.int64, device=dev)  # noqa: E731
    n, first, tile_end, groups, num_groups, rows = new(R, G), new(R, G), new(R * G), new(G), new(1), new(1)
    C = C.contiguous()
    _spill_work_kernel[(1,)](C, prev_rows.contiguous() if prev_rows is not None else C, n, first, tile_end, groups,
                             num_groups, rows, R, G, rank, experts_per_rank, region_rows,
                             HAS_PREV=prev_rows is not None, TILE=BM, BLOCK_R=max(2, _pow2(R)),
                             BLOCK_G=max(2, _pow2(G)))
    return SpillWork(n=n, first=first, tile_end=tile_end, groups=groups, num_groups=num_groups, rows=rows)


# -- the arithmetic, in torch (the CPU harness, and the reference of the kernels) ------------------------------------

def _bf(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).float()


def spill_forward_reference(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """y [n, H] (x's dtype) of one expert (w1 [2F, H], w2 [H, F]) on rows x [n, H], rounded as the kernel rounds."""
    F = w2.shape[1]
    h = _bf(x.float() @ w1.float().t())
    act = _bf(torch.nn.functional.silu(h[:, :F]) * h[:, F:])
    return (act @ w2.float().t()).to(x.dtype)


def spill_backward_reference(x: torch.Tensor, gy: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor):
    """(grad x [n, H] in x's dtype, fp32 grad w1 [2F, H], fp32 grad w2 [H, F]) of one expert on rows x with output
    gradient gy, recomputing the activations as the kernels do."""
    F = w2.shape[1]
    h = _bf(x.float() @ w1.float().t())
    g, u = h[:, :F], h[:, F:]
    act = _bf(torch.nn.functional.silu(g) * u)
    gact = _bf(gy.float() @ w2.float())
    sg = torch.sigmoid(g)
    gh = _bf(torch.cat([gact * u * sg * (1 + g * (1 - sg)), gact * g * sg], 1))
    return (gh @ w1.float()).to(x.dtype), gh.t() @ x.float(), gy.float().t() @ act


# -- the kernels -------------------------------------------------------------------------------------------------

# Triton's interpreter (TRITON_INTERPRET=1, the CPU check of these kernels) multiplies bf16 operands wrongly: there the
# products run in fp32, which equals the GPU's bf16 products accumulated in fp32 up to the order of the sums
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

if triton is not None:

    @triton.jit
    def _mma(a, b, acc, FP32: tl.constexpr):
        """acc + a @ b: bf16 tensor-core products accumulated in fp32 (FP32: the same in exact fp32 arithmetic)."""
        if FP32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    @triton.jit
    def _pair_of(tile_end, n_pairs, tile):
        """The (source, group) pair of a tile: the first pair whose inclusive tile count exceeds it."""
        lo = 0
        hi = n_pairs - 1
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(tile_end + mid) > tile:
                hi = mid
            else:
                lo = mid + 1
        return lo

    @triton.jit
    def _gate_up(xbase, idx, rmask, w1, offs_f, fmask, H: tl.constexpr, F: tl.constexpr, BM: tl.constexpr,
                 BK: tl.constexpr, BF: tl.constexpr, FP32: tl.constexpr):
        """The bf16-rounded gate and up pre-activations [BM, BF] (fp32) of rows xbase[idx] for FFN columns offs_f."""
        gate = tl.zeros([BM, BF], dtype=tl.float32)
        up = tl.zeros([BM, BF], dtype=tl.float32)
        for k0 in range(0, H, BK):
            offs_k = k0 + tl.arange(0, BK)
            kmask = offs_k < H
            xk = tl.load(xbase + idx[:, None] * H + offs_k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            wm = fmask[:, None] & kmask[None, :]
            wg = tl.load(w1 + offs_f[:, None] * H + offs_k[None, :], mask=wm, other=0.0)
            wu = tl.load(w1 + (F + offs_f)[:, None] * H + offs_k[None, :], mask=wm, other=0.0)
            gate = _mma(xk, tl.trans(wg), gate, FP32)
            up = _mma(xk, tl.trans(wu), up, FP32)
        return gate.to(tl.bfloat16).to(tl.float32), up.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def _grad_act(gbase, idx, rmask, w2, offs_f, fmask, H: tl.constexpr, F: tl.constexpr, BM: tl.constexpr,
                  BK: tl.constexpr, BF: tl.constexpr, FP32: tl.constexpr):
        """The bf16-rounded activation gradient [BM, BF] (fp32): rows gbase[idx] times w2[:, offs_f]."""
        acc = tl.zeros([BM, BF], dtype=tl.float32)
        for k0 in range(0, H, BK):
            offs_k = k0 + tl.arange(0, BK)
            kmask = offs_k < H
            gk = tl.load(gbase + idx[:, None] * H + offs_k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
            w = tl.load(w2 + offs_k[:, None] * F + offs_f[None, :], mask=kmask[:, None] & fmask[None, :], other=0.0)
            acc = _mma(gk, w, acc, FP32)
        return acc.to(tl.bfloat16).to(tl.float32)

    @triton.jit
    def _weights(g, E_loc, main1, main2, slot1, slot2, H: tl.constexpr, F: tl.constexpr):
        """Pointers to group g's fc1 [2F, H] and fc2 [H, F]: main expert g, or replica slot g - E_loc."""
        is_main = g < E_loc
        gi = tl.where(is_main, g, g - E_loc).to(tl.int64)
        # the byte addresses to pointers one by one, then the choice between pointers, then elements
        # (each address widened to 64 bits first: Triton passes a small integer argument as int32)
        w1 = tl.where(is_main, main1.to(tl.int64).to(tl.pointer_type(tl.bfloat16)),
                      slot1.to(tl.int64).to(tl.pointer_type(tl.bfloat16)))
        w2 = tl.where(is_main, main2.to(tl.int64).to(tl.pointer_type(tl.bfloat16)),
                      slot2.to(tl.int64).to(tl.pointer_type(tl.bfloat16)))
        return w1 + gi * (2 * F * H), w2 + gi * (H * F)

    @triton.jit
    def _spill_rows_kernel(tile_end, n_sg, first_sg, n_pairs, G, E_loc, xs_bases, gs_bases, meta_bases, back_bases,
                           main1, main2, slot1, slot2, H: tl.constexpr, F: tl.constexpr, BM: tl.constexpr,
                           BK: tl.constexpr, BF: tl.constexpr, BH: tl.constexpr, BACKWARD: tl.constexpr,
                           FP32: tl.constexpr):
        """Forward: y of every spilled row -> back of its source at its assignment index. Backward (BACKWARD): the
        input gradient instead, from the staged input and output-gradient rows. Work items: (tile, output column
        block), strided over the programs; the number of tiles is read on the device."""
        NHB: tl.constexpr = (H + BH - 1) // BH
        total = tl.load(tile_end + n_pairs - 1) * NHB
        item = tl.program_id(0).to(tl.int64)
        while item < total:  # (a while loop: Triton's interpreter takes no tensor bound in range)
            tile = item // NHB
            hb = item % NHB
            pair = _pair_of(tile_end, n_pairs, tile)
            before = tl.load(tile_end + pair - 1, mask=pair > 0, other=0)
            s = pair // G
            g = pair % G
            rows = (tile - before) * BM + tl.arange(0, BM)
            rmask = rows < tl.load(n_sg + pair)
            idx = (tl.load(first_sg + pair) + rows).to(tl.int64)
            xbase = tl.load(xs_bases + s).to(tl.pointer_type(tl.bfloat16))
            w1, w2 = _weights(g, E_loc, main1, main2, slot1, slot2, H, F)
            offs_h = hb * BH + tl.arange(0, BH)
            hmask = offs_h < H
            acc = tl.zeros([BM, BH], dtype=tl.float32)
            for f0 in range(0, F, BF):
                offs_f = f0 + tl.arange(0, BF)
                fmask = offs_f < F
                gate, up = _gate_up(xbase, idx, rmask, w1, offs_f, fmask, H, F, BM, BK, BF, FP32)
                if BACKWARD:
                    gbase = tl.load(gs_bases + s).to(tl.pointer_type(tl.bfloat16))
                    gact = _grad_act(gbase, idx, rmask, w2, offs_f, fmask, H, F, BM, BK, BF, FP32)
                    sg = tl.sigmoid(gate)
                    gh_g = (gact * up * sg * (1 + gate * (1 - sg))).to(tl.bfloat16)
                    gh_u = (gact * gate * sg).to(tl.bfloat16)
                    wm = fmask[:, None] & hmask[None, :]
                    w1g = tl.load(w1 + offs_f[:, None] * H + offs_h[None, :], mask=wm, other=0.0)
                    w1u = tl.load(w1 + (F + offs_f)[:, None] * H + offs_h[None, :], mask=wm, other=0.0)
                    acc = _mma(gh_g, w1g, acc, FP32)
                    acc = _mma(gh_u, w1u, acc, FP32)
                else:
                    act = (gate * tl.sigmoid(gate) * up).to(tl.bfloat16)
                    w2t = tl.load(w2 + offs_h[:, None] * F + offs_f[None, :], mask=hmask[:, None] & fmask[None, :],
                                  other=0.0)
                    acc = _mma(act, tl.trans(w2t), acc, FP32)
            a = tl.load(tl.load(meta_bases + s).to(tl.pointer_type(tl.int64)) + idx, mask=rmask, other=0)
            back = tl.load(back_bases + s).to(tl.pointer_type(tl.bfloat16))
            tl.store(back + a[:, None] * H + offs_h[None, :], acc.to(tl.bfloat16), mask=rmask[:, None] & hmask[None, :])
            item += tl.num_programs(0)

    @triton.jit
    def _spill_wgrad_kernel(n_sg, first_sg, groups, num_groups, R, G, E_loc, g_lo, g_hi, xs_bases, gs_bases,
                            main1, main2, slot1, slot2, gmain1, gmain2, gslot1, gslot2, H: tl.constexpr,
                            F: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BF: tl.constexpr, BH: tl.constexpr,
                            FP32: tl.constexpr):
        """Weight gradients of the spilled rows of the groups in [g_lo, g_hi), added (fp32 sums, one rounding) to
        the gradients at gmain1/gmain2 (main groups) or gslot1/gslot2 (slot groups); the activations are recomputed
        with the weights at main1/main2 / slot1/slot2. Work items: (group with spilled rows, output tile of fc1
        [2F, H] or fc2 [H, F]); each tile sums its rows in (source, staging) order: a fixed order."""
        NHB: tl.constexpr = (H + BH - 1) // BH
        NFB: tl.constexpr = (F + BF - 1) // BF
        T1: tl.constexpr = 2 * NFB * NHB  # fc1 tiles: [BF rows of 2F, BH columns of H]
        per: tl.constexpr = T1 + NHB * NFB  # then fc2 tiles: [BH rows of H, BF columns of F]
        total = tl.load(num_groups) * per
        item = tl.program_id(0).to(tl.int64)
        while item < total:
            g = tl.load(groups + item // per)
            t = item % per
            if (g >= g_lo) & (g < g_hi):
                w1, w2 = _weights(g, E_loc, main1, main2, slot1, slot2, H, F)
                d1, d2 = _weights(g, E_loc, gmain1, gmain2, gslot1, gslot2, H, F)
                is_fc1 = t < T1
                tf = tl.where(is_fc1, t // NHB, (t - T1) % NFB)  # fc1: block of 2F; fc2: block of F
                hb = tl.where(is_fc1, t % NHB, (t - T1) // NFB)
                up_part = is_fc1 & (tf >= NFB)
                offs_f = (tf % NFB) * BF + tl.arange(0, BF)
                fmask = offs_f < F
                offs_h = hb * BH + tl.arange(0, BH)
                hmask = offs_h < H
                acc = tl.zeros([BF, BH], dtype=tl.float32)  # fc1's tile; for fc2 its transpose
                s = R * 0
                while s < R:
                    n = tl.load(n_sg + s * G + g)
                    base = tl.load(first_sg + s * G + g)
                    xbase = tl.load(xs_bases + s).to(tl.pointer_type(tl.bfloat16))
                    gbase = tl.load(gs_bases + s).to(tl.pointer_type(tl.bfloat16))
                    r0 = n * 0
                    while r0 < n:
                        rows = r0 + tl.arange(0, BM)
                        rmask = rows < n
                        idx = (base + rows).to(tl.int64)
                        gate, up = _gate_up(xbase, idx, rmask, w1, offs_f, fmask, H, F, BM, BK, BF, FP32)
                        m_rh = rmask[:, None] & hmask[None, :]
                        if is_fc1:
                            gact = _grad_act(gbase, idx, rmask, w2, offs_f, fmask, H, F, BM, BK, BF, FP32)
                            sg = tl.sigmoid(gate)
                            gh = tl.where(up_part, gact * gate * sg, gact * up * sg * (1 + gate * (1 - sg)))
                            xh = tl.load(xbase + idx[:, None] * H + offs_h[None, :], mask=m_rh, other=0.0)
                            acc = _mma(tl.trans(gh.to(tl.bfloat16)), xh, acc, FP32)
                        else:
                            act = (gate * tl.sigmoid(gate) * up).to(tl.bfloat16)
                            gyh = tl.load(gbase + idx[:, None] * H + offs_h[None, :], mask=m_rh, other=0.0)
                            acc = _mma(tl.trans(act), gyh, acc, FP32)  # [BF, BH] = (gy^T act)^T
                        r0 += BM
                    s += 1
                if is_fc1:
                    ptr = d1 + tl.where(up_part, F + offs_f, offs_f)[:, None] * H + offs_h[None, :]
                else:
                    ptr = d2 + offs_h[None, :] * F + offs_f[:, None]
                m = fmask[:, None] & hmask[None, :]
                tl.store(ptr, (tl.load(ptr, mask=m, other=0.0).to(tl.float32) + acc).to(tl.bfloat16), mask=m)
            item += tl.num_programs(0)


def _grid(device) -> tuple[int]:
    if device.type != "cuda":  # Triton's interpreter on CPU tensors (tests/spill_check.py)
        return (4,)
    return (PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count,)


def spill_rows(work: SpillWork, xs_bases: torch.Tensor, meta_bases: torch.Tensor, back_bases: torch.Tensor,
               main: tuple, slot: tuple | None, gs_bases: torch.Tensor | None = None) -> None:
    """Forward (gs_bases None): every spilled row's expert output into its source's `back` at its assignment index.
    Backward: its input gradient there instead (gs_bases: the sources' staged output gradients; xs_bases their
    staged inputs). main = (W1 [E_loc, 2F, H], W2 [E_loc, H, F]) contiguous bf16; slot the same for the slots (None
    without)."""
    W1, W2 = main
    S1, S2 = slot if slot is not None else main
    R, G = work.n.shape
    H, F = W1.shape[2], W2.shape[2]
    _spill_rows_kernel[_grid(W1.device)](
        work.tile_end, work.n, work.first, R * G, G, W1.shape[0], xs_bases,
        gs_bases if gs_bases is not None else xs_bases, meta_bases, back_bases, W1.data_ptr(), W2.data_ptr(),
        S1.data_ptr(), S2.data_ptr(), H=H, F=F, BM=BM, BK=BK, BF=BF, BH=BH, BACKWARD=gs_bases is not None,
        FP32=_INTERPRET, num_warps=4)


def spill_wgrad(work: SpillWork, xs_bases: torch.Tensor, gs_bases: torch.Tensor, main: tuple, main_grads: tuple,
                g_lo: int, g_hi: int, slot: tuple | None = None, slot_grads: tuple | None = None) -> None:
    """Adds the spilled rows' weight gradients of the local groups [g_lo, g_hi) to main_grads = (g1 [E_loc, 2F, H],
    g2 [E_loc, H, F]) for main groups and slot_grads ([N, ...]) for slot groups, recomputing the activations from
    the sources' staged rows with the weights main / slot (all contiguous bf16)."""
    R, G = work.n.shape
    W1, W2 = main
    S1, S2 = slot if slot is not None else main
    D1, D2 = slot_grads if slot_grads is not None else main_grads
    _spill_wgrad_kernel[_grid(W1.device)](
        work.n, work.first, work.groups, work.num_groups, R, G, W1.shape[0], g_lo, g_hi, xs_bases, gs_bases,
        W1.data_ptr(), W2.data_ptr(), S1.data_ptr(), S2.data_ptr(), main_grads[0].data_ptr(),
        main_grads[1].data_ptr(), D1.data_ptr(), D2.data_ptr(), H=W1.shape[2], F=W2.shape[2], BM=BM, BK=BK, BF=BF,
        BH=BH, FP32=_INTERPRET, num_warps=4)
