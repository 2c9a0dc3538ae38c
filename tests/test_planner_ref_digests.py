"""The stored reference digests that the CUDA planner's GPU test compares with (tests/planner_cases.py) are
the reference's: a sample recomputed on the CPU matches them, and a stale file is not used."""

import json

import pytest
import torch

import planner_cases as pc


def test_digest_is_exact_on_dtype_shape_and_values():
    a = torch.arange(6, dtype=torch.int64)
    assert pc.digest(a) == pc.digest(a.clone())
    assert pc.digest(a) != pc.digest(a.view(2, 3))
    assert pc.digest(a) != pc.digest(a.to(torch.int32))
    b = a.clone()
    b[5] += 1
    assert pc.digest(a) != pc.digest(b)


def test_stored_digests_match_the_reference_on_a_sample():
    if pc.load_digests(0) is None:
        pytest.skip("tests/data/planner_ref_digests.json is missing or stale (the GPU test then computes the "
                    "reference itself); refresh it with: python tools/planner_ref_digests.py")
    for chunk, picks in ((0, (0, 1, 7)), (pc.CHUNKS - 1, (0, 10)), ("large", (0, 1))):
        stored = pc.load_digests(chunk)
        assert len(stored) == len(pc.large_cases() if chunk == "large" else range(pc.CASES_PER_CHUNK))
        cases = pc.large_cases() if chunk == "large" else pc.chunk_cases(chunk, max(picks) + 1)
        for i in picks:
            assert stored[i] == pc.reference_digests(i, cases[i]), (chunk, i)


def test_a_stale_key_is_not_used(tmp_path, monkeypatch):
    path = tmp_path / "digests.json"
    path.write_text(json.dumps({"key": "not the sources' key", "chunks": {"0": []}}))
    monkeypatch.setattr(pc, "DIGESTS", path)
    assert pc.load_digests(0) is None
    path.write_text(json.dumps({"key": pc.sources_key(), "chunks": {"0": [{"omega": "x"}]}}))
    assert pc.load_digests(0) == [{"omega": "x"}]
