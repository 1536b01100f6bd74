"""Gradient engines: where the trainer gets its loss and gradients from.

An engine is a callable ``loss_and_grads(model, x, y, loss_scale) -> loss``:

- ``x``, ``y``: (B, T) int64 inputs and next-token targets;
- it must *accumulate* d(loss * loss_scale)/d(param) into ``param.grad`` for every trainable
  parameter (creating ``.grad`` where it is None), exactly as ``loss.backward()`` does;
- it returns the unscaled mean cross-entropy of the micro-batch as a detached float32 scalar tensor.

The trainer does everything else (accumulation, all-reduce, clipping, AdamW, schedule), so an
alternative engine (e.g. the hand-written autodiff of ``scratchlm.autodiff``) only has to fill
``.grad``. Select one with ``TrainConfig.engine`` / ``--engine``: a name from :data:`ENGINES`, or a
``"package.module:function"`` path, imported when the run starts (nothing registers itself globally).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

from scratchlm.training.loss import cross_entropy

LossAndGrads = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, float], torch.Tensor]


def torch_loss_and_grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_scale: float) -> torch.Tensor:
    """The default engine: forward, hand-written cross-entropy, torch.autograd backward."""
    logits = model(x)  # (B, T, V)
    loss = cross_entropy(logits, y)
    (loss * loss_scale).backward()
    return loss.detach().float()


# Built-in names -> "module:function". The autodiff engine lands with the autodiff layer.
ENGINES: dict[str, str] = {
    "torch": "scratchlm.training.engines:torch_loss_and_grads",
    "autodiff": "scratchlm.autodiff.training:loss_and_grads",
}


def resolve_engine(name: str) -> LossAndGrads:
    """The engine called `name` (a key of ENGINES or 'package.module:function'); clear error if absent."""
    spec = ENGINES.get(name, name)
    if ":" not in spec:
        raise ValueError(f"unknown gradient engine {name!r}: expected one of {sorted(ENGINES)} "
                         "or 'package.module:function'")
    module_name, func_name = spec.split(":", 1)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise ValueError(f"gradient engine {name!r}: cannot import {module_name!r} ({e})") from e
    fn = getattr(module, func_name, None)
    if not callable(fn):
        raise ValueError(f"gradient engine {name!r}: {module_name!r} has no callable {func_name!r}")
    return fn
