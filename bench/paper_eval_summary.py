"""Summary of the paper's section 6 (Figs. 12-16) from the committed per-figure reports:

    python bench/paper_eval_summary.py            # writes results/paper_eval.md

Reads the JSON that `bench/paper_eval.py` wrote beside each report (results/fig12*.json, fig13.json, fig14.json,
fig16_cpu_2x2.json) and needs no GPU and no run directories: every number here is one of those reports'
numbers or a ratio, minimum or maximum of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, markdown_table  # noqa: E402

THROUGHPUT = {"qwen3": "fig12", "glm45air": "fig12_glm45air", "deepseekv2": "fig12_deepseekv2"}
REPEATS, POLICIES, LOSS, LOCALITY = "fig12_repeats", "fig13", "fig14", "fig16_cpu_2x2"
LINKED = ["fig12", "fig12_repeats", "fig12_glm45air", "fig12_deepseekv2", "fig13", "fig14", "fig15", "fig16",
          "fig16_repeats", "fig16_cpu_2x2", "fig16_layer", "fig12_torch_balanced_rpd1", "fig12_torch_balanced_rpd2"]


def load(results: Path, name: str) -> dict:
    return json.loads((results / f"{name}.json").read_text())


def rng(vals: list[float], f: str = "{:.3f}") -> str:
    if not vals:
        return "-"
    lo, hi = min(vals), max(vals)
    return f.format(lo) if f.format(lo) == f.format(hi) else f"{f.format(lo)}-{f.format(hi)}"


def row_of(rows: list[dict], eplb: str, routing: str) -> dict | None:
    return next((r for r in rows if r["eplb"] == eplb and r["routing"] == routing), None)


def tps(r: dict | None, spread: bool = False) -> str:
    if r is None:
        return ""
    return f"{r['tokens_per_s']:,.0f}" + (f" ± {r['tokens_per_s_std']:,.0f}" if spread else "")


def throughput_table(rows: list[dict], spread: bool = False) -> str:
    """One line per routing of topoep: its rank imbalance, none / static / topoep tokens/s, the share of calls where
    the guard ran the static plan, and topoep's ratios (the none column only where the report has none's runs)."""
    has_none = any(r["eplb"] == "none" for r in rows)
    lines = []
    for t in (r for r in rows if r["eplb"] == "topoep"):
        lines.append([t["routing"], f"{t['imbalance_before']:.2f} -> {t['imbalance_after']:.2f}",
                      *([tps(row_of(rows, "none", t["routing"]), spread)] if has_none else []),
                      tps(row_of(rows, "static", t["routing"]), spread), tps(t, spread),
                      f"{100 * (t['guard_fired'] or 0):.0f} %", f"{t['vs_static']:.3f}", f"{t['vs_bound']:.3f}"])
    return markdown_table(["routing", "topoep's imbalance before -> after", *(["none (megatron)"] if has_none else []),
                           "static", "topoep", "guard fired", "topoep / static", "topoep / bound"], lines)


def skewed(rows: list[dict], eplb: str) -> list[dict]:
    return [r for r in rows if r["eplb"] == eplb and r["routing"] != "balanced"]


def targets(reports: dict[str, list[dict]]) -> str:
    """The evaluation targets per model (ratios of each report's own runs)."""
    def cell(rows, what):
        topo = skewed(rows, "topoep")
        if what == "static":
            vals = [r["vs_static"] for r in topo]
            return f"{rng(vals)} ({'met' if min(vals) >= 0.98 else 'missed'})"
        if what == "bound":
            vals = [r["vs_bound"] for r in topo if r["skew"] != "natural" and float(r["skew"]) == -4.0]
            return f"{rng(vals)} ({'met' if min(vals) >= 0.90 else 'missed'})" if vals else "-"
        if what == "skews":
            out = []
            for layout in sorted({r["layout"] for r in topo if r["skew"] != "natural"}):
                v = [r["tokens_per_s"] for r in topo if r["skew"] != "natural" and r["layout"] == layout]
                if len(v) > 1:
                    s = 100 * (max(v) - min(v)) / max(v)
                    out.append(f"{layout} {s:.1f} % ({'met' if s < 3 else 'missed'})")
            return "; ".join(out)
        if what == "kernels":
            return rng([r["vs_none"] for r in rows if r["eplb"] == "static" and r["vs_none"]], "{:.2f}")
    names = list(reports)
    lines = [[label, *(cell(reports[n], what) for n in names)] for label, what in [
        ("topoep / static at every skew (target >= 0.98)", "static"),
        ("topoep / balanced bound at skew -4 (target >= 0.90)", "bound"),
        ("topoep's tokens/s across skews, per bias layout (target < 3 %)", "skews"),
        ("static / none: our layer and kernels against megatron's, no balancing", "kernels")]]
    return markdown_table(["target", *names], lines)


def policies_table(rows: list[dict]) -> str:
    routings = [x for x in dict.fromkeys(r["routing"] for r in rows) if x != "balanced"]
    lines = [[e, *(f"{r['vs_static']:.3f} ({r['imbalance_after']:.2f})" if (r := row_of(rows, e, x)) else "-"
                   for x in routings)]
             for e in dict.fromkeys(r["eplb"] for r in rows) if e not in ("none", "static")]
    return markdown_table(["policy", *(f"{x}: vs static (imbalance after)" for x in routings)], lines)


def loss_table(rows: list[dict]) -> str:
    return markdown_table(["a", "b", "steps", "step-1 relative difference", "mean relative difference",
                           "max (step)", "mean after an EMA (0.1)"],
                          [[r["a"], r["b"], r["steps"], f"{r['step1_rel_diff']:.1e}",
                            f"{100 * r['mean_rel_diff']:.2f} %", f"{100 * r['max_rel_diff']:.1f} % ({r['max_step']})",
                            f"{100 * r['mean_rel_diff_ema']:.2f} %"] for r in rows if r["eplb"] == "difference"])


def locality_table(rows: list[dict]) -> str:
    routings = [x for x in dict.fromkeys(r["routing"] for r in rows) if x != "balanced"]
    lines = []
    for e in dict.fromkeys(r["eplb"] for r in rows if r["eplb"] != "none"):
        rs = [row_of(rows, e, x) for x in routings]
        lines.append([e, " / ".join(f"{r['internode_after']:.3f}" for r in rs),
                      " / ".join(f"{r['replica_fraction']:.3f}" for r in rs),
                      " / ".join(f"{r['imbalance_after']:.2f}" for r in rs)])
    return markdown_table(["policy", "inter-node after", "replica-served", "imbalance after"], lines), routings


def provenance(docs: list[dict]) -> str:
    hw = sorted({h for d in docs for h in d.get("runs_hardware", [])})
    commits = sorted({c for d in docs for c in d.get("runs_commit", [])})
    dates = [x for d in docs for x in d.get("runs_date", [])]
    return (f"- runs measured {min(dates)} to {max(dates)} on {'; '.join(hw)}, at commits "
            f"{', '.join(f'`{c}`' for c in commits)} (each report names its own)")


def summary(results: Path) -> str:
    fig12 = {m: load(results, n) for m, n in THROUGHPUT.items()}
    rep, pol, loss, loc = (load(results, n) for n in (REPEATS, POLICIES, LOSS, LOCALITY))
    setup = "; ".join(f"{m}: {' '.join(d['config']['set']) or 'as configured'}" for m, d in fig12.items())
    loc_table, loc_routings = locality_table(loc["rows"])
    md = ["# The paper's section 6 on 2 x H200 (EP 2): summary of Figs. 12-16\n",
          "- made by `python bench/paper_eval_summary.py` from the per-figure reports' JSON (their commands are in "
          "each report): " + ", ".join(f"[{n}.md]({n}.md)" for n in LINKED),
          provenance([*fig12.values(), rep, pol, loss]),
          f"- EP 2, backend cuda, 2 replica slots per rank; overrides per model: {setup}; tokens/s: mean over the "
          "steps after the warm-up steps (see each report)",
          "- `none` is megatron-core's alltoall dispatcher with its SequentialMLP experts (a loop over the experts; "
          "no Transformer Engine on this stack): `static / none` compares our grouped GEMMs and dispatch with that "
          "loop, not balancing; `topoep / static` is what balancing adds",
          "- imbalance: max / mean rank load, before -> after balancing; bound: the same `eplb` on megatron's forced "
          "balanced routing\n",
          "## Throughput (Fig. 12)\n"]
    for m, d in fig12.items():
        md += [f"**{m}** ([{THROUGHPUT[m]}.md]({THROUGHPUT[m]}.md)):\n", throughput_table(d["rows"]), ""]
    md += [f"**qwen3, {rep['config']['repeats']} interleaved runs per configuration** ([{REPEATS}.md]({REPEATS}.md); "
           "mean ± spread of the run means):\n", throughput_table(rep["rows"], spread=True), "",
           "## Targets (each model's own runs)\n",
           targets({m: d["rows"] for m, d in fig12.items()} | {"qwen3, repeats": rep["rows"]}), "",
           f"## Every policy at skew -4 (Fig. 13, qwen3; [{POLICIES}.md]({POLICIES}.md))\n",
           policies_table(pol["rows"]), "",
           f"## Loss (Fig. 14, qwen3, natural routing; [{LOSS}.md]({LOSS}.md))\n",
           loss_table(loss["rows"]), "",
           "`none` against `static` (our layer without balancing) is the control: two bf16 runs whose kernels reduce "
           "in different orders drift apart by that much without any balancing.\n",
           f"## Locality (Fig. 16, 2 domains of 2 ranks on the CPU, tiny model; [{LOCALITY}.md]({LOCALITY}.md))\n",
           f"Per policy, {' / '.join(loc_routings)}; shares and imbalance of the plans made in training (tokens/s on "
           "2 CPU cores mean nothing):\n", loc_table, "",
           "On 2 GPUs, 2 domains have 1 rank each and the net-benefit guard keeps every replica off the modelled "
           "fabric ([fig16.md](fig16.md)); [fig16.md](fig16.md), [fig16_repeats.md](fig16_repeats.md) and "
           "[fig12_torch_balanced_rpd1.md](fig12_torch_balanced_rpd1.md) ran backend torch before it stacked "
           "megatron's experts into one grouped GEMM (their commits), so their balanced runs are no bound; "
           "[fig12_torch_balanced_rpd2.md](fig12_torch_balanced_rpd2.md) is the same probe after it.\n"]
    return "\n".join(md)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", type=Path, default=REPO / "results", help="folder of the per-figure reports")
    args = ap.parse_args(argv)
    text = summary(args.results)
    (args.results / "paper_eval.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
