"""Checkpoint loaders (`load`) and the HF exporter (`export_hf`).

`load(path)` recognises the format from the path itself (directory with config.json, GGUF magic,
torch zip, llama2.c header), never from the file name alone.
"""

from __future__ import annotations

from pathlib import Path

import torch

from scratchlm.model.loading.checkpoint import load_checkpoint_model, read_checkpoint, save_model
from scratchlm.model.loading.common import CheckpointError, LoadedModel, build_model
from scratchlm.model.loading.export import export_hf
from scratchlm.model.loading.gguf_file import load_gguf
from scratchlm.model.loading.guard import check_path
from scratchlm.model.loading.hf import load_hf_dir
from scratchlm.model.loading.llama2c import load_llama2c

FORMATS = "an HF directory (config.json + *.safetensors), a .gguf file, a llama2.c .bin or a scratchlm .pt checkpoint"


def detect_format(path: str | Path) -> str:
    """'hf', 'gguf', 'scratchlm' or 'llama2c' for `path`; raises a clear error otherwise."""
    path = Path(path)
    try:
        check_path(path, expected=f"a model file or folder ({FORMATS})")
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{e} (expected {FORMATS})") from None
    if path.is_dir():
        if (path / "config.json").is_file():
            return "hf"
        raise CheckpointError(_not_a_model_dir(path))
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return "gguf"
    if magic == b"PK\x03\x04":  # torch.save's zip container
        return "scratchlm"
    if path.suffix == ".gguf":
        raise CheckpointError(f"{path}: not a GGUF file (bad magic {magic!r})")
    if path.suffix in (".pt", ".pth", ".ckpt"):
        raise CheckpointError(f"{path}: not a torch checkpoint (bad magic {magic!r}); truncated or corrupt?")
    if path.suffix == ".bin":
        if _is_token_file(path):
            raise CheckpointError(f"{path}: this is a token file written by `scratchlm tokenizer encode` (its sidecar "
                                  f"{path.name}.json says so), training data rather than a model: pass it to "
                                  f"`scratchlm train --train-data`, and give generate/serve a model ({FORMATS})")
        return "llama2c"
    raise CheckpointError(f"{path}: unrecognised model file (expected {FORMATS})")


def _not_a_model_dir(path: Path) -> str:
    """Why the folder `path` is not a model, and what to pass instead."""
    checkpoints = sorted(p.name for p in path.glob("*.pt"))
    if checkpoints:
        pick = "ckpt.pt" if "ckpt.pt" in checkpoints else checkpoints[0]
        return (f"{path}: a training run folder, not a model directory (no config.json): pass its checkpoint, "
                f"{path / pick}")
    if any((path / n).is_file() for n in ("tokenizer.json", "vocab.json", "encoder.json")):
        return (f"{path}: this folder holds a tokenizer but no model (no config.json); pass a model ({FORMATS}), "
                "and this folder as --tokenizer if the model has none")
    return f"{path}: directory has no config.json (expected {FORMATS})"


def _is_token_file(path: Path) -> bool:
    """A flat token file from `scratchlm tokenizer encode`: its ``.bin.json`` sidecar names dtype and count."""
    side = Path(str(path) + ".json")
    if not side.is_file():
        return False
    try:
        import json

        meta = json.loads(side.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and "dtype" in meta and "count" in meta


def load(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a model, its tokenizer and config from any supported format, built on meta and filled in place."""
    loaders = {"hf": load_hf_dir, "gguf": load_gguf, "scratchlm": load_checkpoint_model, "llama2c": load_llama2c}
    return loaders[detect_format(path)](path, dtype=dtype, device=device)


__all__ = ["CheckpointError", "LoadedModel", "build_model", "detect_format", "export_hf", "load", "load_gguf",
           "load_hf_dir", "load_llama2c", "load_checkpoint_model", "read_checkpoint", "save_model"]
