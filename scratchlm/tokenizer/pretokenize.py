"""Pre-tokenization: special-token splitting and regex pre-token splitting.

A pre-tokenizer is data, not code: an ordered tuple of regex *stages*. Each stage splits every piece
produced by the previous stage into its matches **and** the gaps between them ("isolated" behaviour in
HF `tokenizers`, the regex sequence of llama.cpp). GPT-2 is one stage; SmolLM2 is two
(``\\p{N}`` then GPT-2: digits are isolated first, exactly as HF's ``Digits(individual_digits=True)``
followed by ``ByteLevel``). Merges never cross a pre-token boundary.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import regex

#: The GPT-2 pattern (tiktoken ``gpt2``, HF ``ByteLevel(use_regex=True)``).
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
#: Llama-3 (tiktoken ``cl100k``-style, numbers in groups of up to three).
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: Qwen2 (like Llama-3 but single digits).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
#: HF ``Digits(individual_digits=True)``: every digit becomes its own piece.
DIGITS_PATTERN = r"\p{N}"

#: Named pre-tokenizers (the names llama.cpp writes into ``tokenizer.ggml.pre``).
PRESETS: dict[str, tuple[str, ...]] = {
    "gpt2": (GPT2_PATTERN,),
    "default": (GPT2_PATTERN,),
    "smollm": (DIGITS_PATTERN, GPT2_PATTERN),
    "llama-bpe": (LLAMA3_PATTERN,),
    "llama3": (LLAMA3_PATTERN,),
    "qwen2": (QWEN2_PATTERN,),
}


@dataclass(frozen=True)
class PreTokenizer:
    """An ordered tuple of regex stages (see the module docstring)."""

    stages: tuple[str, ...] = (GPT2_PATTERN,)
    _compiled: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a PreTokenizer needs at least one regex stage")
        try:
            compiled = tuple(regex.compile(s) for s in self.stages)
        except regex.error as e:
            raise ValueError(f"invalid pre-tokenizer regex {self.stages!r}: {e}") from e
        object.__setattr__(self, "_compiled", compiled)

    @classmethod
    def named(cls, name: str) -> PreTokenizer:
        """A preset by name: gpt2, smollm, llama-bpe/llama3, qwen2."""
        if name not in PRESETS:
            raise ValueError(f"unknown pre-tokenizer {name!r}; expected one of {sorted(PRESETS)}")
        return cls(PRESETS[name])

    def split(self, text: str) -> list[str]:
        """Pre-tokens of `text` (which must not contain special tokens)."""
        first = self._compiled[0]
        if len(self._compiled) == 1:
            return first.findall(text)
        pieces = _isolate(first, text)
        for pattern in self._compiled[1:]:
            pieces = [p for piece in pieces for p in _isolate(pattern, piece)]
        return pieces

    def to_dict(self) -> dict:
        return {"stages": list(self.stages)}

    @classmethod
    def from_dict(cls, d: dict) -> PreTokenizer:
        return cls(tuple(d["stages"]))


def _isolate(pattern: regex.Pattern, text: str) -> list[str]:
    """Matches of `pattern` and the non-empty gaps between them, in order."""
    out: list[str] = []
    pos = 0
    for m in pattern.finditer(text):
        start, end = m.span()
        if start > pos:
            out.append(text[pos:start])
        if end > start:
            out.append(text[start:end])
        pos = end
    if pos < len(text):
        out.append(text[pos:])
    return out


class SpecialSplitter:
    """Splits text on special tokens, longest first (``<|a|><|a|>`` wins over ``<|a|>``)."""

    def __init__(self, special_tokens: Iterable[str] = ()):
        self.tokens = sorted(set(special_tokens), key=lambda s: (-len(s), s))
        if any(not t for t in self.tokens):
            raise ValueError("special tokens must be non-empty strings")
        self.pattern = regex.compile("|".join(regex.escape(t) for t in self.tokens)) if self.tokens else None
        self.max_len = max((len(t) for t in self.tokens), default=0)

    def split(self, text: str) -> Iterator[tuple[str, bool]]:
        """(segment, is_special) pairs in order; empty ordinary segments are skipped."""
        if self.pattern is None:
            if text:
                yield text, False
            return
        pos = 0
        for m in self.pattern.finditer(text):
            if m.start() > pos:
                yield text[pos : m.start()], False
            yield m.group(), True
            pos = m.end()
        if pos < len(text):
            yield text[pos:], False
