"""Replica weight transfers of backend cuda's peer transport (topoep/runtime/symm.py) on the GPUs of one host:
the fetch (each main rank pushes its experts' weights into the peers' slots, `_push_slots_kernel`) and the
gradient push (each rank sends its slots' weight gradients to the main rank, `_push_grads_kernel`), for a grid of
copy chunk sizes and warps per program, beside copy-engine peer copies of the same bytes (`copy_` into the peer's
symmetric-memory view: the link's rate without SMs, which the layer cannot use: its slot targets are device data).

    torchrun --nproc_per_node=2 bench/replica_copy.py [--slots 8] [--chunks 4096 8192 16384 32768] [--warps 4 8 16]

Qwen3-30B-A3B expert shape (hidden 2048, expert FFN 768, bf16: 9.4 MB per expert). Rank 0's first `slots` experts
go into every other rank's slots: one sender, as with hot experts concentrated on one rank (the case where
results/moe_layer_cuda_slots8.md measures the fetch at 0.3-0.4 ms for 8 experts, about 200 GB/s). Every fetch
is checked against the sender's weights once per setting. Time: median over `--runs` runs after `--warmup`, CUDA
events around the copy and a symmetric-memory barrier (so the bytes have arrived), the slowest rank. GB/s: the
bytes one sender moves / time. Writes results/replica_copy.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, bench_gpu, markdown_table, run_info, without_options, write_json  # noqa: E402
from bench.moe_layer import across_ranks_max, time_iterations  # noqa: E402

HIDDEN, FFN = 2048, 768


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, default=8, help="replica slots per rank (experts sent per receiver)")
    ap.add_argument("--experts-per-rank", type=int, default=64)
    ap.add_argument("--chunks", type=int, nargs="+", default=[4096, 8192, 16384, 32768],
                    help="elements per program (symm.COPY_CHUNK; the layer's default is 8192)")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16], help="warps per program (symm.COPY_WARPS)")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "results")
    ap.add_argument("--name", default="replica_copy")
    args = ap.parse_args(argv)
    if not 1 <= args.slots <= args.experts_per_rank:
        raise ValueError(f"--slots must be in [1, --experts-per-rank={args.experts_per_rank}], got {args.slots}")
    bad = [c for c in args.chunks if c < 128 or c & (c - 1)]
    if bad:
        raise ValueError(f"--chunks must be powers of two >= 128 (Triton block sizes), got {bad}")
    bad = [w for w in args.warps if w not in (1, 2, 4, 8, 16, 32)]
    if bad:
        raise ValueError(f"--warps must be among 1, 2, 4, 8, 16, 32, got {bad}")
    args.command = " ".join(["bench/replica_copy.py", *without_options(sys.argv[1:] if argv is None else argv,
                                                                        "--out")])
    return args


def _weights(rank: int, e_loc: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s stacked expert weights, from a seed per rank (so a receiver can rebuild the sender's)."""
    g = torch.Generator(device=dev).manual_seed(1000 + rank)
    w1 = torch.randn(e_loc, 2 * FFN, HIDDEN, generator=g, device=dev).to(torch.bfloat16)
    w2 = torch.randn(e_loc, HIDDEN, FFN, generator=g, device=dev).to(torch.bfloat16)
    return w1, w2


def _timed(fn, runs: int, warmup: int) -> float:
    """Median ms of fn over runs (CUDA events, each after a barrier), the slowest rank's."""
    for _ in range(warmup):
        fn()
    return statistics.median(across_ranks_max(time_iterations(fn, runs, cuda=True), torch.device("cuda")))


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench/replica_copy.py needs GPUs (run it with torchrun on the GPU machine)")
    dev = bench_gpu()
    dist.init_process_group("nccl", device_id=dev)
    rank, R = dist.get_rank(), dist.get_world_size()
    if R < 2:
        raise SystemExit("bench/replica_copy.py needs at least 2 ranks (torchrun --nproc_per_node=2)")
    import topoep.runtime.symm as S

    N, e_loc = args.slots, args.experts_per_rank
    pool = S.SymmReplicaPool(None, N, HIDDEN, FFN, torch.bfloat16, dev)
    W1, W2 = _weights(rank, e_loc, dev)
    se = torch.full((R, N), -1, dtype=torch.int64, device=dev)
    se[1:] = torch.arange(N, device=dev)  # rank 0's experts 0..N-1 in every other rank's slots
    expert_bytes = (W1[0].numel() + W2[0].numel()) * 2
    fetch_bytes = (R - 1) * N * expert_bytes  # what rank 0 sends
    s1, s2 = torch.randn_like(pool.fc1, dtype=torch.float32).bfloat16(), torch.randn_like(pool.fc2, dtype=torch.float32).bfloat16()
    g1, g2 = torch.zeros_like(W1), torch.zeros_like(W2)
    publish = lambda: pool._fc1.barrier(channel=0)  # noqa: E731 - nothing else uses this handle's barrier
    want = _weights(0, e_loc, dev) if rank else None
    rows = []
    for chunk in args.chunks:
        for warps in args.warps:
            S.COPY_CHUNK, S.COPY_WARPS = chunk, warps
            pool.fc1.zero_()
            pool.fc2.zero_()
            dist.barrier()
            pool.fetch(se, W1, W2, e_loc)
            publish()
            torch.cuda.synchronize()
            ok = torch.tensor([1 if rank == 0 else int(torch.equal(pool.fc1, want[0][:N])
                                                        and torch.equal(pool.fc2, want[1][:N]))], device=dev)
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            if not int(ok):
                raise SystemExit(f"fetch with chunk {chunk}, {warps} warps: the slots differ from the sender's weights")
            t_fetch = _timed(lambda: (pool.fetch(se, W1, W2, e_loc), publish()), args.runs, args.warmup)
            # every rank but 0 pushes its N slot gradients to rank 0, which sums them (reduce_grads barriers first)
            t_grad = _timed(lambda: (pool.push_grads(se, s1, s2, e_loc), publish()), args.runs, args.warmup)
            t_ret = _timed(lambda: pool.return_grads(se, g1, g2, e_loc, src=(s1, s2)), args.runs, args.warmup)
            rows.append(dict(kind="kernel", chunk=chunk, warps=warps, fetch_ms=t_fetch,
                             fetch_gbs=fetch_bytes / t_fetch / 1e6, grad_push_ms=t_grad,
                             grad_push_gbs=N * expert_bytes / t_grad / 1e6, grad_return_ms=t_ret))
            if rank == 0:
                print(f"chunk {chunk:6d} warps {warps:2d}: fetch {t_fetch:.3f} ms ({rows[-1]['fetch_gbs']:.0f} GB/s), "
                      f"gradient push {t_grad:.3f} ms ({rows[-1]['grad_push_gbs']:.0f} GB/s), return (push + sum) "
                      f"{t_ret:.3f} ms", flush=True)
    S.COPY_CHUNK, S.COPY_WARPS = 8192, 4
    # copy engines: rank 0 copies the same experts into every peer's slots with copy_ (cudaMemcpyAsync)
    remote = [(pool._fc1.handle.get_remote_tensor(r, tuple(pool.fc1.shape), torch.bfloat16),
               pool._fc2.handle.get_remote_tensor(r, tuple(pool.fc2.shape), torch.bfloat16)) for r in range(R)]

    def engines():
        if rank == 0:
            for r in range(1, R):
                remote[r][0].copy_(W1[:N])
                remote[r][1].copy_(W2[:N])
        publish()

    try:
        t_ce = _timed(engines, args.runs, args.warmup)
        rows.append(dict(kind="copy engine", chunk=None, warps=None, fetch_ms=t_ce, fetch_gbs=fetch_bytes / t_ce / 1e6,
                         grad_push_ms=None, grad_push_gbs=None, grad_return_ms=None))
        if rank == 0:
            print(f"copy engines: {t_ce:.3f} ms ({rows[-1]['fetch_gbs']:.0f} GB/s)", flush=True)
    except RuntimeError as e:  # the kernels' rows are still reported
        if rank == 0:
            print(f"copy engines: failed ({e}); not in the report", flush=True)
    if rank == 0:
        report(args, rows, R, expert_bytes)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(args, rows: list[dict], R: int, expert_bytes: int) -> None:
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()} | {"world": R})
    f = lambda v, fmt="{:.3f}": "-" if v is None else fmt.format(v)  # noqa: E731
    table = markdown_table(
        ["copy", "chunk (elements)", "warps", "fetch ms", "fetch GB/s", "gradient push ms", "gradient push GB/s",
         "gradient return (push + barrier + sum) ms"],
        [[r["kind"], f(r["chunk"], "{}"), f(r["warps"], "{}"), f(r["fetch_ms"]), f(r["fetch_gbs"], "{:.0f}"),
          f(r["grad_push_ms"]), f(r["grad_push_gbs"], "{:.0f}"), f(r["grad_return_ms"])] for r in rows])
    text = "\n".join([
        "# Replica weight transfers of backend cuda's peer transport: fetch and gradient push bandwidth\n",
        f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']}",
        f"- {R} ranks; {args.slots} experts of rank 0 into each other rank's slots ({expert_bytes / 1e6:.1f} MB per "
        f"expert, Qwen3-30B-A3B shape, bf16); every rank but 0 pushes {args.slots} slot gradients to rank 0",
        f"- ms: median of {args.runs} runs after {args.warmup} warm-ups, the slowest rank, copy plus a symmetric-memory "
        "barrier; GB/s: bytes one sender moves / time; the layer's defaults are chunk 8192, 4 warps; copy engine: "
        "`copy_` into the peer's symmetric-memory view (not usable by the layer, whose slot targets are device data)",
        f"- reproduce: `torchrun --nproc_per_node={R} {args.command}`\n", table, ""])
    print(text, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    write_json(args.out / f"{args.name}.json", info, rows)


if __name__ == "__main__":
    sys.exit(main())
