"""diffusers-format directories: `config.json` (with `_class_name`) + `diffusion_pytorch_model.safetensors`.

Writes are atomic (`scratchlm.atomic`: temporary file, fsync, rename), so a crash or a full disk never leaves half
a checkpoint, and a full disk is reported as such. Weights are safetensors: reading them runs no code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from scratchlm import atomic

WEIGHTS = "diffusion_pytorch_model.safetensors"


def load_diffusers_dir(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a diffusers model folder; errors name the missing file."""
    path = Path(path)
    cfg_path, w_path = path / "config.json", path / WEIGHTS
    for p in (cfg_path, w_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p} not found: expected a diffusers model folder with config.json and {WEIGHTS}")
    return json.loads(cfg_path.read_text()), load_file(str(w_path))


def save_diffusers_dir(path: str | Path, class_name: str, config: dict, state_dict: dict[str, torch.Tensor]) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"_class_name": class_name, "_diffusers_version": _diffusers_version(), **config}
    sd = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    # serialised in memory, then written through scratchlm.atomic: a full disk is a DiskFullError naming the file
    atomic.write_bytes(path / WEIGHTS, save(sd, metadata={"format": "pt"}))
    atomic.write_text(path / "config.json", json.dumps(cfg, indent=2))


def _diffusers_version() -> str:
    try:
        from importlib.metadata import version

        return version("diffusers")
    except Exception:  # diffusers is a dev dependency only
        return "0.0.0"
