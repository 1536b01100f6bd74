"""Text normalizers, as HF ``tokenizers`` applies them before pre-tokenization.

Policy: a normalizer is data (its HF ``tokenizer.json`` spec), compiled into a function of one segment of
text (the text between two added tokens). Only the kinds that real LLM tokenizers ship are implemented:
``Sequence``, ``Prepend`` (Llama 2 / Mistral), ``Replace`` (a string or a regex; Llama 2, Gemma),
``NFC``/``NFD``/``NFKC``/``NFKD`` (Qwen2), ``Lowercase``, ``Strip``. Any other kind (``Precompiled``,
``BertNormalizer``, ...) raises ValueError naming it: a normalizer is never silently ignored.

Semantics follow HF's ``NormalizedString``: ``Prepend`` adds its string to every non-empty segment;
``Lowercase`` maps character by character (no final-sigma rule, unlike ``str.lower``); ``Strip`` removes
Unicode White_Space.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

import regex

_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD"}
#: Unicode White_Space (Rust's ``char::is_whitespace``; ``str.isspace`` also counts U+001C..U+001F).
WHITESPACE = "".join(map(chr, [*range(9, 14), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                               0x202F, 0x205F, 0x3000]))


def hf_regex(pattern: str) -> regex.Pattern:
    r"""Compile an HF (Oniguruma) regex with the `regex` module (``\z`` is spelled ``\Z`` there)."""
    try:
        return regex.compile(pattern.replace(r"\z", r"\Z"))
    except regex.error as e:
        raise ValueError(f"invalid regex {pattern!r}: {e}") from e


def pattern_of(spec: dict, where: str) -> regex.Pattern:
    """The compiled pattern of an HF ``{"String": s}`` or ``{"Regex": r}`` pattern spec."""
    if "String" in spec:
        return regex.compile(regex.escape(spec["String"]))
    if "Regex" in spec:
        return hf_regex(spec["Regex"])
    raise ValueError(f"{where}: pattern {spec!r} not understood (expected String or Regex)")


def _lowercase(text: str) -> str:
    """Character-wise lowercase (Rust's ``char::to_lowercase``): no context-dependent final sigma."""
    return text.lower() if "Σ" not in text else "".join(c.lower() for c in text)


def _compile(spec: dict, where: str) -> list[Callable[[str], str]]:
    kind = spec.get("type")
    if kind == "Sequence":
        return [f for child in spec.get("normalizers", []) for f in _compile(child, where)]
    if kind == "Prepend":
        prefix = spec["prepend"]
        return [lambda s: prefix + s if s else s]
    if kind == "Replace":
        pat, content = pattern_of(spec["pattern"], where), spec["content"]
        if "String" in spec["pattern"]:
            old = spec["pattern"]["String"]
            return [lambda s: s.replace(old, content)]
        return [lambda s: pat.sub(lambda _: content, s)]
    if kind in _UNICODE_FORMS:
        return [lambda s: unicodedata.normalize(kind, s)]
    if kind == "Lowercase":
        return [_lowercase]
    if kind == "Strip":
        left, right = spec.get("strip_left", True), spec.get("strip_right", True)

        def strip(s: str) -> str:
            s = s.lstrip(WHITESPACE) if left else s
            return s.rstrip(WHITESPACE) if right else s
        return [strip]
    raise ValueError(f"{where}: normalizer {kind!r} is not supported (supported: Sequence, Prepend, Replace, "
                     "NFC, NFD, NFKC, NFKD, Lowercase, Strip)")


@dataclass(frozen=True)
class Normalizer:
    """An HF normalizer spec (a ``tokenizer.json`` ``normalizer`` object) and its compiled steps."""

    spec: dict
    where: str = ""
    _steps: tuple = field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_steps", tuple(_compile(self.spec, self.where or "normalizer")))

    def __call__(self, text: str) -> str:
        """The normalized text of one segment."""
        for step in self._steps:
            text = step(text)
        return text

    @property
    def unicode_only(self) -> bool:
        """Whether every step is a Unicode normalization form (NFC & co.), which commutes with cutting the
        text before an ASCII character."""
        def walk(node: dict) -> bool:
            if node.get("type") == "Sequence":
                return all(walk(c) for c in node.get("normalizers", []))
            return node.get("type") in _UNICODE_FORMS
        return walk(self.spec)


def normalizer_from_hf(spec: dict | None, where: str = "") -> Normalizer | None:
    """A Normalizer for an HF spec, None for ``null`` (or an empty Sequence)."""
    if spec is None or (spec.get("type") == "Sequence" and not spec.get("normalizers")):
        return None
    return Normalizer(spec, where)
