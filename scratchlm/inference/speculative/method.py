"""Parsing of the `--speculative` setting: `ngram[:N]`, `draft:PATH` or `layers:K`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

EXPECTED = "ngram, ngram:N (longest n-gram, 1-8), draft:PATH (a smaller model with the same tokenizer) or layers:K"


@dataclass(frozen=True)
class SpecMethod:
    """A parsed speculative-decoding method.

    kind: "ngram" (prompt lookup), "draft" (a separate draft model) or "layers" (the target's first K layers).
    ngram_max: the longest n-gram matched against the context (ngram only).
    path: the draft model's path (draft only).
    layers: how many leading layers of the target form the draft (layers only).
    """

    kind: Literal["ngram", "draft", "layers"]
    ngram_max: int = 4
    path: str | None = None
    layers: int = 0


def parse_speculative(spec: str) -> SpecMethod:
    """`ngram`, `ngram:N`, `draft:PATH`, `layers:K` -> SpecMethod; anything else is a ValueError naming the forms."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"speculative={spec!r}: expected {EXPECTED}")
    kind, _, arg = spec.strip().partition(":")
    if kind == "ngram":
        if not arg:
            return SpecMethod("ngram")
        if not arg.isdigit() or not 1 <= int(arg) <= 8:
            raise ValueError(f"speculative={spec!r}: the n-gram length must be an integer in [1, 8]")
        return SpecMethod("ngram", ngram_max=int(arg))
    if kind == "draft":
        if not arg:
            raise ValueError(f"speculative={spec!r}: draft needs a model path, e.g. draft:models/small.gguf")
        return SpecMethod("draft", path=arg)
    if kind == "layers":
        if not arg.isdigit() or int(arg) < 1:
            raise ValueError(f"speculative={spec!r}: layers needs a positive layer count, e.g. layers:8")
        return SpecMethod("layers", layers=int(arg))
    raise ValueError(f"speculative={spec!r}: unknown method {kind!r}; expected {EXPECTED}")
