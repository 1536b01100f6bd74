"""scratchlm checkpoints: a torch `.pt` dict {"format": "scratchlm", "model_config", "model", "tokenizer", ...}.

The trainer writes richer checkpoints (optimizer, RNG, data state); the loader only needs these keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from scratchlm import atomic
from scratchlm.model.config import ModelConfig
from scratchlm.model.loading.common import CheckpointError, LoadedModel, build_model, log, require_file
from scratchlm.model.loading.guard import check_state_dict
from scratchlm.model.transformer import TransformerLM

FORMAT = "scratchlm"
_PREFIXES = ("_orig_mod.", "module.")  # torch.compile / DDP wrappers


def _strip(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for p in _PREFIXES:
            if name.startswith(p):
                name, changed = name[len(p):], True
    return name


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint dict (tensors mmap'd, weights_only unpickling), validated."""
    path = require_file(Path(path), "scratchlm checkpoint")
    try:
        ckpt = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as e:  # pickle/zip errors: a truncated or foreign file
        raise CheckpointError(f"{path}: not a readable torch checkpoint ({type(e).__name__}: {e})") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        found = ckpt.get("format") if isinstance(ckpt, dict) else type(ckpt).__name__
        raise CheckpointError(f"{path}: not a scratchlm checkpoint (expected format 'scratchlm', found {found!r})")
    for key in ("model_config", "model"):
        if key not in ckpt:
            raise CheckpointError(f"{path}: scratchlm checkpoint has no {key!r} entry")
    return ckpt


def load_checkpoint_model(path: str | Path, dtype: torch.dtype = torch.float32,
                          device: str | torch.device = "cpu") -> LoadedModel:
    """Load the model (and tokenizer, when stored) of a scratchlm checkpoint."""
    ckpt = read_checkpoint(path)
    try:
        config = ModelConfig.from_dict(dict(ckpt["model_config"]))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid model_config ({e})") from None
    state = {_strip(k): v for k, v in ckpt["model"].items()}
    check_state_dict(config, {k: tuple(v.shape) for k, v in state.items()}, str(path))  # before building
    log.info("loading scratchlm checkpoint %s: %d layers, d_model %d, vocab %d", path, config.n_layers,
             config.d_model, config.vocab_size)
    model = build_model(config, state.items(), str(path), dtype, device)
    tokenizer = _tokenizer(ckpt) if ckpt.get("tokenizer") is not None else None
    return LoadedModel(model, tokenizer, config)


def _tokenizer(ckpt: dict[str, Any]) -> Any:
    try:
        from scratchlm.tokenizer import tokenizer_from_state
    except ImportError as e:
        log.warning("checkpoint has a tokenizer but scratchlm.tokenizer is unavailable (%s): tokenizer=None", e)
        return None
    return tokenizer_from_state(ckpt["tokenizer"])


def save_model(path: str | Path, model: TransformerLM, tokenizer: Any = None, **extra: Any) -> Path:
    """Write a minimal scratchlm checkpoint (model, config, tokenizer state) atomically."""
    path = Path(path)
    tok_state = None
    if tokenizer is not None:
        from scratchlm.tokenizer import tokenizer_to_state

        tok_state = tokenizer_to_state(tokenizer)
    ckpt = {"format": FORMAT, "model_config": model.config.to_dict(), "model": model.state_dict(),
            "tokenizer": tok_state, **extra}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(ckpt, tmp)
    atomic.replace(tmp, path)
    return path
