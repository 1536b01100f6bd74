"""diffusers-format directories: `config.json` (with `_class_name`) + `diffusion_pytorch_model.safetensors`.

Writes are atomic (`scratchlm.atomic`: temporary file, fsync, rename), so a crash or a full disk never leaves half
a checkpoint, and a full disk is reported as such. Weights are safetensors: reading them runs no code.

Weight variants as diffusers names them: `variant="fp16"` is `diffusion_pytorch_model.fp16.safetensors`. Reading
with no variant takes the plain file; a folder that holds only one variant file (as many shipped SD folders hold
only `.fp16.safetensors`) is read from that file, and the choice is logged.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from scratchlm import atomic

WEIGHTS = "diffusion_pytorch_model.safetensors"
log = logging.getLogger(__name__)


def weights_name(variant: str | None = None) -> str:
    """diffusers' weights file name: `diffusion_pytorch_model[.VARIANT].safetensors`."""
    return WEIGHTS if variant is None else f"diffusion_pytorch_model.{variant}.safetensors"


def weights_path(path: str | Path, variant: str | None = None) -> Path:
    """The weights file of a diffusers model folder (see the module docstring); errors name what is missing."""
    path = Path(path)
    want = path / weights_name(variant)
    if want.is_file():
        return want
    if variant is None:
        others = sorted(path.glob("diffusion_pytorch_model.*.safetensors"))
        if len(others) == 1:
            log.info("%s: no %s; reading the only variant there, %s", path, WEIGHTS, others[0].name)
            return others[0]
        if others:
            raise FileNotFoundError(f"{want} not found and several variants are there "
                                    f"({', '.join(p.name for p in others)}): pass variant=")
    raise FileNotFoundError(f"{want} not found: expected a diffusers model folder with config.json and {want.name}")


def load_diffusers_dir(path: str | Path, variant: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a diffusers model folder; errors name the missing file."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: expected a diffusers model folder with config.json and "
                                f"{weights_name(variant)}")
    return json.loads(cfg_path.read_text()), load_file(str(weights_path(path, variant)))


def save_diffusers_dir(path: str | Path, class_name: str, config: dict, state_dict: dict[str, torch.Tensor],
                       variant: str | None = None) -> None:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"_class_name": class_name, "_diffusers_version": _diffusers_version(), **config}
    sd = {k: v.detach().contiguous().cpu() for k, v in state_dict.items()}
    # serialised in memory, then written through scratchlm.atomic: a full disk is a DiskFullError naming the file
    atomic.write_bytes(path / weights_name(variant), save(sd, metadata={"format": "pt"}))
    atomic.write_text(path / "config.json", json.dumps(cfg, indent=2))


def _diffusers_version() -> str:
    try:
        from importlib.metadata import version

        return version("diffusers")
    except Exception:  # diffusers is a dev dependency only
        return "0.0.0"
