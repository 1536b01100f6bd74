"""Pre-tokenization: special-token splitting and regex pre-token splitting.

A pre-tokenizer is data, not code: an ordered tuple of regex *stages*. Each stage splits every piece
produced by the previous stage into its matches **and** the gaps between them ("isolated" behaviour in
HF `tokenizers`, the regex sequence of llama.cpp). GPT-2 is one stage; SmolLM2 is two
(``\\p{N}`` then GPT-2: digits are isolated first, exactly as HF's ``Digits(individual_digits=True)``
followed by ``ByteLevel``). Merges never cross a pre-token boundary.
"""

from __future__ import annotations

import re
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
    "gpt-2": (GPT2_PATTERN,),  # what llama.cpp's convert writes for GPT-2 itself
    "default": (GPT2_PATTERN,),
    "smollm": (DIGITS_PATTERN, GPT2_PATTERN),
    "llama-bpe": (LLAMA3_PATTERN,),
    "llama3": (LLAMA3_PATTERN,),
    "qwen2": (QWEN2_PATTERN,),
}


# Cutting text between a letter and " letter" never changes the pre-tokens of these patterns (the
# letter run ends at the space; " letter..." starts a piece either way; no look-behind).
_CUTTABLE = {GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, DIGITS_PATTERN}
_SAFE_CUT = re.compile(r"(?<=[A-Za-z])(?= [A-Za-z])")
_BLOCK_CHARS = 4096


def _simple_text_checker() -> re.Pattern:
    r"""Matches a character that is *not* "simple": simple = ASCII, or a Latin-1 / general-punctuation /
    currency character that is neither a letter, a number nor whitespace (’ “ ” — … « » £ € ...). On
    simple text the ASCII translation of a pattern splits exactly like the original: such characters
    are "other" for both (`[^\s\p{L}\p{N}]`)."""
    other = regex.compile(r"[\s\p{L}\p{N}]")
    candidates = [*range(0x80, 0x100), *range(0x2000, 0x2070), *range(0x20A0, 0x20D0)]
    safe = "".join(chr(c) for c in candidates if not other.match(chr(c)))
    return re.compile("[^\x00-\x7f" + re.escape(safe) + "]")


_NOT_SIMPLE = _simple_text_checker()


def ascii_version(pattern: str) -> str | None:
    r"""`pattern` for the stdlib `re` module with ``re.ASCII``, for pure-ASCII text: ``\p{L}`` -> ``A-Za-z``,
    ``\p{N}`` -> ``0-9`` (exact on ASCII, where they are the only letters and digits). None when the pattern
    uses other ``\p{..}`` classes."""
    out, i, depth = [], 0, 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and pattern.startswith(("\\p{L}", "\\p{N}"), i):
            cls = "A-Za-z" if pattern[i + 3] == "L" else "0-9"
            out.append(cls if depth else f"[{cls}]")
            i += 5
            continue
        if c == "\\":
            if pattern[i + 1 : i + 2] in ("p", "P"):
                return None
            out.append(pattern[i : i + 2])
            i += 2
            continue
        if c == "[" and not depth:
            depth = 1
        elif c == "]" and depth:
            depth = 0
        out.append(c)
        i += 1
    return "".join(out)


@dataclass(frozen=True)
class PreTokenizer:
    """An ordered tuple of regex stages (see the module docstring).

    Speed: long text is cut into ~4 KB blocks at points that cannot change the pre-tokens (known patterns
    only), and a block of "simple" text (ASCII plus non-letter punctuation such as ’ “ ” —) is split with an
    ASCII-only translation of the pattern in the stdlib `re` module (about twice as fast as `regex`;
    identical on such text, checked against tiktoken in tests).
    """

    stages: tuple[str, ...] = (GPT2_PATTERN,)
    _compiled: tuple = field(default=(), init=False, repr=False, compare=False)
    _ascii: tuple | None = field(default=None, init=False, repr=False, compare=False)
    _cuttable: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a PreTokenizer needs at least one regex stage")
        try:
            compiled = tuple(regex.compile(s) for s in self.stages)
        except regex.error as e:
            raise ValueError(f"invalid pre-tokenizer regex {self.stages!r}: {e}") from e
        object.__setattr__(self, "_compiled", compiled)
        try:
            ascii_patterns = [ascii_version(s) for s in self.stages]
            if None not in ascii_patterns:
                object.__setattr__(self, "_ascii", tuple(re.compile(p, re.ASCII) for p in ascii_patterns))
        except (re.error, IndexError):
            pass
        object.__setattr__(self, "_cuttable", all(s in _CUTTABLE for s in self.stages))

    @classmethod
    def named(cls, name: str) -> PreTokenizer:
        """A preset by name: gpt2, smollm, llama-bpe/llama3, qwen2."""
        if name not in PRESETS:
            raise ValueError(f"unknown pre-tokenizer {name!r}; expected one of {sorted(PRESETS)}")
        return cls(PRESETS[name])

    def split(self, text: str) -> list[str]:
        """Pre-tokens of `text` (which must not contain special tokens)."""
        if self._ascii is None:
            return self._split(self._compiled, text)
        if text.isascii() or _NOT_SIMPLE.search(text) is None:
            return self._split(self._ascii, text)
        if not self._cuttable or len(text) <= 2 * _BLOCK_CHARS:
            return self._split(self._compiled, text)
        pieces: list[str] = []
        pos, n = 0, len(text)
        while pos < n:
            m = _SAFE_CUT.search(text, pos + _BLOCK_CHARS)
            end = m.end() if m else n
            block = text[pos:end]
            simple = block.isascii() or _NOT_SIMPLE.search(block) is None
            pieces += self._split(self._ascii if simple else self._compiled, block)
            pos = end
        return pieces

    @staticmethod
    def _split(compiled: tuple, text: str) -> list[str]:
        first = compiled[0]
        if len(compiled) == 1:
            return first.findall(text)
        pieces = _isolate(first, text)
        for pattern in compiled[1:]:
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
