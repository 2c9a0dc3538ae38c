"""bench/link_sweep.py on a few small cells: one row per (preset, EP, slots, scenario) with every policy's simulated
time, the balanced bound below static's, the verdict of the issue's targets, and a report that lists the misses."""

import json

import pytest

from bench import link_sweep


def test_link_sweep_small(tmp_path):
    args = ["--presets", "paper_h800", "--eps", "8", "16", "--slots", "2", "--scenarios", "uniform", "hot_rank",
            "--tokens", "2048", "--out", str(tmp_path), "--name", "ls"]
    link_sweep.main(args)
    rows = json.loads((tmp_path / "ls.json").read_text())["rows"]
    assert [(r["ep"], r["scenario"]) for r in rows] == [(8, "uniform"), (8, "hot_rank"), (16, "uniform"),
                                                        (16, "hot_rank")]
    for r in rows:
        assert all(r[f"{p}_ms"] > 0 for p in link_sweep.POLICIES)
        assert r["bound_ms"] <= r["static_ms"] * 1.0001
    hot = [r for r in rows if r["scenario"] == "hot_rank"]
    assert all(r["topoep_plus_ms"] < r["static_ms"] for r in hot)  # a hot rank: balancing pays
    assert all(r["topoep_plus_ran"] in ("plus", "local") for r in hot)
    # uniform routing: nothing planned, the static layer's time (both pay the count all-gather) plus what the slot
    # hint's call adds on the GPU (the bound beside the static plan)
    from topoep_research import sim

    for r in rows:
        if r["scenario"] == "uniform":
            assert r["topoep_plus_ran"] == "static"
            assert abs(r["topoep_plus_ms"] - r["static_ms"] - 1e3 * sim.gpu_hint_s(r["ep"])) < 1e-9
    # the spread layer chooses among a superset of the plain layer's plans: where the plain layer planned, it is
    # never slower by the guard's prediction; the simulator agrees on these cells
    for r in rows:
        assert r["topoep_plus_spread_ran"] in ("plus", "local", "spread", "static")
        assert r["topoep_plus_spread_ms"] <= r["topoep_plus_ms"] * 1.0001
    text = (tmp_path / "ls.md").read_text()
    for ours in link_sweep.OURS:
        misses = sum(not link_sweep.verdict(r, ours)["ok"] for r in rows)
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| {ours} | ")]
        assert f"| {misses} of 4 |" in line
    # the busiest sender's copies: none where nothing was planned, and the summary shows the maximum over the cells
    for r in rows:
        if r["scenario"] == "uniform":
            assert all(r[f"topoep_plus_sends_{k}"] == 0 for k in link_sweep.SENDS)
    for ours in link_sweep.OURS:
        m = {k: int(max(r[f"{ours}_sends_{k}"] for r in rows)) for k in link_sweep.SENDS}
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| {ours} | ")]
        flags = [link_sweep.beyond_tree(r, ours) for r in rows]
        beyond = f"{sum(a or b for a, b in flags)} ({sum(a for a, _ in flags)} / {sum(b for _, b in flags)})"
        assert line.rstrip(" |").endswith(f"{m['nvlink']} / {m['nic']} ({m['nvlink_expert']} / {m['nic_expert']}) | "
                                          + beyond)
    row = {"domains": 4, "x_sends_nvlink_expert": 3.0, "x_sends_nic_expert": 2.0}
    assert link_sweep.beyond_tree(row, "x") == (True, False)  # 3 > 2 over NVLink; 2 NIC copies: a NIC tree's share
    assert link_sweep.beyond_tree(row | {"x_sends_nic_expert": 3.0}, "x") == (True, True)  # 3 > 2 over the NIC
    assert link_sweep.beyond_tree(row | {"x_sends_nic_expert": 4.0}, "x", fanout=3) == (False, True)


def test_link_sweep_peer_candidates(tmp_path):
    """--peer-candidates adds the what-if layer topoep_plus_peers (FlexMoE's and DeepSeek EPLB's plans as further
    guard candidates): listed with its misses, its `ran` names the candidate kept, and on a hot domain (paper_h800,
    EP 16, 2 slots), where FlexMoE beats topoep_plus, the guard keeps FlexMoE's plan and the layer is faster."""
    args = ["--presets", "paper_h800", "--eps", "16", "--slots", "2", "--scenarios", "hot_domain", "uniform",
            "--peer-candidates", "--out", str(tmp_path), "--name", "lp"]
    link_sweep.main(args)
    rows = json.loads((tmp_path / "lp.json").read_text())["rows"]
    layer = link_sweep.PEER_LAYER
    hot, uniform = rows
    assert hot[f"{layer}_ran"] == "flexmoe" and uniform[f"{layer}_ran"] == "static"
    assert hot[f"{layer}_ms"] < 0.95 * hot["topoep_plus_ms"] and hot["flexmoe_ms"] < hot["topoep_plus_ms"]
    text = (tmp_path / "lp.md").read_text()
    assert "a what-if" in text
    misses = sum(not link_sweep.verdict(r, layer)["ok"] for r in rows)
    (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| {layer} | ")]
    assert "topoep_plus, topoep_plus_local, flexmoe, deepseek" in line and f"| {misses} of 2 |" in line
    assert link_sweep.ran_name(link_sweep.OURS[link_sweep.SPREAD_RELAY][1], 3) == "tree"


def test_guard_pipeline_option():
    """--guard-pipeline: every guard predicts with the simulator's chunk pipeline (the execution's chunks); the
    report says which prediction the guards made."""
    from topoep_research import sim

    assert link_sweep.guard_of(link_sweep.parse_args([])).token_chunks is None
    g = link_sweep.guard_of(link_sweep.parse_args(["--guard-pipeline"]))
    assert g.token_chunks == sim.EXECUTIONS["topoep"].num_chunks == 2
    assert link_sweep.guard_of(link_sweep.parse_args(["--token-overlap", "0"])).token_overlap == 0.0
    for bad in (["--guard-pipeline", "--execution", "cuda"], ["--guard-pipeline", "--token-overlap", "0"],
                ["--token-overlap", "1.5"]):
        with pytest.raises(SystemExit):
            link_sweep.parse_args(bad)


def test_link_sweep_serial_execution(tmp_path):
    """--execution cuda: the runtime backend's serial execution for every policy and the bound."""
    args = ["--presets", "h200", "--eps", "16", "--slots", "2", "--scenarios", "hot_rank", "--execution", "cuda",
            "--token-overlap", "0", "--out", str(tmp_path), "--name", "ls"]
    link_sweep.main(args)
    (row,) = json.loads((tmp_path / "ls.json").read_text())["rows"]
    assert row["topoep_plus_ms"] < row["static_ms"] and row["bound_ms"] <= row["static_ms"]
    assert "execution `cuda`" in (tmp_path / "ls.md").read_text()


def test_link_sweep_oracle(tmp_path):
    """--oracle: every layer's fastest plan of the call is at most its guarded time, equal where the layer met the
    targets; the report counts each layer's misses with the guard's pick and with the fastest plan, and lists the
    cells the fastest plan still misses."""
    args = ["--presets", "h200", "--eps", "32", "--slots", "2", "--scenarios", "source_ragged", "burst",
            "--spread-planner", "measured", "--oracle", "--out", str(tmp_path), "--name", "ls"]
    link_sweep.main(args)
    rows = json.loads((tmp_path / "ls.json").read_text())["rows"]
    text = (tmp_path / "ls.md").read_text()
    assert "## The guard's pick against the fastest plan of the call (--oracle)" in text
    improved = 0
    for o in link_sweep.OURS:
        oracle_misses = 0
        for r in rows:
            assert r[f"{o}_oracle_ms"] <= r[f"{o}_ms"] * (1 + 1e-12)
            if link_sweep.verdict(r, o)["ok"]:
                assert r[f"{o}_oracle_ms"] == r[f"{o}_ms"] and r[f"{o}_oracle_ran"] == r[f"{o}_ran"]
            improved += r[f"{o}_oracle_ms"] < r[f"{o}_ms"]
            oracle_misses += not link_sweep.verdict({**r, f"{o}_ms": r[f"{o}_oracle_ms"]}, o)["ok"]
        misses = sum(not link_sweep.verdict(r, o)["ok"] for r in rows)
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| {o} | {misses} | ")]
        assert line.startswith(f"| {o} | {misses} | {oracle_misses} | ")
    assert improved > 0  # h200 EP 32 source-ragged: the guard keeps topoep_plus's plan, the local one is faster


def test_relay_fanout_sets_the_relay_layers_trees(tmp_path):
    """--relay-fanout: the relay layers fetch down trees of that many children (the summary's fanout column and the
    report's text), the layers without relays keep none, and their sends are judged against that tree's share; a
    fanout below 2 is refused."""
    args = ["--presets", "paper_h800", "--eps", "16", "--slots", "2", "--scenarios", "hot_rank", "--tokens", "2048",
            "--out", str(tmp_path), "--name", "f3", "--relay-fanout", "3", "--relay-share"]
    link_sweep.main(args)
    text = (tmp_path / "f3.md").read_text()
    assert "`relay_fanout=3`" in text and "relay trees of 3 children per node" in text
    rows = json.loads((tmp_path / "f3.json").read_text())["rows"]
    for ours, fanout in (("topoep_plus", "-"), (link_sweep.RELAY, "3"), (link_sweep.SPREAD_RELAY, "3")):
        (line,) = [ln for ln in text.splitlines() if ln.startswith(f"| {ours} | ")]
        assert line.split(" | ")[1] == fanout
        assert line.endswith(f"| {link_sweep._beyond(rows, ours, 3)} |")
    for r in rows:  # relayed with relay_share: no sender beyond a tree of 3's share
        assert r[f"{link_sweep.SPREAD_RELAY}_sends_nvlink_expert"] <= 3
    with pytest.raises(SystemExit, match="--relay-fanout must be >= 2"):
        link_sweep.parse_args(["--relay-fanout", "1"])


def test_peer_relays_fetch_the_peers_replicas_down_relay_trees(tmp_path):
    """--peer-relays: the peers' layers fetch as the relay layers do; with --relay-share no peer's rank then sends more
    copies of one expert than a tree's share (paper_h800, EP 16 as 2 domains, hot domain: topoep's and deepseek's
    homes send 4 copies over NVLink and topoep's 6 over its NIC when they fetch directly); ours are unchanged."""
    base = ["--presets", "paper_h800", "--eps", "16", "--slots", "2", "--scenarios", "hot_domain", "--relay-share",
            "--relay-schedule", "async", "--out", str(tmp_path)]
    link_sweep.main(base + ["--name", "direct"])
    link_sweep.main(base + ["--name", "relayed", "--peer-relays"])
    (direct,) = json.loads((tmp_path / "direct.json").read_text())["rows"]
    (relayed,) = json.loads((tmp_path / "relayed.json").read_text())["rows"]
    assert max(direct[f"{p}_sends_nvlink_expert"] for p in link_sweep.PEERS) > 2
    assert max(direct[f"{p}_sends_nic_expert"] for p in link_sweep.PEERS) > 1
    for p in link_sweep.PEERS:
        assert relayed[f"{p}_sends_nvlink_expert"] <= 2 and relayed[f"{p}_sends_nic_expert"] <= 1
    assert relayed["topoep_ms"] < direct["topoep_ms"]  # its homes' fan-out was its busiest link
    for o in link_sweep.OURS:
        assert relayed[f"{o}_ms"] == direct[f"{o}_ms"]
    assert "(`--peer-relays`: relay trees of 2" in (tmp_path / "relayed.md").read_text()
    assert "every copy from its home (`--peer-relays`" in (tmp_path / "direct.md").read_text()
