"""Qwen2 / Qwen2.5: the Llama block with q/k/v biases; sliding windows on the layers from `max_window_layers`
when `use_sliding_window` (HF `Qwen2ForCausalLM`; GGUF arch `qwen2`, q/k rows not permuted)."""

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
    layer_types,
    llama_rules,
    sliding_layers_from_types,
)


def window_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen's window fields (`use_sliding_window`, `sliding_window`, and `layer_types` or `max_window_layers`: the
    layers from it on slide) as `AttentionFeatures` keyword arguments; Qwen3 shares them."""
    if not (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
        return {}
    n = int(cfg["num_hidden_layers"])
    layers = sliding_layers_from_types(cfg, n)
    if layers is None:
        layers = list(range(int(cfg.get("max_window_layers", n)), n))
    return {"sliding_window": int(cfg["sliding_window"]), "sliding_layers": layers}


def window_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The inverse of `window_from_hf`."""
    if config.attn.sliding_window is None:
        return {"use_sliding_window": False, "sliding_window": None}
    types = layer_types(config)
    return {"use_sliding_window": True, "sliding_window": config.attn.sliding_window, "layer_types": types,
            "max_window_layers": types.index("sliding_attention") if "sliding_attention" in types else config.n_layers}


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    return base_config(cfg, source, qkv_bias=True, attn=AttentionFeatures(**window_from_hf(cfg)),
                       mlp=MLPFeatures(act=check_act(cfg, source)))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    if not config.qkv_bias:
        raise ValueError("qwen2 has q/k/v biases")
    return base_hf_config(config, "qwen2", "Qwen2ForCausalLM") | window_to_hf(config)


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    return gguf_base_config(meta, tensors, "qwen2", source)


FAMILY = Family(
    name="qwen2",
    export_rank=10,
    hf_model_types=("qwen2",),
    hf_architectures=("Qwen2ForCausalLM",),
    gguf_archs=("qwen2",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=llama_rules,
    config_from_gguf=config_from_gguf,
    gguf_rules=gguf_llama_rules,
)
