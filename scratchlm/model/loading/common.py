"""What every checkpoint loader shares: meta-device construction, in-place loading, clear errors."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

from scratchlm.model.config import ModelConfig
from scratchlm.model.transformer import TransformerLM

log = logging.getLogger("scratchlm.model.loading")


class CheckpointError(ValueError):
    """A checkpoint file or directory is missing, corrupt or of an unsupported kind."""


class LoadedModel(NamedTuple):
    """What `scratchlm.model.load` returns. `tokenizer` is None when the checkpoint carries none."""

    model: TransformerLM
    tokenizer: Any
    config: ModelConfig


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict entry of `TransformerLM(config)` with its shape (built on meta: no memory)."""
    with torch.device("meta"):
        model = TransformerLM(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def build_model(config: ModelConfig, tensors: Iterable[tuple[str, Tensor]], source: str,
                dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                check_finite: bool = True) -> TransformerLM:
    """Build `TransformerLM(config)` on the meta device and assign `tensors` (scratchlm names) in place.

    Before the first tensor is read, the weights' bytes are checked against the memory available
    (`guard.check_memory`); callers check a config's layer count against the files first (`guard`), since the
    meta model has config.n_layers blocks. Each tensor is checked for NaN/Inf (unless `check_finite` is False:
    the HF and GGUF readers check the file's own tensors, by their file names) and converted to dtype/device as
    it arrives, so peak memory stays near one copy of the weights. Missing, unexpected or wrongly shaped
    tensors raise CheckpointError naming them.
    """
    from scratchlm.model.loading import guard  # guard imports this module

    shapes = expected_shapes(config)
    guard.check_memory(guard.weight_bytes(shapes.values(), dtype), source, dtype, device)
    state: dict[str, Tensor] = {}
    problems: list[str] = []
    for name, t in tensors:
        if name not in shapes:
            problems.append(f"unexpected tensor {name!r} {tuple(t.shape)}")
            continue
        if tuple(t.shape) != shapes[name]:
            problems.append(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shapes[name]}")
            continue
        if check_finite:
            guard.check_finite(t, name, source)
        state[name] = t.to(device=device, dtype=dtype)
    missing = [n for n in shapes if n not in state and not any(n in p for p in problems)]
    if missing:
        problems.append(f"missing tensors {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if problems:
        raise CheckpointError(f"{source}: weights do not fit the model config ({config}): " + "; ".join(problems))
    with torch.device("meta"):
        model = TransformerLM(config, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval()


def require_file(path: Path, what: str) -> Path:
    """`path` if it is a regular file; FileNotFoundError or a CheckpointError saying what it is otherwise (a
    folder, a FIFO, a device, a socket, a symlink loop: `guard.check_path`)."""
    from scratchlm.model.loading.guard import check_path

    check_path(path, what, expected="a file")
    if not path.is_file():
        raise CheckpointError(f"{what} is not a file: {path}")
    return path


def optional_tokenizer(loader_name: str, *args: Any) -> Any:
    """Call `scratchlm.tokenizer.<module>.<function>` if that layer is installed; None with a log line otherwise."""
    module_name, _, func_name = loader_name.rpartition(".")
    try:
        import importlib

        module = importlib.import_module(f"scratchlm.tokenizer.{module_name}")
        target = module
        for part in func_name.split(":"):
            target = getattr(target, part)
    except (ImportError, AttributeError) as e:
        log.warning("tokenizer not loaded (scratchlm.tokenizer.%s unavailable: %s); returning tokenizer=None",
                    loader_name, e)
        return None
    return target(*args)
