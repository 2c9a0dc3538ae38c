"""The six grouped GEMMs of one MoE layer call, each kernel we could run them with, on one GPU.

    python bench/grouped_gemm.py                       # Qwen3 expert shape, 4096 and 16384 tokens, both routings
    python bench/grouped_gemm.py --tokens 4096 --inductor

Backend cuda runs an expert call as six grouped GEMMs over the rows of every expert (`topoep.runtime.cuda_function`):
forward fc1 and fc2, their data gradients and their weight gradients. This script times each of them, in the exact
call form the layer uses, with:
    aten        torch._grouped_mm (CUTLASS), what the layer runs by default
    triton      the weight gradients with `topoep_research.grouped_gemm.grouped_wgrad`, one row per tile shape of
                --configs (WgradConfig fields block_p, block_q, block_k, num_warps, num_stages)
    cutlass     (--cutlass) every GEMM with `topoep_research.cutlass_wgrad` (CUTLASS's Hopper grouped GEMM with our
                schedules and tiles: grouped_wgrad for the weight gradients, grouped_mm for the others), one row per
                configuration (WGRAD_CONFIGS, MM_CONFIGS; built beforehand: the module's docstring)
    inductor    (--inductor) torch.compile(torch._grouped_mm, mode="max-autotune-no-cudagraphs"): inductor's Triton
                grouped-GEMM templates autotuned against aten on this GPU, for reference
    dense       one dense bf16 matmul of the same FLOPs (the rate a GEMM of that size reaches here)
Routings: "balanced" (every expert A / E rows) and "uniform" (each token's k experts drawn at random: groups of
A / E give or take a few percent, as megatron's router at skew 0 makes).

GPU ms: median over --iters of the GPU's time per call, ten calls queued behind a sleep kernel (no launch gap is
counted); host us: the host's time to issue one call. Each kernel's output is compared with aten's (max abs
difference over the max abs value). Writes <out>/<name>.md and .json (default results/grouped_gemm) with config,
commit and hardware.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, command, markdown_table, parse_options, run_info, write_json  # noqa: E402

QWEN3 = dict(hidden=2048, ffn=768, experts=128, topk=8)
DEFAULT_CONFIGS = ["128,128,64,8,3", "128,128,64,4,4", "128,256,64,8,3", "256,128,64,8,3", "128,128,32,4,4",
                   "64,128,64,4,4", "128,64,64,4,4", "128,256,32,8,4", "64,256,64,4,3", "256,128,32,8,4"]
SLEEP_CYCLES = 100_000_000  # torch.cuda._sleep: about 50 ms on an H200, longer than issuing ten calls


def group_offsets(routing: str, T: int, k: int, E: int, dev) -> torch.Tensor:
    """int32 [E]: end row of each expert's group for T tokens of top-k."""
    if routing == "balanced":
        return torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (T * k // E)
    g = torch.Generator(device=dev).manual_seed(0)
    choice = torch.rand(T, E, device=dev, generator=g).topk(k, dim=1).indices
    counts = torch.zeros(E, device=dev, dtype=torch.int64).index_add_(0, choice.flatten(),
                                                                      torch.ones_like(choice.flatten()))
    return counts.cumsum(0).to(torch.int32)


def gpu_and_host(fn, iters: int) -> tuple[float, float]:
    """(GPU ms per call, host us per call): medians over iters rounds of ten calls queued behind a sleep."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        t0 = time.perf_counter()
        for _ in range(10):
            fn()
        host.append((time.perf_counter() - t0) * 1e5)  # us per call
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b) / 10)
    return statistics.median(gpu), statistics.median(host)


def operands(T: int, k: int, E: int, H: int, Fd: int, dev):
    """The layer's tensors at A = T k rows: x [A, H], act [A, F], gy [A, H], gh [A, 2F], w1 [E, 2F, H],
    w2 [E, H, F] (random bf16, scaled like activations and weights)."""
    A = T * k
    g = torch.Generator(device=dev).manual_seed(1)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=g) * scale).to(torch.bfloat16)
    return dict(x=r(A, H), act=r(A, Fd), gy=r(A, H), gh=r(A, 2 * Fd), w1=r(E, 2 * Fd, H, scale=H ** -0.5),
                w2=r(E, H, Fd, scale=Fd ** -0.5))


def gemms(t: dict) -> list[tuple[str, tuple, tuple | None]]:
    """(name, aten operands (a, b) of torch._grouped_mm(a, b, offs), our wgrad's operands (a, b) or None), in the
    layer's call forms (cuda_function.grouped_swiglu, _dgrad, _wgrad)."""
    return [("fwd fc1", (t["x"], t["w1"].transpose(1, 2)), None),
            ("fwd fc2", (t["act"], t["w2"].transpose(1, 2)), None),
            ("dgrad fc2", (t["gy"], t["w2"]), None),
            ("dgrad fc1", (t["gh"], t["w1"]), None),
            ("wgrad fc2", (t["gy"].t(), t["act"]), (t["gy"], t["act"])),
            ("wgrad fc1", (t["gh"].t(), t["x"]), (t["gh"], t["x"]))]


def flops_of(a: torch.Tensor, b: torch.Tensor) -> int:
    """FLOPs of a grouped GEMM whose groups together span a's rows (M-grouped) or its columns (K-grouped)."""
    if b.dim() == 3:  # [A, K] x [G, K, N]
        return 2 * a.shape[0] * a.shape[1] * b.shape[2]
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]  # [P, A] x [A, Q]


def rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def run(args) -> tuple[list[dict], list[str]]:
    from topoep_research.grouped_gemm import WgradConfig, grouped_wgrad

    dev = torch.device("cuda")
    E, H, Fd, k = args.experts, args.hidden, args.ffn, args.topk
    configs = [WgradConfig(*map(int, c.split(","))) for c in args.configs]
    cutlass = None
    if args.cutlass:
        from topoep_research import cutlass_wgrad

        cutlass = cutlass_wgrad
        cutlass_wgrad.load(build=False)  # before any timing: a missing build fails here, naming how to build it
    compiled = torch.compile(torch._grouped_mm, mode="max-autotune-no-cudagraphs", dynamic=False) \
        if args.inductor else None
    rows, notes = [], []
    for T in args.tokens:
        t = operands(T, k, E, H, Fd, dev)
        for routing in args.routings:
            offs = group_offsets(routing, T, k, E, dev)
            sizes = torch.diff(offs, prepend=offs.new_zeros(1)).tolist()
            notes.append(f"- {T} tokens, {routing}: groups of {min(sizes)}-{max(sizes)} rows")
            for name, (a, b), ours in gemms(t):
                fl = flops_of(a, b)
                ref = torch._grouped_mm(a, b, offs=offs)

                def add(kernel, fn, out):
                    ms, host = gpu_and_host(fn, args.iters)
                    rows.append(dict(tokens=T, routing=routing, gemm=name, kernel=kernel, gpu_ms=ms, host_us=host,
                                     tflops_per_s=fl / ms / 1e9, rel_diff=rel_diff(out, ref)))
                    print(f"  {T:6d} {routing:8s} {name:9s} {kernel:28s} {ms:7.3f} ms {fl / ms / 1e9:6.0f} TFLOP/s "
                          f"host {host:5.1f} us diff {rows[-1]['rel_diff']:.1e}", flush=True)

                add("aten", lambda: torch._grouped_mm(a, b, offs=offs), ref)
                if ours is not None:
                    for c in configs:
                        try:
                            out = grouped_wgrad(*ours, offs, c)
                        except Exception as e:  # a tile shape this GPU cannot hold: reported, not fatal
                            notes.append(f"- triton {c}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                            continue
                        add(f"triton {c.block_p}x{c.block_q}x{c.block_k} w{c.num_warps} s{c.num_stages}",
                            lambda c=c: grouped_wgrad(*ours, offs, c), out)
                if cutlass is not None:  # every configuration of the GEMM's form
                    wgrad = ours is not None
                    fn, names = ((cutlass.grouped_wgrad, cutlass.WGRAD_CONFIGS) if wgrad else
                                 (cutlass.grouped_mm, cutlass.MM_CONFIGS))
                    args_ = ours if wgrad else (a, b)
                    for c, cname in enumerate(names):
                        try:
                            out = fn(*args_, offs, c)
                        except Exception as e:  # a configuration CUTLASS refuses on this shape: reported
                            notes.append(f"- cutlass {cname}, {name}: {type(e).__name__}: "
                                         f"{str(e).splitlines()[0][:160]}")
                            continue
                        add(f"cutlass {cname}", lambda fn=fn, c=c, args_=args_: fn(*args_, offs, c), out)
                if compiled is not None:
                    try:
                        out = compiled(a, b, offs=offs)
                        add("inductor", lambda: compiled(a, b, offs=offs), out)
                    except Exception as e:
                        notes.append(f"- inductor, {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
                if routing == args.routings[0]:  # dense: the routing does not change it
                    M, K, N = (a.shape[0], a.shape[1], b.shape[-1]) if b.dim() == 3 else (a.shape[0], a.shape[1],
                                                                                         b.shape[1])
                    da = torch.randn(M, K, device=dev).to(torch.bfloat16)
                    db = torch.randn(K, N, device=dev).to(torch.bfloat16)
                    ms, host = gpu_and_host(lambda: da @ db, args.iters)
                    rows.append(dict(tokens=T, routing="-", gemm=name, kernel="dense", gpu_ms=ms, host_us=host,
                                     tflops_per_s=fl / ms / 1e9, rel_diff=None))
        del t
        torch.cuda.empty_cache()
    return rows, notes


def report(args, rows: list[dict], notes: list[str]) -> str:
    info = run_info(vars(args) | {"out": None})
    cmd = command("grouped_gemm.py", args.argv)
    out = ["# The grouped GEMMs of one MoE layer call, kernel by kernel", "",
           f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']}",
           f"- shape: {args.experts} experts, hidden {args.hidden}, expert FFN {args.ffn} (SwiGLU), top-{args.topk}, "
           "bf16; the layer's call forms (`bench/grouped_gemm.py` docstring)",
           "- GPU ms: median GPU time per call (ten calls queued behind a sleep); host us: the host's time to issue "
           "one call; diff: max abs difference to aten's output over its max abs value",
           f"- reproduce: `{cmd}`", ""] + notes + [""]
    best_rows = []
    for T in args.tokens:
        for routing in args.routings:
            for name in ("fwd fc1", "fwd fc2", "dgrad fc2", "dgrad fc1", "wgrad fc2", "wgrad fc1"):
                mine = [r for r in rows if r["tokens"] == T and r["routing"] == routing and r["gemm"] == name]
                if not mine:
                    continue
                aten = next(r for r in mine if r["kernel"] == "aten")
                dense = next(r for r in rows if r["tokens"] == T and r["gemm"] == name and r["kernel"] == "dense")
                best = min(mine, key=lambda r: r["gpu_ms"])
                best_rows.append([T, routing, name, f"{dense['gpu_ms']:.3f}", f"{aten['gpu_ms']:.3f}",
                                  f"{aten['tflops_per_s']:.0f}", best["kernel"], f"{best['gpu_ms']:.3f}",
                                  f"{best['tflops_per_s']:.0f}", f"{aten['gpu_ms'] / best['gpu_ms']:.2f}",
                                  f"{best['rel_diff']:.1e}"])
    out += ["## Best kernel per GEMM", "",
            markdown_table(["tokens", "routing", "GEMM", "dense ms", "aten ms", "aten TFLOP/s", "best kernel",
                            "best ms", "best TFLOP/s", "aten / best", "best diff"], best_rows), "",
            "## Every kernel", "",
            markdown_table(["tokens", "routing", "GEMM", "kernel", "GPU ms", "TFLOP/s", "host us", "diff"],
                           [[r["tokens"], r["routing"], r["gemm"], r["kernel"], f"{r['gpu_ms']:.3f}",
                             f"{r['tflops_per_s']:.0f}", f"{r['host_us']:.1f}",
                             "-" if r["rel_diff"] is None else f"{r['rel_diff']:.1e}"] for r in rows]), ""]
    return "\n".join(out)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens per call")
    ap.add_argument("--routings", nargs="+", default=["balanced", "uniform"], choices=["balanced", "uniform"])
    ap.add_argument("--experts", type=int, default=QWEN3["experts"])
    ap.add_argument("--hidden", type=int, default=QWEN3["hidden"])
    ap.add_argument("--ffn", type=int, default=QWEN3["ffn"])
    ap.add_argument("--topk", type=int, default=QWEN3["topk"])
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                    help="wgrad tile shapes: block_p,block_q,block_k,num_warps,num_stages")
    ap.add_argument("--inductor", action="store_true", help="also inductor's autotuned grouped GEMM (slow to compile)")
    ap.add_argument("--cutlass", action="store_true",
                    help="also CUTLASS's grouped GEMM under our tiles and schedules, every configuration "
                         "(topoep_research.cutlass_wgrad, built beforehand)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", type=Path, default=REPO / "results")
    ap.add_argument("--name", default="grouped_gemm")
    args = parse_options(ap, argv)
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not torch.cuda.is_available():
        print("bench/grouped_gemm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    rows, notes = run(args)
    text = report(args, rows, notes)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    write_json(args.out / f"{args.name}.json", run_info(vars(args) | {"out": None}), rows)
    print(text.split("## Every kernel")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
