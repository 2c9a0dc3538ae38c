"""How large a planning group should be (LayerConfig.plan_domain), in the simulator: the link sweep's cells of one
preset (GB200 NVL72 by default: one NVLink domain up to EP 64) run with the refining planners on groups of each size,
and the topoep_plus layers' missed targets per size, per EP.

    python bench/plan_domain.py                      # writes results/plan_domain.{md,json}

Each size is one `bench/link_sweep.py` run with `--plan-domain` (0: whole domains) and this script's other options
(default: the recommended relay configuration, `--fetch-overlap --relay-share --relay-schedule async`, the spread
planner at its measured time). The refining planners are timed at the groups' size (`sim.gpu_planner_s`: the
refinement's growth measured on one domain of 16-64 ranks). The peer column `topoep` plans on the same groups as the
topoep_plus layers. Nothing here ran on a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import link_sweep  # noqa: E402
from bench.common import REPO, command, markdown_table, parse_options, run_info, write_report  # noqa: E402
from topoep_research import sim  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 0],
                    help="planning group sizes to compare (0: whole domains)")
    ap.add_argument("--presets", nargs="+", default=["gb200_nvl72"], choices=list(sim.CLUSTERS))
    ap.add_argument("--eps", type=int, nargs="+", default=[16, 32, 64])
    ap.add_argument("--sweep-args", default="--fetch-overlap --relay-share --spread-planner measured --relay-schedule "
                    "async", help="the other bench/link_sweep.py options of every run (one string)")
    ap.add_argument("--name", default="plan_domain")
    ap.add_argument("--out", type=Path, default=REPO / "results")
    args = parse_options(ap, argv)
    if any(s < 0 for s in args.sizes) or len(set(args.sizes)) != len(args.sizes):
        raise SystemExit(f"--sizes must be distinct sizes >= 1, or 0 for whole domains, got {args.sizes}")
    return args


def sweep(args, size: int) -> tuple[list[dict], dict]:
    """One link sweep with the planners on groups of `size` (0: whole domains): its rows and its layers."""
    argv = [*args.sweep_args.split(), "--presets", *args.presets, "--eps", *map(str, args.eps),
            "--plan-domain", str(size), "--name", "unused"]
    sweep_args = link_sweep.parse_args(argv)
    return link_sweep.run(sweep_args), link_sweep.layers(sweep_args)


def summary(size: int, layer: str, rows: list[dict], eps: list[int]) -> list:
    verdicts = [link_sweep.verdict(r, layer) for r in rows]
    missed = [v for v in verdicts if not v["ok"]]
    per_ep = [sum(not v["ok"] for r, v in zip(rows, verdicts) if r["ep"] == ep) for ep in eps]
    return [size or "whole", layer, f"{len(missed)} of {len(rows)}", " / ".join(map(str, per_ep)),
            f"{max(v['vs_best'] for v in verdicts):.2f}", f"{statistics.median(v['vs_bound'] for v in verdicts):.2f}",
            f"{statistics.median(v['vs_static'] for v in verdicts):.3f}"]


def main(argv=None) -> None:
    args = parse_args(argv)
    table, raw = [], []
    for size in args.sizes:
        rows, ours = sweep(args, size)
        raw += [{**r, "plan_domain": size or None} for r in rows]
        table += [summary(size, layer, rows, args.eps) for layer in ours]
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()})
    text = "\n".join([
        "# The planning groups' size (LayerConfig.plan_domain), simulated",
        "",
        f"- date: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']} (a prediction: nothing here "
        "ran on a GPU)",
        f"- cells: `bench/link_sweep.py {args.sweep_args}` on {', '.join(args.presets)} at EP "
        f"{', '.join(map(str, args.eps))}, 1-4 slots, every routing scenario; one run per size with `--plan-domain` "
        "(the refining planners, topoep and topoep_plus with its local plan, balance inside groups of at most that many "
        "ranks of each NVLink domain and are timed at the groups' size; whole: the domain itself). Targets as the link "
        "sweep's: ours / static <= 1.00 (1.01 on uniform) and <= 1.01 x the best of guarded topoep (on the same groups), "
        "deepseek, fastermoe, flexmoe",
        f"- reproduce: `{command('plan_domain.py', args.argv)}`",
        "",
        markdown_table(["planning group", "layer", "cells missed", "missed at EP " + " / ".join(map(str, args.eps)),
                        "worst / best peer", "median / bound", "median / static"], table),
        "",
    ])
    write_report(args, text, raw)
    print(text)


if __name__ == "__main__":
    main()
