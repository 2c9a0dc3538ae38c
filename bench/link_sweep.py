"""Every policy on every routing scenario at cluster scale, in the simulator's per-link model (`topoep_research.sim`,
which reads `topoep.links`): the layer time of each policy, guarded, against static and against the balanced bound
(the static layer on perfectly balanced routing), and the cells where `topoep_plus` is not the fastest.

    python bench/link_sweep.py                       # writes results/link_sweep.{md,json}
    python bench/link_sweep.py --eps 16 --slots 2 --presets paper_h800 --scenarios warm_domain   # one cell

Workloads: `topoep.workloads.scenario` (SCENARIOS) with `--experts-per-rank` experts per rank, top-k and token count
of the model (Qwen3-30B-A3B's expert shape by default). Nothing here is measured: it is the simulator's prediction
(its NVLink and GEMM constants fitted on 2 x H200, its RDMA bandwidth taken from DeepEP's H800 numbers and never
measured here; `--nic-scale` reruns with the NIC bandwidth scaled).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, command, markdown_table, parse_options, run_info, write_report  # noqa: E402
from topoep import workloads  # noqa: E402
from topoep.runtime import NetBenefitGuard  # noqa: E402
from topoep_research import sim  # noqa: E402

POLICIES = ("static", "topoep", "topoep_plus", "deepseek", "fastermoe", "flexmoe")
RELAY = "topoep_plus_relay"  # topoep_plus's plans with their replica fetches down relay trees (topoep.relay)
SPREAD = "topoep_plus_spread"  # guarded topoep_plus with the link-aware spread candidate (topoep.planners.spread)
SPREAD_RELAY = "topoep_plus_spread_relay"  # the same with relay trees
# the topoep_plus layers: column -> (relay fanout, the candidates the guard chooses from besides topoep_plus's plan);
# the relay layers' fanout is --relay-fanout (2 here)
OURS = {"topoep_plus": (None, ("topoep_plus_local",)), RELAY: (2, ("topoep_plus_local",)),
        SPREAD: (None, ("topoep_plus_local", "topoep_plus_spread")),
        SPREAD_RELAY: (2, ("topoep_plus_local", "topoep_plus_spread", "topoep_plus_spread_tree"))}
# `--peer-candidates` (a what-if): guarded topoep_plus with the peers' plans as further candidates
PEER_LAYER, PEER_CANDIDATES = "topoep_plus_peers", ("topoep_plus_local", "flexmoe", "deepseek")
SHORT = {"topoep_plus_local": "local", "topoep_plus_spread": "spread", "topoep_plus_spread_tree": "tree"}
SENDS = ("nvlink", "nic", "nvlink_expert", "nic_expert")  # topoep.relay.sender_copies
PEERS = ("topoep", "deepseek", "fastermoe", "flexmoe")  # what topoep_plus must match (issue: within 1.01x the best)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["paper_h800", "h200", "gb200_nvl72"], choices=list(sim.CLUSTERS))
    ap.add_argument("--eps", type=int, nargs="+", default=[16, 32, 64],
                    help="EP sizes (128 and more: 10-20 s per cell on this CPU)")
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4], help="replica slots per rank")
    ap.add_argument("--scenarios", nargs="+", default=list(workloads.SCENARIOS), choices=list(workloads.SCENARIOS))
    ap.add_argument("--model", default="qwen3", choices=list(sim.MODELS))
    ap.add_argument("--experts-per-rank", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--nic-scale", type=float, default=1.0, help="multiply every preset's NIC bandwidth by this")
    ap.add_argument("--relay-fanout", type=int, default=2,
                    help="the relay layers' relay_fanout: children per node of a relay tree (>= 2), the copies of one "
                         "expert a rank may send")
    ap.add_argument("--relay-chunks", type=int, default=1,
                    help="the relay layers' relay_chunks: each relayed copy in this many chunks, levels overlapping")
    ap.add_argument("--relay-schedule", default="levels", choices=list(sim.RELAY_SCHEDULES),
                    help="the relay layers' fetch: levels (one level of the trees after the other) or async (every "
                         "copy leaves as soon as its source holds it; LayerConfig.relay_schedule, "
                         "sim.Execution.relay_schedule), the guard pricing the one that runs")
    ap.add_argument("--relay-share", action="store_true",
                    help="the relay layers' relay_share: relay every fetch whose direct form exceeds a tree's share")
    ap.add_argument("--fetch-overlap", action="store_true",
                    help="every policy's forward replica fetch beside the dispatch and main GEMMs "
                         "(sim.Execution.fetch_overlap)")
    ap.add_argument("--spread-planner", default="plus", choices=list(sim.SPREAD_PLANNERS),
                    help="time the spread candidates as topoep_plus's CUDA planner (plus: the target) or as the CUDA "
                         "spread planner measured on one H200 (measured; sim.Execution.spread_planner)")
    ap.add_argument("--spread-speedup", type=float, default=1.0,
                    help="with --spread-planner measured: the measured spread planner's time divided by this")
    ap.add_argument("--spread-gate", default="on", choices=["on", "off"],
                    help="the spread layers' spread gate (sim.Execution.spread_gate, LayerConfig.spread_gate)")
    ap.add_argument("--spread-probe", type=int, default=sim.Execution.spread_probe,
                    help="the spread gate's probe period in calls (LayerConfig.spread_probe)")
    ap.add_argument("--peer-candidates", action="store_true",
                    help="a layer topoep_plus_peers: guarded topoep_plus with FlexMoE's and DeepSeek EPLB's plans as "
                         "further candidates (LayerConfig.plus_peers), timed as --peer-planner says")
    ap.add_argument("--peer-planner", default="plus", choices=list(sim.SPREAD_PLANNERS),
                    help="with --peer-candidates: time the peers' candidates as topoep_plus's CUDA planner (plus: the "
                         "what-if) or as csrc/peers.cu measured on one H200 (measured; sim.Execution.peer_planner)")
    ap.add_argument("--peers-on-gpu", action="store_true",
                    help="the peers' own layers (deepseek, flexmoe) plan with their CUDA planners as this runtime runs "
                         "them (sim.Execution.peers_on_gpu: measured alone, no host round trip); default: on the host, "
                         "as their own systems plan")
    ap.add_argument("--peer-relays", action="store_true",
                    help="the peers' own layers (topoep, deepseek, fastermoe, flexmoe) fetch their replicas as the "
                         "relay layers do (--relay-fanout, --relay-share, --relay-schedule, the guard choosing relayed "
                         "or direct and paying the relay guard's time): a stricter comparison, since none of their "
                         "systems relays (FasterMoE's shadowing broadcasts); default: every copy from its home")
    ap.add_argument("--execution", default="topoep", choices=list(sim.EXECUTIONS),
                    help="the simulated software (sim.EXECUTIONS): topoep, paper 3.3's overlapped two-chunk pipeline; "
                         "cuda and torch, the runtime backends as fitted on the GPU machine (serial)")
    ap.add_argument("--token-overlap", type=float, default=None,
                    help="every guard's token_overlap (NetBenefitGuard; default its own, 0.8): 0 prices the token "
                         "transfers and the expert compute serially")
    ap.add_argument("--guard-pipeline", action="store_true",
                    help="every guard predicts the compute and token time with the simulator's chunk pipeline "
                         "(NetBenefitGuard.token_chunks = the execution's chunks) instead of its token_overlap formula")
    ap.add_argument("--plan-domain", type=int, default=sim.Execution.plan_domain,
                    help="the refining planners (topoep, and topoep_plus with its local plan) balance inside groups of at "
                         "most this many ranks of an NVLink domain (LayerConfig.plan_domain, sim.Execution.plan_domain; "
                         "default %(default)s); 0: whole domains")
    ap.add_argument("--oracle", action="store_true",
                    help="where a topoep_plus layer misses a target, also run each plan it planned in that call (and "
                         "the static plan) in the guard's place (sim.simulate's force_choice) and report the fastest: "
                         "which misses a perfect pick would meet, and which need better plans")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plan-cache", default="build/plan_cache",
                    help="solve each plan once across runs (sim.PlanCache: the same plans, the same report; keyed on "
                         "every input and the planners' source); 'none': solve every plan here")
    ap.add_argument("--name", default="link_sweep")
    ap.add_argument("--out", type=Path, default=REPO / "results")
    args = parse_options(ap, argv)
    for name in ("eps", "slots"):
        if any(v < (1 if name == "eps" else 0) for v in getattr(args, name)):
            raise SystemExit(f"--{name} must be {'>= 1' if name == 'eps' else '>= 0'}")
    if args.spread_speedup != 1.0 and args.spread_planner != "measured":
        raise SystemExit("--spread-speedup scales the measured spread planner: add --spread-planner measured")
    if args.peer_planner != "plus" and not args.peer_candidates:
        raise SystemExit("--peer-planner times the --peer-candidates layer: add --peer-candidates")
    if args.guard_pipeline and (not sim.EXECUTIONS[args.execution].pipelined or args.token_overlap is not None):
        raise SystemExit(f"--guard-pipeline predicts with the chunk pipeline: it needs a pipelined --execution (got "
                         f"{args.execution}) and no --token-overlap")
    if args.token_overlap is not None and not 0 <= args.token_overlap <= 1:
        raise SystemExit("--token-overlap must be in [0, 1]")
    if args.plan_domain is not None and args.plan_domain < 0:
        raise SystemExit("--plan-domain must be >= 1, or 0 for whole domains")
    args.plan_domain = args.plan_domain or None
    if args.spread_probe < 2:
        raise SystemExit("--spread-probe must be >= 2")
    if args.relay_schedule == "async" and args.relay_chunks != 1:
        raise SystemExit("--relay-schedule async moves whole copies: leave --relay-chunks at 1")
    if args.relay_fanout < 2:
        raise SystemExit(f"--relay-fanout must be >= 2 (a tree of one child per node is a chain), got {args.relay_fanout}")
    if not args.spread_speedup > 0:
        raise SystemExit("--spread-speedup must be > 0")
    if args.experts_per_rank < 1 or args.tokens < 1 or not args.nic_scale > 0 or args.relay_chunks < 1:
        raise SystemExit("--experts-per-rank, --tokens and --relay-chunks must be >= 1 and --nic-scale > 0")
    return args


def guard_of(args) -> NetBenefitGuard:
    """Every guarded policy's guard: default constants, with --guard-pipeline the chunk pipeline's prediction."""
    if args.guard_pipeline:
        return NetBenefitGuard(token_chunks=sim.EXECUTIONS[args.execution].num_chunks)
    if args.token_overlap is not None:
        return NetBenefitGuard(token_overlap=args.token_overlap)
    return NetBenefitGuard()


def layers(args) -> dict:
    """The topoep_plus layers of this sweep: OURS (the relay layers' fanout --relay-fanout), and with
    --peer-candidates PEER_LAYER."""
    ours = {o: (f and args.relay_fanout, c) for o, (f, c) in OURS.items()}
    return {**ours, PEER_LAYER: (None, PEER_CANDIDATES)} if args.peer_candidates else ours


def ran_name(candidates: tuple[str, ...], choice: int) -> str:
    """`ran`: the plan the guard kept, plus (topoep_plus's own) or its candidate `choice` (1-based) by short name."""
    return (("plus",) + tuple(SHORT.get(c, c) for c in candidates))[choice]


def cells(args):
    for preset in args.presets:
        for ep in args.eps:
            for slots in args.slots:
                for scen in args.scenarios:
                    yield preset, ep, slots, scen


def run(args) -> list[dict]:
    from tqdm import tqdm

    model0 = sim.MODELS[args.model]
    guard = guard_of(args)
    omegas, bounds, rows = {}, {}, []
    ours = layers(args)
    cache = None if args.plan_cache == "none" else sim.PlanCache(REPO / args.plan_cache, min_solve_s=0.0)
    todo = list(cells(args))
    for preset, ep, slots, scen in tqdm(todo, desc="cells", unit="cell"):
        base = sim.CLUSTERS[preset]
        cl = dataclasses.replace(base, rdma_bytes_per_s=base.rdma_bytes_per_s * args.nic_scale)
        model = model0.with_experts(ep * args.experts_per_rank)
        d = cl.domain_size(ep)
        key = (scen, ep, d)
        if key not in omegas:
            omegas[key] = workloads.scenario(scen, ep, model.num_experts, args.tokens, model.top_k, ranks_per_domain=d,
                                             seed=args.seed)
        if (preset, ep) not in bounds:
            bal = workloads.balanced_routing(ep, model.num_experts, args.tokens, model.top_k)
            bounds[(preset, ep)] = sim.simulate(bal, cl, model=model, policy="static", num_slots=0,
                                                execution=sim.EXECUTIONS[args.execution]).layer_s
        row = {"preset": preset, "ep": ep, "domains": ep // d, "slots": slots, "scenario": scen,
               "bound_ms": 1e3 * bounds[(preset, ep)]}
        forced = {}  # the topoep_plus layers' simulate arguments, for --oracle
        for policy in POLICIES + tuple(o for o in ours if o not in POLICIES):
            fanout, cands = ours.get(policy, (None, ()))
            ex = dataclasses.replace(sim.EXECUTIONS[args.execution], fetch_overlap=args.fetch_overlap,
                                     spread_planner=args.spread_planner, spread_speedup=args.spread_speedup,
                                     spread_gate=args.spread_gate == "on", spread_probe=args.spread_probe,
                                     peer_planner=args.peer_planner, peers_on_gpu=args.peers_on_gpu,
                                     plan_domain=args.plan_domain)
            if args.peer_relays and policy in PEERS:
                fanout = args.relay_fanout
            if fanout:
                ex = dataclasses.replace(ex, relay_fanout=fanout, relay_chunks=args.relay_chunks,
                                         relay_share=args.relay_share, relay_schedule=args.relay_schedule)
            kw = dict(model=model, policy=policy if policy not in ours else "topoep_plus", num_slots=slots,
                      guard=None if policy == "static" else guard, execution=ex, plan_cache=cache,
                      **({"plus_candidates": cands} if policy in ours else {}))
            r = sim.simulate(omegas[key], cl, **kw)
            if policy in ours:
                forced[policy] = (kw, r)
            row[f"{policy}_ms"] = 1e3 * r.layer_s
            row[f"{policy}_imbalance"] = r.stats["imbalance"]
            if policy in ours:  # which plan the guard kept: topoep_plus's, a candidate, or static
                row[f"{policy}_ran"] = ("static" if r.stats["num_replicas"] == 0 else
                                        ran_name(cands, int(r.stats["guard_choice"])))
                row[f"{policy}_gate"] = {1.0: "on", 0.0: "off"}.get(r.stats["spread_gate"], "-")
            row[f"{policy}_fetch_nic_bytes"] = r.traffic.get("replica_nic_bytes", 0.0)
            for k in SENDS:  # the busiest senders of the fetch as it ran (relayed or direct)
                row[f"{policy}_sends_{k}"] = r.stats[f"sends_{k}"]
        if args.oracle:
            for o, (kw, r) in forced.items():
                row.update(oracle(row, o, omegas[key], cl, kw, r))
        rows.append(row)
    return rows


def oracle(row: dict, layer: str, omega, cluster, kw: dict, guarded) -> dict:
    """--oracle for one layer in one cell: where it misses a target, every plan it planned in the call (and static) in
    the guard's place; `<layer>_oracle_ms` the fastest (the guarded time where it met the targets: a pick can only be
    as fast or faster), `<layer>_oracle_ran` which plan that was."""
    best, ran = row[f"{layer}_ms"], row[f"{layer}_ran"]
    if not verdict(row, layer)["ok"] and guarded.stats["plans_planned"] > 0:
        names = ("plus",) + tuple(SHORT.get(c, c) for c in kw["plus_candidates"])
        planned = int(guarded.stats["plans_planned"])
        for i in range(-1, planned):
            ms = 1e3 * sim.simulate(omega, cluster, **kw, force_choice=i).layer_s
            if ms < best - 1e-12:
                best, ran = ms, "static" if i < 0 else names[i]
    return {f"{layer}_oracle_ms": best, f"{layer}_oracle_ran": ran}


def verdict(row: dict, ours: str = "topoep_plus") -> dict:
    """The issue's targets for one cell: topoep_plus (or `ours`) / static <= 1.00 (1.01 on uniform), <= 1.01 x the
    best peer."""
    plus, static = row[f"{ours}_ms"], row["static_ms"]
    best_peer = min(PEERS, key=lambda p: row[f"{p}_ms"])
    limit = 1.01 if row["scenario"] == "uniform" else 1.00
    return {"vs_static": plus / static, "vs_best": plus / row[f"{best_peer}_ms"], "best_peer": best_peer,
            "vs_bound": plus / row["bound_ms"],
            "ok": plus / static <= limit + 1e-9 and plus / row[f"{best_peer}_ms"] <= 1.01 + 1e-9}


def _sends(rows: list[dict], layer: str) -> str:
    """The busiest sender's copies of `layer`: the maxima over the cells."""
    m = {k: int(max(r[f"{layer}_sends_{k}"] for r in rows)) for k in SENDS}
    return f"{m['nvlink']} / {m['nic']} ({m['nvlink_expert']} / {m['nic_expert']})"


def beyond_tree(row: dict, layer: str, fanout: int = 2) -> tuple[bool, bool]:
    """Whether a rank of `layer`'s fetch in this cell sent more copies of one expert than the relay trees of `fanout`
    children let it: over NVLink or over the NIC, more than fanout (`topoep.relay`)."""
    return (row[f"{layer}_sends_nvlink_expert"] > fanout, row[f"{layer}_sends_nic_expert"] > fanout)


def _beyond(rows: list[dict], layer: str, fanout: int) -> str:
    """Cells beyond a relay tree of `fanout`'s share: any, over NVLink, over the NIC."""
    flags = [beyond_tree(r, layer, fanout) for r in rows]
    return f"{sum(a or b for a, b in flags)} ({sum(a for a, _ in flags)} / {sum(b for _, b in flags)})"


def report(args, rows: list[dict]) -> str:
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    lines = [
        "# Every policy on every routing scenario, in the simulator's per-link model",
        "",
        f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']} (a prediction: nothing here "
        "ran on a GPU)",
        f"- model {args.model} expert shape, {args.experts_per_rank} experts per rank, "
        f"top-{sim.MODELS[args.model].top_k}, "
        f"{args.tokens} tokens per rank, seed {args.seed}; NIC bandwidth x {args.nic_scale:g}",
        "- ms: the simulated MoE layer (forward + backward) with the net-benefit guard on for every balancing policy "
        "(its per-link prediction; routing no plan can pay for is not planned; "
        + ("its compute and token time as the simulator's chunk pipeline runs them, `NetBenefitGuard.token_chunks="
           f"{sim.EXECUTIONS[args.execution].num_chunks}`" if args.guard_pipeline else
           f"its compute and token time by the `token_overlap` formula, h = {guard_of(args).token_overlap:g}")
        + f"); execution `{args.execution}` (`sim.EXECUTIONS`); every policy, static included, pays "
        "the count all-gather of megatron's dispatcher; each policy column is its time / static's; topoep_plus: the "
        "layer plans topoep_plus and topoep_plus_local at once and the guard keeps the faster by its prediction "
        "(`ran`: plus, local, or static when the guard fired or nothing was planned); topoep_plus_relay: the same with "
        f"`relay_fanout={args.relay_fanout}`, `relay_chunks={args.relay_chunks}`, `relay_share={str(args.relay_share).lower()}` "
        "(`topoep.relay`; both backends execute it): the guard also chooses, per plan, between the replica fetch down "
        f"relay trees of {args.relay_fanout} children per node, each copy in {args.relay_chunks} chunk(s) forwarded as they arrive "
        "(more than one: the levels overlap, each step paying a transfer latency), and the direct one"
        + (", and relays wherever the direct fetch would make a home send more copies of one expert than a tree's "
           "share" if args.relay_share else "")
        + (" (`--relay-schedule async`, LayerConfig.relay_schedule: the relayed fetch runs copy by copy, each leaving "
           "as soon as its source holds it, timed as the longer of its busiest link and its longest chain of hops, "
           "`sim.async_fetch_s`, an optimistic bound; the guard prices it so)"
           if args.relay_schedule == "async" else "") + "; "
        "topoep_plus_spread (and _relay): the same layer with a third candidate, `topoep_plus_spread` "
        "(`topoep.planners.spread`: load moved across the whole EP group, priced on the busiest replica link; its "
        "planner: csrc/spread.cu, " + ("timed as measured on one H200 (`sim.gpu_spread_s`: "
                                        f"{_us_range(sim.GPU_SPREAD_US)} alone, {_us_range(sim.GPU_SPREAD_SET_US)} "
                                        "with the three other plans at EP 8-128 on the latency workload; per call "
                                        "shifted by its time per greedy move for the moves the call's greedy made, "
                                        "`spread.measured_latency_s`)"
                                        + (f" divided by {args.spread_speedup:g}" if args.spread_speedup != 1 else "")
                                        if args.spread_planner == "measured" else "timed here as topoep_plus's CUDA planner (about 50 us; the "
                                        f"measured one: {_us_range(sim.GPU_SPREAD_US)}, `--spread-planner measured`)")
        + "); with relays also a fourth, "
        "`topoep_plus_spread_tree` (the same planner pricing a remote domain's copies as its relay tree fetches "
        "them); `ran`: the plan the guard kept (plus, local, spread, tree, or static when the guard fired or nothing "
        "was planned); "
        + ("the spread layers gate the spread planner (`sim.Execution.spread_gate`, the runtime's "
           "`LayerConfig.spread_gate`) with a probe every " + str(args.spread_probe) + " calls: where the guard keeps a "
           "spread plan that beats the other two by more than the spread planner's time it runs on every call but the "
           "probes (which run the other two plans: averaged in), elsewhere only on the probes (its time beyond theirs "
           "amortised) and the other two plans run; `gate`: on or off per cell; " if args.spread_gate == "on" else
           "the spread planner runs on every planned call (`--spread-gate off`); ")
        + ("topoep_plus_peers (`--peer-candidates`; the runtime's `LayerConfig.plus_peers`): guarded topoep_plus with "
           "FlexMoE's and DeepSeek EPLB's plans as further candidates (`ran`: plus, local, flexmoe, deepseek), "
           + ("planned beside topoep_plus's at its CUDA planner's measured time (a what-if: what such candidates give "
              "when they cost no time beyond the pair); " if args.peer_planner == "plus" else
              "the four plans at once timed as csrc/peers.cu ran them on one H200 (`--peer-planner measured`, "
              "`baselines.peer_set_s`: results/peer_latency.md); ") if args.peer_candidates else "")
        + "bound: the variant / the static layer on perfectly balanced routing",
        "- forward replica fetch: " + (
            "beside the dispatch and the main experts' GEMMs for every policy (`sim.Execution.fetch_overlap`, backend "
            "cuda's `fetch_overlap`: first on the links it shares with the dispatch; every rank's slot GEMMs wait for "
            "it); the guard still prices it as exposed" if args.fetch_overlap else
            "before the dispatch, exposed (`--fetch-overlap`: beside it)"),
        "- the peers' own layers: " + (
            "deepseek and flexmoe plan with their CUDA planners (csrc/peers.cu) as this runtime runs them, timed alone "
            "as measured on one H200 (`sim.Execution.peers_on_gpu`, `baselines.peer_solo_s`: results/peer_latency.md), "
            "no host round trip; fastermoe on the host" if args.peers_on_gpu else
            "every peer plans on the host as its own system does: a host round trip, the counts' copy and a planner as "
            "fast as topoep's CUDA one (`--peers-on-gpu`: deepseek and flexmoe with their measured CUDA planners)")
        + ("; they fetch their replicas as the relay layers do (`--peer-relays`: relay trees of "
           f"{args.relay_fanout}, the guard choosing relayed or direct, the relay guard's time paid)"
           if args.peer_relays else "; every copy from its home (`--peer-relays`: down relay trees as ours)"),
        "- the refining planners (topoep, and topoep_plus with its local plan) balance inside "
        + (f"groups of at most {args.plan_domain} ranks of each NVLink domain (`--plan-domain`, LayerConfig.plan_domain: "
           "a larger domain, GB200's, is planned as groups and timed at the groups' size)" if args.plan_domain else
           "whole NVLink domains (`--plan-domain 0`), timed at the domain's size"),
        f"- reproduce: `{command('link_sweep.py', args.argv)}`",
        "",
    ]
    ours = layers(args)
    verdicts = {o: [verdict(r, o) for r in rows] for o in ours}
    misses = {o: [(r, v) for r, v in zip(rows, vs) if not v["ok"]] for o, vs in verdicts.items()}
    lines += ["## Cells where a topoep_plus layer misses a target", "",
              "Targets: ours / static <= 1.00 (1.01 on uniform) and <= 1.01 x the best of topoep, deepseek, "
              "fastermoe, flexmoe (all guarded).", "",
              markdown_table(["layer", "relay fanout", "guard candidates", "cells missed", "worst / best peer",
                              "median / bound", "busiest sender's copies: NVLink / NIC (of one expert)",
                              "cells beyond a tree's share (NVLink / NIC)"],
                             [[o, ours[o][0] or "-", ", ".join(("topoep_plus",) + ours[o][1]),
                               f"{len(misses[o])} of {len(rows)}",
                               f"{max(v['vs_best'] for v in verdicts[o]):.2f}",
                               f"{statistics.median(v['vs_bound'] for v in verdicts[o]):.2f}", _sends(rows, o),
                               _beyond(rows, o, args.relay_fanout)]
                              for o in ours]),
              "",
              "Busiest sender: the most replica copies one rank sends in a fetch as it ran (relayed or direct, the "
              "guard's choice), the maximum over the cells (`topoep.relay.sender_copies`). With relay trees of f "
              "children a rank sends at most f copies of one expert over NVLink and at most f over its NIC (the "
              f"remote domains' roots form a tree of f children below the home); cells beyond a tree's share: those where a rank sent more than a tree of "
              f"{args.relay_fanout} lets it (the "
              "layers without relays fetch every copy from its home; " + ("the relay layers' guard relays every such "
              "fetch)." if args.relay_share else "the relay layers' guard runs the direct fetch where its model finds "
              "it faster: `--relay-share` relays every such fetch).") + "", ""]
    for o in ours:
        if misses[o]:
            lines += [f"{o}:", "",
                      markdown_table(["preset", "EP", "slots", "scenario", "ours / static", "best peer", "ours / best"],
                                     [[r["preset"], r["ep"], r["slots"], r["scenario"], f"{v['vs_static']:.2f}",
                                       v["best_peer"], f"{v['vs_best']:.2f}"] for r, v in misses[o]]), ""]
    if args.oracle:
        lines += oracle_report(rows, ours)
    shown = [p for p in POLICIES if p != "static"] + [o for o in ours if o not in POLICIES]
    header = (["preset", "EP", "slots", "scenario", "static ms"] + shown
              + ["plus ran", "spread ran", "spread gate", "plus / bound", "spread relay / bound"])
    body = [[r["preset"], r["ep"], r["slots"], r["scenario"], f"{r['static_ms']:.2f}"]
            + [f"{r[f'{p}_ms'] / r['static_ms']:.2f}" for p in shown]
            + [r["topoep_plus_ran"], r[f"{SPREAD_RELAY}_ran"], f"{r[f'{SPREAD}_gate']} / {r[f'{SPREAD_RELAY}_gate']}",
               f"{vp['vs_bound']:.2f}", f"{vs['vs_bound']:.2f}"]
            for r, vp, vs in zip(rows, verdicts["topoep_plus"], verdicts[SPREAD_RELAY])]
    lines += ["## All cells (layer time / static)", "", markdown_table(header, body), ""]
    return "\n".join(lines)


def oracle_report(rows: list[dict], ours: dict) -> list[str]:
    """--oracle: each layer's misses with the guard's pick and with the fastest of the plans it planned, and the cells
    a perfect pick still misses."""
    def oracle_verdict(r, o):
        return verdict({**r, f"{o}_ms": r[f"{o}_oracle_ms"]}, o)

    summary, left = [], []
    for o in ours:
        vs = [oracle_verdict(r, o) for r in rows]
        summary.append([o, sum(not verdict(r, o)["ok"] for r in rows), sum(not v["ok"] for v in vs),
                        f"{max(v['vs_best'] for v in vs):.2f}"])
        left += [[o, r["preset"], r["ep"], r["slots"], r["scenario"], r[f"{o}_ran"], r[f"{o}_oracle_ran"],
                  f"{v['vs_static']:.2f}", v["best_peer"], f"{verdict(r, o)['vs_best']:.2f}", f"{v['vs_best']:.2f}"]
                 for r, v in zip(rows, vs) if not v["ok"]]
    return ["## The guard's pick against the fastest plan of the call (--oracle)", "",
            "Where a layer misses a target, each plan it planned in that call (and the static plan) ran in the guard's "
            "place (`sim.simulate(..., force_choice=i)`: the same plan time, the guard's relayed or direct fetch for "
            "that plan; the spread gate's probe calls keep the guard's pick). Misses a perfect pick would meet come "
            "from the guard's prediction; the rest need better plans (or cheaper planning).", "",
            markdown_table(["layer", "cells missed (guard's pick)", "cells missed (fastest plan)",
                            "worst / best peer (fastest plan)"], summary), "",
            "Cells the fastest plan still misses:", "",
            markdown_table(["layer", "preset", "EP", "slots", "scenario", "guard ran", "fastest", "fastest / static",
                            "best peer", "guard / best", "fastest / best"], left) if left else "none", ""]


def _us_range(points) -> str:
    """"a-b us" of measured (ranks, us) points (sim.GPU_SPREAD_US)."""
    us = [u for _, u in points]
    return f"{min(us):.0f}-{max(us):.0f} us"

def main(argv=None) -> None:
    args = parse_args(argv)
    rows = run(args)
    text = report(args, rows)
    write_report(args, text, rows)
    missed = ", ".join(f"{o} {sum(not verdict(r, o)['ok'] for r in rows)}" for o in layers(args))
    print(f"{len(rows)} cells; cells missing a target: {missed}; wrote {args.out / args.name}.md")


if __name__ == "__main__":
    main()
