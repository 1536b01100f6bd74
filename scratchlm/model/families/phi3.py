"""Phi-3 / Phi-3.5 / Phi-4-mini: the Llama block with fused q/k/v (`qkv_proj`) and gate/up (`gate_up_proj`, gate
first) projections, LongRoPE and partial rotary dims (HF `Phi3ForCausalLM`; GGUF arch `phi3`)."""

from __future__ import annotations

from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig
from scratchlm.model.families.base import (
    Family,
    FamilyError,
    Rule,
    base_config,
    base_hf_config,
    check_act,
    gguf_base_config,
    rename,
    split,
)


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise FamilyError(f"{source}: Phi-3 with attention_bias / mlp_bias is not supported")
    window = cfg.get("sliding_window")
    return base_config(cfg, source, partial_rotary=True,
                       attn=AttentionFeatures(sliding_window=int(window) if window else None),
                       mlp=MLPFeatures(act=check_act(cfg, source)))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    out = base_hf_config(config, "phi3", "Phi3ForCausalLM") | {"sliding_window": config.attn.sliding_window,
                                                                 "attention_bias": False}
    if config.rope.original_max_seq_len is not None:
        out["original_max_position_embeddings"] = config.rope.original_max_seq_len
    if config.rope.rotary_dim is not None:
        out["partial_rotary_factor"] = config.rope.rotary_dim / config.head_dim
    return out


def _fused(config: ModelConfig, prefix: str, names: dict[str, str]) -> list[Rule]:
    """Tensor rules with fused qkv / gate-up under `names` (HF or GGUF spelling)."""
    c, hd = config, config.head_dim
    rules = [rename("tok_embeddings.weight", names["embed"]), rename("norm.weight", names["norm"])]
    if not c.tie_embeddings:
        rules.append(rename("lm_head.weight", names["head"]))
    for i in range(c.n_layers):
        ours, theirs = f"layers.{i}.", prefix.format(i=i)
        rules += [
            split(theirs + names["qkv"], tuple(f"{ours}attn.{p}_proj.weight" for p in "qkv"),
                  (c.n_heads * hd, c.n_kv_heads * hd, c.n_kv_heads * hd)),
            rename(f"{ours}attn.o_proj.weight", theirs + names["o"]),
            rename(f"{ours}attn_norm.weight", theirs + names["attn_norm"]),
            rename(f"{ours}ffn_norm.weight", theirs + names["ffn_norm"]),
            split(theirs + names["gate_up"], (f"{ours}ffn.w1.weight", f"{ours}ffn.w3.weight"), (c.d_ff, c.d_ff)),
            rename(f"{ours}ffn.w2.weight", theirs + names["down"]),
        ]
    return rules


HF_NAMES = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "head": "lm_head.weight",
            "qkv": "self_attn.qkv_proj.weight", "o": "self_attn.o_proj.weight", "attn_norm": "input_layernorm.weight",
            "ffn_norm": "post_attention_layernorm.weight", "gate_up": "mlp.gate_up_proj.weight",
            "down": "mlp.down_proj.weight"}
GGUF_NAMES = {"embed": "token_embd.weight", "norm": "output_norm.weight", "head": "output.weight",
              "qkv": "attn_qkv.weight", "o": "attn_output.weight", "attn_norm": "attn_norm.weight",
              "ffn_norm": "ffn_norm.weight", "gate_up": "ffn_up.weight", "down": "ffn_down.weight"}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    """LongRoPE from `rope_factors_long/short.weight` (see `base.gguf_rope`); a window of 0 is none."""
    window = meta.get("phi3.attention.sliding_window")
    return gguf_base_config(meta, tensors, "phi3", source,
                            attn=AttentionFeatures(sliding_window=int(window) if window else None))


FAMILY = Family(
    name="phi3",
    hf_model_types=("phi3",),
    hf_architectures=("Phi3ForCausalLM",),
    gguf_archs=("phi3",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=lambda c: _fused(c, "model.layers.{i}.", HF_NAMES),
    config_from_gguf=config_from_gguf,
    gguf_rules=lambda c: _fused(c, "blk.{i}.", GGUF_NAMES),
)
