"""Gemma 2: Gemma's block with norms before and after each branch ("sandwich"), attention and final logit
soft-caps, the query scale query_pre_attn_scalar^-1/2 and a sliding window on every other layer (HF
`Gemma2ForCausalLM`; GGUF arch `gemma2`)."""

from __future__ import annotations

import math
from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig, NormFeatures
from scratchlm.model.families.base import (
    Family,
    base_config,
    base_hf_config,
    gguf_base_config,
    gguf_llama_rules,
    gguf_meta,
    layer_types,
    llama_rules,
    sliding_layers_from_types,
)
from scratchlm.model.families.gemma import act

NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
         "ffn_norm": "pre_feedforward_layernorm", "ffn_post_norm": "post_feedforward_layernorm"}
GGUF_NORMS = {"attn_norm": "attn_norm", "attn_post_norm": "post_attention_norm", "ffn_norm": "ffn_norm",
              "ffn_post_norm": "post_ffw_norm"}


def sliding(cfg: dict[str, Any], n: int, every: int = 2) -> list[int]:
    """The sliding layers: `layer_types` when given, else every layer but each `every`-th (Gemma 2: the even
    layers slide; Gemma 3: five of six)."""
    layers = sliding_layers_from_types(cfg, n)
    return layers if layers is not None else [i for i in range(n) if (i + 1) % every]


def query_pre_attn_scalar(config: ModelConfig) -> float:
    """HF's query_pre_attn_scalar for the config's query scale (an integer when it is one: 256, 144, ...)."""
    q = 1.0 / config.query_scale() ** 2
    return round(q) if abs(q - round(q)) < 1e-6 * q else q


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    n, d = int(cfg.get("num_hidden_layers", 0)), int(cfg.get("hidden_size", 0))
    window = cfg.get("sliding_window")
    attn = AttentionFeatures(query_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                             logit_softcap=cfg.get("attn_logit_softcapping"),
                             sliding_window=int(window) if window else None,
                             sliding_layers=sliding(cfg, n) if window else None)
    return base_config(cfg, source, tie_embeddings=True, embedding_scale=math.sqrt(d), attn=attn,
                       norm=NormFeatures(placement="sandwich"), mlp=MLPFeatures(act=act(cfg, source)),
                       final_logit_softcap=cfg.get("final_logit_softcapping"))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    a = config.attn
    return base_hf_config(config, "gemma2", "Gemma2ForCausalLM") | {
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar(config), "attn_logit_softcapping": a.logit_softcap,
        "final_logit_softcapping": config.final_logit_softcap, "sliding_window": a.sliding_window,
        "layer_types": layer_types(config)}


def gguf_sliding_layers(meta: dict[str, Any], arch: str, n: int, default_pattern: int) -> list[int]:
    """The sliding layers as llama.cpp reads them: `<arch>.attention.sliding_window_pattern`, an array of per-layer
    flags or a period p (layer i slides when i % p < p - 1, p = 0: all), else the architecture's period (Gemma 2:
    2, Gemma 3: 6). convert writes none of these for Gemma 2/3, so a checkpoint with other `layer_types` comes
    out with the default pattern, as llama.cpp runs it."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, list):
        return [i for i, swa in enumerate(pattern[:n]) if swa]
    p = int(pattern)
    return [i for i in range(n) if p == 0 or i % p < p - 1]


def gguf_query_scale(meta: dict[str, Any], arch: str, n_layers_27b: int, head_dim: int) -> float:
    """llama.cpp's Gemma query scale (the GGUF has no query_pre_attn_scalar): (d_model / n_heads)^-1/2 for the
    27B (told by its layer count), head_dim^-1/2 otherwise, as Google's configs set query_pre_attn_scalar."""
    d, n_heads = int(meta[f"{arch}.embedding_length"]), int(meta[f"{arch}.attention.head_count"])
    if int(meta[f"{arch}.block_count"]) == n_layers_27b:
        return (d // n_heads) ** -0.5
    return head_dim ** -0.5


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    arch = "gemma2"
    n, d = int(gguf_meta(meta, arch, "block_count", source)), int(gguf_meta(meta, arch, "embedding_length", source))
    key_len = int(meta.get(f"{arch}.attention.key_length", 256))
    window = int(meta.get(f"{arch}.attention.sliding_window", 4096))  # llama.cpp's default for Gemma 2
    attn = AttentionFeatures(query_scale=gguf_query_scale(meta, arch, 46, key_len),
                             logit_softcap=meta.get(f"{arch}.attn_logit_softcapping"),
                             sliding_window=window or None,
                             sliding_layers=gguf_sliding_layers(meta, arch, n, 2) if window else None)
    config = gguf_base_config(meta, tensors, arch, source, tie_embeddings=True, embedding_scale=math.sqrt(d),
                              attn=attn, norm=NormFeatures(placement="sandwich"), mlp=MLPFeatures(act="gelu_tanh"),
                              final_logit_softcap=meta.get(f"{arch}.final_logit_softcapping"))
    if f"{arch}.rope.freq_base_swa" in meta:
        config.rope.local_theta = float(meta[f"{arch}.rope.freq_base_swa"])
    return config


FAMILY = Family(
    name="gemma2",
    hf_model_types=("gemma2",),
    hf_architectures=("Gemma2ForCausalLM",),
    gguf_archs=("gemma2",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=lambda c: llama_rules(c, norm_delta=1.0, norms=NORMS),
    config_from_gguf=config_from_gguf,
    gguf_rules=lambda c: gguf_llama_rules(c, norms=GGUF_NORMS),
)
