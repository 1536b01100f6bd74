"""Byte-level BPE tokenizer (training, encoding, decoding, file formats), SentencePiece-style BPE with byte
fallback (Llama 2, Mistral, Phi-3, Gemma; from tokenizer.json or GGUF) and llama2.c's tokenizer.

Quick start::

    from scratchlm.tokenizer import Tokenizer, train_bpe
    vocab, merges = train_bpe("my_text.txt", vocab_size=10_000, special_tokens=["<|endoftext|>"])
    tok = Tokenizer(vocab, merges, special_tokens=["<|endoftext|>"])
    ids = tok.encode("Hello world<|endoftext|>")
    assert tok.decode(ids) == "Hello world<|endoftext|>"
"""

from __future__ import annotations

from typing import Any

from scratchlm.tokenizer.bpe import Tokenizer
from scratchlm.tokenizer.llama2c import Llama2cTokenizer
from scratchlm.tokenizer.normalize import Normalizer
from scratchlm.tokenizer.pretokenize import PreTokenizer
from scratchlm.tokenizer.spm import SentencePieceBPE

__all__ = ["Tokenizer", "SentencePieceBPE", "Llama2cTokenizer", "PreTokenizer", "train_bpe", "tokenizer_to_state",
           "tokenizer_from_state"]


def train_bpe(input_path, vocab_size, special_tokens=None, **kwargs):
    """Train a byte-level BPE; see :func:`scratchlm.tokenizer.train.train_bpe`."""
    from scratchlm.tokenizer.train import train_bpe as _train

    return _train(input_path, vocab_size, special_tokens, **kwargs)


def tokenizer_to_state(tok: Tokenizer | SentencePieceBPE | Llama2cTokenizer) -> dict[str, Any]:
    """A plain dict (str/bytes/int/float/list/dict only) to store a tokenizer inside a checkpoint;
    it loads with ``torch.load(weights_only=True)``."""
    if isinstance(tok, Tokenizer):
        return {
            "kind": "bpe",
            "vocab": dict(tok.vocab),
            "merges": [tuple(m) for m in tok.merges],
            "special_tokens": list(tok.special_tokens),
            "pretokenizer": list(tok.pretokenizer.stages),
            "bos_id": tok.bos_id,
            "eos_id": tok.eos_id,
            "chat_template": tok.chat_template,
            "add_bos": tok.add_bos,
            "ignore_merges": tok.ignore_merges,
            "normalizer": tok.normalizer.spec if tok.normalizer is not None else None,
        }
    if isinstance(tok, SentencePieceBPE):
        return tok.to_state()
    if isinstance(tok, Llama2cTokenizer):
        return {"kind": "llama2c", "pieces": list(tok.pieces), "scores": list(tok.scores)}
    raise TypeError(f"cannot store a {type(tok).__name__} (expected Tokenizer, SentencePieceBPE or Llama2cTokenizer)")


def tokenizer_from_state(d: dict[str, Any]) -> Tokenizer | SentencePieceBPE | Llama2cTokenizer:
    """Inverse of :func:`tokenizer_to_state`."""
    if not isinstance(d, dict) or "kind" not in d:
        raise ValueError("a tokenizer state must be a dict with a 'kind' key ('bpe', 'spm' or 'llama2c')")
    if d["kind"] == "bpe":
        stages = d.get("pretokenizer")
        return Tokenizer(
            d["vocab"], [tuple(m) for m in d["merges"]], d.get("special_tokens") or [],
            pretokenizer=PreTokenizer(tuple(stages)) if stages else None,
            bos_id=d.get("bos_id"), eos_id=d.get("eos_id"), chat_template=d.get("chat_template"),
            add_bos=bool(d.get("add_bos", False)), ignore_merges=bool(d.get("ignore_merges", False)),
            normalizer=Normalizer(d["normalizer"]) if d.get("normalizer") else None,
        )
    if d["kind"] == "spm":
        return SentencePieceBPE.from_state(d)
    if d["kind"] == "llama2c":
        return Llama2cTokenizer(d["pieces"], d["scores"])
    raise ValueError(f"unknown tokenizer kind {d['kind']!r} (expected 'bpe', 'spm' or 'llama2c')")
