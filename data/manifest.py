"""The manifest (`manifest.json`) of a built corpus: what went in (sources, config, tokenizer), how much
(documents, tokens, duplicates and truncations per source), and content hashes of every shard part.
Its presence marks a complete build; loaders read the parts it lists, in its order.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = "topoep-corpus/1"


@dataclass(kw_only=True)
class Manifest:
    name: str
    """Corpus name (DataConfig.name)."""
    fingerprint: str
    """DataConfig.fingerprint() of the config it was built from."""
    tokenizer: dict[str, Any]
    """name, vocab_size, eod_id, pad_id, dtype (of the token shards)."""
    max_doc_tokens: int
    """Longest stored document, EOD included."""
    num_documents: int
    num_tokens: int
    """Tokens stored, EOD tokens included."""
    content_hash: str
    """sha256 over the parts' prefixes and file hashes, in order: equal hashes mean equal corpora."""
    sources: dict[str, dict[str, Any]]
    """Per source: its config, target_tokens, share (realised token share), counts and its parts."""
    config: dict[str, Any]
    """The resolved DataConfig."""
    build_seconds: float
    """Wall time of the build (all sessions of a resumed build together)."""
    created: str
    versions: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT

    def parts(self) -> list[dict[str, Any]]:
        """Part records of all sources, in corpus order."""
        return [p for s in self.sources.values() for p in s["parts"]]

    def save(self, corpus_dir: Path) -> None:
        from data.shards import write_json_atomic

        write_json_atomic(Path(corpus_dir) / MANIFEST, asdict(self))

    @staticmethod
    def exists(corpus_dir: str | Path) -> bool:
        return (Path(corpus_dir) / MANIFEST).is_file()

    @staticmethod
    def load(corpus_dir: str | Path) -> Manifest:
        path = Path(corpus_dir) / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(f"no corpus at {corpus_dir} ({MANIFEST} missing): build it with "
                                    "`python -m data.build data=<offline|paper> data.output_dir=...`")
        with open(path) as f:
            raw = json.load(f)
        if raw.get("format") != FORMAT:
            raise ValueError(f"{path} has format {raw.get('format')!r}, this code reads {FORMAT!r}: rebuild it")
        return Manifest(**raw)


def content_hash(parts: list[dict[str, Any]]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(f"{p['prefix']}:{p['sha256_bin']}:{p['sha256_idx']}\n".encode())
    return h.hexdigest()
