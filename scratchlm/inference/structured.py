"""Grammar-constrained decoding with llguidance: the tokenizer bridge, compiled grammars, per-sequence matchers and
the batched token-mask fill that runs while the forward does.

Policy:

- One `GrammarCompiler` per engine (a field of it; nothing here is module state). It converts the engine's tokenizer
  once, on first use, into an ``llguidance.LLTokenizer``: each id's bytes (`token_table`), with BOS, EOS, the
  tokenizer's special/control tokens and ids without bytes marked special, so grammar text can never produce them;
  EOS is allowed exactly when the grammar is complete. A tokenizer without an EOS gets a phantom one past its
  vocabulary (never sampled: the grammar's completion stops the sequence instead, see below).
- A `StructuredOutputs` spec -> an llguidance grammar: a JSON schema (no free whitespace: items separated by ", " and
  keys by ": ", so a small model cannot loop on blank lines; the schema's own ``"x-guidance"`` options override),
  json_object = the schema ``{"type": "object"}``, a regex, a choice (a Lark alternation of the strings as
  literals), a Lark grammar (or GBNF, converted by llguidance). Compiling = building an ``LLMatcher``; one that
  ends in an error is a `ValueError` carrying llguidance's message. The pristine compiled matcher of each spec stays
  in an LRU (`cache_size` specs); each sequence gets its own deep copy (microseconds), so `n > 1` samples and
  requests with the same schema never recompile.
- A `GrammarMatcher` has consumed exactly its sequence's output tokens (the engine advances it after each appended
  token), so preemption by recompute needs nothing; it is `finished` when no more text can follow (the engine then
  stops the sequence with finish reason "stop", without sampling the EOS).
- Masks: one row per constrained sample, int32 words of 32 token bits, ``ceil(V_tok / 32)`` words, filled by
  llguidance's executor (which releases the GIL) on a worker thread: `start_fill` before the forward,
  `MaskFill.wait` before sampling. A row with draft tokens (speculative decoding) gets one mask per draft position
  from llguidance's draft fill, which advances through the drafts and rolls back itself: positions after an
  invalid draft stay all-allowed (the target rejects that draft anyway, as its masked probability is 0).
  The sampler's `apply_token_bitmask` turns a row into -inf on the disallowed logits; ids past the tokenizer (a
  vocabulary padded beyond it) are disallowed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
import torch

from scratchlm.inference.params import StructuredOutputs

# JSON schemas: compact separators and no free whitespace (see the module docstring); "x-guidance" overrides these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def token_table(tokenizer: Any) -> tuple[list[bytes], list[int], int | None]:
    """(bytes of each id, special ids, EOS id) of a scratchlm tokenizer: byte-level BPE (`Tokenizer`), SentencePiece
    (`SentencePieceBPE`, from tokenizer.json or GGUF), llama2.c's, or anything with ``vocab_size`` and ``decode``.

    Bytes come from ``id_to_token`` (the piece as it reads mid-text: a SentencePiece "▁" is a space, "<0x0A>" its
    byte), else ``decode_bytes([i])``, else ``decode([i])``. Special: BOS, EOS, the tokenizer's special tokens
    (SentencePiece: its added tokens flagged special; BPE: its special tokens), and ids with no bytes."""
    n = int(tokenizer.vocab_size)
    if hasattr(tokenizer, "id_to_token"):
        def piece(i: int) -> bytes:
            return tokenizer.id_to_token(i)
    elif hasattr(tokenizer, "decode_bytes"):
        def piece(i: int) -> bytes:
            return tokenizer.decode_bytes([i])
    else:
        def piece(i: int) -> bytes:
            return tokenizer.decode([i]).encode("utf-8")
    tokens: list[bytes] = []
    special = {i for i in (getattr(tokenizer, "bos_id", None), getattr(tokenizer, "eos_id", None)) if i is not None}
    for i in range(n):
        try:
            b = bytes(piece(i))
        except (KeyError, IndexError, ValueError):  # a hole in the vocabulary
            b = b""
        tokens.append(b)
        if not b:
            special.add(i)
    added = getattr(tokenizer, "added_tokens", None)
    if added is not None:
        special.update(t.id for t in added if t.special)
    else:
        special.update(getattr(tokenizer, "special_ids", {}).values())
    return tokens, sorted(i for i in special if 0 <= i < n), getattr(tokenizer, "eos_id", None)


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` reads: tokens, EOS/BOS, special ids, and an encoder (bytes -> ids).

    llguidance tokenizes forced bytes with the encoder and trusts that the ids spell exactly those bytes. A
    SentencePiece or llama2.c tokenizer prepends a space (its dummy prefix), a normalizer may change the text, and
    bytes may stop inside a UTF-8 character: whenever the tokenizer's ids do not spell the bytes exactly (or hold a
    special token), the encoder spells them greedily, longest token first, from the vocabulary instead."""

    def __init__(self, tokenizer: Any):
        self.tokens, self.special_token_ids, eos = token_table(tokenizer)
        special = set(self.special_token_ids)
        self._ids: dict[bytes, int] = {}
        for i, b in enumerate(self.tokens):
            if b and i not in special:
                self._ids.setdefault(b, i)
        self._longest = max(map(len, self._ids), default=1)
        if eos is None:  # a phantom EOS past the vocabulary: the grammar's completion stops the sequence instead
            eos = len(self.tokens)
            self.tokens.append(b"")
            self.special_token_ids.append(eos)
        self._special = set(self.special_token_ids)
        self.eos_token_id = eos
        self.bos_token_id = getattr(tokenizer, "bos_id", None)
        self._encode = getattr(tokenizer, "encode_ordinary", None) or tokenizer.encode

    def __call__(self, data: str | bytes) -> list[int]:
        raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        try:
            ids = list(self._encode(raw.decode("utf-8")))
        except UnicodeDecodeError:
            return self.greedy(raw)
        n = len(self.tokens)
        if all(0 <= i < n and i not in self._special for i in ids) and b"".join(self.tokens[i] for i in ids) == raw:
            return ids
        return self.greedy(raw)

    def greedy(self, raw: bytes) -> list[int]:
        """`raw` spelled with the longest vocabulary token at each position (a byte no token holds is skipped:
        the grammar can never produce it either)."""
        out: list[int] = []
        i = 0
        while i < len(raw):
            for n in range(min(self._longest, len(raw) - i), 0, -1):
                token = self._ids.get(raw[i : i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                i += 1
        return out


def grammar_of(spec: StructuredOutputs) -> str:
    """The llguidance grammar (its JSON text) for `spec`; a `ValueError` when the text cannot even be read."""
    kind = spec.kind
    if kind == "json":  # its compact JSON text, as validated (a dict changed since cannot slip past the cache)
        return llguidance.LLMatcher.grammar_from_json_schema(spec.key[1], defaults=JSON_DEFAULTS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(spec.choice))
    return llguidance.grammar_from("grammar", spec.grammar)


class GrammarMatcher:
    """One sequence's grammar state (it has consumed the sequence's output tokens)."""

    __slots__ = ("matcher",)

    def __init__(self, matcher: llguidance.LLMatcher):
        self.matcher = matcher

    def advance(self, token: int) -> None:
        """Consume the sampled `token`; a `ValueError` with llguidance's message when the grammar rejects it."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"structured output: token {token} rejected by the grammar: "
                             f"{self.matcher.get_error().splitlines()[0]}")

    @property
    def finished(self) -> bool:
        """No more text can follow (the grammar is complete, or an EOS was consumed)."""
        return self.matcher.is_stopped()


@dataclass
class MaskFill:
    """Token masks being filled on the worker thread; `wait()` joins it and returns the (rows, words) int32 masks.
    Job i's masks are rows ``offsets[i] .. offsets[i] + 1 + len(drafts_i)``."""

    future: Future | None
    masks: torch.Tensor
    offsets: list[int]

    def wait(self) -> torch.Tensor:
        if self.future is not None:
            self.future.result()
            self.future = None
        return self.masks


class GrammarCompiler:
    """The engine's grammar side: its tokenizer for llguidance, the compiled-grammar LRU, the mask worker."""

    def __init__(self, tokenizer: Any, cache_size: int = 128, threads: int | None = None):
        self.tokenizer = tokenizer
        self.cache_size = cache_size
        self.threads = threads
        self.hits = 0
        self.misses = 0
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._executor: llguidance.LLExecutor | None = None
        self._worker: ThreadPoolExecutor | None = None

    @property
    def lltokenizer(self) -> llguidance.LLTokenizer:
        """The tokenizer converted for llguidance (once)."""
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocabulary(self.tokenizer)))
        return self._lltokenizer

    @property
    def mask_words(self) -> int:
        """int32 words per mask row."""
        return (self.lltokenizer.vocab_size + 31) // 32

    def _compiled(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        key = spec.key
        hit = self._cache.get(key)
        if hit is not None:
            self.hits += 1
            self._cache.move_to_end(key)
            return hit
        self.misses += 1
        try:
            grammar = grammar_of(spec)
        except ValueError as e:
            raise ValueError(f"structured_outputs.{spec.kind}: {e}") from None
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{spec.kind}: llguidance cannot compile it: "
                             f"{matcher.get_error()}")
        self._cache[key] = matcher
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return matcher

    def check(self, spec: StructuredOutputs) -> None:
        """Compile `spec` (or find it in the cache); a `ValueError` carrying llguidance's message when it cannot."""
        self._compiled(spec)

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher for one sequence (a copy of the cached compiled grammar)."""
        return GrammarMatcher(self._compiled(spec).deep_copy())

    def start_fill(self, jobs: Sequence[tuple[GrammarMatcher, Sequence[int]]]) -> MaskFill:
        """Start filling the masks of `jobs` ((matcher, draft tokens) each: 1 + len(drafts) rows) on the worker
        thread; the matchers must not change until `wait()`."""
        offsets, rows = [], 0
        for _, drafts in jobs:
            offsets.append(rows)
            rows += 1 + len(drafts)
        masks = np.full((rows, self.mask_words), -1, dtype=np.int32)  # -1: all allowed (rows past a bad draft)
        plain = [(m.matcher, off) for (m, drafts), off in zip(jobs, offsets) if not drafts]
        drafted = [(m.matcher, off, list(drafts)) for (m, drafts), off in zip(jobs, offsets) if drafts]
        if self._executor is None:
            self._executor = llguidance.LLExecutor(self.threads)
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        future = self._worker.submit(self._fill, plain, drafted, masks) if jobs else None
        return MaskFill(future, torch.from_numpy(masks), offsets)

    def _fill(self, plain: list, drafted: list, masks: np.ndarray) -> None:
        """On the worker thread: llguidance fills the rows (the GIL released, its own thread pool)."""
        if plain:
            llg_numpy.fill_next_token_bitmask_par(self._executor, plain, masks)
        if drafted:
            llg_numpy.fill_next_token_bitmask_par_with_draft_tokens(self._executor, drafted, masks)

    def close(self) -> None:
        """Stop the mask worker thread (a later fill starts a new one)."""
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
            self._executor = None


def check_structured(spec: StructuredOutputs, tokenizer: Any) -> None:
    """Raise a `ValueError` carrying llguidance's message when `spec` cannot be compiled for `tokenizer`.

    `tokenizer`: a `GrammarCompiler` (the engine's own, `LLMEngine.grammars`, whose cache keeps the result), or a
    tokenizer (converted for this call only: ~0.1 s for a 50k vocabulary, then the compile)."""
    if not isinstance(spec, StructuredOutputs):
        raise ValueError(f"structured_outputs: got {type(spec).__name__}, expected a StructuredOutputs")
    if tokenizer is None:
        raise ValueError("structured_outputs needs the model's tokenizer (this model has none)")
    compiler = tokenizer if isinstance(tokenizer, GrammarCompiler) else GrammarCompiler(tokenizer)
    compiler.check(spec)
