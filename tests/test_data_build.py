"""Integration tests (CPU, no network): the corpus builder on local stand-ins of the six sources, written
with the real datasets' layouts and field names and read through the same datasets calls as the Hub
(configs/data/paper.yaml with only the locations overridden); mixture budgets; resume after a crash;
errors for unreachable sources; the offline default and the build CLI."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import data.shards
from data import build_corpus, build_loader, compose_data_config, ensure_corpus
from data.config import DataConfig, SourceConfig
from data.loader import Corpus
from data.manifest import Manifest
from data.sources import SourceUnavailableError, extract_text
from data.testing import fixture_overrides, write_paper_fixtures, write_text_dataset
from data.tokenizers import ByteTokenizer

REPO = Path(__file__).resolve().parent.parent
EOD = ByteTokenizer.eod_id
N = 30  # records per fixture source


@pytest.fixture(scope="module")
def paper_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("paper_sources")
    return root, write_paper_fixtures(root, num_docs=N)


def _paper_cfg(paper_sources, out: Path, *extra: str) -> DataConfig:
    _, overrides = paper_sources
    # a budget larger than the stand-ins: every source is read to its end
    return compose_data_config("paper", ["data.tokenizer.name=byte", f"data.output_dir={out}",
                                         "data.num_tokens=100000000", "data.part_tokens=8192",
                                         "data.batch_size=8", *fixture_overrides(overrides), *extra])


@pytest.fixture(scope="module")
def paper_build(paper_sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("paper_corpus")
    cfg = _paper_cfg(paper_sources, out)
    return cfg, build_corpus(cfg)


def test_six_sources_are_read_deduplicated_and_counted(paper_build):
    _, m = paper_build
    s = m.sources
    assert list(s) == ["fineweb", "fineweb2_zh", "dolma", "starcoder_python", "starcoder_cpp", "starcoder_java",
                       "starcoder_rust", "pes2o", "dapo_math"]
    for name in s:
        assert s[name]["num_records"] == (N if name != "dapo_math" else 3 * (N // 3)) and s[name]["exhausted"]
    # dolma's first record is fineweb's first one in other case and spacing: an exact duplicate after
    # normalisation, across sources; DAPO repeats each prompt three times
    assert (s["dolma"]["num_documents"], s["dolma"]["num_exact_duplicates"]) == (N - 1, 1)
    assert (s["dapo_math"]["num_documents"], s["dapo_math"]["num_exact_duplicates"]) == (N // 3, 2 * (N // 3))
    assert s["fineweb"]["num_truncated"] >= 1  # its 4th record is far longer than 4096 byte tokens
    assert m.num_documents == sum(x["num_documents"] for x in s.values())
    assert m.num_tokens == sum(p["num_tokens"] for p in m.parts())
    assert len(s["fineweb"]["parts"]) > 1 and all(len(p["sha256_bin"]) == 64 for p in m.parts())


def test_stored_documents_are_the_source_texts_truncated_with_eod(paper_build, paper_sources):
    import datasets

    cfg, m = paper_build
    corpus = Corpus(cfg.output_dir)
    lengths = corpus.document_lengths
    assert lengths.max() <= cfg.max_doc_tokens
    for d in range(corpus.num_documents):
        doc = corpus.document(d)
        assert doc[-1] == EOD and EOD not in doc[:-1]
    root, _ = paper_sources
    fineweb = datasets.load_from_disk(str(root / "fineweb"))["train"]["text"]
    for i in (0, 3):  # doc 3 is truncated to 4095 bytes + EOD
        want = np.frombuffer(fineweb[i].encode(), dtype=np.uint8)[:cfg.max_doc_tokens - 1]
        assert np.array_equal(corpus.document(i)[:-1], want)
    assert len(corpus.document(3)) == cfg.max_doc_tokens
    # the DAPO text is the content of its chat messages
    first_dapo = sum(m.sources[n]["num_documents"] for n in list(m.sources)[:-1])
    text = ByteTokenizer().decode(corpus.document(first_dapo))
    assert text.startswith("Solve: ") and "role" not in text


def test_build_is_deterministic(paper_build, paper_sources, tmp_path):
    _, m = paper_build
    again = build_corpus(_paper_cfg(paper_sources, tmp_path / "again"))
    assert again.content_hash == m.content_hash


class _Crash(Exception):
    pass


@pytest.mark.parametrize("crash_after", [2, 9])  # inside fineweb's parts; inside a later source
def test_interrupted_build_resumes_to_the_same_corpus(paper_build, paper_sources, tmp_path, monkeypatch, crash_after):
    _, reference = paper_build
    cfg = _paper_cfg(paper_sources, tmp_path / "resumed")
    commit = data.shards.PartWriter.commit
    calls = {"n": 0}

    def crashing_commit(self, *args, **kwargs):
        if calls["n"] == crash_after:
            raise _Crash()
        calls["n"] += 1
        return commit(self, *args, **kwargs)

    monkeypatch.setattr(data.shards.PartWriter, "commit", crashing_commit)
    with pytest.raises(_Crash):
        build_corpus(cfg)
    out = Path(cfg.output_dir)
    assert not Manifest.exists(out) and (out / "progress.json").exists()
    assert not list(out.rglob("*.tmp*"))  # the part being written was dropped
    monkeypatch.setattr(data.shards.PartWriter, "commit", commit)
    resumed = build_corpus(cfg)
    assert resumed.content_hash == reference.content_hash
    counters = ("num_records", "num_documents", "num_tokens", "num_exact_duplicates", "num_near_duplicates")
    for name, s in reference.sources.items():  # the stream continued where it stopped: nothing re-read
        assert {c: resumed.sources[name][c] for c in counters} == {c: s[c] for c in counters}


def test_complete_corpus_is_returned_and_a_changed_config_is_refused(paper_build, paper_sources):
    cfg, m = paper_build
    manifest_file = Path(cfg.output_dir) / "manifest.json"
    before = manifest_file.stat().st_mtime_ns
    assert build_corpus(cfg).content_hash == m.content_hash
    assert manifest_file.stat().st_mtime_ns == before
    changed = _paper_cfg(paper_sources, Path(cfg.output_dir), "data.sources.fineweb.weight=0.5")
    with pytest.raises(ValueError, match="different data config"):
        build_corpus(changed)


def _mixture_cfg(tmp_path: Path, weights: dict[str, float], num_tokens: int) -> DataConfig:
    rng = np.random.default_rng(0)
    sources = {}
    for k, (name, w) in enumerate(weights.items()):
        alphabet = [chr(ord("a") + 8 * k + j) for j in range(8)]  # disjoint letters per source
        texts = ["".join(rng.choice(alphabet, size=int(n))) for n in rng.integers(40, 160, size=600)]
        sources[name] = SourceConfig(dataset="unused", path=write_text_dataset(tmp_path / name, texts), weight=w)
    return DataConfig(name="mix", output_dir=str(tmp_path / "corpus"), num_tokens=num_tokens,
                      sources=sources, part_tokens=4096, batch_size=16)


def test_mixture_weights_are_respected_in_the_corpus_and_the_loader(tmp_path):
    weights = {"src_a": 0.5, "src_b": 0.3, "src_c": 0.2}
    cfg = _mixture_cfg(tmp_path, weights, num_tokens=24000)
    m = build_corpus(cfg)
    for name, w in weights.items():
        s = m.sources[name]
        assert not s["exhausted"] and s["target_tokens"] == round(24000 * w)
        assert 0 <= s["num_tokens"] - s["target_tokens"] < 161  # stops after the document reaching its budget
        assert s["share"] == pytest.approx(w, abs=0.01)
    loader = build_loader(cfg, seq_length=64, micro_batch_size=8, dp_rank=0, dp_size=1, seed=3)
    counts = np.zeros(3)
    for _ in range(loader.sequences.samples_per_epoch // 16):  # the first half of an epoch
        tokens = next(loader)["tokens"].numpy().ravel()
        tokens = tokens[tokens < 256]
        counts += np.bincount((tokens - ord("a")) // 8, minlength=3)[:3]
    assert counts / counts.sum() == pytest.approx(list(weights.values()), abs=0.05)


def test_a_short_source_runs_out_and_is_reported(tmp_path):
    cfg = _mixture_cfg(tmp_path, {"src_a": 0.5, "src_b": 0.5}, num_tokens=200000)
    m = build_corpus(cfg)
    assert all(s["exhausted"] and s["num_tokens"] < s["target_tokens"] for s in m.sources.values())


@pytest.fixture
def hub_offline(monkeypatch):
    """What a machine without network sees, without waiting for retries."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_unreachable_hub_source_fails_before_any_shard_is_written(tmp_path, hub_offline):
    local = write_text_dataset(tmp_path / "local", ["some text"] * 3)
    cfg = DataConfig(name="t", output_dir=str(tmp_path / "out"), num_tokens=1000, sources={
        "local": SourceConfig(dataset="unused", path=local, weight=1.0),
        "fineweb": SourceConfig(dataset="HuggingFaceFW/fineweb", subset="sample-10BT", weight=1.0)})
    with pytest.raises(SourceUnavailableError) as err:
        build_corpus(cfg)
    msg = str(err.value)
    assert "'fineweb'" in msg and "HuggingFaceFW/fineweb" in msg and "data.sources.fineweb.path" in msg
    assert not list((tmp_path / "out").rglob("*.bin"))


def test_missing_local_copy_is_reported(tmp_path):
    cfg = DataConfig(name="t", output_dir=str(tmp_path / "out"), num_tokens=1000, sources={
        "pes2o": SourceConfig(dataset="json", data_files=[str(tmp_path / "nowhere/*.json.gz")], weight=1.0)})
    with pytest.raises(SourceUnavailableError, match="'pes2o'"):
        build_corpus(cfg)


def test_wrong_text_field_names_the_fields_that_exist(tmp_path):
    path = tmp_path / "starcoder.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write(json.dumps({"content": "int main() {}", "max_stars_repo_path": "a.c"}) + "\n")
    cfg = DataConfig(name="t", output_dir=str(tmp_path / "out"), num_tokens=1000, sources={
        "code": SourceConfig(dataset="json", data_files=[str(path)], weight=1.0)})  # text_field: text
    with pytest.raises(ValueError, match=r"no field 'text'.*'content'"):
        build_corpus(cfg)


def test_text_extraction_handles_dapo_chat_messages():
    record = {"data_source": "math_dapo", "prompt": [{"content": "What is 1+1?", "role": "user"}],
              "reward_model": {"ground_truth": "2", "style": "rule"}}
    assert extract_text(record, "prompt", "dapo_math") == "What is 1+1?"
    with pytest.raises(ValueError, match="reward_model"):
        extract_text(record, "reward_model", "dapo_math")


def test_a_missing_real_corpus_says_how_to_build_it(tmp_path):
    cfg = compose_data_config("paper", [f"data.output_dir={tmp_path / 'none'}"])
    with pytest.raises(FileNotFoundError, match="python -m data.build data=paper"):
        ensure_corpus(cfg)


def test_offline_default_builds_on_first_use_and_feeds_the_loader(tmp_path):
    cfg = compose_data_config("offline", [f"data.output_dir={tmp_path / 'offline'}"])
    loader = build_loader(cfg, seq_length=256, micro_batch_size=2, dp_rank=0, dp_size=1, seed=0)
    batch = next(loader)
    assert batch["tokens"].shape == (2, 256) and int(batch["tokens"].max()) < loader.vocab_size == 258
    m = Manifest.load(cfg.output_dir)
    assert m.num_tokens >= cfg.num_tokens and m.tokenizer["dtype"] == "uint16"
    assert m.sources["stdlib_packages"]["num_near_duplicates"] > 0  # encodings/*.py are near-copies
    assert all(s["share"] == pytest.approx(0.5, abs=0.01) for s in m.sources.values())


def test_build_cli_writes_the_corpus_and_its_resolved_config(tmp_path):
    out = tmp_path / "cli"
    run = subprocess.run([sys.executable, "-m", "data.build", f"data.output_dir={out}", "data.num_tokens=20000"],
                         cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "stdlib_modules" in run.stdout and "total" in run.stdout
    assert Manifest.exists(out) and (out / "build_config.yaml").is_file()
    bad = subprocess.run([sys.executable, "-m", "data.build", f"data.output_dir={tmp_path / 'bad'}",
                          "data.sources.stdlib_modules.data_files=[/nonexistent/*.py]"],
                         cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 1 and "error: cannot read source 'stdlib_modules'" in bad.stderr
