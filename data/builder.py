"""Corpus build: for each source in order, stream its records, drop blank and duplicate documents,
tokenize, truncate, append EOD and write shard parts until the source's token budget (or document cap)
is met or the source runs out; then write the manifest.

Resumable: `progress.json` records, at every committed part, each source's stream position (the
`state_dict()` of its datasets stream), counters and parts. A restarted build verifies the committed
parts, restores the dedup state from them, drops anything uncommitted, and continues from the recorded
stream positions, producing the same shards as an uninterrupted build.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import logging
import platform
import time
from datetime import datetime, timezone
from importlib import metadata
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from data.config import DataConfig
from data.dedup import Deduplicator, normalize
from data.manifest import Manifest, content_hash
from data.packing import finish_document
from data.shards import (PartWriter, load_part_state, part_prefix, remove_uncommitted, verify_part,
                         write_json_atomic)
from data.sources import check_readable, extract_text, iterate_records, open_source
from data.tokenizers import Tokenizer, build_tokenizer, token_dtype

log = logging.getLogger(__name__)

PROGRESS = "progress.json"
LOCK = ".build.lock"
_COUNTERS = ("num_records", "num_documents", "num_tokens", "num_exact_duplicates", "num_near_duplicates",
             "num_too_short", "num_truncated")


@contextlib.contextmanager
def corpus_lock(corpus_dir: Path):
    """Exclusive lock on a corpus directory: concurrent builders (e.g. every rank of a job calling
    ensure_corpus) wait for the first one instead of writing the same files."""
    corpus_dir.mkdir(parents=True, exist_ok=True)
    with open(corpus_dir / LOCK, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_corpus(cfg: DataConfig, *, progress: bool = False) -> Manifest:
    """Build (or finish building) the corpus a config describes; returns its manifest. A complete corpus
    of the same config is returned as it is."""
    out = Path(cfg.output_dir)
    with corpus_lock(out):
        if Manifest.exists(out):
            manifest = Manifest.load(out)
            check_fingerprint(out, manifest.fingerprint, cfg)
            return manifest
        return _Build(cfg, out, progress).run()


def check_fingerprint(out: Path, found: str, cfg: DataConfig) -> None:
    if found != cfg.fingerprint():
        raise ValueError(f"{out} holds a corpus built from a different data config (fingerprint {found[:12]} "
                         f"!= {cfg.fingerprint()[:12]}): set data.output_dir to another directory, or delete "
                         f"{out} to rebuild it")


class _Build:
    def __init__(self, cfg: DataConfig, out: Path, progress: bool) -> None:
        self.cfg, self.out, self.progress = cfg, out, progress
        self.state = self._load_or_start()
        self.tokenizer: Tokenizer = build_tokenizer(cfg.tokenizer)
        self.dtype = token_dtype(self.tokenizer.vocab_size)
        self.dedup = Deduplicator(cfg.dedup)
        self.targets = cfg.target_tokens()
        self.session_start = time.monotonic()
        self.elapsed_before = self.state["elapsed_seconds"]

    def _load_or_start(self) -> dict[str, Any]:
        path = self.out / PROGRESS
        if path.is_file():
            with open(path) as f:
                state = json.load(f)
            check_fingerprint(self.out, state["fingerprint"], self.cfg)
            log.info("resuming the build in %s", self.out)
            return state
        return {"fingerprint": self.cfg.fingerprint(), "elapsed_seconds": 0.0,
                "sources": {name: {"finished": False, "exhausted": False, "stream_state": None, "parts": [],
                                   **{c: 0 for c in _COUNTERS}} for name in self.cfg.sources}}

    def _save_progress(self) -> None:
        self.state["elapsed_seconds"] = self.elapsed_before + time.monotonic() - self.session_start
        write_json_atomic(self.out / PROGRESS, self.state)

    def run(self) -> Manifest:
        for name, spec in self.cfg.sources.items():  # fail before hours of work when a source is unreachable
            if not self.state["sources"][name]["finished"]:
                check_readable(name, spec)
        for name in self.cfg.sources:
            for record in self.state["sources"][name]["parts"]:
                verify_part(self.out, record)
                self.dedup.restore(load_part_state(self.out / record["prefix"]))
        for name in self.cfg.sources:
            if not self.state["sources"][name]["finished"]:
                remove_uncommitted(self.out, name, len(self.state["sources"][name]["parts"]))
                self._build_source(name)
        return self._write_manifest()

    def _build_source(self, name: str) -> None:
        from tqdm import tqdm

        spec, sp, target = self.cfg.sources[name], self.state["sources"][name], self.targets[name]
        stream = open_source(name, spec, sp["stream_state"])
        records = iterate_records(name, spec, stream)
        writer: PartWriter | None = None
        bar = tqdm(total=target, initial=min(sp["num_tokens"], target), unit="tok", unit_scale=True,
                   desc=f"{name:>18}", disable=not self.progress, leave=True)
        done = False
        try:
            while not done:
                batch = list(islice(records, self.cfg.batch_size))
                if not batch:
                    sp["exhausted"] = True
                    break
                writer = writer or PartWriter(part_prefix(self.out, name, len(sp["parts"])), self.dtype)
                before = sp["num_tokens"]
                done = self._process_batch(name, batch, sp, target, writer)
                bar.update(min(sp["num_tokens"], target) - min(before, target))
                bar.set_postfix(docs=sp["num_documents"],
                                dups=sp["num_exact_duplicates"] + sp["num_near_duplicates"])
                if not done and writer.num_tokens >= self.cfg.part_tokens:
                    sp["stream_state"] = stream.state_dict()
                    self._commit(name, writer)
                    writer = None
        except BaseException:
            if writer is not None:
                writer.abort()
            raise
        finally:
            bar.close()
            records.close()
        if writer is not None and writer.num_documents:
            self._commit(name, writer)
        elif writer is not None:
            writer.abort()
        sp["finished"], sp["stream_state"] = True, None
        self._save_progress()
        if sp["exhausted"] and sp["num_tokens"] < target:
            log.warning("source %r ran out after %d of its %d target tokens: its share of the corpus is below "
                        "its weight (lower its weight or raise the others')", name, sp["num_tokens"], target)

    def _process_batch(self, name: str, batch: list[dict], sp: dict, target: int, writer: PartWriter) -> bool:
        """Decide, tokenize and write one batch of records; True when the source has met its budget."""
        spec = self.cfg.sources[name]
        texts = [extract_text(r, spec.text_field, name) for r in batch]
        norms = [normalize(t) for t in texts]
        # Tokenize only what may be kept: not too short and not an exact repeat of a kept document or of
        # an earlier record of this batch (the decisions themselves are made below, in stream order).
        seen_here: set = set()
        wanted = []
        for i, norm in enumerate(norms):
            if len(norm) < self.cfg.min_chars:
                continue
            key = hash(norm)
            if self.cfg.dedup.exact and (key in seen_here or self.dedup.is_known(norm)):
                continue
            seen_here.add(key)
            wanted.append(i)
        encoded = dict(zip(wanted, self.tokenizer.encode_truncated([texts[i] for i in wanted],
                                                                   self.cfg.max_doc_tokens)))
        for i, norm in enumerate(norms):
            sp["num_records"] += 1
            if len(norm) < self.cfg.min_chars:
                sp["num_too_short"] += 1
                continue
            reason, key, sig = self.dedup.check(norm)
            if reason is not None:
                sp[f"num_{reason}_duplicates"] += 1
                continue
            content = encoded[i] if i in encoded else \
                self.tokenizer.encode_truncated([texts[i]], self.cfg.max_doc_tokens)[0]
            doc, truncated = finish_document(content, self.cfg.max_doc_tokens, self.tokenizer.eod_id)
            self.dedup.add(key, sig)
            writer.add(doc)
            sp["num_documents"] += 1
            sp["num_tokens"] += len(doc)
            sp["num_truncated"] += int(truncated)
            if sp["num_tokens"] >= target or (spec.max_documents is not None
                                              and sp["num_documents"] >= spec.max_documents):
                return True
        return False

    def _commit(self, name: str, writer: PartWriter) -> None:
        record = writer.commit(self.dedup.take_part_state(), self.out)
        self.state["sources"][name]["parts"].append(record)
        self._save_progress()

    def _write_manifest(self) -> Manifest:
        cfg, st = self.cfg, self.state["sources"]
        total_tokens = sum(s["num_tokens"] for s in st.values())
        weight_sum = sum(s.weight for s in cfg.sources.values())
        sources = {}
        for name, spec in cfg.sources.items():
            s = st[name]
            sources[name] = {
                "source": dataclasses.asdict(spec),
                "weight": spec.weight / weight_sum,
                "target_tokens": self.targets[name],
                "share": s["num_tokens"] / total_tokens if total_tokens else 0.0,
                "exhausted": s["exhausted"],
                **{c: s[c] for c in _COUNTERS},
                "parts": s["parts"],
            }
        parts = [p for s in sources.values() for p in s["parts"]]
        if not parts:
            raise ValueError(f"the build of {cfg.name!r} kept no document: every source was empty or "
                             "duplicate; check the sources' paths and text_field")
        versions = {"python": platform.python_version()}  # the offline corpus reads this Python's stdlib
        for pkg in ("datasets", "numpy", "megatron-core", "datasketch", "transformers", "tokenizers"):
            with contextlib.suppress(metadata.PackageNotFoundError):
                versions[pkg] = metadata.version(pkg)
        tok = self.tokenizer
        self._save_progress()
        manifest = Manifest(
            name=cfg.name, fingerprint=cfg.fingerprint(),
            tokenizer={"name": tok.name, "vocab_size": tok.vocab_size, "eod_id": tok.eod_id, "pad_id": tok.pad_id,
                       "dtype": np.dtype(self.dtype).name},
            max_doc_tokens=cfg.max_doc_tokens, num_documents=sum(s["num_documents"] for s in st.values()),
            num_tokens=total_tokens, content_hash=content_hash(parts), sources=sources,
            config=dataclasses.asdict(cfg), build_seconds=round(self.state["elapsed_seconds"], 3),
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"), versions=versions)
        manifest.save(self.out)
        return manifest
