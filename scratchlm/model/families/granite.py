"""Granite (3.x dense): the Llama block with four multipliers: embeddings (embedding_multiplier), each branch's
output before the residual add (residual_multiplier), the query scale (attention_multiplier) and the logits
(divided by logits_scaling) (HF `GraniteForCausalLM`; GGUF arch `granite`)."""

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


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias"))
    return base_config(cfg, source, qkv_bias=bias,
                       attn=AttentionFeatures(o_bias=bias, query_scale=float(cfg.get("attention_multiplier", 1.0))),
                       mlp=MLPFeatures(act=check_act(cfg, source), bias=bool(cfg.get("mlp_bias"))),
                       embedding_scale=float(cfg.get("embedding_multiplier", 1.0)),
                       residual_multiplier=float(cfg.get("residual_multiplier", 1.0)),
                       logit_scale=1.0 / float(cfg.get("logits_scaling", 1.0)))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    return base_hf_config(config, "granite", "GraniteForCausalLM") | {
        "attention_bias": config.qkv_bias, "mlp_bias": config.mlp.bias, "attention_multiplier": config.query_scale(),
        "embedding_multiplier": config.embedding_scale, "residual_multiplier": config.residual_multiplier,
        "logits_scaling": 1.0 / config.logit_scale}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    a = "granite"
    return gguf_base_config(meta, tensors, a, source,
                            attn=AttentionFeatures(query_scale=float(meta.get(f"{a}.attention.scale", 1.0))),
                            embedding_scale=float(meta.get(f"{a}.embedding_scale", 1.0)),
                            residual_multiplier=float(meta.get(f"{a}.residual_scale", 1.0)),
                            logit_scale=1.0 / float(meta.get(f"{a}.logit_scale", 1.0)))


FAMILY = Family(
    name="granite",
    hf_model_types=("granite",),
    hf_architectures=("GraniteForCausalLM",),
    gguf_archs=("granite",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=llama_rules,
    config_from_gguf=config_from_gguf,
    gguf_rules=lambda c: gguf_llama_rules(c, permute_qk=True),
)
