"""GPT-2 (nanoGPT's model): LayerNorm with biases, learned absolute positions and no RoPE, a plain gelu-tanh MLP,
biases on every linear, fused c_attn, Conv1D weights stored (d_in, d_out) (HF `GPT2LMHeadModel`; GGUF arch
`gpt2`)."""

from __future__ import annotations

from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig, NormFeatures
from scratchlm.model.families.base import Family, FamilyError, Rule, gguf_meta, rename, split, transposed

ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    for key in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if cfg.get(key):
            raise FamilyError(f"{source}: GPT-2 with {key}=true is not supported")
    if cfg.get("scale_attn_weights") is False:
        raise FamilyError(f"{source}: GPT-2 with scale_attn_weights=false is not supported")
    act = cfg.get("activation_function", "gelu_new")
    if act not in ACTS:
        raise FamilyError(f"{source}: activation_function {act!r} is not supported (supported: {sorted(ACTS)})")
    try:
        d = int(cfg["n_embd"])
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]), d_model=d, n_layers=int(cfg["n_layer"]), n_heads=int(cfg["n_head"]),
            d_ff=int(cfg.get("n_inner") or 4 * d), max_seq_len=int(cfg.get("n_positions", 1024)),
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)), rope_layout="none",
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), qkv_bias=True, learned_positions=True,
            attn=AttentionFeatures(o_bias=True), norm=NormFeatures(kind="layer", bias=True),
            mlp=MLPFeatures(act=ACTS[act], gated=False, bias=True))
    except KeyError as e:
        raise FamilyError(f"{source}: required field {e.args[0]!r} is missing") from None


def hf_config(config: ModelConfig) -> dict[str, Any]:
    if config.n_kv_heads != config.n_heads:
        raise ValueError("GPT-2 has no grouped-query attention")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_embd": config.d_model, "n_layer": config.n_layers, "n_head": config.n_heads, "n_inner": config.d_ff,
            "n_positions": config.max_seq_len, "layer_norm_epsilon": config.norm_eps,
            "activation_function": {"gelu_tanh": "gelu_new", "gelu": "gelu"}.get(config.mlp.act, config.mlp.act),
            "tie_word_embeddings": config.tie_embeddings, "scale_attn_weights": True, "torch_dtype": "float32",
            "dtype": "float32"}


def hf_rules(c: ModelConfig) -> list[Rule]:
    d = c.d_model
    rules = [rename("tok_embeddings.weight", "transformer.wte.weight"),
             rename("pos_embeddings.weight", "transformer.wpe.weight"),
             rename("norm.weight", "transformer.ln_f.weight"), rename("norm.bias", "transformer.ln_f.bias")]
    if not c.tie_embeddings:
        rules.append(rename("lm_head.weight", "lm_head.weight"))
    for i in range(c.n_layers):
        o, t = f"layers.{i}.", f"transformer.h.{i}."
        rules += [
            rename(f"{o}attn_norm.weight", f"{t}ln_1.weight"), rename(f"{o}attn_norm.bias", f"{t}ln_1.bias"),
            split(f"{t}attn.c_attn.weight", tuple(f"{o}attn.{p}_proj.weight" for p in "qkv"), (d, d, d), 0, True),
            split(f"{t}attn.c_attn.bias", tuple(f"{o}attn.{p}_bias" for p in "qkv"), (d, d, d)),
            transposed(f"{o}attn.o_proj.weight", f"{t}attn.c_proj.weight"),
            rename(f"{o}attn.o_bias", f"{t}attn.c_proj.bias"),
            rename(f"{o}ffn_norm.weight", f"{t}ln_2.weight"), rename(f"{o}ffn_norm.bias", f"{t}ln_2.bias"),
            transposed(f"{o}ffn.w1.weight", f"{t}mlp.c_fc.weight"), rename(f"{o}ffn.b1", f"{t}mlp.c_fc.bias"),
            transposed(f"{o}ffn.w2.weight", f"{t}mlp.c_proj.weight"), rename(f"{o}ffn.b2", f"{t}mlp.c_proj.bias"),
        ]
    return rules


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    a = "gpt2"
    d = int(gguf_meta(meta, a, "embedding_length", source))
    return ModelConfig(
        vocab_size=int(tensors["token_embd.weight"].shape[0]), d_model=d,
        n_layers=int(gguf_meta(meta, a, "block_count", source)),
        n_heads=int(gguf_meta(meta, a, "attention.head_count", source)),
        d_ff=int(gguf_meta(meta, a, "feed_forward_length", source)),
        max_seq_len=int(gguf_meta(meta, a, "context_length", source)),
        norm_eps=float(meta.get(f"{a}.attention.layer_norm_epsilon", 1e-5)), rope_layout="none",
        tie_embeddings="output.weight" not in tensors, qkv_bias=True, learned_positions=True,
        attn=AttentionFeatures(o_bias=True), norm=NormFeatures(kind="layer", bias=True),
        mlp=MLPFeatures(act="gelu_tanh", gated=False, bias=True))


def gguf_rules(c: ModelConfig) -> list[Rule]:
    """llama.cpp's gpt2 names; its converter stores the Conv1D weights transposed to (d_out, d_in) already."""
    d = c.d_model
    rules = [rename("tok_embeddings.weight", "token_embd.weight"),
             rename("pos_embeddings.weight", "position_embd.weight"),
             rename("norm.weight", "output_norm.weight"), rename("norm.bias", "output_norm.bias")]
    if not c.tie_embeddings:
        rules.append(rename("lm_head.weight", "output.weight"))
    for i in range(c.n_layers):
        o, t = f"layers.{i}.", f"blk.{i}."
        rules += [
            rename(f"{o}attn_norm.weight", f"{t}attn_norm.weight"),
            rename(f"{o}attn_norm.bias", f"{t}attn_norm.bias"),
            split(f"{t}attn_qkv.weight", tuple(f"{o}attn.{p}_proj.weight" for p in "qkv"), (d, d, d)),
            split(f"{t}attn_qkv.bias", tuple(f"{o}attn.{p}_bias" for p in "qkv"), (d, d, d)),
            rename(f"{o}attn.o_proj.weight", f"{t}attn_output.weight"),
            rename(f"{o}attn.o_bias", f"{t}attn_output.bias"),
            rename(f"{o}ffn_norm.weight", f"{t}ffn_norm.weight"), rename(f"{o}ffn_norm.bias", f"{t}ffn_norm.bias"),
            rename(f"{o}ffn.w1.weight", f"{t}ffn_up.weight"), rename(f"{o}ffn.b1", f"{t}ffn_up.bias"),
            rename(f"{o}ffn.w2.weight", f"{t}ffn_down.weight"), rename(f"{o}ffn.b2", f"{t}ffn_down.bias"),
        ]
    return rules


FAMILY = Family(
    name="gpt2",
    hf_model_types=("gpt2",),
    hf_architectures=("GPT2LMHeadModel",),
    gguf_archs=("gpt2",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=hf_rules,
    config_from_gguf=config_from_gguf,
    gguf_rules=gguf_rules,
)
