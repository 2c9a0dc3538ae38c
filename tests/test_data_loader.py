"""Unit tests (CPU, no network) of the training loader on a small built corpus: it matches the reference
packer, its order is fixed by the seed, data-parallel ranks split every global batch without overlap,
and a checkpointed position resumes the exact stream (also with another number of ranks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data import build_corpus
from data.config import DataConfig, SourceConfig
from data.loader import Corpus, PackedLoader, PackedSequences, build_loader
from data.packing import epoch_orders, pack_reference
from data.testing import write_text_dataset

SEQ = 32


@pytest.fixture(scope="module")
def cfg(tmp_path_factory) -> DataConfig:
    root = tmp_path_factory.mktemp("loader")
    rng = np.random.default_rng(1)
    # each document says which one it is, so a wrong window is readable in a failure
    texts = [f"<doc {i}>" + "x" * int(n) for i, n in enumerate(rng.integers(0, 90, size=120))]
    cfg = DataConfig(name="loader", output_dir=str(root / "corpus"), num_tokens=10**9, part_tokens=2048,
                     batch_size=16, sources={"a": SourceConfig(dataset="unused", weight=1.0,
                                                               path=write_text_dataset(root / "a", texts))})
    build_corpus(cfg)
    return cfg


def _loader(cfg, **kw) -> PackedLoader:
    args = dict(seq_length=SEQ, micro_batch_size=4, dp_rank=0, dp_size=1, seed=11)
    args.update(kw)
    return build_loader(cfg, **args)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def test_samples_are_the_reference_windows_of_the_seeded_document_order(cfg):
    corpus = Corpus(cfg.output_dir)
    seqs = PackedSequences(corpus, seq_length=SEQ, seed=11)
    doc_order, sample_order = epoch_orders(corpus.num_documents, seqs.samples_per_epoch, 11, 0)
    ref = pack_reference([corpus.document(int(d)) for d in doc_order], SEQ)
    assert len(ref) == seqs.samples_per_epoch
    for g in range(seqs.samples_per_epoch):
        assert np.array_equal(seqs[g], ref[sample_order[g]])
    # the next epoch is another order of the same windows' documents
    assert not np.array_equal(seqs[seqs.samples_per_epoch], seqs[0])


def test_batches_are_shifted_windows(cfg):
    batch = next(_loader(cfg))
    assert batch["tokens"].dtype == batch["labels"].dtype == torch.int64
    assert batch["tokens"].shape == batch["labels"].shape == (4, SEQ)
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])
    assert torch.equal(batch["position_ids"][1], torch.arange(SEQ))
    assert batch["loss_mask"].dtype == torch.float32 and bool((batch["loss_mask"] == 1).all())


def test_order_is_deterministic_for_a_seed_and_changes_with_it(cfg):
    a, b = _take(_loader(cfg), 5), _take(_loader(cfg), 5)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, b))
    c = _take(_loader(cfg, seed=12), 5)
    assert not all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(a, c))


@pytest.mark.parametrize("dp_size", [2, 3])
def test_ranks_split_each_global_batch_without_overlap(cfg, dp_size):
    steps, b = 6, 2
    ranks = [_take(_loader(cfg, micro_batch_size=b, dp_rank=r, dp_size=dp_size), steps) for r in range(dp_size)]
    single = _take(_loader(cfg, micro_batch_size=b * dp_size), steps)  # one rank, the whole global batch
    for k in range(steps):
        together = torch.cat([ranks[r][k]["tokens"] for r in range(dp_size)])
        assert torch.equal(together, single[k]["tokens"])


def test_resume_from_a_checkpointed_position_continues_the_stream(cfg):
    loader = _loader(cfg, micro_batch_size=2, dp_rank=1, dp_size=2)
    first = _take(loader, 7)
    state = loader.state_dict()
    assert state["consumed_samples"] == 7 * 2 * 2
    rest = _take(loader, 5)
    resumed = _loader(cfg, micro_batch_size=2, dp_rank=1, dp_size=2)
    resumed.load_state_dict(state)
    assert all(torch.equal(x["tokens"], y["tokens"]) for x, y in zip(rest, _take(resumed, 5)))
    by_count = _loader(cfg, micro_batch_size=2, dp_rank=1, dp_size=2, consumed_samples=state["consumed_samples"])
    assert torch.equal(next(by_count)["tokens"], rest[0]["tokens"])
    assert not torch.equal(first[-1]["tokens"], rest[0]["tokens"])


def test_resume_with_another_data_parallel_size_keeps_the_global_stream(cfg):
    two = _loader(cfg, micro_batch_size=2, dp_rank=0, dp_size=2)
    _take(two, 3)
    consumed = two.state_dict()["consumed_samples"]  # 12 global samples
    four = [_loader(cfg, micro_batch_size=1, dp_rank=r, dp_size=4, consumed_samples=consumed) for r in range(4)]
    reference = _loader(cfg, micro_batch_size=4, consumed_samples=consumed)
    assert torch.equal(torch.cat([next(x)["tokens"] for x in four]), next(reference)["tokens"])


def test_state_from_another_run_is_refused(cfg):
    state = _loader(cfg).state_dict()
    with pytest.raises(ValueError, match="seed"):
        _loader(cfg, seed=99).load_state_dict(state)
    with pytest.raises(ValueError, match="seq_length"):
        _loader(cfg, seq_length=SEQ * 2).load_state_dict(state)
    with pytest.raises(ValueError, match="a loader state has the keys consumed_samples, content_hash"):
        _loader(cfg).load_state_dict({k: v for k, v in state.items() if k != "content_hash"})
    with pytest.raises(ValueError, match="consumed_samples must be an integer >= 0, got -5"):
        _loader(cfg).load_state_dict({**state, "consumed_samples": -5})


def test_bad_arguments_are_refused(cfg):
    with pytest.raises(ValueError, match="dp_rank"):
        _loader(cfg, dp_rank=2, dp_size=2)
    with pytest.raises(ValueError, match=r"fewer than seq_length \+ 1 = .*trainer.seq_length"):
        _loader(cfg, seq_length=10**7)
