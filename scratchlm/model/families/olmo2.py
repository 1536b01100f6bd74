"""OLMo-2: norms after each branch ("post": x + norm(f(x))) and RMSNorm of q and k over the whole projection
(HF `Olmo2ForCausalLM`; GGUF arch `olmo2`)."""

from __future__ import annotations

from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig, NormFeatures
from scratchlm.model.families.base import (
    Family,
    FamilyError,
    base_config,
    base_hf_config,
    check_act,
    gguf_base_config,
    gguf_llama_rules,
    llama_rules,
)

NORMS = {"attn_post_norm": "post_attention_layernorm", "ffn_post_norm": "post_feedforward_layernorm"}
GGUF_NORMS = {"attn_post_norm": "post_attention_norm", "ffn_post_norm": "post_ffw_norm"}


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    if cfg.get("attention_bias"):
        raise FamilyError(f"{source}: OLMo-2 with attention_bias is not supported")
    return base_config(cfg, source, attn=AttentionFeatures(qk_norm="full"), norm=NormFeatures(placement="post"),
                       mlp=MLPFeatures(act=check_act(cfg, source)))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    return base_hf_config(config, "olmo2", "Olmo2ForCausalLM") | {"attention_bias": False}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    return gguf_base_config(meta, tensors, "olmo2", source, attn=AttentionFeatures(qk_norm="full"),
                            norm=NormFeatures(placement="post"))


FAMILY = Family(
    name="olmo2",
    hf_model_types=("olmo2",),
    hf_architectures=("Olmo2ForCausalLM",),
    gguf_archs=("olmo2",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=lambda c: llama_rules(c, norms=NORMS),
    config_from_gguf=config_from_gguf,
    gguf_rules=lambda c: gguf_llama_rules(c, norms=GGUF_NORMS),
)
