"""Smoke test (CPU): bench/plan_quality.py runs end to end and writes its result files."""

import json

from bench.plan_quality import distribution, main, small_instance


def test_plan_quality_writes_results(tmp_path, capsys):
    assert main(["--workloads", "fig10", "--slots", "0", "2", "--milp-instances", "1", "--repeats", "1",
                 "--small-instances", "2", "--one-domain-experts", "16", "--one-domain-slots", "1",
                 "--quiet", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "plan_quality.md").read_text()
    assert "| topoep |" in md and "| joint |" in md and "commit:" in md and "hardware:" in md
    data = json.loads((tmp_path / "plan_quality.json").read_text())
    rows = [r for r in data["rows"] if r.get("workload") == "fig10"]
    assert {(r["policy"], r["slots"]) for r in rows} >= {("static", 0), ("topoep", 2), ("flexmoe", 2), ("joint", 2)}
    static = next(r for r in rows if r["policy"] == "static")
    assert abs(static["imbalance"] - 8.39) < 0.01
    topo2 = next(r for r in rows if r["policy"] == "topoep" and r["slots"] == 2)
    joint2 = next(r for r in rows if r["policy"] == "joint" and r["slots"] == 2)
    assert topo2["imbalance"] < static["imbalance"]
    plus2 = next(r for r in rows if r["policy"] == "topoep_plus" and r["slots"] == 2)
    assert joint2["modelled_ms"] <= plus2["modelled_ms"] + 1e-9 <= topo2["modelled_ms"] + 2e-9
    # the LP bound is reported with every cell and is below every policy's modelled time
    assert all(r["bound_ms"] <= r["modelled_ms"] * (1 + 1e-9) for r in rows)
    small = [r for r in data["rows"] if r.get("kind") == "small"]
    assert len(small) == 2 and all(r["joint_gap_pct"] >= -1e-6 for r in small)
    assert {r["plan"] for r in data["rows"] if r.get("kind") == "small_summary"} == {"joint", "joint_unguarded", "topoep",
                                                                                            "topoep_plus"}
    od = [r for r in data["rows"] if r.get("kind") == "one_domain"]
    assert len(od) == 4 and all(r["joint_balance_imbalance"] >= r["bound_imbalance"] - 1e-9 for r in od)
    for name in ("plan_quality.png", "plan_quality_pareto.png", "plan_quality_small.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    assert "Gap to the exact optimum" in md and "random small instances" in md and "One domain" in md
    assert "imbalance" in capsys.readouterr().out.lower()


def test_small_instances_are_deterministic_and_small():
    for i in range(20):
        om, topo, N, W, desc = small_instance(i)
        om2, *_ = small_instance(i)
        assert (om == om2).all() and om.shape[0] <= 8 and om.shape[1] <= 32 and topo.num_domains <= 2
        assert 1 <= N <= 3 and 20_000 <= W <= 2_000_000
    d = distribution([0.0, 1.0, 3.0, 10.0])
    assert d["median"] == 1.0 and d["max"] == 10.0 and d["within_2pct"] == 0.5
