"""Backend cuda's row kernels (topoep/runtime/symm.py: dispatch, copy out of the receive buffers, combine), with a
rank's own rows kept in place and without, against a loop over the rows (tests/symm_rows_check.py), on a GPU (skipped
without one). Not under Triton's interpreter: it cannot run their loops over `range(tl.program_id(0), ...)` with this
numpy (it converts a one-element array to an int); their sm_90 compile is tests/test_triton_compile.py's."""

import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_row_kernels_equal_the_loop_on_the_gpu():
    sys.path.insert(0, str(Path(__file__).parent))
    import symm_rows_check

    assert symm_rows_check.main("cuda") == 0
