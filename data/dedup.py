"""Duplicate removal in stream order (the first occurrence is kept, later ones are dropped).

Exact: a 64-bit blake2b key of the normalised text (NFKC, case-folded, whitespace runs collapsed).
Near (optional): a MinHash signature (datasketch, `affine32` scheme) over character n-gram shingles of the
normalised text; datasketch's MinHashLSH proposes candidates and a candidate counts only when the
estimated Jaccard similarity (share of equal signature entries) reaches the threshold.

The state of both is the list of documents kept so far, so a resumed build restores it from what each
committed shard part saved (`PartState`).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from dataclasses import dataclass

import numpy as np

from data.config import DedupConfig

# Shingles are taken from the first this-many characters of the normalised text: training sees only the
# first max_doc_tokens tokens (about 16K characters at 4096 tokens), and it bounds the cost per document.
SHINGLE_CHARS = 20_000

_WS = re.compile(r"\s+")
_MULT = np.uint64(0x100000001B3)  # FNV-1a 64-bit prime, as the polynomial base of the shingle hash


def normalize(text: str) -> str:
    """Text as compared for duplicates: NFKC, case-folded, whitespace runs as one space, stripped."""
    return _WS.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def exact_key(normalized: str) -> int:
    """64-bit key of a normalised text."""
    return int.from_bytes(hashlib.blake2b(normalized.encode("utf-8"), digest_size=8).digest(), "little")


def shingle_hashes(normalized: str, ngram: int) -> np.ndarray:
    """uint32[k]: distinct 32-bit hashes of the character n-grams of (the head of) a normalised text; a
    text shorter than ngram is one shingle."""
    cps = np.frombuffer(normalized[:SHINGLE_CHARS].encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    n = min(ngram, len(cps))
    if n == 0:
        return np.zeros(1, dtype=np.uint32)
    h = np.zeros(len(cps) - n + 1, dtype=np.uint64)
    for k in range(n):  # polynomial hash of each window, wrapping mod 2^64
        h = h * _MULT + cps[k:len(cps) - n + 1 + k]
    # splitmix64 finaliser, then the high 32 bits (the MinHash scheme takes 32-bit inputs)
    h ^= h >> np.uint64(30)
    h *= np.uint64(0xBF58476D1CE4E5B9)
    h ^= h >> np.uint64(27)
    h *= np.uint64(0x94D049BB133111EB)
    h ^= h >> np.uint64(31)
    return np.unique((h >> np.uint64(32)).astype(np.uint32))


@dataclass
class PartState:
    """What the documents kept since the last commit add to the dedup state (saved with a shard part)."""

    exact_keys: np.ndarray  # uint64[n]
    signatures: np.ndarray | None  # uint32[n, num_perm], None when near dedup is off


class Deduplicator:
    """Decides, document by document in stream order, whether a document repeats a kept one."""

    def __init__(self, cfg: DedupConfig) -> None:
        self.cfg = cfg
        self._seen: set[int] = set()
        self._pending_keys: list[int] = []
        self._pending_sigs: list[np.ndarray] = []
        if cfg.near:
            from datasketch import MinHash, MinHashLSH

            self._MinHash = MinHash
            self._template = MinHash(num_perm=cfg.num_perm, seed=cfg.seed, hashfunc=_identity)
            self._lsh = MinHashLSH(threshold=cfg.near_threshold, num_perm=cfg.num_perm)
            self._sigs: list[np.ndarray] = []  # signature of kept document i, the LSH key being i

    def _minhash(self, hashvalues: np.ndarray):
        """A datasketch MinHash with these values, sharing the template's permutations."""
        return self._MinHash(seed=self.cfg.seed, hashfunc=_identity, permutations=self._template.permutations,
                             scheme="affine32", hashvalues=hashvalues)

    def signature(self, normalized: str) -> np.ndarray:
        """uint32[num_perm] MinHash signature of a normalised text."""
        m = self._minhash(self._template.hashvalues)
        m.update_batch(shingle_hashes(normalized, self.cfg.ngram))
        return m.hashvalues.astype(np.uint32)

    def is_known(self, normalized: str) -> bool:
        """Whether a kept document has exactly this normalised text."""
        return exact_key(normalized) in self._seen

    def check(self, normalized: str) -> tuple[str | None, int, np.ndarray | None]:
        """(reason, key, signature): reason is 'exact', 'near' or None (keep). Pass key and signature to
        add() when the document is kept."""
        key = exact_key(normalized)
        if self.cfg.exact and key in self._seen:
            return "exact", key, None
        sig = None
        if self.cfg.near:
            sig = self.signature(normalized)
            for cand in self._lsh.query(self._minhash(sig)):
                if np.mean(self._sigs[cand] == sig) >= self.cfg.near_threshold:
                    return "near", key, sig
        return None, key, sig

    def add(self, key: int, sig: np.ndarray | None) -> None:
        """Record a kept document."""
        self._add(key, sig)
        self._pending_keys.append(key)
        if sig is not None:
            self._pending_sigs.append(sig)

    def _add(self, key: int, sig: np.ndarray | None) -> None:
        self._seen.add(key)
        if self.cfg.near:
            assert sig is not None
            self._lsh.insert(len(self._sigs), self._minhash(sig), check_duplication=False)
            self._sigs.append(sig)

    def take_part_state(self) -> PartState:
        """The keys/signatures added since the last call (to save with the shard part being committed)."""
        keys = np.asarray(self._pending_keys, dtype=np.uint64)
        sigs = None
        if self.cfg.near:
            sigs = (np.stack(self._pending_sigs) if self._pending_sigs
                    else np.zeros((0, self.cfg.num_perm), dtype=np.uint32))
        self._pending_keys, self._pending_sigs = [], []
        return PartState(exact_keys=keys, signatures=sigs)

    def restore(self, part: PartState) -> None:
        """Re-add the documents of a committed part (resume), in their original order."""
        if self.cfg.near and part.signatures is None:
            raise ValueError("cannot restore near-dedup state from a part saved without signatures")
        for i, key in enumerate(part.exact_keys.tolist()):
            self._add(int(key), None if part.signatures is None else part.signatures[i])


def _identity(x):
    return x
