"""GPT-2 (nanoGPT's model): LayerNorm with biases, learned absolute positions and no RoPE, a plain gelu-tanh MLP,
biases on every linear, fused c_attn, Conv1D weights stored (d_in, d_out) (HF `GPT2LMHeadModel`; GGUF arch
`gpt2`)."""

from __future__ import annotations

from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig, NormFeatures
from scratchlm.model.families.base import Family, FamilyError, Rule, gguf_meta, rename, split, transposed

ACTS = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}


def _block(act: str) -> dict[str, Any]:
    """GPT-2's block as `ModelConfig` features: learned positions and no RoPE, biases everywhere, LayerNorm, a plain
    MLP."""
    return dict(rope_layout="none", learned_positions=True, qkv_bias=True, attn=AttentionFeatures(o_bias=True),
                norm=NormFeatures(kind="layer", bias=True), mlp=MLPFeatures(act=act, gated=False, bias=True))


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
            norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", True)), **_block(ACTS[act]))
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


#: The tensor names of GPT-2's block in each format: {our piece: (HF name, GGUF name)} with {t} the layer prefix.
NAMES = {
    "embed": ("transformer.wte.weight", "token_embd.weight"), "pos": ("transformer.wpe.weight", "position_embd.weight"),
    "norm": ("transformer.ln_f", "output_norm"), "head": ("lm_head.weight", "output.weight"),
    "ln_1": ("{t}ln_1", "{t}attn_norm"), "qkv": ("{t}attn.c_attn", "{t}attn_qkv"),
    "o": ("{t}attn.c_proj", "{t}attn_output"), "ln_2": ("{t}ln_2", "{t}ffn_norm"),
    "fc": ("{t}mlp.c_fc", "{t}ffn_up"), "proj": ("{t}mlp.c_proj", "{t}ffn_down"),
}


def _rules(c: ModelConfig, gguf: bool) -> list[Rule]:
    """GPT-2's tensors in HF (`transformer.h.N.`, Conv1D weights stored (d_in, d_out)) or llama.cpp's names (`blk.N.`,
    its converter stores them transposed to (d_out, d_in) already)."""
    d, prefix = c.d_model, "blk.{i}." if gguf else "transformer.h.{i}."

    def name(piece: str, i: int = 0) -> str:
        return NAMES[piece][gguf].format(t=prefix.format(i=i))

    def weight(ours: str, piece: str, i: int) -> Rule:  # a Conv1D weight
        theirs = name(piece, i) + ".weight"
        return rename(ours, theirs) if gguf else transposed(ours, theirs)

    rules = [rename("tok_embeddings.weight", name("embed")), rename("pos_embeddings.weight", name("pos")),
             rename("norm.weight", name("norm") + ".weight"), rename("norm.bias", name("norm") + ".bias")]
    if not c.tie_embeddings:
        rules.append(rename("lm_head.weight", name("head")))
    for i in range(c.n_layers):
        o = f"layers.{i}."
        rules += [
            rename(f"{o}attn_norm.weight", name("ln_1", i) + ".weight"),
            rename(f"{o}attn_norm.bias", name("ln_1", i) + ".bias"),
            split(name("qkv", i) + ".weight", tuple(f"{o}attn.{p}_proj.weight" for p in "qkv"), (d, d, d), 0,
                  transpose=not gguf),
            split(name("qkv", i) + ".bias", tuple(f"{o}attn.{p}_bias" for p in "qkv"), (d, d, d)),
            weight(f"{o}attn.o_proj.weight", "o", i), rename(f"{o}attn.o_bias", name("o", i) + ".bias"),
            rename(f"{o}ffn_norm.weight", name("ln_2", i) + ".weight"),
            rename(f"{o}ffn_norm.bias", name("ln_2", i) + ".bias"),
            weight(f"{o}ffn.w1.weight", "fc", i), rename(f"{o}ffn.b1", name("fc", i) + ".bias"),
            weight(f"{o}ffn.w2.weight", "proj", i), rename(f"{o}ffn.b2", name("proj", i) + ".bias"),
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
        norm_eps=float(meta.get(f"{a}.attention.layer_norm_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensors, **_block("gelu_tanh"))


FAMILY = Family(
    name="gpt2",
    hf_model_types=("gpt2",),
    hf_architectures=("GPT2LMHeadModel",),
    gguf_archs=("gpt2",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=lambda c: _rules(c, gguf=False),
    config_from_gguf=config_from_gguf,
    gguf_rules=lambda c: _rules(c, gguf=True),
)
