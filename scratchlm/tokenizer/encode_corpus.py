"""Parallel corpus encoder: text files -> one flat ``.bin`` of token ids + a ``.bin.json`` sidecar.

The files are cut into blocks of ~`block_bytes` at places where cutting does not change the tokens
(before a special token, else between a letter and `` letter``; see `train.find_chunk_boundaries`),
so the output equals ``tok.encode(whole_file)`` for each file, concatenated in order. Worker processes
read their own byte range and return a numpy array; the parent writes them in order to a temporary
file, then renames it (atomic). At most two blocks per worker are in flight (bounded memory).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from scratchlm import atomic
from scratchlm.tokenizer.bpe import Tokenizer
from scratchlm.tokenizer.train import find_chunk_boundaries

log = logging.getLogger(__name__)

_worker_tokenizer: Tokenizer | None = None  # one per worker process, set by the pool initializer


def _init_worker(tok_or_state: Tokenizer | dict[str, Any]) -> None:
    """Forked workers inherit the parent's Tokenizer as is (nothing pickled or rebuilt); spawned ones
    rebuild it from its state dict."""
    global _worker_tokenizer
    from scratchlm.tokenizer import tokenizer_from_state

    _worker_tokenizer = tok_or_state if isinstance(tok_or_state, Tokenizer) else tokenizer_from_state(tok_or_state)


def _encode_range(path: str, start: int, end: int, dtype: str) -> np.ndarray:
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read(end - start).decode("utf-8", errors="replace")
    return np.array(_worker_tokenizer.encode(text), dtype=dtype)


def token_dtype(vocab_size: int) -> str:
    """uint16 when every id fits, else uint32."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def encode_corpus(
    tok: Tokenizer,
    inputs: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    num_workers: int | None = None,
    block_bytes: int = 1 << 20,
    tokenizer_name: str = "",
    progress: bool = True,
) -> dict[str, Any]:
    """Encode `inputs` (in order) into `out` (flat ids) and ``out + '.json'`` (the sidecar); returns the sidecar.

    Sidecar: ``{"dtype", "count", "vocab_size", "tokenizer", "source", "bytes"}`` where `bytes` is the
    UTF-8 size of the source text (for bits per byte).
    """
    from scratchlm.tokenizer import tokenizer_to_state

    if not isinstance(tok, Tokenizer):
        raise TypeError(f"encode_corpus needs a byte-level BPE Tokenizer, got {type(tok).__name__}")
    paths = [Path(p) for p in inputs]
    if not paths:
        raise ValueError("encode_corpus needs at least one input file")
    for p in paths:
        if not p.is_file():
            raise FileNotFoundError(f"input text file not found: {p}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tok.vocab_size)
    tasks = []
    for p in paths:
        bounds = find_chunk_boundaries(p, block_bytes, tok.special_tokens)
        tasks += [(str(p), a, b, dtype) for a, b in zip(bounds, bounds[1:]) if b > a]
    total_bytes = sum(p.stat().st_size for p in paths)
    workers = max(1, min(num_workers or len(os.sched_getaffinity(0)), len(tasks)))
    log.info("encoding %d file(s), %.1f MB, in %d block(s) with %d worker(s)", len(paths), total_bytes / 1e6,
             len(tasks), workers)

    count = 0
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="encode", disable=not progress)
    try:
        with atomic.atomic_write(out, "wb") as f:  # usual permissions (umask), the whole file or none
            if workers == 1:
                _init_worker(tok)
                for t in tasks:
                    ids = _encode_range(*t)
                    ids.tofile(f)
                    count += len(ids)
                    bar.update(t[2] - t[1])
            else:
                fork = "fork" in mp.get_all_start_methods()
                ctx = mp.get_context("fork" if fork else "spawn")
                with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                                         initargs=(tok if fork else tokenizer_to_state(tok),)) as pool:
                    pending: deque = deque()
                    for t in tasks:
                        pending.append((t, pool.submit(_encode_range, *t)))
                        if len(pending) >= 2 * workers:
                            count += _drain(pending.popleft(), f, bar)
                    while pending:
                        count += _drain(pending.popleft(), f, bar)
    finally:
        bar.close()
    sidecar = {
        "dtype": dtype,
        "count": count,
        "vocab_size": tok.vocab_size,
        # absolute, so that training from another folder finds it (a name that is not a path stays as given)
        "tokenizer": str(Path(tokenizer_name).resolve()) if tokenizer_name and Path(tokenizer_name).exists()
        else tokenizer_name,
        "source": [str(p) for p in paths],
        "bytes": total_bytes,
    }
    side = Path(str(out) + ".json")
    atomic.write_text(side, json.dumps(sidecar, indent=2))
    log.info("wrote %d tokens (%s) to %s (%.2f bytes/token)", count, dtype, out, total_bytes / max(count, 1))
    return sidecar


def _drain(item, f, bar) -> int:
    task, fut = item
    ids = fut.result()
    ids.tofile(f)
    bar.update(task[2] - task[1])
    return len(ids)


def read_token_file(path: str | os.PathLike) -> np.ndarray:
    """Memory-map a ``.bin`` written by :func:`encode_corpus`, using its sidecar for dtype and count."""
    path = Path(path)
    side = Path(str(path) + ".json")
    if not side.is_file():
        raise FileNotFoundError(f"sidecar {side} not found (written by `scratchlm tokenizer encode`)")
    meta = json.loads(side.read_text(encoding="utf-8"))
    if meta.get("dtype") not in ("uint16", "uint32"):
        raise ValueError(f"{side}: dtype {meta.get('dtype')!r}, expected uint16 or uint32")
    arr = np.memmap(path, dtype=meta["dtype"], mode="r")
    if len(arr) != meta["count"]:
        raise ValueError(f"{path}: {len(arr)} tokens on disk but the sidecar says {meta['count']}")
    return arr
