"""Run by tests/test_spill.py in a subprocess with TRITON_INTERPRET=1 (Triton's interpreter runs the kernel on CPU
tensors; it must be set before triton is imported), and by the GPU test as main("cuda"): spill.spill_work_triton, the
spill work in one Triton kernel, against spill.spill_work (its torch form) on random counts C[s, d, g] (1-8 ranks, with
and without slots and earlier chunks' rows, most with rows that spill). Integer arithmetic: bit for bit. Prints one
line per case; exits 1 on the first difference."""

import dataclasses
import sys

import torch

from topoep.runtime.spill import SpillWork, spill_work, spill_work_triton


def main(device: str = "cpu") -> int:
    for case in range(10):
        g = torch.Generator().manual_seed(case)
        R, E_loc, N = (1, 2, 3, 4, 8)[case % 5], (4, 3, 2, 1)[case % 4], (2, 1, 0)[case % 3]
        G = E_loc + N
        C = torch.randint(0, 40, (R, R, G), generator=g)
        C[torch.rand(R, R, G, generator=g) < 0.3] = 0
        prev = torch.randint(0, 50, (R,), generator=g) if case % 2 else None
        cap = int(torch.randint(1, 150, (1,), generator=g))
        spilled, bad = 0, []
        for rank in range(R):
            want = spill_work(C, rank, E_loc, cap, prev)
            got = spill_work_triton(C.to(device), rank, E_loc, cap, prev.to(device) if prev is not None else None)
            spilled += int(want.rows)
            bad += [f"rank {rank} {f.name}" for f in dataclasses.fields(SpillWork)
                    if not torch.equal(getattr(want, f.name).reshape(-1), getattr(got, f.name).reshape(-1).cpu())]
        print(f"case {case}: R={R} E_loc={E_loc} N={N} capacity={cap} spilled rows={spilled}: "
              + ("equal" if not bad else "DIFFERENT: " + ", ".join(bad)), flush=True)
        if bad:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
