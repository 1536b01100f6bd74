"""MNIST for the case study: the 10k test images split 8k train / 2k held out, and the prompts.

The IDX files are read directly (gzip); images become float tensors in [-1, 1], (N, 1, 28, 28).
The split is fixed (the first 8,000 / the last 2,000), so every run and test sees the same sets.
"""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
TEMPLATES = ["a handwritten {w}", "the digit {d}", "a handwritten {d}", "the number {w}", "digit {w}",
             "an image of a {w}", "{w}", "{d}", "a drawing of the digit {w}", "number {d}"]
N_TRAIN = 8000


def _read_idx(path: Path, magic: int) -> np.ndarray:
    if not path.is_file():
        raise FileNotFoundError(f"MNIST file {path} not found (expected the t10k IDX files from data/images/mnist)")
    with gzip.open(path, "rb") as f:
        raw = f.read()
    got = int.from_bytes(raw[:4], "big")
    if got != magic:
        raise ValueError(f"{path}: IDX magic {got}, expected {magic}")
    n = int.from_bytes(raw[4:8], "big")
    if magic == 2051:
        rows, cols = int.from_bytes(raw[8:12], "big"), int.from_bytes(raw[12:16], "big")
        return np.frombuffer(raw, dtype=np.uint8, offset=16).reshape(n, rows, cols)
    return np.frombuffer(raw, dtype=np.uint8, offset=8)


def load_mnist(root: str | Path, split: str = "train") -> tuple[Tensor, Tensor]:
    """(images (N, 1, 28, 28) float in [-1, 1], labels (N,) long) for split 'train' (8k), 'heldout' (2k), 'all'."""
    root = Path(root)
    x = _read_idx(root / "t10k-images-idx3-ubyte.gz", 2051)
    y = _read_idx(root / "t10k-labels-idx1-ubyte.gz", 2049)
    sl = {"train": slice(0, N_TRAIN), "heldout": slice(N_TRAIN, None), "all": slice(None)}
    if split not in sl:
        raise ValueError(f"split must be one of {sorted(sl)}, got {split!r}")
    imgs = torch.from_numpy(x[sl[split]].copy()).float().div_(127.5).sub_(1.0).unsqueeze(1)
    return imgs, torch.from_numpy(y[sl[split]].astype(np.int64))


def prompt_for(label: int, rng: random.Random | None = None) -> str:
    t = (rng or random).choice(TEMPLATES)
    return t.format(w=WORDS[label], d=label)


def canonical_prompt(label: int) -> str:
    return f"a handwritten {WORDS[label]}"


def prompt_corpus() -> list[str]:
    return [t.format(w=WORDS[i], d=i) for i in range(10) for t in TEMPLATES]


def label_of_prompt(prompt: str) -> int | None:
    """The digit a prompt asks for ("a handwritten seven", "the digit 7"), or None."""
    p = prompt.lower()
    for i, w in enumerate(WORDS):
        if w in p.split() or str(i) in p.split():
            return i
    return None
