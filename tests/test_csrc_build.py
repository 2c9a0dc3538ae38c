"""Build test (CPU): csrc/ compiles and links with nvcc into a loadable library that registers the planner
ops, their per-call grid and skip arguments, the workspace layout the wrapper reads, and the guard's ops. CI has nvcc but no GPU,
so a build break fails CI even though the kernels only run on the GPU machine. Skipped, saying so, where no CUDA
toolkit is installed."""

import os
import subprocess
import sys

import pytest

from topoep.planners.cuda import cuda_home

CHECK = """
import torch
from topoep.planners.cuda import PHASES, PLUS_PHASES, REFINE_COUNTERS, WORKSPACE_FIELDS, load_extension
lib = load_extension()
assert lib.exists() and lib.stat().st_size > 0
ops = torch.ops.topoep
for name in ("plan_topoep", "plan_topoep_plus", "plan_static", "fit_capacity", "workspace_layout"):
    assert hasattr(ops, name), name
for name in ("set_skip_stages", "set_grid_blocks"):  # no process-wide settings: both are arguments of a plan
    assert not hasattr(ops, name), name
tail = "Tensor(c!) workspace, int num_blocks=0, int skip_stages=0, Tensor? enable=None"
assert str(ops.plan_topoep.default._schema).endswith(tail + ") -> ()")
assert str(ops.plan_topoep_plus.default._schema).endswith(tail + ", bool inter_domain=True) -> ()")
lay = dict(zip(WORKSPACE_FIELDS, ops.workspace_layout(32, 640, 4, 2), strict=True))
heads = [(lay[n], lay["num_" + n]) for n in ("stamps", "refine_counters", "plus_stamps")]
assert [k for _, k in heads] == [len(PHASES) + 1, len(REFINE_COUNTERS), len(PLUS_PHASES)], lay
ends = sorted((at, at + k) for at, k in heads + [(lay["moves"], 1)])
assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])) and ends[-1][1] <= lay["elems"], lay
assert ops.fit_workspace_elems(32, 640, 2) > 0
# the guard's ops (csrc/guard.cu): schemas with every output mutated, and the workspace of its accumulators (per plan
# and the static plan: loads and 4 token links per rank; per plan: 4 fetch links per rank, 4 per rank and relay
# level, copies per level, occupied slots, plans whose direct fetch exceeds a tree's share, the longest chain of hops
# copy by copy, each rank's rows on slots for fetch_overlap) and one block counter
for name in ("guard_select", "relay_trees", "guard_workspace_elems"):
    assert hasattr(ops, name), name
schema = str(ops.guard_select.default._schema)
for out in ("route_out", "slot_out", "choice", "use", "fired", "relay", "saved", "cost", "workspace"):
    assert f"!) {out}" in schema, (out, schema)
assert "Tensor(a!) source, Tensor(b!) level" in str(ops.relay_trees.default._schema)
for P, R, L in ((1, 8, 0), (2, 32, 3), (4, 128, 9)):
    assert ops.guard_workspace_elems(P, R, L) == (P + 1) * 5 * R + P * 4 * R + P * L * 4 * R + P * L + 3 * P + P * R + 1
assert "int levels, int chunks, bool share, bool async_fetch, bool fetch_overlap, Tensor? allow" in schema, schema
print(lib)
"""


@pytest.mark.skipif(cuda_home() is None, reason="no CUDA toolkit (nvcc) on this machine")
def test_planner_extension_builds_and_registers_ops(tmp_path):
    env = {**os.environ, "TOPOEP_EXT_DIR": str(tmp_path)}  # a fresh build in a new process, not a cached one
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert str(tmp_path) in proc.stdout
