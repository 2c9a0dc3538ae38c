"""bench/replacement.py: the re-placed homes keep E / R experts per rank and balance the static load; the report has
a row per cell with the amortised move, which shrinks as N grows; a warm domain gains from re-placement."""

import json

import pytest
import torch

from bench import replacement
from topoep.planners.common import static_rank_load
from topoep.workloads import scenario


def test_replaced_homes_balance_the_static_load():
    omega = scenario("warm_domain", 16, 128, 1024, 8, ranks_per_domain=8, seed=0)
    home = replacement.replaced_homes(omega)
    assert torch.equal(torch.bincount(home, minlength=16), torch.full((16,), 8))
    before = static_rank_load(omega, torch.arange(128) // 8, 16)
    after = static_rank_load(omega, home, 16)
    assert after.sum() == before.sum() and after.max() < before.max()
    assert after.max() - after.min() <= omega.sum(0).max()  # greedy: within one expert's load


def test_replacement_report(tmp_path):
    replacement.main(["--presets", "paper_h800", "--eps", "16", "--scenarios", "warm_domain", "uniform",
                      "--every", "1", "100", "--out", str(tmp_path), "--name", "rp"])
    rows = json.loads((tmp_path / "rp.json").read_text())["rows"]
    assert [r["scenario"] for r in rows] == ["warm_domain", "uniform"]
    for r in rows:
        assert r["replaced_every_1_ms"] >= r["replaced_every_100_ms"] >= r["replaced_ms"]
        assert r["replaced_every_1_ms"] - r["replaced_ms"] == pytest.approx(r["move_ms"], rel=1e-9)
        assert r["replaced_spread_every_1_ms"] - r["replaced_spread_ms"] == pytest.approx(r["move_ms"], rel=1e-9)
    warm = rows[0]
    assert warm["moved_experts"] > 0 and warm["replaced_ms"] < warm["today_ms"]
    assert warm["today_spread_ms"] < warm["today_ms"]  # the spread candidate relieves the warm domain
    text = (tmp_path / "rp.md").read_text()
    assert "| paper_h800 | 16 | 2 | warm_domain |" in text and "Re-placing every 100 steps cuts" in text

