"""bench/transports.py: the three transports' reports of bench/moe_layer.py become one table, case by case, with each
transport's time over the peer transport's; a case one report lacks shows "-"; two reports of one transport raise."""

import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("transports", Path(__file__).resolve().parent.parent / "bench/transports.py")
transports = importlib.util.module_from_spec(spec)
spec.loader.exec_module(transports)


def _report(tmp_path, transport, times):
    rows = [{"tokens": 4096, "workload": w, "layout": "random", "layer": layer, "ms": ms, "dispatch_combine_ms": ms / 2,
             "ran": True} for (w, layer), ms in times.items()]
    p = tmp_path / f"moe_layer_deepep_{transport}.json"
    p.write_text(json.dumps({"date": "d", "commit": "c", "hardware": "h", "rows": rows,
                             "config": {"transport": transport, "command": f"moe_layer.py --transport {transport}"}}))
    return p


def test_three_reports_become_one_table_with_ratios_to_peer(tmp_path):
    cases = [("skew 0", "cuda/static"), ("skew -4", "cuda/topoep")]
    _report(tmp_path, "peer", dict(zip(cases, (2.0, 4.0))))
    _report(tmp_path, "a2a", dict(zip(cases, (4.0, 6.0))))
    _report(tmp_path, "deepep", {cases[0]: 3.0})  # lacks the second case
    assert transports.main([str(tmp_path), "--results", str(tmp_path / "out")]) == 0
    out = json.loads((tmp_path / "out" / "moe_layer_deepep.json").read_text())
    by = {(r["workload"], r["layer"]): r for r in out["rows"]}
    assert by[cases[0]]["deepep_vs_peer"] == 1.5 and by[cases[0]]["a2a_vs_peer"] == 2.0
    assert by[cases[1]]["deepep_ms"] is None and by[cases[1]]["a2a_vs_peer"] == 1.5
    md = (tmp_path / "out" / "moe_layer_deepep.md").read_text()
    assert "| 4096 | skew 0 | random | cuda/static | 3.00 | 1.50 | 1.50x | 4.00 | 2.00 | 2.00x | 2.00 | 1.00 |" in md
    assert "| 4096 | skew -4 | random | cuda/topoep | - | - | - | 6.00 | 3.00 | 1.50x | 4.00 | 2.00 |" in md


def test_missing_or_repeated_reports_are_refused(tmp_path, capsys):
    assert transports.main([str(tmp_path), "--results", str(tmp_path / "out")]) == 1
    assert "no report at" in capsys.readouterr().err
    p = _report(tmp_path, "peer", {("skew 0", "cuda/static"): 1.0})
    with pytest.raises(ValueError, match="a second report of transport 'peer'"):
        transports.main(["--reports", str(p), str(p), "--results", str(tmp_path / "out")])
