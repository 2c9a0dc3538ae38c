"""Every policy's plan against the per-link lower bound (`topoep_research.bound.link_lower_bound`, an LP over link
loads with C1-C3): the guard's per-link objective of each plan (`link_objective`: straggler compute and token
transfers at their busiest link, overlapped as the guard models them, plus one direct replica fetch at its busiest
link) divided by the bound, on every routing scenario.

    python bench/link_bound.py                     # EP 8 and 16 as 2 domains, 1-4 slots: results/link_bound.{md,json}

The bound is an LP relaxation (fractional replicas; a source's rows not tied to experts), so a ratio of 1 is not
reachable in general: the ratios compare policies with each other and show how far each is from what no plan can
beat. Uniform routing at EP 32 takes over a minute per LP on this CPU, hence EP 8-16 by default.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, command, markdown_table, parse_options, run_info, write_report  # noqa: E402
from topoep import Topology, solve, workloads  # noqa: E402
from topoep.metrics import DEFAULT_T_FFN  # noqa: E402
from topoep.runtime import NetBenefitGuard  # noqa: E402
from topoep_research.bound import link_lower_bound, link_objective  # noqa: E402

POLICIES = ("static", "topoep", "topoep_plus", "topoep_plus_local", "topoep_plus_spread", "deepseek", "fastermoe",
            "flexmoe")
GUARDED = "guarded_plus"  # what a guarded topoep_plus layer executes: plus, its local plan or static (guard.select)
GUARDED_SPREAD = "guarded_spread"  # the same layer with the spread candidate too (plus, local, spread or static)
EXPERT_BYTES, TOKEN_BYTES = 3 * 2048 * 768 * 2, 2048 * 2  # Qwen3-30B-A3B's expert and token row, bf16


def run(args) -> list[dict]:
    from tqdm import tqdm

    guard = NetBenefitGuard()
    kw = dict(expert_bytes=EXPERT_BYTES, token_bytes=TOKEN_BYTES)
    cells = [(ep, slots, scen) for ep in args.eps for slots in args.slots for scen in args.scenarios]
    rows = []
    for ep, slots, scen in tqdm(cells, desc="cells", unit="cell"):
        rpd = ep // args.domains
        topo = Topology(num_domains=args.domains, ranks_per_domain=rpd)
        omega = workloads.scenario(scen, ep, ep * args.experts_per_rank, args.tokens, 8, ranks_per_domain=rpd,
                                   seed=args.seed)
        lb = link_lower_bound(omega, topo, num_slots=slots, **kw)
        row = {"ep": ep, "domains": args.domains, "slots": slots, "scenario": scen, "bound_ms": 1e3 * lb.bound,
               "lp_s": lb.seconds}
        plans = {p: solve(omega, topo, num_slots=slots, policy=p, **kw) for p in POLICIES}
        plans[GUARDED] = guard.select(plans["topoep_plus"], DEFAULT_T_FFN, 1,
                                      candidates=(plans["topoep_plus_local"],))[0]
        plans[GUARDED_SPREAD] = guard.select(plans["topoep_plus"], DEFAULT_T_FFN, 1,
                                             candidates=(plans["topoep_plus_local"], plans["topoep_plus_spread"]))[0]
        for name, plan in plans.items():
            row[f"{name}_ms"] = 1e3 * link_objective(plan, guard, DEFAULT_T_FFN)
        rows.append(row)
    return rows


def report(args, rows: list[dict]) -> str:
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    names = POLICIES + (GUARDED, GUARDED_SPREAD)
    body = [[r["ep"], r["slots"], r["scenario"], f"{r['bound_ms']:.3f}"] + [f"{r[f'{p}_ms'] / r['bound_ms']:.2f}"
                                                                          for p in names] for r in rows]
    geo = [[p, f"{math.exp(sum(math.log(r[f'{p}_ms'] / r['bound_ms']) for r in rows) / len(rows)):.2f}",
            f"{max(r[f'{p}_ms'] / r['bound_ms'] for r in rows):.2f}"] for p in names]
    return "\n".join([
        "# Every policy against the per-link lower bound",
        "",
        f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']} (LPs and plans on the "
        "CPU; nothing timed on a GPU)",
        f"- {args.experts_per_rank} experts per rank, top-8, {args.tokens} tokens per rank, {args.domains} NVLink "
        f"domains, Qwen3-30B-A3B's expert and token bytes, t_ffn {DEFAULT_T_FFN:g} s per assignment, the topology's "
        "default link costs (NVLink 200 GB/s, NIC 50 GB/s per direction), seed " + str(args.seed),
        "- each policy's column: its plan's per-link objective (`topoep_research.bound.link_objective`: the guard's "
        "prediction of straggler compute and token transfers, plus one direct replica fetch, latencies left out) / "
        "the LP lower bound (`link_lower_bound`, C1-C3, valid for every plan); guarded_plus: the plan a guarded "
        "topoep_plus layer executes (topoep_plus, its local plan, or static); guarded_spread: the same with "
        "topoep_plus_spread as a third candidate",
        f"- reproduce: `{command('link_bound.py', args.argv)}`",
        "",
        "## Over all cells",
        "",
        markdown_table(["policy", "geomean / bound", "worst / bound"], geo),
        "",
        "## Every cell (objective / bound)",
        "",
        markdown_table(["EP", "slots", "scenario", "bound ms"] + list(names), body),
        "",
    ])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--eps", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--domains", type=int, default=2)
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--scenarios", nargs="+", default=list(workloads.SCENARIOS), choices=list(workloads.SCENARIOS))
    ap.add_argument("--experts-per-rank", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--name", default="link_bound")
    ap.add_argument("--out", type=Path, default=REPO / "results")
    args = parse_options(ap, argv)
    if args.domains < 1 or any(ep < args.domains or ep % args.domains for ep in args.eps):
        raise SystemExit(f"--eps must be multiples of --domains {args.domains}, got {args.eps}")
    if any(s < 0 for s in args.slots) or args.experts_per_rank < 1 or args.tokens < 1:
        raise SystemExit("--slots must be >= 0, --experts-per-rank and --tokens >= 1")
    rows = run(args)
    text = report(args, rows)
    write_report(args, text, rows)
    print(text.split("## Every cell")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
