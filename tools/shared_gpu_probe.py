"""Can two ranks share one GPU for backend cuda's correctness tests? (one-GPU machines)

Runs 2 processes that both use cuda:0 and, for each process-group backend (gloo, nccl), tries:
- torch symmetric memory with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1: allocate, rendezvous, write into the
  peer's buffer through its pointer, barrier on the signal pads, read what the peer wrote;
- an all_gather of a CUDA tensor through the group (NCCL refuses two ranks on one device).
Prints one line per (backend, check): ok or the error's first line. Timing on a shared GPU means nothing; this
only decides whether the multi-rank correctness tests can run there.

    python tools/shared_gpu_probe.py
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from distributed import free_port  # noqa: E402


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:200]


def _rank(rank, world, port, backend, queue):
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES="1")
    torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    out = {}
    try:
        t = symm_mem.empty(1024, dtype=torch.float32, device="cuda:0").fill_(-1)
        h = symm_mem.rendezvous(t, dist.group.WORLD.group_name)
        torch.cuda.synchronize()  # every rank's fill done before any peer writes into its buffer
        dist.barrier()
        peer = (rank + 1) % world
        h.get_buffer(peer, (1024,), torch.float32).fill_(float(rank))
        h.barrier(channel=0)
        got = t.clone().cpu()
        out["symm_mem"] = "ok" if bool((got == float((rank - 1) % world)).all()) else f"wrong values {got[:4]}"
    except Exception as exc:  # noqa: BLE001 - the probe reports every failure
        out["symm_mem"] = _first_line(exc)
    try:
        x = torch.full((4,), float(rank), device="cuda:0")
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x)
        torch.cuda.synchronize()
        out["all_gather"] = "ok" if all(bool((p == r).all()) for r, p in enumerate(parts)) else "wrong values"
    except Exception as exc:  # noqa: BLE001
        out["all_gather"] = _first_line(exc)
    queue.put((rank, out))
    dist.destroy_process_group()


def probe(backend: str, world: int = 2) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, backend, queue)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    results = {}
    while not queue.empty():
        rank, out = queue.get()
        results[rank] = out
    for p in procs:
        if p.is_alive():
            p.kill()
    return results


def main():
    if not torch.cuda.is_available():
        sys.exit("needs a GPU")
    for backend in ("gloo", "nccl"):
        res = probe(backend)
        if len(res) < 2:
            print(f"{backend}: only ranks {sorted(res)} reported (a rank hung or died)")
        for rank in sorted(res):
            for check, status in res[rank].items():
                print(f"{backend:5s} rank {rank} {check:10s} {status}")


if __name__ == "__main__":
    main()
