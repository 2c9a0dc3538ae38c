"""Smoke test (CPU, 2 gloo processes): bench/moe_layer.py --tiny runs every case (every routing, the
TopoEP layer with policies static and topoep, megatron-core's alltoall layer), writes its table and JSON,
and every layer executed the same routing (outputs equal to the static layer's)."""

import json

from distributed import run_ranks

ROUTINGS = ["skew 0 (uniform)", "skew -2 random", "skew -2 concentrated", "skew -4 random", "skew -4 concentrated",
            "balanced (bound)"]
LAYERS = ["torch/static", "torch/topoep", "megatron/alltoall"]


def _bench(rank, world, out):
    from bench.moe_layer import main

    return main(["--tiny", "--out", out])


def test_tiny_bench_measures_every_case(tmp_path):
    assert run_ranks(_bench, 2, str(tmp_path)) == [0, 0]
    data = json.loads((tmp_path / "moe_layer.json").read_text())
    assert data["commit"] and data["hardware"] and data["config"]["tiny"] is True
    assert data["config"]["rounds"] == 2 and data["config"]["iters"] == 3  # timed calls taken in 2 rounds over the cases
    rows = {(r["workload"], r["layer"]): r for r in data["rows"]}
    assert set(rows) == {(w, layer) for w in ROUTINGS for layer in LAYERS}
    md = (tmp_path / "moe_layer.md").read_text()
    for (w, layer), r in rows.items():
        assert r["ran"] and r["ms"] > 0 and r["vs_static"] > 0 and r["vs_bound"] > 0
        assert f"| {r['tokens']} | {w} | {layer} | {r['ms']:.2f} |" in md
        assert r["max_diff"] < 1e-4, f"{w} {layer}: output differs from the static layer's by {r['max_diff']}"
        assert r["experts_ms"] > 0 and r["dispatch_combine_ms"] > 0
        # the forward/backward split: both passes run experts and dispatch/combine
        assert r["experts_fwd_ms"] > 0 and r["experts_bwd_ms"] > 0 and r["dispatch_combine_bwd_ms"] > 0
        assert r["experts_fwd_ms"] + r["experts_bwd_ms"] >= r["experts_ms"] - 1e-9
        if layer.startswith("torch/"):
            assert r["plan_ms"] > 0 and r["plan_fetch_share"] is not None
            assert r["plan_fwd_ms"] == r["plan_ms"] and r["plan_bwd_ms"] == 0  # planning is forward only
        if layer == "megatron/alltoall":
            assert r["imbalance_after"] == r["imbalance_before"]
        elif layer == "torch/static":  # only the capacity step moves rows: of a rank above 1.25 T k (the mean)
            assert r["imbalance_after"] <= r["imbalance_before"]
            if r["imbalance_before"] <= 1.25:
                assert r["imbalance_after"] == r["imbalance_before"]
    assert "## Breakdown by pass: forward / backward" in md and (tmp_path / "moe_layer_breakdown.png").stat().st_size
    assert rows[("balanced (bound)", "torch/static")]["imbalance_before"] == 1.0
    assert rows[("balanced (bound)", "torch/topoep")]["guard_fired"] == 1.0
    assert rows[("balanced (bound)", "torch/static")]["vs_bound"] == 1.0
    conc, rand = rows[("skew -4 concentrated", "torch/static")], rows[("skew -4 random", "torch/static")]
    assert conc["imbalance_before"] > rand["imbalance_before"]
    assert rows[("skew 0 (uniform)", "torch/static")]["imbalance_before"] < 1.2


def _bench_depth(rank, world, out):
    from bench.moe_layer import main

    return main(["--tiny", "--out", out, "--name", "deep", "--depth", "3", "--no-megatron", "--skews", "-4",
                 "--layouts", "concentrated", "--profile-iters", "1"])


def test_depth_chains_the_layer_and_reports_per_layer_times(tmp_path):
    assert run_ranks(_bench_depth, 2, str(tmp_path)) == [0, 0]
    data = json.loads((tmp_path / "deep.json").read_text())
    assert data["config"]["depth"] == 3
    rows = {(r["workload"], r["layer"]): r for r in data["rows"]}
    assert set(rows) == {(w, layer) for w in ("skew -4 concentrated", "balanced (bound)")
                         for layer in ("torch/static", "torch/topoep")}
    for r in rows.values():
        assert r["ms"] > 0 and r["max_diff"] < 1e-4 and r["experts_ms"] > 0
    assert "each case is 3 layers in a chain, every time per layer" in (tmp_path / "deep.md").read_text()


def test_depth_needs_no_megatron():
    import pytest

    from bench.moe_layer import parse_args

    with pytest.raises(ValueError, match="--depth must be >= 1, and > 1 only with --no-megatron"):
        parse_args(["--tiny", "--depth", "2"])
    with pytest.raises(ValueError, match="got --depth 0"):
        parse_args(["--tiny", "--depth", "0", "--no-megatron"])


def test_rounds_split_the_timed_calls():
    import pytest

    from bench.moe_layer import parse_args, timed_rounds

    with pytest.raises(ValueError, match=r"--rounds \(4\) from 1 to --iters"):
        parse_args(["--tiny", "--rounds", "4"])  # tiny: 3 iterations

    class _Case:
        def __init__(self, name, log):
            self.name, self.run = name, lambda: log.append(name)

    log = []
    args = parse_args(["--tiny", "--iters", "5", "--rounds", "2"])
    import bench.moe_layer as ml

    orig, ml.time_iterations = ml.time_iterations, lambda run, n, cuda: [run() or 1.0 for _ in range(n)]
    try:
        times = timed_rounds([_Case("a", log), _Case("b", log)], args, False)
    finally:
        ml.time_iterations = orig
    assert log == ["a"] * 3 + ["b"] * 3 + ["a"] * 2 + ["b"] * 2  # 5 calls each, in 2 rounds taken in turn
    assert times == {"a": [1.0] * 5, "b": [1.0] * 5}
