"""The byte-level BPE tokenizer: encode, decode, encode_iterable.

Encoding = split on special tokens (longest first) -> normalize (optional, e.g. Qwen2's NFC) -> pre-tokenize
(regex stages) -> byte-level BPE inside each pre-token, merges applied in rank order. Pre-token results are
cached in a dict whose ``__missing__`` runs BPE, so the hot loop (`map(cache.__getitem__, pieces)`) runs in C
for every pre-token seen before: that is where the speed comes from.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from itertools import chain, repeat
from pathlib import Path

from scratchlm.tokenizer.normalize import Normalizer
from scratchlm.tokenizer.pretokenize import PreTokenizer, SpecialSplitter

# Pre-token strings longer than this skip the cache (runs of whitespace, base64 blobs, ...).
_CACHE_MAX_PIECE = 64
_CACHE_MAX_ENTRIES = 1 << 20
# Above this many symbols, BPE uses a heap instead of repeated linear scans.
_HEAP_THRESHOLD = 48
_NO_RANK = 1 << 62


class _PieceCache(dict):
    """pre-token str -> tuple of ids; a miss runs BPE and remembers the result (bounded)."""

    __slots__ = ("_encode_piece",)

    def __init__(self, encode_piece):
        super().__init__()
        self._encode_piece = encode_piece

    def __missing__(self, piece: str) -> tuple[int, ...]:
        ids = self._encode_piece(piece)
        if len(piece) <= _CACHE_MAX_PIECE:
            if len(self) >= _CACHE_MAX_ENTRIES:
                self.clear()
            self[piece] = ids
        return ids


class Tokenizer:
    """Byte-level BPE tokenizer.

    Args:
        vocab: id -> token bytes. Must contain every single byte (byte-level BPE).
        merges: (left, right) byte pairs in rank order (first = applied first).
        special_tokens: strings matched in the text before pre-tokenization, longest first. Each gets
            the id of its bytes in `vocab`, or a new id after the last one when absent.
        pretokenizer: the regex stages (default GPT-2).
        bos_id, eos_id, chat_template, add_bos: metadata used by the model and inference layers.
        ignore_merges: a pre-token that is itself a vocabulary entry is emitted whole (HF
            ``ignore_merges``, used by Llama-3).
        normalizer: applied to the text between special tokens before pre-tokenization (HF
            ``normalizer``; Qwen2's NFC).
    """

    def __init__(
        self,
        vocab: dict[int, bytes],
        merges: list[tuple[bytes, bytes]],
        special_tokens: list[str] | None = None,
        *,
        pretokenizer: PreTokenizer | None = None,
        bos_id: int | None = None,
        eos_id: int | None = None,
        chat_template: str | None = None,
        add_bos: bool = False,
        ignore_merges: bool = False,
        normalizer: Normalizer | None = None,
    ):
        self.vocab: dict[int, bytes] = {int(i): bytes(b) for i, b in vocab.items()}
        self.merges: list[tuple[bytes, bytes]] = [(bytes(a), bytes(b)) for a, b in merges]
        self.pretokenizer = pretokenizer or PreTokenizer()
        self.bos_id, self.eos_id = bos_id, eos_id
        self.chat_template = chat_template
        self.add_bos = bool(add_bos)
        self.ignore_merges = bool(ignore_merges)
        self.normalizer = normalizer

        self.token_to_id: dict[bytes, int] = {}
        for i in sorted(self.vocab):  # on duplicate bytes, the lowest id wins
            self.token_to_id.setdefault(self.vocab[i], i)
        # Byte-level BPE has all 256 bytes; some published vocabularies (SmolLM2) lack a few never-seen
        # ones. Such a byte is dropped when encoding, as HF tokenizers does without an unk token.
        self.missing_bytes = [b for b in range(256) if bytes([b]) not in self.token_to_id]

        self.special_tokens: list[str] = list(dict.fromkeys(special_tokens or []))
        self.special_ids: dict[str, int] = {}
        next_id = max(self.vocab, default=-1) + 1
        for s in self.special_tokens:
            b = s.encode("utf-8")
            if b not in self.token_to_id:
                self.vocab[next_id] = b
                self.token_to_id[b] = next_id
                next_id += 1
            self.special_ids[s] = self.token_to_id[b]
        self.splitter = SpecialSplitter(self.special_tokens)

        # (left id, right id) -> (rank, merged id)
        self.merge_ranks: dict[tuple[int, int], tuple[int, int]] = {}
        for rank, (a, b) in enumerate(self.merges):
            try:
                key = (self.token_to_id[a], self.token_to_id[b])
                merged = self.token_to_id[a + b]
            except KeyError as e:
                raise ValueError(f"merge #{rank} {a!r} + {b!r}: token {e.args[0]!r} is not in the vocab") from None
            self.merge_ranks.setdefault(key, (rank, merged))
        self.pair_code = {pair: r << 32 | m for pair, (r, m) in self.merge_ranks.items()}
        self._byte_ids = [self.token_to_id.get(bytes([b])) for b in range(256)]
        self._id_to_bytes = self.vocab  # alias used by decode
        self._cache = _PieceCache(self._encode_piece)

    # ------------------------------------------------------------------ metadata
    @property
    def vocab_size(self) -> int:
        """One past the largest id (ids are 0..vocab_size-1)."""
        return max(self.vocab) + 1

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, merges={len(self.merges)}, "
                f"special_tokens={self.special_tokens[:4]}{'...' if len(self.special_tokens) > 4 else ''})")

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_files(
        cls, vocab_filepath: str | Path, merges_filepath: str | Path, special_tokens: list[str] | None = None
    ) -> Tokenizer:
        """Load CS336 / GPT-2 style files: ``vocab.json`` (token string -> id, GPT-2 byte-to-unicode
        strings) and ``merges.txt`` (one ``left right`` pair per line)."""
        from scratchlm.tokenizer.formats import read_vocab_merges

        vocab, merges = read_vocab_merges(vocab_filepath, merges_filepath)
        return cls(vocab, merges, special_tokens)

    # ------------------------------------------------------------------ encoding
    def _encode_piece(self, piece: str) -> tuple[int, ...]:
        """BPE of one pre-token."""
        data = piece.encode("utf-8")
        if self.ignore_merges:
            whole = self.token_to_id.get(data)
            if whole is not None:
                return (whole,)
        byte_ids = self._byte_ids
        ids = [byte_ids[b] for b in data]
        if self.missing_bytes and None in ids:
            ids = [i for i in ids if i is not None]
        if len(ids) < 2:
            return tuple(ids)
        if len(ids) > _HEAP_THRESHOLD:
            return tuple(self._bpe_heap(ids))
        # Short pre-token: code every adjacent pair as rank << 32 | merged id (C-level map/min), merge the
        # lowest rank, repeat.
        code_get, inf = self.pair_code.get, _NO_RANK
        while True:
            codes = list(map(code_get, zip(ids, ids[1:]), repeat(inf)))
            best = min(codes)
            if best == inf:
                return tuple(ids)
            i = codes.index(best)
            merged = best & 0xFFFFFFFF
            if codes.count(best) == 1:
                ids[i : i + 2] = [merged]
            else:  # the same pair several times: merge left to right, without overlaps
                a, b = ids[i], ids[i + 1]
                out = ids[:i]
                n = len(ids)
                while i < n:
                    if i < n - 1 and ids[i] == a and ids[i + 1] == b:
                        out.append(merged)
                        i += 2
                    else:
                        out.append(ids[i])
                        i += 1
                ids = out
            if len(ids) < 2:
                return tuple(ids)

    def _bpe_heap(self, ids: list[int]) -> list[int]:
        """BPE on a long symbol list: doubly linked list + heap of (rank, position), lazy deletion.
        Same result as the linear version: equal ranks merge left to right."""
        ranks = self.merge_ranks
        n = len(ids)
        sym = list(ids)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = []
        for i in range(n - 1):
            r = ranks.get((sym[i], sym[i + 1]))
            if r is not None:
                heap.append((r[0], i, sym[i], sym[i + 1]))
        heapq.heapify(heap)
        while heap:
            rank, i, a, b = heapq.heappop(heap)
            j = nxt[i] if alive[i] else n
            if j >= n or sym[i] != a or sym[j] != b:
                continue  # stale
            sym[i] = ranks[(a, b)][1]
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            p = prv[i]
            if p >= 0:
                r = ranks.get((sym[p], sym[i]))
                if r is not None:
                    heapq.heappush(heap, (r[0], p, sym[p], sym[i]))
            q = nxt[i]
            if q < n:
                r = ranks.get((sym[i], sym[q]))
                if r is not None:
                    heapq.heappush(heap, (r[0], i, sym[i], sym[q]))
        return [sym[i] for i in range(n) if alive[i]]

    def encode_ordinary(self, text: str) -> list[int]:
        """Encode text with no special-token handling (special strings become ordinary bytes)."""
        if self.normalizer is not None:
            text = self.normalizer(text)
        return list(chain.from_iterable(map(self._cache.__getitem__, self.pretokenizer.split(text))))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens in the text are matched longest first."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        if self.splitter.pattern is None:
            return self.encode_ordinary(text)
        out: list[int] = []
        special_ids = self.special_ids
        for segment, special in self.splitter.split(text):
            if special:
                out.append(special_ids[segment])
            else:
                out.extend(self.encode_ordinary(segment))
        return out

    def encode_iterable(self, iterable: Iterable[str], min_chunk_chars: int = 1 << 16) -> Iterator[int]:
        """Lazily encode a stream of strings (e.g. an open text file) in bounded memory.

        Text is buffered until at least `min_chunk_chars`, then encoded up to a *stable* cut: before
        any suffix that could still become a longer special token, and before the last pre-tokens
        (the trailing whitespace run plus a few characters), whose split could change with more text.
        The result equals ``encode("".join(iterable))``.
        """
        buf = ""
        for chunk in iterable:
            buf += chunk
            if len(buf) < min_chunk_chars:
                continue
            cut = self._stable_cut(buf)
            if cut > 0:
                yield from self.encode(buf[:cut])
                buf = buf[cut:]
        if buf:
            yield from self.encode(buf)

    def _stable_cut(self, buf: str) -> int:
        """A position p such that encode(buf[:p]) is a prefix of encode(buf + any continuation)."""
        n = len(buf)
        horizon = n - self.splitter.max_len  # a special match starting after this may still grow
        start, end = 0, n  # the ordinary text after the last stable special match
        if self.splitter.pattern is not None:
            for m in self.splitter.pattern.finditer(buf):
                if m.start() > horizon:
                    end = m.start()
                    break
                start = m.end()
        segment = buf[start:end]
        # The trailing whitespace run and 4 characters before it may still re-split with more text,
        # and a cut right after whitespace would turn that whitespace into a trailing run (which
        # `\s+(?!\S)` splits differently): cut only after a pre-token ending in non-whitespace.
        limit = min(len(segment.rstrip()) - 4, horizon - start)
        norm = self.normalizer
        if norm is not None and not norm.unicode_only:
            return start  # cut only after a special token
        cut, pos = 0, 0
        for piece in self.pretokenizer.split(segment):
            pos += len(piece)
            if pos > limit:
                break
            # With NFC & co., cut only between ASCII pieces: NFC(a + b) == NFC(a) + NFC(b) then.
            if not piece[-1].isspace() and (norm is None or (piece.isascii() and segment[pos].isascii())):
                cut = pos
        return start + cut

    # ------------------------------------------------------------------ decoding
    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """The raw bytes of `ids` (may be incomplete UTF-8)."""
        if not isinstance(ids, list | tuple):
            ids = list(ids)
        try:
            return b"".join(map(self._id_to_bytes.__getitem__, ids))
        except (KeyError, TypeError):
            bad = [i for i in ids if not isinstance(i, int) or i not in self._id_to_bytes]
            raise ValueError(f"token id(s) {bad[:5]} not in the vocabulary (0..{self.vocab_size - 1})") from None

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD (never raises for valid ids)."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> bytes:
        return self.vocab[i]
