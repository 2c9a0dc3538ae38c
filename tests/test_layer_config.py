"""`topoep.LayerConfig`: every field's validation (the error names the field and the fix), the trainer's `eplb`
group built from the same dataclass, keywords of ExpertParallelMoE as overrides, no behaviour switch read from
the environment under topoep/, and docs/config.md generated from the dataclasses."""

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest

from topoep import ExpertParallelMoE, LayerConfig, Topology

REPO = Path(__file__).resolve().parents[1]

BAD = [  # (field, bad value, what the error says)
    ("policy", "joint", "LayerConfig.policy='joint' is an offline planner"),
    ("policy", "nope", "LayerConfig.policy='nope' is unknown; choose one of static, topoep"),
    ("num_slots", -1, "LayerConfig.num_slots must be an integer >= 0, got -1"),
    ("num_slots", True, "LayerConfig.num_slots must be an integer >= 0, got True"),
    ("backend", "triton", "LayerConfig.backend='triton' is unknown; choose one of torch, cuda"),
    ("transport", "gloo", "LayerConfig.transport='gloo' is unknown; choose one of peer, a2a"),
    ("num_chunks", 0, "LayerConfig.num_chunks must be an integer >= 1, got 0"),
    ("capacity_factor", 0.5, "LayerConfig.capacity_factor must be a number >= 1"),
    ("capacity_factor", float("inf"), "LayerConfig.capacity_factor must be a number >= 1"),
    ("capacity_factor", "1.5", "LayerConfig.capacity_factor must be a number >= 1"),
    ("guard", "yes", "LayerConfig.guard must be true or false, got 'yes'"),
    ("t_ffn", -1.0, "LayerConfig.t_ffn must be a positive number"),
    ("planner_blocks", -2, "LayerConfig.planner_blocks must be an integer >= 0, got -2"),
    ("max_tokens", 0, "LayerConfig.max_tokens must be an integer >= 1, got 0"),
    ("plan_domain", 0, "LayerConfig.plan_domain must be an integer >= 1, got 0"),
    ("prefetch", 1, "LayerConfig.prefetch must be true or false, got 1"),
    ("combine_side_stream", None, "LayerConfig.combine_side_stream must be true or false"),
    ("cuda_graphs", "0", "LayerConfig.cuda_graphs must be true or false"),
    ("layer_graphs", "yes", "LayerConfig.layer_graphs must be true or false, got 'yes'"),
    ("relay_fanout", 0, "LayerConfig.relay_fanout must be an integer >= 1, got 0"),
    ("relay_chunks", 0, "LayerConfig.relay_chunks must be an integer >= 1, got 0"),
    ("relay_share", 1, "LayerConfig.relay_share must be true or false, got 1"),
    ("relay_schedule", "tree", "LayerConfig.relay_schedule='tree' is unknown; choose one of levels, async"),
    ("deepep_deterministic", "yes", "LayerConfig.deepep_deterministic must be true or false, got 'yes'"),
    ("fetch_overlap", 1, "LayerConfig.fetch_overlap must be true or false, got 1"),
    ("plus_spread", 1, "LayerConfig.plus_spread must be true or false, got 1"),
    ("plus_peers", 1, "LayerConfig.plus_peers must be true or false, got 1"),
    ("spread_gate", "yes", "LayerConfig.spread_gate must be true or false, got 'yes'"),
    ("spread_probe", 1, "LayerConfig.spread_probe must be an integer >= 2 (calls between the spread gate's probes), "
                        "got 1"),
]


@pytest.mark.parametrize("name, value, message", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_every_field_is_checked(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LayerConfig(**{name: value})


def test_every_field_has_a_bad_value_in_this_test():
    assert {f.name for f in dataclasses.fields(LayerConfig)} == {b[0] for b in BAD}


def test_combinations_are_checked():
    with pytest.raises(ValueError, match=r"LayerConfig.transport=a2a applies to LayerConfig.backend=cuda"):
        LayerConfig(transport="a2a", capacity_factor=None)
    with pytest.raises(ValueError, match=r"set LayerConfig.capacity_factor=null with it"):
        LayerConfig(backend="cuda", transport="a2a")
    with pytest.raises(ValueError, match=r"backend cuda runs 1 or 2 token chunks"):
        LayerConfig(backend="cuda", num_chunks=3)
    LayerConfig(backend="cuda", transport="a2a", capacity_factor=None)
    for bad in (dict(), dict(backend="cuda", transport="a2a", capacity_factor=None)):
        with pytest.raises(ValueError, match=r"fetch_overlap=true runs backend cuda's peer-pointer fetch.*set "
                                             r"LayerConfig.backend=cuda and LayerConfig.transport=peer"):
            LayerConfig(fetch_overlap=True, **bad)
    assert LayerConfig(backend="cuda", fetch_overlap=True).fetch_overlap
    for name, value, shown in (("prefetch", True, "true"), ("combine_side_stream", True, "true"), ("max_tokens", 8, "8")):
        with pytest.raises(ValueError, match=rf"LayerConfig.{name}={shown} applies to LayerConfig.backend=cuda \(backend "
                                             rf"torch would ignore it\)"):
            LayerConfig(**{name: value})
        assert getattr(LayerConfig(backend="cuda", **{name: value}), name) == value
    for transport in ("a2a", "deepep"):
        with pytest.raises(ValueError, match=rf"combine_side_stream=true runs the peer-pointer combine.*transport "
                                             rf"{transport} combines.*set LayerConfig.transport=peer"):
            LayerConfig(backend="cuda", transport=transport, capacity_factor=None, combine_side_stream=True)
    assert LayerConfig(num_chunks=4).chunks == 4  # backend torch: any number
    assert (LayerConfig().chunks, LayerConfig(backend="cuda").chunks) == (2, 1)  # the backends' defaults
    assert LayerConfig(capacity_factor=2).capacity_factor == 2.0 and LayerConfig(t_ffn=1).t_ffn == 1.0


def test_replace_names_unknown_fields():
    with pytest.raises(ValueError, match="unknown LayerConfig field.*slots.*the fields are"):
        LayerConfig().replace(slots=3)
    assert LayerConfig().replace(num_slots=3).num_slots == 3


def test_the_eplb_group_is_the_layer_config():
    """One list of fields: eplb = LayerConfig's fields plus `name`; the same checks, named eplb.<field>."""
    from app.config import EplbConfig

    assert [f.name for f in dataclasses.fields(EplbConfig)] == [f.name for f in dataclasses.fields(LayerConfig)] + ["name"]
    for name, value, message in BAD:
        with pytest.raises(ValueError, match=re.escape(message.replace("LayerConfig.", "eplb."))):
            EplbConfig(**{name: value})
    ec = EplbConfig(name="topoep_plus", num_slots=4, backend="cuda", prefetch=True)
    lc = ec.layer_config(t_ffn=2e-6)
    assert isinstance(lc, LayerConfig) and not isinstance(lc, EplbConfig)
    assert (lc.policy, lc.num_slots, lc.backend, lc.prefetch, lc.t_ffn) == ("topoep_plus", 4, "cuda", True, 2e-6)
    assert EplbConfig(name="none").unused() == []  # megatron's baseline: the layer's fields are not used
    assert EplbConfig(name="none", backend="cuda", num_slots=4).unused() == ["eplb.num_slots=4", "eplb.backend=cuda"]
    assert ec.unused() == []  # (the trainer prints the list with eplb=none)


def test_layer_keywords_override_the_config():
    topo = Topology(num_domains=1, ranks_per_domain=1)
    layer = ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo,
                              config=LayerConfig(policy="static", num_slots=1), num_slots=0, num_chunks=3)
    assert (layer.config.policy, layer.num_slots, layer.num_chunks) == ("static", 0, 3)
    with pytest.raises(ValueError, match="unknown LayerConfig field.*chunks"):
        ExpertParallelMoE(num_experts=4, hidden_size=8, ffn_hidden_size=4, topology=topo, chunks=2)


def test_no_behaviour_switch_is_read_from_the_environment():
    """Under topoep/ the environment gives only toolchain facts (TOPOEP_EXT_DIR, CUDA_HOME, TORCH_CUDA_ARCH_LIST,
    TRITON_INTERPRET, TORCH_SYMMMEM_NBLOCKS) and the launcher's (WORLD_SIZE, LOCAL_WORLD_SIZE, SLURM_*,
    CUDA_VISIBLE_DEVICES)."""
    allowed = {"TOPOEP_EXT_DIR", "CUDA_HOME", "TORCH_CUDA_ARCH_LIST", "TRITON_INTERPRET", "TORCH_SYMMMEM_NBLOCKS",
               "WORLD_SIZE", "LOCAL_WORLD_SIZE", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE", "CUDA_VISIBLE_DEVICES"}
    read = set()
    for path in (REPO / "topoep").rglob("*.py"):
        text = path.read_text()
        read |= set(re.findall(r"environ(?:\.get|\.setdefault)?\(\s*[\"']([A-Z0-9_]+)", text))
        read |= set(re.findall(r"environ\[\s*[\"']([A-Z0-9_]+)", text))
        read |= set(re.findall(r"env\.get\(\s*[\"']([A-Z0-9_]+)", text))
        assert "getenv" not in text, path
    assert read and read <= allowed, sorted(read - allowed)


def test_config_reference_is_up_to_date():
    r = subprocess.run([sys.executable, str(REPO / "tools" / "config_reference.py"), "--check"], capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
