"""bench/link_bound.py on a small sweep: every policy's ratio to the per-link bound is at least 1, the report has a
row per cell and a summary row per policy, and bad options are refused."""

import json

import pytest

from bench.link_bound import GUARDED, GUARDED_SPREAD, POLICIES, main


def test_a_small_sweep_reports_every_policy_at_or_above_the_bound(tmp_path):
    main(["--eps", "4", "--slots", "1", "--scenarios", "hot_rank", "warm_domain", "--tokens", "256",
          "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "link_bound.json").read_text())["rows"]
    assert len(rows) == 2
    for r in rows:
        for p in POLICIES + (GUARDED, GUARDED_SPREAD):
            assert r[f"{p}_ms"] >= r["bound_ms"] * (1 - 1e-7), p
    text = (tmp_path / "link_bound.md").read_text()
    assert all(f"| {p} |" in text for p in POLICIES + (GUARDED, GUARDED_SPREAD))
    assert text.count("| 4 | 1 |") == 2


def test_bad_options_are_refused():
    with pytest.raises(SystemExit, match="multiples of --domains"):
        main(["--eps", "3"])
