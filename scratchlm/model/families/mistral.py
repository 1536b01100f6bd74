"""Mistral: the Llama block with a sliding window on every layer (HF `MistralForCausalLM`)."""

from __future__ import annotations

from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig
from scratchlm.model.families.base import Family, base_config, base_hf_config, check_act, llama_rules


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    window = cfg.get("sliding_window")
    return base_config(cfg, source, attn=AttentionFeatures(sliding_window=int(window) if window else None),
                       mlp=MLPFeatures(act=check_act(cfg, source)))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    return base_hf_config(config, "mistral", "MistralForCausalLM") | {"sliding_window": config.attn.sliding_window}


FAMILY = Family(
    name="mistral",
    export_rank=20,
    hf_model_types=("mistral",),
    hf_architectures=("MistralForCausalLM",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=llama_rules,
)
