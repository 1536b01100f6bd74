"""Qwen3 (dense): the Llama block with per-head RMSNorm of q and k before RoPE (HF `Qwen3ForCausalLM`;
GGUF arch `qwen3`)."""

from __future__ import annotations

from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig
from scratchlm.model.families.base import (
    Family,
    base_config,
    base_hf_config,
    check_act,
    gguf_base_config,
    gguf_llama_rules,
    llama_rules,
)
from scratchlm.model.families.qwen2 import window_from_hf, window_to_hf


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias"))
    return base_config(cfg, source, qkv_bias=bias, mlp=MLPFeatures(act=check_act(cfg, source)),
                       attn=AttentionFeatures(o_bias=bias, qk_norm="head", **window_from_hf(cfg)))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    return base_hf_config(config, "qwen3", "Qwen3ForCausalLM") | {"attention_bias": config.qkv_bias} | window_to_hf(
        config)


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    return gguf_base_config(meta, tensors, "qwen3", source, attn=AttentionFeatures(qk_norm="head"))


FAMILY = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    hf_architectures=("Qwen3ForCausalLM",),
    gguf_archs=("qwen3",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=llama_rules,
    config_from_gguf=config_from_gguf,
    gguf_rules=gguf_llama_rules,
)
