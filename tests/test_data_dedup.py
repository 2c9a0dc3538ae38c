"""Unit tests (CPU, no network): normalisation, exact and MinHash near-duplicate removal in stream
order, and restoring the dedup state after a resumed build."""

from __future__ import annotations

import numpy as np

from data.config import DedupConfig
from data.dedup import Deduplicator, normalize, shingle_hashes

_WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()


def _doc(seed: int, n: int = 300) -> str:
    return " ".join(np.random.default_rng(seed).choice(_WORDS, size=n))


def _kept(dedup: Deduplicator, texts: list[str]) -> tuple[list[int], list[str | None]]:
    kept, reasons = [], []
    for i, text in enumerate(texts):
        reason, key, sig = dedup.check(normalize(text))
        reasons.append(reason)
        if reason is None:
            dedup.add(key, sig)
            kept.append(i)
    return kept, reasons


def test_normalize_folds_case_width_and_whitespace():
    assert normalize("  Hello\t\tWORLD \n") == "hello world"
    assert normalize("ＡＢＣ １２３") == "abc 123"  # NFKC: full-width forms
    assert normalize("Straße") == normalize("STRASSE")  # case folding, not just lower()


def test_exact_dedup_keeps_first_occurrences_in_order():
    texts = ["one doc", "Two  Doc", "ONE DOC", "three", "two doc\n", "one doc", "four"]
    kept, reasons = _kept(Deduplicator(DedupConfig(exact=True, near=False)), texts)
    assert kept == [0, 1, 3, 6]
    assert reasons == [None, None, "exact", None, "exact", "exact", None]


def test_exact_dedup_off_keeps_everything():
    kept, _ = _kept(Deduplicator(DedupConfig(exact=False, near=False)), ["a", "a", "A"])
    assert kept == [0, 1, 2]


def test_near_dedup_drops_edited_copies_and_keeps_distinct_documents_in_order():
    a, b, c = _doc(1), _doc(2), _doc(3)
    a_edit = a.replace("gamma", "GAMMAX", 1) + " omega"  # one word changed, one appended
    texts = [a, b, a_edit, c, b + " the end"]
    kept, reasons = _kept(Deduplicator(DedupConfig(near=True, near_threshold=0.8)), texts)
    assert kept == [0, 1, 3]
    assert reasons == [None, None, "near", None, "near"]
    # without near dedup the edited copies stay (they are not exact duplicates)
    kept_exact, _ = _kept(Deduplicator(DedupConfig(near=False)), texts)
    assert kept_exact == [0, 1, 2, 3, 4]


def test_near_threshold_is_a_jaccard_bound():
    a = _doc(7, n=200)
    half = " ".join(a.split()[:100] + _doc(8, n=100).split())  # shares about half of its shingles
    kept, _ = _kept(Deduplicator(DedupConfig(near=True, near_threshold=0.8)), [a, half])
    assert kept == [0, 1]
    kept, _ = _kept(Deduplicator(DedupConfig(near=True, near_threshold=0.2)), [a, half])
    assert kept == [0]


def test_shingles_are_deterministic_and_cover_short_texts():
    assert len(shingle_hashes("abc", 9)) == 1
    assert len(shingle_hashes("", 9)) == 1
    h1, h2 = shingle_hashes("the quick brown fox", 5), shingle_hashes("the quick brown fox", 5)
    assert h1.dtype == np.uint32 and np.array_equal(h1, h2) and len(h1) == len(set(h1.tolist()))


def test_restored_state_makes_the_same_decisions():
    cfg = DedupConfig(near=True)
    first = [_doc(i) for i in range(6)]
    later = [first[2].upper(), _doc(0) + " x", _doc(50), first[5]]
    live = Deduplicator(cfg)
    _kept(live, first)
    part = live.take_part_state()
    assert part.exact_keys.shape == (6,) and part.signatures.shape == (6, cfg.num_perm)
    restored = Deduplicator(cfg)
    restored.restore(part)
    assert _kept(restored, later) == _kept(live, later) == ([2], ["exact", "near", None, "exact"])
