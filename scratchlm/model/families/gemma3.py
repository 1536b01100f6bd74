"""Gemma 3 (text): Gemma 2's sandwich block with per-head q/k-norm (gains (1 + w), folded at load), no soft-caps,
five sliding layers of six with their own RoPE base (`rope_local_base_freq`, unscaled) and the global layers'
RoPE scaling (HF `Gemma3ForCausalLM` / model_type `gemma3_text`; GGUF arch `gemma3`)."""

from __future__ import annotations

import math
from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig, NormFeatures
from scratchlm.model.families.base import (
    Family,
    FamilyError,
    base_config,
    base_hf_config,
    gguf_base_config,
    gguf_llama_rules,
    gguf_meta,
    layer_types,
    llama_rules,
    rope_parameters,
    rope_to_hf,
)
from scratchlm.model.families.gemma import act
from scratchlm.model.families.gemma2 import (
    GGUF_NORMS,
    NORMS,
    gguf_query_scale,
    gguf_sliding_layers,
    query_pre_attn_scalar,
    sliding,
)


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    if cfg.get("model_type") == "gemma3" and "text_config" in cfg:
        raise FamilyError(f"{source}: Gemma 3 with a vision tower (Gemma3ForConditionalGeneration) is not supported; "
                          "use the text-only model (model_type gemma3_text)")
    n, d = int(cfg.get("num_hidden_layers", 0)), int(cfg.get("hidden_size", 0))
    window = cfg.get("sliding_window")
    layers = sliding(cfg, n, every=int(cfg.get("sliding_window_pattern", 6))) if window else None
    local = rope_parameters(cfg, "sliding_attention")
    if local.get("rope_type", "default") != "default":
        raise FamilyError(f"{source}: scaled RoPE on the sliding layers ({local['rope_type']!r}) is not supported")
    local_theta = float(cfg.get("rope_local_base_freq") or local.get("rope_theta") or 10_000.0)
    attn = AttentionFeatures(qk_norm="head", query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                             logit_softcap=cfg.get("attn_logit_softcapping"),
                             sliding_window=int(window) if window else None, sliding_layers=layers)
    config = base_config(cfg, source, tie_embeddings=bool(cfg.get("tie_word_embeddings", True)),
                         embedding_scale=math.sqrt(d), attn=attn, norm=NormFeatures(placement="sandwich"),
                         mlp=MLPFeatures(act=act(cfg, source)), final_logit_softcap=cfg.get("final_logit_softcapping"))
    config.rope.local_theta, config.rope.local_scaling = local_theta, False
    return config


def hf_config(config: ModelConfig) -> dict[str, Any]:
    a, r = config.attn, config.rope
    full = rope_to_hf(config)["rope_parameters"]
    local = {"rope_type": "default", "rope_theta": r.local_theta or config.rope_theta}
    out = base_hf_config(config, "gemma3_text", "Gemma3ForCausalLM")
    out.pop("rope_scaling", None)
    return out | {
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar(config), "attn_logit_softcapping": a.logit_softcap,
        "final_logit_softcapping": config.final_logit_softcap, "sliding_window": a.sliding_window,
        "rope_local_base_freq": local["rope_theta"],
        "rope_parameters": {"full_attention": full, "sliding_attention": local},
        "layer_types": layer_types(config)}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    """llama.cpp's reading: sliding layers by `gguf_sliding_layers` (period 6), their RoPE base
    `gemma3.rope.freq_base_swa` (10000 when absent) unscaled, the global layers' scaling from `rope.scaling.*`,
    the query scale by `gguf_query_scale`, an optional final soft-cap."""
    arch = "gemma3"
    n, d = int(gguf_meta(meta, arch, "block_count", source)), int(gguf_meta(meta, arch, "embedding_length", source))
    key_len = int(meta.get(f"{arch}.attention.key_length", 256))
    window = meta.get(f"{arch}.attention.sliding_window")
    attn = AttentionFeatures(qk_norm="head", query_scale=gguf_query_scale(meta, arch, 62, key_len),
                             logit_softcap=meta.get(f"{arch}.attn_logit_softcapping"),
                             sliding_window=int(window) if window else None,
                             sliding_layers=gguf_sliding_layers(meta, arch, n, 6) if window else None)
    config = gguf_base_config(meta, tensors, arch, source, tie_embeddings="output.weight" not in tensors,
                              embedding_scale=math.sqrt(d), attn=attn, norm=NormFeatures(placement="sandwich"),
                              mlp=MLPFeatures(act="gelu_tanh"),
                              final_logit_softcap=meta.get(f"{arch}.final_logit_softcapping"))
    config.rope.local_theta = float(meta.get(f"{arch}.rope.freq_base_swa", 10_000.0))
    config.rope.local_scaling = False
    return config


FAMILY = Family(
    name="gemma3",
    hf_model_types=("gemma3_text", "gemma3"),
    hf_architectures=("Gemma3ForCausalLM",),
    gguf_archs=("gemma3",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=lambda c: llama_rules(c, norm_delta=1.0, norms=NORMS),
    config_from_gguf=config_from_gguf,
    gguf_rules=lambda c: gguf_llama_rules(c, norms=GGUF_NORMS),
)
