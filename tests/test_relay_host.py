"""csrc/relay_tree.cuh, the relay trees' rule that csrc/guard.cu runs per copy on the GPU (the guard's pricing and the
runtime's trees, `topoep.runtime.guard_cuda`), built for the host with the system's C++ compiler: its sources and
levels equal `topoep.relay.relay_sources` bit for bit on the plans of tests/test_relay.py, and its per-copy share
flags give `topoep.relay.direct_beyond_tree`. The GPU tests (tests/test_guard_cuda.py) compare the kernel itself."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from test_relay import _plans, duty_plan
from topoep.relay import direct_beyond_tree, relay_sources

SOURCE = Path(__file__).parent / "csrc" / "relay_host.cpp"


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory):
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        pytest.skip("needs a C++ compiler (c++ or g++) to build csrc/relay_tree.cuh for the host")
    out = tmp_path_factory.mktemp("relay_host") / "relay_host.so"
    subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Werror", "-shared", "-fPIC", str(SOURCE), "-o", str(out)],
                   check=True, capture_output=True, text=True)
    lib = ctypes.CDLL(str(out))
    lib.relay_sources_host.restype = None
    return lib


def host_trees(lib, plan, fanout: int):
    """(source, level, beyond) of every slot, from the host build of the device rule."""
    R, N = plan.num_ranks, plan.num_slots
    slot = plan.slot_expert.to(torch.int64).contiguous()
    main = plan.main_rank.to(torch.int64).contiguous()
    source = torch.empty(R, N, dtype=torch.int64)
    level = torch.empty(R, N, dtype=torch.int64)
    beyond = torch.empty(R, N, dtype=torch.uint8)
    ptr = ctypes.c_void_p
    lib.relay_sources_host(ptr(slot.data_ptr()), ptr(main.data_ptr()), R, N, plan.num_experts,
                           plan.topology.ranks_per_domain, fanout, ptr(source.data_ptr()), ptr(level.data_ptr()),
                           ptr(beyond.data_ptr()))
    return source, level, beyond.bool()


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_device_rule_equals_the_reference(host_lib, fanout):
    seen = 0
    for plan in (*_plans(), duty_plan()):
        source, level, beyond = host_trees(host_lib, plan, fanout)
        want_s, want_l = relay_sources(plan, fanout)
        assert torch.equal(source, want_s) and torch.equal(level, want_l), plan.policy
        assert bool(beyond.any()) == bool(direct_beyond_tree(plan, fanout))
        seen += int(level.max()) >= 2
    assert seen > 0  # relayed copies were compared
