"""Qwen3-MoE: the Qwen3 block (per-head q/k RMSNorm) whose MLP is a mixture of `num_experts` experts of width
`moe_intermediate_size`, `num_experts_per_tok` per token, softmax router (top-k weights renormalised when
`norm_topk_prob`), no shared expert; dense layers as Qwen2-MoE's (`mlp_only_layers`, `decoder_sparse_step`); a
sliding window, when `use_sliding_window`, on every layer. HF `Qwen3MoeForCausalLM`; GGUF arch `qwen3moe`, where
llama.cpp always renormalises the top-k weights: a file of that arch reads as norm_topk True.

`router_aux_loss_coef` and `output_router_logits` act in training only.
"""

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
    gguf_moe,
    llama_rules,
)
from scratchlm.model.families.qwen2_moe import qwen_moe_features, qwen_moe_to_hf


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias"))
    window = int(cfg.get("sliding_window") or 0) if cfg.get("use_sliding_window") else 0
    return base_config(cfg, source, qkv_bias=bias, mlp=MLPFeatures(act=check_act(cfg, source)),
                       attn=AttentionFeatures(o_bias=bias, qk_norm="head", sliding_window=window or None),
                       moe=qwen_moe_features(cfg, source, shared=False))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    if config.moe.d_shared or config.attn.sliding_layers is not None or config.attn.o_bias != config.qkv_bias:
        raise ValueError("qwen3_moe: no shared expert, a window on every layer, biases on q/k/v/o or none")
    window = config.attn.sliding_window
    return base_hf_config(config, "qwen3_moe", "Qwen3MoeForCausalLM") | qwen_moe_to_hf(config) | {
        "attention_bias": config.qkv_bias, "use_sliding_window": window is not None, "sliding_window": window}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    return gguf_base_config(meta, tensors, "qwen3moe", source, attn=AttentionFeatures(qk_norm="head"),
                            moe=gguf_moe(meta, tensors, "qwen3moe", source, norm_topk=True))


FAMILY = Family(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    hf_architectures=("Qwen3MoeForCausalLM",),
    gguf_archs=("qwen3moe",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=llama_rules,
    hf_file_rules=lambda c, names: llama_rules(c, present=names),
    config_from_gguf=config_from_gguf,
    gguf_rules=gguf_llama_rules,
)
