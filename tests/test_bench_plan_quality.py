"""Smoke test (CPU): bench/plan_quality.py runs end to end and writes its three result files."""

import json

from bench.plan_quality import main


def test_plan_quality_writes_results(tmp_path, capsys):
    assert main(["--workloads", "fig10", "--slots", "0", "2", "--milp-instances", "1", "--repeats", "1",
                 "--quiet", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "plan_quality.md").read_text()
    assert "| topoep |" in md and "commit:" in md and "hardware:" in md
    data = json.loads((tmp_path / "plan_quality.json").read_text())
    rows = [r for r in data["rows"] if r.get("workload") == "fig10"]
    assert {(r["policy"], r["slots"]) for r in rows} >= {("static", 0), ("topoep", 2), ("flexmoe", 2)}
    static = next(r for r in rows if r["policy"] == "static")
    assert abs(static["imbalance"] - 8.39) < 0.01
    topo2 = next(r for r in rows if r["policy"] == "topoep" and r["slots"] == 2)
    assert topo2["imbalance"] < static["imbalance"]
    assert (tmp_path / "plan_quality.png").stat().st_size > 10_000
    assert "Gap to the exact optimum" in md
    assert "imbalance" in capsys.readouterr().out.lower()
