"""Gemma: GeGLU (gelu-tanh), embeddings scaled by sqrt(d_model), RMSNorm gains stored as w with a (1 + w) gain
(folded in at load: ours = 1 + w), tied head (HF `GemmaForCausalLM`; GGUF arch `gemma`, whose converter adds the
1 already)."""

from __future__ import annotations

import math
from typing import Any

from scratchlm.model.config import MLPFeatures, ModelConfig
from scratchlm.model.families.base import (
    Family,
    base_config,
    base_hf_config,
    check_act,
    gguf_base_config,
    gguf_llama_rules,
    llama_rules,
)

GELU = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}  # HF ACT2FN's names


def act(cfg: dict[str, Any], source: str) -> str:
    key = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"
    return check_act(cfg, source, key, GELU)


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    d = int(cfg.get("hidden_size", 0))
    return base_config(cfg, source, tie_embeddings=True, embedding_scale=math.sqrt(d),
                       mlp=MLPFeatures(act=act(cfg, source)))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    return base_hf_config(config, "gemma", "GemmaForCausalLM") | {
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    d = int(meta.get("gemma.embedding_length", 0))
    return gguf_base_config(meta, tensors, "gemma", source, tie_embeddings=True, embedding_scale=math.sqrt(d),
                            mlp=MLPFeatures(act="gelu_tanh"))


FAMILY = Family(
    name="gemma",
    hf_model_types=("gemma",),
    hf_architectures=("GemmaForCausalLM",),
    gguf_archs=("gemma",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=lambda c: llama_rules(c, norm_delta=1.0),
    config_from_gguf=config_from_gguf,
    gguf_rules=gguf_llama_rules,
)
