"""CPU tests of backend cuda's spill path (topoep/runtime/spill.py): which rows spill and where their sources stage
them (against a brute-force walk of the receive layout), and the Triton kernels against their torch references under
Triton's interpreter (tests/spill_check.py in a subprocess: the interpreter must be chosen before triton is
imported); the same check with the compiled kernels on a GPU (skipped without one)."""

import sys
from pathlib import Path

import pytest
import torch

from interpreter import interpreted_cases
from topoep.runtime.layout import receive_starts
from topoep.runtime.spill import BM, spill_work


@pytest.mark.parametrize("seed", range(6))
def test_spill_work_matches_the_receive_layout(seed):
    g = torch.Generator().manual_seed(seed)
    R, E_loc, N = (2, 2, 1), (4, 3, 2), (8, 1, 0)
    R, E_loc, N = R[seed % 3], E_loc[seed % 3], N[seed % 3]
    G = E_loc + N
    C = torch.randint(0, 40, (R, R, G), generator=g)
    C[:, :, :][torch.rand(R, R, G, generator=g) < 0.3] = 0
    prev = torch.randint(0, 50, (R,), generator=g)
    cap = int(torch.randint(1, 150, (1,), generator=g))
    for rank in range(R):
        work = spill_work(C, rank, E_loc, cap, prev)
        want_n = torch.zeros(R, G, dtype=torch.int64)
        want_first = {}
        for s in range(R):
            start = receive_starts(C, s, E_loc)  # [R * G]: where s's rows of each (destination, group) start
            i = int(prev[s])  # s's staging index: its rows in send order, after earlier chunks' rows
            for d in range(R):
                for grp in range(G):
                    for j in range(int(C[s, d, grp])):
                        if d == rank and int(start[d * G + grp]) + j >= cap:
                            want_first.setdefault((s, grp), i)
                            want_n[s, grp] += 1
                        i += 1
        assert torch.equal(work.n, want_n)
        for (s, grp), f in want_first.items():
            assert int(work.first[s, grp]) == f
        assert int(work.rows) == int(want_n.sum())
        assert torch.equal(work.tile_end, torch.cumsum(((want_n + BM - 1) // BM).reshape(-1), 0))
        has = want_n.sum(0) > 0
        assert int(work.num_groups) == int(has.sum())
        assert work.groups[:int(has.sum())].tolist() == torch.nonzero(has).flatten().tolist()


def test_spill_kernels_equal_their_references_in_the_interpreter():
    lines = interpreted_cases("spill_check.py")
    assert len(lines) == 2 and all(ln.endswith(": equal") for ln in lines), lines


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_spill_kernels_equal_their_references_on_the_gpu():
    sys.path.insert(0, str(Path(__file__).parent))
    import spill_check

    assert spill_check.main("cuda") == 0


def test_spill_work_kernel_equals_spill_work_in_the_interpreter():
    lines = interpreted_cases("spill_work_check.py")
    assert len(lines) == 10 and all(ln.endswith(": equal") for ln in lines), lines
    assert sum(" spilled rows=0:" not in ln for ln in lines) >= 5  # most cases spill


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_spill_work_kernel_equals_spill_work_on_the_gpu():
    sys.path.insert(0, str(Path(__file__).parent))
    import spill_work_check

    assert spill_work_check.main("cuda") == 0
