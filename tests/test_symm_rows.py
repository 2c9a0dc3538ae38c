"""Backend cuda's row kernels (topoep/runtime/symm.py: dispatch, copy out of the receive buffers, combine), with a
rank's own rows kept in place and without, against a loop over the rows: under Triton's interpreter on the CPU
(tests/symm_rows_check.py in a subprocess: the interpreter must be chosen before triton is imported), and with the
compiled kernels on a GPU (skipped without one)."""

import sys
from pathlib import Path

import pytest
import torch

from interpreter import interpreted_cases


def test_row_kernels_equal_the_loop_in_the_interpreter():
    lines = interpreted_cases("symm_rows_check.py")
    assert len(lines) == 4 and all(ln.endswith(": equal") for ln in lines), lines


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_row_kernels_equal_the_loop_on_the_gpu():
    sys.path.insert(0, str(Path(__file__).parent))
    import symm_rows_check

    assert symm_rows_check.main("cuda") == 0
