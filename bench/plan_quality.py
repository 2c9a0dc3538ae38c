"""Plan quality: paper Fig. 10 (rank-load imbalance vs replica slots) and Fig. 16 (inter-node and
replica-served fractions) for every policy, on three synthetic workloads at the Fig. 10 scale
(32 ranks = 4 domains x 8, 640 experts, top-8, 4096 tokens per rank), plus every policy's gap to the
exact optimum of problem (8) on small instances.

    python bench/plan_quality.py            # or: topoep-plan-quality
    python bench/plan_quality.py --milp-instances 0 --slots 0 1 2

Prints the tables and writes results/plan_quality.{md,json,png} with config, commit and hardware.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, markdown_table, run_info, write_json  # noqa: E402
from topoep import POLICIES, Topology, metrics, solve  # noqa: E402
from topoep.metrics import DEFAULT_T_FFN  # noqa: E402
from topoep.planners import QWEN3_EXPERT_BYTES, QWEN3_TOKEN_BYTES  # noqa: E402
from topoep.planners.milp import solve_milp  # noqa: E402
from topoep.workloads import FIG10, FIG10_ROUTER_SKEW, FIG10_SEED, biased_routing, fig10_workload  # noqa: E402

WORKLOADS = {
    "fig10": ("random", "megatron's random expert bias, calibrated to the paper's no-balancing 8.39"),
    "clustered": ("clustered", "same bias values, hottest experts on the first ranks (domain 0)"),
    "scattered": ("scattered", "same bias values, i-th hottest expert on rank i mod 32"),
}
# Numbers stated in the paper's text (Fig. 10: imbalance; Fig. 16: fractions on the three models).
PAPER_FIG10 = {("static", s): 8.39 for s in range(5)} | {
    ("topoep", 1): 3.79, ("topoep", 2): 1.30, ("topoep", 3): 1.30, ("topoep", 4): 1.30,
    ("flexmoe", 1): 1.45, ("fastermoe", 4): 1.82, ("deepseek", 4): 2.88,
}
PAPER_FIG16 = "TopoEP inter-node 0.91-1.88 % (Megatron-LM 50.0-75.0 %), replica-served 63.8-79.8 %"


def domain_bound(plan) -> float:
    """Imbalance lower bound for any plan that keeps this plan's per-domain loads (the topoep
    refinement never moves load between domains): max domain load / ranks_per_domain / mean."""
    t = plan.topology
    L = plan.rank_load.view(t.num_domains, t.ranks_per_domain).sum(1).double()
    mean = L.sum() / plan.num_ranks
    return (L.max() / t.ranks_per_domain / mean).item() if mean > 0 else 1.0


def evaluate(args) -> list[dict]:
    topo = Topology(num_domains=FIG10["num_ranks"] // FIG10["ranks_per_domain"],
                    ranks_per_domain=FIG10["ranks_per_domain"])
    rows = []
    jobs = [(w, s, p) for w in args.workloads for s in args.slots for p in args.policies]
    omegas = {w: fig10_workload(layout=WORKLOADS[w][0]) for w in args.workloads}
    for w, s, p in tqdm(jobs, desc="plan quality", disable=args.quiet):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            plan = solve(omegas[w], topo, num_slots=s, policy=p, expert_bytes=args.expert_bytes,
                         token_bytes=args.token_bytes)
            times.append(time.perf_counter() - t0)
        plan.check()
        m = metrics(plan, t_ffn=args.t_ffn)
        rows.append(dict(workload=w, slots=s, policy=p, imbalance=m["imbalance"],
                         internode_pct=100 * m["internode_fraction"], replica_pct=100 * m["replica_fraction"],
                         replicas=int(m["num_replicas"]), modelled_ms=1e3 * m["t_total"],
                         t_comp_ms=1e3 * m["t_comp"], t_token_ms=1e3 * m["t_token"],
                         t_replica_ms=1e3 * m["t_replica"], solve_ms=1e3 * statistics.median(times),
                         static_imbalance=m["static_imbalance"], domain_bound=domain_bound(plan),
                         stage1_replicas=plan.info.get("stage1_replicas"),
                         refine_iters=sum(plan.info.get("refine_iters", [])) if p == "topoep" else None,
                         fallback=plan.info.get("fallback"), paper_imbalance=PAPER_FIG10.get((p, s)) if w == "fig10" else None))
    return rows


def milp_gaps(args) -> list[dict]:
    """Gap of every policy's modelled time (eq. 8) to the MILP optimum on small 2-domain instances."""
    if args.milp_instances <= 0:
        return []
    R, rpd, E = 8, 4, 16
    topo = Topology(num_domains=R // rpd, ranks_per_domain=rpd)
    W, S = args.milp_expert_bytes, args.token_bytes
    gaps: dict[tuple[str, int], list[float]] = {}
    jobs = [(i, s) for s in (1, 2) for i in range(args.milp_instances)]
    for i, s in tqdm(jobs, desc="MILP optimum", disable=args.quiet):
        om = biased_routing(R, E, 128, 4, [-1.0, -2.0, -3.0][i % 3], seed=i,
                            layout=["random", "clustered", "scattered"][(i // 3) % 3])
        res = solve_milp(om, topo, num_slots=s, expert_bytes=W, token_bytes=S, t_ffn=args.t_ffn, time_limit=60)
        for p in args.policies:
            t = metrics(solve(om, topo, num_slots=s, policy=p, expert_bytes=W, token_bytes=S), t_ffn=args.t_ffn)["t_total"]
            gaps.setdefault((p, s), []).append(100 * (t / res.objective - 1) if res.optimal else float("nan"))
    rows = []
    for (p, s), g in sorted(gaps.items(), key=lambda kv: (kv[0][1], POLICIES.index(kv[0][0]))):
        g = sorted(x for x in g if x == x)
        rows.append(dict(policy=p, slots=s, instances=len(g), median_gap_pct=statistics.median(g),
                         p90_gap_pct=g[int(0.9 * (len(g) - 1))], max_gap_pct=g[-1],
                         within_2pct=sum(x <= 2.0 for x in g) / len(g)))
    return rows


def pivot(rows, workload, key, fmt) -> str:
    slots = sorted({r["slots"] for r in rows})
    header = ["policy"] + [f"{s} slot{'s' if s != 1 else ''}" for s in slots]
    body = []
    for p in dict.fromkeys(r["policy"] for r in rows):
        cells = {r["slots"]: r for r in rows if r["workload"] == workload and r["policy"] == p}
        body.append([p] + [fmt.format(cells[s][key]) if s in cells else "" for s in slots])
    return markdown_table(header, body)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(len(workloads), 3, figsize=(13, 3.3 * len(workloads)), squeeze=False)
    for i, w in enumerate(workloads):
        for j, (key, label) in enumerate([("imbalance", "max / mean rank load"),
                                          ("internode_pct", "inter-node assignments (%)"),
                                          ("replica_pct", "replica-served assignments (%)")]):
            ax = axes[i, j]
            for p in policies:
                pts = sorted((r["slots"], r[key]) for r in rows if r["workload"] == w and r["policy"] == p)
                ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=p)
            if key == "imbalance":
                ax.axhline(1.0, color="gray", ls="--", lw=1)
                ax.set_yscale("log")
                if w == "fig10":
                    pts = sorted((s, v) for (p, s), v in PAPER_FIG10.items() if p == "topoep")
                    ax.plot([a for a, _ in pts], [b for _, b in pts], "k*", ms=9, label="paper TopoEP")
            ax.set_title(f"{w}: {label}", fontsize=10)
            ax.set_xlabel("replica slots per rank")
            ax.set_xticks(sorted({r["slots"] for r in rows}))
            ax.grid(alpha=0.3)
        axes[i, 0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analysis(rows) -> str:
    """The comparison with the paper, with every number taken from this run."""
    get = {(r["workload"], r["slots"], r["policy"]): r for r in rows}
    lines = []
    t2 = get.get(("fig10", 2, "topoep"))
    if t2:
        lines.append(
            f"- **Imbalance at 2 slots on the Fig. 10 workload: {t2['imbalance']:.2f} here vs 1.30 in the paper.** "
            f"Stage 1 (inter-node placement) has more positive-benefit candidates than slots, so it fills "
            f"{t2['stage1_replicas']} of the {32 * 2} slots; refinement then finds no free slot on the targets "
            f"and can only move load to ranks that already host the expert ({t2['refine_iters']} moves). The "
            f"domains themselves are balanced (a plan keeping these per-domain loads could reach "
            f"{t2['domain_bound']:.2f}), so the residual imbalance is inside domains: it is the faithful "
            "algorithm running out of slots, not a domain-level limit. How full stage 1 runs depends on how "
            "many (domain, expert) pairs pass b = 2 D S_tok - W > 0, i.e. on the workload's shape and on the "
            f"expert size (here W = {QWEN3_EXPERT_BYTES / 2**20:.0f} MiB, S_tok = {QWEN3_TOKEN_BYTES} B: "
            "D > 1152 assignments); the paper gives neither its generator nor W for the 640-expert workload.")
    t4 = get.get(("fig10", 4, "topoep"))
    if t4:
        lines.append(f"- With 4 slots stage 1 leaves room ({t4['stage1_replicas']} of 128 slots) and refinement "
                     f"reaches {t4['imbalance']:.2f}, better than the paper's 1.30.")
    c2 = get.get(("clustered", 2, "topoep"))
    if c2:
        lines.append(f"- Clustered hot experts (static {c2['static_imbalance']:.1f}): domain 0 holds the hot experts, "
                     f"and C4 plus domain-local refinement leave its load there: the per-domain bound is "
                     f"{c2['domain_bound']:.2f} at 2 slots (topoep {c2['imbalance']:.2f}). Here the limit is the "
                     "domain's slot capacity and C4, which is what a plan crossing the fabric would fix.")
    inter = [get[(w, s, "topoep")]["internode_pct"] for w, s, _ in get if _ == "topoep" and s == 2]
    if inter:
        lines.append(f"- Inter-node share at 2 slots: {min(inter):.1f}-{max(inter):.1f} % here vs the paper's "
                     f"{PAPER_FIG16}. The paper's Fig. 16 comes from end-to-end runs of three models with "
                     "natural routing, not from this synthetic workload; here every domain sends demand for many "
                     "more hot remote experts than its 16 slots can replicate, and those assignments stay remote.")
    worst_ratio = []
    for (w, s, p), r in get.items():
        if p in ("deepseek", "fastermoe", "flexmoe") and s > 0:
            worst_ratio.append(get[(w, s, "topoep")]["internode_pct"] <= r["internode_pct"])
    if worst_ratio:
        lines.append(f"- topoep's inter-node share is at most every topology-unaware policy's in "
                     f"{sum(worst_ratio)}/{len(worst_ratio)} (workload, slots, baseline) cases, and its "
                     "imbalance never exceeds static's (the fallback guard never fired: "
                     f"{sum(1 for r in rows if r['fallback'])} fallbacks).")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--slots", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    ap.add_argument("--expert-bytes", type=int, default=QWEN3_EXPERT_BYTES)
    ap.add_argument("--token-bytes", type=int, default=QWEN3_TOKEN_BYTES)
    ap.add_argument("--t-ffn", type=float, default=DEFAULT_T_FFN, help="seconds per assignment (fwd+bwd)")
    ap.add_argument("--repeats", type=int, default=3, help="solves per cell (median time)")
    ap.add_argument("--milp-instances", type=int, default=12, help="small instances per slot count (0: skip)")
    ap.add_argument("--milp-expert-bytes", type=int, default=200_000,
                    help="expert size for the small MILP instances (small enough that replicas can pay)")
    ap.add_argument("--out", type=Path, default=REPO / "results")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    rows = evaluate(args)
    gaps = milp_gaps(args)
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
                    | {"fig10": FIG10, "router_skew": FIG10_ROUTER_SKEW, "seed": FIG10_SEED})

    md = [f"# Plan quality (paper Fig. 10 and Fig. 16)\n",
          f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']}",
          f"- workload: {FIG10['num_ranks']} ranks = {FIG10['num_ranks'] // FIG10['ranks_per_domain']} domains x "
          f"{FIG10['ranks_per_domain']}, {FIG10['num_experts']} experts, top-{FIG10['top_k']}, "
          f"{FIG10['tokens_per_rank']} tokens per rank; router_skew {FIG10_ROUTER_SKEW}, seed {FIG10_SEED}",
          f"- expert {args.expert_bytes} B, token {args.token_bytes} B, t_ffn {args.t_ffn * 1e9:.1f} ns; "
          "default topology costs (NVLink 200 GB/s, RDMA 50 GB/s per direction)",
          "- reproduce: `python bench/plan_quality.py` (or `make run`)\n"]
    for w in args.workloads:
        static = next(r for r in rows if r["workload"] == w)["static_imbalance"]
        md.append(f"## Workload `{w}`: {WORKLOADS[w][1]} (no balancing {static:.2f})\n")
        md.append("Imbalance (max / mean rank load):\n\n" + pivot(rows, w, "imbalance", "{:.2f}") + "\n")
        md.append("Inter-node assignments (%):\n\n" + pivot(rows, w, "internode_pct", "{:.1f}") + "\n")
        md.append("Replica-served assignments (%):\n\n" + pivot(rows, w, "replica_pct", "{:.1f}") + "\n")
        md.append("Modelled exposed time T_comp + T_token + T_replica (eq. 8, ms):\n\n"
                  + pivot(rows, w, "modelled_ms", "{:.2f}") + "\n")
        md.append("Solve time on the CPU reference (ms, median of "
                  f"{args.repeats}):\n\n" + pivot(rows, w, "solve_ms", "{:.1f}") + "\n")
    paper_rows = [[p, s, f"{v:.2f}", f"{next(r['imbalance'] for r in rows if (r['workload'], r['slots'], r['policy']) == ('fig10', s, p)):.2f}"]
                  for (p, s), v in sorted(PAPER_FIG10.items(), key=lambda kv: (POLICIES.index(kv[0][0]), kv[0][1]))
                  if any((r["workload"], r["slots"], r["policy"]) == ("fig10", s, p) for r in rows)]
    md.append("## Against the paper\n")
    if paper_rows:
        md.append(markdown_table(["policy", "slots", "paper Fig. 10", "here (fig10)"], paper_rows) + "\n")
    md.append(analysis(rows) + "\n")
    if gaps:
        md.append("## Gap to the exact optimum of problem (8) (MILP, HiGHS)\n")
        md.append(f"{args.milp_instances} instances per slot count: 8 ranks = 2 domains x 4, 16 experts, top-4, "
                  f"128 tokens per rank, skews -1/-2/-3, the three layouts; expert {args.milp_expert_bytes} B. "
                  "Gap = modelled time / optimum - 1.\n")
        md.append(markdown_table(["policy", "slots", "instances", "median gap %", "p90 gap %", "max gap %", "within 2 %"],
                                 [[g["policy"], g["slots"], g["instances"], f"{g['median_gap_pct']:.1f}",
                                   f"{g['p90_gap_pct']:.1f}", f"{g['max_gap_pct']:.1f}", f"{100 * g['within_2pct']:.0f} %"]
                                  for g in gaps]) + "\n")
    md.append("![plan quality](plan_quality.png)\n")
    text = "\n".join(md)

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan_quality.md").write_text(text)
    write_json(args.out / "plan_quality.json", info, rows + [dict(kind="milp_gap", **g) for g in gaps])
    plot(rows, args.out / "plan_quality.png")
    print(text)
    print(f"\nwrote {args.out / 'plan_quality.md'}, .json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
