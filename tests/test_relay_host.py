"""csrc/relay_tree.cuh, the relay trees' rule that csrc/guard.cu runs per copy on the GPU (the guard's pricing and the
runtime's trees, `topoep.runtime.guard_cuda`), built for the host with the system's C++ compiler: its sources and
levels equal `topoep.relay.relay_sources` bit for bit on the plans of tests/test_relay.py and on random slot tables
with hot experts, each copy's arrival copy by copy equals `topoep.relay.copy_arrival`, and its per-copy share flags
give `topoep.relay.direct_beyond_tree`. The GPU tests (tests/test_guard_cuda.py) compare the kernel itself."""

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from test_relay import _plans, duty_plan, nic_relays
from topoep.relay import copy_arrival, direct_beyond_tree, max_level, relay_sources

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
    """(source, level, beyond, arrival) of every slot, from the host build of the device rule (arrival: copy by copy,
    at the topology's integer costs, csrc/relay_tree.cuh relay_arrival)."""
    R, N = plan.num_ranks, plan.num_slots
    slot = plan.slot_expert.to(torch.int64).contiguous()
    main = plan.main_rank.to(torch.int64).contiguous()
    cost = plan.topology.on("cpu").cost_fs.contiguous()
    source, level, arrival = (torch.empty(R, N, dtype=torch.int64) for _ in range(3))
    beyond = torch.empty(R, N, dtype=torch.uint8)
    ptr = ctypes.c_void_p
    lib.relay_sources_host(ptr(slot.data_ptr()), ptr(main.data_ptr()), R, N, plan.num_experts,
                           plan.topology.ranks_per_domain, fanout, ptr(source.data_ptr()), ptr(level.data_ptr()),
                           ptr(beyond.data_ptr()), ptr(cost.data_ptr()), ctypes.c_int64(plan.expert_bytes),
                           max_level(plan.topology, fanout), ptr(arrival.data_ptr()))
    return source, level, beyond.bool(), arrival


def random_plans():
    """Random valid slot tables with hot experts (deep trees), as tests/test_guard_cuda.py draws them for the GPU."""
    import dataclasses
    import random

    from test_guard_cuda import random_slots
    from topoep import Topology, solve

    rng = random.Random(5)
    for _ in range(60):
        rpd, M = rng.choice([(1, 4), (2, 2), (4, 2), (8, 1), (8, 4), (3, 3), (16, 1), (1, 8), (2, 6)])
        R, N = rpd * M, rng.choice([1, 2, 4])
        E = R * 2
        topo = Topology(num_domains=M, ranks_per_domain=rpd, intra_cost=1 / rng.choice([155e9, 287e9]),
                        inter_cost=1 / rng.choice([45e9, 90e9]))
        base = solve(torch.ones(R, E, dtype=torch.int64), topo, num_slots=N, policy="static", backend="reference",
                     expert_bytes=rng.choice([1 << 20, 9437184]))
        yield dataclasses.replace(base, slot_expert=random_slots(R, E, N, base.main_rank, rng,
                                                                 hot=rng.choice([1, 2, E])))


@pytest.mark.parametrize("fanout", [1, 2, 3, 4])
def test_device_rule_equals_the_reference(host_lib, fanout):
    """Sources, levels and each copy's arrival copy by copy equal relay_sources and copy_arrival bit for bit; the
    share flags give direct_beyond_tree."""
    deep = roots_relayed = 0
    for plan in (*_plans(), duty_plan(), *random_plans()):
        source, level, beyond, arrival = host_trees(host_lib, plan, fanout)
        want_s, want_l = relay_sources(plan, fanout)
        assert torch.equal(source, want_s) and torch.equal(level, want_l), plan.policy
        assert bool(beyond.any()) == bool(direct_beyond_tree(plan, fanout))
        hop = plan.topology.on("cpu").cost_fs * plan.expert_bytes
        assert torch.equal(arrival, copy_arrival(plan, want_s, want_l, hop, max_level(plan.topology, fanout)))
        deep += int(level.max()) >= 3
        roots_relayed += nic_relays(plan, want_s)
    assert deep > 0  # chains of three hops and more were compared
    assert roots_relayed > 0  # and remote roots fetching from another domain's root (the NIC tree's deeper levels)
