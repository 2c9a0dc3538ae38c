"""Typed configuration of a corpus build: where each source comes from, which tokenizer, how much of
each source, how to deduplicate, where the shards go. Pure dataclasses (no Hydra import); `data.store`
registers them as the Hydra group `data`. Every field that changes the corpus content enters
`DataConfig.fingerprint()`, which guards resumed builds and loaders against mixing corpora.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

# Bumped whenever the builder's output for an unchanged config changes (normalisation, shingling,
# truncation rule, shard layout). Part of every fingerprint.
FORMAT_VERSION = 1

BYTE_TOKENIZER = "byte"
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


@dataclass(kw_only=True)
class TokenizerConfig:
    """Which tokenizer turns text into token ids (the model's own one for a real corpus)."""

    name: str = BYTE_TOKENIZER
    """`byte` for the built-in byte-level tokenizer (256 byte ids + EOD + PAD, nothing to download), or a
    Hugging Face tokenizer: a Hub id such as `Qwen/Qwen3-30B-A3B` or a local directory with its files."""
    eod_token: str | None = None
    """Hugging Face tokenizers only: the token appended after every document. Default: `<|endoftext|>`
    when the vocabulary has it (Qwen3, GLM-4.5), else the tokenizer's eos_token (DeepSeek-V2)."""
    revision: str | None = None
    """Hugging Face tokenizers only: Hub revision (branch, tag or commit) to pin."""
    trust_remote_code: bool = False
    """Hugging Face tokenizers only: allow tokenizer code shipped in the Hub repository."""

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("tokenizer.name is empty: use 'byte' or a Hugging Face tokenizer id such as "
                             "'Qwen/Qwen3-30B-A3B'")
        if self.name == BYTE_TOKENIZER and (self.eod_token is not None or self.revision is not None):
            raise ValueError("tokenizer.eod_token and tokenizer.revision apply to Hugging Face tokenizers "
                             f"only; the byte tokenizer has fixed ids (got eod_token={self.eod_token!r}, "
                             f"revision={self.revision!r}): leave them null")


@dataclass(kw_only=True)
class SourceConfig:
    """One stream of documents, read with `datasets.load_dataset(..., streaming=True)`."""

    dataset: str
    """First argument of `datasets.load_dataset`: a Hub dataset id (`HuggingFaceFW/fineweb`) or a packaged
    builder (`json`, `parquet`, `text`) used with `data_files`."""
    subset: str | None = None
    """Hub configuration name (`name=` of load_dataset), e.g. `cmn_Hani` for FineWeb2."""
    data_dir: str | None = None
    """Directory inside the dataset repository, e.g. `python` for StarCoderData."""
    data_files: list[str] | None = None
    """Files or glob patterns (local paths, `hf://datasets/...` or URLs). `{stdlib}` expands to this
    Python's standard-library directory."""
    data_files_from: str | None = None
    """A text file (local, `hf://` or URL) listing one data file per line, e.g. Dolma's `urls/v1_7.txt`.
    Exclusive with data_files."""
    shuffle_files_seed: int | None = None
    """Shuffle the file list of data_files_from with this seed before reading (Dolma's list is ordered by
    subset, so its first files would all be one subset); null keeps the listed order."""
    split: str = "train"
    """Split to read."""
    revision: str | None = None
    """Hub revision to pin (branch, tag or commit)."""
    path: str | None = None
    """A local copy that replaces `dataset`: a directory written by `save_to_disk`, or a directory laid
    out like the Hub repository (subset, data_dir, data_files and split still apply)."""
    builder_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for load_dataset, e.g. `{sample_by: document}` for the `text` builder."""
    text_field: str = "text"
    """Record field holding the document: a string, or a list of chat messages whose `content` values
    are joined (DAPO-Math-17K's `prompt`)."""
    weight: float
    """Share of the corpus tokens this source should supply (weights are normalised over sources)."""
    max_documents: int | None = None
    """Cap on the documents kept from this source (after deduplication); null for no cap."""

    def __post_init__(self) -> None:
        if not self.dataset:
            raise ValueError("source.dataset is empty: give a Hub id (e.g. 'HuggingFaceFW/fineweb') or a "
                             "packaged builder ('json', 'parquet', 'text') with data_files")
        src = f"source {self.dataset!r}"  # the key in data.sources is not known here; the dataset is
        if not self.weight > 0:
            raise ValueError(f"{src}: weight must be > 0, got {self.weight} (remove a source with "
                             "'~data.sources.NAME' instead of a zero weight)")
        if self.data_files is not None and self.data_files_from is not None:
            raise ValueError(f"{src}: data_files and data_files_from are exclusive: set one of them")
        if self.data_files is not None and len(self.data_files) == 0:
            raise ValueError(f"{src}: data_files is an empty list: give at least one file or pattern, or null")
        if self.shuffle_files_seed is not None and (self.data_files_from is None or self.shuffle_files_seed < 0):
            raise ValueError(f"{src}: shuffle_files_seed ({self.shuffle_files_seed}) must be >= 0 and needs "
                             "data_files_from (a listed set of files to shuffle)")
        if self.max_documents is not None and self.max_documents < 1:
            raise ValueError(f"{src}: max_documents must be >= 1 or null, got {self.max_documents}")
        if not self.text_field:
            raise ValueError(f"{src}: text_field is empty: name the record field holding the text")
        if not self.split:
            raise ValueError(f"{src}: split is empty: use e.g. 'train'")


@dataclass(kw_only=True)
class DedupConfig:
    """Duplicate removal, in stream order: the first occurrence of a document is kept."""

    exact: bool = True
    """Drop documents whose normalised text (NFKC, case-folded, whitespace collapsed) was seen before."""
    near: bool = False
    """Also drop near-duplicates: MinHash (datasketch) over character n-grams of the normalised text, LSH
    candidates confirmed by estimated Jaccard similarity >= near_threshold."""
    near_threshold: float = 0.8
    """Jaccard similarity at or above which a document is a near-duplicate, in (0, 1]."""
    num_perm: int = 128
    """MinHash permutations (signature length)."""
    ngram: int = 9
    """Characters per shingle (character n-grams work for Chinese and code, where words do not)."""
    seed: int = 1
    """MinHash permutation seed."""

    def __post_init__(self) -> None:
        if not 0.0 < self.near_threshold <= 1.0:
            raise ValueError(f"dedup.near_threshold must be in (0, 1], got {self.near_threshold}")
        if not 16 <= self.num_perm <= 1024:
            raise ValueError(f"dedup.num_perm must be in [16, 1024], got {self.num_perm}")
        if not 1 <= self.ngram <= 64:
            raise ValueError(f"dedup.ngram must be in [1, 64], got {self.ngram}")
        if self.seed < 0:
            raise ValueError(f"dedup.seed must be >= 0, got {self.seed}")


@dataclass(kw_only=True)
class DataConfig:
    """A corpus: its sources and mixture, tokenizer, deduplication, truncation and output location."""

    name: str
    """Corpus name, recorded in the manifest."""
    output_dir: str
    """Directory of the shards, progress file and manifest (relative paths: to the working directory)."""
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    """Tokenizer used for truncation and token ids; name the model's own tokenizer for a real corpus."""
    sources: dict[str, SourceConfig] = field(default_factory=dict)
    """Sources by name (the name becomes a sub-directory); processed in this order."""
    num_tokens: int
    """Total token budget; source s gets round(num_tokens * weight_s / sum of weights) tokens (a source
    stops after the document that reaches its budget, so it overshoots by less than max_doc_tokens)."""
    max_doc_tokens: int = 4096
    """Longest stored document in tokens, its end-of-document token included; longer ones are truncated."""
    min_chars: int = 1
    """Documents whose normalised text has fewer characters are dropped (empty files, blank records)."""
    dedup: DedupConfig = field(default_factory=DedupConfig)
    """Duplicate removal."""
    part_tokens: int = 1 << 27
    """Tokens per shard part (a source's shard is written as parts of about this size; an interrupted
    build resumes after the last complete part)."""
    batch_size: int = 256
    """Records read and tokenized together; parts end on batch boundaries."""
    build_if_missing: bool = False
    """Let `ensure_corpus` (the trainer) build the corpus when output_dir has none. True only for small
    local corpora; a real corpus is built once with `python -m data.build`."""

    def __post_init__(self) -> None:
        if not _NAME_RE.match(self.name or ""):
            raise ValueError(f"data.name must match {_NAME_RE.pattern}, got {self.name!r}")
        if not self.output_dir:
            raise ValueError("data.output_dir is empty: give the directory for the corpus shards")
        if not self.sources:
            raise ValueError("data.sources is empty: configure at least one source")
        for key in self.sources:
            if not _NAME_RE.match(key):
                raise ValueError(f"data.sources key {key!r} must match {_NAME_RE.pattern} (it names a "
                                 "directory)")
        if self.num_tokens < 1:
            raise ValueError(f"data.num_tokens must be >= 1, got {self.num_tokens}")
        if self.max_doc_tokens < 2:
            raise ValueError(f"data.max_doc_tokens must be >= 2 (one content token and the end-of-document "
                             f"token), got {self.max_doc_tokens}")
        if self.min_chars < 1:
            raise ValueError(f"data.min_chars must be >= 1, got {self.min_chars}")
        if self.part_tokens < 1:
            raise ValueError(f"data.part_tokens must be >= 1, got {self.part_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"data.batch_size must be >= 1, got {self.batch_size}")

    def target_tokens(self) -> dict[str, int]:
        """Token budget per source: num_tokens split by the normalised weights."""
        total = sum(s.weight for s in self.sources.values())
        return {k: max(1, round(self.num_tokens * s.weight / total)) for k, s in self.sources.items()}

    def fingerprint(self) -> str:
        """sha256 of everything that determines the corpus content (not output_dir, build_if_missing)."""
        content = dataclasses.asdict(self)
        for key in ("output_dir", "build_if_missing"):
            content.pop(key)
        content["format_version"] = FORMAT_VERSION
        blob = json.dumps(content, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()
