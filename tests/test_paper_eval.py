"""The section-6 evaluation driver (bench/paper_eval.py) end to end on the CPU: tiny model, 2 processes,
a few steps per run. Checks that every configuration ran, the ratios relate the right runs, the targets
are evaluated and the reports are written (the numbers themselves are CPU smoke, not results)."""

import json
import os
import subprocess
import sys

import pytest

from bench import paper_eval


def test_fig12_fig16_fig14_tiny(tmp_path):
    runs, out = tmp_path / "runs", tmp_path / "out"
    common = ["--tiny", "--runs", str(runs), "--out", str(out)]
    assert paper_eval.main(["fig12", "--skews", "-4", "--layouts", "concentrated", "--policies", "none", "topoep",
                            *common]) == 0
    rows = json.loads((out / "fig12.json").read_text())["rows"]
    got = {(r["eplb"], r["routing"]) for r in rows}
    assert got == {("none", "skew -4 concentrated"), ("none", "balanced"), ("topoep", "skew -4 concentrated"),
                   ("topoep", "balanced")}
    by = {(r["eplb"], r["routing"]): r for r in rows}
    t, b = by[("topoep", "skew -4 concentrated")], by[("topoep", "balanced")]
    assert t["vs_bound"] == pytest.approx(t["tokens_per_s"] / b["tokens_per_s"])
    assert t["vs_none"] == pytest.approx(t["tokens_per_s"] / by[("none", "skew -4 concentrated")]["tokens_per_s"])
    assert by[("none", "skew -4 concentrated")]["imbalance_before"] > 1.5  # hot experts all on rank 0
    assert t["imbalance_after"] < t["imbalance_before"] and t["replica_fraction"] > 0
    assert all(r["steps"] == 2 for r in rows)  # 3 steps, 1 warm-up
    md = (out / "fig12.md").read_text()
    assert "balanced bound at skew -4 concentrated" in md and (out / "fig12.png").stat().st_size > 0

    # --report-only: the same report from the runs, with where they ran; a missing run is named
    (out / "fig12.md").unlink()
    assert paper_eval.main(["fig12", "--skews", "-4", "--layouts", "concentrated", "--policies", "none", "topoep",
                            "--report-only", *common]) == 0
    again = (out / "fig12.md").read_text()
    assert again.split("| eplb")[1] == md.split("| eplb")[1] and "runs measured" in again and "report made" in again
    with pytest.raises(SystemExit, match="--report-only: 2 runs are missing.*static-skew-4-concentrated"):
        paper_eval.main(["fig12", "--skews", "-4", "--layouts", "concentrated", "--policies", "static",
                         "--report-only", *common])

    assert paper_eval.main(["fig16", "--policies", "topoep", "--layouts", "megatron", *common]) == 0
    md = (out / "fig16.md").read_text()
    assert "| topoep | skew -4 |" in md and "balanced" not in md.split("## Targets")[0].split("| eplb")[1]

    assert paper_eval.main(["fig14", *common]) == 0
    rows = json.loads((out / "fig14.json").read_text())["rows"]
    assert [r["eplb"] for r in rows] == ["none", "topoep", "static", "difference", "difference", "difference"]
    assert [(r["a"], r["b"], r["steps"]) for r in rows[3:]] == [("none", "topoep", 4), ("none", "static", 4),
                                                               ("static", "topoep", 4)]
    d = paper_eval.loss_difference(rows[0]["loss"], rows[1]["loss"])
    assert rows[3]["mean_rel_diff"] == d["mean_rel_diff"] and d["step1_rel_diff"] < 1e-4
    assert "same step-1 loss" in (out / "fig14.md").read_text()
    # --resume repeats nothing: the runs' metrics are reused
    metrics = runs / "tiny-torch" / "fig14" / "none-natural" / "metrics.jsonl"
    before = metrics.stat().st_mtime
    assert paper_eval.main(["fig14", "--resume", *common]) == 0
    assert metrics.stat().st_mtime == before


def test_jobs_in_one_worker_train_as_alone(tmp_path):
    """bench/eval_worker.py runs several jobs in one process: the last one must train exactly as the same
    job alone in train.py (same losses, bit for bit on the CPU), so nothing leaks between jobs (seeds,
    megatron's router-bias cache for router_skew, parallel state)."""
    args = paper_eval.parse_args(["fig12", "--tiny", "--runs", str(tmp_path / "runs")])
    jobs = [(paper_eval.run_dir(args, e, s, "megatron"), e, paper_eval.routing_overrides(s, "megatron"), 3)
            for e, s in (("topoep", "-4.0"), ("none", "-2.0"), ("topoep", "-2.0"))]
    paper_eval.launch_all(args, jobs)
    last = jobs[-1][0]
    alone = tmp_path / "alone"
    overrides = [o if not o.startswith("trainer.run_dir=") else f"trainer.run_dir={alone}"
                 for o in paper_eval.job_overrides(args, last, "topoep", jobs[-1][2], 3)]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                    str(paper_eval.REPO / "train.py"), *overrides], check=True, cwd=paper_eval.REPO,
                   capture_output=True)
    swept = [m["loss"] for m in paper_eval.read_metrics(last / "metrics.jsonl")]
    solo = [m["loss"] for m in paper_eval.read_metrics(alone / "metrics.jsonl")]
    assert len(swept) == 3 and swept == solo
    # the first job (skew -4) drew other router biases than the last (skew -2): its losses differ
    assert [m["loss"] for m in paper_eval.read_metrics(jobs[0][0] / "metrics.jsonl")] != swept


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit, match="router_skew must be <= 0"):
        paper_eval.parse_args(["fig12", "--tiny", "--skews", "2"])
    with pytest.raises(SystemExit, match="--warmup 5 must be below --steps 3"):
        paper_eval.parse_args(["fig12", "--tiny", "--steps", "3", "--warmup", "5"])


def test_backend_defaults_and_reaches_every_run():
    tiny = paper_eval.parse_args(["fig12", "--tiny"])
    assert tiny.backend == "torch" and "eplb.backend=torch" in paper_eval.base_overrides(tiny)
    gpu = paper_eval.parse_args(["fig12", "--nproc", "2"])  # a GPU run: the GPU-native backend by default
    assert gpu.backend == "cuda" and "eplb.backend=cuda" in paper_eval.base_overrides(gpu)
    assert paper_eval.parse_args(["fig12", "--nproc", "2", "--backend", "torch"]).backend == "torch"


LEAK_CHECK = """
import gc, sys
sys.path.insert(0, {repo!r})
from bench.eval_worker import compose
from app.config import register_configs
from app.loop import job_from_config, run
from megatron.core.distributed import DistributedDataParallel
from megatron.core.models.gpt import GPTModel
register_configs()
for i, (eplb, layers) in enumerate([("none", 2), ("topoep", 3)]):  # natural routing: megatron tracks aux losses
    run(*job_from_config(compose(["model=tiny", "trainer=cpu", "eplb=" + eplb, "trainer.steps=3",
                                  "model.num_layers=" + str(layers), "logger=none",
                                  "topology=node", "trainer.run_dir={out}/" + str(i)])), keep_distributed=True)
    gc.collect()
    alive = [type(o).__name__ for o in gc.get_objects() if isinstance(o, (GPTModel, DistributedDataParallel))]
    print("alive after job", i, alive)
    assert not alive, alive
"""


def test_finished_job_frees_its_model(tmp_path):
    """A job run with keep_distributed (the worker's jobs) leaves no model or DDP module behind: megatron's
    grad-accumulator hooks would otherwise keep every finished job's model, gradients and optimizer alive
    (a GPU ran out of memory after 5 qwen3 jobs before this was fixed)."""
    script = LEAK_CHECK.format(repo=str(paper_eval.REPO), out=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", script], cwd=paper_eval.REPO, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "alive after job 1 []" in proc.stdout


def test_resume_ignores_the_runs_folder_but_not_the_processes(tmp_path):
    """Runs copied to another folder still count as done (their trainer.run_dir differs); runs made on
    another number of processes do not."""
    out = tmp_path / "a" / "topoep-natural"
    out.mkdir(parents=True)
    ov = ["model=tiny", "eplb=topoep", f"trainer.run_dir={tmp_path / 'elsewhere'}", "trainer.steps=2"]
    (out / "overrides.json").write_text(json.dumps(ov))
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    (out / "host.json").write_text(json.dumps({"nproc": 2}))
    mine = ov[:2] + [f"trainer.run_dir={out}", ov[3]]
    assert paper_eval.is_done(out, mine, 2, nproc=2) and paper_eval.is_done(out, mine, 2)
    assert not paper_eval.is_done(out, mine, 2, nproc=4)
    assert not paper_eval.is_done(out, mine, 3, nproc=2)  # fewer steps than asked
    assert not paper_eval.is_done(out, mine[:3] + ["trainer.steps=3"], 2, nproc=2)


def test_repeats_are_interleaved_and_merged(monkeypatch, tmp_path):
    """--repeats 2: every configuration runs twice, repeat-major (all configurations, then all again), in
    directories of their own; the row is the mean of the runs' tokens/s, ± the spread of the two means."""
    args = paper_eval.parse_args(["fig12", "--tiny", "--repeats", "2", "--skews", "-4", "--layouts", "megatron",
                                  "--policies", "static", "topoep", "--runs", str(tmp_path)])
    launched = []
    monkeypatch.setattr(paper_eval, "launch_all", lambda a, jobs: launched.extend(jobs))
    per_run = {}

    def fake_summary(path, warmup):
        tps = per_run.setdefault(path.parent.name, 100.0 + 10 * len(per_run))
        return {"host": None, "steps": 2, "tokens_per_s": tps, "tokens_per_s_std": 1.0, "step_time_s": 1.0,
                "imbalance_before": 1.5, "imbalance_after": 1.0 if "topoep" in path.parent.name else 1.5,
                "internode_before": 0.5, "internode_after": 0.5, "replica_fraction": 0.1, "guard_fired": 0.0,
                "loss": [1.0, 1.0]}

    monkeypatch.setattr(paper_eval, "summarize", fake_summary)
    rows = paper_eval.throughput_figure(args, args.policies, args.skews, args.layouts)
    names = [out.name for out, *_ in launched]
    assert names == ["static-skew-4-megatron", "static-balanced", "topoep-skew-4-megatron", "topoep-balanced",
                     "static-skew-4-megatron-r2", "static-balanced-r2", "topoep-skew-4-megatron-r2",
                     "topoep-balanced-r2"]
    r = {(x["eplb"], x["routing"]): x for x in rows}[("topoep", "skew -4")]
    a, b = per_run["topoep-skew-4-megatron"], per_run["topoep-skew-4-megatron-r2"]
    assert r["repeats"] == 2 and r["tokens_per_s"] == pytest.approx((a + b) / 2)
    assert r["tokens_per_s_std"] == pytest.approx(abs(a - b) / 2 ** 0.5) and r["steps"] == 4
    with pytest.raises(SystemExit, match="--repeats must be >= 1"):
        paper_eval.parse_args(["fig12", "--tiny", "--repeats", "0"])


def test_model_reaches_every_run_and_tiny_models_are_checked(tmp_path):
    args = paper_eval.parse_args(["fig12", "--tiny", "--model", "tiny_glm45air", "--runs", str(tmp_path)])
    assert "model=tiny_glm45air" in paper_eval.base_overrides(args)
    assert paper_eval.run_dir(args, "topoep", "-4.0", "megatron").parent.name == "tiny_glm45air-torch"
    assert paper_eval.parse_args(["fig12", "--nproc", "2"]).model == "qwen3"
    with pytest.raises(SystemExit, match="--model must be a tiny model.*got glm45air"):
        paper_eval.parse_args(["fig12", "--tiny", "--model", "glm45air"])


def test_loss_difference_by_hand():
    d = paper_eval.loss_difference([1.0, 2.0, 4.0, 4.0], [1.1, 2.0, 4.0])
    assert d["steps"] == 3 and d["max_step"] == 1
    assert d["step1_rel_diff"] == pytest.approx(0.1) and d["mean_rel_diff"] == pytest.approx(0.1 / 3)
    # EMA(0.1) from the first value: a = 1, 1.1, 1.39; b = 1.1, 1.19, 1.471
    ema = [0.1, 0.09 / 1.1, 0.081 / 1.39]
    assert d["mean_rel_diff_ema"] == pytest.approx(sum(ema) / 3)


def test_transport_a2a_runs_apart_and_is_passed_on(tmp_path):
    with pytest.raises(SystemExit, match="--transport a2a is backend cuda's"):
        paper_eval.parse_args(["fig16", "--tiny", "--transport", "a2a"])
    args = paper_eval.parse_args(["fig16", "--report-only", "--transport", "a2a", "--ranks-per-domain", "1",
                                  "--runs", str(tmp_path)])
    assert paper_eval.run_dir(args, "topoep", "-4.0", "megatron").parent.name == "qwen3-cuda-a2a-rpd1"
    assert "eplb.transport=a2a" in paper_eval.base_overrides(args)
    peer = paper_eval.parse_args(["fig16", "--report-only", "--runs", str(tmp_path)])
    assert not any("transport" in o for o in paper_eval.base_overrides(peer))
