"""Per-rank memory of one ExpertParallelMoE layer call (forward + backward): backend torch, and backend cuda with its
buffers sized for the worst case (capacity_factor=None) and by the capacity (the default capacity_factor), beside
the memory model's prediction (topoep/memory.py).

Qwen3-30B-A3B expert shape (hidden 2048, expert FFN 768, top-8, 128 experts), megatron's biased random router
(uniform and skewed), policy topoep with its guard, 2 slots, bf16 on GPU. One process per EP rank:

    torchrun --nproc_per_node=8 bench/layer_memory.py --share-gpu --out results/gpu/layer_memory
    python bench/layer_memory.py --report results/gpu/layer_memory/layer_memory_ep*.json

--share-gpu lets the ranks share the visible GPUs (a gloo process group; symmetric memory allowed on overlapping
devices): memory per process is real there, time is not (nothing here is timed). Per configuration the peak of
torch's caching allocator above what was allocated before the call (weights, input) is measured over warm calls,
on every rank; symmetric memory (backend cuda's workspace and replica pool) is allocated outside that allocator and
is reported from the buffers' sizes. --report joins the runs of several EP sizes into results/layer_memory.{md,json}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, markdown_table, repo_relative, run_info  # noqa: E402
from topoep import ExpertParallelMoE, Topology  # noqa: E402
from topoep.memory import layer_memory  # noqa: E402
from topoep.config import DEFAULT_CAPACITY_FACTOR  # noqa: E402
from topoep.workloads import expert_bias  # noqa: E402

MIB = 2 ** 20
VARIANTS = {"torch": ("torch", None), "cuda-worst": ("cuda", None), "cuda-capacity": ("cuda", DEFAULT_CAPACITY_FACTOR)}


def _setup(share: bool) -> torch.device:
    rank, local = int(os.environ.get("RANK", 0)), int(os.environ.get("LOCAL_RANK", 0))
    if share:  # several ranks per GPU: memory is per process, time would mean nothing
        os.environ["TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES"] = "1"
        dev = torch.device("cuda", local % torch.cuda.device_count())
        torch.cuda.set_device(dev)
        dist.init_process_group("gloo")
        return dev
    from bench.common import bench_gpu

    dev = bench_gpu()
    dist.init_process_group("nccl", device_id=dev)
    del rank
    return dev


def _symmetric_bytes(layer) -> int:
    """Backend cuda's symmetric buffers (workspace, replica pool with its gradient-return regions)."""
    ws = layer.workspace
    n = ws.nbytes if ws is not None else 0
    pool = layer.pool if layer.backend.name == "cuda" else None
    if pool is not None and hasattr(pool, "ret1"):
        n += sum(b.tensor.numel() * b.tensor.element_size() for b in (pool._fc1, pool._fc2, pool.ret1, pool.ret2))
    return n


def measure(args, dev, world, rank) -> list[dict]:
    rpd = args.ranks_per_domain or world
    topo = Topology(num_domains=world // rpd, ranks_per_domain=rpd)
    rows = []
    for tokens in args.tokens:
        for skew in args.skews:
            g = torch.Generator().manual_seed(1000 + rank)
            bias = expert_bias(args.experts, skew, num_ranks=world, seed=0, layout=args.layout)
            idx = torch.topk(torch.randn(tokens, args.experts, generator=g) + bias, args.topk, dim=1).indices.to(dev)
            w = torch.softmax(torch.randn(tokens, args.topk, generator=g), -1).to(dev, torch.bfloat16)
            x = (torch.randn(tokens, args.hidden, generator=g) * 0.1).to(dev, torch.bfloat16).requires_grad_()
            gy = torch.randn(tokens, args.hidden, generator=g).to(dev, torch.bfloat16)  # the output's gradient
            for name in args.variants:
                backend, cf = VARIANTS[name]
                layer = ExpertParallelMoE(num_experts=args.experts, hidden_size=args.hidden,
                                          ffn_hidden_size=args.ffn, topology=topo, num_slots=args.slots,
                                          policy=args.policy, backend=backend, dtype=torch.bfloat16, device=dev,
                                          capacity_factor=cf, max_tokens=tokens if backend == "cuda" else None)
                peaks = []
                for it in range(args.warmup + args.iters):
                    x.grad = None
                    layer.zero_grad(set_to_none=True)
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                    y = layer(x, idx, w)
                    y.backward(gy)  # nothing of the caller's: the layer's own memory
                    torch.cuda.synchronize()
                    if it >= args.warmup:
                        peaks.append(torch.cuda.max_memory_allocated() - base)
                    del y
                s = layer.stats_dict()
                used = layer.backend.name == "cuda" and layer.pool is not None and not s["slot_skipped"]
                model = _model(vars(args) | {"world": world}, name, tokens, used)
                rows.append(dict(backend=name, ep=world, rank=rank, tokens=tokens,
                                 routing="uniform" if skew == 0 else f"skew {skew:g} {args.layout}",
                                 peak_mib=max(peaks) / MIB, symmetric_mib=_symmetric_bytes(layer) / MIB,
                                 model_peak_mib=model.peak / MIB if model else None,
                                 model_symmetric_mib=(model.buffers + model.slots) / MIB if model else None,
                                 imbalance=s["imbalance"], static_imbalance=s["static_imbalance"],
                                 guard_fired=s["guard_fired"], slots_used=used,
                                 capacity_overflow=s["capacity_overflow"]))
                del layer
                torch.cuda.empty_cache()
    return rows


def _model(config: dict, backend: str, tokens: int, slots_used: bool):
    """topoep.memory's prediction for one measured configuration (None for backend torch). The top-k weights
    here need no gradient (`w` above), so the expert outputs are not kept for one."""
    if VARIANTS[backend][0] != "cuda":
        return None
    return layer_memory(num_ranks=config["world"], num_experts=config["experts"], hidden=config["hidden"],
                        ffn_hidden=config["ffn"], top_k=config["topk"], tokens=tokens, num_slots=config["slots"],
                        slots_used=slots_used, capacity_factor=VARIANTS[backend][1], topk_weights_grad=False)


def with_model(rows: list[dict], config: dict) -> list[dict]:
    """The rows of one run with the memory model's prediction (MiB) beside each measurement."""
    out = []
    for r in rows:
        m = _model(config, r["backend"], r["tokens"], r["slots_used"])
        out.append(dict(r, model_peak_mib=m.peak / MIB if m else None,
                        model_symmetric_mib=(m.buffers + m.slots) / MIB if m else None))
    return out


def summary(rows: list[dict]) -> list[dict]:
    """One record per (backend, ep, tokens, routing): the largest rank's measured peak beside the model."""
    out = {}
    for r in rows:
        key = (r["backend"], r["ep"], r["tokens"], r["routing"])
        o = out.setdefault(key, dict(r, peak_mib=0.0, ranks=0))
        o["peak_mib"] = max(o["peak_mib"], r["peak_mib"])
        o["ranks"] += 1
        o.pop("rank", None)
    return sorted(out.values(), key=lambda r: (r["tokens"], r["routing"], r["backend"], r["ep"]))


MODEL_EPS = (2, 8, 32, 64, 128)


def model_scaling(config: dict, tokens: list[int]) -> list[list]:
    """The model beyond the measured EP sizes (the measured run's shapes; 128 experts allow EP 128): per tokens,
    slots used or not, and buffers, the allocator peak and the peak with the symmetric buffers (MiB)."""
    table = []
    for t in tokens:
        for used in (False, True):
            for name in ("cuda-worst", "cuda-capacity"):
                cells = []
                for ep in MODEL_EPS:
                    m = _model(dict(config, world=ep), name, t, used)
                    cells.append(f"{m.peak / MIB:.0f} / {(m.peak + m.buffers + m.slots) / MIB:.0f}")
                table.append([t, "used" if used else "left out", name, *cells])
    return table


def report_md(records: list[dict], infos: list[dict], info: dict, cmd: str) -> str:
    """The report of the raw runs `infos` (their records joined), written under `info` (run_info) by `cmd`."""
    eps = sorted({r["ep"] for r in records})
    groups = sorted({(r["tokens"], r["routing"]) for r in records})
    by = {(r["backend"], r["ep"], r["tokens"], r["routing"]): r for r in records}
    table = []
    for tokens, routing in groups:
        for name in VARIANTS:
            cells = []
            for ep in eps:
                r = by.get((name, ep, tokens, routing))
                if r is None:
                    cells.append("")
                    continue
                cell = f"{r['peak_mib']:.0f}"
                if r["model_peak_mib"] is not None:
                    cell += f" (model {r['model_peak_mib']:.0f}; +{r['symmetric_mib']:.0f} symm.)"
                cells.append(cell)
            table.append([f"{tokens}, {routing}", name, *cells])
    text = ["# One MoE layer: per-rank memory by EP size (forward + backward)", "",
            f"- report: date {info['date']}; commit `{info['commit']}` (joins the raw runs below, recomputing the "
            "memory model)", f"- reproduce: `{cmd}`"]
    for info in infos:
        text.append(f"- EP {info['config']['world']}: date {info['date']}; commit `{info['commit']}`; "
                    f"hardware {info['hardware']}; config {json.dumps(info['config'], sort_keys=True)}")
    text += ["", "Peak of torch's caching allocator above what was allocated before the call (MiB, the largest rank); "
             "in brackets the memory model's prediction (topoep/memory.py) and backend cuda's symmetric buffers "
             "(workspace, replica pool and gradient-return regions: outside the caching allocator, from their "
             "sizes). `cuda-worst`: capacity_factor=None (buffers for R x T x k rows); `cuda-capacity`: the default "
             f"capacity_factor {DEFAULT_CAPACITY_FACTOR}. The ranks shared one GPU (memory per process is real; "
             "nothing is timed).", "",
             markdown_table(["tokens per rank, routing", "backend", *[f"EP {e}" for e in eps]], table), ""]
    ratios = []
    for tokens, routing in groups:
        for ep in eps:
            c, t = by.get(("cuda-capacity", ep, tokens, routing)), by.get(("torch", ep, tokens, routing))
            if c and t:
                ratios.append([f"{tokens}, {routing}", ep, f"{c['peak_mib'] / t['peak_mib']:.2f}",
                               f"{(c['peak_mib'] + c['symmetric_mib']) / t['peak_mib']:.2f}"])
    if ratios:
        text += ["backend cuda with the capacity against backend torch (whose buffers are exact), the largest "
                 "rank; `+ symm.` adds backend cuda's symmetric buffers (backend torch has none; NCCL's own buffers "
                 "are counted in neither):", "",
                 markdown_table(["tokens per rank, routing", "EP", "cuda-capacity / torch",
                                 "(cuda-capacity + symm.) / torch"], ratios), ""]
    growth = []
    for tokens, routing in groups:
        for name in ("cuda-worst", "cuda-capacity", "torch"):
            pts = [by[(name, ep, tokens, routing)] for ep in eps if ep >= 2 and (name, ep, tokens, routing) in by]
            if len(pts) >= 2:
                a, z = pts[0], pts[-1]
                growth.append([f"{tokens}, {routing}", name, f"EP {a['ep']} -> {z['ep']}",
                               f"{100 * (z['peak_mib'] / a['peak_mib'] - 1):+.0f} %",
                               f"{100 * ((z['peak_mib'] + z['symmetric_mib']) / (a['peak_mib'] + a['symmetric_mib']) - 1):+.0f} %"])
    if growth:
        text += ["Growth with the EP size (from EP 2):", "",
                 markdown_table(["tokens per rank, routing", "backend", "EP", "peak", "peak + symm."], growth), ""]
    if infos:
        cfg = infos[-1]["config"]
        text += [f"The model at larger EP sizes ({cfg['experts']} experts, hidden {cfg['hidden']}, expert FFN "
                 f"{cfg['ffn']}, top-{cfg['topk']}, {cfg['slots']} slots; each cell: allocator peak / with the "
                 "symmetric buffers, MiB; the slots `left out`: the guard's hint, as on uniform routing). With the "
                 "capacity the peak stops changing once the main experts' weight gradients are small; what still "
                 "grows is the replica pool's gradient-return regions (EP x slots expert-sized regions per rank):", "",
                 markdown_table(["tokens per rank", "slots", "backend", *[f"EP {e}" for e in MODEL_EPS]],
                                model_scaling(cfg, sorted({r["tokens"] for r in records}))), ""]
    errs = [r["model_peak_mib"] / r["peak_mib"] - 1 for r in records if r["model_peak_mib"] is not None]
    if errs:
        text += [f"Memory model against the measurements (backend cuda, {len(errs)} points): model / measured - 1 "
                 f"from {100 * min(errs):+.1f} % to {100 * max(errs):+.1f} %. It follows the allocation order of "
                 "cuda_function.py (topoep/memory.py); the symmetric buffers are computed from the same sizes as "
                 "the workspace's.", ""]
    return "\n".join(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="tokens per rank")
    ap.add_argument("--skews", type=float, nargs="+", default=[0.0, -4.0], help="router skews (0: uniform)")
    ap.add_argument("--layout", default="clustered", choices=["random", "clustered", "scattered", "concentrated"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=768)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--policy", default="topoep")
    ap.add_argument("--ranks-per-domain", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3, help="calls before measuring (the metadata graph is captured "
                                                          "on the second; the guard's hint acts from the third)")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--share-gpu", action="store_true", help="let the ranks share the visible GPUs (memory only)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where to write: a run's layer_memory_ep<R>.json (default results/gpu/layer_memory), "
                         "--report's layer_memory.{md,json} (default results)")
    ap.add_argument("--report", type=Path, nargs="+", help="join these runs' json into <out>/layer_memory.{md,json}")
    args = ap.parse_args(argv)
    if args.report:
        out = args.out or REPO / "results"
        runs = [json.loads(p.read_text()) for p in args.report]
        # the model is recomputed here, so a report always shows topoep/memory.py as it is
        records = summary([r for run in runs for r in with_model(run["rows"], run["config"])])
        infos = sorted(({k: v for k, v in run.items() if k != "rows"} for run in runs),
                       key=lambda i: i["config"]["world"])
        named = [repo_relative(p) for p in args.report]
        info = run_info({"report": named})
        out.mkdir(parents=True, exist_ok=True)
        (out / "layer_memory.json").write_text(json.dumps({**info, "runs": infos, "rows": records}, indent=1) + "\n")
        md = report_md(records, infos, info, "python bench/layer_memory.py --report " + " ".join(named))
        (out / "layer_memory.md").write_text(md)
        print(md)
        return 0
    args.out = args.out or REPO / "results" / "gpu" / "layer_memory"
    dev = _setup(args.share_gpu)
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = measure(args, dev, world, rank)
    every = [None] * world
    dist.all_gather_object(every, rows)
    if rank == 0:
        info = run_info(vars(args) | {"world": world, "out": None, "report": None})
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"layer_memory_ep{world}.json"
        path.write_text(json.dumps({**info, "rows": [r for rs in every for r in rs]}, indent=1, default=str) + "\n")
        for r in summary([r for rs in every for r in rs]):
            print(f"EP {world} {r['tokens']:>5} {r['routing']:<22} {r['backend']:<14} peak {r['peak_mib']:8.0f} MiB"
                  + (f"  model {r['model_peak_mib']:8.0f}  symmetric {r['symmetric_mib']:6.0f}"
                     if r["model_peak_mib"] is not None else ""), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
