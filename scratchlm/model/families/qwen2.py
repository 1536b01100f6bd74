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
    llama_rules,
    sliding_layers_from_types,
)


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    attn = AttentionFeatures()
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        n = int(cfg["num_hidden_layers"])
        layers = sliding_layers_from_types(cfg, n)
        if layers is None:
            layers = list(range(int(cfg.get("max_window_layers", n)), n))
        attn = AttentionFeatures(sliding_window=int(cfg["sliding_window"]), sliding_layers=layers)
    return base_config(cfg, source, qkv_bias=True, attn=attn, mlp=MLPFeatures(act=check_act(cfg, source)))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    if not config.qkv_bias:
        raise ValueError("qwen2 has q/k/v biases")
    a = config.attn
    out = base_hf_config(config, "qwen2", "Qwen2ForCausalLM") | {"use_sliding_window": False, "sliding_window": None}
    if a.sliding_window is not None:
        layers = a.sliding_layers if a.sliding_layers is not None else list(range(config.n_layers))
        out |= {"use_sliding_window": True, "sliding_window": a.sliding_window,
                "max_window_layers": min(layers, default=config.n_layers),
                "layer_types": ["sliding_attention" if i in layers else "full_attention"
                                for i in range(config.n_layers)]}
    return out


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
