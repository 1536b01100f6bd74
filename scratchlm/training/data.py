"""Token files and batches: memmap'd `.bin` files from `scratchlm tokenizer encode`, random windows.

A token file is a flat array of ids (``NAME.bin``) plus a JSON sidecar (``NAME.bin.json``) with at
least ``{"dtype": "uint16" | "uint32", "count": N}``, and ideally ``"vocab_size"`` and ``"bytes"``
(UTF-8 bytes of the source text, for bits per byte). The file is memory-mapped, never read whole.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

_DTYPES = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32, "uint8": np.uint8}


class TokenFileError(ValueError):
    """A token file or its sidecar is missing, empty or inconsistent."""


@dataclass
class TokenFile:
    """A memory-mapped token file with the metadata of its sidecar."""

    path: Path
    tokens: np.ndarray  # (count,) memmap
    meta: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> TokenFile:
        """Open ``path`` (the ``.bin``) and its ``.bin.json`` sidecar; clear errors on bad input."""
        path = Path(path)
        if not path.is_file():
            raise TokenFileError(f"token file not found: {path} (make one with `scratchlm tokenizer encode`)")
        sidecar = path.with_name(path.name + ".json")
        if not sidecar.is_file():
            raise TokenFileError(
                f"{path}: sidecar {sidecar.name} not found; it holds the dtype and count "
                "(written by `scratchlm tokenizer encode`)"
            )
        try:
            meta = json.loads(sidecar.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenFileError(f"{sidecar}: not valid JSON ({e})") from e
        if not isinstance(meta, dict) or "dtype" not in meta:
            raise TokenFileError(f"{sidecar}: expected a JSON object with a 'dtype' key, got {meta!r:.200}")
        dtype_name = meta["dtype"]
        if dtype_name not in _DTYPES:
            raise TokenFileError(f"{sidecar}: dtype {dtype_name!r} is not one of {sorted(_DTYPES)}")
        dtype = np.dtype(_DTYPES[dtype_name])
        size = path.stat().st_size
        if size == 0:
            raise TokenFileError(f"{path}: the corpus is empty (0 tokens); encode a non-empty text file")
        if size % dtype.itemsize:
            raise TokenFileError(f"{path}: size {size} bytes is not a multiple of {dtype_name} ({dtype.itemsize} B)")
        count = size // dtype.itemsize
        if "count" in meta and int(meta["count"]) != count:
            raise TokenFileError(f"{path}: sidecar says {meta['count']} tokens but the file holds {count}")
        tokens = np.memmap(path, dtype=dtype, mode="r", shape=(count,))
        return cls(path=path, tokens=tokens, meta=meta)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def vocab_size(self) -> int | None:
        v = self.meta.get("vocab_size")
        return int(v) if v is not None else None

    @property
    def bytes_per_token(self) -> float | None:
        """UTF-8 bytes of source text per token (from the sidecar), for bits per byte; None if unknown."""
        b = self.meta.get("bytes")
        return float(b) / len(self) if b else None

    def check_fits(self, context_length: int) -> None:
        if len(self) < context_length + 1:
            raise TokenFileError(
                f"{self.path}: only {len(self)} tokens, fewer than context_length + 1 = {context_length + 1}; "
                "use a longer corpus or a shorter context"
            )


def windows_to_batch(
    tokens: np.ndarray, starts: np.ndarray, context_length: int, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets for windows starting at `starts`: two (B, T) int64 tensors."""
    offsets = np.arange(context_length + 1)
    rows = np.asarray(tokens[starts[:, None] + offsets[None, :]], dtype=np.int64)  # (B, T+1)
    batch = torch.from_numpy(rows)
    x, y = batch[:, :-1], batch[:, 1:]
    if torch.device(device).type == "cuda":
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.contiguous().to(device), y.contiguous().to(device)


def get_batch(
    data: np.ndarray, batch_size: int, context_length: int, device: str | torch.device,
    rng: np.random.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch_size` random windows of `context_length` tokens from `data` (CS336 `get_batch`).

    Returns (x, y), both (batch_size, context_length) int64 on `device`, with y = x shifted by one.
    """
    if len(data) < context_length + 1:
        raise ValueError(f"get_batch: data has {len(data)} tokens, need at least context_length + 1 = "
                         f"{context_length + 1}")
    rng = rng if rng is not None else np.random.default_rng()
    starts = rng.integers(0, len(data) - context_length, size=batch_size)
    return windows_to_batch(data, starts, context_length, device)


class RandomWindowSampler:
    """Deterministic random windows over a token file, with a saveable state.

    Every call to :meth:`next_starts` draws the start offsets of one *global* batch from one seeded
    generator; data-parallel ranks all draw the same global batch and each takes its own slice, so
    a run on N processes sees exactly the windows of a single-process run.
    """

    def __init__(self, tokens: np.ndarray, context_length: int, seed: int):
        self.tokens = tokens
        self.context_length = context_length
        self.rng = np.random.default_rng(seed)

    def next_starts(self, batch_size: int) -> np.ndarray:
        return self.rng.integers(0, len(self.tokens) - self.context_length, size=batch_size)

    def state_dict(self) -> dict:
        return {"bit_generator": self.rng.bit_generator.state, "context_length": self.context_length,
                "num_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_tokens") != len(self.tokens) or state.get("context_length") != self.context_length:
            raise ValueError(
                f"data-loader state is for {state.get('num_tokens')} tokens / context {state.get('context_length')}, "
                f"but the training file has {len(self.tokens)} tokens / context {self.context_length}: "
                "resume with the same corpus and context length"
            )
        self.rng.bit_generator.state = state["bit_generator"]


def sequential_windows(num_tokens: int, context_length: int, max_windows: int | None = None) -> np.ndarray:
    """Start offsets of windows that tile a file: window i covers tokens [i*T, i*T + T] (T+1 tokens),
    so every token after the first is predicted exactly once."""
    n = (num_tokens - 1) // context_length
    if max_windows is not None:
        n = min(n, max_windows)
    return np.arange(n, dtype=np.int64) * context_length
