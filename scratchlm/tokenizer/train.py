"""Byte-level BPE training (GPT-2 / CS336 style).

1. **Pre-token counts**, in parallel and in bounded memory: each input file is cut into chunks of
   about `chunk_bytes` whose boundaries fall right before a special token (or, when there is none,
   between a letter and a space followed by a letter, where pre-tokenization cannot change); worker
   processes read their byte range, split on special tokens, pre-tokenize, and return a Counter of
   distinct pre-tokens. Only those counts (deduplicated) ever live in the parent.
2. **Merges**, incrementally: pair -> count and pair -> set of word indices; a merge touches only the
   words that contain its pair and pushes the pairs it creates onto a max-heap. Heap entries are never
   updated in place: a popped entry whose count is stale is re-pushed with the current count
   (counts of existing pairs only ever decrease). Ties go to the lexicographically greater pair of
   bytes, through a key that inverts byte order inside the heap tuple (compared in C).
"""

from __future__ import annotations

import heapq
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from tqdm import tqdm

from scratchlm.tokenizer.pretokenize import PreTokenizer, SpecialSplitter

log = logging.getLogger(__name__)

_SAFE_CUT = re.compile(rb"[A-Za-z](?= [A-Za-z])")  # cut after the letter: "...x| word"


# ---------------------------------------------------------------------------- chunking
def find_chunk_boundaries(path: Path, chunk_bytes: int, special_tokens: Sequence[str] = ()) -> list[int]:
    """Byte offsets [0, ..., size] that cut `path` into ~`chunk_bytes` pieces at places where splitting
    does not change the pre-tokens: right before a special token, else inside ``letter|space letter``."""
    size = path.stat().st_size
    specials = sorted({s.encode("utf-8") for s in special_tokens}, key=len, reverse=True)
    special_re = re.compile(b"|".join(re.escape(s) for s in specials)) if specials else None
    margin = max((len(s) for s in specials), default=0)
    window = 1 << 16
    bounds = [0]
    with open(path, "rb") as f:
        probe = chunk_bytes
        while probe < size:
            base = max(probe - margin, 0)
            f.seek(base)
            block = f.read(window + 2 * margin)
            cut = _find_cut(block, probe - base, special_re)
            if cut is None:  # nothing safe in this window: look further
                probe += window
                continue
            cut += base
            if cut >= size:
                break
            bounds.append(cut)
            probe = cut + chunk_bytes
    bounds.append(size)
    return bounds


def _find_cut(block: bytes, start: int, special_re: re.Pattern | None) -> int | None:
    """The first safe cut at or after `start` in `block` (offsets within the block)."""
    matches = list(special_re.finditer(block)) if special_re is not None else []
    for m in matches:
        if m.start() >= start:
            return m.start()
    m = _SAFE_CUT.search(block, start)
    if m is not None and not any(s.start() < m.end() < s.end() for s in matches):
        return m.end()
    return None


def _count_chunk(args: tuple[str, int, int, tuple[str, ...], tuple[str, ...]]) -> Counter:
    path, start, end, special_tokens, stages = args
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read(end - start).decode("utf-8", errors="replace")
    return count_pretokens(text, special_tokens, PreTokenizer(stages))


def count_pretokens(text: str, special_tokens: Sequence[str] = (), pretokenizer: PreTokenizer | None = None
                    ) -> Counter:
    """Distinct pre-tokens of `text` and their counts (special tokens split the text and are not counted)."""
    pre = pretokenizer or PreTokenizer()
    counts: Counter = Counter()
    for segment, special in SpecialSplitter(special_tokens).split(text):
        if not special:
            counts.update(pre.split(segment))
    return counts


def count_corpus(
    paths: Sequence[Path], special_tokens: Sequence[str], pretokenizer: PreTokenizer, num_workers: int,
    chunk_bytes: int, progress: bool = True,
) -> Counter:
    """Pre-token counts of all `paths`, chunked and counted in `num_workers` processes."""
    tasks = []
    for p in paths:
        bounds = find_chunk_boundaries(p, chunk_bytes, special_tokens)
        tasks += [(str(p), a, b, tuple(special_tokens), pretokenizer.stages) for a, b in zip(bounds, bounds[1:])]
    total: Counter = Counter()
    bar = tqdm(total=sum(t[2] - t[1] for t in tasks), unit="B", unit_scale=True, desc="pre-tokenize",
               disable=not progress)
    if num_workers <= 1 or len(tasks) == 1:
        for t in tasks:
            total.update(_count_chunk(t))
            bar.update(t[2] - t[1])
    else:
        with ProcessPoolExecutor(num_workers) as pool:
            # Bounded: at most 2 chunks per worker in flight.
            pending = []
            it = iter(tasks)
            for t in it:
                pending.append((t, pool.submit(_count_chunk, t)))
                if len(pending) >= 2 * num_workers:
                    t0, fut = pending.pop(0)
                    total.update(fut.result())
                    bar.update(t0[2] - t0[1])
            for t0, fut in pending:
                total.update(fut.result())
                bar.update(t0[2] - t0[1])
    bar.close()
    return total


# ---------------------------------------------------------------------------- merges
def _inverted(token: bytes) -> tuple[int, ...]:
    """A key whose ascending order is the *descending* lexicographic order of `token`."""
    return tuple(255 - b for b in token) + (256,)


def bpe_merges(
    word_counts: dict[tuple[int, ...], int] | Iterable[tuple[tuple[int, ...], int]],
    vocab: dict[int, bytes],
    num_merges: int,
    progress: bool = True,
) -> list[tuple[bytes, bytes]]:
    """Run `num_merges` merges over words (tuples of token ids) with counts; extends `vocab` in place."""
    items = word_counts.items() if isinstance(word_counts, dict) else word_counts
    words: list[list[int]] = []
    counts: list[int] = []
    pair_counts: dict[tuple[int, int], int] = {}
    where: dict[tuple[int, int], set[int]] = {}
    for w, c in items:
        if len(w) < 2:
            continue
        wi = len(words)
        words.append(list(w))
        counts.append(c)
        for p in zip(w, w[1:]):
            pair_counts[p] = pair_counts.get(p, 0) + c
            s = where.get(p)
            if s is None:
                where[p] = {wi}
            else:
                s.add(wi)
    inv = {i: _inverted(b) for i, b in vocab.items()}
    heap = [(-c, inv[a], inv[b], a, b) for (a, b), c in pair_counts.items()]
    heapq.heapify(heap)
    merges: list[tuple[bytes, bytes]] = []
    next_id = max(vocab) + 1
    bar = tqdm(total=num_merges, desc="merges", unit="merge", disable=not progress)
    while len(merges) < num_merges and heap:
        negc, _, _, a, b = heapq.heappop(heap)
        cur = pair_counts.get((a, b), 0)
        if cur != -negc:
            if cur > 0:
                heapq.heappush(heap, (-cur, inv[a], inv[b], a, b))
            continue
        new = next_id
        next_id += 1
        vocab[new] = vocab[a] + vocab[b]
        inv[new] = _inverted(vocab[new])
        merges.append((vocab[a], vocab[b]))
        bar.update(1)
        pair_counts.pop((a, b), None)
        delta: dict[tuple[int, int], int] = {}
        for wi in where.pop((a, b)):
            w = words[wi]
            if len(w) < 2:
                continue
            merged: list[int] = []
            i, n = 0, len(w)
            while i < n:
                if i < n - 1 and w[i] == a and w[i + 1] == b:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(w[i])
                    i += 1
            if len(merged) == n:
                continue  # a stale index entry: the word no longer has the pair
            c = counts[wi]
            # Only the neighbours of each new token change: (L, a) -> (L, new) and (b, R) -> (new, R);
            # between two new tokens the old pair was (b, a). (a, b) itself is gone from every word.
            last = len(merged) - 1
            for j, t in enumerate(merged):
                if t != new:
                    continue
                if j > 0:
                    left = merged[j - 1]
                    old = (b, a) if left == new else (left, a)
                    if old != (a, b):
                        delta[old] = delta.get(old, 0) - c
                    p = (left, new)
                    delta[p] = delta.get(p, 0) + c
                if j < last and merged[j + 1] != new:
                    right = merged[j + 1]
                    old = (b, right)
                    if old != (a, b):
                        delta[old] = delta.get(old, 0) - c
                    p = (new, right)
                    delta[p] = delta.get(p, 0) + c
                    s = where.get(p)
                    if s is None:
                        where[p] = {wi}
                    else:
                        s.add(wi)
                if j > 0:
                    p = (merged[j - 1], new)
                    s = where.get(p)
                    if s is None:
                        where[p] = {wi}
                    else:
                        s.add(wi)
            words[wi] = merged
        # Stale `where` entries (words that lost a pair) are skipped when that pair is merged.
        for p, d in delta.items():
            if d == 0:
                continue
            c = pair_counts.get(p, 0) + d
            if c > 0:
                pair_counts[p] = c
                if d > 0:
                    heapq.heappush(heap, (-c, inv[p[0]], inv[p[1]], p[0], p[1]))
            else:
                pair_counts.pop(p, None)
                where.pop(p, None)
    bar.close()
    return merges


def train_bpe(
    input_path: str | os.PathLike | Sequence[str | os.PathLike],
    vocab_size: int,
    special_tokens: Sequence[str] | None = None,
    *,
    pretokenizer: PreTokenizer | None = None,
    num_workers: int | None = None,
    chunk_bytes: int = 1 << 20,
    progress: bool = True,
) -> tuple[dict[int, bytes], list[tuple[bytes, bytes]]]:
    """Train a byte-level BPE on one or more text files.

    Returns ``(vocab, merges)``: `vocab` maps ids to bytes (0..255 the bytes, then the special tokens,
    then one token per merge); `merges` lists the merged pairs in order. Training stops early when no
    pair is left to merge.
    """
    paths = [Path(input_path)] if isinstance(input_path, str | os.PathLike) else [Path(p) for p in input_path]
    if not paths:
        raise ValueError("train_bpe needs at least one input file")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"training input not found: {p}")
    specials = list(dict.fromkeys(special_tokens or []))
    if any(not isinstance(s, str) or not s for s in specials):
        raise ValueError(f"special tokens must be non-empty strings, got {specials!r}")
    min_size = 256 + len(specials)
    if not isinstance(vocab_size, int) or vocab_size < min_size:
        raise ValueError(f"vocab_size must be an integer >= 256 + number of special tokens = {min_size}; "
                         f"got {vocab_size!r}")
    pre = pretokenizer or PreTokenizer()
    workers = num_workers or len(os.sched_getaffinity(0))
    total_bytes = sum(p.stat().st_size for p in paths)
    if total_bytes < chunk_bytes:
        workers = 1
    log.info("pre-tokenizing %d file(s), %.1f MB, with %d worker(s)", len(paths), total_bytes / 1e6, workers)
    t0 = time.perf_counter()
    counts = count_corpus(paths, specials, pre, workers, chunk_bytes, progress)
    t1 = time.perf_counter()
    log.info("%d distinct pre-tokens in %.1fs", len(counts), t1 - t0)

    vocab: dict[int, bytes] = {i: bytes([i]) for i in range(256)}
    for s in specials:
        vocab[len(vocab)] = s.encode("utf-8")
    word_counts = ((tuple(w.encode("utf-8")), c) for w, c in counts.items())
    merges = bpe_merges(word_counts, vocab, vocab_size - len(vocab), progress)
    log.info("%d merges in %.1fs", len(merges), time.perf_counter() - t1)
    if len(vocab) < vocab_size:
        log.warning("stopped at vocab size %d < %d: no pair left to merge", len(vocab), vocab_size)
    return vocab, merges
