"""Helper for multi-rank tests: run a function in several gloo processes on this machine."""

from __future__ import annotations

import datetime
import io
import os
import socket
import sys
import traceback

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpus_shared(world_size: int) -> bool:
    """Whether a GPU test of `world_size` ranks runs with several ranks per GPU: only when asked with
    TOPOEP_GPU_SHARE=1 on a machine with fewer GPUs than ranks (one-GPU machines: the multi-rank paths' correctness,
    never their speed). The ranks then share the GPUs round-robin over a gloo process group."""
    return os.environ.get("TOPOEP_GPU_SHARE", "0") == "1" and 0 < torch.cuda.device_count() < world_size


def gpus_for(world_size: int) -> bool:
    """Whether this machine can run a GPU test of `world_size` ranks (one GPU each, or shared: gpus_shared)."""
    return torch.cuda.device_count() >= world_size or gpus_shared(world_size)


def rank_device(rank: int) -> torch.device:
    """The GPU of a test rank: its own, or round-robin when the ranks share the GPUs (gpus_shared)."""
    return torch.device("cuda", rank % torch.cuda.device_count())


def _entry(rank, world_size, port, fn, args, queue, backend="gloo"):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        kw = {}
        if backend == "nccl":
            dev = rank_device(rank)
            torch.cuda.set_device(dev)
            if gpus_shared(world_size):
                # NCCL refuses two ranks on one device; gloo moves the tests' own CUDA collectives through the
                # host, and symmetric memory accepts the overlap when told (torch's own test of it does the same)
                os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
                backend = "gloo"
            else:
                kw["device_id"] = dev
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=5), **kw)
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()  # plain bytes: tensors must not travel as shared-memory handles of a dying process
        torch.save(result, buf)
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report any failure of the rank to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            deepep = sys.modules.get("topoep.runtime.deepep")  # never imported: no DeepEP buffer to free
            if deepep is not None:
                deepep.release_buffers()  # transport deepep's buffers, while their process group lives
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, backend: str = "gloo"):
    """Run fn(rank, world_size, *args) in `world_size` processes joined by a process group (gloo: forked
    CPU processes; nccl: spawned processes, one GPU each, or sharing them: gpus_shared). Returns the per-rank
    results; raises AssertionError with the failing rank's traceback."""
    ctx = mp.get_context("fork" if backend == "gloo" else "spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, backend)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, status, payload = queue.get()
        if status != "ok":
            for p in procs:
                p.terminate()
            raise AssertionError(f"rank {rank} failed:\n{payload}")
        results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    for p in procs:
        p.join()
    return [results[r] for r in range(world_size)]
