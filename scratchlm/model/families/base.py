"""What a model family declares, and the pieces most families share.

A `Family` is data: the HF `model_type`s and GGUF architectures it answers to, the translation of its configs
(HF config.json -> `ModelConfig` -> HF, GGUF metadata -> `ModelConfig`) and its tensor tables. A tensor table is
a list of `Rule`s, each tying one tensor of the file to one or more of `TransformerLM`'s state-dict entries, with
the transform both ways (q/k permutes, fused qkv and gate/up splits, transposed Conv1D weights, Gemma's (1 + w)
norms folded into the gain). Every reader (HF safetensors, GGUF float and packed, the sharded loader of tensor-
parallel ranks) and the HF exporter go through these tables; none keeps its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig, MoEFeatures, RopeFeatures


class FamilyError(ValueError):
    """A config or file this family cannot express (the message names the field)."""


@dataclass(frozen=True)
class Rule:
    """One file tensor `theirs` <-> the state-dict entries `ours`.

    `load(t) -> tuple of tensors` (one per name of `ours`) and `save(*tensors) -> t` are inverse transforms;
    the default is the identity on a single tensor. `rows`: the load transform only moves or splits rows (dim 0),
    so it applies unchanged to each plane of a row-blocked quantized tensor (codes, scales) without dequantizing.
    """

    theirs: str
    ours: tuple[str, ...]
    load: Callable[[Tensor], tuple[Tensor, ...]] | None = None
    save: Callable[..., Tensor] | None = None
    rows: bool = True

    def to_ours(self, t: Tensor) -> list[tuple[str, Tensor]]:
        parts = (t,) if self.load is None else self.load(t)
        return list(zip(self.ours, parts, strict=True))

    def to_theirs(self, state: dict[str, Tensor]) -> Tensor:
        parts = [state[n] for n in self.ours]
        return parts[0] if self.save is None else self.save(*parts)


def rename(ours: str, theirs: str) -> Rule:
    return Rule(theirs, (ours,))


def norm_rule(ours: str, theirs: str, delta: float) -> Rule:
    """A norm gain: renamed, or stored as (w - delta) when `delta` (Gemma's (1 + w) gains in HF files)."""
    return offset(ours, theirs, delta) if delta else rename(ours, theirs)


def offset(ours: str, theirs: str, delta: float) -> Rule:
    """A gain stored as (w - delta) in the file (Gemma's norms keep w with a (1 + w) gain): ours = file + delta."""
    return Rule(theirs, (ours,), lambda t: (t.float().add(delta).to(t.dtype),),
                lambda w: w.float().sub(delta).to(w.dtype), rows=False)


def split(theirs: str, ours: tuple[str, ...], sizes: tuple[int, ...], dim: int = 0, transpose: bool = False) -> Rule:
    """One fused file tensor cut into `ours` along `dim` (after transposing a Conv1D weight when `transpose`)."""

    def load(t: Tensor) -> tuple[Tensor, ...]:
        if transpose:
            t = t.t()
        return tuple(p.contiguous() for p in torch.split(t, sizes, dim=dim))

    def save(*parts: Tensor) -> Tensor:
        t = torch.cat(parts, dim=dim)
        return t.t().contiguous() if transpose else t

    return Rule(theirs, ours, load, save, rows=not transpose and dim == 0)


def transposed(ours: str, theirs: str) -> Rule:
    """A Conv1D weight (d_in, d_out) in the file, (d_out, d_in) here."""
    return Rule(theirs, (ours,), lambda t: (t.t().contiguous(),), lambda w: w.t().contiguous(), rows=False)


def permute_to_adjacent(w: Tensor, n_heads: int) -> Tensor:
    """Per head, rotate-half rows (0..D/2, D/2..D) -> adjacent pairs (0,D/2),(1,D/2+1).. (llama.cpp's permute)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def permute_to_half(w: Tensor, n_heads: int) -> Tensor:
    """Per head, adjacent-pair rows (0,1),(2,3).. -> rotate-half (0,2,4..,1,3,5..): undoes `permute_to_adjacent`."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermuted(ours: str, theirs: str, n_heads: int) -> Rule:
    """A q/k weight or bias stored in llama.cpp's adjacent-pair row order; ours is rotate-half."""
    return Rule(theirs, (ours,), lambda t: (permute_to_half(t, n_heads),), lambda w: permute_to_adjacent(w, n_heads))


@dataclass(frozen=True)
class Family:
    """A model family as data (see the module docstring)."""

    name: str
    hf_model_types: tuple[str, ...] = ()
    hf_architectures: tuple[str, ...] = ()
    gguf_archs: tuple[str, ...] = ()
    config_from_hf: Callable[[dict[str, Any], str], ModelConfig] | None = None
    hf_config: Callable[[ModelConfig], dict[str, Any]] | None = None
    hf_rules: Callable[[ModelConfig], list[Rule]] | None = None
    config_from_gguf: Callable[[dict[str, Any], dict[str, Any], str], ModelConfig] | None = None
    gguf_rules: Callable[[ModelConfig], list[Rule]] | None = None
    hf_unused: Callable[[dict[str, Any]], dict[str, str]] | None = field(default=None, metadata={
        "help": "{tensor-name prefix: why} of an HF checkpoint's tensors the model does not use (DeepSeek-V3's "
                "multi-token-prediction layer); the loader skips them and logs why, every other unread tensor "
                "is an error"})
    export_rank: int = field(default=50, metadata={
        "help": "the exporter tries families in this order and takes the first whose HF config reproduces the "
                "ModelConfig: the plainest (Llama 0, Qwen2 10) come first, so a plain model is exported as Llama"})
    hf_file_rules: Callable[[ModelConfig, Collection[str]], list[Rule]] | None = field(default=None, metadata={
        "help": "the tensor rules for an HF file holding these tensor names, for a family whose files come in more "
                "than one layout (MoE experts: per-expert tensors, or transformers 5's fused 3D ones); None: "
                "hf_rules whatever the file holds. The exporter writes hf_rules' layout"})

    def hf_rules_for(self, config: ModelConfig, names: Collection[str] | None = None) -> list[Rule]:
        """The HF tensor rules for a file holding the tensors `names` (None: the layout the exporter writes)."""
        if names is not None and self.hf_file_rules is not None:
            return self.hf_file_rules(config, names)
        return self.hf_rules(config)


# ---------------------------------------------------------------------------------------------- HF configs
def need(cfg: dict[str, Any], key: str, source: str) -> Any:
    if cfg.get(key) is None:
        raise FamilyError(f"{source}: required field {key!r} is missing")
    return cfg[key]


def rope_parameters(cfg: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameters of an HF config in either format: transformers 5's `rope_parameters` (maybe per layer
    type: `layer_type`, default the full-attention layers') or the older `rope_theta` + `rope_scaling`; one flat
    dict with `rope_type` and `rope_theta`."""
    params = cfg.get("rope_parameters")
    nested = isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params)
    if nested:
        params = params.get(layer_type or "full_attention") or {}
    out: dict[str, Any] = dict(params) if isinstance(params, dict) else {}
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and scaling and not nested:  # the older key, beside or instead of the new one
        kind = scaling.get("rope_type", scaling.get("type"))
        if out.get("rope_type", out.get("type", "default")) in ("default", None):
            out.update(scaling)
        elif kind not in (None, out.get("rope_type", out.get("type"))):
            raise FamilyError(f"rope_parameters ({out.get('rope_type')!r}) and rope_scaling ({kind!r}) disagree")
    if "type" in out and "rope_type" not in out:
        out["rope_type"] = out.pop("type")
    out.pop("type", None)
    out.setdefault("rope_type", "default")
    if out.get("rope_theta") is None:
        out["rope_theta"] = cfg.get("rope_theta", 10_000.0)
    return out


_SCALINGS = {"default": "none", "linear": "linear", "dynamic": "dynamic", "llama3": "llama3", "yarn": "yarn",
             "longrope": "longrope", "su": "longrope"}
_KNOWN_ROPE_KEYS = {"rope_type", "type", "rope_theta", "factor", "original_max_position_embeddings", "low_freq_factor",
                    "high_freq_factor", "beta_fast", "beta_slow", "attention_factor", "short_factor", "long_factor",
                    "partial_rotary_factor", "truncate", "mscale", "mscale_all_dim"}


def rope_features(params: dict[str, Any], cfg: dict[str, Any], head_dim: int, source: str) -> RopeFeatures:
    """`RopeFeatures` from `rope_parameters(...)`; unknown scalings and parameters are errors naming them."""
    kind = params["rope_type"]
    if kind not in _SCALINGS:
        raise FamilyError(f"{source}: RoPE scaling {kind!r} is not supported (supported: {sorted(_SCALINGS)})")
    unknown = sorted(set(params) - _KNOWN_ROPE_KEYS)
    if unknown:
        raise FamilyError(f"{source}: RoPE parameters {unknown} are not supported")
    truncate = params.get("truncate", True)
    if truncate is not True and (truncate is not False or _SCALINGS[kind] != "yarn"):
        raise FamilyError(f"{source}: RoPE truncate={truncate!r} is not supported (YaRN's true or false only)")
    if (params.get("mscale") or params.get("mscale_all_dim")) and _SCALINGS[kind] != "yarn":
        raise FamilyError(f"{source}: mscale / mscale_all_dim with RoPE scaling {kind!r} are not supported (YaRN only)")
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) or 1.0)
    rotary_dim = int(head_dim * partial) if partial != 1.0 else None
    scaling = _SCALINGS[kind]
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    orig = cfg.get("original_max_position_embeddings", params.get("original_max_position_embeddings"))
    if orig is None and scaling in ("llama3", "yarn", "longrope"):
        orig = max_pos  # transformers' default (standardize_rope_params)
    factor = params.get("factor")
    if scaling in ("yarn", "longrope") and factor is None:
        factor = max_pos / orig
    if scaling == "dynamic":
        orig = max_pos  # HF's dynamic NTK grows theta past max_position_embeddings
    feats = RopeFeatures(
        scaling=scaling, factor=float(factor if factor is not None else 1.0),
        original_max_seq_len=None if orig is None else int(orig),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)), high_freq_factor=float(
            params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        short_factor=list(params["short_factor"]) if params.get("short_factor") is not None else None,
        long_factor=list(params["long_factor"]) if params.get("long_factor") is not None else None,
        rotary_dim=rotary_dim,
        mscale=float(params["mscale"]) if params.get("mscale") is not None else None,
        mscale_all_dim=float(params["mscale_all_dim"]) if params.get("mscale_all_dim") is not None else None,
        truncate=truncate,
    )
    return feats


def base_config(cfg: dict[str, Any], source: str, *, partial_rotary: bool = False, **fields: Any) -> ModelConfig:
    """The fields every HF decoder config spells alike, then `fields` on top. `partial_rotary`: whether the family's
    HF model rotates only part of each head (others ignore a partial_rotary_factor: it is then an error)."""
    n_heads = int(need(cfg, "num_attention_heads", source))
    d_model = int(need(cfg, "hidden_size", source))
    head_dim = int(cfg.get("head_dim") or d_model // n_heads)
    params = rope_parameters(cfg)
    rope = rope_features(params, cfg, head_dim, source)
    if rope.rotary_dim is not None and not partial_rotary:
        raise FamilyError(f"{source}: partial_rotary_factor is not supported by this family's model")
    base = dict(
        vocab_size=int(need(cfg, "vocab_size", source)),
        d_model=d_model,
        n_layers=int(need(cfg, "num_hidden_layers", source)),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        d_ff=int(need(cfg, "intermediate_size", source)),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=float(params["rope_theta"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_layout="half",
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        head_dim=head_dim,
        rope=rope,
    )
    try:
        return ModelConfig(**(base | fields))
    except ValueError as e:
        raise FamilyError(f"{source}: {e}") from None


def check_act(cfg: dict[str, Any], source: str, key: str = "hidden_act", allowed: dict[str, str] | None = None) -> str:
    """The config's activation as a `MLPFeatures.act` name; others are an error."""
    allowed = allowed or {"silu": "silu", "swish": "silu"}
    act = cfg.get(key, "silu")
    if act not in allowed:
        raise FamilyError(f"{source}: {key} {act!r} is not supported (supported: {sorted(allowed)})")
    return allowed[act]


def sliding_layers_from_types(cfg: dict[str, Any], n_layers: int) -> list[int] | None:
    """Layers marked "sliding_attention" in transformers' `layer_types`, or None when it is absent."""
    types = cfg.get("layer_types")
    if not types:
        return None
    return [i for i, t in enumerate(types[:n_layers]) if t == "sliding_attention"]


def layer_types(config: ModelConfig) -> list[str]:
    """transformers' `layer_types` of `config` (the inverse of `sliding_layers_from_types`)."""
    return ["sliding_attention" if config.window(i) is not None else "full_attention" for i in range(config.n_layers)]


def rope_to_hf(config: ModelConfig) -> dict[str, Any]:
    """HF `rope_parameters` (transformers 5) and the older `rope_theta` / `rope_scaling` keys for `config`."""
    r = config.rope
    params: dict[str, Any] = {"rope_type": "default" if r.scaling == "none" else r.scaling,
                              "rope_theta": config.rope_theta}
    if r.scaling != "none":
        params["factor"] = r.factor
    if r.original_max_seq_len is not None and r.scaling in ("llama3", "yarn", "longrope"):
        params["original_max_position_embeddings"] = r.original_max_seq_len
    if r.scaling == "llama3":
        params.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.scaling == "yarn":
        params.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow)
        if not r.truncate:
            params["truncate"] = False
    if r.scaling in ("yarn", "longrope") and r.attention_factor is not None:
        params["attention_factor"] = r.attention_factor
    params.update({k: getattr(r, k) for k in ("mscale", "mscale_all_dim") if getattr(r, k) is not None})
    if r.scaling == "longrope":
        params.update(short_factor=r.short_factor, long_factor=r.long_factor)
    if r.rotary_dim is not None:
        params["partial_rotary_factor"] = r.rotary_dim / config.head_dim
    out: dict[str, Any] = {"rope_parameters": params, "rope_theta": config.rope_theta}
    if r.scaling != "none":
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return out


def base_hf_config(config: ModelConfig, model_type: str, architecture: str) -> dict[str, Any]:
    """The config.json fields every HF decoder spells alike."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_dim,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "dtype": "float32",
        "bos_token_id": None,  # the exporter fills in the tokenizer's; never a family default outside the vocab
        "eos_token_id": None,
        "pad_token_id": None,
    } | rope_to_hf(config)


# ---------------------------------------------------------------------------------------------- HF tensors
def llama_rules(config: ModelConfig, *, prefix: str = "model.", norm_delta: float = 0.0,
                norms: dict[str, str] | None = None, moe: MoENames | None = None,
                present: Collection[str] | None = None) -> list[Rule]:
    """The Llama tensor names (q/k/v/o_proj, gate/up/down_proj, the block's norms, embed_tokens, norm, lm_head)
    for every tensor `TransformerLM(config)` has. `norms`: our norm module -> the family's HF name; `norm_delta`:
    the (delta + w) gain of Gemma's norms, folded in at load. The MoE layers' feed-forward is spelled as `moe`
    says (`moe_hf_rules`; `present`: the file's tensor names, which pick the per-expert or the fused layout)."""
    norms = norms or {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}

    def norm(ours: str, theirs: str) -> Rule:
        return norm_rule(ours, theirs, norm_delta)

    rules = [rename("tok_embeddings.weight", f"{prefix}embed_tokens.weight"),
             norm("norm.weight", f"{prefix}norm.weight")]
    if not config.tie_embeddings:
        rules.append(rename("lm_head.weight", "lm_head.weight"))
    a = config.attn
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"{prefix}layers.{i}."
        for p in ("q", "k", "v", "o"):
            rules.append(rename(f"{ours}attn.{p}_proj.weight", f"{theirs}self_attn.{p}_proj.weight"))
        if config.qkv_bias:
            rules += [rename(f"{ours}attn.{p}_bias", f"{theirs}self_attn.{p}_proj.bias") for p in "qkv"]
        if a.o_bias:
            rules.append(rename(f"{ours}attn.o_bias", f"{theirs}self_attn.o_proj.bias"))
        if a.qk_norm != "none":
            rules += [norm(f"{ours}attn.{p}_norm.weight", f"{theirs}self_attn.{p}_norm.weight") for p in "qk"]
        for ours_norm, theirs_norm in norms.items():
            rules.append(norm(f"{ours}{ours_norm}.weight", f"{theirs}{theirs_norm}.weight"))
        if config.is_moe_layer(i):
            rules += moe_hf_rules(config, ours, theirs, moe or MoENames(), present)
            continue
        for w, p in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
            rules.append(rename(f"{ours}ffn.{w}.weight", f"{theirs}mlp.{p}.weight"))
        if config.mlp.bias:
            rules += [rename(f"{ours}ffn.{b}", f"{theirs}mlp.{p}.bias")
                      for b, p in (("b1", "gate_proj"), ("b2", "down_proj"), ("b3", "up_proj"))]
    return rules


# ---------------------------------------------------------------------------------------------- GGUF
#: Tensors of a GGUF file that `config_from_gguf` reads into the config (RoPE frequency factors), not weights.
GGUF_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def gguf_meta(meta: dict[str, Any], arch: str, key: str, source: str, default: Any = None) -> Any:
    value = meta.get(f"{arch}.{key}", default)
    if value is None:
        raise FamilyError(f"{source}: metadata {arch}.{key} is missing")
    return value


def gguf_vector(tensors: dict[str, Any], name: str, source: str) -> list[float]:
    """A small float tensor of the file (RoPE factors) as a list, each value the shortest decimal that rounds to
    the same float32 (as the config.json lists they were written from: 2.3, not 2.299999952...); F32 or F16."""
    t = tensors[name]
    if getattr(t, "type_name", None) not in ("F32", "F16") or getattr(t, "data", None) is None:
        raise FamilyError(f"{source}: tensor {name} must be F32 or F16 data (got {getattr(t, 'type_name', None)})")
    return [float(str(x)) for x in np.asarray(t.data, dtype=np.float32).reshape(-1)]


def llama3_from_freq_factors(factors: list[float], head_dim: int, theta: float, source: str) -> RopeFeatures:
    """Llama 3 RoPE scaling recovered from llama.cpp's `rope_freqs.weight`: convert stores the llama3 scaling as
    per-frequency divisors of the plain frequencies (and no scaling metadata). The divisors depend on (factor,
    orig / low_freq_factor, orig / high_freq_factor) only, so low_freq_factor is taken as 1 and high_freq_factor
    as 4 (every Llama 3.x) unless two or more blended frequencies pin both; the result is checked to reproduce
    every divisor (relative 1e-5), and anything else is an error rather than a silent approximation."""
    from scratchlm.model.rope import inv_freq

    f = np.asarray(factors, dtype=np.float64)
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)
    if len(f) != len(plain):
        raise FamilyError(f"{source}: rope_freqs.weight has {len(f)} factors for {len(plain)} frequencies")
    factor = float(f.max())
    wavelen = 2 * math.pi / plain
    medium = (f > 1 + 1e-6) & (f < factor * (1 - 1e-6))
    smooth = (1 / f[medium] - 1 / factor) / (1 - 1 / factor) if factor > 1 else f[medium]
    low, high = 1.0, 4.0
    if medium.sum() >= 2:  # smooth = orig/(high-low) / wavelen - low/(high-low): a line in 1/wavelen
        a, b = np.polyfit(1 / wavelen[medium], smooth, 1)
        high = 1 - 1 / b if b < 0 else high
        orig = -a / b if b < 0 else 0.0
    elif medium.sum() == 1:
        orig = float(wavelen[medium][0] * (low + smooth[0] * (high - low)))
    else:  # no blended frequency: any boundary between the kept and the divided wavelengths
        divided = wavelen[f >= factor * (1 - 1e-6)]
        orig = float(divided.min()) if len(divided) else 0.0
    rope = RopeFeatures(scaling="llama3", factor=factor, original_max_seq_len=max(int(round(orig)), 1),
                        low_freq_factor=low, high_freq_factor=float(round(high, 4)))
    ours = plain / inv_freq(head_dim, theta, rope)[0].double().numpy()
    if factor <= 1 or not np.allclose(ours, f, rtol=1e-5, atol=0):
        raise FamilyError(f"{source}: rope_freqs.weight is not a Llama 3 RoPE scaling this loader can express "
                          f"(factors {np.round(f, 4).tolist()})")
    return rope


def gguf_rope(meta: dict[str, Any], tensors: dict[str, Any], arch: str, head_dim: int, theta: float,
              source: str) -> RopeFeatures:
    """The RoPE features of a GGUF file: `<arch>.rope.dimension_count` (partial rotary), `<arch>.rope.scaling.*`
    (linear, yarn) and the frequency-factor tensors (`rope_freqs.weight`: Llama 3; `rope_factors_long/short`:
    LongRoPE with `<arch>.rope.scaling.original_context_length` and `attn_factor`). Unknown kinds are errors."""
    rotary = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    rope = RopeFeatures(rotary_dim=rotary if rotary != head_dim else None)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling == "linear":
            rope.scaling, rope.factor = "linear", float(meta[f"{arch}.rope.scaling.factor"])
        elif scaling == "yarn":
            rope.scaling, rope.factor = "yarn", float(meta[f"{arch}.rope.scaling.factor"])
            rope.original_max_seq_len = int(meta[f"{arch}.rope.scaling.original_context_length"])
            for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                              ("yarn_attn_factor", "attention_factor")):
                if meta.get(f"{arch}.rope.scaling.{key}") is not None:
                    setattr(rope, name, float(meta[f"{arch}.rope.scaling.{key}"]))
        elif scaling != "longrope":
            raise FamilyError(f"{source}: GGUF RoPE scaling {scaling!r} is not supported")
    long, short = "rope_factors_long.weight" in tensors, "rope_factors_short.weight" in tensors
    if long or short or scaling == "longrope":
        if not (long and short):
            raise FamilyError(f"{source}: LongRoPE needs both rope_factors_long.weight and rope_factors_short.weight")
        orig = int(gguf_meta(meta, arch, "rope.scaling.original_context_length", source))
        rope.scaling, rope.original_max_seq_len = "longrope", orig
        rope.factor = int(gguf_meta(meta, arch, "context_length", source)) / orig
        rope.long_factor = gguf_vector(tensors, "rope_factors_long.weight", source)
        rope.short_factor = gguf_vector(tensors, "rope_factors_short.weight", source)
        attn = meta.get(f"{arch}.rope.scaling.attn_factor")
        default = 1.0 if rope.factor <= 1 else math.sqrt(1 + math.log(rope.factor) / math.log(orig))
        rope.attention_factor = None if attn is None or abs(float(attn) - default) < 1e-6 else float(attn)
    if "rope_freqs.weight" in tensors:
        if rope.scaling != "none":
            raise FamilyError(f"{source}: rope_freqs.weight together with RoPE scaling {rope.scaling!r}")
        llama3 = llama3_from_freq_factors(gguf_vector(tensors, "rope_freqs.weight", source), rotary, theta, source)
        llama3.rotary_dim = rope.rotary_dim
        rope = llama3
    return rope


def gguf_base_config(meta: dict[str, Any], tensors: dict[str, Any], arch: str, source: str,
                     **fields: Any) -> ModelConfig:
    """The GGUF metadata keys every llama.cpp architecture spells alike, then `fields` on top. Biases are read
    off the tensor list (q/k/v: `blk.0.attn_q.bias`; output: `attn_output.bias`; MLP: `ffn_up.bias`)."""
    if "token_embd.weight" not in tensors:
        raise FamilyError(f"{source}: no token_embd.weight tensor")
    d_model = int(gguf_meta(meta, arch, "embedding_length", source))
    n_heads = int(gguf_meta(meta, arch, "attention.head_count", source))
    head_dim = int(meta.get(f"{arch}.attention.key_length", 0) or d_model // n_heads)
    n_kv = meta.get(f"{arch}.attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        if len(set(n_kv)) != 1:
            raise FamilyError(f"{source}: per-layer kv head counts {sorted(set(n_kv))} are not supported")
        n_kv = n_kv[0]
    theta = float(meta.get(f"{arch}.rope.freq_base", 10_000.0))
    eps = meta.get(f"{arch}.attention.layer_norm_rms_epsilon", meta.get(f"{arch}.attention.layer_norm_epsilon", 1e-5))
    mlp_bias = "blk.0.ffn_up.bias" in tensors
    base = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[0]),
        d_model=d_model,
        n_layers=int(gguf_meta(meta, arch, "block_count", source)),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        d_ff=int(gguf_meta(meta, arch, "feed_forward_length", source)),
        max_seq_len=int(meta.get(f"{arch}.context_length", 2048)),
        rope_theta=theta,
        norm_eps=float(eps),
        rope_layout="half",
        tie_embeddings="output.weight" not in tensors,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        head_dim=head_dim,
        rope=gguf_rope(meta, tensors, arch, head_dim, theta, source),
        attn=AttentionFeatures(o_bias="blk.0.attn_output.bias" in tensors),
        mlp=MLPFeatures(bias=mlp_bias),
    )
    for name, sub in (("attn", "o_bias"), ("mlp", "bias")):  # a family's own sub-config keeps the file's biases
        if name in fields:
            fields[name] = replace(fields[name], **{sub: getattr(base[name], sub)})
    try:
        return ModelConfig(**(base | fields))
    except ValueError as e:
        raise FamilyError(f"{source}: {e}") from None


def gguf_llama_rules(config: ModelConfig, *, permute_qk: bool = False, norm_delta: float = 0.0,
                     norms: dict[str, str] | None = None) -> list[Rule]:
    """llama.cpp's tensor names for `TransformerLM(config)` (token_embd, blk.N.attn_q ...): q/k rows in the
    adjacent-pair order when `permute_qk` (llama.cpp's converter permutes the `llama` arch's), Gemma's norm
    gains stored as (w - 1) when `norm_delta` is 1 (llama.cpp stores the (1 + w) already added: delta 0). The MoE
    layers' feed-forward: `moe_gguf_rules`."""
    norms = norms or {"attn_norm": "attn_norm", "ffn_norm": "ffn_norm"}

    def norm(ours: str, theirs: str) -> Rule:
        return norm_rule(ours, theirs, norm_delta)

    rules = [rename("tok_embeddings.weight", "token_embd.weight"), norm("norm.weight", "output_norm.weight")]
    if not config.tie_embeddings:
        rules.append(rename("lm_head.weight", "output.weight"))
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"blk.{i}."
        for p, g in (("q", "attn_q"), ("k", "attn_k")):
            heads = config.n_heads if p == "q" else config.n_kv_heads
            names = [("weight", f"{p}_proj.weight")] + ([("bias", f"{p}_bias")] if config.qkv_bias else [])
            for kind, our in names:
                rules.append(unpermuted(f"{ours}attn.{our}", f"{theirs}{g}.{kind}", heads) if permute_qk
                             else rename(f"{ours}attn.{our}", f"{theirs}{g}.{kind}"))
        rules.append(rename(f"{ours}attn.v_proj.weight", f"{theirs}attn_v.weight"))
        if config.qkv_bias:
            rules.append(rename(f"{ours}attn.v_bias", f"{theirs}attn_v.bias"))
        rules.append(rename(f"{ours}attn.o_proj.weight", f"{theirs}attn_output.weight"))
        if config.attn.o_bias:
            rules.append(rename(f"{ours}attn.o_bias", f"{theirs}attn_output.bias"))
        if config.attn.qk_norm != "none":
            rules += [norm(f"{ours}attn.{p}_norm.weight", f"{theirs}attn_{p}_norm.weight") for p in "qk"]
        for ours_norm, theirs_norm in norms.items():
            rules.append(norm(f"{ours}{ours_norm}.weight", f"{theirs}{theirs_norm}.weight"))
        if config.is_moe_layer(i):
            rules += moe_gguf_rules(config, ours, theirs)
            continue
        for w, g in (("w1", "ffn_gate"), ("w2", "ffn_down"), ("w3", "ffn_up")):
            rules.append(rename(f"{ours}ffn.{w}.weight", f"{theirs}{g}.weight"))
        if config.mlp.bias:
            rules += [rename(f"{ours}ffn.{b}", f"{theirs}{g}.bias")
                      for b, g in (("b1", "ffn_gate"), ("b2", "ffn_down"), ("b3", "ffn_up"))]
    return rules


# ---------------------------------------------------------------------------------------------- MoE tensors
@dataclass(frozen=True)
class MoENames:
    """How a family's HF files spell a mixture-of-experts layer under `model.layers.N.`: the block (Mixtral's
    `block_sparse_moe`, Qwen's `mlp`), the experts' three linears (w1 gate, w2 down, w3 up), the shared expert and
    its sigmoid gate. transformers 5 loads these per-expert names (the Hub's, and what its `save_pretrained`
    writes) into fused 3D parameters under `mlp.`; a file saved in that fused layout is read too."""

    block: str = "mlp"
    experts: tuple[str, str, str] = ("gate_proj", "down_proj", "up_proj")
    shared: str = "shared_expert"
    shared_gate: str = "shared_expert_gate"


def _expert_names(config: ModelConfig, ours: str, w: str) -> tuple[str, ...]:
    return tuple(f"{ours}ffn.experts.{e}.{w}.weight" for e in range(config.moe.n_experts))


def stacked(theirs: str, ours: tuple[str, ...]) -> Rule:
    """A stacked expert tensor (E, rows, cols) <-> one (rows, cols) weight per expert. The load flattens the
    leading dims into rows and cuts E equal row ranges, so it applies unchanged to the planes of a packed GGUF
    tensor, (E * rows, bytes), without dequantizing; the pieces are views of the stacked tensor."""
    n = len(ours)

    def load(t: Tensor) -> tuple[Tensor, ...]:
        return tuple(t.reshape(n, -1, t.shape[-1]).unbind(0))  # (E, rows, cols) -> E x (rows, cols)

    return Rule(theirs, ours, load, lambda *parts: torch.stack(parts))


def stacked_pair(theirs: str, first: tuple[str, ...], second: tuple[str, ...]) -> Rule:
    """A stacked fused tensor (E, 2 * rows, cols), each expert's first half `first[e]` (gate) and second half
    `second[e]` (up): transformers 5's `experts.gate_up_proj`."""
    n = len(first)

    def load(t: Tensor) -> tuple[Tensor, ...]:
        halves = t.reshape(n, 2, -1, t.shape[-1])  # (E, 2, rows, cols)
        return tuple(halves[:, 0].unbind(0)) + tuple(halves[:, 1].unbind(0))

    def save(*parts: Tensor) -> Tensor:
        return torch.cat([torch.stack(parts[:n]), torch.stack(parts[n:])], dim=1)

    return Rule(theirs, first + second, load, save)


def _shared_rules(config: ModelConfig, ours: str, names: dict[str, str], gate: str | None) -> list[Rule]:
    """The shared expert's linears (`names`: w1/w2/w3 -> file names) and its gate."""
    if not config.moe.d_shared:
        return []
    rules = [rename(f"{ours}ffn.shared.{w}.weight", theirs) for w, theirs in names.items()]
    if config.moe.shared_gate and gate is not None:
        rules.append(rename(f"{ours}ffn.shared_gate.weight", gate))
    return rules


def moe_hf_rules(config: ModelConfig, ours: str, theirs: str, names: MoENames,
                 present: Collection[str] | None = None) -> list[Rule]:
    """One MoE layer's HF tensors (`ours` = "layers.N.", `theirs` = "model.layers.N."): the router, the experts
    (per expert, or transformers 5's fused `mlp.experts.gate_up_proj` (E, 2F, D) and `down_proj` (E, D, F) when
    `present` holds them), the shared expert and its gate."""
    fused = present is not None and f"{theirs}mlp.experts.gate_up_proj" in present
    block = f"{theirs}{'mlp' if fused else names.block}."
    rules = [rename(f"{ours}ffn.gate.weight", f"{block}gate.weight")]
    if config.moe.score_bias:
        rules.append(rename(f"{ours}ffn.score_bias", f"{block}gate.e_score_correction_bias"))
    w1, w2, w3 = (_expert_names(config, ours, w) for w in ("w1", "w2", "w3"))
    if fused:
        rules += [stacked_pair(f"{block}experts.gate_up_proj", w1, w3), stacked(f"{block}experts.down_proj", w2)]
    else:
        for w, mine in zip(names.experts, (w1, w2, w3), strict=True):
            rules += [rename(m, f"{block}experts.{e}.{w}.weight") for e, m in enumerate(mine)]
    shared = {w: f"{block}{names.shared}.{p}.weight" for w, p in zip(("w1", "w2", "w3"), names.experts, strict=True)}
    return rules + _shared_rules(config, ours, shared, f"{block}{names.shared_gate}.weight")


def moe_gguf_rules(config: ModelConfig, ours: str, theirs: str) -> list[Rule]:
    """One MoE layer's llama.cpp tensors (`theirs` = "blk.N."): `ffn_gate_inp` (the router), the stacked experts
    `ffn_gate_exps` / `ffn_down_exps` / `ffn_up_exps` (E, F, D), the shared expert `ffn_*_shexp` and its gate
    `ffn_gate_inp_shexp` ((D,) or (1, D)). (llama.cpp's converter fuses gate and up into `ffn_gate_up_exps` only
    for other architectures.)"""
    rules = [rename(f"{ours}ffn.gate.weight", f"{theirs}ffn_gate_inp.weight")]
    if config.moe.score_bias:
        rules.append(rename(f"{ours}ffn.score_bias", f"{theirs}exp_probs_b.bias"))
    w1, w2, w3 = (_expert_names(config, ours, w) for w in ("w1", "w2", "w3"))
    rules += [stacked(f"{theirs}ffn_gate_exps.weight", w1), stacked(f"{theirs}ffn_up_exps.weight", w3),
              stacked(f"{theirs}ffn_down_exps.weight", w2)]
    shared = {w: f"{theirs}{g}_shexp.weight" for w, g in (("w1", "ffn_gate"), ("w2", "ffn_down"), ("w3", "ffn_up"))}
    rules += _shared_rules(config, ours, shared, None)
    if config.moe.d_shared and config.moe.shared_gate:
        rules.append(Rule(f"{theirs}ffn_gate_inp_shexp.weight", (f"{ours}ffn.shared_gate.weight",),
                          lambda t: (t.reshape(1, -1),), lambda w: w.reshape(-1), rows=False))  # (D,) -> (1, D)
    return rules


def gguf_moe(meta: dict[str, Any], tensors: dict[str, Any], arch: str, source: str, *, norm_topk: bool,
             d_ff: int | None = None) -> MoEFeatures:
    """The MoE features of a GGUF file (`tensors`: the file's, by name, with `.shape`): `<arch>.expert_count`
    experts (none: a dense model), `expert_used_count` per token, their width `expert_feed_forward_length` (else
    read off `ffn_down_exps`; None when it equals `d_ff`: Mixtral's experts are `feed_forward_length` wide), the
    shared expert `expert_shared_feed_forward_length` with its sigmoid gate when `ffn_gate_inp_shexp` is there,
    and the dense layers: those without a router `blk.N.ffn_gate_inp`. Whether the top-k weights are
    renormalised is the architecture's (llama.cpp hard-codes it per arch: `norm_topk`). A gating function,
    expert groups or a weights scale these families' llama.cpp graphs do not read are an error naming the key."""
    n = int(meta.get(f"{arch}.expert_count", 0) or 0)
    if n == 0:
        return MoEFeatures()
    for key, neutral in (("expert_group_count", (None, 0, 1)), ("expert_weights_scale", (None, 0.0, 1.0)),
                         ("expert_gating_func", (None, 1))):  # 1: softmax (llama.cpp's LLAMA_EXPERT_GATING_FUNC)
        if meta.get(f"{arch}.{key}") not in neutral:
            raise FamilyError(f"{source}: metadata {arch}.{key}={meta[f'{arch}.{key}']} is not supported for {arch}")
    layers = int(gguf_meta(meta, arch, "block_count", source))
    sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    d_expert = meta.get(f"{arch}.expert_feed_forward_length")
    if d_expert is None and sparse and f"blk.{sparse[0]}.ffn_down_exps.weight" in tensors:
        d_expert = tensors[f"blk.{sparse[0]}.ffn_down_exps.weight"].shape[-1]  # (E, D, F)
    d_shared = int(meta.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0)
    if d_shared == 0 and any(f"blk.{i}.ffn_gate_shexp.weight" in tensors for i in range(layers)):
        raise FamilyError(f"{source}: shared-expert tensors without {arch}.expert_shared_feed_forward_length")
    top_k = gguf_meta(meta, arch, "expert_used_count", source)
    if isinstance(top_k, list):  # per layer (llama.cpp's get_key_or_arr)
        if len(set(top_k)) != 1:
            raise FamilyError(f"{source}: per-layer {arch}.expert_used_count {sorted(set(top_k))} is not supported")
        top_k = top_k[0]
    return MoEFeatures(
        n_experts=n, top_k=int(top_k), norm_topk=norm_topk,
        d_expert=None if d_expert is None or int(d_expert) == d_ff else int(d_expert), d_shared=d_shared,
        shared_gate=any(f"blk.{i}.ffn_gate_inp_shexp.weight" in tensors for i in range(layers)),
        dense_layers=[i for i in range(layers) if i not in sparse])
