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
    sliding_layers_from_types,
)


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias"))
    window = int(cfg["sliding_window"]) if cfg.get("use_sliding_window") and cfg.get("sliding_window") else None
    n = int(cfg.get("num_hidden_layers", 0))
    layers = sliding_layers_from_types(cfg, n) if window else None
    if window and layers is None:
        layers = list(range(int(cfg.get("max_window_layers", n)), n))
    return base_config(cfg, source, qkv_bias=bias, mlp=MLPFeatures(act=check_act(cfg, source)),
                       attn=AttentionFeatures(o_bias=bias, qk_norm="head", sliding_window=window,
                                              sliding_layers=layers))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    a = config.attn
    out = base_hf_config(config, "qwen3", "Qwen3ForCausalLM") | {
        "attention_bias": config.qkv_bias, "use_sliding_window": False, "sliding_window": None}
    if a.sliding_window is not None:
        layers = a.sliding_layers if a.sliding_layers is not None else list(range(config.n_layers))
        out |= {"use_sliding_window": True, "sliding_window": a.sliding_window,
                "max_window_layers": min(layers, default=config.n_layers),
                "layer_types": ["sliding_attention" if i in layers else "full_attention"
                                for i in range(config.n_layers)]}
    return out


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
