"""Integration tests (CPU, no network) against megatron-core 0.19's own dataset classes: IndexedDataset
reads every stored document back exactly, and GPTDataset/BlendedDataset built by
BlendedMegatronDatasetBuilder (with its precompiled helpers_cpp, no CUDA) sample the shards."""

from __future__ import annotations

import numpy as np
import pytest

from data import build_corpus
from data.config import DataConfig, SourceConfig
from data.manifest import Manifest
from data.megatron import megatron_blend, megatron_tokenizer
from data.testing import write_text_dataset
from data.tokenizers import ByteTokenizer, token_dtype

EOD = ByteTokenizer.eod_id


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    rng = np.random.default_rng(2)
    texts = {name: [f"<{name} {i}>" + "y" * int(n) for i, n in enumerate(rng.integers(0, 200, size=150))]
             for name in ("web", "code")}
    cfg = DataConfig(name="mg", output_dir=str(root / "corpus"), num_tokens=10**9, part_tokens=4096, batch_size=16,
                     sources={name: SourceConfig(dataset="unused", path=write_text_dataset(root / name, t),
                                                 weight=1.0) for name, t in texts.items()})
    build_corpus(cfg)
    return cfg.output_dir, texts


def test_indexed_dataset_reads_every_document_back(corpus):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    out, texts = corpus
    prefixes, _ = megatron_blend(out)
    datasets = [IndexedDataset(p) for p in prefixes]  # kept alive: their items are views of its mmap
    docs = [ds[i] for ds in datasets for i in range(len(ds))]
    want = [np.append(np.frombuffer(t.encode(), dtype=np.uint8), EOD) for name in ("web", "code") for t in texts[name]]
    assert len(docs) == len(want) == Manifest.load(out).num_documents
    assert all(d.dtype == np.uint16 and np.array_equal(d, w) for d, w in zip(docs, want))
    ds = IndexedDataset(prefixes[0])  # one sequence per document, as preprocess_data.py writes them
    assert np.array_equal(ds.document_indices, np.arange(len(ds) + 1))


def test_token_dtype_is_megatrons_choice_for_the_vocab():
    from megatron.core.datasets.indexed_dataset import DType

    for vocab in (258, 65499, 65500, 151936):
        assert token_dtype(vocab) is DType.optimal_dtype(vocab)


def test_gpt_and_blended_datasets_sample_the_shards(corpus, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    out, texts = corpus
    seq = 128
    prefixes, weights = megatron_blend(out)
    config = GPTDatasetConfig(random_seed=1, sequence_length=seq, blend=(prefixes, weights), split="1,0,0",
                              tokenizer=megatron_tokenizer(out), reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False, path_to_cache=str(tmp_path))
    train, valid, test = BlendedMegatronDatasetBuilder(GPTDataset, [400, 0, 0], lambda: True, config).build()
    assert len(train) >= 400 and valid is None and test is None
    documents = {t.encode() for name in texts for t in texts[name]}
    counts = np.zeros(len(prefixes))
    for i in range(len(train)):
        sample = train[i]
        counts[int(sample["dataset_id"])] += 1
        text = np.append(sample["tokens"].numpy(), sample["labels"].numpy()[-1])
        assert len(text) == seq + 1 and text.max() <= EOD
        # a window of the EOD-separated stream: whole documents between a document's tail and a head
        pieces = [bytes(p.astype(np.uint8)) for p in np.split(text, np.flatnonzero(text == EOD))]
        pieces = [pieces[0]] + [p[1:] for p in pieces[1:]]  # drop each piece's leading EOD
        if len(pieces) == 1:  # inside one document
            assert any(pieces[0] in d for d in documents)
        else:
            assert any(d.endswith(pieces[0]) for d in documents)
            assert all(p in documents for p in pieces[1:-1])
            assert any(d.startswith(pieces[-1]) for d in documents)
    # blended sampling follows the parts' token counts (megatron_blend's weights)
    assert counts / counts.sum() == pytest.approx(np.array(weights) / sum(weights), abs=0.02)
