"""How the capacity factor trades memory against plans that must change or spill (topoep.planners.capacity), on
the CPU with the reference planners:

    python bench/capacity.py            # EP 8, 32, 64 (domains of 8), Qwen3 shape, 4096 tokens per rank

For every (EP, routing, policy, slots) the policy's plan goes through the capacity step at each --factors value
(capacity = ceil(factor x T x k) rows per receive region, as backend cuda sizes them). Per factor:
    changed    share of plans the step had to change (a region over the capacity)
    spill      share of plans with rows still beyond the capacity after the step (backend cuda's spill path), and
               the largest such overflow in rows per T x k
    moves      mean / max moves of the step where it acted
    imbalance  mean max/mean rank load before -> after the step
    memory     the rows of one region relative to T x k (= the factor): what backend cuda holds per region
Routing: megatron's biased router (uniform, skews -1, -2, -4 with the random and clustered layouts) and the
simulator's natural-like Zipf popularity. Writes results/capacity.{md,json}.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, command, markdown_table, parse_options, run_info, write_json  # noqa: E402
from topoep import Topology, solve  # noqa: E402
from topoep.planners.capacity import fit_capacity, overflow_rows  # noqa: E402
from topoep.workloads import biased_routing  # noqa: E402
from topoep_research.sim import sample_routing  # noqa: E402


def workloads(R: int, E: int, T: int, k: int, seed: int):
    yield "uniform", biased_routing(R, E, T, k, 0.0, seed=seed)
    for skew in (-1.0, -2.0, -4.0):
        for layout in ("random", "clustered"):
            yield f"skew {skew:g} {layout}", biased_routing(R, E, T, k, skew, seed=seed, layout=layout)
    yield "natural", sample_routing(R, E, T, k, natural=True, seed=seed)


NUM_WORKLOADS = 8


def imbalance(plan) -> float:
    L = plan.rank_load.double()
    return float(L.max() / L.mean()) if float(L.mean()) > 0 else 1.0


def run(args) -> list[dict]:
    rows = []
    bar = tqdm(total=len(args.eps) * NUM_WORKLOADS * len(args.slots) * len(args.policies), desc="plans",
               disable=args.quiet)
    for R in args.eps:
        topo = Topology(num_domains=R // min(args.domain, R), ranks_per_domain=min(args.domain, R))
        A = args.tokens * args.topk
        for name, omega in workloads(R, args.experts, args.tokens, args.topk, args.seed):
            for slots in args.slots:
                for policy in args.policies:
                    plan = solve(omega, topo, num_slots=slots, policy=policy, expert_bytes=args.expert_bytes,
                                 token_bytes=args.token_bytes)
                    for factor in args.factors:
                        cap = math.ceil(factor * A)
                        t0 = time.perf_counter()
                        fitted = fit_capacity(plan, cap)
                        info = fitted.info["capacity"]
                        rows.append(dict(ep=R, workload=name, slots=slots, policy=policy, factor=factor,
                                         changed=overflow_rows(plan, cap) > 0, overflow=info["overflow"] / A,
                                         moves=info["moves"], new_replicas=len(info["new_replicas"]),
                                         refit=info["refit"], imbalance_before=imbalance(plan),
                                         imbalance_after=imbalance(fitted), fit_s=time.perf_counter() - t0))
                    bar.update()
    bar.close()
    return rows


def _row(sel) -> list:
    acted = [r for r in sel if r["changed"]]
    spilled = [r for r in sel if r["overflow"] > 0]
    return [len(sel), f"{100 * len(acted) / len(sel):.0f} %",
            f"{100 * len(spilled) / len(sel):.0f} %" + (f" (max {max(r['overflow'] for r in spilled):.2f})"
                                                       if spilled else ""),
            f"{statistics.mean(r['moves'] for r in acted):.1f} / {max(r['moves'] for r in acted)}" if acted else "-",
            f"{statistics.mean(r['imbalance_before'] for r in sel):.2f} -> "
            f"{statistics.mean(r['imbalance_after'] for r in sel):.2f}"]


def report(rows, args) -> str:
    kinds = (("static", ("static",)), ("balancing", tuple(p for p in args.policies if p != "static")))
    table = []
    for factor in args.factors:
        for slots in args.slots:
            for kind, policies in kinds:
                sel = [r for r in rows if r["factor"] == factor and r["slots"] == slots and r["policy"] in policies]
                if sel:
                    table.append([f"{factor:g}", slots, kind, *_row(sel)])
    spill_cases = sorted({(r["factor"], r["slots"], r["ep"], r["workload"], r["policy"]) for r in rows
                          if r["overflow"] > 0})
    lines = [markdown_table(["factor", "slots", "policies", "plans", "changed", "spill (max rows / T k)",
                             "moves (mean / max)", "imbalance before -> after"], table), ""]
    if spill_cases:
        lines.append("Plans with rows beyond the capacity after the step (factor, slots, EP, routing, policy): "
                     + "; ".join(f"{f:g}, {s}, {e}, {w}, {p}" for f, s, e, w, p in spill_cases[:40])
                     + (" ..." if len(spill_cases) > 40 else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eps", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--domain", type=int, default=8, help="ranks per NVLink domain")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--slots", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--policies", nargs="+", default=["static", "topoep", "topoep_plus"])
    ap.add_argument("--factors", type=float, nargs="+", default=[1.0, 1.1, 1.25, 1.5])
    ap.add_argument("--expert-bytes", type=int, default=3 * 2048 * 768 * 2)
    ap.add_argument("--token-bytes", type=int, default=2048 * 2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=REPO / "results")
    ap.add_argument("--quiet", action="store_true")
    args = parse_options(ap, argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    rows = run(args)
    info = run_info(vars(args))
    text = "\n".join([
        "# The capacity factor: plans the capacity step changes, plans that still spill (reference planners, CPU)\n",
        f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']}",
        f"- EP {', '.join(map(str, args.eps))} (domains of {args.domain}), {args.experts} experts, top-{args.topk}, "
        f"{args.tokens} tokens per rank, policies {', '.join(args.policies)}; routing: uniform, megatron's skew "
        "-1 / -2 / -4 (random and clustered layouts), natural-like Zipf",
        f"- reproduce: `{command('capacity.py', args.argv, '--quiet')}` ({time.perf_counter() - t0:.0f} s here)\n",
        "Capacity = ceil(factor x T x k) rows per receive region (a rank's main experts', its replica slots'). "
        "`changed`: plans over the capacity that the step changed; `spill`: plans with rows left beyond it "
        "(backend cuda computes them on the spill path); imbalance: the mean over the plans, of the rank loads "
        "(both regions).\n",
        report(rows, args), ""])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "capacity.md").write_text(text)
    write_json(args.out / "capacity.json", info, rows)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
