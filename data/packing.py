"""Documents to fixed-length training sequences. Pure NumPy; this is the reference the loader uses.

Stored document: at most max_doc_tokens - 1 content tokens, then the end-of-document (EOD) token, so no
stored document is longer than max_doc_tokens.

Packing (one epoch): the documents, in a seeded order, form one token stream (each ends with its EOD).
Sample w is the window stream[w*S : w*S + S + 1] (S = seq_length): tokens = window[:-1] and
labels = window[1:], so every stream token is a label exactly once, windows cross document boundaries,
and the tail that does not fill a window is dropped (as megatron's GPTDataset does for training).
"""

from __future__ import annotations

import numpy as np


def finish_document(content: np.ndarray, max_doc_tokens: int, eod_id: int) -> tuple[np.ndarray, bool]:
    """(stored document int64[<= max_doc_tokens], truncated?) from content token ids."""
    keep = max_doc_tokens - 1
    truncated = len(content) > keep
    return np.append(np.asarray(content[:keep], dtype=np.int64), np.int64(eod_id)), truncated


def epoch_orders(num_documents: int, num_samples: int, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """(document order int64[N], sample order int64[M]) of one epoch: two permutations drawn from a
    MT19937 stream seeded by (seed, epoch) (RandomState's stream is frozen across NumPy versions, so the
    order is the same on every machine)."""
    rs = np.random.RandomState([seed & 0xFFFFFFFF, seed >> 32, epoch & 0xFFFFFFFF, epoch >> 32])
    return rs.permutation(num_documents).astype(np.int64), rs.permutation(num_samples).astype(np.int64)


def samples_per_epoch(num_tokens: int, seq_length: int) -> int:
    """Windows of seq_length + 1 tokens, stride seq_length, that fit in a stream of num_tokens tokens."""
    return max(0, (num_tokens - 1) // seq_length)


def window_pieces(offsets: np.ndarray, window: int, seq_length: int) -> list[tuple[int, int, int]]:
    """The pieces of window `window`: (position in the document order, start offset in that document,
    length), in stream order. offsets: int64[N + 1], the cumulative document lengths in stream order."""
    start = window * seq_length
    stop = start + seq_length + 1
    assert stop <= offsets[-1], (window, seq_length, int(offsets[-1]))
    i = int(np.searchsorted(offsets, start, side="right")) - 1
    pieces = []
    pos = start
    while pos < stop:
        end = min(int(offsets[i + 1]), stop)
        pieces.append((i, pos - int(offsets[i]), end - pos))
        pos = end
        i += 1
    return pieces


def pack_reference(documents: list[np.ndarray], seq_length: int) -> np.ndarray:
    """int64[M, seq_length + 1]: all windows of the documents in the given order (tests compare the
    loader against this)."""
    stream = np.concatenate([np.asarray(d, dtype=np.int64) for d in documents])
    m = samples_per_epoch(len(stream), seq_length)
    return np.stack([stream[w * seq_length: w * seq_length + seq_length + 1] for w in range(m)]) if m else \
        np.zeros((0, seq_length + 1), dtype=np.int64)
