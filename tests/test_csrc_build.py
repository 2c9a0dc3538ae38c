"""Build test (CPU): csrc/ compiles and links with nvcc into a loadable library that registers the planner
ops. CI has nvcc but no GPU, so a build break fails CI even though the kernels only run on the GPU machine.
Skipped, saying so, where no CUDA toolkit is installed."""

import os
import subprocess
import sys

import pytest

from topoep.planners.cuda import cuda_home

CHECK = ("import torch; from topoep.planners.cuda import load_extension; lib = load_extension(); "
         "assert lib.exists() and lib.stat().st_size > 0; "
         "assert hasattr(torch.ops.topoep, 'plan_topoep') and hasattr(torch.ops.topoep, 'plan_static'); "
         "assert hasattr(torch.ops.topoep, 'set_skip_stages'); "
         "from topoep.planners.cuda import set_grid_blocks; set_grid_blocks(7); set_grid_blocks(0); print(lib)")


@pytest.mark.skipif(cuda_home() is None, reason="no CUDA toolkit (nvcc) on this machine")
def test_planner_extension_builds_and_registers_ops(tmp_path):
    env = {**os.environ, "TOPOEP_EXT_DIR": str(tmp_path)}  # a fresh build in a new process, not a cached one
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert str(tmp_path) in proc.stdout
