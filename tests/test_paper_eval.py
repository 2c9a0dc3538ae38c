"""The section-6 evaluation driver (bench/paper_eval.py) end to end on the CPU: tiny model, 2 processes,
a few steps per run. Checks that every configuration ran, the ratios relate the right runs, the targets
are evaluated and the reports are written (the numbers themselves are CPU smoke, not results)."""

import json

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

    assert paper_eval.main(["fig16", "--policies", "topoep", "--layouts", "megatron", *common]) == 0
    md = (out / "fig16.md").read_text()
    assert "| topoep | skew -4 |" in md and "balanced" not in md.split("## Targets")[0].split("| eplb")[1]

    assert paper_eval.main(["fig14", *common]) == 0
    rows = json.loads((out / "fig14.json").read_text())["rows"]
    assert [r["eplb"] for r in rows] == ["none", "topoep", "difference"] and rows[2]["steps"] == 4
    assert "same step-1 loss" in (out / "fig14.md").read_text()
    # --resume repeats nothing: the runs' metrics are reused
    before = (runs / "fig14" / "none-natural" / "metrics.jsonl").stat().st_mtime
    assert paper_eval.main(["fig14", "--resume", *common]) == 0
    assert (runs / "fig14" / "none-natural" / "metrics.jsonl").stat().st_mtime == before


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
