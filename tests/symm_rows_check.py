"""Run by tests/test_symm_rows.py on a GPU as main("cuda") (or `python tests/symm_rows_check.py cuda`): backend
cuda's row kernels of topoep/runtime/symm.py (the dispatch, the copy out of the receive buffers, the combine) against a loop over the
rows, with several ranks emulated in one process (each rank's buffers are tensors of their own, the kernels reach
them through the same address tables the symmetric workspace builds). Covers the main and slot buffers, rows that
spill beyond the region, the top-k scale, and a rank's own rows kept in place (`LOCAL`, `SKIP_LOCAL`). Copies are
exact and the scale is one fp32 product rounded once: everything is compared bit for bit (under Triton's
interpreter, which truncates where a GPU rounds to nearest, the scaled rows could differ by one bf16 step: allowed
there; tests/test_symm_rows.py says why the interpreter does not run these kernels). Prints one line per case; exits
1 on the first difference."""

import os
import sys

import torch

from topoep.runtime.symm import _combine_kernel, _copy_rows_kernel, _dispatch_kernel, _pow2


def cases():
    # (ranks, hidden, tokens, top-k, rows per receive region, region end, this rank, local, scale, the region's first
    # row in the receive buffers: a chunk's base)
    yield 3, 40, 15, 2, 24, 18, 1, True, False, 5
    yield 3, 40, 15, 2, 24, 18, 1, False, True, 0
    yield 2, 64, 9, 3, 30, 30, 0, True, True, 7
    yield 1, 24, 8, 2, 20, 12, 0, True, False, 0


def _ptrs(ts, device):
    return torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)


def _layout(g, R, A, cap):
    """A valid send layout of one rank: destinations, slot flags and receive positions, unique per (destination,
    buffer), each buffer's rows starting after a few rows of other senders; some positions run past the region."""
    dest = torch.randint(0, R, (A,), generator=g)
    slot = torch.rand(A, generator=g) < 0.3
    nxt = torch.randint(0, 4, (R, 2), generator=g)
    pos = torch.empty(A, dtype=torch.int64)
    for i in range(A):
        d, s = int(dest[i]), int(slot[i])
        pos[i] = nxt[d, s]
        nxt[d, s] += 1 + int(torch.randint(0, 2, (1,), generator=g))  # gaps: rows of other senders
    assert int(pos.max()) < cap
    return dest, slot, pos


def main(device: str = "cpu") -> int:
    for c, (R, H, T, k, cap, region_end, me, local, scaled, base) in enumerate(cases()):
        g = torch.Generator().manual_seed(c)
        A = T * k
        a_cap = A + 3
        bf = dict(dtype=torch.bfloat16, device=device)
        src = torch.randn(T, H, generator=g).to(**bf)
        scale = torch.rand(A, generator=g).to(**bf)
        order = torch.randperm(A, generator=g)
        dest, slot, pos = _layout(g, R, A, cap)
        nan = float("nan")
        # [main, slot][rank]: receive buffers of base + cap rows, this chunk's region from row base
        recv = [[torch.full((base + cap, H), nan, **bf) for _ in range(R)] for _ in range(2)]
        meta = [[torch.full((base + cap,), -7, dtype=torch.int64, device=device) for _ in range(R)] for _ in range(2)]
        lmain, lslot = torch.full((cap, H), nan, **bf), torch.full((cap, H), nan, **bf)
        stage = torch.full((A, H), nan, **bf)
        stage_meta = torch.full((A,), -7, dtype=torch.int64, device=device)
        overflow = torch.zeros(1, dtype=torch.int32, device=device)
        want = [[t.clone() for t in b] for b in recv], [[t.clone() for t in b] for b in meta]
        want_local, want_stage, want_stage_meta = [lmain.clone(), lslot.clone()], stage.clone(), stage_meta.clone()
        for i in range(A):
            a, d, s, p = int(order[i]), int(dest[i]), int(slot[i]), base + int(pos[i])
            row = src[a // k]
            if scaled:
                row = (row.float() * scale[a].float()).to(torch.bfloat16)
            if p < base + region_end:
                if local and d == me:
                    want_local[s][p - base] = row
                else:
                    want[0][s][d][p] = row
                want[1][s][d][p] = me * a_cap + a
            else:
                want_stage[i], want_stage_meta[i] = row, a
        dv = lambda t: t.to(device)  # noqa: E731
        _dispatch_kernel[(4,)](src, dv(order), k, dv(dest), dv(pos + base), dv(slot.to(torch.int8)), me * a_cap,
                               _ptrs(recv[0], device), _ptrs(recv[1], device), _ptrs(meta[0], device),
                               _ptrs(meta[1], device), overflow, A, base + region_end, scale if scaled else src, stage,
                               stage_meta, 0, src, stage, me, lmain, lslot, base, H=H, BLOCK_H=_pow2(H),
                               HAS_SCALE=scaled, SPILL=True, HAS_SRC2=False, LOCAL=local)
        step = 2.0 ** -7 if scaled and os.environ.get("TRITON_INTERPRET", "0") == "1" else 0.0

        def same(x, y, tol=0.0):
            x, y = x.float(), y.float()
            return torch.equal(x.isnan(), y.isnan()) and bool(
                ((x.nan_to_num() - y.nan_to_num()).abs() <= tol * y.nan_to_num().abs()).all())
        ok = {"rows": all(same(recv[b][r], want[0][b][r], step) for b in range(2) for r in range(R)),
              "meta": all(torch.equal(meta[b][r], want[1][b][r]) for b in range(2) for r in range(R)),
              "local": same(lmain, want_local[0], step) and same(lslot, want_local[1], step),
              "stage": same(stage, want_stage, step) and torch.equal(stage_meta, want_stage_meta),
              "no overflow": int(overflow) == 0}
        # the copy out of rank me's main receive buffer (its first n rows), leaving its own rows out with `local`
        n = int(region_end)
        rows_in = recv[0][me][base:].clone()
        rows_in[torch.isnan(rows_in)] = 0
        meta_in = meta[0][me][base:].clone()
        meta_in[meta_in < 0] = me * a_cap  # rows no sender wrote: as if this rank's own (left out with local)
        dst = torch.full((cap, H), nan, **bf)
        n_dev = torch.tensor([n], dtype=torch.int64, device=device)
        _copy_rows_kernel[(4,)](dst, rows_in, n_dev, cap, meta_in, a_cap, me, H=H, BLOCK_H=_pow2(H), SKIP_LOCAL=local)
        want_dst = torch.full((cap, H), nan, **bf)
        for r in range(n):
            if not (local and int(meta_in[r]) // a_cap == me):
                want_dst[r] = rows_in[r]
        ok["copy"] = same(dst, want_dst)
        # the combine: every received row goes home to its source's `back` at its assignment index
        y = torch.randn(cap, H, generator=g).to(**bf)
        back = [torch.full((a_cap, H), nan, **bf) for _ in range(R)]
        want_back = [t.clone() for t in back]
        meta_c = torch.tensor([s * a_cap + j for j, s in enumerate(torch.randint(0, R, (cap,), generator=g).tolist())],
                              dtype=torch.int64, device=device)
        for r in range(n):
            s, a = divmod(int(meta_c[r]), a_cap)
            if not (local and s == me):
                want_back[s][a] = y[r]
        _combine_kernel[(4,)](y, meta_c, n_dev, _ptrs(back, device), a_cap, cap, me, H=H, BLOCK_H=_pow2(H),
                              SKIP_LOCAL=local)
        ok["combine"] = all(same(back[r], want_back[r]) for r in range(R))
        bad = [name for name, v in ok.items() if not v]
        print(f"case {c}: R={R} H={H} A={A} local={local} scale={scaled}: "
              + ("equal" if not bad else "DIFFERENT: " + ", ".join(bad)), flush=True)
        if bad:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
