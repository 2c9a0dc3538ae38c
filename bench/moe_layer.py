"""Forward + backward time of one MoE layer under skewed routing, beside the balanced upper bound, with a
latency breakdown like the paper's Fig. 15. One process per GPU (NCCL), EP = world size:

    torchrun --nproc_per_node=2 bench/moe_layer.py                 # Qwen3-30B-A3B expert shape (estimated 2-3
                                                                   # min on 2 H200: 54 cases x 26 iterations)
    torchrun --nproc_per_node=2 bench/moe_layer.py --tokens 4096   # one token count (a fraction of that)
    torchrun --nproc_per_node=2 bench/moe_layer.py --tiny          # CPU/gloo smoke: small shapes, few iterations

Shape: hidden 2048, expert FFN 768 (SwiGLU), top-8, 128 experts (64 per GPU at EP 2), bf16 on GPU (fp32 on
CPU); --tokens tokens per rank (default 4096 8192 16384).

Layers, all fed the same routing, expert weights, input and output gradient in one run:
    <backend>/<policy>  `topoep.ExpertParallelMoE` for each --backends entry (default torch and cuda on GPUs,
                        torch on the CPU) and --policies entry (default static, topoep; the net-benefit
                        guard on; --unguarded adds every balancing policy with the guard off)
    megatron/alltoall   megatron-core's MoELayer with its alltoall token dispatcher and its experts
                        (SequentialMLP on the local spec; TEGroupedMLP when Transformer Engine imports)

Routing (topoep.workloads, token level, the same on every rank; rank r executes row r): router_skew 0
(uniform; at skew 0 every layout is the same routing, so it runs once), each skew of --skews times each
--layouts entry ("random": megatron's random per-expert bias; "concentrated": rank 0's experts get the
largest biases), and "balanced", the upper bound (`balanced_topk`: every rank exactly the mean load).
Megatron gets it by replacing its router's output (`MoELayer.route` returns probs[T, E] = the routing
weights scattered, routing_map = where they are): its `moe_router_force_biased` draws its own logits and
cannot express the concentrated or the exactly balanced routing, and this way every layer executes
identical assignments (checked: each layer's output against <first backend>/static, `max_diff`).

Measured per case:
    ms         median over --iters iterations (after --warmup) of the slowest rank's forward + backward
               (barrier before each iteration; CUDA events on GPU, perf_counter on CPU)
    vs static  ms / ms of <backend>/static (the same backend's static layer) on the same routing
    vs bound   ms / ms of the same layer on balanced routing in this run (the issue's >= 90 % target is
               vs bound <= 1.11)
    imbalance  max / mean rank load before balancing (main instances: what static and megatron execute)
               -> after (the plan executed, from the layer's statistics)
    guard      share of the calls in which the net-benefit guard fired (executed the static plan); backend
               cuda: (skip x%) the share that also left the replica machinery out (guard.py, skip_lag)
    breakdown  --profile-iters extra iterations with a `topoep.runtime.PhaseTimer` (phases serialised: each
               one waits for the work before it, communication phases start after a barrier, each phase is
               timed with CUDA events), median per rank, then the maximum over ranks: plan (count
               all-gather, planner, guard), fetch (replica weights, forward fetch + backward reload),
               dispatch/combine (layouts, count exchange and every token all-to-all, forward and
               backward), experts (expert GEMMs forward, data and weight gradients; the max over ranks is
               the straggler's), grad return (replica weight gradients to their main ranks). For megatron
               the same timer wraps its dispatcher phases (preprocess, dispatch, dispatch_postprocess,
               combine_preprocess, combine, postprocess) and its experts module, in the backward pass
               between autograd marks on the hidden states; it has no plan, fetch or grad return. The
               phases overlap in the timed (pipelined) runs, so they do not add up to ms.

Prints the table and writes <out>/<name>.md and .json (config, commit, hardware; --name, default moe_layer),
with the breakdown split into forward and backward and plotted in <out>/<name>_breakdown.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, bench_gpu, cuda_ms, markdown_table, run_info, without_options, write_json  # noqa: E402
from topoep import POLICIES, ExpertParallelMoE, Topology  # noqa: E402
from topoep.metrics import ffn_time_per_assignment  # noqa: E402
from topoep.runtime import LAYER_STAT_NAMES, PHASES, PhaseTimer  # noqa: E402
from topoep.config import DEFAULT_CAPACITY_FACTOR, TRANSPORTS  # noqa: E402
from topoep.runtime.deepep import release_buffers  # noqa: E402
from topoep.workloads import balanced_topk, biased_topk, routing_counts, static_imbalance  # noqa: E402

LAYER_BACKENDS = ("torch", "cuda")  # ExpertParallelMoE backends measured here (cuda: GPUs only)
QWEN3 = dict(hidden=2048, ffn=768, experts=128, topk=8, tokens=[4096, 8192, 16384], iters=20, rounds=4, warmup=3,
             profile_iters=3)
TINY = dict(hidden=32, ffn=16, experts_per_rank=4, topk=2, tokens=[64], iters=3, rounds=2, warmup=1, profile_iters=1)


# -- routing --------------------------------------------------------------------------------------
def workloads(args) -> list[tuple[str, float | None, str]]:
    """(name, router_skew, layout) of every routing case; skew 0 once (every layout coincides there)."""
    out = []
    for skew in args.skews:
        for layout in (args.layouts if skew != 0 else ["uniform"]):
            out.append((f"skew {skew:g} {layout}" if skew != 0 else "skew 0 (uniform)", skew, layout))
    out.append(("balanced (bound)", None, "balanced"))
    return out


def routing(world, E, T, k, skew, layout, seed) -> torch.Tensor:
    """int64[R, T, k]: the same on every rank."""
    if layout == "balanced":
        return balanced_topk(world, E, T, k)
    return biased_topk(world, E, T, k, skew, seed=seed, layout="random" if layout == "uniform" else layout)


# -- megatron-core's layer ------------------------------------------------------------------------
class _Mark(torch.autograd.Function):
    """Identity; its backward starts or stops a timer phase (the backward of what it marks)."""

    @staticmethod
    def forward(ctx, x, timer, name, edge, collective):
        ctx.args = (timer, name, edge, collective)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        timer, name, edge, collective = ctx.args
        if edge == "output":  # the gradient reached the phase's output: its backward begins
            timer.start(name, collective)
        else:
            timer.stop(name)
        return g, None, None, None, None


class MegatronTiming:
    """Wraps a megatron MoELayer's dispatcher phases and experts with a PhaseTimer while `timer` is set."""

    def __init__(self, layer):
        self.timer: PhaseTimer | None = None
        d = layer.token_dispatcher
        for obj, attr, name, collective in ((layer, "preprocess", "dispatch_combine", True),
                                            (layer, "dispatch", "dispatch_combine", True),
                                            (d, "dispatch_postprocess", "dispatch_combine", False),
                                            (layer.experts, "forward", "experts", False),
                                            (d, "combine_preprocess", "dispatch_combine", False),
                                            (layer, "combine", "dispatch_combine", True),
                                            (layer, "postprocess", "dispatch_combine", False)):
            setattr(obj, attr, self._wrap(getattr(obj, attr), name, collective))

    def _mark(self, value, name, edge, collective):
        """Mark the first tensor that needs a gradient in value (a tensor or a tuple)."""
        items = list(value) if isinstance(value, tuple) else [value]
        for i, t in enumerate(items):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                items[i] = _Mark.apply(t, self.timer, name, edge, collective)
                break
        return tuple(items) if isinstance(value, tuple) else items[0]

    def _wrap(self, fn, name, collective):
        def wrapped(*args, **kwargs):
            if self.timer is None:
                return fn(*args, **kwargs)
            args = self._mark(tuple(args), name, "input", collective)
            with self.timer.phase(name, collective):
                out = fn(*args, **kwargs)
            return self._mark(out, name, "output", collective)
        return wrapped


def megatron_layer(args, world: int, dtype, cuda: bool, fc1: torch.Tensor, fc2: torch.Tensor):
    """(megatron MoELayer with our expert weights, experts module name)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from topoep.megatron.model import transformer_engine_available
    from topoep.megatron.moe_layer import expert_weight_lists

    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(expert_model_parallel_size=world)
    model_parallel_cuda_manual_seed(args.seed)
    te = cuda and transformer_engine_available()
    if te:
        from megatron.core.models.backends import TESpecProvider
    tc = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=max(1, args.hidden // 128), ffn_hidden_size=args.ffn,
        num_moe_experts=args.experts, moe_ffn_hidden_size=args.ffn, moe_router_topk=args.topk, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, expert_model_parallel_size=world,
        moe_grouped_gemm=te, bf16=dtype == torch.bfloat16, params_dtype=dtype, use_cpu_initialization=not cuda,
        gradient_accumulation_fusion=False, bias_activation_fusion=False)
    spec = get_moe_module_spec_for_backend(TESpecProvider() if te else LocalSpecProvider(), num_experts=args.experts,
                                           moe_grouped_gemm=te)
    layer = spec(config=tc, layer_number=1)
    if cuda:
        layer.cuda()
    w1, w2 = expert_weight_lists(layer.experts)
    with torch.no_grad():
        for i in range(len(w1)):
            w1[i].copy_(fc1[i])
            w2[i].copy_(fc2[i])
    return layer, type(layer.experts).__name__


# -- measurement ----------------------------------------------------------------------------------
class Case:
    """One layer on one routing: run() does forward + backward and returns the output; timer_owner gets
    the PhaseTimer while profiling; topoep is the ExpertParallelMoE (None for megatron)."""

    def __init__(self, name, run, timer_owner, topoep_layer):
        self.name, self.run, self.timer_owner, self.topoep = name, run, timer_owner, topoep_layer


def time_iterations(run, n: int, cuda: bool) -> list[float]:
    """This rank's forward + backward ms of n calls, each after a barrier."""
    out = []
    for _ in range(n):
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
            out.append(cuda_ms(run))
        else:
            t0 = time.perf_counter()
            run()
            out.append(1e3 * (time.perf_counter() - t0))
    return out


def across_ranks_max(values: list[float], dev) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def warm_up(case: Case, args) -> tuple[torch.Tensor, tuple | None]:
    """Warm-up calls (the first allocates); returns (the layer's output for the cross-check, the slot hint's
    counters before the timed calls)."""
    ys = case.run()
    for _ in range(args.warmup - 1):
        case.run()
    if case.topoep is not None:
        case.topoep.pop_stats()
    hint = case.topoep.slot_hint if case.topoep is not None else None
    return ys, ((hint.calls, hint.skipped) if hint is not None else None)


def timed_rounds(cases: list[Case], args, cuda: bool) -> dict[str, list[float]]:
    """This rank's ms of every timed call of every case: args.iters calls per case, in args.rounds rounds that
    take the cases in turn, so that a drift of the machine (clocks, neighbours) reaches every case alike and the
    ratios between cases stay fair."""
    times = {c.name: [] for c in cases}
    for r in range(args.rounds):
        n = args.iters // args.rounds + (r < args.iters % args.rounds)
        for c in cases:
            times[c.name] += time_iterations(c.run, n, cuda)
    return times


def measure(case: Case, args, cuda: bool, dev, times: list[float], before: tuple | None) -> dict:
    """The row of a case from its timed calls (this rank's ms), then its statistics and profile."""
    hint = case.topoep.slot_hint if case.topoep is not None else None
    depth = args.depth if case.topoep is not None else 1
    ms = statistics.median(across_ranks_max(times, dev)) / depth
    row = dict(ms=ms, guard_fired=None, imbalance_after=None, guard_saved_ms=None, guard_cost_ms=None, slot_skip=None)
    if hint is not None and hint.calls > before[0]:  # share of timed calls without the replica machinery
        row["slot_skip"] = (hint.skipped - before[1]) / (hint.calls - before[0])
    if case.topoep is not None:
        stats, _ = case.topoep.pop_stats()
        s = dict(zip(LAYER_STAT_NAMES, stats.tolist()))
        row.update(imbalance_after=s["imbalance"], replica_fraction=s["replica_fraction"])
        if case.topoep.guard is not None and case.topoep.policy != "static":
            row.update(guard_fired=s["guard_fired"], guard_saved_ms=s["guard_saved_ms"],
                       guard_cost_ms=s["guard_cost_ms"])
    per_phase = {(p, d): [] for p in PHASES for d in (0, 1)}  # d: 0 forward, 1 backward
    if args.profile_iters:
        timer = PhaseTimer(dev)
        case.timer_owner.timer = timer
        try:
            for _ in range(args.profile_iters):
                dist.barrier()
                case.run()
                got = timer.pop(split=True)
                for p in PHASES:
                    for d in (0, 1):
                        per_phase[p, d].append(got.get(p, (0.0, 0.0))[d])
        finally:
            case.timer_owner.timer = None
        med = torch.tensor([[statistics.median(per_phase[p, d]) / depth for d in (0, 1)] for p in PHASES],
                           dtype=torch.float64, device=dev)
        every = [torch.empty_like(med) for _ in range(dist.get_world_size())]
        dist.all_gather(every, med)
        every = torch.stack(every).cpu()  # [R, phases, (fwd, bwd)]
        for i, p in enumerate(PHASES):
            row[f"{p}_ms"] = every[:, i].sum(-1).max().item()
            row[f"{p}_fwd_ms"], row[f"{p}_bwd_ms"] = every[:, i, 0].max().item(), every[:, i, 1].max().item()
        row["experts_ms_per_rank"] = every[:, PHASES.index("experts")].sum(-1).tolist()
    if args.torch_profile:
        row["torch_profile"] = torch_profile(case, cuda, args.trace_dir)
    return row


def torch_profile(case: Case, cuda: bool, trace_dir: Path | None = None, iters: int = 5) -> str:
    """torch.profiler over `iters` calls of a case (every rank runs them; rank 0's table is returned): where
    the host and the device spend the layer's time, by operator; with trace_dir a Chrome trace per rank."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    dist.barrier()
    with profile(activities=acts) as prof:
        for _ in range(iters):
            case.run()
        if cuda:
            torch.cuda.synchronize()
    if trace_dir:  # a Chrome trace per rank and case, for timeline analysis
        d = trace_dir
        d.mkdir(parents=True, exist_ok=True)
        name = "".join(c if c.isalnum() else "_" for c in case.name)
        n = len(list(d.glob(f"trace_*_{name}_rank{dist.get_rank()}.json")))  # cases repeat over workloads
        prof.export_chrome_trace(str(d / f"trace_{n}_{name}_rank{dist.get_rank()}.json"))
    if dist.get_rank() != 0:
        return ""
    by_cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=70)
    by_dev = prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                       row_limit=40, max_name_column_width=70)
    return f"## {case.name}: {iters} calls, by host time\n{by_cpu}\n## by self device time\n{by_dev}\n"


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="small shapes and few iterations (CPU/gloo smoke test)")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="tokens per rank (default 4096 8192 16384)")
    ap.add_argument("--skews", type=float, nargs="+", default=[0.0, -2.0, -4.0], help="router_skew values")
    ap.add_argument("--layouts", nargs="+", default=["random", "concentrated"], choices=["random", "concentrated"])
    ap.add_argument("--backends", nargs="+", default=None, choices=list(LAYER_BACKENDS),
                    help="ExpertParallelMoE backends (default: torch and cuda on GPUs, torch on the CPU)")
    ap.add_argument("--policies", nargs="+", default=["static", "topoep"], choices=list(POLICIES))
    ap.add_argument("--unguarded", action="store_true", help="also run every balancing policy with the guard off")
    ap.add_argument("--no-megatron", action="store_true", help="skip megatron-core's alltoall layer")
    ap.add_argument("--slots", type=int, default=2, help="replica slots per rank")
    ap.add_argument("--capacity-factors", nargs="+", default=["default"],
                    help="ExpertParallelMoE capacity_factor of the TopoEP layers: 'default' "
                         f"({DEFAULT_CAPACITY_FACTOR}; with --transport a2a or deepep: none), 'none' (buffers for the worst case) or a number; each value "
                         "other than the default labels its layers '<backend> cf=<value>'")
    ap.add_argument("--transport", choices=list(TRANSPORTS), default="peer",
                    help="backend cuda's data movement: peer pointers (one host), NVSHMEM all-to-alls (a2a) or DeepEP "
                         "(deepep; installed with tools/build_deepep.sh)")
    ap.add_argument("--reload", choices=["auto", "always"], default="auto",
                    help="backend cuda's replica reload in backward: auto leaves it out when the slots still hold "
                         "the layer's replicas (a lone layer, the last of a model); always reloads, as every MoE "
                         "layer but the last of a deeper model does (the replica pool's reload_always)")
    ap.add_argument("--chunks", type=int, choices=[1, 2], default=None,
                    help="token chunks per call (LayerConfig.num_chunks; default: the backend's, torch 2, cuda 1)")
    ap.add_argument("--prefetch", action="store_true",
                    help="backend cuda: a second bank of replica slots, refilled at the end of each backward "
                         "(LayerConfig.prefetch)")
    ap.add_argument("--fetch-overlap", action="store_true",
                    help="backend cuda, transport peer: the forward replica fetch beside the dispatch and the main "
                         "experts' GEMMs (LayerConfig.fetch_overlap)")
    ap.add_argument("--combine-side-stream", action="store_true",
                    help="backend cuda: the backward combine beside the weight-gradient GEMMs "
                         "(LayerConfig.combine_side_stream)")
    ap.add_argument("--depth", type=int, default=1,
                    help="MoE layers per case, chained (the layer's output is the next call's input), so that the "
                         "backward runs them in reverse as a model does (reloads, --prefetch); every time is "
                         "reported per layer (the case's time / depth)")
    ap.add_argument("--ranks-per-domain", type=int, default=None, help="virtual NVLink domain size (default: all)")
    ap.add_argument("--iters", type=int, default=None, help="timed iterations per case (default 20; tiny 3)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="the timed iterations are taken in this many rounds over all cases of a routing, in turn "
                         "(default 4; tiny 2): a drift of the machine reaches every case alike")
    ap.add_argument("--warmup", type=int, default=None, help="warm-up iterations per case (default 3; tiny 1)")
    ap.add_argument("--profile-iters", type=int, default=None,
                    help="extra iterations with the phase timer (default 3; tiny 1; 0: no breakdown)")
    ap.add_argument("--seed", type=int, default=0, help="routing seed (the router bias draw)")
    ap.add_argument("--trace-dir", type=Path, default=None,
                    help="with --torch-profile: write a Chrome trace per rank and case here (tools/trace_summary.py)")
    ap.add_argument("--torch-profile", action="store_true",
                    help="also run torch.profiler over 5 calls of every case; writes <out>/moe_layer_profile.txt")
    ap.add_argument("--out", type=Path, default=REPO / "results", help="directory for the report")
    ap.add_argument("--name", default="moe_layer",
                    help="report name: <out>/<name>.md, .json and <name>_breakdown.png (e.g. fig15)")
    args = ap.parse_args(argv)
    argv = without_options(sys.argv[1:] if argv is None else argv, "--out")
    args.command = " ".join(["bench/moe_layer.py", *argv])
    shape = TINY if args.tiny else QWEN3
    for name in ("iters", "rounds", "warmup", "profile_iters"):
        if getattr(args, name) is None:
            setattr(args, name, shape[name])
    if args.iters < 1 or args.warmup < 1 or args.profile_iters < 0 or not 1 <= args.rounds <= args.iters:
        raise ValueError(f"--iters ({args.iters}) and --warmup ({args.warmup}) must be >= 1, --rounds ({args.rounds}) "
                         f"from 1 to --iters, and --profile-iters ({args.profile_iters}) >= 0")
    if args.slots < 0:
        raise ValueError(f"--slots must be >= 0, got {args.slots}")
    if args.depth < 1 or (args.depth > 1 and not args.no_megatron):
        raise ValueError(f"--depth must be >= 1, and > 1 only with --no-megatron (megatron's layer is timed alone); "
                         f"got --depth {args.depth}")
    if args.reload == "always":  # a benchmark knob of the replica pools, not a layer option
        from topoep.runtime.pool import SlotBanks

        SlotBanks.reload_always = True
    args.hidden, args.ffn, args.topk = shape["hidden"], shape["ffn"], shape["topk"]
    args.tokens = args.tokens or shape["tokens"]
    if args.backends is None:
        args.backends = ["torch", "cuda"] if torch.cuda.is_available() and not args.tiny else ["torch"]
    return args


def init_distributed(args) -> tuple[torch.device, torch.dtype, bool]:
    """(device, dtype, cuda): NCCL and bf16 on GPUs, gloo and fp32 otherwise (and always with --tiny)."""
    cuda = torch.cuda.is_available() and not args.tiny
    if cuda:
        dev = bench_gpu()
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=dev)
        return dev, torch.bfloat16, True
    if not args.no_megatron:
        from topoep.megatron.cpu_compat import enable_cpu_compat

        enable_cpu_compat()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return torch.device("cpu"), torch.float32, False


def build_layers(args, topo, dev, dtype, cuda, max_tokens: int, with_megatron: bool = True) -> tuple[dict, object]:
    """({name: ExpertParallelMoE}, (megatron layer, its MegatronTiming, experts module name) or None), all
    with the same expert weights; max_tokens sizes backend cuda's buffers (built per token count, as a
    training run would size them for its micro-batch)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    E, H, Fd = args.experts, args.hidden, args.ffn
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    fc1 = (torch.randn(E // world, 2 * Fd, H, generator=g, device=dev) * 0.02).to(dtype)
    fc2 = (torch.randn(E // world, H, Fd, generator=g, device=dev) * 0.02 / 2 ** 0.5).to(dtype)
    variants = [(be, p, True, cf) for cf in args.capacity_factors for be in args.backends for p in args.policies]
    if args.unguarded:
        variants += [(be, p, False, cf) for cf in args.capacity_factors for be in args.backends for p in args.policies
                     if p != "static"]
    layers = {}
    # a2a has no spill path, DeepEP sizes its own buffers: both for the worst case
    default = None if args.transport in ("a2a", "deepep") else DEFAULT_CAPACITY_FACTOR
    for be, policy, guard, cf in variants:
        factor = default if cf == "default" else None if cf == "none" else float(cf)
        layer = ExpertParallelMoE(num_experts=E, hidden_size=H, ffn_hidden_size=Fd, topology=topo,
                                  num_slots=args.slots, policy=policy, backend=be, dtype=dtype, device=dev,
                                  t_ffn=ffn_time_per_assignment(H, Fd), guard=guard,
                                  max_tokens=max_tokens if be == "cuda" else None,
                                  transport=args.transport if be == "cuda" else "peer", capacity_factor=factor,
                                  num_chunks=args.chunks, prefetch=args.prefetch and be == "cuda",
                                  combine_side_stream=args.combine_side_stream and be == "cuda",
                                  fetch_overlap=args.fetch_overlap and be == "cuda")
        with torch.no_grad():
            layer.fc1.copy_(fc1)
            layer.fc2.copy_(fc2)
        label = be if cf == "default" else f"{be} cf={cf}"  # a capacity other than the default: its own "backend"
        layers[f"{label}/{policy}" + ("" if guard or policy == "static" else " (no guard)")] = layer
    if args.no_megatron or not with_megatron:
        return layers, None
    mlayer, experts_module = megatron_layer(args, world, dtype, cuda, fc1, fc2)
    return layers, (mlayer, MegatronTiming(mlayer), experts_module)


def make_cases(layers, megatron, x, w, gy, idx, depth: int = 1) -> list[Case]:
    """Every layer on this rank's routing idx int64[T, k] with input x, weights w and output gradient gy; with
    depth > 1 the layer is called depth times in a chain (megatron's layer once)."""
    cases = []
    for name, layer in layers.items():
        def run(layer=layer):
            x.grad = w.grad = None
            layer.zero_grad(set_to_none=True)
            y = x
            for _ in range(depth):
                y = layer(y, idx, w)
            y.backward(gy)
            return y.detach()
        cases.append(Case(name, run, layer, layer))
    if megatron is not None:
        mlayer, timing, _ = megatron
        T, H = x.shape
        E = mlayer.config.num_moe_experts
        # the router's output: probs as its softmax gives them (fp32), routing_map where they are
        probs = torch.zeros(T, E, device=x.device).scatter(1, idx, w.detach().float()).requires_grad_()
        rmap = torch.zeros(T, E, device=x.device, dtype=torch.bool).scatter(1, idx, True)
        mlayer.route = lambda hidden, padding_mask=None: (probs, rmap)
        x3 = x.detach().view(T, 1, H).requires_grad_()

        def mrun():
            x3.grad = probs.grad = None
            mlayer.zero_grad(set_to_none=True)
            y, _ = mlayer(x3)
            y.backward(gy.view(T, 1, H))
            return y.detach().view(T, H)
        cases.append(Case("megatron/alltoall", mrun, timing, None))
    return cases


def main(argv=None) -> int:
    args = parse_args(argv)
    own_group = not dist.is_initialized()
    dev, dtype, cuda = init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    args.experts = TINY["experts_per_rank"] * world if args.tiny else QWEN3["experts"]
    if args.experts % world:
        raise ValueError(f"{args.experts} experts do not split over {world} ranks: run on a world size dividing it")
    rpd = args.ranks_per_domain or world
    if world % rpd:
        raise ValueError(f"--ranks-per-domain {rpd} must divide the world size {world}")
    topo = Topology(num_domains=world // rpd, ranks_per_domain=rpd)
    layers, megatron = build_layers(args, topo, dev, dtype, cuda, args.tokens[0])
    reference = next((name for name in layers if name.endswith("/static")), None)
    E, H, k = args.experts, args.hidden, args.topk
    rows = []
    for T in args.tokens:
        if T != args.tokens[0]:
            layers = build_layers(args, topo, dev, dtype, cuda, T, with_megatron=False)[0]
        gi = torch.Generator().manual_seed(99 + rank)
        x = (torch.randn(T, H, generator=gi) * 0.1).to(dev, dtype).requires_grad_()
        w = torch.softmax(torch.randn(T, k, generator=gi), -1).to(dev, dtype).requires_grad_()
        gy = torch.randn(T, H, generator=gi).to(dev, dtype)
        for wname, skew, layout in workloads(args):
            idx_all = routing(world, E, T, k, skew, layout, args.seed)
            before = static_imbalance(routing_counts(idx_all, E))
            outputs, case_rows, counters = {}, [], {}
            cases = make_cases(layers, megatron, x, w, gy, idx_all[rank].to(dev), args.depth)
            for case in cases:
                outputs[case.name], counters[case.name] = warm_up(case, args)
            times = timed_rounds(cases, args, cuda)
            for case in cases:
                row = measure(case, args, cuda, dev, times[case.name], counters[case.name])
                row.update(tokens=T, workload=wname, router_skew=skew, layout=layout, layer=case.name,
                           imbalance_before=before, ran=True)
                if row["imbalance_after"] is None:
                    row["imbalance_after"] = before  # static placement: what static and megatron execute
                case_rows.append(row)
                if rank == 0 and not args.tiny:
                    print(f"  {T} {wname} {case.name}: {row['ms']:.2f} ms", flush=True)
            for row in case_rows:  # identical routing and weights: outputs agree up to reduction order
                diff = torch.zeros((), dtype=torch.float32, device=dev)
                if reference is not None:
                    diff = (outputs[row["layer"]].float() - outputs[reference].float()).abs().max()
                dist.all_reduce(diff, op=dist.ReduceOp.MAX)
                row["max_diff"] = diff.item() if reference is not None else None
            rows += case_rows
    relate(rows)
    if rank == 0 and args.torch_profile:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "moe_layer_profile.txt").write_text("\n".join(
            f"# {r['tokens']} tokens/rank, {r['workload']}\n{r.pop('torch_profile')}" for r in rows))
    for r in rows:
        r.pop("torch_profile", None)
    if rank == 0:
        # the guard the balanced layers built (a layer's own rule for its constants: ExpertParallelMoE)
        guard = next((layer.guard for layer in layers.values() if layer.guard is not None), None)
        report(args, rows, world, topo, dtype, megatron[2] if megatron else None, guard)
    if megatron is not None:
        from megatron.core import parallel_state as ps

        ps.destroy_model_parallel()
    if own_group:
        dist.barrier()  # every rank done before teardown (with transport a2a the run hung at exit once)
        release_buffers()  # transport deepep's buffers, while their process group lives
        dist.destroy_process_group()
    return 0


def relate(rows: list[dict]) -> None:
    """vs_static (same routing) and vs_bound (same layer on balanced routing) for every row."""
    by = {(r["tokens"], r["workload"], r["layer"]): r for r in rows}
    statics = [r["layer"] for r in rows if r["layer"].endswith("/static")]
    for r in rows:
        own = r["layer"].split("/")[0] + "/static"  # the same backend's static layer, else the first one
        s = by.get((r["tokens"], r["workload"], own if own in statics else statics[0])) if statics else None
        b = by.get((r["tokens"], "balanced (bound)", r["layer"]))
        r["vs_static"] = r["ms"] / s["ms"] if s else None
        r["vs_bound"] = r["ms"] / b["ms"] if b else None
        exposed = (r.get("plan_ms") or 0.0) + (r.get("fetch_ms") or 0.0)
        r["plan_fetch_share"] = exposed / r["ms"] if "plan_ms" in r and r["layer"] != "megatron/alltoall" else None


def _f(v, fmt="{:.2f}"):
    return "-" if v is None else fmt.format(v)


def _reload_text(args) -> str:
    if args.reload == "always":
        return "always (as every MoE layer but the last of a model with several)"
    return ("auto: left out, the lone layer's replicas are still in the slots in backward (as for a model's last "
            "MoE layer; `--reload always` shows the others)")


def report(args, rows, world, topo, dtype, experts_module, guard=None) -> None:
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
                    | {"world": world, "topology": repr(topo), "dtype": str(dtype), "megatron_experts": experts_module})
    header = ["tokens/rank", "routing", "layer", "fwd+bwd ms", "vs static", "vs bound", "rank imbalance",
              "guard", "plan", "fetch", "dispatch/combine", "experts (straggler)", "grad return", "(plan+fetch) / ms"]
    mega = lambda r: r["layer"].startswith("megatron")  # noqa: E731
    table = markdown_table(header, [[
        r["tokens"], r["workload"], r["layer"], f"{r['ms']:.2f}", _f(r["vs_static"]), _f(r["vs_bound"]),
        f"{r['imbalance_before']:.2f} -> {r['imbalance_after']:.2f}",
        (_f(r["guard_fired"], "{:.0%}") + (f" (skip {r['slot_skip']:.0%})" if r.get("slot_skip") is not None else "")
         if r["guard_fired"] is not None else "-"),
        *(("-" if mega(r) and p in ("plan", "fetch", "grad_return") else _f(r.get(f"{p}_ms")))
          for p in PHASES), _f(r["plan_fetch_share"], "{:.0%}")] for r in rows])
    text = "\n".join([
        "# One MoE layer: forward + backward time under skewed routing vs the balanced bound (Fig. 15 breakdown)\n",
        f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']}",
        f"- {world} ranks, EP {world} ({topo}), {args.experts} experts, hidden {args.hidden}, expert FFN {args.ffn}, "
        f"top-{args.topk}, {dtype}; {args.slots} replica slots; backends {', '.join(args.backends)}"
        + (f" (backend cuda on transport {args.transport})" if "cuda" in args.backends else "") + "; "
        f"routing seed {args.seed}; backward replica reload: {_reload_text(args)}; token chunks: "
        f"{args.chunks or 'the backend default (torch 2, cuda 1)'}; backward prefetch (backend cuda): "
        f"{int(args.prefetch)}; backward combine on a side stream: {int(args.combine_side_stream)}; "
        f"forward fetch beside the dispatch: {int(args.fetch_overlap)}; megatron experts: {experts_module or 'not run'}"
        + (f"; each case is {args.depth} layers in a chain, every time per layer (the case's / {args.depth})"
           if args.depth > 1 else ""),
        f"- ms: median over {args.iters} iterations (after {args.warmup} warm-up; taken in {args.rounds} rounds over the "
        "cases of each routing in turn) of the slowest rank's forward + backward; vs static: / the static layer on the same routing; vs bound: / the same layer on "
        "balanced routing (every rank exactly the mean load); rank imbalance: max / mean rank load before -> "
        "after balancing; guard: share of calls where the net-benefit guard executed the static plan (skip: "
        "share of timed calls whose replica machinery was left out because the guard had fired `skip_lag` calls "
        "earlier)",
        f"- breakdown (ms): median of {args.profile_iters} extra iterations with phases serialised (CUDA events on "
        "GPU), maximum over ranks: experts is the straggler's; phases overlap in the timed runs and do not add up; "
        "(plan+fetch) / ms: the serialised plan and fetch over the timed layer, both blocking (target <= 10 %)",
        "- routing: token-level `topoep.workloads` routing (biased_topk, balanced_topk), identical for every layer; "
        "megatron's router output is replaced by it (probs, routing_map); `max_diff` in the JSON is each layer's "
        "largest output difference from the static layer's",
        f"- net-benefit guard: `{guard if guard is not None else 'off'}` (as the layers built it), t_ffn {1e9 * ffn_time_per_assignment(args.hidden, args.ffn):.3g} "
        "ns per assignment (fwd + bwd)",
        f"- reproduce: `torchrun --nproc_per_node={world} {args.command}`\n",
        table, ""])
    if args.profile_iters:
        text += "\n".join([
            "\n## Breakdown by pass: forward / backward (ms, maximum over ranks of each)\n",
            "The same serialised phases split by the pass they ran in (autograd's backward or not); plan is "
            "forward only, grad return backward only; fetch in backward is the replica reload.\n",
            markdown_table(["tokens/rank", "routing", "layer", *(p.replace("_", " ") for p in PHASES)], [[
                r["tokens"], r["workload"], r["layer"],
                *("-" if mega(r) and p in ("plan", "fetch", "grad_return")
                  else f"{_f(r.get(f'{p}_fwd_ms'))} / {_f(r.get(f'{p}_bwd_ms'))}" for p in PHASES)] for r in rows]),
            f"\n![breakdown]({args.name}_breakdown.png)\n"])
    print(text, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(text)
    write_json(args.out / f"{args.name}.json", info, rows)
    if args.profile_iters:
        plot_breakdown(rows, args.out / f"{args.name}_breakdown.png")
    print(f"wrote {args.out / args.name}.md and .json", flush=True)


def plot_breakdown(rows: list[dict], path: Path) -> None:
    """Stacked bars per (routing, layer) of the largest token count: forward and backward phases (Fig. 15)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    T = max(r["tokens"] for r in rows)
    sel = [r for r in rows if r["tokens"] == T and f"{PHASES[0]}_fwd_ms" in r]
    if not sel:
        return
    workloads_ = list(dict.fromkeys(r["workload"] for r in sel))
    fig, axes = plt.subplots(1, len(workloads_), figsize=(3.2 * len(workloads_) + 1, 4), sharey=True, squeeze=False)
    colors = dict(zip(PHASES, plt.get_cmap("tab10").colors))
    for ax, wl in zip(axes[0], workloads_):
        layers = [r for r in sel if r["workload"] == wl]
        for i, r in enumerate(layers):
            for j, d in enumerate(("fwd", "bwd")):
                bottom = 0.0
                for p in PHASES:
                    v = r.get(f"{p}_{d}_ms") or 0.0
                    ax.bar(2.4 * i + j, v, bottom=bottom, color=colors[p], edgecolor="white", lw=0.3,
                           label=p.replace("_", " ") if (i, j) == (0, 0) else None)
                    bottom += v
        ax.set_xticks([2.4 * i + 0.5 for i in range(len(layers))],
                      [r["layer"].replace("/", "/\n") + "\nfwd | bwd" for r in layers], fontsize=6)
        ax.set_title(wl, fontsize=8)
    axes[0][0].set_ylabel(f"ms (serialised phases, {T} tokens/rank;\neach phase and pass: max over ranks)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
