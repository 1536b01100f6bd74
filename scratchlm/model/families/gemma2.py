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
    layers = a.sliding_layers if a.sliding_layers is not None else list(range(config.n_layers))
    return base_hf_config(config, "gemma2", "Gemma2ForCausalLM") | {
        "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": query_pre_attn_scalar(config), "attn_logit_softcapping": a.logit_softcap,
        "final_logit_softcapping": config.final_logit_softcap, "sliding_window": a.sliding_window,
        "layer_types": ["sliding_attention" if a.sliding_window and i in layers else "full_attention"
                        for i in range(config.n_layers)]}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    arch = "gemma2"
    n, d = int(meta.get(f"{arch}.block_count", 0)), int(meta.get(f"{arch}.embedding_length", 0))
    key_len = int(meta.get(f"{arch}.attention.key_length", 256))
    window = meta.get(f"{arch}.attention.sliding_window")
    attn = AttentionFeatures(query_scale=key_len ** -0.5, logit_softcap=meta.get(f"{arch}.attn_logit_softcapping"),
                             sliding_window=int(window) if window else None,
                             sliding_layers=[i for i in range(n) if i % 2 == 0] if window else None)
    return gguf_base_config(meta, tensors, arch, source, tie_embeddings=True, embedding_scale=math.sqrt(d), attn=attn,
                            norm=NormFeatures(placement="sandwich"), mlp=MLPFeatures(act="gelu_tanh"),
                            final_logit_softcap=meta.get(f"{arch}.final_logit_softcapping"))


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
