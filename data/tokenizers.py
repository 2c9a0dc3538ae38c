"""Tokenizers behind one small interface: `encode_truncated(texts, max_tokens) -> list[int64[n]]`,
`eod_id`, `pad_id`, `vocab_size`, `name`.

`ByteTokenizer` needs no download (the offline stand-in); `HFTokenizer` wraps the model's own Hugging Face
tokenizer and is only imported when a config names one. A tokenizer that cannot be loaded raises
`TokenizerUnavailableError` naming the tokenizer and what to do.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from data.config import BYTE_TOKENIZER, TokenizerConfig

# A Hugging Face token spans at most this many characters in practice; longer documents are cut to
# max_tokens * _CHARS_PER_TOKEN characters before tokenizing (see HFTokenizer.encode_truncated).
_CHARS_PER_TOKEN = 24
# Tokens beyond max_tokens that a cut text must still produce for its first max_tokens tokens to equal
# those of the full text (only the pre-tokens around the cut can differ).
_CUT_MARGIN = 64
_ENDOFTEXT = "<|endoftext|>"


class TokenizerUnavailableError(RuntimeError):
    """The configured tokenizer cannot be loaded (not installed, not cached, Hub unreachable)."""


class Tokenizer(Protocol):
    name: str
    vocab_size: int
    eod_id: int
    pad_id: int | None

    def encode_truncated(self, texts: list[str], max_tokens: int) -> list[np.ndarray]:
        """Token ids (int64) of each text, cut to its first max_tokens tokens. No special tokens added."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then EOD = 256 and PAD = 257 (vocab_size 258)."""

    name = BYTE_TOKENIZER
    vocab_size = 258
    eod_id = 256
    pad_id = 257

    def encode_truncated(self, texts: list[str], max_tokens: int) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8)[:max_tokens].astype(np.int64) for t in texts]

    def decode(self, ids: np.ndarray) -> str:
        """Text of byte ids; special ids are dropped, broken UTF-8 is replaced."""
        ids = np.asarray(ids)
        return bytes(ids[ids < 256].astype(np.uint8)).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face tokenizer (transformers.AutoTokenizer), tried from the local cache first."""

    def __init__(self, cfg: TokenizerConfig) -> None:
        self.name = cfg.name
        self._tok = _load_auto_tokenizer(cfg)
        eod_token = cfg.eod_token
        if eod_token is None:  # a pretraining document separator, not a chat turn end (Qwen3's eos is <|im_end|>)
            vocab = self._tok.get_vocab()
            eod_token = _ENDOFTEXT if _ENDOFTEXT in vocab else self._tok.eos_token
        if eod_token is None:
            raise TokenizerUnavailableError(
                f"tokenizer {cfg.name!r} has no eos_token to end documents with: set "
                "data.tokenizer.eod_token to its end-of-text token (e.g. '<|endoftext|>')")
        eod_id = self._tok.convert_tokens_to_ids(eod_token)
        if eod_id is None or eod_id == self._tok.unk_token_id:
            raise TokenizerUnavailableError(
                f"tokenizer {cfg.name!r} does not know the end-of-document token {eod_token!r}: set "
                "data.tokenizer.eod_token to a token of its vocabulary")
        self.eod_token = eod_token
        self.eod_id = int(eod_id)
        pad = self._tok.pad_token_id
        self.pad_id = None if pad is None or pad == self.eod_id else int(pad)
        self.vocab_size = len(self._tok)  # includes added special tokens, unlike .vocab_size

    def encode_truncated(self, texts: list[str], max_tokens: int) -> list[np.ndarray]:
        cut = max_tokens * _CHARS_PER_TOKEN
        heads = [t[:cut] for t in texts]
        ids = self._tok(heads, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        out = []
        for text, head, row in zip(texts, heads, ids):
            if len(head) < len(text) and len(row) < max_tokens + _CUT_MARGIN:
                # The cut text is too short to vouch for the first max_tokens tokens: tokenize it whole.
                row = self._tok(text, add_special_tokens=False, verbose=False)["input_ids"]
            out.append(np.asarray(row[:max_tokens], dtype=np.int64))
        return out


def _load_auto_tokenizer(cfg: TokenizerConfig):
    fix = (f"Fix: on a machine with network access run `python -c \"from transformers import AutoTokenizer; "
           f"AutoTokenizer.from_pretrained('{cfg.name}')\"` and copy its Hugging Face cache (HF_HOME), or set "
           "data.tokenizer.name to a local directory with the tokenizer files, or use the offline corpus "
           "(data=offline, byte tokenizer).")
    try:
        from transformers import AutoTokenizer
    except ImportError as err:
        raise TokenizerUnavailableError(
            f"tokenizer {cfg.name!r} needs the transformers package, which is not installed ({err}). "
            "Fix: pip install transformers, or use data.tokenizer.name=byte.") from err
    kwargs = dict(revision=cfg.revision, trust_remote_code=cfg.trust_remote_code)
    try:  # the cache first: no network round trip (and no retries) when the files are already here
        return AutoTokenizer.from_pretrained(cfg.name, local_files_only=True, **kwargs)
    except Exception:  # noqa: BLE001 - any cache miss falls through to the Hub
        pass
    try:
        return AutoTokenizer.from_pretrained(cfg.name, **kwargs)
    except Exception as err:  # noqa: BLE001 - OSError, HTTP, validation errors: all mean "cannot load"
        raise TokenizerUnavailableError(
            f"cannot load tokenizer {cfg.name!r}: not in the local Hugging Face cache and the Hub is not "
            f"reachable or refused it ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}). "
            + fix) from err


def build_tokenizer(cfg: TokenizerConfig) -> Tokenizer:
    """The tokenizer a config names: the byte tokenizer, or a Hugging Face one."""
    if cfg.name == BYTE_TOKENIZER:
        return ByteTokenizer()
    return HFTokenizer(cfg)


def token_dtype(vocab_size: int) -> type[np.number]:
    """Smallest dtype megatron's indexed dataset uses for ids below vocab_size (its own rule)."""
    return np.uint16 if vocab_size < 65500 else np.int32
