"""diffusers-format directories: `config.json` (with `_class_name`) + `diffusion_pytorch_model.safetensors`.

Writes are atomic (`scratchlm.atomic`: temporary file, fsync, rename), so a crash or a full disk never leaves half
a checkpoint, and a full disk is reported as such. Weights are safetensors: reading them runs no code.

Weight variants as diffusers names them: `variant="fp16"` is `diffusion_pytorch_model.fp16.safetensors`. Reading
with no variant takes the plain file; a folder that holds only one variant file (as many shipped SD folders hold
only `.fp16.safetensors`) is read from that file, and the choice is logged.

Sharded weights as diffusers writes them (`save_pretrained(max_shard_size=...)`, big UNets as shipped):
`diffusion_pytorch_model.safetensors.index.json` (`.index.fp16.json` for the fp16 variant) maps every tensor to
its shard file in the same folder; the shards are read and the tensors must be exactly the index's (a shard name
with a path in it, a missing shard, a tensor missing or not listed: errors naming it). The single file wins
when a folder has both. Writing is always one file.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from scratchlm import atomic

WEIGHTS = "diffusion_pytorch_model.safetensors"
log = logging.getLogger(__name__)


def weights_name(variant: str | None = None) -> str:
    """diffusers' weights file name: `diffusion_pytorch_model[.VARIANT].safetensors`."""
    return WEIGHTS if variant is None else f"diffusion_pytorch_model.{variant}.safetensors"


def index_name(variant: str | None = None) -> str:
    """diffusers' shard index name: `diffusion_pytorch_model.safetensors.index[.VARIANT].json`."""
    return f"{WEIGHTS}.index.json" if variant is None else f"{WEIGHTS}.index.{variant}.json"


def read_sharded(index: Path) -> dict[str, torch.Tensor]:
    """The state dict of a sharded folder from its index file (see the module docstring)."""
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index}: no weight_map")
    shards = sorted(set(weight_map.values()))
    for shard in shards:
        if Path(shard).name != shard:
            raise ValueError(f"{index}: shard {shard!r} is not a file name in {index.parent}")
        if not (index.parent / shard).is_file():
            raise FileNotFoundError(f"{index.parent / shard} not found: {index.name} lists it")
    sd: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(str(index.parent / shard))
        stray = sorted(k for k in part if weight_map.get(k) != shard)
        if stray:
            raise ValueError(f"{index.parent / shard}: tensors {stray[:3]} are not mapped to it by {index.name}")
        sd.update(part)
    missing = sorted(set(weight_map) - set(sd))
    if missing:
        raise ValueError(f"{index}: tensors {missing[:3]} ({len(missing)} in all) are in no shard")
    return sd


def weights_path(path: str | Path, variant: str | None = None) -> Path:
    """The weights file of a diffusers model folder (see the module docstring); errors name what is missing."""
    path = Path(path)
    want = path / weights_name(variant)
    if want.is_file():
        return want
    if (path / index_name(variant)).is_file():
        return path / index_name(variant)
    if variant is None:
        others = sorted([*(p for p in path.glob("diffusion_pytorch_model.*.safetensors")  # a variant file
                           if not re.search(r"-\d+-of-\d+\.safetensors$", p.name)),  # (not a shard)
                         *path.glob(f"{WEIGHTS}.index.*.json")])  # or a variant's shard index
        if len(others) == 1:
            log.info("%s: no %s; reading the only variant there, %s", path, WEIGHTS, others[0].name)
            return others[0]
        if others:
            raise FileNotFoundError(f"{want} not found and several variants are there "
                                    f"({', '.join(p.name for p in others)}): pass variant=")
    raise FileNotFoundError(f"{want} not found: expected a diffusers model folder with config.json and {want.name} "
                            f"(or the shard index {index_name(variant)})")


def load_diffusers_dir(path: str | Path, variant: str | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a diffusers model folder; errors name the missing file."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise FileNotFoundError(f"{cfg_path} not found: expected a diffusers model folder with config.json and "
                                f"{weights_name(variant)}")
    weights = weights_path(path, variant)
    sd = read_sharded(weights) if weights.name.endswith(".json") else load_file(str(weights))
    return json.loads(cfg_path.read_text()), sd


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
