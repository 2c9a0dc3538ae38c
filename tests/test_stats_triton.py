"""The plan statistics kernel (topoep.runtime.stats_triton) against topoep.metrics.plan_stats: under Triton's
interpreter on the CPU (tests/plan_stats_check.py in a subprocess: the interpreter must be chosen before triton is
imported) and on a GPU (skipped without one); and when the runtime uses it."""

import sys
from pathlib import Path

import pytest
import torch

from interpreter import interpreted_cases
from topoep import Topology, solve
from topoep.metrics import plan_stats
from topoep.runtime import stats_triton


def test_stats_kernel_equals_plan_stats_in_the_interpreter():
    lines = interpreted_cases("plan_stats_check.py")
    assert len(lines) == 6 and all(ln.endswith(": equal") for ln in lines), lines
    assert any(" replicas=0:" not in ln for ln in lines)  # replicas placed in some cases


def test_the_kernel_applies_to_gpu_plans_with_the_default_placement_only():
    plan = solve(torch.ones(2, 8, dtype=torch.int64), Topology(num_domains=1, ranks_per_domain=2), policy="static",
                 num_slots=1)
    assert not stats_triton.usable(plan)  # a CPU plan: the reference
    assert torch.equal(stats_triton.stats(plan, 1e-7), plan_stats(plan, 1e-7))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_stats_kernel_equals_plan_stats_on_the_gpu():
    sys.path.insert(0, str(Path(__file__).parent))
    import plan_stats_check

    assert plan_stats_check.main("cuda") == 0
