"""Reading a built corpus for training: deterministic packed sequences, sharded over data-parallel ranks,
resumable from a sample count.

Order: epoch e shuffles the documents and, after packing them into windows of seq_length + 1 tokens
(`data.packing`), shuffles the windows; both permutations come from (seed, e). Global sample g is window
sample_order_e[g mod M] of epoch e = g div M. The stream of global samples depends only on the corpus,
the seed and seq_length, never on the number of ranks.

Sharding and resume (megatron's MegatronPretrainingSampler convention): with B = micro_batch_size and D
data-parallel ranks, micro-batch k of rank r holds global samples c + k*B*D + r*B ... + B - 1, where
c = consumed_samples at construction; `consumed_samples` counts the samples of all ranks, so a
checkpoint stores one number and a restart (even with another D) continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data.builder import build_corpus, check_fingerprint
from data.config import DataConfig
from data.manifest import Manifest
from data.packing import epoch_orders, samples_per_epoch, window_pieces

log = logging.getLogger(__name__)


def ensure_corpus(cfg: DataConfig, *, progress: bool = False) -> Manifest:
    """The manifest of cfg's corpus; builds it first when it is missing and cfg.build_if_missing is set
    (the offline default). Concurrent callers (all ranks of a job on one machine) wait for one build."""
    out = Path(cfg.output_dir)
    if Manifest.exists(out):
        manifest = Manifest.load(out)
        check_fingerprint(out, manifest.fingerprint, cfg)
        return manifest
    if not cfg.build_if_missing:
        raise FileNotFoundError(
            f"no corpus {cfg.name!r} at {out}. Build it first: python -m data.build data={cfg.name} "
            f"data.output_dir={out} (it needs network access to the Hugging Face Hub; the offline default "
            "needs none: data=offline)")
    if progress:  # (the logging rank: every rank of a machine calls this, one builds, the others wait)
        log.info("building the %r corpus in %s (first use)", cfg.name, out)
    return build_corpus(cfg, progress=progress)


class Corpus:
    """A built corpus as documents (memory-mapped through megatron's IndexedDataset)."""

    def __init__(self, corpus_dir: str | Path) -> None:
        from megatron.core.datasets.indexed_dataset import IndexedDataset

        self.dir = Path(corpus_dir)
        self.manifest = Manifest.load(self.dir)
        with warnings.catch_warnings():  # megatron warns that it cannot tell the rank outside torch.distributed
            warnings.filterwarnings("ignore", message="Could not determine rank")
            self._parts = [IndexedDataset(str(self.dir / p["prefix"])) for p in self.manifest.parts()]
        lengths = [ds.sequence_lengths.astype(np.int64) for ds in self._parts]
        self.document_lengths = np.concatenate(lengths)  # int64[N]
        self._first_doc = np.cumsum([0] + [len(x) for x in lengths])  # int64[P + 1]
        if len(self.document_lengths) != self.manifest.num_documents or \
                int(self.document_lengths.sum()) != self.manifest.num_tokens:
            raise ValueError(f"{self.dir}: shard contents disagree with {self.dir / 'manifest.json'} "
                             "(documents or tokens): rebuild the corpus")

    @property
    def num_documents(self) -> int:
        return len(self.document_lengths)

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    def read(self, doc: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """int64 copy of tokens [offset, offset + length) of document doc (global index, manifest order).
        A copy: IndexedDataset returns views of its mmap, which die with it."""
        part = int(np.searchsorted(self._first_doc, doc, side="right")) - 1
        view = self._parts[part].get(doc - int(self._first_doc[part]), offset=offset, length=length)
        return view.astype(np.int64)

    def document(self, doc: int) -> np.ndarray:
        return self.read(doc)


class PackedSequences:
    """Global sample g -> int64[seq_length + 1] tokens, for one corpus, seed and seq_length."""

    def __init__(self, corpus: Corpus, *, seq_length: int, seed: int) -> None:
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        self.corpus, self.seq_length, self.seed = corpus, seq_length, seed
        self.samples_per_epoch = samples_per_epoch(corpus.num_tokens, seq_length)
        if self.samples_per_epoch == 0:
            raise ValueError(f"corpus {corpus.dir} has {corpus.num_tokens} tokens, fewer than seq_length + 1 = "
                             f"{seq_length + 1}: lower the sequence length (trainer.seq_length) or build a larger corpus "
                             f"(data.num_tokens)")
        self._epoch_cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if epoch not in self._epoch_cache:
            doc_order, sample_order = epoch_orders(self.corpus.num_documents, self.samples_per_epoch,
                                                   self.seed, epoch)
            offsets = np.zeros(len(doc_order) + 1, dtype=np.int64)
            np.cumsum(self.corpus.document_lengths[doc_order], out=offsets[1:])
            if len(self._epoch_cache) >= 2:
                self._epoch_cache.pop(min(self._epoch_cache))
            self._epoch_cache[epoch] = (doc_order, sample_order, offsets)
        return self._epoch_cache[epoch]

    def __getitem__(self, g: int) -> np.ndarray:
        epoch, j = divmod(int(g), self.samples_per_epoch)
        doc_order, sample_order, offsets = self._epoch(epoch)
        pieces = window_pieces(offsets, int(sample_order[j]), self.seq_length)
        return np.concatenate([self.corpus.read(int(doc_order[i]), start, n) for i, start, n in pieces])


@dataclass
class LoaderState:
    """What a checkpoint stores to resume the loader."""

    consumed_samples: int
    seed: int
    seq_length: int
    content_hash: str


class PackedLoader:
    """Iterator of micro-batches for one data-parallel rank: dicts of
    tokens, labels, position_ids: int64[B, S] and loss_mask: float32[B, S]."""

    def __init__(self, sequences: PackedSequences, *, micro_batch_size: int, dp_rank: int, dp_size: int,
                 consumed_samples: int = 0) -> None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank must be in [0, dp_size={dp_size}), got {dp_rank}")
        if consumed_samples < 0:
            raise ValueError(f"consumed_samples must be >= 0, got {consumed_samples}")
        self.sequences = sequences
        self.micro_batch_size, self.dp_rank, self.dp_size = micro_batch_size, dp_rank, dp_size
        self.consumed_samples = consumed_samples
        manifest = sequences.corpus.manifest
        self.vocab_size: int = manifest.tokenizer["vocab_size"]
        self.eod_id: int = manifest.tokenizer["eod_id"]

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        b, s = self.micro_batch_size, self.sequences.seq_length
        first = self.consumed_samples + self.dp_rank * b
        window = torch.from_numpy(np.stack([self.sequences[g] for g in range(first, first + b)]))
        self.consumed_samples += b * self.dp_size
        return {
            "tokens": window[:, :-1].contiguous(),
            "labels": window[:, 1:].contiguous(),
            "loss_mask": torch.ones(b, s, dtype=torch.float32),
            "position_ids": torch.arange(s, dtype=torch.int64).expand(b, s).contiguous(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Position to store in a checkpoint (plain Python values)."""
        seq = self.sequences
        return LoaderState(consumed_samples=self.consumed_samples, seed=seq.seed, seq_length=seq.seq_length,
                           content_hash=seq.corpus.manifest.content_hash).__dict__.copy()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a stored position; the corpus, seed and seq_length must be the ones it came from."""
        fields = {f.name for f in dataclasses.fields(LoaderState)}
        if not isinstance(state, dict) or set(state) != fields:
            raise ValueError(f"a loader state has the keys {', '.join(sorted(fields))}, got "
                             f"{sorted(state) if isinstance(state, dict) else type(state).__name__}: not a checkpoint "
                             "of this loader")
        st = LoaderState(**state)
        if isinstance(st.consumed_samples, bool) or not isinstance(st.consumed_samples, int) or st.consumed_samples < 0:
            raise ValueError(f"a loader state's consumed_samples must be an integer >= 0, got {st.consumed_samples!r}")
        seq = self.sequences
        for key, mine in (("seed", seq.seed), ("seq_length", seq.seq_length),
                          ("content_hash", seq.corpus.manifest.content_hash)):
            if getattr(st, key) != mine:
                raise ValueError(f"loader state has {key}={getattr(st, key)!r} but this loader has {mine!r}: "
                                 "resume with the corpus, seed and seq_length of the checkpoint")
        self.consumed_samples = st.consumed_samples


def build_loader(cfg: DataConfig, *, seq_length: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                 seed: int, consumed_samples: int = 0, progress: bool = False) -> PackedLoader:
    """The trainer's entry point: ensure the corpus exists (building the offline default if needed, with
    progress bars when progress is set) and return this rank's micro-batch iterator, positioned after
    consumed_samples global samples."""
    ensure_corpus(cfg, progress=progress)
    sequences = PackedSequences(Corpus(cfg.output_dir), seq_length=seq_length, seed=seed)
    return PackedLoader(sequences, micro_batch_size=micro_batch_size, dp_rank=dp_rank, dp_size=dp_size,
                        consumed_samples=consumed_samples)
