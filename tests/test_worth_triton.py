"""The pre-plan bound's Triton kernel (topoep.runtime.worth_triton) against NetBenefitGuard.worth_planning's torch
form: the same decision on every case under Triton's interpreter (CPU), and on the GPU."""

import sys
from pathlib import Path

import pytest
import torch

from interpreter import interpreted_cases


def test_bound_kernel_equals_the_reference_in_the_interpreter():
    lines = interpreted_cases("worth_check.py")
    assert len(lines) == 9 * 6 + 1 and all(ln.endswith("equal") for ln in lines), lines
    # both decisions occur, and the threshold at the bound itself says no (strictly greater)
    assert any("threshold=0.0" in ln for ln in lines) and any("diff=0 " in ln for ln in lines)


def test_the_kernel_applies_to_the_default_placement_only():
    from topoep.plan import default_main_rank
    from topoep.runtime.worth_triton import usable

    omega = torch.ones(4, 16, dtype=torch.int64)
    assert usable(omega, default_main_rank(16, 4)) == (usable.__module__ is not None and _has_triton())
    assert not usable(omega, default_main_rank(16, 4).clone())  # another placement's tensor: the torch path
    assert not usable(torch.ones(1, 16, dtype=torch.int64), default_main_rank(16, 1))


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bound_kernel_equals_the_reference_on_the_gpu():
    sys.path.insert(0, str(Path(__file__).parent))
    import worth_check

    assert worth_check.main("cuda") == 0
