"""Peak memory and time of one ExpertParallelMoE layer (backend torch) with and without balancing.

Qwen3-30B-A3B expert shape (hidden 2048, expert FFN 768, top-8, 128 experts), megatron's biased random
router (router_skew), bf16 on GPU. Launch one process per GPU:

    torchrun --nproc_per_node=2 bench/layer_memory.py [--tokens 4096] [--skew -4] [--layout clustered]

Measures, per policy, the peak allocated memory of forward + backward above what is resident before the
call (weights, inputs, the replica pool), the pool's size, and the median layer time. Writes
results/layer_memory.md (rank 0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, bench_gpu, markdown_table, run_info  # noqa: E402
from topoep import ExpertParallelMoE, Topology  # noqa: E402
from topoep.workloads import expert_bias  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--skew", type=float, default=-4.0)
    ap.add_argument("--layout", default="clustered", choices=["random", "clustered", "scattered"])
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--ranks-per-domain", type=int, default=None)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "layer_memory.md")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    if cuda:
        dev = bench_gpu()
        dist.init_process_group("nccl", device_id=dev)
        dtype = torch.bfloat16
    else:
        dev, dtype = torch.device("cpu"), torch.float32
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rpd = args.ranks_per_domain or world
    topo = Topology(num_domains=world // rpd, ranks_per_domain=rpd)
    g = torch.Generator().manual_seed(1000 + rank)
    bias = expert_bias(args.experts, args.skew, num_ranks=world, seed=0, layout=args.layout)
    idx = torch.topk(torch.randn(args.tokens, args.experts, generator=g) + bias, args.topk, dim=1).indices.to(dev)
    w = torch.softmax(torch.randn(args.tokens, args.topk, generator=g), -1).to(dev, dtype)
    x = (torch.randn(args.tokens, args.hidden, generator=g) * 0.1).to(dev, dtype).requires_grad_()
    rows = []
    for policy in ("static", "topoep"):
        layer = ExpertParallelMoE(num_experts=args.experts, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
                                  topology=topo, num_slots=args.slots, policy=policy, dtype=dtype, device=dev)
        times, peaks = [], []
        for it in range(args.iters + 1):
            x.grad = None
            layer.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            t0 = time.perf_counter()
            y = layer(x, idx, w)
            y.float().square().mean().backward()
            if cuda:
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_allocated() - base)
            if it:  # the first call warms up (and allocates the replica pool)
                times.append(time.perf_counter() - t0)
        s = layer.stats_dict()
        rows.append(dict(policy=policy, ms=1e3 * statistics.median(times), peak_mib=max(peaks[1:]) / 2**20 if peaks else None,
                         pool_mib=layer.pool.nbytes / 2**20, imbalance=s["imbalance"], before=s["static_imbalance"],
                         replica=s["replica_fraction"]))
        del layer
    if rank == 0:
        info = run_info(vars(args) | {"out": str(args.out), "world": world})
        table = markdown_table(
            ["policy", "layer fwd+bwd (ms, median)", "peak extra memory (MiB)", "replica pool (MiB)",
             "rank imbalance (before -> after)", "replica-served"],
            [[r["policy"], f"{r['ms']:.1f}", f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "n/a",
              f"{r['pool_mib']:.1f}" if r["policy"] != "static" else "0 (not used)",
              f"{r['before']:.2f} -> {r['imbalance']:.2f}", f"{100 * r['replica']:.1f} %"] for r in rows])
        text = (f"# One MoE layer: memory and time with and without balancing (backend torch)\n\n"
                f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']}\n"
                f"- {world} ranks ({topo}), {args.experts} experts, hidden {args.hidden}, expert FFN {args.ffn}, "
                f"top-{args.topk}, {args.tokens} tokens per rank, router_skew {args.skew} ({args.layout}), "
                f"{args.slots} slots, {dtype}\n- reproduce: `torchrun --nproc_per_node={world} bench/layer_memory.py`\n\n"
                f"{table}\n\nPeak extra memory = max allocated during forward + backward minus what was allocated "
                "before the call (weights, input, and the replica pool once it exists).\n")
        print(text)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
