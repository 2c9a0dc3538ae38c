"""Shard parts on disk, in megatron's indexed-dataset format (written by megatron's own
`IndexedDatasetBuilder`, one sequence per document, so `IndexedDataset`, `GPTDataset` and
`BlendedDataset` read them as they read `preprocess_data.py` output).

Layout under the corpus directory: `<source>/part-00000.bin|.idx` (tokens and index) and
`<source>/part-00000.dedup.npz` (the dedup keys of its documents, for resuming). A part is written under a
`.tmp` name and renamed when complete, so a crash leaves either a whole part or nothing that counts.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from data.dedup import PartState


def part_prefix(corpus_dir: Path, source: str, index: int) -> Path:
    """Path prefix (without .bin/.idx) of a source's index-th part."""
    return corpus_dir / source / f"part-{index:05d}"


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class PartWriter:
    """Collects the stored documents of one part; commit() makes it visible under its final name."""

    def __init__(self, prefix: Path, dtype: type[np.number]) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

        self.prefix = prefix
        self._tmp = prefix.with_name(prefix.name + ".tmp")
        prefix.parent.mkdir(parents=True, exist_ok=True)
        self._builder = IndexedDatasetBuilder(f"{self._tmp}.bin", dtype=dtype)
        self.num_documents = 0
        self.num_tokens = 0

    def add(self, document: np.ndarray) -> None:
        """Append one stored document (its EOD included) as one sequence and one document."""
        self._builder.add_document(document, [len(document)])
        self.num_documents += 1
        self.num_tokens += len(document)

    def commit(self, dedup: PartState, corpus_dir: Path) -> dict[str, Any]:
        """Finish the files, save the dedup state, rename into place; returns the part's manifest record."""
        self._builder.finalize(f"{self._tmp}.idx")
        npz_tmp = self._tmp.with_name(self._tmp.name + ".dedup.npz")
        arrays = {"exact_keys": dedup.exact_keys}
        if dedup.signatures is not None:
            arrays["signatures"] = dedup.signatures
        np.savez(npz_tmp, **arrays)
        for suffix in (".bin", ".idx", ".dedup.npz"):
            os.replace(f"{self._tmp}{suffix}", f"{self.prefix}{suffix}")
        return {
            "prefix": str(self.prefix.relative_to(corpus_dir)),
            "num_documents": self.num_documents,
            "num_tokens": self.num_tokens,
            "sha256_bin": sha256_file(Path(f"{self.prefix}.bin")),
            "sha256_idx": sha256_file(Path(f"{self.prefix}.idx")),
        }

    def abort(self) -> None:
        """Drop an uncommitted part."""
        self._builder.data_file.close()
        for suffix in (".bin", ".idx", ".dedup.npz"):
            Path(f"{self._tmp}{suffix}").unlink(missing_ok=True)


def load_part_state(prefix: Path) -> PartState:
    """The dedup state a committed part saved."""
    with np.load(f"{prefix}.dedup.npz") as z:
        return PartState(exact_keys=z["exact_keys"], signatures=z["signatures"] if "signatures" in z else None)


def verify_part(corpus_dir: Path, record: dict[str, Any]) -> None:
    """Raise ValueError when a committed part's files are missing or differ from their recorded hashes."""
    prefix = corpus_dir / record["prefix"]
    for suffix, key in ((".bin", "sha256_bin"), (".idx", "sha256_idx")):
        path = Path(f"{prefix}{suffix}")
        if not path.exists():
            raise ValueError(f"committed part file {path} is missing: delete {corpus_dir} and build again")
        if sha256_file(path) != record[key]:
            raise ValueError(f"committed part file {path} does not match its recorded sha256 (changed after "
                             f"it was written): delete {corpus_dir} and build again")


def remove_uncommitted(corpus_dir: Path, source: str, num_committed: int) -> None:
    """Delete a source's temporary files and parts beyond the committed ones (left by a crash)."""
    src_dir = corpus_dir / source
    if not src_dir.is_dir():
        return
    for path in src_dir.iterdir():
        name = path.name
        if ".tmp" in name:
            path.unlink()
        elif name.startswith("part-") and int(name[5:10]) >= num_committed:
            path.unlink()
