"""CPU tests of the memory model of backend cuda (topoep/memory.py), its use by the simulator and the reports of
bench/layer_memory.py and bench/simulate.py's memory section. The model is checked against GPU measurements in
results/layer_memory.md (bench/layer_memory.py on the GPU machine)."""

from pathlib import Path

import pytest

from topoep.memory import layer_memory
from topoep_research import sim

REPO = Path(__file__).resolve().parent.parent

QWEN3 = dict(num_experts=128, hidden=2048, ffn_hidden=768, top_k=8, tokens=4096, num_slots=2)
MIB = 2 ** 20


def test_with_a_capacity_the_rows_do_not_grow_with_the_ep_size():
    caps = [layer_memory(num_ranks=R, **QWEN3, capacity_factor=1.25) for R in (8, 16, 32, 64, 128)]
    assert len({(m.kept, m.peak) for m in caps}) == 1  # kept tensors and temporaries: flat in EP
    # the buffers too, but for the count all-gather's (R x max(E, R (E/R + N)) int64: 1 MiB at EP 128)
    assert max(m.buffers for m in caps) - min(m.buffers for m in caps) < 2 * MIB
    # only the gradient-return regions of the replica pool grow (R x N expert-sized regions)
    expert = 3 * 2048 * 768 * 2
    assert [m.slots for m in caps] == [(1 + R) * 2 * expert for R in (8, 16, 32, 64, 128)]
    worst = [layer_memory(num_ranks=R, **QWEN3, capacity_factor=None) for R in (8, 16, 32)]
    assert (worst[1].kept - worst[0].kept) / 8 == pytest.approx((worst[2].kept - worst[1].kept) / 16)  # linear in R
    assert worst[0].kept > 5 * caps[0].kept


def test_regions_never_exceed_the_worst_case_and_small_ep_keeps_it():
    # at EP 1 a region of 1.25 T k rows would exceed the worst case (T k): the worst case is kept, nothing spills
    one = layer_memory(num_ranks=1, **QWEN3, capacity_factor=1.25)
    assert one == layer_memory(num_ranks=1, **QWEN3, capacity_factor=None)
    two = layer_memory(num_ranks=2, **QWEN3, capacity_factor=1.25)
    assert two.kept < layer_memory(num_ranks=2, **QWEN3, capacity_factor=None).kept


def test_the_slot_region_costs_only_when_replicas_are_used():
    used = layer_memory(num_ranks=8, **QWEN3, slots_used=True)
    skipped = layer_memory(num_ranks=8, **QWEN3, slots_used=False)
    rows = int(1.25 * 4096 * 8)
    assert used.kept - skipped.kept == rows * (2048 + 2 * 768) * 2  # the slot region's rows and pre-activations
    assert used.buffers == skipped.buffers  # the symmetric buffers exist either way


def test_two_chunks_have_a_region_each():
    one = layer_memory(num_ranks=8, **QWEN3, chunks=1)
    two = layer_memory(num_ranks=8, **QWEN3, chunks=2)
    assert two.kept > one.kept  # each chunk's region holds up to the capacity


def test_the_simulator_reports_memory_per_rank():
    model = sim.MODELS["qwen3"]
    r = sim.simulate(sim.sample_routing(16, 128, 512, 8, router_skew=-2.0, seed=0), sim.CLUSTERS["h200"],
                     model=sim.replace(model, tokens_per_rank=512), num_slots=2)
    assert set(r.memory) == {"buffers", "slots", "kept", "peak", "total"}
    assert r.memory["total"] == r.memory["buffers"] + r.memory["slots"] + r.memory["peak"]
    assert "memory.total" in r.row()


def test_memory_section_of_the_simulation_report():
    from bench.simulate import memory_md, memory_sweep

    rows = memory_sweep([8, 32, 1024], [0, 2], tokens=(4096,))
    by = {(r["model"], r["ep"], r["slots"]): r for r in rows}
    assert by[("qwen3", 32, 2)]["worst_gb"] > 80 > by[("qwen3", 32, 2)]["capacity_gb"]
    assert by[("qwen3", 1024, 2)]["experts"] == 1024
    md = memory_md(rows)
    assert "qwen3, 4096 tokens, 2 slots, H800 (80 GB): fits at EP 8 with worst-case buffers" in md


def test_layer_memory_report_joins_the_ranks_and_the_ep_sizes():
    from bench.layer_memory import report_md, summary, with_model

    config = dict(experts=128, hidden=2048, ffn=768, topk=8, slots=2)
    runs, infos = [], []
    for ep in (2, 8):
        rows = []
        for rank in range(ep):
            for name in ("torch", "cuda-capacity", "cuda-worst"):
                rows.append(dict(backend=name, ep=ep, rank=rank, tokens=4096, routing="uniform", slots_used=False,
                                 peak_mib=900.0 + rank + (ep == 8) * 100 * (name == "cuda-worst"),
                                 symmetric_mib=10.0 if name != "torch" else 0.0))
        runs += with_model(rows, dict(config, world=ep))
        infos.append(dict(date="d", commit="c", hardware="h", config=dict(config, world=ep)))
    records = summary(runs)
    assert len(records) == 6 and all("rank" not in r for r in records)
    r8 = next(r for r in records if r["ep"] == 8 and r["backend"] == "cuda-worst")
    assert r8["peak_mib"] == 907.0 + 100 and r8["ranks"] == 8  # the largest rank
    assert next(r for r in records if r["backend"] == "torch")["model_peak_mib"] is None
    # the model is the one of topoep/memory.py for the measured shapes (the top-k weights without a gradient)
    cap8 = next(r for r in records if r["ep"] == 8 and r["backend"] == "cuda-capacity")
    assert cap8["model_peak_mib"] == layer_memory(num_ranks=8, **QWEN3, slots_used=False,
                                                   topk_weights_grad=False).peak / MIB
    md = report_md(records, infos, dict(date="today", commit="abc1234"), "python bench/layer_memory.py --report x")
    assert "- report: date today; commit `abc1234`" in md and "- reproduce: `python bench/layer_memory.py --report x`" in md
    assert "| 4096, uniform | torch | 901 | 907 |" in md
    assert "| 4096, uniform | 8 | 1.00 | 1.01 |" in md  # cuda-capacity / torch, and with its symmetric buffers
    assert "| 4096, uniform | cuda-worst | EP 2 -> 8 | +12 % | +12 % |" in md
    assert "| 4096 | left out | cuda-capacity | 1052 / 1811 | 620 / 1487 | 576 / 1875 |" in md  # model, EP 2 8 32


def test_the_model_follows_the_allocation_order():
    """One configuration by hand (EP 8, 4096 tokens, uniform: the slots left out), as cuda_function.py allocates:
    the peak is in the main experts' weight gradients, with the kept rows (xm), pre-activations (h) and their
    gradients alive, the caller's output, g1, the recomputed activation and g2."""
    T, k, H, F, E_loc = 4096, 8, 2048, 768, 16
    r = int(1.25 * T * k)  # the capacity
    m = layer_memory(num_ranks=8, **QWEN3, slots_used=False, topk_weights_grad=False)
    wq, xm, h, gh, y = T * k * 2, r * H * 2, r * 2 * F * 2, r * 2 * F * 2, T * H * 2
    g1, act, g2 = E_loc * 2 * F * H * 2, r * F * 2, E_loc * H * F * 2
    assert m.peak == wq + xm + h + gh + y + g1 + act + g2
    assert m.kept == wq + xm + h
    # a router's top-k weights need a gradient: the expert outputs are kept for it
    assert layer_memory(num_ranks=8, **QWEN3, slots_used=False).kept == m.kept + T * k * H * 2
    # with the slots used (skewed routing) the peak is in the data gradients, both regions' row gradients alive
    used = layer_memory(num_ranks=8, **QWEN3, slots_used=True, topk_weights_grad=False)
    assert used.peak == wq + 2 * (xm + h) + y + 2 * (gh + r * H * 2)
    # two chunks on the comm stream: every chunk's outputs stay until the join
    assert layer_memory(num_ranks=8, **QWEN3, chunks=2).peak > layer_memory(num_ranks=8, **QWEN3, chunks=1).peak


def test_layer_memory_report_writes_where_it_is_told_with_its_provenance(tmp_path):
    """bench/layer_memory.py --report: the committed raw runs joined into <out>/layer_memory.{md,json} (--out
    honoured: results/ untouched), the json with the report's date and commit, each raw run's provenance and the
    rows; the md's reproduce line names the raw runs relative to the repository."""
    import json

    from bench import layer_memory as lm

    raw = sorted((REPO / "results" / "gpu" / "layer_memory").glob("layer_memory_ep*.json"))
    assert raw
    before = (REPO / "results" / "layer_memory.md").stat().st_mtime_ns
    assert lm.main(["--report", *map(str, raw), "--out", str(tmp_path)]) == 0
    assert (REPO / "results" / "layer_memory.md").stat().st_mtime_ns == before
    data = json.loads((tmp_path / "layer_memory.json").read_text())
    assert {"date", "commit", "hardware", "config", "runs", "rows"} <= set(data)
    assert [r["config"]["world"] for r in data["runs"]] == sorted(r["config"]["world"] for r in data["runs"])
    assert data["rows"] and all("peak_mib" in r for r in data["rows"])
    md = (tmp_path / "layer_memory.md").read_text()
    assert "- reproduce: `python bench/layer_memory.py --report results/gpu/layer_memory/layer_memory_ep" in md
