"""Checkpoints: atomic writes, clear errors on corrupt files, CS336 `save_checkpoint`/`load_checkpoint`.

A training checkpoint is one ``torch.save`` dict in the scratchlm checkpoint format of
docs/contracts.md, so that ``scratchlm.model.load(path)`` and ``scratchlm generate --model PATH`` read
it directly::

    {"format": "scratchlm", "version": 1,
     "model_config": dict, "model": state_dict, "tokenizer": dict | None,     # what the model loader reads
     "optimizer": state_dict, "step": int, "rng": {...}, "data": {...},       # what resume reads
     "train_config": dict}

It is loaded with ``weights_only=True`` (no arbitrary code runs when a checkpoint is opened).
"""

from __future__ import annotations

import io
import os
import random
from pathlib import Path
from typing import IO, Any

import torch

from scratchlm.atomic import atomic_write

FORMAT = "scratchlm"
VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint file is missing, corrupt, or not what the caller expects."""


def atomic_torch_save(obj: Any, path: str | Path) -> Path:
    """``torch.save`` to a temp file in the same folder, fsync, ``os.replace``, fsync the folder
    (`scratchlm.atomic`): a reader never sees a half-written checkpoint, even if the process dies
    mid-write; an interrupted write leaves only ``<name>.<random>.tmp``, which the trainer removes
    on its next start."""
    path = Path(path)
    with atomic_write(path, "wb") as f:
        torch.save(obj, f)
    return path


def read_checkpoint(src: str | Path | IO[bytes], map_location: str | torch.device = "cpu",
                    require: tuple[str, ...] = ("model",)) -> dict[str, Any]:
    """Load a checkpoint dict safely; raise :class:`CheckpointError` naming the file and the problem."""
    name = str(src) if isinstance(src, str | Path) else getattr(src, "name", "<file object>")
    if isinstance(src, str | Path):
        path = Path(src)
        if not path.is_file():
            raise CheckpointError(f"checkpoint not found: {path}")
        if path.stat().st_size == 0:
            raise CheckpointError(f"{path}: the checkpoint file is empty (an interrupted write?)")
    try:
        obj = torch.load(src, map_location=map_location, weights_only=True)
    except Exception as e:  # torch raises RuntimeError, EOFError, UnpicklingError, ... on corrupt files
        raise CheckpointError(
            f"{name}: not a readable checkpoint (corrupt or truncated file?): {type(e).__name__}: {e}"
        ) from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{name}: expected a checkpoint dict, found a {type(obj).__name__}")
    missing = [k for k in require if k not in obj]
    if missing:
        raise CheckpointError(f"{name}: checkpoint lacks {missing}; it has keys {sorted(obj)}")
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
        torch.save(obj, out)


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
