"""Planner latency, paper Fig. 11, on one GPU: the whole `topoep.solve(..., backend="cuda")` call (eager)
and the planner replayed from a CUDA graph, beside the CPU reference planner's time; `topoep`,
`topoep_plus` (topoep.planners.plus) and the spread candidates (topoep.planners.spread, csrc/spread.cu).

    python bench/planner_latency.py            # (a) E=640, EP 8..128 (8 ranks per domain); (b) EP=32, E 40..640

Besides the full plan it replays variants that leave stages out (the refinement; the refinement and the route;
everything but the launch), so that the time of each stage, launch included, is visible; their plans are not
the policy's and are only timed.

Fig. 10-style skewed workload (megatron's biased router, router_skew -2.5, top-8), 2 slots. GPU times:
median over 200 runs after 20 warm-ups, CUDA events. Writes results/planner_latency.{md,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, command, cuda_ms, markdown_table, parse_options, run_info, write_json  # noqa: E402
from topoep import Topology, solve  # noqa: E402
from topoep.plan import default_main_rank  # noqa: E402
from topoep.planners.cuda import CudaPlanner  # noqa: E402
from topoep.runtime.moe import PEER_CANDIDATES  # noqa: E402
from topoep.workloads import biased_routing  # noqa: E402


def workload(ep: int, experts: int, tokens: int = 1024, rpd: int = 8) -> tuple[Topology, torch.Tensor]:
    """The latency workload (module docstring; also bench/joint_work.py's and tools/planner_ncu.sh's): EP ranks
    in domains of rpd, and the CPU counts of the biased router at router_skew -2.5, top-8."""
    topo = Topology(num_domains=max(1, ep // rpd), ranks_per_domain=min(rpd, ep))
    return topo, biased_routing(ep, experts, tokens, 8, -2.5, seed=13)


BUSY_CYCLES = 400_000  # about 200 us of GPU spin ahead of each busy-stream sample


def _events_median(fn, runs: int, warmup: int, busy: bool = False) -> float:
    """Median time (us) between CUDA events around fn(). Idle stream: the GPU waits for the host to submit
    the work, so the host's launch latency counts. Busy stream: a GPU spin is queued first, so the work is
    already queued when the first event fires and only its time on the GPU counts (as in a training step,
    where the host runs ahead of the GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        if busy:
            torch.cuda._sleep(BUSY_CYCLES)
        times.append(cuda_ms(fn) * 1e3)  # us
    return statistics.median(times)


def _captured(planner: CudaPlanner, omega, topo, policy: str, slots: int, grid_blocks: int = 0,
              skip_stages: int = 0):
    """(a CUDA graph of one plan of `policy` with the planner's grid_blocks and skip_stages (CudaPlanner.plan), the
    plan call's positional arguments: omega, topology, policy, expert and token bytes, the slot_expert and route
    buffers the graph writes). Warmed up on a side stream first."""
    ep, experts = omega.shape
    se = torch.empty(ep, slots, dtype=torch.int64, device="cuda")
    rt = torch.empty(ep, experts + ep * slots, dtype=torch.int64, device="cuda")
    args = (omega, topo, policy, 9_437_184, 4096, se, rt)
    settings = dict(grid_blocks=grid_blocks, skip_stages=skip_stages)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        planner.plan(*args, **settings)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        planner.plan(*args, **settings)
    return graph, args


def measure(ep: int, experts: int, slots: int, rpd: int, runs: int, warmup: int, tokens: int,
            plan_domain: int | None = None) -> dict:
    topo, omega_cpu = workload(ep, experts, tokens, rpd)
    topo = topo.planning_groups(plan_domain)  # what `solve(..., plan_domain=...)` plans on
    omega = omega_cpu.cuda()
    eager_fn = lambda: solve(omega, topo, num_slots=slots, backend="cuda")  # noqa: E731
    eager = _events_median(eager_fn, runs, warmup)
    eager_busy = _events_median(eager_fn, runs, warmup, busy=True)
    planner = CudaPlanner(ep, experts, topo.num_domains, slots, "cuda")
    graph, args = _captured(planner, omega, topo, "topoep", slots)
    se, rt = args[-2:]
    graphed = _events_median(graph.replay, runs, warmup)
    graphed_busy = _events_median(graph.replay, runs, warmup, busy=True)
    phases = _phase_medians(planner.phase_ns, graph, runs)
    refine = planner.refine_profile(*args[:2], *args[3:5])  # omega, topology, expert and token bytes
    variants = {}
    for name, mask in VARIANTS.items():  # each variant is its own graph: the skip mask is a kernel argument
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            # its own outputs: se, rt hold the checked plan
            planner.plan(*args[:5], se.clone(), rt.clone(), skip_stages=mask)
        variants[name] = _events_median(g.replay, runs, warmup, busy=True)
    cpu_times = []
    for _ in range(5):
        t0 = time.perf_counter()
        ref = solve(omega_cpu, topo, num_slots=slots, backend="reference")
        cpu_times.append(time.perf_counter() - t0)
    assert torch.equal(ref.slot_expert, se.cpu()) and torch.equal(ref.route, rt.cpu()), "CUDA plan != reference"
    plus = measure_plus(omega, omega_cpu, topo, slots, planner, runs, warmup)
    return dict(**plus, ep=ep, experts=experts, slots=slots, domains=topo.num_domains, eager_us=eager, graph_us=graphed,
                eager_busy_us=eager_busy, graph_busy_us=graphed_busy,
                reference_ms=1e3 * statistics.median(cpu_times), device=torch.cuda.get_device_name(0),
                phases_us=phases, refine_domain0=refine, variants_graph_us=variants,
                refine_iters=list(ref.info.get("refine_iters", [])))


def measure_plus(omega, omega_cpu, topo, slots: int, planner: CudaPlanner, runs: int, warmup: int) -> dict:
    """topoep_plus (topoep, then free moves and the own-rank-first route): eager solve, graph replay on an idle
    and a busy stream, the reference's time, and its plan checked against the reference's."""
    eager = _events_median(lambda: solve(omega, topo, num_slots=slots, policy="topoep_plus", backend="cuda"), runs,
                           warmup)
    graph, args = _captured(planner, omega, topo, "topoep_plus", slots)
    se, rt = args[-2:]
    graphed = _events_median(graph.replay, runs, warmup)
    graphed_busy = _events_median(graph.replay, runs, warmup, busy=True)
    phases = _phase_medians(planner.plus_phase_ns, graph, runs)
    t0 = time.perf_counter()
    ref = solve(omega_cpu, topo, num_slots=slots, policy="topoep_plus", backend="reference")
    ref_ms = 1e3 * (time.perf_counter() - t0)
    assert torch.equal(ref.slot_expert, se.cpu()) and torch.equal(ref.route, rt.cpu()), "topoep_plus CUDA plan != reference"
    pair_busy = _set_graph_busy(omega, topo, slots, PAIR, runs, warmup)
    return dict(plus_eager_us=eager, plus_graph_us=graphed, plus_graph_busy_us=graphed_busy, plus_reference_ms=ref_ms,
                pair_graph_busy_us=pair_busy,
                plus_moves=planner.moves(), plus_phases_us=phases,
                grid_us=grid_sweeps(planner, omega, omega_cpu, topo, slots, runs, warmup, ref))


PAIR = ("topoep_plus", "topoep_plus_local")  # what a guarded topoep_plus layer plans
SPREAD = ("topoep_plus_spread", "topoep_plus_spread_tree")  # and with LayerConfig.plus_spread (and relay trees)


def measure_spread(ep: int, experts: int, slots: int, rpd: int, runs: int, warmup: int, tokens: int) -> dict:
    """The spread candidates alone, the pair, and the four plans at once (graph replay on a busy stream), every plan
    checked against the reference's; and the moves the greedy made."""
    topo, omega_cpu = workload(ep, experts, tokens, rpd)
    omega = omega_cpu.cuda()
    every, every_moves = _spread_alone(omega, topo, slots, runs, warmup, move_cost_fs=0)
    fixed, _ = _spread_alone(omega, topo, slots, runs, warmup, max_moves=0)
    return dict(ep=ep, experts=experts, slots=slots, domains=topo.num_domains,
                spread_graph_busy_us={n: _set_graph_busy(omega, topo, slots, (n,), runs, warmup) for n in SPREAD},
                spread_moves={n: _spread_moves(omega_cpu, topo, slots, n) for n in SPREAD},
                pair_graph_busy_us=_set_graph_busy(omega, topo, slots, PAIR, runs, warmup),
                spread_set_graph_busy_us=_set_graph_busy(omega, topo, slots, PAIR + SPREAD, runs, warmup),
                spread_fixed_us=fixed, spread_every_us=every, spread_every_moves=every_moves,
                spread_move_us=(every - fixed) / every_moves if every_moves else float("nan"))


def _spread_moves(omega_cpu, topo, slots: int, policy: str, **kw) -> int:
    """The moves the spread greedy makes on this workload (the reference's count; the GPU's is equal)."""
    from topoep.planners.spread import solve_topoep_plus_spread

    return solve_topoep_plus_spread(omega_cpu, topo, num_slots=slots, main_rank=default_main_rank(*omega_cpu.shape[::-1]),
                                    expert_bytes=9_437_184, token_bytes=4096,
                                    trees=policy == "topoep_plus_spread_tree", **kw).info["greedy_moves"]


def _spread_alone(omega, topo, slots: int, runs: int, warmup: int, **kw) -> tuple[float, int]:
    """topoep_plus_spread with the greedy's max_moves or move_cost_fs as given (graph replay on a busy stream, us),
    its plan checked against the reference's with the same arguments, and the moves it made: the planner's fixed part
    (max_moves=0) and its time per move (move_cost_fs=0: every move that gains anything)."""
    from topoep.planners.cuda import solve_spread_cuda
    from topoep.planners.spread import solve_topoep_plus_spread

    main_rank = default_main_rank(omega.shape[1], omega.shape[0], device=omega.device)
    args = dict(num_slots=slots, main_rank=main_rank, expert_bytes=9_437_184, token_bytes=4096)
    solve_spread_cuda(omega, topo, policy="topoep_plus_spread", **args, **kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = solve_spread_cuda(omega, topo, policy="topoep_plus_spread", **args, **kw)
    graph.replay()
    ref = solve_topoep_plus_spread(omega.cpu(), topo, **(args | {"main_rank": main_rank.cpu()}), **kw)
    assert torch.equal(ref.route, plan.route.cpu()) and torch.equal(ref.slot_expert, plan.slot_expert.cpu()), kw
    return _events_median(graph.replay, runs, warmup, busy=True), ref.info["greedy_moves"]


def _set_graph_busy(omega, topo, slots: int, names: tuple[str, ...], runs: int, warmup: int) -> float:
    """Graph replay on a busy stream (us) of the plans `names` at the same time, each on a stream of its own
    (`topoep.planners.plan_concurrently`), every plan checked against the reference's."""
    from topoep.planners import plan_concurrently

    kw = dict(num_slots=slots, expert_bytes=9_437_184, token_bytes=4096)
    plan_concurrently(omega, topo, names, kw)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plans = plan_concurrently(omega, topo, names, kw)
    graph.replay()
    for p, name in zip(plans, names):
        ref = solve(omega.cpu(), topo, policy=name, backend="reference", **kw)
        assert torch.equal(ref.route, p.route.cpu()) and torch.equal(ref.slot_expert, p.slot_expert.cpu()), name
    return _events_median(graph.replay, runs, warmup, busy=True)


# the plans of the grid table beside the two policies' defaults: (name, policy, csrc/planner.h tuning bits):
# topoep_plus's route pass A forced to one path (kRouteSerial, kRouteLanes), and topoep without its one-block
# plan (kNoLocal; only one-domain topoep plans of at most 16384 (source, instance) pairs have one)
FORCED = [("topoep_plus, pass A serial", "topoep_plus", 32), ("topoep_plus, pass A lanes", "topoep_plus", 64),
          ("topoep, no one-block plan", "topoep", 128)]


def grid_sweeps(planner: CudaPlanner, omega, omega_cpu, topo, slots: int, runs: int, warmup: int, plus_ref) -> dict:
    """grid_sweep of topoep and topoep_plus, and of the FORCED variants (the no-one-block rows only where the
    default is a one-block plan)."""
    refs = {"topoep": solve(omega_cpu, topo, num_slots=slots, backend="reference"), "topoep_plus": plus_ref}
    out = {pol: grid_sweep(planner, omega, topo, pol, slots, runs, warmup, ref) for pol, ref in refs.items()}
    one_block = topo.num_domains == 1 and omega.shape[0] * (omega.shape[1] + omega.shape[0] * slots) <= 16384
    for name, pol, mask in FORCED:
        if mask == 128 and not one_block:
            continue
        out[name] = grid_sweep(planner, omega, topo, pol, slots, runs, warmup, refs[pol], skip_stages=mask)
    return out


GRID_BLOCKS = (16, 32, 64, 132)  # multi-block grids tried beside the default (at most one block per SM)


def grid_sweep(planner: CudaPlanner, omega, topo, policy: str, slots: int, runs: int, warmup: int, ref,
               skip_stages: int = 0) -> dict:
    """Graph replay on a busy stream (us) of `policy` with the planner's grid set to each of GRID_BLOCKS
    (CudaPlanner.plan's grid_blocks; one-block plans keep their one block), and with `skip_stages` (a tuning bit of
    FORCED, or 0); every plan checked against the reference's. The key "default" is the planner's own choice."""
    out = {}
    for blocks in (0,) + GRID_BLOCKS:
        graph, args = _captured(planner, omega, topo, policy, slots, grid_blocks=blocks, skip_stages=skip_stages)
        se, rt = args[-2:]
        out["default" if blocks == 0 else str(blocks)] = _events_median(graph.replay, runs, warmup, busy=True)
        assert torch.equal(ref.slot_expert, se.cpu()) and torch.equal(ref.route, rt.cpu()), \
            f"{policy} CUDA plan with {blocks} blocks != reference"
    return out


def grid_table(rows: list[dict]) -> str:
    """The planner's time against the size of its cooperative grid."""
    names = list(rows[0]["grid_us"]["topoep"])
    return ("\n## Grid size\n\nGraph replay on a busy stream (us, median as above) with the planner's grid set to "
            "a number of blocks (`CudaPlanner.plan(..., grid_blocks=n)`, at most one per SM; a one-block plan keeps "
            "its single block), beside the default choice; topoep_plus with its route's pass A forced to a thread "
            "per (expert, domain) group or to a lane group per group; and, where topoep's default is a one-block "
            "plan, topoep on a grid instead (topoep_plus always plans on a grid). Every plan equals the "
            "reference's.\n\n" + markdown_table(
                ["sweep", "EP", "experts", "policy"] + [f"{n} blocks" if n != "default" else "default" for n in names],
                [[r["sweep"], r["ep"], r["experts"], pol] + [f"{r['grid_us'][pol][n]:.1f}" for n in names]
                 for r in rows for pol in r["grid_us"]]) + "\n")


def plus_table(rows: list[dict]) -> str:
    return ("\n## topoep_plus\n\n`topoep` followed by the free moves across the EP group and the own-rank-first "
            "route (`topoep/planners/plus.py`; csrc/planner_kernel.cu phases 7-9), same workload and timing; every "
            "plan equals the reference's. With its local plan: the pair a guarded topoep_plus layer plans, "
            "topoep_plus and topoep_plus_local on two streams at once (`topoep.planners.plan_concurrently`).\n\n" + markdown_table(
                ["sweep", "EP", "experts", "topoep graph, busy us", "topoep_plus eager us", "topoep_plus graph us",
                 "topoep_plus graph, busy us", "extra over topoep us", "with its local plan, graph, busy us", "moves",
                 "reference ms"],
                [[r["sweep"], r["ep"], r["experts"], f"{r['graph_busy_us']:.1f}", f"{r['plus_eager_us']:.1f}",
                  f"{r['plus_graph_us']:.1f}", f"{r['plus_graph_busy_us']:.1f}",
                  f"{r['plus_graph_busy_us'] - r['graph_busy_us']:+.1f}", f"{r['pair_graph_busy_us']:.1f}",
                  r["plus_moves"], f"{r['plus_reference_ms']:.1f}"]
                 for r in rows]) + "\n\nGPU time after the refinement (us, median of 50 graph replays, %globaltimer "
            "stamps of block 0; `CudaPlanner.plus_phase_ns`): the staging of the loads and the guard; the free moves "
            "(every block makes the same moves on its own copy of the loads): the first iteration's busiest rank, its "
            "best move (pair scan and block reduction), the iterations after it; the route's pass A (per (expert, "
            "domain) group, and the grid barrier after it) and pass B (a thread per (source, instance); its end is "
            "the latest block's):\n\n" + markdown_table(
                ["sweep", "EP", "experts"] + list(rows[0]["plus_phases_us"]),
                [[r["sweep"], r["ep"], r["experts"]] + [f"{v:.1f}" for v in r["plus_phases_us"].values()]
                 for r in rows]) + "\n")


def spread_table(rows: list[dict]) -> str:
    """The spread planner (csrc/spread.cu) alone, and the four plans of a guarded topoep_plus layer with
    plus_spread and relay trees at once; graph replay on a busy stream ("" for rows without them)."""
    rows = [r for r in rows if "spread_graph_busy_us" in r]
    if not rows:
        return ""
    return ("\n\nThe spread candidates (`topoep.planners.spread`, csrc/spread.cu: the greedy's chain of moves in one "
            "block of 512 threads, then the route in a grid of warps; LayerConfig.plus_spread), alone and with the pair, four plans on four streams at once "
            "(what a guarded topoep_plus layer with plus_spread and relay trees plans); graph replay on a busy "
            "stream, every plan equal to the reference's:\n\n" + markdown_table(
                ["sweep", "EP", "experts", "topoep_plus_spread us", "moves", "topoep_plus_spread_tree us", "moves",
                 "with its local plan us", "all four at once us"],
                [[r["sweep"], r["ep"], r["experts"]]
                 + [x for n in SPREAD for x in (f"{r['spread_graph_busy_us'][n]:.1f}", r["spread_moves"][n])]
                 + [f"{r['pair_graph_busy_us']:.1f}", f"{r['spread_set_graph_busy_us']:.1f}"]
                 for r in rows])
            + "\n\nThe greedy's cost per move: topoep_plus_spread with max_moves=0 (its fixed part: the greedy's state, "
            "the rollback, the route) and with move_cost_fs=0 (every move that gains anything: the default stops once "
            "no move gains more than `spread.MOVE_COST_US`), graph replay on a busy stream, each plan equal to the "
            "reference's with the same arguments; us per move = (every move - fixed) / its moves:\n\n" + markdown_table(
                ["sweep", "EP", "experts", "fixed part us", "every move us", "moves", "us per move"],
                [[r["sweep"], r["ep"], r["experts"], f"{r['spread_fixed_us']:.1f}", f"{r['spread_every_us']:.1f}",
                  r["spread_every_moves"], f"{r['spread_move_us']:.2f}"] for r in rows if "spread_fixed_us" in r]))


# graph replay of the planner with stages left out (csrc/planner.h kSkip*)
VARIANTS = {"without refine": 1, "without refine and route": 3, "launch only": 4}
TARGETS = {(8, 640): 15.0, (128, 640): 50.0}  # us, one H200 (the targets)


def variant_table(rows: list[dict]) -> str:
    """Graph-replay time of the full plan and of the variants that leave stages out."""
    names = list(VARIANTS)
    table = markdown_table(["sweep", "EP", "experts", "full"] + names,
                           [[r["sweep"], r["ep"], r["experts"], f"{r['graph_busy_us']:.1f}"]
                            + [f"{r['variants_graph_us'][n]:.1f}" for n in names] for r in rows])
    return ("\n## Variants that leave a stage out\n\nCUDA-graph replay on a busy stream (us, median as above) of the "
            "same planner kernel with stages skipped (`CudaPlanner.plan(..., skip_stages=mask)`): the refinement (the "
            "stage-1/2 plan is routed), the refinement and the route, everything (the launch and an empty kernel). "
            "Their plans are not the policy's; they only show what each stage costs.\n\n" + table + "\n")


def target_table(rows: list[dict]) -> str:
    """The issue's latency targets against the full plan and the plan without its refinement."""
    out = []
    for r in rows:
        t = TARGETS.get((r["ep"], r["experts"]))
        if t is None or r["sweep"] != "a":
            continue
        best = min(r["eager_us"], r["graph_us"], r["eager_busy_us"], r["graph_busy_us"])
        nr = r["variants_graph_us"]["without refine"]
        out.append([r["ep"], r["experts"], f"{t:.0f}", f"{r['eager_us']:.1f}", f"{r['graph_us']:.1f}",
                    f"{r['eager_busy_us']:.1f}", f"{r['graph_busy_us']:.1f}", "yes" if best <= t else "no", f"{nr:.1f}",
                    "yes" if nr <= t else "no"])
    return ("\n## Against the targets\n\n" + markdown_table(
        ["EP", "experts", "target us", "eager us", "graph us", "eager, busy stream us", "graph, busy stream us", "met",
         "graph without refine, busy stream us", "met without refine"], out) + "\n")


def _phase_medians(read, graph, runs: int) -> dict[str, float]:
    """Median GPU time of each planner phase (us) over graph replays, from the kernel's own %globaltimer stamps
    as `read()` returns them in ns (CudaPlanner.phase_ns, or plus_phase_ns for topoep_plus's own phases)."""
    samples = []
    for _ in range(min(runs, 50)):
        graph.replay()
        samples.append(read())
    return {k: statistics.median(s[k] for s in samples) / 1e3 for k in samples[0]}


def kernel_breakdown(slots: int, tokens: int) -> str:
    """GPU time per planner kernel for EP 8 and EP 128 (E 640), from torch.profiler over 50 solves."""
    from torch.profiler import ProfilerActivity, profile

    out = ["\n## Where the time goes (GPU time per kernel, us per solve)\n"]
    for ep in (8, 128):
        topo, omega = workload(ep, 640, tokens)
        omega = omega.cuda()
        for _ in range(5):
            solve(omega, topo, num_slots=slots, backend="cuda")
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                solve(omega, topo, num_slots=slots, backend="cuda")
            torch.cuda.synchronize()
        rows = [(e.key, e.device_time_total / 50) for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(key=lambda r: -r[1])
        out.append(f"EP {ep}, E 640: " + ", ".join(f"{k.split('(')[0].replace('topoep::', '')} {v:.1f}"
                                                    for k, v in rows[:9]) + "\n")
    return "\n".join(out)


def refine_iters_table(rows: list[dict]) -> str:
    """Per plan: the slowest domain's refinement iterations and which domain that is, and the total."""
    body = []
    for r in rows:
        it = r.get("refine_iters") or [0]
        slowest = max(range(len(it)), key=lambda m: (it[m], -m))
        body.append([r["sweep"], r["ep"], r["experts"], len(it), it[slowest], slowest, sum(it)])
    return markdown_table(["sweep", "EP", "experts", "domains", "most iterations", "in domain", "all domains"], body)


def phase_table(rows: list[dict]) -> str:
    """Where the time goes: the planner kernel's phases (graph replay, median us)."""
    names = list(rows[0]["phases_us"])
    table = markdown_table(["sweep", "EP", "experts"] + names + ["sum"],
                           [[r["sweep"], r["ep"], r["experts"]] + [f"{r['phases_us'][n]:.1f}" for n in names]
                            + [f"{sum(r['phases_us'].values()):.1f}"] for r in rows])
    counters = list(rows[0]["refine_domain0"])
    table2 = markdown_table(["sweep", "EP", "experts"] + counters + ["cycles per iteration"],
                            [[r["sweep"], r["ep"], r["experts"]] + [r["refine_domain0"][c] for c in counters]
                             + [f"{r['refine_domain0']['loop_cycles'] / max(1, r['refine_domain0']['iterations']):.0f}"]
                             for r in rows])
    table += ("\nRefinement of domain 0 (SM cycles counted by its warp's lane 0, last replay):\n\n" + table2)
    table += ("\nRefinement iterations per domain (the CPU reference's `info[\"refine_iters\"]`; domains refine in "
              "parallel, so the slowest one sets the phase's time):\n\n" + refine_iters_table(rows))
    return ("\n## Where the time goes\n\nGPU time of each phase of the planner kernel (us, median over 50 graph "
            "replays, from %globaltimer stamps block 0 writes after each grid barrier; the route phase, which "
            "no barrier follows, ends at the latest block's stamp). The rest of the graph time is the "
            "launch.\n\n" + table + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per rank of the generated workload")
    ap.add_argument("--out", type=Path, default=REPO / "results")
    ap.add_argument("--rpd", type=int, default=8,
                    help="ranks per NVLink domain; at least the EP size: one domain (GB200 NVL72). Other than 8: "
                         "sweep (a) only, over --eps, written as --name")
    ap.add_argument("--eps", type=int, nargs="+", default=[8, 16, 32, 64, 128], help="sweep (a)'s EP sizes")
    ap.add_argument("--plan-domain", type=int, default=0,
                    help="plan each domain as groups of at most this many ranks (LayerConfig.plan_domain; sweep (a) "
                         "only, written as --name); 0 (default): whole domains")
    ap.add_argument("--name", default="planner_latency")
    ap.add_argument("--profile", action="store_true", help="add a per-kernel time breakdown (torch.profiler)")
    ap.add_argument("--spread", action="store_true", help="only the spread candidates (csrc/spread.cu), EP 8-128 at "
                    "E 640: writes spread_latency.{md,json}")
    ap.add_argument("--peers", action="store_true", help="only the peers' planners (csrc/peers.cu: flexmoe, deepseek) "
                    "alone and with topoep_plus's pair, EP 8-128 at E 640 and EP 16-256 at 8 experts per rank: writes "
                    "peer_latency.{md,json}")
    args = parse_options(ap, argv)
    if not torch.cuda.is_available():
        raise SystemExit("planner_latency needs a GPU")
    torch.set_num_threads(4)
    if args.spread:
        return spread_main(args)
    if args.peers:
        return peers_main(args)
    # (b): the paper uses E = 40 and 80 at EP 32; TopoEP (like megatron) needs E to be a multiple of EP, so
    # those two points become 64 and 96
    if args.rpd < 1 or any(ep < 1 or 640 % ep or (ep > args.rpd and ep % args.rpd) for ep in args.eps):
        raise SystemExit(f"--eps must divide 640 experts and --rpd (>= 1) must divide every EP size above it, got "
                         f"--eps {args.eps} --rpd {args.rpd}")
    configs = [("a", ep, 640) for ep in args.eps]
    if args.plan_domain < 0:
        raise SystemExit(f"--plan-domain must be >= 1, or 0 for whole domains, got {args.plan_domain}")
    if args.rpd == 8 and not args.plan_domain:
        configs += [("b", 32, e) for e in (64, 96, 160, 320, 640)]
    rows = []
    for sweep, ep, e in configs:
        r = measure(ep, e, args.slots, args.rpd, args.runs, args.warmup, args.tokens, args.plan_domain or None)
        r["sweep"] = sweep
        rows.append(r)
        print(f"({sweep}) EP {ep:>3} E {e:>4}: eager {r['eager_us']:8.1f} us  graph {r['graph_us']:8.1f} us  "
              f"busy: eager {r['eager_busy_us']:.1f} graph {r['graph_busy_us']:.1f}  "
              f"reference {r['reference_ms']:8.2f} ms  topoep_plus graph busy {r['plus_graph_busy_us']:.1f}  "
              + "  ".join(f"{k} {v:.1f}" for k, v in
                                                                      r["variants_graph_us"].items()), flush=True)
    breakdown = (target_table(rows) + plus_table(rows) + grid_table(rows) + variant_table(rows) + phase_table(rows)
                 + (kernel_breakdown(args.slots, args.tokens) if args.profile else ""))
    info = run_info(vars(args) | {"out": str(args.out)})
    paper = {(8, 640): 131, (128, 640): 510}
    table = markdown_table(["sweep", "EP", "experts", "domains", "slots", "eager us", "graph us",
                            "eager, busy stream us", "graph, busy stream us", "CPU reference ms", "paper (H800) us"],
                           [[r["sweep"], r["ep"], r["experts"], r["domains"], r["slots"], f"{r['eager_us']:.1f}",
                             f"{r['graph_us']:.1f}", f"{r['eager_busy_us']:.1f}", f"{r['graph_busy_us']:.1f}",
                             f"{r['reference_ms']:.2f}", paper.get((r["ep"], r["experts"]), "")] for r in rows])
    md = (f"# Planner latency (paper Fig. 11)\n\n- date: {info['date']}; commit: `{info['commit']}`; "
          f"hardware: {info['hardware']}\n- workload: biased router, router_skew -2.5, top-8, {args.tokens} tokens "
          f"per rank, {args.rpd} ranks per domain (at most the EP size)"
          + (f", planned as groups of at most {args.plan_domain} ranks (`Topology.planning_groups`, as "
             "LayerConfig.plan_domain plans)" if args.plan_domain else "") + f", {args.slots} slots; median of {args.runs} runs after {args.warmup} "
          "warm-ups (CUDA events). eager = the whole `topoep.solve(..., backend='cuda')` call; graph = the planner "
          "replayed from a CUDA graph. Idle stream: events around one call on an idle GPU (the host's launch latency "
          "counts); busy stream: a GPU spin is queued ahead, so only the time on the GPU counts, as in a training "
          "step whose host runs ahead. Every measured plan equals the CPU reference plan.\n- reproduce: "
          f"`{command('planner_latency.py', args.argv)}`\n\n" + table + "\n" + breakdown)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(md)
    write_json(args.out / f"{args.name}.json", info, rows)
    print(md)
    return 0


def spread_main(args) -> int:
    rows = []
    for ep in (8, 16, 32, 64, 128):
        r = measure_spread(ep, 640, args.slots, 8, args.runs, args.warmup, args.tokens) | {"sweep": "a"}
        rows.append(r)
        print(f"EP {ep:>3}: " + "  ".join(f"{n} {v:.1f} us" for n, v in r["spread_graph_busy_us"].items())
              + f"  all four {r['spread_set_graph_busy_us']:.1f} us", flush=True)
    info = run_info(vars(args) | {"out": str(args.out)})
    md = (f"# Spread planner latency\n\n- date: {info['date']}; commit: `{info['commit']}`; hardware: "
          f"{info['hardware']}\n- workload: Fig. 11's (biased router, router_skew -2.5, top-8, {args.tokens} tokens "
          f"per rank, 8 ranks per domain, E 640), {args.slots} slots; median of {args.runs} runs after {args.warmup} "
          "warm-ups (CUDA events)\n- reproduce: "
          f"`{command('planner_latency.py', args.argv)}`" + spread_table(rows) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "spread_latency.md").write_text(md)
    write_json(args.out / "spread_latency.json", info, rows)
    print(md)
    return 0


PEERS = PEER_CANDIDATES  # LayerConfig.plus_peers' candidates, in the layer's order


def measure_peers(ep: int, experts: int, slots: int, scen: str, runs: int, warmup: int, tokens: int) -> dict:
    """The peers' planners alone and the four plans of a guarded topoep_plus layer with plus_peers at once (graph
    replay on a busy stream), every plan checked against the reference's; and flexmoe's steps. scen: "fig11" (the
    latency workload) or a `topoep.workloads` scenario."""
    from topoep.workloads import scenario

    if scen == "fig11":
        topo, omega_cpu = workload(ep, experts, tokens, 8)
    else:
        topo = Topology(num_domains=max(1, ep // 8), ranks_per_domain=min(8, ep))
        omega_cpu = scenario(scen, ep, experts, tokens, 8, ranks_per_domain=min(8, ep), seed=13)
    omega = omega_cpu.cuda()
    steps = solve(omega_cpu, topo, num_slots=slots, policy="flexmoe", backend="reference").info["steps"]
    return dict(ep=ep, experts=experts, slots=slots, scenario=scen, domains=topo.num_domains, flexmoe_steps=steps,
                peer_graph_busy_us={n: _set_graph_busy(omega, topo, slots, (n,), runs, warmup) for n in PEERS},
                pair_graph_busy_us=_set_graph_busy(omega, topo, slots, PAIR, runs, warmup),
                peer_set_graph_busy_us=_set_graph_busy(omega, topo, slots, PAIR + PEERS, runs, warmup))


def peers_main(args) -> int:
    rows = []
    configs = ([(ep, 640, args.slots, "fig11") for ep in (8, 16, 32, 64, 128)]
               + [(ep, 8 * ep, n, "hot_domain") for ep in (16, 32, 64, 128, 256) for n in (2, 4)])
    for ep, e, n, scen in configs:
        r = measure_peers(ep, e, n, scen, args.runs, args.warmup, args.tokens)
        rows.append(r)
        print(f"{scen} EP {ep:>3} E {e:>4} slots {n}: " + "  ".join(f"{k} {v:.1f} us" for k, v in
                                                                     r["peer_graph_busy_us"].items())
              + f"  pair {r['pair_graph_busy_us']:.1f}  all four {r['peer_set_graph_busy_us']:.1f} us", flush=True)
    info = run_info(vars(args) | {"out": str(args.out)})
    table = markdown_table(
        ["workload", "EP", "experts", "slots", "flexmoe us", "flexmoe steps", "deepseek us", "topoep_plus + local us",
         "all four at once us"],
        [[r["scenario"], r["ep"], r["experts"], r["slots"], f"{r['peer_graph_busy_us']['flexmoe']:.1f}",
          r["flexmoe_steps"], f"{r['peer_graph_busy_us']['deepseek']:.1f}", f"{r['pair_graph_busy_us']:.1f}",
          f"{r['peer_set_graph_busy_us']:.1f}"] for r in rows])
    md = (f"# The peers' planners' latency\n\n- date: {info['date']}; commit: `{info['commit']}`; hardware: "
          f"{info['hardware']}\n- workloads: fig11 (Fig. 11's: biased router, router_skew -2.5, top-8, E 640, "
          f"{args.slots} slots) and hot_domain (`topoep.workloads`, 8 experts per rank: flexmoe's most steps); "
          f"{args.tokens} tokens per rank, 8 ranks per domain; median of {args.runs} graph replays on a busy stream "
          f"after {args.warmup} warm-ups (CUDA events), every plan equal to the reference's\n- flexmoe, deepseek: "
          "csrc/peers.cu alone; all four at once: topoep_plus, topoep_plus_local, flexmoe and deepseek on four "
          "streams (`plan_concurrently`: what a guarded topoep_plus layer with LayerConfig.plus_peers plans)\n"
          f"- reproduce: `{command('planner_latency.py', args.argv)}`\n\n" + table + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peer_latency.md").write_text(md)
    write_json(args.out / "peer_latency.json", info, rows)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
