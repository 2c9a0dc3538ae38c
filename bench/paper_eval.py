"""The paper's section-6 experiments, end to end with `train.py` jobs (all of one call in one torchrun):

    python bench/paper_eval.py fig12                 # tokens/s vs router_skew: none, static, topoep + balanced bound
    python bench/paper_eval.py fig13                 # every policy at router_skew -4 (throughput, imbalance)
    python bench/paper_eval.py fig16                 # inter-node and replica-served shares per policy (fig13's runs)
    python bench/paper_eval.py fig14                 # loss curves: none vs topoep, static as control
    python bench/paper_eval.py fig12 --tiny          # CPU smoke: model=tiny, trainer=cpu, a few steps

Every configuration is a `train.py` job with its own directory,
`--runs/<model>-<backend>[-rpd<n>]/<eplb>-<routing>/` (metrics.jsonl, config.yaml, overrides.json; fig14's
longer runs under fig14/), shared by the figures that need the same run. The jobs of one call run in one
torchrun of `bench/eval_worker.py` (the process group and CUDA context are set up once). With `--resume` a
run whose metrics cover the requested steps and whose overrides are the same is not repeated, so a long
figure can be produced over several sessions. GPU defaults: model=qwen3 trainer=default (bf16, sequence
4096), all local GPUs (`--nproc`), EP = all ranks; `--set k=v` passes any further override to every run
(e.g. `--set model.num_layers=3` to reduce depth).

Per run: mean tokens/s over the steps after `--warmup`, and the mean MoE statistics the trainer logs
(imbalance before -> after balancing, inter-node and replica-served shares). Rows:
    eplb=none      megatron's own alltoall dispatcher and experts (the baseline)
    eplb=static    our layer and kernels without balancing (separates the gain of balancing from kernels)
    eplb=<policy>  our layer with that planner policy (topoep, deepseek, fastermoe, flexmoe, ...)
    bound          the same eplb on router=balanced (megatron's moe_router_force_load_balancing: every rank
                   the mean load in expectation): the balanced upper bound
Routing: `natural` (the router as trained) or router=synthetic with router_skew s and a bias layout:
`megatron` (megatron's shared random bias) or `concentrated` (the hot experts on rank 0's experts: large
rank imbalance even at EP 2).

Writes results/<figure>.md and .json (config, commit, hardware, every run's numbers, the targets of the
evaluation issue checked as ratios within this run) and a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO, markdown_table, run_info, without_options, write_json  # noqa: E402

FIGURES = ("fig12", "fig13", "fig14", "fig16")
ALL_POLICIES = ("none", "static", "topoep", "deepseek", "fastermoe", "flexmoe")


# -- runs ------------------------------------------------------------------------------------------
def routing_overrides(skew, layout: str) -> list[str]:
    if skew == "natural":
        return ["router=natural"]
    if skew == "balanced":
        return ["router=balanced"]
    return ["router=synthetic", f"router.router_skew={float(skew)}", f"router.layout={layout}"]


def routing_name(skew, layout: str) -> str:
    if skew in ("natural", "balanced"):
        return skew
    return f"skew {float(skew):g}" + ("" if layout == "megatron" else f" {layout}")


def run_dir(args, eplb: str, skew, layout: str, sub: str = "", rep: int = 1) -> Path:
    """runs/<model>-<backend>[-rpd<n>]/[sub/]<eplb>-<routing>[-r<rep>]: the throughput figures (12, 13, 16)
    share their runs (fig13's none/static/topoep at skew -4 are fig12's); fig14's longer runs go to sub fig14;
    repeat rep > 1 of a configuration (--repeats) gets its own directory."""
    tag = skew if skew in ("natural", "balanced") else f"skew{float(skew):g}-{layout}"
    tag += f"-r{rep}" if rep > 1 else ""
    group = f"{args.model}-{args.backend}" + ("-a2a" if args.transport == "a2a" else "") + (
        f"-rpd{args.ranks_per_domain}" if args.ranks_per_domain else "")
    return args.runs / group / sub / f"{eplb}-{tag}"


def job_overrides(args, out: Path, eplb: str, overrides: list[str], steps: int) -> list[str]:
    return [*base_overrides(args), f"eplb={eplb}", f"trainer.steps={steps}", f"trainer.run_dir={out}", "logger=none",
            *overrides, *args.set]


def _without_run_dir(overrides: list[str]) -> list[str]:
    return [o for o in overrides if not o.startswith("trainer.run_dir=")]


def is_done(out: Path, overrides: list[str], steps: int, nproc: int | None = None) -> bool:
    """The run's metrics cover `steps` and it ran with the same overrides (overrides.json; its own folder
    is left out of the comparison, so runs copied to another path still count) on the same number of
    processes (host.json; when nproc is given)."""
    metrics, saved, host = out / "metrics.jsonl", out / "overrides.json", out / "host.json"
    if not (metrics.exists() and saved.exists()):
        return False
    if _without_run_dir(json.loads(saved.read_text())) != _without_run_dir(overrides):
        return False
    if nproc and host.exists() and json.loads(host.read_text()).get("nproc", nproc) != nproc:
        return False
    return len(read_metrics(metrics)) >= steps


def launch_all(args, jobs: list[tuple[Path, str, list[str], int]]) -> None:
    """Run every (out, eplb, routing overrides, steps) job not done before (with --resume) in one torchrun
    of bench/eval_worker.py: the process group and CUDA context are set up once for all of them. The worker
    writes each run's overrides.json and host.json when the run starts (a run that never started keeps its
    earlier files)."""
    plan, skipped = [], 0
    if args.report_only:
        missing = [str(out) for out, eplb, overrides, steps in jobs
                   if not is_done(out, job_overrides(args, out, eplb, overrides, steps), steps, args.nproc)]
        if missing:
            raise SystemExit(f"--report-only: {len(missing)} runs are missing or ran with other overrides (run "
                             f"without --report-only to make them): " + ", ".join(missing))
        return
    for out, eplb, overrides, steps in jobs:
        full = job_overrides(args, out, eplb, overrides, steps)
        if args.resume and is_done(out, full, steps, args.nproc):
            skipped += 1
            continue
        plan.append({"name": out.name, "out": str(out), "overrides": full})
    print(f"  {len(plan)} runs to do" + (f", {skipped} done before (--resume)" if skipped else ""), flush=True)
    if not plan:
        return
    root = Path(plan[0]["out"]).parent
    root.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    plan_file, log = root / f"plan-{stamp}.json", root / f"worker-{stamp}.log"
    plan_file.write_text(json.dumps(plan, indent=1))
    for p in plan:
        print(f"    {p['name']}: {' '.join(p['overrides'])}", flush=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
           str(REPO / "bench" / "eval_worker.py"), str(plan_file)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_SILENT": "true"})
        for line in proc.stdout:  # the whole log to the file; the worker's progress lines to the console
            f.write(line)
            if line.startswith("[") and "] " in line:
                print("  " + line.rstrip(), flush=True)
        rc = proc.wait()
    if rc != 0:
        tail = "".join(open(log).readlines()[-30:])
        raise RuntimeError(f"the evaluation worker failed (exit {rc}); log {log}:\n{tail}")


def base_overrides(args) -> list[str]:
    if args.tiny:
        return [f"model={args.model}", "trainer=cpu", "topology=virtual",
                f"topology.ranks_per_domain={args.ranks_per_domain or 1}", f"eplb.backend={args.backend}"]
    out = [f"model={args.model}", "trainer=default", f"eplb.backend={args.backend}"]
    if args.transport != "peer":
        out += [f"eplb.transport={args.transport}", "eplb.capacity_factor=null"]  # a2a: worst-case buffers
    if args.ranks_per_domain:
        out += ["topology=virtual", f"topology.ranks_per_domain={args.ranks_per_domain}"]
    return out


def read_metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def read_host(out: Path) -> dict | None:
    """Where and at which commit a run was measured (its host.json, written by bench/eval_worker.py)."""
    host = out / "host.json"
    return json.loads(host.read_text()) if host.exists() else None


def summarize(path: Path, warmup: int) -> dict:
    """Mean tokens/s and MoE statistics over the steps after warm-up."""
    rows = [m for m in read_metrics(path) if m["step"] > warmup and not m.get("skipped")]
    if not rows:
        raise RuntimeError(f"{path}: no step after the {warmup} warm-up steps; raise --steps")

    def mean(key):
        vals = [m[key] for m in rows if key in m]
        return statistics.fmean(vals) if vals else None

    tps = [m["tokens_per_s"] for m in rows]
    return {"host": read_host(path.parent), "steps": len(rows), "tokens_per_s": statistics.fmean(tps),
            "tokens_per_s_std": statistics.pstdev(tps), "step_time_s": mean("step_time_s"),
            "imbalance_before": mean("moe/imbalance_before"), "imbalance_after": mean("moe/imbalance_after"),
            "internode_before": mean("moe/internode_before"), "internode_after": mean("moe/internode_after"),
            "replica_fraction": mean("moe/replica_fraction"), "guard_fired": mean("moe/guard_fired"),
            "loss": [m["loss"] for m in read_metrics(path)]}


# -- figures ---------------------------------------------------------------------------------------
def throughput_figure(args, policies: list[str], skews: list, layouts: list[str]) -> list[dict]:
    rows = []
    cases = [(s, lay) for s in skews for lay in (["megatron"] if s == "natural" else layouts)]
    bound_policies = [p for p in policies if p in ("none", "static", "topoep")]
    todo = [(eplb, skew, layout) for eplb in policies
            for skew, layout in cases + ([("balanced", "megatron")] if eplb in bound_policies else [])]
    reps = range(1, args.repeats + 1)
    # repeat-major order: every configuration once, then again, so that a drift of the machine over the
    # call affects every configuration alike
    launch_all(args, [(run_dir(args, e, s, lay, rep=i), e, routing_overrides(s, lay), args.steps)
                      for i in reps for e, s, lay in todo])
    for eplb, skew, layout in todo:
        r = merge_repeats([summarize(run_dir(args, eplb, skew, layout, rep=i) / "metrics.jsonl", args.warmup)
                           for i in reps])
        r.update(eplb=eplb, routing=routing_name(skew, layout), skew=skew, layout=layout)
        rows.append(r)
    relate(rows)
    return rows


def merge_repeats(runs: list[dict]) -> dict:
    """One row from the repeats of a configuration: tokens/s and the MoE statistics averaged over the runs;
    tokens_per_s_std is the spread across the runs' means when there are several (within the run otherwise)."""
    if len(runs) == 1:
        return {**runs[0], "repeats": 1}
    out = {"hosts": [r["host"] for r in runs if r["host"]], "repeats": len(runs),
           "steps": sum(r["steps"] for r in runs), "tokens_per_s_runs": [r["tokens_per_s"] for r in runs],
           "loss": runs[0]["loss"]}
    out["tokens_per_s"] = statistics.fmean(out["tokens_per_s_runs"])
    out["tokens_per_s_std"] = statistics.stdev(out["tokens_per_s_runs"])
    for k in ("step_time_s", "imbalance_before", "imbalance_after", "internode_before", "internode_after",
              "replica_fraction", "guard_fired"):
        vals = [r[k] for r in runs if r[k] is not None]
        out[k] = statistics.fmean(vals) if vals else None
    return out


def relate(rows: list[dict]) -> None:
    """vs_static / vs_none (same routing) and vs_bound (same eplb on balanced routing)."""
    by = {(r["eplb"], r["routing"]): r for r in rows}
    for r in rows:
        for ref in ("static", "none"):
            o = by.get((ref, r["routing"]))
            r[f"vs_{ref}"] = r["tokens_per_s"] / o["tokens_per_s"] if o else None
        b = by.get((r["eplb"], "balanced"))
        r["vs_bound"] = r["tokens_per_s"] / b["tokens_per_s"] if b else None


def check_targets(rows: list[dict]) -> list[str]:
    """The evaluation issue's targets, as measured ratios of this run."""
    out = []
    topo = [r for r in rows if r["eplb"] == "topoep" and r["routing"] not in ("balanced",)]
    for r in topo:
        if r["vs_static"] is not None:
            ok = r["vs_static"] >= 0.98
            out.append(f"{'met' if ok else 'MISSED'}: topoep >= 0.98 x static at {r['routing']}: {r['vs_static']:.3f}")
    for r in topo:
        if r["skew"] not in ("natural",) and float(r["skew"]) == -4.0 and r["vs_bound"] is not None:
            ok = r["vs_bound"] >= 0.90
            out.append(f"{'met' if ok else 'MISSED'}: topoep >= 0.90 x balanced bound at {r['routing']}: "
                       f"{r['vs_bound']:.3f}")
    by = {(r["eplb"], r["routing"]): r for r in rows}
    for r in rows:  # at skew 0 every layout is the same configuration: the second run is a repeat
        if r["skew"] not in ("natural", "balanced") and float(r["skew"]) == 0 and r["layout"] != "megatron":
            o = by.get((r["eplb"], routing_name(r["skew"], "megatron")))
            if o:
                out.append(f"run-to-run spread (not a target): eplb={r['eplb']} at skew 0 measured twice (layouts "
                           f"megatron and {r['layout']} coincide there): {o['tokens_per_s']:,.0f} vs "
                           f"{r['tokens_per_s']:,.0f} tok/s "
                           f"({100 * abs(o['tokens_per_s'] / r['tokens_per_s'] - 1):.1f} %)")
    for layout in sorted({r["layout"] for r in topo if r["skew"] != "natural"}):
        tps = [r["tokens_per_s"] for r in topo if r["skew"] != "natural" and r["layout"] == layout]
        if len(tps) > 1:
            spread = (max(tps) - min(tps)) / max(tps)
            out.append(f"{'met' if spread < 0.03 else 'MISSED'}: topoep tokens/s varies < 3 % across skews "
                       f"({layout} layout): {100 * spread:.1f} %")
    return out


def _ema(xs: list[float], alpha: float = 0.1) -> list[float]:
    out, m = [], xs[0]
    for x in xs:
        m = alpha * x + (1 - alpha) * m
        out.append(m)
    return out


def _rel(a: list[float], b: list[float]) -> list[float]:
    """Per-step relative difference of b against a, over their common steps."""
    return [abs(y - x) / abs(x) for x, y in zip(a, b)]


def _rel_ema(a: list[float], b: list[float]) -> list[float]:
    """The same after an EMA (0.1) of each curve (what the report's EMA column averages and fig14 plots)."""
    n = min(len(a), len(b))
    return _rel(_ema(a[:n]), _ema(b[:n]))


def loss_difference(a: list[float], b: list[float]) -> dict:
    """Per-step relative difference of two loss curves (b against a), raw and after an EMA (0.1) of each."""
    rel = _rel(a, b)
    return {"steps": len(rel), "step1_a": a[0], "step1_b": b[0], "step1_rel_diff": rel[0],
            "mean_rel_diff": statistics.fmean(rel), "max_rel_diff": max(rel),
            "max_step": 1 + max(range(len(rel)), key=rel.__getitem__),
            "mean_rel_diff_ema": statistics.fmean(_rel_ema(a, b))}


def loss_figure(args) -> tuple[list[dict], list[str]]:
    """none vs topoep (the target) and, as a control, every other policy asked for (default static: our layer
    and kernels without balancing): how far two bf16 trajectories drift from reduction order alone."""
    eplbs = ["none", "topoep"] + [p for p in args.policies if p not in ("none", "topoep")]
    outs = {eplb: run_dir(args, eplb, "natural", "megatron", sub="fig14") for eplb in eplbs}
    launch_all(args, [(out, eplb, ["router=natural"], args.loss_steps) for eplb, out in outs.items()])
    rows = [{"eplb": eplb, "loss": [m["loss"] for m in read_metrics(out / "metrics.jsonl")], "host": read_host(out)}
            for eplb, out in outs.items()]
    loss = {r["eplb"]: r["loss"] for r in rows}
    pairs = [("none", e) for e in eplbs[1:]] + [(e, "topoep") for e in eplbs[2:]]
    diffs = [{"eplb": "difference", "a": a, "b": b, **loss_difference(loss[a], loss[b])} for a, b in pairs]
    d = diffs[0]  # none vs topoep
    # step 1 sees the same weights, data and routing: only float reduction order differs (other kernels)
    targets = [f"{'met' if d['step1_rel_diff'] < 1e-4 else 'MISSED'}: same step-1 loss up to reduction order "
               f"(relative difference < 1e-4): {d['step1_a']:.8f} vs {d['step1_b']:.8f} ({d['step1_rel_diff']:.1e})",
               f"{'met' if d['mean_rel_diff'] < 0.005 else 'MISSED'}: mean relative loss difference < 0.5 %: "
               f"{100 * d['mean_rel_diff']:.3f} % (max {100 * d['max_rel_diff']:.3f} %) over {d['steps']} steps"]
    return rows + diffs, targets


def loss_table(rows: list[dict]) -> str:
    return markdown_table(
        ["a", "b", "steps", "step-1 loss a", "step-1 loss b", "mean rel. diff", "max rel. diff (step)",
         "mean rel. diff of EMA(0.1)"],
        [[r["a"], r["b"], r["steps"], f"{r['step1_a']:.6f}", f"{r['step1_b']:.6f}", f"{100 * r['mean_rel_diff']:.3f} %",
          f"{100 * r['max_rel_diff']:.3f} % ({r['max_step']})", f"{100 * r['mean_rel_diff_ema']:.3f} %"]
         for r in rows if r["eplb"] == "difference"])


# -- reports ---------------------------------------------------------------------------------------
def fmt(v, f="{:.2f}"):
    return "-" if v is None else f.format(v)


def throughput_table(rows: list[dict]) -> str:
    return markdown_table(
        ["eplb", "routing", "tokens/s", "vs static", "vs none", "vs bound", "imbalance before -> after",
         "inter-node after", "replica-served", "guard fired", "steps"],
        [[r["eplb"], r["routing"], f"{r['tokens_per_s']:,.0f} ± {r['tokens_per_s_std']:,.0f}", fmt(r["vs_static"], "{:.3f}"),
          fmt(r["vs_none"], "{:.3f}"), fmt(r["vs_bound"], "{:.3f}"),
          f"{fmt(r['imbalance_before'])} -> {fmt(r['imbalance_after'])}", fmt(r["internode_after"], "{:.3f}"),
          fmt(r["replica_fraction"], "{:.3f}"), fmt(r["guard_fired"], "{:.2f}"), r["steps"]] for r in rows])


def locality_table(rows: list[dict]) -> str:
    return markdown_table(
        ["eplb", "routing", "inter-node before", "inter-node after", "replica-served", "imbalance after"],
        [[r["eplb"], r["routing"], fmt(r["internode_before"], "{:.3f}"), fmt(r["internode_after"], "{:.3f}"),
          fmt(r["replica_fraction"], "{:.3f}"), fmt(r["imbalance_after"])] for r in rows if r["routing"] != "balanced"])


def plot_throughput(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for (eplb, layout) in sorted({(r["eplb"], r["layout"]) for r in rows if r["skew"] not in ("natural", "balanced")}):
        pts = sorted((float(r["skew"]), r["tokens_per_s"]) for r in rows
                     if r["eplb"] == eplb and r["layout"] == layout and r["skew"] not in ("natural", "balanced"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{eplb} ({layout})")
    for r in rows:
        if r["routing"] == "balanced":
            ax.axhline(r["tokens_per_s"], ls=":", lw=1, color="gray")
            ax.annotate(f"bound ({r['eplb']})", (0, r["tokens_per_s"]), fontsize=7, color="gray")
    ax.set_xlabel("router_skew")
    ax.set_ylabel("tokens/s")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_policies(rows: list[dict], path: Path, title: str) -> None:
    """Per routing: tokens/s of every policy (bars) and its rank imbalance after balancing (dots), with the
    inter-node and replica-served shares written on the bars (Fig. 13 / Fig. 16)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    routings = [x for x in dict.fromkeys(r["routing"] for r in rows) if x != "balanced"]
    fig, axes = plt.subplots(1, len(routings), figsize=(4.5 * len(routings), 4), squeeze=False)
    for ax, routing in zip(axes[0], routings):
        sel = [r for r in rows if r["routing"] == routing]
        xs = range(len(sel))
        ax.bar(xs, [r["tokens_per_s"] for r in sel], yerr=[r["tokens_per_s_std"] for r in sel], color="tab:blue",
               alpha=0.7, capsize=3)
        for i, r in enumerate(sel):
            ax.annotate(f"inter {fmt(r['internode_after'], '{:.2f}')}\nrepl {fmt(r['replica_fraction'], '{:.2f}')}",
                        (i, r["tokens_per_s"] * 0.5), ha="center", fontsize=6, color="white")
        ax.set_xticks(list(xs), [r["eplb"] for r in sel], rotation=30, fontsize=7)
        ax.set_ylabel("tokens/s")
        ax.set_title(routing, fontsize=8)
        ax2 = ax.twinx()
        ax2.plot(list(xs), [r["imbalance_before"] or 1 for r in sel], "x", color="gray", label="imbalance before")
        ax2.plot(list(xs), [r["imbalance_after"] or 1 for r in sel], "o", color="tab:red", label="imbalance after")
        ax2.set_ylabel("max / mean rank load")
        ax2.set_ylim(bottom=0.9)
        ax2.legend(fontsize=6, loc="upper right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_loss(rows: list[dict], path: Path) -> None:
    """Left: the loss curves. Right: each policy's per-step relative difference to `none`, both curves after
    an EMA (0.1), as in the report's EMA column."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {r["eplb"]: r["loss"] for r in rows if r["eplb"] != "difference"}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4))
    for eplb, loss in curves.items():
        ax.plot(range(1, len(loss) + 1), loss, label=f"eplb={eplb}", lw=1)
        if eplb != "none":
            rel = _rel_ema(curves["none"], loss)
            bx.plot(range(1, len(rel) + 1), [100 * x for x in rel], label=f"{eplb} vs none", lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    bx.set_xlabel("step")
    bx.set_ylabel("relative loss difference, EMA(0.1) (%)")
    bx.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TITLES = {"fig12": "Fig. 12: tokens/s vs router skew", "fig13": "Fig. 13: every policy at router_skew -4",
          "fig16": "Fig. 16: inter-node and replica-served shares per policy", "fig14": "Fig. 14: loss curves"}


def report(args, fig: str, rows: list[dict], targets: list[str], body: str) -> None:
    info = run_info({k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "runs"})
    hosts = sorted({json.dumps(h, sort_keys=True) for r in rows for h in (r.get("hosts") or [r.get("host")]) if h})
    if hosts:  # where the runs were measured (this machine may only render the report: --report-only)
        hs = [json.loads(h) for h in hosts]
        info["runs_hardware"] = sorted({h["hardware"] for h in hs})
        info["runs_commit"] = sorted({h["commit"] for h in hs})
        info["runs_date"] = [min(h["date"] for h in hs), max(h["date"] for h in hs)]
        info["runs_nproc"] = sorted({h.get("nproc") or args.nproc for h in hs})
    cmd = "python bench/paper_eval.py " + " ".join(a for a in args.argv if a != "--report-only")
    where = (f"- runs measured {info['runs_date'][0]} to {info['runs_date'][1]} on {'; '.join(info['runs_hardware'])} "
             f"at commit {', '.join(f'`{c}`' for c in info['runs_commit'])}\n" if hosts else "")
    made = "report made" if hosts else "date"
    nproc = ", ".join(str(n) for n in info.get("runs_nproc", [args.nproc]))
    md = (f"# {TITLES[fig]}\n\n- {made}: {info['date']}; commit: `{info['commit']}`; hardware: {info['hardware']}\n"
          + where +
          f"- runs: model={args.model} {'trainer=cpu (CPU smoke)' if args.tiny else 'trainer=default'}; "
          f"{nproc} processes; TopoEP backend {args.backend}"
          + (f" (transport {args.transport})" if args.transport != "peer" else "")
          + f"; overrides: {' '.join(args.set) or '-'}; tokens/s: "
          + (f"mean over {args.repeats} interleaved runs per configuration ± the spread of their means, each run "
             if args.repeats > 1 else "mean ± std ")
          + f"over the steps after {args.warmup} warm-up steps\n- reproduce: `{cmd}`\n\n" + body
          + "\n\n## Targets (ratios measured in this run)\n\n"
          + "\n".join(f"- {t}" for t in targets) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.md").write_text(md)
    write_json(args.out / f"{args.name}.json", info, rows)
    print(md)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("figure", choices=FIGURES)
    ap.add_argument("--model", default=None,
                    help="model config (default qwen3; --tiny: tiny, or tiny_glm45air / tiny_deepseekv2)")
    ap.add_argument("--nproc", type=int, default=None, help="processes (default: all GPUs; --tiny: 2)")
    ap.add_argument("--ranks-per-domain", type=int, default=None,
                    help="virtual NVLink domains of this many ranks (default: a node; --tiny: 1)")
    ap.add_argument("--steps", type=int, default=None, help="steps per run (default 30; --tiny 3)")
    ap.add_argument("--warmup", type=int, default=None, help="steps left out of the means (default 10; --tiny 1)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per configuration (throughput figures), interleaved; tokens/s is their mean and "
                         "± their spread")
    ap.add_argument("--loss-steps", type=int, default=None, help="fig14 steps (default 300; --tiny 4)")
    ap.add_argument("--skews", nargs="+", default=None,
                    help="natural and/or router_skew values (default: natural 0 -1 -2 -3 -4; fig13/16: -4)")
    ap.add_argument("--layouts", nargs="+", default=["megatron", "concentrated"],
                    help="synthetic bias layouts (megatron, concentrated, ...)")
    ap.add_argument("--policies", nargs="+", default=None,
                    help=f"eplb values (fig12 default: none static topoep; fig13/16: {' '.join(ALL_POLICIES)})")
    ap.add_argument("--backend", choices=["torch", "cuda"], default=None,
                    help="execution backend of the TopoEP layer (eplb.backend; default: cuda on GPUs, torch with "
                         "--tiny); eplb=none ignores it")
    ap.add_argument("--transport", choices=["peer", "a2a"], default="peer",
                    help="backend cuda's data movement (eplb.transport): peer pointers, or NVSHMEM all-to-alls (a2a: "
                         "with --ranks-per-domain, the virtual domains' traffic takes the path of real RDMA)")
    ap.add_argument("--name", default=None, help="base name of the report files (default: the figure)")
    ap.add_argument("--set", nargs="*", default=[], help="extra Hydra overrides for every run")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: model=tiny trainer=cpu, few steps")
    ap.add_argument("--resume", action="store_true", help="skip runs whose metrics already cover the steps")
    ap.add_argument("--report-only", action="store_true",
                    help="run nothing: make the report from the runs in --runs (all must exist; e.g. runs copied "
                         "back from the GPU machine); the report names the machine and commit they ran on")
    ap.add_argument("--runs", type=Path, default=REPO / "runs" / "eval", help="where the runs go")
    ap.add_argument("--out", type=Path, default=REPO / "results", help="where the reports go")
    args = ap.parse_args(argv)
    args.argv = without_options(argv if argv is not None else sys.argv[1:], "--runs", "--out")
    if args.nproc is None and args.report_only:
        args.nproc = 2 if args.tiny else 0  # not used: nothing is launched
    if args.nproc is None:
        if args.tiny:
            args.nproc = 2
        else:
            import torch

            args.nproc = max(1, torch.cuda.device_count())
            if not torch.cuda.is_available():
                raise SystemExit("GPU runs need CUDA; use --tiny for the CPU smoke")
    if args.backend is None:
        args.backend = "torch" if args.tiny else "cuda"
    if args.model is None:
        args.model = "tiny" if args.tiny else "qwen3"
    if args.tiny and not args.model.startswith("tiny"):
        raise SystemExit(f"--tiny runs on the CPU: --model must be a tiny model (tiny, tiny_glm45air, "
                         f"tiny_deepseekv2), got {args.model}")
    args.steps = args.steps or (3 if args.tiny else 30)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 10)
    args.loss_steps = args.loss_steps or (4 if args.tiny else 300)
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    args.name = args.name or args.figure
    if args.transport != "peer" and (args.tiny or args.backend == "torch"):
        raise SystemExit(f"--transport {args.transport} is backend cuda's (GPUs): leave it out with --tiny or "
                         "--backend torch")
    if args.warmup >= args.steps:
        raise SystemExit(f"--warmup {args.warmup} must be below --steps {args.steps}")
    if args.skews is None:
        args.skews = ["natural", "0", "-1", "-2", "-3", "-4"] if args.figure == "fig12" else ["-4"]
    args.skews = [s if s == "natural" else str(float(s)) for s in args.skews]
    for s in args.skews:
        if s != "natural" and float(s) > 0:
            raise SystemExit(f"--skews: router_skew must be <= 0 (a fixed bias per layer), got {s}")
    if args.policies is None:
        args.policies = ["none", "static", "topoep"] if args.figure in ("fig12", "fig14") else list(ALL_POLICIES)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    fig = args.figure
    print(f"{TITLES[fig]}: runs in {args.runs}", flush=True)
    if fig == "fig14":
        rows, targets = loss_figure(args)
        body = loss_table(rows)
        args.out.mkdir(parents=True, exist_ok=True)
        plot_loss(rows, args.out / f"{args.name}.png")
        body += f"\n\n![loss curves]({args.name}.png)"
    else:
        rows = throughput_figure(args, args.policies, args.skews, args.layouts)
        targets = check_targets(rows)
        body = locality_table(rows) if fig == "fig16" else throughput_table(rows)
        args.out.mkdir(parents=True, exist_ok=True)
        if fig == "fig12":
            plot_throughput(rows, args.out / f"{args.name}.png", TITLES[fig])
            body += f"\n\n![tokens/s vs skew]({args.name}.png)"
        else:
            plot_policies(rows, args.out / f"{args.name}.png", TITLES[fig])
            body += f"\n\n![every policy]({args.name}.png)"
        for r in rows:
            r.pop("loss", None)
    report(args, fig, rows, targets, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
