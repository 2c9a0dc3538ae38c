"""Unit tests (CPU, no network): the byte tokenizer, truncation to max_doc_tokens with the EOD token,
packing boundaries on hand-worked streams, the seeded epoch orders, and the tokenizer errors."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from data.config import TokenizerConfig
from data.packing import epoch_orders, finish_document, pack_reference, samples_per_epoch, window_pieces
from data.tokenizers import ByteTokenizer, TokenizerUnavailableError, build_tokenizer, token_dtype

EOD = ByteTokenizer.eod_id


def test_byte_tokenizer_is_utf8_bytes_with_specials_above():
    tok = build_tokenizer(TokenizerConfig(name="byte"))
    (ids,) = tok.encode_truncated(["aé中"], 100)
    assert ids.dtype == np.int64 and ids.tolist() == list("aé中".encode()) == [97, 195, 169, 228, 184, 173]
    assert (tok.vocab_size, tok.eod_id, tok.pad_id) == (258, 256, 257)
    assert tok.decode(np.array([104, 105, EOD])) == "hi"
    assert [len(x) for x in tok.encode_truncated(["abcdef", "", "ab"], 4)] == [4, 0, 2]


@pytest.mark.parametrize("n_content, stored, truncated", [
    (4094, 4095, False), (4095, 4096, False), (4096, 4096, True), (10000, 4096, True), (0, 1, False)])
def test_truncation_boundary_counts_the_eod_token(n_content, stored, truncated):
    content = np.arange(n_content, dtype=np.int64) % 256
    doc, was_truncated = finish_document(content, 4096, EOD)
    assert (len(doc), was_truncated) == (stored, truncated)
    assert doc[-1] == EOD and np.array_equal(doc[:-1], content[:stored - 1])


def test_packing_windows_cross_documents_and_drop_the_tail():
    docs = [np.array([1, 2, EOD]), np.array([3, 4, 5, EOD]), np.array([6, EOD])]  # stream of 9 tokens
    windows = pack_reference(docs, seq_length=3)
    assert windows.tolist() == [[1, 2, EOD, 3], [3, 4, 5, EOD]]  # stride 3, one shared token; tail dropped
    offsets = np.array([0, 3, 7, 9])
    assert window_pieces(offsets, 0, 3) == [(0, 0, 3), (1, 0, 1)]
    assert window_pieces(offsets, 1, 3) == [(1, 0, 4)]
    # tokens/labels of a window: every stream token except the first is a label exactly once
    labels = np.concatenate([w[1:] for w in windows])
    assert labels.tolist() == [2, EOD, 3, 4, 5, EOD]


def test_window_pieces_agree_with_the_reference_on_random_documents():
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(0, 256, size=int(n)), EOD) for n in rng.integers(0, 40, size=50)]
    for s in (1, 7, 16, 64):
        ref = pack_reference(docs, s)
        offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
        assert len(ref) == samples_per_epoch(int(offsets[-1]), s)
        for w in range(len(ref)):
            got = np.concatenate([docs[i][start:start + n] for i, start, n in window_pieces(offsets, w, s)])
            assert np.array_equal(got, ref[w])


def test_epoch_orders_are_seeded_permutations():
    d0, s0 = epoch_orders(100, 40, seed=5, epoch=0)
    assert sorted(d0.tolist()) == list(range(100)) and sorted(s0.tolist()) == list(range(40))
    d0b, s0b = epoch_orders(100, 40, seed=5, epoch=0)
    assert np.array_equal(d0, d0b) and np.array_equal(s0, s0b)
    assert not np.array_equal(d0, epoch_orders(100, 40, seed=5, epoch=1)[0])
    assert not np.array_equal(d0, epoch_orders(100, 40, seed=6, epoch=0)[0])
    # MT19937 (RandomState) streams are frozen across NumPy versions, so the order is the same on every
    # machine: pin the first elements (a change here changes every training run's data order)
    assert d0[:6].tolist() == [51, 79, 89, 39, 40, 80] and s0[:6].tolist() == [32, 28, 27, 0, 14, 31]


def test_token_dtype_follows_megatrons_rule():
    assert token_dtype(258) is np.uint16 and token_dtype(151936) is np.int32


def test_missing_transformers_is_reported_with_the_tokenizer_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import fails as if not installed
    with pytest.raises(TokenizerUnavailableError, match="Qwen/Qwen3-30B-A3B") as err:
        build_tokenizer(TokenizerConfig(name="Qwen/Qwen3-30B-A3B"))
    assert "pip install transformers" in str(err.value) and "byte" in str(err.value)


def test_unreachable_hub_tokenizer_is_reported_with_the_tokenizer_and_the_fix(monkeypatch):
    pytest.importorskip("transformers")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail fast, no retries
    with pytest.raises(TokenizerUnavailableError, match="zai-org/GLM-4.5-Air") as err:
        build_tokenizer(TokenizerConfig(name="zai-org/GLM-4.5-Air"))
    msg = str(err.value)
    assert "local Hugging Face cache" in msg and "data.tokenizer.name" in msg and "data=offline" in msg


@pytest.fixture(scope="module")
def local_hf_tokenizer(tmp_path_factory) -> str:
    """A tiny byte-level BPE tokenizer saved as a Hugging Face tokenizer directory (no download)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 20, "def f(x):\n    return x\n" * 20],
                            trainer)
    path = tmp_path_factory.mktemp("hf_tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>").save_pretrained(path)
    return str(path)


def test_hf_tokenizer_from_a_local_directory_separates_documents_with_endoftext(local_hf_tokenizer):
    from transformers import AutoTokenizer

    tok = build_tokenizer(TokenizerConfig(name=local_hf_tokenizer))
    ref = AutoTokenizer.from_pretrained(local_hf_tokenizer)
    # <|endoftext|> is preferred to the chat eos (<|im_end|>), as for Qwen3
    assert tok.eod_id == ref.convert_tokens_to_ids("<|endoftext|>") and tok.vocab_size == len(ref)
    eos = build_tokenizer(TokenizerConfig(name=local_hf_tokenizer, eod_token="<|im_end|>"))
    assert eos.eod_id == ref.convert_tokens_to_ids("<|im_end|>")
    with pytest.raises(TokenizerUnavailableError, match="eod_token"):
        build_tokenizer(TokenizerConfig(name=local_hf_tokenizer, eod_token="<|not_a_token|>"))


@pytest.mark.parametrize("max_tokens", [1, 50, 300])
def test_hf_truncation_of_long_texts_equals_the_prefix_of_the_full_tokenization(local_hf_tokenizer, max_tokens):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(local_hf_tokenizer)
    tok = build_tokenizer(TokenizerConfig(name=local_hf_tokenizer))
    texts = ["the quick brown fox " * 400 + "def g(y): return y", "short text", "x" * 20000, ""]
    for text, ids in zip(texts, tok.encode_truncated(texts, max_tokens)):
        full = ref(text, add_special_tokens=False)["input_ids"]
        assert ids.tolist() == full[:max_tokens]
