"""The pieces of an HF ``tokenizers`` pipeline around a SentencePiece-style BPE: added-token splitting,
pre-tokenizers (``Metaspace``, ``Split``) and decoders (``Replace``, ``ByteFallback``, ``Fuse``,
``Strip``, ``Metaspace``).

Policy: each piece is built from its ``tokenizer.json`` spec and reproduces what HF ``tokenizers`` does
with it, including its quirks (``Strip`` and ``Metaspace`` decode act per token, so ``Fuse`` comes first;
``ByteFallback`` turns an invalid run of byte tokens into one U+FFFD per byte). A spec kind that is not
implemented raises ValueError naming it; nothing is silently ignored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import regex

from scratchlm.tokenizer.normalize import WHITESPACE, pattern_of

_BYTE_TOKEN = regex.compile(r"<0x([0-9A-Fa-f]{2})>")


def byte_token_value(piece: str) -> int | None:
    """The byte a ``<0xNN>`` piece stands for, else None."""
    m = _BYTE_TOKEN.fullmatch(piece)
    return int(m.group(1), 16) if m else None


# ---------------------------------------------------------------------------- added tokens
@dataclass(frozen=True)
class AddedToken:
    """An HF added token: matched in the text before the model sees it."""

    content: str
    id: int
    special: bool = True
    lstrip: bool = False
    rstrip: bool = False
    normalized: bool = False
    single_word: bool = False

    @classmethod
    def from_hf(cls, d: dict) -> AddedToken:
        return cls(d["content"], int(d["id"]), bool(d.get("special", False)), bool(d.get("lstrip", False)),
                   bool(d.get("rstrip", False)), bool(d.get("normalized", False)), bool(d.get("single_word", False)))

    def to_hf(self) -> dict:
        return {"id": self.id, "content": self.content, "single_word": self.single_word, "lstrip": self.lstrip,
                "rstrip": self.rstrip, "normalized": self.normalized, "special": self.special}


def _is_word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


class AddedSplitter:
    """Splits text on added tokens as HF's ``AddedVocabulary`` does: leftmost-longest matches; ``lstrip`` /
    ``rstrip`` swallow the whitespace before / after; a ``single_word`` token only matches between
    non-word characters."""

    def __init__(self, tokens: list[AddedToken], contents: list[str] | None = None):
        """`contents`: the strings to match (default: each token's content; HF matches the normalized
        content of ``normalized`` tokens)."""
        contents = contents if contents is not None else [t.content for t in tokens]
        self.by_content = {}
        for t, c in zip(tokens, contents):
            if c:
                self.by_content.setdefault(c, t)
        ordered = sorted(self.by_content, key=lambda s: (-len(s), s))
        self.pattern = regex.compile("|".join(regex.escape(s) for s in ordered)) if ordered else None

    def split(self, text: str, base: int = 0) -> Iterator[tuple[str, int | None, int]]:
        """(segment, token id or None, offset of the segment + `base`); empty text segments are skipped."""
        if self.pattern is None:
            if text:
                yield text, None, base
            return
        pos = 0
        for m in self.pattern.finditer(text):
            start, stop = m.span()
            if start < pos:  # inside whitespace an rstrip token took
                continue
            tok = self.by_content[m.group()]
            if tok.single_word and ((start > 0 and _is_word_char(text[start - 1]))
                                    or (stop < len(text) and _is_word_char(text[stop]))):
                continue
            if tok.lstrip:
                while start > pos and text[start - 1] in WHITESPACE:
                    start -= 1
            if tok.rstrip:
                while stop < len(text) and text[stop] in WHITESPACE:
                    stop += 1
            if start > pos:
                yield text[pos:start], None, base + pos
            yield text[start:stop], tok.id, base + start
            pos = stop
        if pos < len(text):
            yield text[pos:], None, base + pos


# ---------------------------------------------------------------------------- pre-tokenizers
Piece = tuple[str, bool]  # (text, starts at offset 0 of the whole input)


def _split_spans(text: str, pattern: regex.Pattern, behavior: str, invert: bool) -> list[tuple[int, int]]:
    """HF ``NormalizedString::split``: the kept (start, end) spans of `text`."""
    parts: list[tuple[int, int, bool]] = []
    prev = 0
    for m in pattern.finditer(text):
        start, end = m.span()
        if prev != start:
            parts.append((prev, start, invert))
        parts.append((start, end, not invert))
        prev = end
    if prev != len(text):
        parts.append((prev, len(text), invert))
    behavior = behavior.lower().replace("_", "")
    if behavior == "isolated":
        return [(a, b) for a, b, _ in parts]
    if behavior == "removed":
        return [(a, b) for a, b, is_match in parts if not is_match]
    out: list[list[int]] = []
    previous = False
    if behavior == "mergedwithnext":
        for a, b, is_match in reversed(parts):
            if is_match and not previous and out:
                out[-1][0] = a
            else:
                out.append([a, b])
            previous = is_match
        return [(a, b) for a, b in reversed(out)]
    for a, b, is_match in parts:
        if behavior == "mergedwithprevious":
            merge = is_match and not previous
        elif behavior == "contiguous":
            merge = is_match == previous
        else:
            raise ValueError(f"Split behavior {behavior!r} is not supported")
        if merge and out:
            out[-1][1] = b
        else:
            out.append([a, b])
        previous = is_match
    return [(a, b) for a, b in out]


def _metaspace_scheme(spec: dict) -> str:
    if "prepend_scheme" in spec:
        return str(spec["prepend_scheme"]).lower()
    return "always" if spec.get("add_prefix_space", True) else "never"


def _compile_pre(spec: dict, where: str) -> list[Callable[[Piece], list[Piece]]]:
    kind = spec.get("type")
    if kind == "Sequence":
        return [f for child in spec.get("pretokenizers", []) for f in _compile_pre(child, where)]
    if kind == "Metaspace":
        repl = spec.get("replacement", "▁")
        scheme, split = _metaspace_scheme(spec), bool(spec.get("split", True))
        if scheme not in ("always", "first", "never"):
            raise ValueError(f"{where}: Metaspace prepend_scheme {scheme!r} not understood")
        delim = regex.compile(regex.escape(repl))

        def metaspace(piece: Piece) -> list[Piece]:
            text, first = piece
            text = text.replace(" ", repl)
            if (scheme == "always" or (scheme == "first" and first)) and not text.startswith(repl):
                text = repl + text
            if not split:
                return [(text, first)]
            return [(text[a:b], first and a == 0) for a, b in _split_spans(text, delim, "merged_with_next", False)]
        return [metaspace]
    if kind == "Split":
        pattern = pattern_of(spec.get("pattern", {}), where)
        behavior, invert = spec.get("behavior", "Isolated"), bool(spec.get("invert", False))
        _split_spans("", pattern, behavior, invert)  # validates the behavior now

        def split(piece: Piece) -> list[Piece]:
            text, first = piece
            return [(text[a:b], first and a == 0) for a, b in _split_spans(text, pattern, behavior, invert) if b > a]
        return [split]
    raise ValueError(f"{where}: pre-tokenizer {kind!r} is not supported with a SentencePiece-style BPE "
                     "(supported: Metaspace, Split, Sequence)")


class PreTokenizerSteps:
    """An HF pre-tokenizer spec (Metaspace / Split / Sequence) as a function of a normalized segment."""

    def __init__(self, spec: dict | None, where: str = ""):
        self.spec = spec
        self.steps = _compile_pre(spec, where or "pre_tokenizer") if spec is not None else []

    def __call__(self, text: str, first: bool) -> list[str]:
        pieces: list[Piece] = [(text, first)]
        for step in self.steps:
            pieces = [p for piece in pieces for p in step(piece) if p[0]]
        return [p[0] for p in pieces]


# ---------------------------------------------------------------------------- decoders
def _byte_fallback(tokens: list[str], raw: bool) -> list[str]:
    """HF ``ByteFallback``: a run of ``<0xNN>`` tokens becomes its UTF-8 text, or one U+FFFD per byte when
    invalid. With `raw`, the bytes are kept (as surrogate escapes) instead."""
    out: list[str] = []
    run = bytearray()

    def flush() -> None:
        if not run:
            return
        if raw:
            out.append(run.decode("utf-8", errors="surrogateescape"))
        else:
            try:
                out.append(run.decode("utf-8"))
            except UnicodeDecodeError:
                out.extend("\ufffd" * len(run))
        run.clear()

    for t in tokens:
        b = byte_token_value(t) if len(t) == 6 else None
        if b is None:
            flush()
            out.append(t)
        else:
            run.append(b)
    flush()
    return out


def _strip(token: str, content: str, start: int, stop: int) -> str:
    a = 0
    while a < min(start, len(token)) and token[a] == content:
        a += 1
    b = len(token)
    while b > a and len(token) - b < stop and token[b - 1] == content:
        b -= 1
    return token[a:b]


@dataclass
class _Step:
    chain: Callable[[list[str], bool], list[str]]  # (tokens, raw bytes wanted) -> tokens
    per_token: Callable[[str], str] | None  # the step's effect on a token in the middle of a text


def _compile_dec(spec: dict, where: str) -> list[_Step]:
    kind = spec.get("type")
    if kind == "Sequence":
        return [s for child in spec.get("decoders", []) for s in _compile_dec(child, where)]
    if kind == "Replace":
        pat, content = pattern_of(spec["pattern"], where), spec["content"]

        def replace(t: str) -> str:
            return pat.sub(lambda _: content, t)
        return [_Step(lambda ts, raw: [replace(t) for t in ts], replace)]
    if kind == "ByteFallback":
        return [_Step(_byte_fallback, None)]
    if kind == "Fuse":
        return [_Step(lambda ts, raw: ["".join(ts)], None)]
    if kind == "Strip":
        content, start, stop = spec.get("content", " "), int(spec.get("start", 0)), int(spec.get("stop", 0))
        return [_Step(lambda ts, raw: [_strip(t, content, start, stop) for t in ts], None)]
    if kind == "Metaspace":
        repl, scheme = spec.get("replacement", "▁"), _metaspace_scheme(spec)

        def metaspace(ts: list[str], raw: bool) -> list[str]:
            return [t.replace(repl, "" if i == 0 and scheme != "never" else " ") for i, t in enumerate(ts)]
        return [_Step(metaspace, lambda t: t.replace(repl, " "))]
    raise ValueError(f"{where}: decoder {kind!r} is not supported with a SentencePiece-style BPE "
                     "(supported: Replace, ByteFallback, Fuse, Strip, Metaspace, Sequence)")


class Decoder:
    """An HF decoder spec as a function of token strings; ``None`` joins the tokens with spaces (as HF)."""

    def __init__(self, spec: dict | None, where: str = ""):
        self.spec = spec
        self.steps = _compile_dec(spec, where or "decoder") if spec is not None else None

    def __call__(self, tokens: list[str], raw: bool = False) -> str:
        """The text of `tokens`; with `raw`, byte tokens stay raw bytes (as surrogate escapes)."""
        if self.steps is None:
            return " ".join(tokens)
        for step in self.steps:
            tokens = step.chain(tokens, raw)
        return "".join(tokens)

    def token_text(self, token: str) -> str:
        """What one token contributes in the middle of a text (byte tokens as surrogate escapes)."""
        value = byte_token_value(token)
        if value is not None and any(s.chain is _byte_fallback for s in self.steps or []):
            return bytes([value]).decode("utf-8", errors="surrogateescape")
        for step in self.steps or []:
            if step.per_token is not None:
                token = step.per_token(token)
        return token
