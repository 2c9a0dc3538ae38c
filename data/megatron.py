"""Handing a built corpus to megatron-core's own datasets (GPTDataset through
BlendedMegatronDatasetBuilder), for trainers that prefer megatron's sampling to `data.loader`.

    prefixes, weights = megatron_blend(corpus_dir)
    config = GPTDatasetConfig(blend=(prefixes, weights), tokenizer=megatron_tokenizer(corpus_dir), ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from data.manifest import Manifest


def megatron_blend(corpus_dir: str | Path) -> tuple[list[str], list[float]]:
    """(path prefixes, weights) of every shard part, weighted by its tokens, so that megatron's blended
    sampling draws each source at its share of the corpus (GPTDatasetConfig.blend)."""
    corpus_dir = Path(corpus_dir).resolve()
    parts = Manifest.load(corpus_dir).parts()
    return [str(corpus_dir / p["prefix"]) for p in parts], [float(p["num_tokens"]) for p in parts]


@dataclass(frozen=True)
class MegatronTokenizerInfo:
    """The tokenizer attributes megatron's datasets read (vocab_size, eod, pad, and unique_identifiers
    for their cache keys), from a corpus manifest."""

    name: str
    vocab_size: int
    eod: int
    pad: int

    @property
    def unique_identifiers(self) -> dict[str, object]:
        return {"class": type(self).__qualname__, "name": self.name, "vocab_size": self.vocab_size,
                "eod": self.eod, "pad": self.pad}


def megatron_tokenizer(corpus_dir: str | Path) -> MegatronTokenizerInfo:
    tok = Manifest.load(corpus_dir).tokenizer
    # megatron uses -1 as "no pad token"; our packing never pads
    return MegatronTokenizerInfo(name=tok["name"], vocab_size=tok["vocab_size"], eod=tok["eod_id"],
                                 pad=-1 if tok["pad_id"] is None else tok["pad_id"])
