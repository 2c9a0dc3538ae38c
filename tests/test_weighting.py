"""CPU test of backend cuda's fused top-k weighting (topoep/runtime/weighting.py): its Triton kernels
against their torch references under Triton's interpreter (tests/weighting_check.py in a subprocess: the
interpreter must be chosen before triton is imported), and the same check with the compiled kernels on a GPU
(skipped without one)."""

import sys
from pathlib import Path

import pytest

from interpreter import interpreted_cases


def test_weighting_kernels_equal_their_references_in_the_interpreter():
    lines = interpreted_cases("weighting_check.py")
    assert len(lines) == 5 and all(ln.endswith(": equal") for ln in lines), lines


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a GPU")
def test_weighting_kernels_equal_their_references_on_the_gpu():
    sys.path.insert(0, str(Path(__file__).parent))
    import weighting_check

    assert weighting_check.main("cuda") == 0
