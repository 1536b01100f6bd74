"""llama2.c's SentencePiece-style tokenizer (``tok512.bin`` / ``tokenizer.bin``).

File: int32 max_token_length, then per token: float32 score, int32 length, the piece's bytes.
Pieces ``<0xNN>`` stand for raw bytes (byte fallback); id 0 is ``<unk>``, 1 BOS, 2 EOS.
Encoding follows llama2.c's ``encode()``: a dummy-prefix space, one piece per UTF-8 character (or its
bytes as ``<0xNN>`` when the character is not a piece), then repeatedly merge the adjacent pair whose
concatenation is the piece with the highest score (the leftmost on ties).
"""

from __future__ import annotations

import heapq
import re
import struct
from collections.abc import Iterable
from pathlib import Path

_BYTE_PIECE = re.compile(rb"<0x([0-9A-Fa-f]{2})>")


class Llama2cTokenizer:
    """The tokenizer of llama2.c models (e.g. ``stories260K`` with ``tok512.bin``)."""

    bos_id: int = 1
    eos_id: int = 2
    chat_template: str | None = None
    add_bos: bool = True

    def __init__(self, pieces: list[bytes], scores: list[float]):
        if len(pieces) != len(scores):
            raise ValueError(f"{len(pieces)} pieces but {len(scores)} scores")
        if len(pieces) < 3 + 256:
            raise ValueError(f"a llama2.c vocabulary needs <unk>, BOS, EOS and 256 byte pieces; got {len(pieces)}")
        self.pieces = [bytes(p) for p in pieces]
        self.scores = [float(s) for s in scores]
        self.piece_to_id: dict[bytes, int] = {}
        for i, p in enumerate(self.pieces):
            self.piece_to_id.setdefault(p, i)
        # The bytes each id decodes to: <0xNN> -> that byte.
        self._bytes = []
        for p in self.pieces:
            m = _BYTE_PIECE.fullmatch(p)
            self._bytes.append(bytes([int(m.group(1), 16)]) if m else p)
        self._byte_fallback = [self.piece_to_id.get(b"<0x%02X>" % b) for b in range(256)]
        if None in self._byte_fallback:
            raise ValueError("the vocabulary lacks some <0xNN> byte pieces")

    @classmethod
    def from_file(cls, path: str | Path) -> Llama2cTokenizer:
        """Read a llama2.c tokenizer file (``tok512.bin``, ``tokenizer.bin``)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"llama2.c tokenizer file not found: {path}")
        data = path.read_bytes()
        if len(data) < 4:
            raise ValueError(f"{path}: too short for a llama2.c tokenizer (needs an int32 max_token_length)")
        pieces, scores, off = [], [], 4
        while off < len(data):
            if off + 8 > len(data):
                raise ValueError(f"{path}: truncated entry header at byte {off}")
            score, n = struct.unpack_from("<fi", data, off)
            off += 8
            if n < 0 or off + n > len(data):
                raise ValueError(f"{path}: bad piece length {n} at byte {off - 4}")
            pieces.append(data[off : off + n])
            scores.append(score)
            off += n
        return cls(pieces, scores)

    @property
    def vocab_size(self) -> int:
        return len(self.pieces)

    def __repr__(self) -> str:
        return f"Llama2cTokenizer(vocab_size={self.vocab_size})"

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        """llama2.c's ``encode(text, bos, eos)``: dummy-prefix space, characters, score-ordered merges."""
        if not isinstance(text, str):
            raise TypeError(f"encode expects str, got {type(text).__name__}")
        ids: list[int] = [self.bos_id] if bos else []
        body: list[int] = []
        if text:
            body.append(self.piece_to_id[b" "])
        for ch in text:
            b = ch.encode("utf-8")
            i = self.piece_to_id.get(b)
            if i is not None:
                body.append(i)
            else:
                body.extend(self._byte_fallback[x] for x in b)
        ids += self._merge(body)
        if eos:
            ids.append(self.eos_id)
        return ids

    def _merge(self, ids: list[int]) -> list[int]:
        """Merge the best-scoring pair, leftmost on ties, until none applies (heap + linked list)."""
        n = len(ids)
        if n < 2:
            return ids
        pieces, scores, lookup = self.pieces, self.scores, self.piece_to_id
        sym = list(ids)
        nxt = list(range(1, n + 1))
        prv = list(range(-1, n - 1))
        alive = [True] * n
        heap = []

        def push(i: int, j: int) -> None:
            merged = lookup.get(pieces[sym[i]] + pieces[sym[j]])
            if merged is not None:
                heapq.heappush(heap, (-scores[merged], i, sym[i], sym[j], merged))

        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, i, a, b, merged = heapq.heappop(heap)
            if not alive[i]:
                continue
            j = nxt[i]
            if j >= n or sym[i] != a or sym[j] != b:
                continue
            sym[i] = merged
            alive[j] = False
            nxt[i] = nxt[j]
            if nxt[j] < n:
                prv[nxt[j]] = i
            if prv[i] >= 0:
                push(prv[i], i)
            if nxt[i] < n:
                push(i, nxt[i])
        return [sym[i] for i in range(n) if alive[i]]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Bytes of `ids` as llama2.c prints them: <unk>/BOS/EOS give nothing, a piece right after BOS
        loses its leading space, ``<0xNN>`` is the raw byte."""
        out = []
        prev = None
        for i in ids:
            if not isinstance(i, int) or not 0 <= i < len(self.pieces):
                raise ValueError(f"token id {i!r} not in the vocabulary (0..{len(self.pieces) - 1})")
            if i > 2:
                b = self._bytes[i]
                if prev == self.bos_id and b.startswith(b" "):
                    b = b[1:]
                out.append(b)
            prev = i
        return b"".join(out)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`; invalid UTF-8 becomes U+FFFD."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")
