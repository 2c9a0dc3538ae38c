"""Helper for multi-rank tests: run a function in several gloo processes on this machine."""

from __future__ import annotations

import datetime
import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=5))
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - report any failure of the rank to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args):
    """Run fn(rank, world_size, *args) in `world_size` forked processes joined by a gloo group.
    Returns the list of per-rank results; raises AssertionError with the failing rank's traceback."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, status, payload = queue.get()
        if status != "ok":
            for p in procs:
                p.terminate()
            raise AssertionError(f"rank {rank} failed:\n{payload}")
        results[rank] = payload
    for p in procs:
        p.join()
    return [results[r] for r in range(world_size)]
