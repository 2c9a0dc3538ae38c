"""One MoE layer call on one GPU against its physical limit (the GEMMs' FLOPs and the rows' HBM bytes).

    torchrun --nproc_per_node=1 bench/layer_limit.py                   # Qwen3 expert shape, 4096 and 16384 tokens
    torchrun --nproc_per_node=1 bench/layer_limit.py --tokens 4096 --no-megatron

At EP 1 nothing crosses a link: what a layer spends beyond its expert GEMMs and the rows it must move is
its own overhead (host work, launches, extra copies). Everything here is measured on the machine in the
same run, so the ratios hold for the GPU the script ran on.

The limit of one forward + backward call (T tokens, top-k, E experts, hidden H, expert FFN F, A = T k rows):
    GEMMs   the six GEMMs of a SwiGLU expert, forward [A, H] x [H, 2F] and [A, F] x [F, H], their two data
            gradients and two weight gradients (2 A H 3F x 3 FLOPs), each timed as one dense bf16 matmul of the
            same total size (`dense`; the best a GEMM of that size does on this GPU), but never faster than its
            own HBM bytes at the measured copy bandwidth (`roofline`: a grouped GEMM reads or writes all E
            experts' weights, E times a dense GEMM's one matrix, besides its rows: 1.2 GB per forward or
            backward at the Qwen3 shape; on a GPU whose bandwidth is low for its FLOPs this, not the FLOPs, sets
            the GEMM's time), and, beside it, as torch._grouped_mm over E perfectly even groups (`even groups`:
            what the grouped kernel does at our group sizes)
    bytes   every row an unfused-but-single-pass layer must move through HBM outside the GEMMs, at the
            measured device copy bandwidth (bytes read + written per second): forward, the gather of x into
            expert order (T H read, A H written), the SwiGLU activation (2 A F read, A F written), the
            weighted combine (A H read, T H written); backward, the top-k weights' gradient (A H + T H read),
            the scatter of the output gradient (T H read, A H written), the activation's gradient (3 A F read,
            2 A F written, and A F written: the activation the weight gradient reads), the sum of each token's
            k input gradients (A H read, T H written). 2 bytes per bf16 element.
    limit   GEMMs (each the larger of its dense time and its HBM bytes' time) + bytes (the phases are not
            overlapped: a layer that overlaps them can go below it)

Layers, all on the same input, routing, weights and output gradient:
    cuda/static, cuda/topoep     `topoep.ExpertParallelMoE`, backend cuda (transport peer), 2 replica slots;
                                 at EP 1 topoep's guard fires on every call (nothing to balance)
    cuda/static cutlass,         (--cutlass) the same layers with their grouped GEMMs on CUTLASS under our tiles and
    cuda/topoep cutlass          schedules (topoep_research.cutlass_wgrad.as_grouped_mm in --cutlass-config swapped in
                                 for topoep.runtime.cuda_function.GROUPED_MM around each call); built beforehand
    cuda/static graphed,         (--graphed) the same layers with their forward and backward captured as CUDA
    cuda/topoep graphed          graphs on their first call (LayerConfig.layer_graphs, topoep.graph_layer): no host work of the
                                 layer per call; a capture the layer does not allow is reported as such
    plain torch                  the MoE layer any user could write: sort the choices by expert, gather the
                                 rows, torch._grouped_mm, SwiGLU, torch._grouped_mm, weight, index_add into the
                                 output; autograd does the backward
    megatron/alltoall            megatron-core's MoELayer (alltoall dispatcher; its experts as the installed
                                 spec provides: TEGroupedMLP with Transformer Engine, else SequentialMLP)

Measured per layer and routing ("balanced": every expert exactly A / E rows, as the limit assumes; "uniform":
megatron's router at skew 0, random top-k):
    ms          median over --iters calls of forward + backward (CUDA events around each call, the GPU idle
                before it): what a training step pays
    GPU ms      the same call's GPU time alone: the host first queues a sleep kernel longer than its own
                work, so no launch gap is counted (median)
    host ms     the host's time to issue the call (forward + backward, median); above GPU ms the call is
                host-bound
    phases      cuda layers only: a `topoep.runtime.PhaseTimer` over --profile-iters calls (phases
                serialised, ms): plan (the metadata graph), dispatch_combine (local row copies, weighting),
                experts (GEMMs and activations)
    metadata    cuda layers only: the layer's metadata CUDA graph (counts, plan, guard, statistics, layout)
                replayed alone, GPU and host us per replay

Writes <out>/<name>.md and .json (default results/layer_limit), with config, commit and hardware; --profile
(torch.profiler tables per layer), --host-profile (cProfile of the cuda layers' host work) and --meta-profile (the
kernels of the cuda layers' metadata graph, one by one) write <out>/<name>_profile.txt.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (REPO, bench_gpu, cuda_ms, markdown_table, median_cuda_ms, parse_options,  # noqa: E402
                          repo_relative, run_info, without_options, write_json)

QWEN3 = dict(hidden=2048, ffn=768, experts=128, topk=8)
BF16 = 2  # bytes per element


# -- the limit ---------------------------------------------------------------------------------------------
def gemm_shapes(A: int, H: int, Fd: int) -> list[tuple[str, int, int, int]]:
    """(name, M, K, N) of the six GEMMs of one SwiGLU expert call over A rows: [M, K] x [K, N]."""
    return [("fwd fc1", A, H, 2 * Fd), ("fwd fc2", A, Fd, H),
            ("dgrad fc2", A, H, Fd), ("dgrad fc1", A, 2 * Fd, H),
            ("wgrad fc2", H, A, Fd), ("wgrad fc1", 2 * Fd, A, H)]


def gemm_flops(A: int, H: int, Fd: int) -> int:
    return sum(2 * M * K * N for _, M, K, N in gemm_shapes(A, H, Fd))


def gemm_bytes(A: int, E: int, H: int, Fd: int) -> dict[str, int]:
    """HBM bytes each of the six grouped GEMMs must move at least once (module docstring): its two operands read
    and its result written, the E experts' weight matrices being one operand of the forward and data-gradient GEMMs
    ([E, K, N] read) and the result of the weight gradients ([E, M, N] written)."""
    out = {}
    for name, M, K, N in gemm_shapes(A, H, Fd):
        if name.startswith("wgrad"):  # [M, A] x [A, N] summed per group into E results
            out[name] = BF16 * (M * K + K * N + E * M * N)
        else:  # [A, K] x [E, K, N] over groups of rows
            out[name] = BF16 * (M * K + E * K * N + M * N)
    return out


def limit_parts(dense_ms: dict[str, float], even_ms: dict[str, float], copy_gb_per_s: float, T: int, k: int, E: int,
                H: int, Fd: int) -> dict:
    """The limit (module docstring) from the measured parts: each GEMM's dense time and even-groups time (ms), the
    copy bandwidth (GB/s, bytes read + written); ms."""
    A = T * k
    bw = copy_gb_per_s * 1e9
    flops, moved, gb = gemm_flops(A, H, Fd), row_bytes(T, k, H, Fd), gemm_bytes(A, E, H, Fd)
    roof = {n: max(dense_ms[n], 1e3 * gb[n] / bw) for n in dense_ms}
    gemm_ms, roof_ms, even_ms_sum = sum(dense_ms.values()), sum(roof.values()), sum(even_ms.values())
    bytes_ms = 1e3 * moved / bw
    return dict(gemm_dense_ms=gemm_ms, gemm_roofline_ms=roof_ms, gemm_even_ms=even_ms_sum, bytes_ms=bytes_ms,
                limit_ms=roof_ms + bytes_ms, limit_even_ms=even_ms_sum + bytes_ms, tflops=flops / 1e12,
                dense_tflops_per_s=flops / gemm_ms / 1e9, even_tflops_per_s=flops / even_ms_sum / 1e9,
                copy_gb_per_s=copy_gb_per_s, row_gb=moved / 1e9, gemm_gb=sum(gb.values()) / 1e9,
                dense_ms=dict(dense_ms), even_ms=dict(even_ms), roofline_ms=roof)


def row_bytes(T: int, k: int, H: int, Fd: int) -> int:
    """HBM bytes an unfused single-pass layer moves outside its GEMMs in forward + backward (module docstring)."""
    A = T * k
    forward = (T * H + A * H) + (2 * A * Fd + A * Fd) + (A * H + T * H)
    backward = (A * H + T * H) + (T * H + A * H) + (3 * A * Fd + 2 * A * Fd + A * Fd) + (A * H + T * H)
    return BF16 * (forward + backward)


def measure_limit(T: int, k: int, E: int, H: int, Fd: int, dev, iters: int) -> dict:
    """The limit's parts on this GPU (module docstring), in ms, and the rates behind them."""
    A = T * k
    dense, grouped = {}, {}
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * (A // E)
    g = torch.Generator(device=dev).manual_seed(0)
    for name, M, K, N in gemm_shapes(A, H, Fd):
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16, generator=g)
        b = torch.randn(K, N, device=dev, dtype=torch.bfloat16, generator=g)
        dense[name] = median_cuda_ms(lambda: a @ b, iters)
        if name.startswith("wgrad"):  # [M, A] x [A, N] summed per group: the weight gradient's grouped form
            at = torch.randn(K, M, device=dev, dtype=torch.bfloat16, generator=g)
            grouped[name] = median_cuda_ms(lambda: torch._grouped_mm(at.t(), b, offs=offs), iters)
        else:  # [A, K] x [E, K, N] over even groups of rows
            w = torch.randn(E, N, K, device=dev, dtype=torch.bfloat16, generator=g)
            grouped[name] = median_cuda_ms(lambda: torch._grouped_mm(a, w.transpose(1, 2), offs=offs), iters)
    nbytes = 1 << 30
    src = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = median_cuda_ms(lambda: dst.copy_(src), iters)
    bw = 2 * nbytes / (copy_ms * 1e-3)  # read + written
    return limit_parts(dense, grouped, bw / 1e9, T, k, E, H, Fd)


# -- the plain PyTorch layer --------------------------------------------------------------------------------
def plain_moe(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, fc1: torch.Tensor,
              fc2: torch.Tensor) -> torch.Tensor:
    """y [T, H] = sum_j w[t, j] SwiGLU_{e = idx[t, j]}(x[t]) the way a user writes it with torch ops: fc1 [E, 2F, H],
    fc2 [E, H, F] (megatron's layout); autograd gives the backward. No host synchronisation."""
    T, k = topk_idx.shape
    E, Fd = fc1.shape[0], fc2.shape[2]
    flat = topk_idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=x.device).index_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)  # (bincount would read the maximum on the host: a sync)
    token = order // k
    h = torch._grouped_mm(x[token], fc1.transpose(1, 2), offs=offs)
    act = F.silu(h[:, :Fd]) * h[:, Fd:]
    y = torch._grouped_mm(act, fc2.transpose(1, 2), offs=offs)
    y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def plain_moe_reference(x, topk_idx, topk_weights, fc1, fc2) -> torch.Tensor:
    """The same layer as a loop over tokens and choices (fp32): what plain_moe must equal."""
    T, k = topk_idx.shape
    Fd = fc2.shape[2]
    out = [torch.zeros(x.shape[1]) for _ in range(T)]
    for t in range(T):
        for j in range(k):
            e = int(topk_idx[t, j])
            h = fc1[e].float() @ x[t].float()
            out[t] = out[t] + topk_weights[t, j].float() * (fc2[e].float() @ (F.silu(h[:Fd]) * h[Fd:]))
    return torch.stack(out)


# -- timing the layers --------------------------------------------------------------------------------------
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1 s on an H200, longer than any call's host work here


def time_layer(run, iters: int) -> dict:
    """ms (the call from an idle GPU), GPU ms (the GPU's own time: queued behind a sleep), host ms (median)."""
    wall, gpu, host, ahead = [], [], [], []
    for _ in range(iters):
        torch.cuda.synchronize()
        wall.append(cuda_ms(run))
    for _ in range(iters):
        torch.cuda.synchronize()
        s, a, b = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        s.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        t0 = time.perf_counter()
        run()
        host.append(1e3 * (time.perf_counter() - t0))
        b.record()
        b.synchronize()
        gpu.append(a.elapsed_time(b))
        ahead.append(s.elapsed_time(a) > host[-1])  # the sleep outlasted the host's issuing: no gap counted
    return dict(ms=statistics.median(wall), gpu_ms=statistics.median(gpu), host_ms=statistics.median(host),
                gpu_clean=all(ahead))


def metadata_graph_us(layer, iters: int) -> dict:
    """The layer's metadata CUDA graph (cuda_meta.py) replayed alone: its GPU time per replay (queued behind a
    sleep) and the host's time per replay, in us; empty when the layer has no captured graph."""
    graphs = [e[0] for e in layer._meta_graphs._graphs.values() if isinstance(e, tuple)]
    if not graphs:
        return {}
    graph = graphs[0]
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    a.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        graph.replay()
    host = (time.perf_counter() - t0) / iters
    b.record()
    b.synchronize()
    return dict(meta_gpu_us=1e3 * a.elapsed_time(b) / iters, meta_host_us=1e6 * host)


def metadata_graph_profile(layer, iters: int = 20) -> str:
    """torch.profiler over `iters` replays of the layer's metadata CUDA graph alone: every kernel, copy and fill it
    runs, by name, with its count and GPU time per replay (what the graph's nodes are and what each costs)."""
    from torch.profiler import ProfilerActivity, profile

    graphs = [e[0] for e in layer._meta_graphs._graphs.values() if isinstance(e, tuple)]
    if not graphs:
        return "(no captured metadata graph)\n"
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            graphs[0].replay()
        torch.cuda.synchronize()
    per: dict[str, list] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        c = per.setdefault(ev.name, [0, 0.0])
        c[0] += 1
        c[1] += ev.device_time
    rows = sorted(per.items(), key=lambda kv: -kv[1][1])
    nodes = sum(c for c, _ in per.values()) / iters
    busy = sum(t for _, t in per.values()) / iters
    lines = [f"{nodes:.0f} device activities per replay, {busy:.1f} us of them busy (the rest of the replay's time "
             "is the gaps between them)", "", "| per replay | us per replay | name |", "|---|---|---|"]
    lines += [f"| {c / iters:.1f} | {t / iters:.1f} | {name[:110]} |" for name, (c, t) in rows]
    return "\n".join(lines) + "\n"


def phase_times(layer, run, iters: int, dev) -> dict:
    from topoep.runtime import PHASES, PhaseTimer

    timer = PhaseTimer(dev)
    layer.timer = timer
    per = {p: [] for p in PHASES}
    try:
        for _ in range(iters):
            run()
            got = timer.pop()
            for p in PHASES:
                per[p].append(got.get(p, 0.0))
    finally:
        layer.timer = None
    return {f"{p}_ms": statistics.median(v) for p, v in per.items()}


def profile_table(run, iters: int = 5) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            run()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    return (f"### by host time ({iters} calls)\n"
            f"{avg.table(sort_by='cpu_time_total', row_limit=25, max_name_column_width=70)}\n"
            f"### by self device time\n"
            f"{avg.table(sort_by='self_device_time_total', row_limit=30, max_name_column_width=70)}\n")


def host_profile(run, iters: int = 20, top: int = 40) -> str:
    """cProfile over `iters` calls: where the host's time per call goes, by Python function (cumulative and own)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(iters):
        run()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    st = pstats.Stats(prof, stream=out)
    st.sort_stats("cumulative").print_stats(top)
    st.sort_stats("tottime").print_stats(top)
    text = out.getvalue().replace(f"{REPO}/", "")  # paths relative to the repository
    for site in sorted({p for p in sys.path if p.endswith("site-packages")}, key=len, reverse=True):
        text = text.replace(f"{site}/", "site-packages/")
    return f"### host profile ({iters} calls; cProfile)\n{text}"


def gemm_kernel(name: str, args):
    """A context manager (factory) under which a layer's call runs: for the `cutlass` layers,
    `topoep.runtime.cuda_function.GROUPED_MM` is CUTLASS's grouped GEMM under our tiles
    (`topoep_research.cutlass_wgrad.as_grouped_mm` in --cutlass-config), forward and backward; else nothing changes."""
    if not name.endswith(" cutlass"):
        return contextlib.nullcontext
    from topoep_research.cutlass_wgrad import as_grouped_mm, swapped_grouped_mm

    kernel = as_grouped_mm(*args.cutlass_config)
    return lambda: swapped_grouped_mm(kernel)


def build(args, T: int, dev, fc1, fc2) -> dict:
    """{name: (module or None, forward(x, idx, w) -> y)} of the layers (module docstring)."""
    from bench.moe_layer import megatron_layer
    from topoep import ExpertParallelMoE, Topology
    from topoep.metrics import ffn_time_per_assignment

    E, H, Fd = args.experts, args.hidden, args.ffn

    def ours(policy: str, layer_graphs: bool = False):
        layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd,
                                  topology=Topology(num_domains=1, ranks_per_domain=1), num_slots=args.slots,
                                  policy=policy, backend="cuda", dtype=torch.bfloat16, device=dev,
                                  t_ffn=ffn_time_per_assignment(H, Fd), max_tokens=T, layer_graphs=layer_graphs)
        with torch.no_grad():
            layer.fc1.copy_(fc1)
            layer.fc2.copy_(fc2)
        return layer, layer

    layers = {f"cuda/{policy}": ours(policy) for policy in ("static", "topoep")}
    p1, p2 = torch.nn.Parameter(fc1.clone()), torch.nn.Parameter(fc2.clone())
    holder = torch.nn.Module()
    holder.fc1, holder.fc2 = p1, p2
    layers["plain torch"] = (holder, lambda x, idx, w: plain_moe(x, idx, w, p1, p2))
    if not args.no_megatron:
        margs = argparse.Namespace(hidden=H, ffn=Fd, experts=E, topk=args.topk, seed=0)
        mlayer, experts_module = megatron_layer(margs, 1, torch.bfloat16, True, fc1, fc2)
        args.megatron_experts = experts_module

        def mrun(x, idx, w, mlayer=mlayer):
            Tn = x.shape[0]
            probs = torch.zeros(Tn, E, device=x.device).scatter(1, idx, w.float())
            rmap = torch.zeros(Tn, E, device=x.device, dtype=torch.bool).scatter(1, idx, True)
            mlayer.route = lambda hidden, padding_mask=None: (probs, rmap)
            y, _ = mlayer(x.view(Tn, 1, H))
            return y.view(Tn, H)
        layers["megatron/alltoall"] = (mlayer, mrun)
    if args.cutlass:  # the same layers timed with CUTLASS's grouped GEMM under our tiles (gemm_kernel swaps it in)
        for policy in ("static", "topoep"):
            layers[f"cuda/{policy} cutlass"] = ours(policy)
    if args.graphed:  # last (a failed capture may leave the stream unusable); layers of their own: a captured
        # pool or metadata graph changes the layer's state
        for policy in ("static", "topoep"):
            layers[f"cuda/{policy} graphed"] = ours(policy, layer_graphs=True)
    return layers


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384], help="tokens per call")
    ap.add_argument("--routings", nargs="+", default=["balanced", "uniform"], choices=["balanced", "uniform"])
    ap.add_argument("--slots", type=int, default=2, help="replica slots of the topoep layers")
    ap.add_argument("--iters", type=int, default=20, help="timed calls per layer and routing")
    ap.add_argument("--profile-iters", type=int, default=5, help="calls with the phase timer (cuda layers)")
    ap.add_argument("--no-megatron", action="store_true", help="leave megatron-core's layer out")
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables of every layer (<name>_profile.txt)")
    ap.add_argument("--host-profile", action="store_true",
                    help="cProfile of the cuda layers' host work by Python function (into <name>_profile.txt)")
    ap.add_argument("--meta-profile", action="store_true",
                    help="torch.profiler over replays of the cuda layers' metadata graph: its kernels one by one "
                         "(into <name>_profile.txt)")
    ap.add_argument("--graphed", action="store_true",
                    help="also cuda/static with forward and backward captured as CUDA graphs by the caller")
    ap.add_argument("--cutlass", action="store_true",
                    help="also cuda/static and cuda/topoep with their grouped GEMMs on CUTLASS under our tiles "
                         "(topoep_research.cutlass_wgrad, built beforehand)")
    ap.add_argument("--cutlass-config", type=int, nargs=2, default=[0, 0], metavar=("WGRAD", "MM"),
                    help="with --cutlass: the weight-gradient and the M-grouped configuration, by index "
                         "(cutlass_wgrad.WGRAD_CONFIGS, MM_CONFIGS)")
    ap.add_argument("--from-json", type=Path, default=None, metavar="JSON",
                    help="measure nothing: write the report of a run again from its JSON (its measured parts, the "
                         "limit and ratios as this script computes them; no GPU needed)")
    ap.add_argument("--out", type=Path, default=REPO / "results", help="directory for the report")
    ap.add_argument("--name", default="layer_limit", help="report name")
    args = parse_options(ap, argv)
    if args.cutlass:
        from topoep_research.cutlass_wgrad import MM_CONFIGS, check_config

        try:
            check_config(args.cutlass_config[0]), check_config(args.cutlass_config[1], MM_CONFIGS)
        except ValueError as err:
            ap.error(f"--cutlass-config: {err}")
    args.__dict__.update(QWEN3)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        return rerender(args.from_json, args.out, args.name)
    if not torch.cuda.is_available():
        raise SystemExit("bench/layer_limit.py measures one GPU: run it on a machine with CUDA")
    dev = bench_gpu()
    if not dist.is_initialized():
        dist.init_process_group("nccl", device_id=dev)
    if dist.get_world_size() != 1:
        raise SystemExit("bench/layer_limit.py runs on one GPU: torchrun --nproc_per_node=1")
    from bench.moe_layer import routing

    E, H, Fd, k = args.experts, args.hidden, args.ffn, args.topk
    g = torch.Generator(device=dev).manual_seed(1234)
    fc1 = (torch.randn(E, 2 * Fd, H, generator=g, device=dev) * 0.02).to(torch.bfloat16)
    fc2 = (torch.randn(E, H, Fd, generator=g, device=dev) * 0.02 / 2 ** 0.5).to(torch.bfloat16)
    rows, limits, profiles = [], {}, []
    for T in args.tokens:
        lim = limits[T] = measure_limit(T, k, E, H, Fd, dev, args.iters)
        print(f"  {T} tokens: limit {lim['limit_ms']:.2f} ms (GEMMs {lim['gemm_dense_ms']:.2f} dense / "
              f"{lim['gemm_even_ms']:.2f} even groups, bytes {lim['bytes_ms']:.2f})", flush=True)
        layers = build(args, T, dev, fc1, fc2)
        gi = torch.Generator().manual_seed(99)
        x = (torch.randn(T, H, generator=gi) * 0.1).to(dev, torch.bfloat16).requires_grad_()
        w = torch.softmax(torch.randn(T, k, generator=gi), -1).to(dev, torch.bfloat16).requires_grad_()
        gy = torch.randn(T, H, generator=gi).to(dev, torch.bfloat16)
        for rname in args.routings:
            idx = routing(1, E, T, k, None if rname == "balanced" else 0.0,
                          "balanced" if rname == "balanced" else "uniform", 0)[0].to(dev)
            ref = None
            for name, (module, fwd) in layers.items():
                def run(module=module, fwd=fwd, kernel=gemm_kernel(name, args)):
                    with kernel():
                        x.grad = w.grad = None
                        module.zero_grad(set_to_none=True)
                        y = fwd(x, idx, w)
                        y.backward(gy)
                    return y.detach()
                try:
                    y = run()
                except Exception as err:  # noqa: BLE001 - a graph capture the layer does not allow: report it
                    print(f"  {T} {rname} {name}: failed: {err}", flush=True)
                    rows.append(dict(tokens=T, routing=rname, layer=name, error=str(err)[:300]))
                    continue
                for _ in range(2):
                    run()
                ref = y if ref is None else ref
                row = dict(tokens=T, routing=rname, layer=name, max_diff=(y.float() - ref.float()).abs().max().item(),
                           **time_layer(run, args.iters))
                if name.startswith("cuda/") and not name.endswith("graphed"):  # (a replay runs no host code)
                    row.update(metadata_graph_us(module, args.iters))
                    if args.meta_profile:
                        profiles.append(f"## {T} tokens, {rname}, {name}: the metadata graph\n"
                                        f"{metadata_graph_profile(module)}")
                    if args.profile_iters:
                        row.update(phase_times(module, run, args.profile_iters, dev))
                if args.profile:
                    profiles.append(f"## {T} tokens, {rname}, {name}\n{profile_table(run)}")
                if args.host_profile and name.startswith("cuda/"):
                    profiles.append(f"## {T} tokens, {rname}, {name}\n{host_profile(run)}")
                row.update(ratios(row, lim))
                rows.append(row)
                print(f"  {T} {rname} {name}: {row['ms']:.2f} ms (GPU {row['gpu_ms']:.2f}, host {row['host_ms']:.2f}) "
                      f"= {row['vs_limit']:.2f}x limit", flush=True)
        del layers
    report(args, rows, limits)
    if args.profile or args.host_profile or args.meta_profile:
        (args.out / f"{args.name}_profile.txt").write_text("\n".join(profiles))
    dist.destroy_process_group()
    return 0


def ratios(row: dict, lim: dict) -> dict:
    """A layer's times against the limit of its token count."""
    return dict(vs_limit=row["ms"] / lim["limit_ms"], vs_limit_even=row["ms"] / lim["limit_even_ms"],
                gpu_vs_limit=row["gpu_ms"] / lim["limit_ms"])


def measuring_options(config: dict) -> list[str]:
    """The measuring options of a run from its JSON's config (bench/layer_limit.py's own options, as parsed)."""
    argv = ["--tokens", *map(str, config["tokens"]), "--iters", str(config["iters"])]
    if config.get("routings") not in (None, ["balanced", "uniform"]):
        argv += ["--routings", *config["routings"]]
    for flag in ("no_megatron", "graphed", "cutlass"):
        if config.get(flag):
            argv.append("--" + flag.replace("_", "-"))
    if config.get("cutlass") and config.get("cutlass_config", [0, 0]) != [0, 0]:
        argv += ["--cutlass-config", *map(str, config["cutlass_config"])]
    return argv


def rerender(path: Path, out: Path, name: str) -> int:
    """--from-json: the report of a run again from its JSON (the measured parts: each GEMM's dense and even-groups
    time, the copy bandwidth, every layer's times), its limit and ratios computed by this version of the script; the
    run's date, commit and hardware kept."""
    data = json.loads(path.read_text())
    c = data["config"]
    limits = {int(T): limit_parts(v["dense_ms"], v["even_ms"], v["copy_gb_per_s"], int(T), c["topk"], c["experts"],
                                  c["hidden"], c["ffn"]) for T, v in data["limits"].items()}
    rows = [r if "error" in r else {**r, **ratios(r, limits[r["tokens"]])} for r in data["rows"]]
    args = argparse.Namespace(**{**c, "out": out, "name": name})
    info = {k: data[k] for k in ("date", "commit", "hardware", "config")}
    measured = " ".join(["torchrun --nproc_per_node=1 bench/layer_limit.py", *measuring_options(c)])
    report(args, rows, limits, info=info,
           cmd=f"{measured}`, then `python bench/layer_limit.py --from-json {repo_relative(path)} --name {name}")
    return 0


def layers_table(rows: list[dict]) -> str:
    """The layers' table, then a line per layer that could not run (its error)."""
    f = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    ran = [r for r in rows if "error" not in r]
    out = markdown_table(
        ["tokens", "routing", "layer", "ms", "/ limit", "/ limit (even)", "GPU ms", "GPU / limit", "host ms",
         "host-bound", "plan ms", "dispatch/combine ms", "experts ms", "metadata graph GPU / host us", "max diff"],
        [[r["tokens"], r["routing"], r["layer"], f(r["ms"]), f(r["vs_limit"]), f(r["vs_limit_even"]), f(r["gpu_ms"]),
          f(r["gpu_vs_limit"]), f(r["host_ms"]), "yes" if r["host_ms"] > r["gpu_ms"] else "no",
          f(r.get("plan_ms")), f(r.get("dispatch_combine_ms")), f(r.get("experts_ms")),
          f"{r['meta_gpu_us']:.0f} / {r['meta_host_us']:.0f}" if "meta_gpu_us" in r else "-", f"{r['max_diff']:.1e}"]
         for r in ran])
    failed = [f"- {r['tokens']} tokens, {r['routing']}, {r['layer']}: did not run: {r['error']}" for r in rows
              if "error" in r]
    failed += [f"- {r['tokens']} tokens, {r['routing']}, {r['layer']}: the host outlasted the sleep in some calls: its "
               "GPU ms may include launch gaps" for r in ran if not r.get("gpu_clean", True)]
    return out + ("\n\n" + "\n".join(failed) if failed else "")


def report(args, rows: list[dict], limits: dict, info: dict | None = None, cmd: str | None = None) -> None:
    """<out>/<name>.md and .json; info and cmd (the provenance and the reproduce line) default to this run's."""
    info = info or run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    cmd = cmd or " ".join(["torchrun --nproc_per_node=1 bench/layer_limit.py", *without_options(args.argv, "--out")])
    text = ["# One MoE layer on one GPU against its physical limit\n",
            f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']}",
            f"- shape: {args.experts} experts, hidden {args.hidden}, expert FFN {args.ffn} (SwiGLU), top-{args.topk}, "
            f"bf16, EP 1; topoep layers: backend cuda, {args.slots} replica slots"
            + (f"; megatron experts: {getattr(args, 'megatron_experts', '-')}" if not args.no_megatron else ""),
            "- limit: the six expert GEMMs, each timed as a dense bf16 matmul of the same size but never below its "
            "own HBM bytes (its rows and all experts' weights) at the measured copy bandwidth (`roofline`), plus the "
            "rows an unfused single-pass layer moves through HBM outside them at that bandwidth "
            "(`bench/layer_limit.py` docstring); `even`: the GEMMs as torch._grouped_mm over perfectly even groups "
            "instead",
            "- ms: median forward + backward from an idle GPU; GPU ms: the GPU's own time (the call queued behind a "
            "sleep); host ms: the host's time to issue it; phases: serialised (PhaseTimer), ms",
            f"- reproduce: `{cmd}`", "", "## The limit", ""]
    text.append(markdown_table(
        ["tokens", "TFLOP", "GEMMs dense ms", "dense TFLOP/s", "GEMM GB", "GEMMs roofline ms", "GEMMs even groups ms",
         "even TFLOP/s", "row GB", "copy GB/s", "bytes ms", "limit ms", "limit (even) ms"],
        [[T, f"{v['tflops']:.3f}", f"{v['gemm_dense_ms']:.2f}", f"{v['dense_tflops_per_s']:.0f}",
          f"{v['gemm_gb']:.2f}", f"{v['gemm_roofline_ms']:.2f}",
          f"{v['gemm_even_ms']:.2f}", f"{v['even_tflops_per_s']:.0f}", f"{v['row_gb']:.2f}",
          f"{v['copy_gb_per_s']:.0f}", f"{v['bytes_ms']:.2f}", f"{v['limit_ms']:.2f}", f"{v['limit_even_ms']:.2f}"]
         for T, v in limits.items()]))
    text += ["", "## The layers", "", layers_table(rows)]
    text += ["", "Per-GEMM times (ms): dense / roofline (the larger of dense and its HBM bytes) / even groups", ""]
    names = [n for n, *_ in gemm_shapes(1, 1, 1)]
    text.append(markdown_table(["tokens", *names],
                               [[T, *(f"{v['dense_ms'][n]:.3f} / {v['roofline_ms'][n]:.3f} / {v['even_ms'][n]:.3f}"
                                      for n in names)] for T, v in limits.items()]))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text("\n".join(text) + "\n")
    write_json(args.out / f"{args.name}.json", {**info, "limits": {str(T): v for T, v in limits.items()}}, rows)
    print("\n".join(text))


if __name__ == "__main__":
    sys.exit(main())
