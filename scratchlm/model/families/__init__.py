"""Model families as data: one module per family, found through a lazy registry (vLLM's `ModelRegistry`).

Every module of this package but `base` defines `FAMILY`, a `base.Family`: the HF `model_type`s and GGUF
architectures it answers to, config translation both ways and its tensor tables. The modules are found and imported
on the first lookup (no list to keep: adding a family is one new module plus its test; docs/model.md, "Adding a
family"). Readers ask `for_hf_config` / `for_gguf_arch`; the exporter asks `for_export`, which takes the first
family, by `Family.export_rank`, whose HF config translates back to the very same `ModelConfig` (so nothing a family
cannot express is exported as something else).
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from typing import Any

from scratchlm.model.config import ModelConfig
from scratchlm.model.families.base import Family, FamilyError, Rule


@cache
def families() -> tuple[Family, ...]:
    """Every family module's `FAMILY`, imported on the first call, in `export_rank` order (then by name)."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if m.name != "base")
    found = [importlib.import_module(f"{__name__}.{n}").FAMILY for n in names]
    return tuple(sorted(found, key=lambda f: (f.export_rank, f.name)))


def _supported(attr: str) -> list[str]:
    return sorted({t for f in families() for t in getattr(f, attr)})


def for_hf_config(cfg: dict[str, Any], source: str = "config.json") -> Family:
    """The family of an HF config.json (by `model_type`; by `architectures` when there is none)."""
    model_type = cfg.get("model_type")
    for f in families():
        if model_type in f.hf_model_types:
            return f
    archs = cfg.get("architectures") or []
    if model_type is None:  # an old config without model_type: by its architecture
        for f in families():
            if any(a in f.hf_architectures for a in archs):
                return f
    raise FamilyError(f"{source}: model_type {model_type!r} is not supported (architectures {archs}); supported "
                      f"model types: {_supported('hf_model_types')}")


def for_gguf_arch(arch: str | None, source: str = "GGUF") -> Family:
    """The family of a GGUF file's `general.architecture`."""
    for f in families():
        if arch in f.gguf_archs:
            return f
    raise FamilyError(f"{source}: architecture {arch!r} is not supported; expected one of {_supported('gguf_archs')}")


def for_export(config: ModelConfig) -> Family:
    """The first family whose HF config reproduces `config` exactly."""
    for f in families():
        if f.hf_config is None or f.config_from_hf is None:
            continue
        try:
            back = f.config_from_hf(f.hf_config(config), "export")
        except (FamilyError, ValueError):
            continue
        if back == config:
            return f
    raise FamilyError(f"no HF model family expresses this config (features: {config.features() or 'none'})")


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """`ModelConfig` of an HF config.json dict, through its family."""
    return for_hf_config(cfg, source).config_from_hf(cfg, source)


__all__ = ["Family", "FamilyError", "Rule", "config_from_hf", "families", "for_export",
           "for_gguf_arch", "for_hf_config"]
