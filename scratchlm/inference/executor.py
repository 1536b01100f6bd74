"""Executors: where the engine's forward passes run. The engine is *given* one (as vLLM's engines are).

An executor loads the model (every rank its share), allocates the KV cache once the engine has sized
it, and hands back the runner the engine steps (`execute(ModelInput) -> logits`, `cache`):

- `UniProcExecutor` (here): the whole model in this process, a `ModelRunner` around it;
- the multi-process executor (tensor / pipeline / context parallelism) is provided by
  `scratchlm.parallel`, which plugs in from above: inference/ only knows this interface and never
  imports parallel/. Which class serves a world size > 1 is wired in the top-level package
  (`scratchlm.MULTIPROCESS_EXECUTOR`, "module:attribute"), read here only when such an engine is asked
  for; `LLMEngine.from_pretrained(..., executor_class=...)` takes any other class with this interface.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from scratchlm.inference.config import EngineConfig
from scratchlm.inference.kv_cache import KVCache
from scratchlm.inference.runner import ModelInput, ModelRunner


@runtime_checkable
class Runner(Protocol):
    """What the engine steps: one batched forward over the paged KV cache."""

    cache: KVCache

    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Logits of the sampled rows, (len(inp.logits_indices), vocab)."""
        ...


@runtime_checkable
class Executor(Protocol):
    """Loads a model somewhere (this process, or ranks of its own) and runs the engine's steps there."""

    model_config: Any  # scratchlm.model.ModelConfig of the whole (unsharded) model
    tokenizer: Any     # the model's tokenizer, or None

    @classmethod
    def from_pretrained(cls, path: Path, config: EngineConfig) -> Executor:
        """Load the model at `path` for `config` (start the ranks, if any)."""
        ...

    def start(self, num_blocks: int) -> Runner:
        """Allocate `num_blocks` KV blocks (on every rank) and return the runner the engine steps."""
        ...

    def shutdown(self) -> None:
        """Stop the ranks, if any, and free what the executor holds; idempotent."""
        ...


class UniProcExecutor:
    """The whole model in this process: moved to the configured device and dtype, run by a `ModelRunner`."""

    def __init__(self, model: torch.nn.Module, model_config: Any, tokenizer: Any, config: EngineConfig):
        if config.context_parallel_size > 1:  # a CP engine's block size and attention need the CP runner
            raise ValueError(f"context_parallel_size={config.context_parallel_size} needs the multi-process runner: "
                             f"build the engine with LLMEngine.from_pretrained(path, config) or LLM(path, ...)")
        self.config = config
        self.model = model.to(device=config.device, dtype=config.torch_dtype).eval()
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.runner: ModelRunner | None = None

    @classmethod
    def from_pretrained(cls, path: Path, config: EngineConfig) -> UniProcExecutor:
        """Any format `scratchlm.model.load` reads, with `config.quantization` applied."""
        from scratchlm.inference.quantization import load_model_quantized

        quantization = None if config.quantization in (None, "none") else config.quantization
        loaded = load_model_quantized(path, quantization, dtype=config.torch_dtype, device=config.device,
                                      calibration=config.quantization_calibration,
                                      calibration_tokens=config.quantization_calibration_tokens)
        return cls(loaded.model, loaded.config, loaded.tokenizer, config)

    def start(self, num_blocks: int) -> ModelRunner:
        c, m = self.config, self.model_config
        cache = KVCache.for_spec(m.kv_spec(), num_blocks, c.block_size, c.kv_torch_dtype, torch.device(c.device))
        self.runner = ModelRunner(self.model, cache, c.device)
        return self.runner

    def shutdown(self) -> None:
        pass


def default_executor_class(config: EngineConfig) -> type:
    """`UniProcExecutor` for one process; for TP x PP x CP x EP > 1 the multi-process executor the top-level
    package names (`scratchlm.MULTIPROCESS_EXECUTOR`), imported only now."""
    if config.world_size == 1:
        return UniProcExecutor
    import scratchlm

    return resolve_executor(scratchlm.MULTIPROCESS_EXECUTOR)


def resolve_executor(target: str | type) -> type:
    """An executor class from a class or a "package.module:Class" string."""
    if isinstance(target, type):
        return target
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"executor {target!r}: expected 'package.module:Class'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"executor {target!r} cannot be imported: {type(e).__name__}: {e}") from e
