"""Which GPU a rank takes: the GPU tests (distributed.py) one per rank, or shared only when asked
(TOPOEP_GPU_SHARE=1) on a machine with fewer GPUs than ranks; the trainer and the benchmarks always one per process
(topoep.runtime.backend.local_gpu). Runs on the CPU with the GPU count faked."""

import pytest
import torch

from distributed import gpus_for, gpus_shared, rank_device


@pytest.mark.parametrize("gpus, share, world, runs, shared", [
    (2, "0", 2, True, False),   # one GPU per rank
    (8, "1", 2, True, False),   # enough GPUs: never shared, even when allowed
    (1, "0", 2, False, False),  # too few, not asked: the test skips
    (1, "1", 2, True, True),    # too few, asked: the ranks share
    (0, "1", 2, False, False),  # no GPU: nothing to share
    (1, "1", 1, True, False),
])
def test_ranks_share_gpus_only_when_asked_and_needed(monkeypatch, gpus, share, world, runs, shared):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setenv("TOPOEP_GPU_SHARE", share)
    assert gpus_for(world) == runs
    assert gpus_shared(world) == shared


def test_shared_ranks_go_round_robin(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert [rank_device(r).index for r in range(5)] == [0, 1, 0, 1, 0]
    assert all(rank_device(r).type == "cuda" for r in range(5))


def test_a_launch_with_more_processes_than_gpus_names_the_fix(monkeypatch):
    """The trainer and the benchmarks take one GPU per process (topoep.runtime.backend.local_gpu); a local rank
    past the node's GPUs is an error that says how to launch, not a CUDA 'invalid device ordinal'."""
    from topoep.runtime.backend import local_gpu

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert local_gpu(1, "torchrun --nproc_per_node=2") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"local rank 2 has no GPU of its own: this node shows 2 GPU\(s\).*"
                                         r"torchrun --nproc_per_node=2"):
        local_gpu(2, "torchrun --nproc_per_node=2")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="shows 0 GPU"):
        local_gpu(0, "torchrun --nproc_per_node=1")
