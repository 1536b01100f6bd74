"""Test corpora: byte-level token files (id = UTF-8 byte) cut from the shared TinyStories head, so the
trainer tests do not depend on a trained tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def write_token_file(path: Path, ids: np.ndarray, vocab_size: int | None = 256, n_bytes: int | None = None,
                     dtype: str = "uint16", **extra) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(ids).astype(dtype).tofile(path)
    meta = {"dtype": dtype, "count": int(len(ids)), **extra}
    if vocab_size is not None:
        meta["vocab_size"] = vocab_size
    if n_bytes is not None:
        meta["bytes"] = n_bytes
    path.with_name(path.name + ".json").write_text(json.dumps(meta))
    return path


def byte_corpus(data_dir: Path, out: Path, train_bytes: int = 60_000, val_bytes: int = 8_000) -> tuple[Path, Path]:
    text = (data_dir / "corpora/tinystories/tinystories_v1_train_head_cased.txt").read_bytes()
    train = np.frombuffer(text[:train_bytes], dtype=np.uint8)
    val = np.frombuffer(text[train_bytes:train_bytes + val_bytes], dtype=np.uint8)
    return (write_token_file(out / "train.bin", train, n_bytes=len(train)),
            write_token_file(out / "val.bin", val, n_bytes=len(val)))
