"""Unit tests (CPU, no network): the data config dataclasses validate their fields, and the Hydra
group `configs/data/` composes into them (offline default and the paper's six sources)."""

from __future__ import annotations

from pathlib import Path

import pytest

from data.config import DataConfig, DedupConfig, SourceConfig, TokenizerConfig
from data.store import compose_data_config


def _cfg(**kw) -> DataConfig:
    base = dict(name="t", output_dir="/tmp/x", num_tokens=1000,
                sources={"a": SourceConfig(dataset="json", data_files=["a.jsonl"], weight=3.0),
                         "b": SourceConfig(dataset="json", data_files=["b.jsonl"], weight=1.0)})
    base.update(kw)
    return DataConfig(**base)


@pytest.mark.parametrize("kwargs, match", [
    (dict(weight=0.0), "weight must be > 0"),
    (dict(weight=1.0, data_files=["x"], data_files_from="list.txt"), "exclusive"),
    (dict(weight=1.0, data_files=[]), "empty list"),
    (dict(weight=1.0, shuffle_files_seed=0), "needs data_files_from"),
    (dict(weight=1.0, max_documents=0), "max_documents"),
    (dict(weight=1.0, text_field=""), "text_field"),
])
def test_source_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        SourceConfig(dataset="HuggingFaceFW/fineweb", **kwargs)
    assert "HuggingFaceFW/fineweb" in str(err.value)  # the message names the source


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_tokens=0), "num_tokens"),
    (dict(max_doc_tokens=1), "max_doc_tokens"),
    (dict(part_tokens=0), "part_tokens"),
    (dict(sources={}), "sources is empty"),
    (dict(sources={"bad/name": SourceConfig(dataset="json", weight=1.0)}), "bad/name"),
    (dict(name="has space"), "data.name"),
    (dict(batch_size=0), "batch_size"),
])
def test_data_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kwargs)


def test_tokenizer_and_dedup_configs_reject_bad_values():
    with pytest.raises(ValueError, match="eod_token"):
        TokenizerConfig(name="byte", eod_token="<|endoftext|>")
    with pytest.raises(ValueError, match="near_threshold"):
        DedupConfig(near_threshold=0.0)
    with pytest.raises(ValueError, match="num_perm"):
        DedupConfig(num_perm=8)


def test_target_tokens_split_the_budget_by_normalised_weight():
    assert _cfg().target_tokens() == {"a": 750, "b": 250}


def test_fingerprint_tracks_content_not_location():
    base = _cfg().fingerprint()
    assert _cfg(output_dir="/elsewhere", build_if_missing=True).fingerprint() == base
    assert _cfg(max_doc_tokens=2048).fingerprint() != base
    assert _cfg(dedup=DedupConfig(near=True)).fingerprint() != base


def test_offline_default_composes_to_a_byte_tokenizer_corpus_that_builds_itself():
    cfg = compose_data_config("offline")
    assert isinstance(cfg, DataConfig) and cfg.name == "offline"
    assert cfg.tokenizer.name == "byte" and cfg.build_if_missing
    assert cfg.max_doc_tokens == 4096
    assert all(s.dataset == "text" and s.data_files[0].startswith("{stdlib}") for s in cfg.sources.values())


def test_paper_config_has_the_six_sources_with_their_hub_ids_and_fields():
    cfg = compose_data_config("paper")
    src = cfg.sources
    assert (src["fineweb"].dataset, src["fineweb"].text_field) == ("HuggingFaceFW/fineweb", "text")
    assert (src["fineweb2_zh"].dataset, src["fineweb2_zh"].subset) == ("HuggingFaceFW/fineweb-2", "cmn_Hani")
    assert src["dolma"].data_files_from == "hf://datasets/allenai/dolma/urls/v1_7.txt"
    for lang in ("python", "cpp", "java", "rust"):
        s = src[f"starcoder_{lang}"]
        assert (s.dataset, s.data_dir, s.text_field) == ("bigcode/starcoderdata", lang, "content")
    assert src["pes2o"].data_files[0].startswith("hf://datasets/allenai/peS2o/")
    assert (src["dapo_math"].dataset, src["dapo_math"].text_field) == ("BytedTsinghua-SIA/DAPO-Math-17k", "prompt")
    assert sum(s.weight for s in src.values()) == pytest.approx(1.0)
    assert cfg.max_doc_tokens == 4096 and cfg.dedup.exact and cfg.dedup.near
    assert cfg.tokenizer.name == "Qwen/Qwen3-30B-A3B" and not cfg.build_if_missing
    # one corpus directory per tokenizer
    glm = compose_data_config("paper", ["data.tokenizer.name=zai-org/GLM-4.5-Air"])
    assert glm.output_dir.endswith("zai-org/GLM-4.5-Air") and glm.fingerprint() != cfg.fingerprint()
    # composed beside a model config that names its tokenizer, the corpus follows the model
    dsv2 = compose_data_config("paper", ["+model.tokenizer=deepseek-ai/DeepSeek-V2"])
    assert dsv2.tokenizer.name == "deepseek-ai/DeepSeek-V2" and dsv2.output_dir.endswith("DeepSeek-V2")


@pytest.mark.parametrize("model, tokenizer", [("qwen3", "Qwen/Qwen3-30B-A3B"), ("glm45air", "zai-org/GLM-4.5-Air"),
                                              ("deepseekv2", "deepseek-ai/DeepSeek-V2")])
def test_the_trainer_tokenizes_data_paper_with_the_models_tokenizer(model, tokenizer):
    from hydra import compose, initialize_config_dir

    from app.config import register_configs
    from data.store import to_data_config

    register_configs()
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "configs"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"model={model}", "data=paper"])
    assert to_data_config(cfg.data).tokenizer.name == tokenizer


def test_bad_override_fails_at_composition_with_the_field_named():
    with pytest.raises(ValueError, match="num_tokens"):
        compose_data_config("offline", ["data.num_tokens=0"])
