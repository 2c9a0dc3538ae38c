"""Small local stand-ins of the paper's six sources, for tests and smoke runs without network.

Each is written in the layout and with the record fields of the real dataset, so the paper config reads
them through the same `load_dataset` / `load_from_disk` calls as the Hub copies, with only the location
overridden (`fixture_overrides`). Texts are synthetic and seeded; a few records repeat across sources
(exactly, or with changed case and spacing) and DAPO-Math repeats every prompt, as the real one does
(about 100 copies of each of its ~17k prompts).
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import numpy as np

_WORDS = ("model expert token layer router balance network training data parallel rank domain gradient "
          "replica slot latency throughput memory kernel schedule batch sequence attention vector matrix "
          "sparse dense optimizer checkpoint cluster node fabric bandwidth topology planner").split()
_CJK = [chr(c) for c in range(0x4E00, 0x4E00 + 400)]
_LANGS = {"python": "def {f}(x):\n    return x + {n}\n", "cpp": "int {f}(int x) {{ return x + {n}; }}\n",
          "java": "static int {f}(int x) {{ return x + {n}; }}\n", "rust": "fn {f}(x: i64) -> i64 {{ x + {n} }}\n"}


def _english(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(_WORDS, size=n_words)
    return " ".join(words) + "."


def _chinese(rng: np.random.Generator, n_chars: int) -> str:
    return "".join(rng.choice(_CJK, size=n_chars)) + "。"


def _code(rng: np.random.Generator, lang: str, n_funcs: int) -> str:
    return "".join(_LANGS[lang].format(f=f"f{rng.integers(1 << 30)}", n=rng.integers(100)) for _ in range(n_funcs))


def _lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> list[int]:
    return [int(x) for x in rng.integers(lo, hi, size=n)]


def write_paper_fixtures(root: str | Path, *, num_docs: int = 30, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Write the six stand-ins under root; returns {source name in configs/data/paper.yaml: field
    overrides pointing it at its stand-in}."""
    import datasets

    root = Path(root)
    rng = np.random.default_rng(seed)
    n = num_docs

    fineweb_text = [_english(rng, k) for k in _lengths(rng, n, 40, 400)]
    fineweb_text[3] = _english(rng, 3000)  # longer than 4096 byte tokens: truncated
    fineweb = datasets.Dataset.from_dict({
        "text": fineweb_text, "id": [f"<urn:uuid:{i:08d}>" for i in range(n)],
        "dump": ["CC-MAIN-2024-10"] * n, "url": [f"https://example.org/{i}" for i in range(n)],
        "date": ["2024-02-20T00:00:00Z"] * n, "file_path": ["s3://commoncrawl/x.warc.gz"] * n,
        "language": ["en"] * n, "language_score": [0.9] * n,
        "token_count": [len(t) // 4 for t in fineweb_text]})
    datasets.DatasetDict({"train": fineweb}).save_to_disk(root / "fineweb")

    zh = [_chinese(rng, k) for k in _lengths(rng, n, 50, 600)]
    fineweb2 = datasets.Dataset.from_dict({
        "text": zh, "id": [f"<urn:uuid:zh{i:06d}>" for i in range(n)], "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.cn/{i}" for i in range(n)], "date": ["2024-02-20T00:00:00Z"] * n,
        "file_path": ["s3://commoncrawl/y.warc.gz"] * n, "language": ["cmn"] * n, "language_score": [0.95] * n,
        "language_script": ["Hani"] * n, "minhash_cluster_size": [1] * n,
        "top_langs": ['{"cmn_Hani_score": 0.95}'] * n})
    datasets.DatasetDict({"train": fineweb2}).save_to_disk(root / "fineweb-2")

    dolma_dir = root / "dolma"
    dolma_dir.mkdir(parents=True, exist_ok=True)
    dolma_text = [_english(rng, k) for k in _lengths(rng, n, 40, 300)]
    dolma_text[0] = "  " + fineweb_text[0].upper().replace(" ", "   ") + "\n"  # normalised exact duplicate
    files = []
    for f in range(2):
        path = dolma_dir / f"v1_7-{f:04d}.json.gz"
        with gzip.open(path, "wt") as out:
            for i in range(f, n, 2):
                record = {"id": f"dolma-{i}", "text": dolma_text[i], "added": "2024-04-01", "created": "2023-01-01",
                          "source": "c4", "metadata": {"length": len(dolma_text[i])}}
                out.write(json.dumps(record) + "\n")
        files.append(str(path))
    (dolma_dir / "urls.txt").write_text("\n".join(files) + "\n")

    for lang in _LANGS:
        lang_dir = root / "starcoderdata" / lang
        lang_dir.mkdir(parents=True, exist_ok=True)
        content = [_code(rng, lang, k) for k in _lengths(rng, n, 2, 30)]
        datasets.Dataset.from_dict({
            "max_stars_repo_path": [f"src/{i}.{lang}" for i in range(n)],
            "max_stars_repo_name": [f"org/repo{i}" for i in range(n)], "max_stars_count": list(range(n)),
            "id": [str(i) for i in range(n)], "content": content,
        }).to_parquet(lang_dir / "train-00000-of-00001.parquet")

    pes2o_dir = root / "peS2o" / "data" / "v2"
    pes2o_dir.mkdir(parents=True, exist_ok=True)
    for f in range(2):
        with gzip.open(pes2o_dir / f"train-{f:05d}-of-00002.json.gz", "wt") as out:
            for i in range(f, n, 2):
                out.write(json.dumps({"added": "2023-01-03", "created": "2021-05-01", "id": str(1000 + i),
                                      "source": "s2orc", "text": _english(rng, int(rng.integers(100, 900))),
                                      "version": "v2"}) + "\n")

    prompts = [f"Solve: {_english(rng, 12)} Remember to put your answer on its own line after \"Answer:\"."
               for _ in range(max(1, n // 3))]
    rows = [p for p in prompts for _ in range(3)]  # every prompt three times, as the real set repeats them
    dapo_dir = root / "DAPO-Math-17k" / "data"
    dapo_dir.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict({
        "data_source": ["math_dapo"] * len(rows),
        "prompt": [[{"content": p, "role": "user"}] for p in rows],
        "ability": ["MATH"] * len(rows),
        "reward_model": [{"ground_truth": str(i % 97), "style": "rule-lighteval/MATH_v2"} for i in range(len(rows))],
        "extra_info": [{"index": f"{i // 3:05d}"} for i in range(len(rows))],
    }).to_parquet(dapo_dir / "dapo-math-17k.parquet")

    starcoder = {f"starcoder_{lang}": {"path": str(root / "starcoderdata")} for lang in _LANGS}
    return {
        "fineweb": {"path": str(root / "fineweb")},
        "fineweb2_zh": {"path": str(root / "fineweb-2")},
        "dolma": {"data_files_from": str(dolma_dir / "urls.txt")},
        **starcoder,
        "pes2o": {"data_files": [str(pes2o_dir / "train-*.json.gz")]},
        "dapo_math": {"path": str(root / "DAPO-Math-17k")},
    }


def write_text_dataset(path: str | Path, texts: list[str], *, field: str = "text") -> str:
    """A one-split (train) DatasetDict with one text field, saved with save_to_disk; returns the path."""
    import datasets

    datasets.DatasetDict({"train": datasets.Dataset.from_dict({field: list(texts)})}).save_to_disk(str(path))
    return str(path)


def fixture_overrides(overrides: dict[str, dict[str, Any]]) -> list[str]:
    """Hydra command-line overrides (data.sources.NAME.FIELD=VALUE) for write_paper_fixtures' result."""
    out = []
    for name, fields in overrides.items():
        for key, value in fields.items():
            out.append(f"data.sources.{name}.{key}={json.dumps(value)}")
    return out
