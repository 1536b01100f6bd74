"""SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Phi-3, Gemma), hand-written.

Encoding, as HF ``tokenizers`` runs a ``tokenizer.json`` of these families:

1. split out the added tokens that are not ``normalized`` (on the raw text), normalize each remaining
   segment (e.g. ``Prepend("▁")`` + ``Replace(" ", "▁")``), split out the ``normalized`` added tokens;
2. pre-tokenize (``Metaspace`` / ``Split``, often nothing: the whole segment is one word);
3. BPE on each word: one symbol per character, a character that is not in the vocabulary becomes its
   UTF-8 bytes as ``<0xNN>`` tokens (byte fallback) or ``<unk>`` (consecutive ones fused with
   ``fuse_unk``); then merge the best adjacent pair, the leftmost on ties, until none applies.

"Best" is the rank of the pair in a merges list (HF ``tokenizer.json``) or, without merges, the score of
the token the pair forms (llama.cpp's ``llm_tokenizer_spm`` on a GGUF vocabulary, and SentencePiece itself:
any adjacent pair whose concatenation is a token may merge, the highest score first, the leftmost on ties).
HF's converter writes an SP model's merges as every split of a token into two tokens, ordered by the
token's score, so the two agree (tested against HF and against ``sentencepiece``) except where they
legitimately cannot:

* equal scores of different tokens: llama.cpp takes the leftmost pair, HF the first in its merges list;
* a character outside the vocabulary: HF (and this module) turn it into byte tokens at once, llama.cpp
  could still merge it with a neighbour into a token (impossible in a trained SP vocabulary, whose pieces
  are made of vocabulary characters);
* overlapping special tokens: llama.cpp matches the longest token first over the whole text, HF (and this
  module) the leftmost-longest match; duplicate token strings: llama.cpp keeps the last id, this the first.

Speed: a word is cut into sub-words before each run of "▁" that no token can span (checked against the
vocabulary once), and sub-words are cached, so the heap BPE only ever runs on short new sub-words.
Decoding applies the HF decoder chain to the token strings (see `scratchlm.tokenizer.pipeline`).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from functools import cached_property
from typing import Any

import regex

from scratchlm.tokenizer.normalize import Normalizer, normalizer_from_hf
from scratchlm.tokenizer.pipeline import AddedSplitter, AddedToken, Decoder, PreTokenizerSteps, byte_token_value

_CACHE_MAX_PIECE = 64
_CACHE_MAX_ENTRIES = 1 << 20
_SPACE = "▁"


class _PairTable(dict):
    """(left id, right id) -> (rank, merged id) or None. Score mode fills it lazily: a pair merges when the
    concatenation of its pieces is a token; its rank is that token's place in descending score order."""

    __slots__ = ("_pieces", "_lookup", "_rank")

    def __init__(self, pieces: dict[int, str] | None = None, lookup: dict[str, int] | None = None,
                 rank: dict[int, int] | None = None):
        super().__init__()
        self._pieces, self._lookup, self._rank = pieces, lookup, rank

    def __missing__(self, pair: tuple[int, int]):
        if self._pieces is None:
            return None
        merged = self._lookup.get(self._pieces[pair[0]] + self._pieces[pair[1]])
        value = None if merged is None else (self._rank.get(merged, 1 << 40), merged)
        if len(self) >= _CACHE_MAX_ENTRIES:
            self.clear()
        self[pair] = value
        return value


class SentencePieceBPE:
    """SentencePiece-style BPE tokenizer with the interface of :class:`scratchlm.tokenizer.Tokenizer`.

    Args:
        pieces: id -> token string as stored (``"▁the"``, ``"<0x0A>"``, ``"<s>"``).
        merges: (left, right) piece pairs in rank order (HF); or None and `scores` (llama.cpp).
        scores: id -> score; used when `merges` is None.
        added_tokens: tokens split out of the text before the model (special or not).
        unk_id, byte_fallback, fuse_unk, ignore_merges: the HF BPE model options.
        normalizer, pre_tokenizer, decoder: HF specs (``tokenizer.json`` objects) or None.
        bos_id, eos_id, add_bos, add_eos, chat_template: metadata for the model and inference layers.
    """

    def __init__(
        self,
        pieces: dict[int, str] | list[str],
        merges: list[tuple[str, str]] | None = None,
        scores: dict[int, float] | list[float] | None = None,
        *,
        added_tokens: Iterable[AddedToken] = (),
        unk_id: int | None = None,
        byte_fallback: bool = True,
        fuse_unk: bool = True,
        ignore_merges: bool = False,
        normalizer: dict | None = None,
        pre_tokenizer: dict | None = None,
        decoder: dict | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        add_bos: bool = False,
        add_eos: bool = False,
        chat_template: str | None = None,
        where: str = "",
    ):
        self.pieces: dict[int, str] = dict(enumerate(pieces)) if isinstance(pieces, list) else dict(pieces)
        self.added_tokens = sorted(added_tokens, key=lambda t: t.id)
        for t in self.added_tokens:
            self.pieces[t.id] = t.content
        self.token_to_id: dict[str, int] = {}
        for i in sorted(self.pieces):  # on duplicates, the lowest id wins
            self.token_to_id.setdefault(self.pieces[i], i)
        self.unk_id, self.byte_fallback, self.fuse_unk = unk_id, bool(byte_fallback), bool(fuse_unk)
        self.ignore_merges = bool(ignore_merges)
        self.bos_id, self.eos_id, self.add_bos, self.add_eos = bos_id, eos_id, bool(add_bos), bool(add_eos)
        self.chat_template = chat_template
        where = where or "tokenizer"
        self.normalizer: Normalizer | None = normalizer_from_hf(normalizer, f"{where}: normalizer")
        self.pre_tokenizer = PreTokenizerSteps(pre_tokenizer, f"{where}: pre_tokenizer")
        self.decoder = Decoder(decoder, f"{where}: decoder")

        self.merges = None if merges is None else [(str(a), str(b)) for a, b in merges]
        self.scores = None
        if self.merges is not None:
            self.pairs = _PairTable()
            for rank, (a, b) in enumerate(self.merges):
                try:
                    key, merged = (self.token_to_id[a], self.token_to_id[b]), self.token_to_id[a + b]
                except KeyError as e:
                    raise ValueError(f"{where}: merge #{rank} {a!r} + {b!r}: {e.args[0]!r} is not in the vocab"
                                     ) from None
                if key not in self.pairs:
                    self.pairs[key] = (rank, merged)
        else:
            if scores is None:
                raise ValueError(f"{where}: a SentencePiece BPE needs merges or scores")
            self.scores = dict(enumerate(scores)) if isinstance(scores, list) else dict(scores)
            order = sorted({-float(s) for s in self.scores.values()})
            dense = {s: r for r, s in enumerate(order)}
            rank = {i: dense[-float(s)] for i, s in self.scores.items()}
            self.pairs = _PairTable(self.pieces, self.token_to_id, rank)

        self.special_tokens = [t.content for t in self.added_tokens]
        self.special_ids = {t.content: t.id for t in self.added_tokens}
        self._special_set = {t.id for t in self.added_tokens if t.special}
        raw = [t for t in self.added_tokens if not t.normalized]
        normalized = [t for t in self.added_tokens if t.normalized]
        self._raw_splitter = AddedSplitter(raw)
        norm = self.normalizer or (lambda s: s)
        self._norm_splitter = AddedSplitter(normalized, [norm(t.content) for t in normalized])
        # HF decodes a `normalized` added token as its normalized content.
        self._decode_pieces = self.pieces | {t.id: norm(t.content) for t in normalized}
        self._byte_ids = [self.token_to_id.get(f"<0x{b:02X}>") for b in range(256)]
        self._word_cut = self._word_cut_pattern()
        self._cache: dict[str, tuple[int, ...]] = {}

    # ------------------------------------------------------------------ metadata
    @property
    def vocab_size(self) -> int:
        """One past the largest id."""
        return max(self.pieces) + 1

    def __repr__(self) -> str:
        mode = f"merges={len(self.merges)}" if self.merges is not None else "score-ordered merges"
        return f"SentencePieceBPE(vocab_size={self.vocab_size}, {mode}, added_tokens={len(self.added_tokens)})"

    def id_to_token(self, i: int) -> bytes:
        """The bytes token `i` stands for in the middle of a text (``▁`` as a space, ``<0xNN>`` as its byte)."""
        return self.decoder.token_text(self._decode_pieces[i]).encode("utf-8", errors="surrogateescape")

    @cached_property
    def vocab(self) -> dict[int, bytes]:
        """id -> :meth:`id_to_token` for every id."""
        return {i: self.id_to_token(i) for i in self.pieces}

    # ------------------------------------------------------------------ encoding
    def _word_cut_pattern(self) -> regex.Pattern | None:
        """Cut points inside a word that no merge can cross: before a run of "▁" whose previous character
        never precedes "▁" inside a token. None when "▁" is not a token or a byte token could glue."""
        if _SPACE not in self.token_to_id:
            return None
        glue = {p[k - 1] for p in self.token_to_id if _SPACE in p[1:]
                for k in range(1, len(p)) if p[k] == _SPACE and p[k - 1] != _SPACE}
        if ">" in glue:
            return None
        return regex.compile(f"(?<=[^{regex.escape(_SPACE + ''.join(sorted(glue)))}])(?={_SPACE})")

    def _symbols(self, text: str) -> list[int]:
        """One id per character; byte fallback or (fused) unk for characters outside the vocabulary. As HF:
        a pending unk is emitted at the next known character, after any byte-fallback tokens."""
        lookup, out, unk_len = self.token_to_id, [], 0
        for ch in text:
            i = lookup.get(ch)
            if i is not None:
                if unk_len:
                    out.append(self.unk_id)
                    unk_len = 0
                out.append(i)
                continue
            if self.byte_fallback:
                ids = [self._byte_ids[b] for b in ch.encode("utf-8")]
                if None not in ids:
                    out += ids
                    continue
            if self.unk_id is not None:
                if unk_len and not self.fuse_unk:
                    out.append(self.unk_id)
                unk_len = 1
        if unk_len:
            out.append(self.unk_id)
        return out

    def _bpe(self, text: str) -> tuple[int, ...]:
        """BPE of one sub-word: heap of (rank, position), lazy deletion, leftmost on equal ranks."""
        sym = self._symbols(text)
        n = len(sym)
        if n < 2:
            return tuple(sym)
        pairs = self.pairs
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = []
        for i in range(n - 1):
            m = pairs[(sym[i], sym[i + 1])]
            if m is not None:
                heap.append((m[0], i, sym[i], sym[i + 1], m[1]))
        heapq.heapify(heap)
        while heap:
            _, i, a, b, merged = heapq.heappop(heap)
            j = nxt[i]
            if not alive[i] or j >= n or sym[i] != a or sym[j] != b:
                continue  # stale
            sym[i] = merged
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            p, q = prv[i], nxt[i]
            if p >= 0 and (m := pairs[(sym[p], merged)]) is not None:
                heapq.heappush(heap, (m[0], p, sym[p], merged, m[1]))
            if q < n and (m := pairs[(merged, sym[q])]) is not None:
                heapq.heappush(heap, (m[0], i, merged, sym[q], m[1]))
        return tuple(sym[i] for i in range(n) if alive[i])

    def _sub_word(self, text: str) -> tuple[int, ...]:
        ids = self._cache.get(text)
        if ids is None:
            ids = self._bpe(text)
            if len(text) <= _CACHE_MAX_PIECE:
                if len(self._cache) >= _CACHE_MAX_ENTRIES:
                    self._cache.clear()
                self._cache[text] = ids
        return ids

    def _encode_word(self, word: str, out: list[int]) -> None:
        if self.ignore_merges:
            whole = self.token_to_id.get(word)
            if whole is not None:
                out.append(whole)
                return
        if self._word_cut is None or len(word) <= _CACHE_MAX_PIECE // 4:
            out.extend(self._sub_word(word))
            return
        for sub in self._word_cut.split(word):
            if sub:
                out.extend(self._sub_word(sub))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS: callers add it when :attr:`add_bos`); added tokens are matched."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        out: list[int] = []
        for segment, tid, offset in self._raw_splitter.split(text):
            if tid is not None:
                out.append(tid)
                continue
            normalized = self.normalizer(segment) if self.normalizer is not None else segment
            for sub, sub_id, sub_offset in self._norm_splitter.split(normalized, offset):
                if sub_id is not None:
                    out.append(sub_id)
                    continue
                for word in self.pre_tokenizer(sub, sub_offset == 0):
                    self._encode_word(word, out)
        return out

    # ------------------------------------------------------------------ decoding
    def _tokens(self, ids: Iterable[int], skip_special_tokens: bool) -> list[str]:
        ids = list(ids)
        try:
            tokens = [self._decode_pieces[i] for i in ids if not (skip_special_tokens and i in self._special_set)]
        except (KeyError, TypeError):
            bad = [i for i in ids if not isinstance(i, int) or i not in self.pieces]
            raise ValueError(f"token id(s) {bad[:5]} not in the vocabulary (0..{self.vocab_size - 1})") from None
        return tokens

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`, as HF ``tokenizers`` decodes them (invalid byte runs give one U+FFFD per byte)."""
        return self.decoder(self._tokens(ids, skip_special_tokens))

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = False) -> bytes:
        """The raw bytes of `ids` (byte tokens kept as bytes, so possibly incomplete UTF-8)."""
        return self.decoder(self._tokens(ids, skip_special_tokens), raw=True).encode("utf-8", "surrogateescape")

    # ------------------------------------------------------------------ state
    def to_state(self) -> dict[str, Any]:
        """A plain dict for :func:`scratchlm.tokenizer.tokenizer_to_state`."""
        return {
            "kind": "spm", "pieces": dict(self.pieces), "merges": self.merges, "scores": self.scores,
            "added_tokens": [t.to_hf() for t in self.added_tokens], "unk_id": self.unk_id,
            "byte_fallback": self.byte_fallback, "fuse_unk": self.fuse_unk, "ignore_merges": self.ignore_merges,
            "normalizer": self.normalizer.spec if self.normalizer else None,
            "pre_tokenizer": self.pre_tokenizer.spec, "decoder": self.decoder.spec, "bos_id": self.bos_id,
            "eos_id": self.eos_id, "add_bos": self.add_bos, "add_eos": self.add_eos,
            "chat_template": self.chat_template,
        }

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> SentencePieceBPE:
        merges, scores = d.get("merges"), d.get("scores")
        return cls(
            {int(i): p for i, p in d["pieces"].items()}, None if merges is None else [tuple(m) for m in merges],
            None if scores is None else {int(i): s for i, s in scores.items()},
            added_tokens=[AddedToken.from_hf(t) for t in d.get("added_tokens", [])],
            unk_id=d.get("unk_id"), byte_fallback=d.get("byte_fallback", True), fuse_unk=d.get("fuse_unk", True),
            ignore_merges=d.get("ignore_merges", False), normalizer=d.get("normalizer"),
            pre_tokenizer=d.get("pre_tokenizer"), decoder=d.get("decoder"), bos_id=d.get("bos_id"),
            eos_id=d.get("eos_id"), add_bos=d.get("add_bos", False), add_eos=d.get("add_eos", False),
            chat_template=d.get("chat_template"),
        )

    def hf_merges(self) -> list[tuple[str, str]]:
        """The merges list: as given, or (score mode) HF's converter's: every split of a token into two
        tokens, ordered by the token's score (descending), then id."""
        if self.merges is not None:
            return list(self.merges)
        special = set(self.special_ids.values())
        ranked = []
        for t, i in self.token_to_id.items():
            if i in special or byte_token_value(t) is not None:
                continue
            for k in range(1, len(t)):
                left, right = self.token_to_id.get(t[:k]), self.token_to_id.get(t[k:])
                if left is not None and right is not None:
                    ranked.append((-self.scores.get(i, 0.0), i, t[:k], t[k:]))
        return [(a, b) for _, _, a, b in sorted(ranked)]
