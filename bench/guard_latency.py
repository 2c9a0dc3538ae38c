"""What the net-benefit guard adds to a layer call's metadata on one GPU, planning left out: its per-link prediction
of topoep_plus's plan and local candidate and the choice between them (`NetBenefitGuard.select`), without relays and
with `relay_fanout=2` (the relayed-or-direct choice per plan, then the relay trees the runtime executes:
`topoep.relay.relay_trees`). Each on both backends: the torch reference and the CUDA kernel (csrc/guard.cu,
`topoep.runtime.guard_cuda`, the layer's path on a GPU). Each replayed from a CUDA graph on a busy stream (its GPU
time alone), as the layer's metadata graph runs it.

Beside it, a guarded topoep_plus layer's whole decision as its metadata graph runs it: the pre-plan bound
(`NetBenefitGuard.worth_planning`), both planners at once (`plan_concurrently`, reading the bound's flag) and the
guard's selection (kernel; with relays also the trees): on uniform routing, where the bound leaves planning out and
the guard prices nothing (what a guarded layer adds to the static layer's metadata there), and on the workload;
and the decision of a call whose replica machinery backend cuda's slot hint left out (on uniform routing, every call
after the first `skip_lag`): the bound and the static plan only.

    python bench/guard_latency.py            # EP 8, 32, 128 (domains of 8), 640 experts, 2 slots
    python bench/guard_latency.py --eps 16 32 64 --rpd 64 --name guard_latency_one_domain   # one NVLink domain

On one domain (EP 8 at the default --rpd, every EP size at --rpd >= EP) the layer plans topoep_plus without its local
candidate (the same plan there: `topoep.runtime.moe.plus_policies`), and so does every chain here. With relays the executed
plan's trees come from the guard kernel's own launches (info["relay_trees"]), as in the layer without a capacity step.

The plans come from the CUDA planner on planner_latency.py's workload (megatron's biased router, skew -2.5, top-8).
Median over 200 replays after 20 warm-ups, CUDA events. Writes results/guard_latency.{md,json}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, command, markdown_table, parse_options, run_info, write_report  # noqa: E402
from bench.planner_latency import _events_median, workload  # noqa: E402
from topoep.metrics import DEFAULT_T_FFN  # noqa: E402
from topoep.plan import default_main_rank  # noqa: E402
from topoep.planners import plan_concurrently, solve  # noqa: E402
from topoep.relay import executed_sources  # noqa: E402
from topoep.runtime import guard_cuda  # noqa: E402
from topoep.runtime.guard import NetBenefitGuard, SpreadGate  # noqa: E402
from topoep.runtime.moe import plus_policies  # noqa: E402

# select with the local candidate; the same with relay_fanout=2 and the trees; each on the reference and the kernel
VARIANTS = ("guard", "guard_relay", "guard_cuda", "guard_relay_cuda")
# the whole decision of a guarded topoep_plus layer (kernels), on uniform routing (skipped) and on the workload
CHAINS = ("chain_skip", "chain_skip_relay", "chain_plan", "chain_plan_relay", "chain_hint", "chain_hint_relay")
# and chain_gate_off: a plus_spread layer's decision where its spread gate leaves the spread planner out
W_BYTES, S_BYTES = 3 * 2048 * 768 * 2, 2048 * 2


def _decide(variant: str, plan, local):
    """The variant's work: the guard's selection (and with relays the trees of the kept plan). local: the local
    candidate, or None (one domain: the layer plans topoep_plus alone)."""
    relay, cuda = "relay" in variant, variant.endswith("_cuda")
    guard = NetBenefitGuard(relay_fanout=2) if relay else NetBenefitGuard()
    executed = guard.select(plan, DEFAULT_T_FFN, 1, candidates=_others(local),
                            backend="cuda" if cuda else "reference")[0]
    return (executed.route, *_trees(executed)) if relay else (executed.route,)


def _others(*plans) -> tuple:
    """The guard's candidates beside topoep_plus's plan: those given, None left out."""
    return tuple(p for p in plans if p is not None)


def _bound(omega: torch.Tensor, topo, relay: bool = False):
    """A layer's guard (relay trees of 2 with `relay`) and its pre-plan bound's verdict on omega."""
    guard = NetBenefitGuard(relay_fanout=2) if relay else NetBenefitGuard()
    main_rank = default_main_rank(omega.shape[1], omega.shape[0], omega.device)
    return guard, guard.worth_planning(omega, topo, main_rank, DEFAULT_T_FFN, W_BYTES, 1)


def _trees(plan):
    """The executed plan's relay trees of 2, as the layer gets them: from the guard kernel's launches where it ran
    (info["relay_trees"]), else by the trees kernel on a GPU (the reference elsewhere)."""
    if "relay_trees" in plan.info:
        return tuple(plan.info["relay_trees"].unbind(0))
    return (guard_cuda.executed_sources if plan.route.is_cuda else executed_sources)(plan, 2)


def _chain(relay: bool, omega: torch.Tensor, topo, slots: int, pair: bool = False, separate: bool = False,
           plan_domain: int | None = None):
    """A guarded topoep_plus layer's decision (moe.py `_guarded_plan`, capacity step left out): the pre-plan bound,
    topoep_plus and topoep_plus_local at once (static where the bound says no; on one domain topoep_plus alone), the
    guard's selection, the trees. The baselines of the same run: `pair`, the local candidate planned and priced on one
    domain too; `separate`, the trees by their own kernel (as after a capacity step) instead of the guard's.
    plan_domain: the planners on groups of at most that many ranks of a domain (LayerConfig.plan_domain)."""
    guard, worth = _bound(omega, topo, relay)
    kw = dict(num_slots=slots, expert_bytes=W_BYTES, token_bytes=S_BYTES, t_ffn=DEFAULT_T_FFN, enable=worth,
              plan_domain=plan_domain)
    names = ("topoep_plus", "topoep_plus_local") if pair else plus_policies(topo, plan_domain=plan_domain)
    plan, *local = plan_concurrently(omega, topo, names, kw)
    executed = guard.select(plan, DEFAULT_T_FFN, 1, candidates=tuple(local), planned=worth)[0]  # kernel on a GPU
    if separate:
        executed.info.pop("relay_trees", None)
    return (executed.route, *_trees(executed)) if relay else (executed.route,)


def _gate_chain(gate, omega: torch.Tensor, topo, slots: int, plan_domain: int | None = None):
    """A guarded topoep_plus layer with plus_spread and its spread gate (moe.py `_guarded_plan`, guard.SpreadGate), on
    a call the gate leaves the spread planner out of: the bound, the gate's flag, topoep_plus, topoep_plus_local and
    the spread planner (which writes the static plan at once) at once, the guard's selection over the three, the
    gate's update."""
    guard, worth = _bound(omega, topo)
    run = gate.enable(worth)
    kw = dict(num_slots=slots, expert_bytes=W_BYTES, token_bytes=S_BYTES, t_ffn=DEFAULT_T_FFN, enable=worth,
              plan_domain=plan_domain)
    names = plus_policies(topo, spread=True, plan_domain=plan_domain)
    plan, *others = plan_concurrently(omega, topo, names, [kw] * (len(names) - 1) + [{**kw, "enable": run}])
    executed, fired, saved, cost = guard.select(plan, DEFAULT_T_FFN, 1, candidates=tuple(others), planned=worth)
    gate.record(worth, run, fired, saved, cost, executed.info["guard_choice"], len(names) - 1)
    return executed.route,


def _hint_chain(relay: bool, omega: torch.Tensor, topo, slots: int):
    """A call the slot hint left out (moe.py `_unplanned`): the pre-plan bound and the static plan (and with relays
    the static plan's trees: none)."""
    _, worth = _bound(omega, topo, relay)
    plan = solve(omega, topo, policy="static", num_slots=slots, expert_bytes=W_BYTES, token_bytes=S_BYTES)
    if relay:
        plan.info["relay"] = torch.zeros((), dtype=torch.bool, device=omega.device)
        return worth, plan.route, *_trees(plan)
    return worth, plan.route


def _floor(x: torch.Tensor):
    """One tiny kernel: what replaying any graph costs here (the guard runs inside the metadata graph, which a
    layer replays anyway)."""
    return x.add_(1),


def measure(ep: int, experts: int, slots: int, runs: int, warmup: int, rpd: int = 8,
            plan_domain: int | None = None) -> dict:
    topo, omega_cpu = workload(ep, experts, rpd=rpd)
    omega = omega_cpu.cuda()
    kw = dict(num_slots=slots, expert_bytes=W_BYTES, token_bytes=S_BYTES)
    plan = solve(omega, topo, policy="topoep_plus", **kw)
    local = solve(omega, topo, policy="topoep_plus_local", **kw) if topo.num_domains > 1 else None
    row = {"ep": ep, "experts": experts, "domains": topo.num_domains, "slots": slots}
    one = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _floor(one)
    row["floor_us"] = _events_median(graph.replay, runs, warmup, busy=True)
    uniform = torch.full_like(omega, int(omega.sum()) // omega.numel())
    guard = NetBenefitGuard()
    mr = default_main_rank(experts, ep, omega.device)
    if guard.worth_planning(uniform, topo, mr, DEFAULT_T_FFN, W_BYTES, 1).item():
        raise SystemExit(f"EP {ep}: the pre-plan bound plans uniform routing; the skipped chain would not be timed")
    row["workload_planned"] = bool(guard.worth_planning(omega, topo, mr, DEFAULT_T_FFN, W_BYTES, 1).item())
    works = {v: (lambda v=v: _decide(v, plan, local)) for v in VARIANTS}
    works.update({c: (lambda c=c: (_hint_chain if "hint" in c else _chain)(
        c.endswith("relay"), omega if "plan" in c else uniform, topo, slots,
        **({} if "hint" in c else {"plan_domain": plan_domain}))) for c in CHAINS})
    works["static_plan"] = lambda: (solve(uniform, topo, policy="static", **kw).route,)  # what the static layer runs
    gate = SpreadGate(probe=1 << 40, spread_s=1.0)  # off, and no probe in reach: the spread planner left out
    gate.enable(torch.ones((), dtype=torch.bool, device="cuda"))
    gate.state.copy_(torch.tensor([0.0, 0.0, float("nan"), float("nan")]))  # no probe since: never due in this run
    works["chain_gate_off"] = lambda: _gate_chain(gate, omega, topo, slots, plan_domain)
    # the same run's baselines: the trees by their own kernel; on one domain, the local candidate planned as well
    works["chain_plan_relay_separate"] = lambda: _chain(True, omega, topo, slots, separate=True)
    if topo.planning_groups(plan_domain) is not topo:  # the planners on whole domains (plan_domain null)
        works["chain_plan_whole"] = lambda: _chain(False, omega, topo, slots)
        works["chain_plan_relay_whole"] = lambda: _chain(True, omega, topo, slots)
    if topo.num_domains == 1:
        works["chain_plan_pair"] = lambda: _chain(False, omega, topo, slots, pair=True)
        works["chain_plan_relay_pair"] = lambda: _chain(True, omega, topo, slots, pair=True, separate=True)
    for variant, work in works.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm the caches (topologies on the device) outside the capture
            for _ in range(2):
                work()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            work()
        row[f"{variant}_us"] = _events_median(graph.replay, runs, warmup, busy=True)
    return row


def table(rows: list[dict]) -> str:
    return markdown_table(["EP", "domains", "experts", "slots", "guard, torch us", "guard, kernel us",
                           "guard + relays, torch us", "guard + relays, kernel us", "kernel / torch (guard + relays)",
                           "one-kernel graph us"],
                          [[r["ep"], r["domains"], r["experts"], r["slots"], f"{r['guard_us']:.1f}",
                            f"{r['guard_cuda_us']:.1f}", f"{r['guard_relay_us']:.1f}",
                            f"{r['guard_relay_cuda_us']:.1f}",
                            f"{r['guard_relay_cuda_us'] / r['guard_relay_us']:.3f}", f"{r['floor_us']:.1f}"]
                           for r in rows])


def chain_table(rows: list[dict]) -> str:
    return markdown_table(["EP", "uniform routing: bound + planners + guard us", "+ relays us",
                           "workload: bound + planners + guard us", "+ relays us",
                           "workload, plus_spread, spread gate off us", "workload planned",
                           "slot hint left out: bound + static plan us", "+ relays us", "static plan alone us"],
                          [[r["ep"], f"{r['chain_skip_us']:.1f}", f"{r['chain_skip_relay_us']:.1f}",
                            f"{r['chain_plan_us']:.1f}", f"{r['chain_plan_relay_us']:.1f}",
                            f"{r['chain_gate_off_us']:.1f}",
                            "yes" if r["workload_planned"] else "no", f"{r['chain_hint_us']:.1f}",
                            f"{r['chain_hint_relay_us']:.1f}", f"{r['static_plan_us']:.1f}"] for r in rows])


def baseline_table(rows: list[dict]) -> str:
    """The decision against the same run's baselines: the relayed chain with the trees from the guard's launches and
    with their own kernel; on one domain, topoep_plus alone and with its local candidate."""
    def us(r, key):
        return f"{r[key]:.1f}" if key in r else "-"

    def ratio(r, a, b):
        return f"{r[a] / r[b]:.3f}" if a in r and b in r else "-"

    return markdown_table(["EP", "domains", "+ relays: trees from the guard us", "trees by their own kernel us",
                           "ratio", "one domain: topoep_plus alone us", "with its local candidate us", "ratio",
                           "+ relays, alone us", "+ relays, with its local candidate (own trees kernel) us", "ratio"],
                          [[r["ep"], r["domains"], us(r, "chain_plan_relay_us"), us(r, "chain_plan_relay_separate_us"),
                            ratio(r, "chain_plan_relay_us", "chain_plan_relay_separate_us"), us(r, "chain_plan_us"),
                            us(r, "chain_plan_pair_us"), ratio(r, "chain_plan_us", "chain_plan_pair_us"),
                            us(r, "chain_plan_relay_us"), us(r, "chain_plan_relay_pair_us"),
                            ratio(r, "chain_plan_relay_us", "chain_plan_relay_pair_us")] for r in rows])


def groups_table(rows: list[dict]) -> str:
    """The decision with the planners on groups against the same run's decision on whole domains."""
    return markdown_table(["EP", "domains", "planned on groups us", "on whole domains us", "ratio",
                           "+ relays, on groups us", "on whole domains us", "ratio"],
                          [[r["ep"], r["domains"], f"{r['chain_plan_us']:.1f}", f"{r['chain_plan_whole_us']:.1f}",
                            f"{r['chain_plan_us'] / r['chain_plan_whole_us']:.3f}",
                            f"{r['chain_plan_relay_us']:.1f}", f"{r['chain_plan_relay_whole_us']:.1f}",
                            f"{r['chain_plan_relay_us'] / r['chain_plan_relay_whole_us']:.3f}"]
                           for r in rows if "chain_plan_whole_us" in r])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eps", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--experts", type=int, default=640)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--rpd", type=int, default=8,
                    help="ranks per NVLink domain (at least the EP size: one domain, as on GB200 NVL72, where the "
                         "layer plans topoep_plus without its local candidate)")
    ap.add_argument("--plan-domain", type=int, default=0,
                    help="the layer's planners on groups of at most this many ranks of a domain (LayerConfig.plan_domain), "
                         "with the same run's decision on whole domains beside it; 0 (default): whole domains")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--name", default="guard_latency")
    ap.add_argument("--out", type=Path, default=REPO / "results")
    args = parse_options(ap, argv)
    if any(ep < 1 or args.experts % ep for ep in args.eps):
        raise SystemExit(f"--eps must be positive divisors of --experts {args.experts}, got {args.eps}")
    if args.rpd < 1 or any(ep > args.rpd and ep % args.rpd for ep in args.eps):
        raise SystemExit(f"--rpd must be >= 1 and divide every EP size above it (or be at least the EP size: one "
                         f"domain), got --rpd {args.rpd} for --eps {args.eps}")
    if not torch.cuda.is_available():
        raise SystemExit("bench/guard_latency.py times CUDA graphs: run it on a machine with a GPU "
                         "(tools/gpu_session.sh planner)")
    if args.plan_domain < 0:
        raise SystemExit(f"--plan-domain must be >= 1, or 0 for whole domains, got {args.plan_domain}")
    rows = [measure(ep, args.experts, args.slots, args.runs, args.warmup, args.rpd, args.plan_domain or None)
            for ep in args.eps]
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    text = "\n".join([
        "# The net-benefit guard's time in a layer call's metadata, planning left out",
        "",
        f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']}",
        "- guard: `NetBenefitGuard.select` of topoep_plus's plan and its local candidate (per-link prediction of "
        "both, the static layer once; on one domain the plan alone, as the layer runs it there); guard + relays: the "
        "same with `relay_fanout=2` (relayed or direct fetch "
        "priced per plan) and the relay trees of the kept plan (`topoep.relay.executed_sources`). torch: the "
        "reference (backend='reference'); kernel: csrc/guard.cu (backend='cuda', the layer's path on a GPU; the same "
        f"results bit for bit). CUDA graph replay on a busy stream, median of {args.runs}; workload of "
        f"bench/planner_latency.py ({args.rpd} ranks per domain), {args.slots} slots; one-kernel graph: a graph of one "
        "tiny kernel timed the same way "
        "(what replaying any graph costs; the guard runs inside the metadata graph a layer replays anyway)",
        f"- reproduce: `{command('guard_latency.py', args.argv)}`",
        "",
        table(rows),
        "",
        "## A guarded topoep_plus layer's whole decision",
        "",
        "The pre-plan bound (`worth_planning`), topoep_plus and topoep_plus_local at once (`plan_concurrently`, the "
        "static plan where the bound says no; on one domain topoep_plus alone) and the guard's selection (kernel; + "
        "relays: relay_fanout=2 and the "
        "kept plan's trees), one CUDA graph on a busy stream. Uniform routing: the bound leaves planning out and the "
        "guard prices nothing, so this is what a guarded layer adds to the static layer's metadata there "
        "(`topoep_research.sim.GPU_DECISION_SKIP_US`). Slot hint left out: a call of backend cuda whose replica "
        "machinery the slot hint left out (on uniform routing every call after the first `skip_lag`) runs the bound "
        "and the static plan only; the static layer runs the static plan too (static plan alone), so the hint's call "
        "adds the difference to the static layer's metadata (`topoep_research.sim.GPU_DECISION_HINT_US`). "
        "plus_spread, spread gate off: the same decision of a layer with `plus_spread` on a call its spread gate "
        "leaves the spread planner out of (`topoep.runtime.guard.SpreadGate`: the gate's flag, the spread planner "
        "writing the static plan beside the other two, the guard over three plans, the gate's update): what the gate "
        "costs where the spread plans do not pay (`topoep_research.sim.GPU_SPREAD_GATE_US`).",
        "",
        chain_table(rows),
        "",
        "## Against the same run's baselines",
        "",
        "The planned chains above beside what they replace, in the same run: with relays, the executed plan's trees "
        "written by the guard kernel's own launches (`NetBenefitGuard.select`'s info[\"relay_trees\"]: the layer's "
        "path without a capacity step) against the trees kernel after the guard (`guard_cuda.executed_sources`: the "
        "path after a capacity step); on one domain, topoep_plus planned alone (the layer's `plus_policies`) against "
        "topoep_plus and topoep_plus_local at once (the same plan twice; with relays, with the trees kernel as well: "
        "the whole decision before both changes). Ratio: the first / the second.",
        "",
        baseline_table(rows),
        "",
    ] + ([
        f"## The planners on groups of at most {args.plan_domain} ranks (`--plan-domain`, LayerConfig.plan_domain)",
        "",
        "The planned chains above (topoep_plus and, with more than one group, its local plan on the groups; the bound "
        "and the guard on the real domains) against the same chains with the planners on whole domains, same run.",
        "",
        groups_table(rows),
        "",
    ] if args.plan_domain and any("chain_plan_whole_us" in r for r in rows) else []))
    write_report(args, text, rows)
    print(table(rows))
    print(chain_table(rows))
    print(baseline_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
