"""Checkpoints: atomic writes with per-tensor checksums, clear errors on corrupt files, CS336
`save_checkpoint`/`load_checkpoint`.

A training checkpoint is one ``torch.save`` dict in the scratchlm checkpoint format of
docs/contracts.md, so that ``scratchlm.model.load(path)`` and ``scratchlm generate --model PATH`` read
it directly::

    {"format": "scratchlm", "version": 2,
     "model_config": dict, "model": state_dict, "tokenizer": dict | None,     # what the model loader reads
     "optimizer": state_dict, "step": int, "rng": {...}, "data": {...},       # what resume reads
     "train_config": dict,
     "checksums": {"algorithm": "crc32", "tensors": {path: crc}, "structure": crc}}

What is guaranteed (the policy lives in `scratchlm.model.loading.checkpoint`; docs/training.md):

- **no code runs** when a checkpoint is opened: it is read ``weights_only=True``, and a file that needs any Python
  object beyond tensors and plain data is refused naming the file;
- **a corrupt checkpoint is refused on resume**: every tensor (model, optimizer state, RNG states) is checked
  against the crc32 written with it, and everything else (step, data position, keys, shapes) against one more,
  so a flipped bit or a NaN written into a tensor fails naming the tensor and the file; a checkpoint from before
  checksums (version 1) resumes with a warning that it is unverified;
- **a write never destroys the previous checkpoint**: a crash, a ``kill -9`` or a full disk mid-write leaves the
  old file intact (temp file + rename, `scratchlm.atomic`); a full disk raises
  :class:`scratchlm.atomic.DiskFullError` naming the file and saying the disk is full, and the temp file is
  removed (after a ``kill -9`` the trainer removes it on its next start).
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import IO, Any

import torch

from scratchlm.model.loading.checkpoint import (
    FORMAT,
    VERSION,
    compute_checksums,
    load_torch_file,
    save_torch_checkpoint,
    verify_checksums,
)
from scratchlm.model.loading.common import CheckpointError

__all__ = ["FORMAT", "VERSION", "CheckpointError", "atomic_torch_save", "capture_rng_state", "load_checkpoint",
           "read_checkpoint", "restore_rng_state", "save_checkpoint"]


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to a temp file in the same folder, fsync, ``os.replace``, fsync the folder
    (`scratchlm.atomic`): a reader never sees a half-written checkpoint, even if the process dies
    mid-write; an interrupted write leaves only ``<name>.<random>.tmp``, which the trainer removes
    on its next start. A dict gets its ``"checksums"`` entry (and ``version`` 2). A full disk raises
    :class:`scratchlm.atomic.DiskFullError` naming `path`; the previous file stays and the temp file is removed."""
    if isinstance(obj, dict):
        return save_torch_checkpoint(obj, path)
    from scratchlm.atomic import atomic_write

    path = Path(path)
    with atomic_write(path, "wb") as f:
        torch.save(obj, f)
    return path


def read_checkpoint(src: str | Path | IO[bytes], map_location: str | torch.device = "cpu",
                    require: tuple[str, ...] = ("model",)) -> dict[str, Any]:
    """Load a checkpoint dict safely (weights-only) and verify its checksums; raise :class:`CheckpointError`
    naming the file and the problem (a refused object, a corrupt file, a tensor that fails its checksum)."""
    name = str(src) if isinstance(src, str | Path) else getattr(src, "name", "<file object>")
    if isinstance(src, str | Path):
        path = Path(src)
        if not path.is_file():
            raise CheckpointError(f"checkpoint not found: {path}")
        if path.stat().st_size == 0:
            raise CheckpointError(f"{path}: the checkpoint file is empty (an interrupted write?)")
    obj = load_torch_file(src, "checkpoint", map_location=map_location)
    if not isinstance(obj, dict):
        raise CheckpointError(f"{name}: expected a checkpoint dict, found a {type(obj).__name__}")
    missing = [k for k in require if k not in obj]
    if missing:
        raise CheckpointError(f"{name}: checkpoint lacks {missing}; it has keys {sorted(obj)}")
    verify_checksums(obj, name)
    return obj


def capture_rng_state() -> dict[str, Any]:
    """Every RNG the trainer touches: torch CPU, CUDA (if any) and Python's `random`."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_as_tuple(state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x):
    return tuple(_as_tuple(v) for v in x) if isinstance(x, list | tuple) else x


def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, iteration: int,
                    out: str | os.PathLike | IO[bytes]) -> None:
    """Save model, optimizer and iteration to a path (atomically) or a binary file object (CS336)."""
    config = getattr(model, "config", None)
    obj = {
        "format": FORMAT, "version": VERSION,
        "model_config": _config_dict(config) if config is not None else None,
        "model": model.state_dict(), "tokenizer": None,
        "optimizer": optimizer.state_dict(), "step": int(iteration),
    }
    if isinstance(out, str | os.PathLike):
        atomic_torch_save(obj, out)
    else:
        torch.save({**obj, "checksums": compute_checksums(obj)}, out)


def load_checkpoint(src: str | os.PathLike | IO[bytes], model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> int:
    """Restore model (and optimizer) state from `src`; returns the saved iteration (CS336)."""
    if isinstance(src, io.IOBase) or hasattr(src, "read"):
        obj = read_checkpoint(src, require=("model", "step"))
    else:
        obj = read_checkpoint(Path(src), require=("model", "step"))
    model.load_state_dict(obj["model"])
    if optimizer is not None:
        if "optimizer" not in obj:
            raise CheckpointError("checkpoint has no optimizer state to restore")
        optimizer.load_state_dict(obj["optimizer"])
    return int(obj["step"])


def _config_dict(config: Any) -> dict[str, Any]:
    import dataclasses

    if dataclasses.is_dataclass(config):
        return dataclasses.asdict(config)
    if isinstance(config, dict):
        return dict(config)
    raise TypeError(f"model.config must be a dataclass or dict, got {type(config).__name__}")
