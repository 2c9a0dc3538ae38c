"""bench/planner_latency.py's report on the CPU (the measurement itself needs a GPU): the targets table reads
the best of the four timings and the variant without refinement, and says met / not met for each."""

import pytest
import torch

from bench.planner_latency import (TARGETS, VARIANTS, grid_table, main, plus_table, refine_iters_table, spread_table,
                                   target_table, variant_table)


def _row(ep, graph, eager=90.0, without_refine=14.0):
    return dict(sweep="a", ep=ep, experts=640, eager_us=eager, graph_us=graph + 3, eager_busy_us=eager - 20,
                graph_busy_us=graph, variants_graph_us={name: without_refine - i for i, name in enumerate(VARIANTS)})


def test_target_table_states_each_target():
    assert set(TARGETS) == {(8, 640), (128, 640)}
    rows = [_row(8, 64.0, without_refine=14.2), _row(128, 45.0, without_refine=36.7), _row(32, 10.0)]
    text = target_table(rows)
    lines = [ln for ln in text.splitlines() if ln.startswith("| 8 ") or ln.startswith("| 128 ")]
    assert len(lines) == 2 and "| 32 " not in text  # only the rows with a target
    ep8 = [c.strip() for c in lines[0].split("|")[1:-1]]
    assert ep8[2] == "15" and ep8[7] == "no" and ep8[8] == "14.2" and ep8[9] == "yes"
    ep128 = [c.strip() for c in lines[1].split("|")[1:-1]]
    assert ep128[6] == "45.0" and ep128[7] == "yes" and ep128[9] == "yes"


def test_variant_table_has_every_variant():
    text = variant_table([_row(8, 64.0)])
    header = next(ln for ln in text.splitlines() if ln.startswith("| sweep"))
    assert all(name in header for name in VARIANTS) and "| 64.0 |" in text


def test_refine_iters_table_names_the_slowest_domain():
    rows = [dict(_row(128, 51.1), refine_iters=[1, 2, 1, 0, 21, 6, 21, 3]), dict(_row(8, 34.7), refine_iters=[28])]
    lines = [ln for ln in refine_iters_table(rows).splitlines() if ln.startswith("| a ")]
    assert [c.strip() for c in lines[0].split("|")[1:-1]] == ["a", "128", "640", "8", "21", "4", "55"]  # ties: lowest
    assert [c.strip() for c in lines[1].split("|")[1:-1]] == ["a", "8", "640", "1", "28", "0", "28"]


def test_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a GPU"):
        main([])


def test_plus_table_states_the_extra_time_and_the_phases():
    row = _row(128, 48.0) | dict(plus_eager_us=84.0, plus_graph_us=68.0, plus_graph_busy_us=66.5, plus_moves=2,
                                 plus_reference_ms=38.0, pair_graph_busy_us=71.2,
                                 plus_phases_us={"moves": 8.8, "route A": 8.4, "route B": 5.9})
    text = plus_table([row])
    line = next(ln for ln in text.splitlines() if ln.startswith("| a | 128 |"))
    cells = [c.strip() for c in line.split("|")[1:-1]]
    assert cells[3] == "48.0" and cells[6] == "66.5" and cells[7] == "+18.5" and cells[8] == "71.2"
    assert cells[9] == "2"
    assert "| moves | route A | route B |" in text and "| 8.8 | 8.4 | 5.9 |" in text


def test_spread_table_lists_the_spread_candidates_where_measured():
    row = _row(128, 48.0) | dict(plus_eager_us=84.0, plus_graph_us=68.0, plus_graph_busy_us=66.5, plus_moves=2,
                                 plus_reference_ms=38.0, pair_graph_busy_us=71.2, plus_phases_us={"moves": 8.8},
                                 spread_graph_busy_us={"topoep_plus_spread": 120.5, "topoep_plus_spread_tree": 131.0},
                                 spread_moves={"topoep_plus_spread": 140, "topoep_plus_spread_tree": 150},
                                 spread_set_graph_busy_us=140.2)
    text = spread_table([row])
    assert "| a | 128 | 640 | 120.5 | 140 | 131.0 | 150 | 71.2 | 140.2 |" in text
    row |= dict(spread_fixed_us=40.0, spread_every_us=310.0, spread_every_moves=100, spread_move_us=2.7)
    assert "| a | 128 | 640 | 40.0 | 310.0 | 100 | 2.70 |" in spread_table([row])
    del row["spread_graph_busy_us"]
    assert spread_table([row]) == ""


def test_grid_table_has_a_row_per_policy_and_a_column_per_grid():
    grid = {"default": 48.1, "16": 50.2, "32": 47.0, "64": 45.5, "132": 44.9}
    row = _row(128, 48.1) | dict(grid_us={"topoep": grid, "topoep_plus": {k: v + 10 for k, v in grid.items()}})
    text = grid_table([row])
    assert "| default | 16 blocks | 32 blocks | 64 blocks | 132 blocks |" in text
    lines = [[c.strip() for c in ln.split("|")[1:-1]] for ln in text.splitlines() if ln.startswith("| a | 128 |")]
    assert lines == [["a", "128", "640", "topoep", "48.1", "50.2", "47.0", "45.5", "44.9"],
                     ["a", "128", "640", "topoep_plus", "58.1", "60.2", "57.0", "55.5", "54.9"]]


def test_stamp_gaps_turn_consecutive_stamps_into_phase_times():
    """The planner's phase readers (CudaPlanner.phase_ns, plus_phase_ns) share this rule; the table's phase
    columns come from it."""
    from topoep.planners.cuda import PHASES, stamp_gaps

    stamps = [100, 130, 130, 180, 400, 1000, 1060]
    assert stamp_gaps(PHASES, stamps) == {"demand": 30, "placement": 0, "instances": 50, "split": 220,
                                          "refine": 600, "route": 60}
    with pytest.raises(ValueError, match="6 phases need 7 stamps, got 6"):
        stamp_gaps(PHASES, stamps[:-1])
