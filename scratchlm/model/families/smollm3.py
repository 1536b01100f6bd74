"""SmolLM3: the Llama block with RoPE left out of every fourth layer (NoPE: `no_rope_layers[i] == 0`), sliding
windows optional on the NoPE layers (HF `SmolLM3ForCausalLM`; GGUF arch `smollm3`, whose NoPE period llama.cpp
fixes at 4 and whose q/k rows convert permutes as Llama's)."""

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


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    n, bias = int(cfg.get("num_hidden_layers", 0)), bool(cfg.get("attention_bias"))
    uses_rope = cfg.get("no_rope_layers") or [int((i + 1) % int(cfg.get("no_rope_layer_interval", 4)) != 0)
                                              for i in range(n)]
    window = int(cfg["sliding_window"]) if cfg.get("use_sliding_window") and cfg.get("sliding_window") else None
    config = base_config(cfg, source, qkv_bias=bias, mlp=MLPFeatures(act=check_act(cfg, source),
                                                                     bias=bool(cfg.get("mlp_bias"))),
                         attn=AttentionFeatures(o_bias=bias, sliding_window=window,
                                                sliding_layers=sliding_layers_from_types(cfg, n) if window else None))
    config.rope.nope_layers = [i for i, r in enumerate(uses_rope[:n]) if not r]
    return config


def hf_config(config: ModelConfig) -> dict[str, Any]:
    a = config.attn
    return base_hf_config(config, "smollm3", "SmolLM3ForCausalLM") | {
        "attention_bias": config.qkv_bias, "mlp_bias": config.mlp.bias,
        "no_rope_layers": [int(i not in config.rope.nope_layers) for i in range(config.n_layers)],
        "use_sliding_window": a.sliding_window is not None, "sliding_window": a.sliding_window,
        "layer_types": layer_types(config)}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    config = gguf_base_config(meta, tensors, "smollm3", source)
    config.rope.nope_layers = [i for i in range(config.n_layers) if (i + 1) % 4 == 0]  # llama.cpp's fixed step
    return config


FAMILY = Family(
    name="smollm3",
    hf_model_types=("smollm3",),
    hf_architectures=("SmolLM3ForCausalLM",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=llama_rules,
    gguf_archs=("smollm3",),
    config_from_gguf=config_from_gguf,
    gguf_rules=lambda c: gguf_llama_rules(c, permute_qk=True),
)
