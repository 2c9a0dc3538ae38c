"""Run by tests/test_spill.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the kernels on CPU
tensors; it must be set before triton is imported), and by the GPU tests as main("cuda"): the spill kernels of
topoep/runtime/spill.py against their torch references, on staged rows of several sources and groups (main and slot
weights, partial tiles, a group with no spilled rows, odd sizes). The kernels sum in another order than the
references: on a GPU, outputs within 2 bf16 rounding steps of the largest value and weight gradients within 1e-2 of
their largest magnitude. The interpreter truncates where a GPU rounds to nearest (fp32 to bf16, at h, the activation
and the output): 8 steps and 3e-2 there. Prints one line per case; exits 1 on the first difference."""

import os

import sys

import torch

from topoep.runtime.spill import (SpillWork, spill_backward_reference, spill_forward_reference, spill_rows,
                                  spill_wgrad, spill_work)


def cases():
    # (sources, main experts, slots, hidden, FFN, rows per (source, group) beyond the region)
    yield 2, 2, 1, 64, 32, [[3, 0, 5], [0, 40, 1]]
    yield 3, 1, 2, 96, 48, [[1, 2, 0], [33, 0, 0], [0, 0, 7]]


def _close(a, b, tol):
    a, b = a.float(), b.float()
    return bool(((a - b).abs() <= tol * b.abs().max().clamp(min=1e-6)).all())


def main(device: str = "cpu") -> int:
    interp = os.environ.get("TRITON_INTERPRET", "0") == "1"
    out_tol, w_tol = (2 ** -5, 3e-2) if interp else (2 ** -6, 1e-2)
    for c, (R, E_loc, N, H, F, spills) in enumerate(cases()):
        g = torch.Generator().manual_seed(c)
        G = E_loc + N
        n = torch.tensor(spills, dtype=torch.int64)
        A = int(n.sum(1).max()) + 5  # staging rows per source
        # staged rows of each source (inputs, output gradients) and their assignment indices; the spilled rows of
        # (s, group) start at first[s, group], in group order, after 2 other rows
        first = torch.zeros(R, G, dtype=torch.int64)
        for s in range(R):
            first[s] = 2 + torch.cumsum(n[s], 0) - n[s]
        xs = [(torch.randn(A + 2, H, generator=g) * 0.5).to(torch.bfloat16).to(device) for _ in range(R)]
        gs = [(torch.randn(A + 2, H, generator=g) * 0.5).to(torch.bfloat16).to(device) for _ in range(R)]
        meta = [torch.randperm(A + 2, generator=g).to(device) for _ in range(R)]
        back = [torch.zeros(A + 2, H, dtype=torch.bfloat16, device=device) for _ in range(R)]
        W1 = (torch.randn(E_loc, 2 * F, H, generator=g) * 0.1).to(torch.bfloat16).to(device)
        W2 = (torch.randn(E_loc, H, F, generator=g) * 0.1).to(torch.bfloat16).to(device)
        S1 = (torch.randn(N, 2 * F, H, generator=g) * 0.1).to(torch.bfloat16).to(device)
        S2 = (torch.randn(N, H, F, generator=g) * 0.1).to(torch.bfloat16).to(device)
        tiles = torch.cumsum(((n + 31) // 32).reshape(-1), 0)
        has = n.sum(0) > 0
        work = SpillWork(n=n.to(device), first=first.to(device), tile_end=tiles.to(device),
                         groups=torch.argsort((~has).to(torch.int8), stable=True).to(device),
                         num_groups=has.sum().view(1).to(device), rows=n.sum().view(1).to(device))
        ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)  # noqa: E731
        weights = lambda grp: (W1[grp], W2[grp]) if grp < E_loc else (S1[grp - E_loc], S2[grp - E_loc])  # noqa: E731
        ok = {}
        spill_rows(work, ptrs(xs), ptrs(meta), ptrs(back), (W1, W2), (S1, S2))
        # the references on the CPU
        xc, gc, mc = [t.cpu() for t in xs], [t.cpu() for t in gs], [t.cpu() for t in meta]
        wc = lambda grp: tuple(t.cpu() for t in weights(grp))  # noqa: E731
        want = [torch.zeros(A + 2, H, dtype=torch.bfloat16) for _ in back]
        for s in range(R):
            for grp in range(G):
                i = torch.arange(int(first[s, grp]), int(first[s, grp] + n[s, grp]))
                if len(i):
                    want[s][mc[s][i]] = spill_forward_reference(xc[s][i], *wc(grp))
        ok["forward"] = all(_close(b.cpu(), w, out_tol) for b, w in zip(back, want))
        for b in back:
            b.zero_()
        spill_rows(work, ptrs(xs), ptrs(meta), ptrs(back), (W1, W2), (S1, S2), gs_bases=ptrs(gs))
        d1, d2 = torch.zeros(E_loc, 2 * F, H), torch.zeros(E_loc, H, F)
        e1, e2 = torch.zeros(N, 2 * F, H), torch.zeros(N, H, F)
        want = [torch.zeros(A + 2, H, dtype=torch.bfloat16) for _ in back]
        for s in range(R):
            for grp in range(G):
                i = torch.arange(int(first[s, grp]), int(first[s, grp] + n[s, grp]))
                if len(i):
                    gx, a1, a2 = spill_backward_reference(xc[s][i], gc[s][i], *wc(grp))
                    want[s][mc[s][i]] = gx
                    t1, t2 = (d1[grp], d2[grp]) if grp < E_loc else (e1[grp - E_loc], e2[grp - E_loc])
                    t1 += a1
                    t2 += a2
        ok["dgrad"] = all(_close(b.cpu(), w, out_tol) for b, w in zip(back, want))
        base = [(torch.randn(E_loc, 2 * F, H, generator=g) * 0.01).to(torch.bfloat16).to(device),
                (torch.randn(E_loc, H, F, generator=g) * 0.01).to(torch.bfloat16).to(device)]
        sbase = [(torch.randn(N, 2 * F, H, generator=g) * 0.01).to(torch.bfloat16).to(device),
                 (torch.randn(N, H, F, generator=g) * 0.01).to(torch.bfloat16).to(device)]
        got, sgot = [t.clone() for t in base], [t.clone() for t in sbase]
        spill_wgrad(work, ptrs(xs), ptrs(gs), (W1, W2), got, 0, E_loc, (S1, S2), sgot)  # main groups only
        ok["wgrad main"] = (_close(got[0].cpu(), base[0].cpu().float() + d1, w_tol)
                            and _close(got[1].cpu(), base[1].cpu().float() + d2, w_tol)
                            and torch.equal(sgot[0], sbase[0]) and torch.equal(sgot[1], sbase[1]))
        spill_wgrad(work, ptrs(xs), ptrs(gs), (W1, W2), got, E_loc, G, (S1, S2), sgot)  # then the slot groups
        ok["wgrad slot"] = (_close(sgot[0].cpu(), sbase[0].cpu().float() + e1, w_tol)
                            and _close(sgot[1].cpu(), sbase[1].cpu().float() + e2, w_tol))
        bad = [name for name, v in ok.items() if not v]
        print(f"case {c}: R={R} groups={G} H={H} F={F}: " + ("equal" if not bad else "DIFFERENT: " + ", ".join(bad)),
              flush=True)
        if bad:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
