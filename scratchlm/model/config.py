"""`ModelConfig`: everything needed to rebuild a `TransformerLM`; stored inside every checkpoint.

A config states *features*, never family names. The flat fields are the Llama core every model has (sizes,
RoPE base and pair layout, norm epsilon, q/k/v biases, tied head). Everything that differs between families
lives in four grouped sub-configs that the one `TransformerBlock` (and every backend: the C++ fused step,
tensor parallelism, the planner, the KV cache through `kv_spec()`) reads:

- `rope`: RoPE scaling (none / linear / dynamic NTK / llama3 / YaRN with or without truncation / LongRoPE), partial
  rotary dims, the theta of sliding-window layers (Gemma 3), layers without RoPE (NoPE);
- `attn`: o-projection bias, q/k-norm (per head or over the full width), the query scale, the logit soft-cap,
  sliding windows with a per-layer pattern, attention sinks (gpt-oss);
- `norm`: RMSNorm or LayerNorm (with bias), pre / post / both ("sandwich") placement, the (1 + w) offset;
- `mlp`: SiLU or GELU-tanh, gated (SwiGLU / GeGLU) or plain, biases, gpt-oss's clamped SwiGLU;
- `moe`: a mixture-of-experts feed-forward in place of the MLP (Mixtral, Qwen2/3-MoE, DeepSeek-V2/V3, gpt-oss): the
  router (softmax or sigmoid scores or gpt-oss's softmax over the top-k logits, a router bias, top-k with or
  without renormalisation, group-limited choice, the score correction bias, the routed scale), shared experts,
  and which layers stay dense;
- `mla`: multi-head latent attention (DeepSeek-V2/V3, Kimi K2): low-rank q, a compressed KV latent plus a decoupled
  RoPE key, which is what the KV cache stores;

plus the model-level scalars: embedding scale, learned absolute positions, final-logit soft-cap, residual
multiplier and logit scale (Granite). The defaults of every feature are the Llama block, so
`ModelConfig.cs336()` and the checkpoints written before the features existed load unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal


def default_d_ff(d_model: int, multiple_of: int = 64) -> int:
    """SwiGLU hidden size: about 8/3 * d_model, rounded up to a multiple of `multiple_of`."""
    return multiple_of * math.ceil(8 * d_model / 3 / multiple_of)


ROPE_SCALINGS = ("none", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass
class RopeFeatures:
    """How positions enter beyond plain RoPE(theta): scaling, partial rotation, per-layer theta, NoPE layers."""

    scaling: Literal["none", "linear", "dynamic", "llama3", "yarn", "longrope"] = field(
        default="none", metadata={"help": "frequency scaling: none, linear (position interpolation), dynamic (NTK), "
                                          "llama3, yarn or longrope (Phi-3)"})
    factor: float = field(default=1.0, metadata={"help": "context extension factor of the scaling"})
    original_max_seq_len: int | None = field(
        default=None, metadata={"help": "the context the model was pre-trained at (llama3, yarn, longrope, dynamic)"})
    low_freq_factor: float = field(default=1.0, metadata={"help": "llama3: wavelengths above orig/low are scaled"})
    high_freq_factor: float = field(default=4.0, metadata={"help": "llama3: wavelengths below orig/high are kept"})
    beta_fast: float = field(default=32.0, metadata={"help": "yarn: rotations above which dims are extrapolated"})
    beta_slow: float = field(default=1.0, metadata={"help": "yarn: rotations below which dims are interpolated"})
    truncate: bool = field(default=True, metadata={"help": "yarn: the ramp's ends are rounded to whole dims (floor/"
                                                           "ceil); False keeps them fractional (gpt-oss)"})
    attention_factor: float | None = field(
        default=None, metadata={"help": "yarn/longrope: cos/sin multiplier; None = the method's default formula"})
    mscale: float | None = field(
        default=None, metadata={"help": "yarn (DeepSeek): with mscale_all_dim, the cos/sin multiplier is "
                                        "(0.1 mscale ln f + 1) / (0.1 mscale_all_dim ln f + 1)"})
    mscale_all_dim: float | None = field(
        default=None, metadata={"help": "yarn (DeepSeek): MLA's query scale is multiplied by "
                                        "(0.1 mscale_all_dim ln f + 1)^2 (HF yarn_apply_mscale)"})
    short_factor: list[float] | None = field(
        default=None, metadata={"help": "longrope: per-frequency divisors within the original context"})
    long_factor: list[float] | None = field(
        default=None, metadata={"help": "longrope: per-frequency divisors beyond the original context"})
    rotary_dim: int | None = field(
        default=None, metadata={"help": "leading dims of each head that rotate (partial RoPE); None = all"})
    local_theta: float | None = field(
        default=None, metadata={"help": "RoPE base of the sliding-window layers (Gemma 3); None = rope_theta"})
    local_scaling: bool = field(
        default=True, metadata={"help": "whether the scaling applies to sliding-window layers too (Gemma 3: no)"})
    nope_layers: list[int] = field(default_factory=list, metadata={"help": "layers that apply no RoPE (NoPE)"})


@dataclass
class AttentionFeatures:
    """Attention beyond GQA with optional q/k/v biases (the flat `qkv_bias`)."""

    o_bias: bool = field(default=False, metadata={"help": "bias on the output projection (Llama attention_bias, "
                                                          "GPT-2)"})
    qk_norm: Literal["none", "head", "full"] = field(
        default="none", metadata={"help": "RMSNorm of q and k before RoPE: per head (Qwen3, Gemma 3) or over the "
                                          "whole projection (OLMo-2)"})
    query_scale: float | None = field(
        default=None, metadata={"help": "multiplier of q.k; None = 1/sqrt(head_dim) (Gemma: query_pre_attn_scalar, "
                                        "Granite: attention_multiplier)"})
    logit_softcap: float | None = field(
        default=None, metadata={"help": "scores become cap * tanh(scores / cap) (Gemma 2)"})
    sliding_window: int | None = field(
        default=None, metadata={"help": "a query sees itself and the window - 1 tokens before it; None = full"})
    sliding_layers: list[int] | None = field(
        default=None, metadata={"help": "layers that use the window; None = every layer (when a window is set)"})
    sinks: bool = field(default=False, metadata={"help": "a learned logit per query head joins each query's softmax "
                                                         "denominator (gpt-oss attention sinks; no value)"})


@dataclass
class NormFeatures:
    """The block's norms: kind, placement and parameterisation."""

    kind: Literal["rms", "layer"] = field(default="rms", metadata={"help": "RMSNorm, or LayerNorm (GPT-2)"})
    bias: bool = field(default=False, metadata={"help": "LayerNorm with a bias"})
    placement: Literal["pre", "post", "sandwich"] = field(
        default="pre", metadata={"help": "pre: x + f(norm(x)); post: x + norm(f(x)) (OLMo-2); sandwich: "
                                         "x + norm2(f(norm1(x))) (Gemma 2/3)"})
    offset: float = field(default=0.0, metadata={"help": "gain is (offset + w): Gemma's (1 + w) is offset 1"})


@dataclass
class MLPFeatures:
    """The feed-forward network."""

    act: Literal["silu", "gelu_tanh", "gelu"] = field(default="silu", metadata={"help": "activation"})
    gated: bool = field(default=True, metadata={"help": "act(x W1) * (x W3), then W2 (SwiGLU / GeGLU); "
                                                        "False: act(x W1) W2 (GPT-2)"})
    bias: bool = field(default=False, metadata={"help": "biases on every MLP linear (MoE experts included)"})
    swiglu_alpha: float = field(default=1.0, metadata={"help": "gated silu as gate * sigmoid(alpha * gate) (gpt-oss: "
                                                               "1.702); 1 = SwiGLU"})
    swiglu_limit: float | None = field(
        default=None, metadata={"help": "gpt-oss's clamped SwiGLU: gate clamped to max=limit, up to [-limit, limit], "
                                        "and the product taken with (up + 1); None = plain"})


@dataclass
class MoEFeatures:
    """A mixture-of-experts feed-forward (`model/moe.py`): in a sparse layer the MLP becomes `n_experts` routed
    experts (gated MLPs of width `d_expert`, the `mlp` features' activation), of which each token uses `top_k`,
    plus optional shared experts every token uses. `n_experts` 0: every layer is dense."""

    n_experts: int = field(default=0, metadata={"help": "routed experts per sparse layer; 0 = no MoE"})
    top_k: int = field(default=2, metadata={"help": "experts each token is routed to"})
    d_expert: int | None = field(default=None, metadata={"help": "hidden size of one routed expert; None = d_ff"})
    scoring: Literal["softmax", "sigmoid", "topk_softmax"] = field(
        default="softmax", metadata={"help": "router scores: softmax over all experts (Mixtral, Qwen, DeepSeek-V2), "
                                             "an independent sigmoid per expert (DeepSeek-V3), or top-k of the logits "
                                             "then a softmax over the chosen k (gpt-oss)"})
    router_bias: bool = field(default=False, metadata={"help": "the router linear has a bias (gpt-oss)"})
    norm_topk: bool = field(default=True, metadata={"help": "renormalise the chosen experts' scores to sum to 1 "
                                                            "(Mixtral, Qwen3-MoE; Qwen2-MoE norm_topk_prob)"})
    routed_scale: float = field(default=1.0, metadata={"help": "the routed experts' sum is multiplied by this "
                                                               "(DeepSeek routed_scaling_factor)"})
    n_groups: int = field(default=1, metadata={"help": "group-limited routing: experts fall into this many equal "
                                                       "groups (DeepSeek n_group); 1 = no groups"})
    topk_groups: int = field(default=1, metadata={"help": "only the experts of this many best groups can be "
                                                          "chosen (DeepSeek topk_group)"})
    group_score: Literal["max", "top2"] = field(
        default="max", metadata={"help": "a group's score: its best expert's (DeepSeek-V2 group_limited_greedy) or "
                                         "the sum of its best two (DeepSeek-V3 noaux_tc)"})
    score_bias: bool = field(default=False, metadata={"help": "a per-expert bias added to the scores for the choice "
                                                              "only, not the weights (DeepSeek-V3 "
                                                              "e_score_correction_bias)"})
    d_shared: int = field(default=0, metadata={"help": "hidden size of the shared expert every token uses (DeepSeek: "
                                                       "n_shared_experts x moe_intermediate_size); 0 = none"})
    shared_gate: bool = field(default=False, metadata={"help": "the shared expert's output is scaled by "
                                                               "sigmoid(x . w) (Qwen2-MoE shared_expert_gate)"})
    dense_layers: list[int] = field(default_factory=list, metadata={
        "help": "layers whose feed-forward is the dense MLP of width d_ff (DeepSeek first_k_dense_replace, "
                "Qwen mlp_only_layers / decoder_sparse_step)"})


@dataclass
class MLAFeatures:
    """Multi-head latent attention (DeepSeek-V2/V3): q from x (or through a rank-`q_lora_rank` bottleneck), and per
    token one latent of `kv_lora_rank` plus one RoPE key of `qk_rope_head_dim` shared by all heads, from which each
    head's no-RoPE key (`qk_nope_head_dim`) and value (`v_head_dim`) are expanded. `kv_lora_rank` 0: not MLA."""

    kv_lora_rank: int = field(default=0, metadata={"help": "width of the compressed KV latent; 0 = no MLA"})
    q_lora_rank: int | None = field(default=None, metadata={"help": "rank of q's bottleneck; None = q from x"})
    qk_nope_head_dim: int = field(default=0, metadata={"help": "per head: q/k dims without RoPE"})
    qk_rope_head_dim: int = field(default=0, metadata={"help": "per head: q/k dims with RoPE (the key's are shared)"})
    v_head_dim: int = field(default=0, metadata={"help": "per head: value dims"})


_GROUPS = {"rope": RopeFeatures, "attn": AttentionFeatures, "norm": NormFeatures, "mlp": MLPFeatures,
           "moe": MoEFeatures, "mla": MLAFeatures}


@dataclass(frozen=True)
class LayerKV:
    """What one layer keeps in the KV cache per token: `n_kv_heads` keys of `head_dim` and as many values of
    `v_dim` (None = head_dim), and the window (None = the whole context).

    A multi-head latent attention layer (`latent`) keeps no per-head K/V: per token one latent of `head_dim` =
    kv_lora_rank (the cache's k plane) and one RoPE key of `v_dim` = qk_rope_head_dim shared by all heads (the v
    plane), `n_kv_heads` 1; the heads' keys and values are expanded from the latent (`model/mla.py`)."""

    n_kv_heads: int
    head_dim: int
    window: int | None
    v_dim: int | None = None
    latent: bool = False

    @property
    def value_dim(self) -> int:
        """Width of one cached "value" vector (the RoPE key of an MLA layer)."""
        return self.head_dim if self.v_dim is None else self.v_dim

    def elements_per_token(self) -> int:
        """Numbers this layer caches per token (K and V of every KV head; latent + RoPE key for MLA)."""
        return self.n_kv_heads * (self.head_dim + self.value_dim)


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only transformer LM (see the module docstring for the feature groups).

    `n_kv_heads`, `d_ff` and `head_dim` may be left as None and are then derived
    (n_heads, ~8/3 d_model rounded to 64, d_model // n_heads).
    """

    vocab_size: int = field(default=10_000, metadata={"help": "number of token ids (rows of the embedding)"})
    d_model: int = field(default=256, metadata={"help": "width of the residual stream"})
    n_layers: int = field(default=4, metadata={"help": "number of transformer blocks"})
    n_heads: int = field(default=8, metadata={"help": "number of query heads"})
    n_kv_heads: int | None = field(
        default=None, metadata={"help": "number of key/value heads (grouped-query attention); None = n_heads"}
    )
    d_ff: int | None = field(
        default=None, metadata={"help": "SwiGLU hidden size; None = 8/3 d_model rounded up to a multiple of 64"}
    )
    max_seq_len: int = field(default=256, metadata={"help": "longest context the model is meant for"})
    rope_theta: float = field(default=10_000.0, metadata={"help": "RoPE base frequency"})
    norm_eps: float = field(default=1e-5, metadata={"help": "epsilon of every norm"})
    rope_layout: Literal["half", "adjacent", "none"] = field(
        default="half",
        metadata={"help": "RoPE pair layout: 'half' = HF rotate-half, 'adjacent' = llama2.c/CS336 (x0,x1),(x2,x3)..; "
                          "'none' = no position embedding (NoPE)"},
    )
    tie_embeddings: bool = field(default=True, metadata={"help": "output head shares the token embedding matrix"})
    qkv_bias: bool = field(default=False, metadata={"help": "add biases to the q/k/v projections (Qwen2)"})
    head_dim: int | None = field(default=None, metadata={"help": "width of one head; None = d_model // n_heads"})
    rope: RopeFeatures = field(default_factory=RopeFeatures, metadata={"help": "RoPE scaling and variants"})
    attn: AttentionFeatures = field(default_factory=AttentionFeatures, metadata={"help": "attention features"})
    norm: NormFeatures = field(default_factory=NormFeatures, metadata={"help": "norm kind and placement"})
    mlp: MLPFeatures = field(default_factory=MLPFeatures, metadata={"help": "feed-forward features"})
    moe: MoEFeatures = field(default_factory=MoEFeatures, metadata={"help": "mixture-of-experts feed-forward"})
    mla: MLAFeatures = field(default_factory=MLAFeatures, metadata={"help": "multi-head latent attention"})
    embedding_scale: float = field(
        default=1.0, metadata={"help": "token embeddings are multiplied by this (Gemma: sqrt(d_model); Granite)"})
    learned_positions: bool = field(
        default=False, metadata={"help": "learned absolute position embeddings added to the tokens' (GPT-2)"})
    final_logit_softcap: float | None = field(
        default=None, metadata={"help": "logits become cap * tanh(logits / cap) (Gemma 2)"})
    residual_multiplier: float = field(
        default=1.0, metadata={"help": "each sublayer's output is multiplied by this before the residual add "
                                       "(Granite)"})
    logit_scale: float = field(default=1.0, metadata={"help": "logits are multiplied by this (Granite: "
                                                              "1 / logits_scaling)"})

    def __post_init__(self) -> None:
        for name, cls in _GROUPS.items():
            value = getattr(self, name)
            if isinstance(value, dict):
                setattr(self, name, _group_from_dict(cls, value, name))
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.d_ff is None:
            self.d_ff = default_d_ff(self.d_model)
        if self.head_dim is None:
            if self.n_heads <= 0 or self.d_model % self.n_heads:
                raise ValueError(
                    f"ModelConfig: d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                    "give head_dim explicitly or change one of them"
                )
            self.head_dim = self.d_model // self.n_heads
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming every inconsistent field."""
        problems = []
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                problems.append(f"{name}={value!r} must be a positive int")
        if not problems and self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads={self.n_heads} must be a multiple of n_kv_heads={self.n_kv_heads}")
        if not problems and self.rotary_dim % 2 and self.rope_layout != "none":
            problems.append(f"rotary dims={self.rotary_dim} must be even for RoPE")
        if not problems and self.rope.rotary_dim is not None and not 0 < self.rope.rotary_dim <= self.head_dim:
            problems.append(f"rope.rotary_dim={self.rope.rotary_dim} must be in 1..head_dim={self.head_dim}")
        if self.rope_layout not in ("half", "adjacent", "none"):
            problems.append(f"rope_layout={self.rope_layout!r} must be 'half', 'adjacent' or 'none'")
        if not (self.rope_theta > 0):
            problems.append(f"rope_theta={self.rope_theta!r} must be > 0")
        if not (self.norm_eps > 0):
            problems.append(f"norm_eps={self.norm_eps!r} must be > 0")
        r, a, n, m = self.rope, self.attn, self.norm, self.mlp
        if r.scaling not in ROPE_SCALINGS:
            problems.append(f"rope.scaling={r.scaling!r} must be one of {ROPE_SCALINGS}")
        if r.scaling == "longrope" and (r.short_factor is None or r.long_factor is None):
            problems.append("rope.scaling='longrope' needs rope.short_factor and rope.long_factor")
        if r.scaling in ("llama3", "yarn", "longrope") and not r.original_max_seq_len:
            problems.append(f"rope.scaling={r.scaling!r} needs rope.original_max_seq_len")
        if a.qk_norm not in ("none", "head", "full"):
            problems.append(f"attn.qk_norm={a.qk_norm!r} must be 'none', 'head' or 'full'")
        if a.sliding_window is not None and a.sliding_window <= 0:
            problems.append(f"attn.sliding_window={a.sliding_window!r} must be a positive int or None")
        if a.sliding_layers is not None and not all(0 <= i < self.n_layers for i in a.sliding_layers):
            problems.append(f"attn.sliding_layers={a.sliding_layers} names layers outside 0..{self.n_layers - 1}")
        if n.kind not in ("rms", "layer") or n.placement not in ("pre", "post", "sandwich"):
            problems.append(f"norm kind={n.kind!r} / placement={n.placement!r} not one of rms|layer / "
                            "pre|post|sandwich")
        if n.bias and n.kind != "layer":
            problems.append("norm.bias needs norm.kind='layer'")
        if m.act not in ("silu", "gelu_tanh", "gelu"):
            problems.append(f"mlp.act={m.act!r} must be 'silu', 'gelu_tanh' or 'gelu'")
        if (m.swiglu_alpha != 1.0 or m.swiglu_limit is not None) and (m.act != "silu" or not m.gated):
            problems.append("mlp.swiglu_alpha / swiglu_limit need a gated silu MLP (mlp.act='silu', gated=True)")
        if m.swiglu_limit is not None and not m.swiglu_limit > 0:
            problems.append(f"mlp.swiglu_limit={m.swiglu_limit!r} must be > 0 or None")
        problems += self._moe_problems()
        problems += self._mla_problems()
        if problems:
            raise ValueError("invalid ModelConfig: " + "; ".join(problems))

    def _moe_problems(self) -> list[str]:
        e = self.moe
        if e.n_experts == 0:
            return []
        out = []
        if not 0 < e.top_k <= e.n_experts:
            out.append(f"moe.top_k={e.top_k} must be in 1..moe.n_experts={e.n_experts}")
        if e.scoring not in ("softmax", "sigmoid", "topk_softmax") or e.group_score not in ("max", "top2"):
            out.append(f"moe.scoring={e.scoring!r} / group_score={e.group_score!r} not one of softmax|sigmoid|"
                       "topk_softmax / max|top2")
        if e.scoring == "topk_softmax" and (e.n_groups > 1 or e.score_bias):
            out.append("moe.scoring='topk_softmax' takes no expert groups or score_bias")
        if e.n_groups < 1 or e.n_experts % e.n_groups or not 0 < e.topk_groups <= e.n_groups:
            out.append(f"moe.n_groups={e.n_groups} must divide n_experts={e.n_experts} and 1 <= topk_groups="
                       f"{e.topk_groups} <= n_groups")
        elif e.n_groups > 1 and e.top_k > e.topk_groups * (e.n_experts // e.n_groups):
            out.append(f"moe.top_k={e.top_k} exceeds the experts of topk_groups={e.topk_groups} groups")
        if e.d_expert is not None and e.d_expert <= 0 or e.d_shared < 0:
            out.append(f"moe.d_expert={e.d_expert} / d_shared={e.d_shared} must be positive / >= 0")
        if not all(0 <= i < self.n_layers for i in e.dense_layers):
            out.append(f"moe.dense_layers={e.dense_layers} names layers outside 0..{self.n_layers - 1}")
        if not self.mlp.gated:
            out.append("moe experts are gated MLPs (mlp.gated=True)")
        return out

    def _mla_problems(self) -> list[str]:
        m = self.mla
        if m.kv_lora_rank == 0:
            return []
        out = []
        dims = {"kv_lora_rank": m.kv_lora_rank, "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim}
        out += [f"mla.{k}={v!r} must be a positive int" for k, v in dims.items() if not isinstance(v, int) or v <= 0]
        if m.qk_nope_head_dim < 0 or m.q_lora_rank is not None and m.q_lora_rank <= 0:
            out.append(f"mla.qk_nope_head_dim={m.qk_nope_head_dim} must be >= 0 and mla.q_lora_rank="
                       f"{m.q_lora_rank} None or > 0")
        if self.head_dim != m.qk_rope_head_dim or self.rotary_dim != m.qk_rope_head_dim:
            out.append(f"head_dim={self.head_dim} (rope.rotary_dim={self.rope.rotary_dim}) must be "
                       f"mla.qk_rope_head_dim={m.qk_rope_head_dim}: with MLA head_dim is the RoPE width, as HF's")
        if m.qk_rope_head_dim % 2:
            out.append(f"mla.qk_rope_head_dim={m.qk_rope_head_dim} must be even for RoPE")
        if self.n_kv_heads != self.n_heads:
            out.append(f"n_kv_heads={self.n_kv_heads} must equal n_heads={self.n_heads} with MLA (every head "
                       "expands its own key and value from the latent)")
        a = self.attn
        unsupported = [name for name, on in (("qkv_bias", self.qkv_bias), ("attn.o_bias", a.o_bias),
                                             ("attn.qk_norm", a.qk_norm != "none"),
                                             ("attn.logit_softcap", a.logit_softcap is not None),
                                             ("attn.sinks", a.sinks),
                                             ("attn.sliding_window", a.sliding_window is not None),
                                             ("rope.nope_layers", bool(self.rope.nope_layers)),
                                             ("rope.local_theta", self.rope.local_theta is not None)) if on]
        if unsupported:
            out.append(f"multi-head latent attention does not implement {', '.join(unsupported)}")
        return out

    # ------------------------------------------------------------------ derived, per layer
    def is_moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s feed-forward is the mixture of experts (else the dense MLP)."""
        return self.moe.n_experts > 0 and layer not in self.moe.dense_layers

    @property
    def d_expert(self) -> int:
        """Hidden size of one routed expert."""
        return self.d_ff if self.moe.d_expert is None else self.moe.d_expert

    @property
    def rotary_dim(self) -> int:
        """Leading dims of each head that RoPE rotates."""
        return self.head_dim if self.rope.rotary_dim is None else self.rope.rotary_dim

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (tokens a query sees, itself included), or None for full attention."""
        a = self.attn
        if a.sliding_window is None or (a.sliding_layers is not None and layer not in a.sliding_layers):
            return None
        return a.sliding_window

    def layer_theta(self, layer: int) -> float:
        """The RoPE base of `layer` (Gemma 3's sliding layers have their own)."""
        local = self.rope.local_theta
        return local if local is not None and self.window(layer) is not None else self.rope_theta

    def layer_rope_scaled(self, layer: int) -> bool:
        """Whether `layer`'s RoPE uses the scaling (Gemma 3 scales only its global layers)."""
        return self.rope.scaling != "none" and (self.rope.local_scaling or self.window(layer) is None)

    def layer_has_rope(self, layer: int) -> bool:
        return self.rope_layout != "none" and layer not in self.rope.nope_layers

    def query_scale(self) -> float:
        """The multiplier of q.k in attention. MLA (DeepSeek): (qk_nope + qk_rope)^-0.5, times
        (0.1 mscale_all_dim ln factor + 1)^2 under a RoPE scaling with mscale_all_dim (HF `yarn_apply_mscale`)."""
        if self.attn.query_scale is not None:
            return self.attn.query_scale
        if not self.mla.kv_lora_rank:
            return 1.0 / math.sqrt(self.head_dim)
        scale = (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim) ** (-0.5)
        r = self.rope
        if r.scaling != "none" and r.mscale_all_dim and r.factor > 1:
            m = 0.1 * r.mscale_all_dim * math.log(r.factor) + 1.0
            scale = scale * m * m
        return scale

    def kv_spec(self) -> list[LayerKV]:
        """Per layer: what it stores in the KV cache (heads, head dim, window; MLA: the latent and the RoPE key)."""
        m = self.mla
        if m.kv_lora_rank:
            return [LayerKV(1, m.kv_lora_rank, None, m.qk_rope_head_dim, latent=True) for _ in range(self.n_layers)]
        return [LayerKV(self.n_kv_heads, self.head_dim, self.window(i)) for i in range(self.n_layers)]

    def is_plain_llama(self) -> bool:
        """Whether every feature is at its Llama default (what the oldest backends were written for)."""
        return (self.rope == RopeFeatures() and self.attn == AttentionFeatures() and self.norm == NormFeatures()
                and self.mlp == MLPFeatures() and self.moe == MoEFeatures() and self.mla == MLAFeatures()
                and self.embedding_scale == 1.0 and not self.learned_positions
                and self.final_logit_softcap is None and self.residual_multiplier == 1.0 and self.logit_scale == 1.0)

    def features(self) -> list[str]:
        """Short names of the non-default features (for logs and errors)."""
        out = []
        for name, cls in _GROUPS.items():
            default, value = cls(), getattr(self, name)
            out += [f"{name}.{f.name}={getattr(value, f.name)!r}" for f in dataclasses.fields(cls)
                    if getattr(value, f.name) != getattr(default, f.name)]
        for name in ("embedding_scale", "learned_positions", "final_logit_softcap", "residual_multiplier",
                     "logit_scale"):
            if getattr(self, name) != getattr(ModelConfig, name, None):
                out.append(f"{name}={getattr(self, name)!r}")
        return out

    @classmethod
    def cs336(cls, vocab_size: int = 10_000, context_length: int = 256, d_model: int = 512, num_layers: int = 4,
              num_heads: int = 16, d_ff: int = 1344, rope_theta: float = 10_000.0, **overrides: Any) -> ModelConfig:
        """The architecture of CS336 assignment 1's `TransformerLM`, with its argument names (defaults: the
        assignment's TinyStories model). What differs from this class's own defaults: RoPE rotates adjacent
        pairs (`rope_layout="adjacent"`), the output head is a separate `lm_head` (`tie_embeddings=False`),
        `d_ff` is given rather than derived, and there are as many kv heads as query heads. `overrides` set
        any other field, e.g. `rope_layout="none"` for the NoPE ablation."""
        fields = dict(vocab_size=vocab_size, max_seq_len=context_length, d_model=d_model, n_layers=num_layers,
                      n_heads=num_heads, n_kv_heads=num_heads, d_ff=d_ff, rope_theta=rope_theta, norm_eps=1e-5,
                      rope_layout="adjacent", tie_embeddings=False, qkv_bias=False)
        return cls(**(fields | overrides))

    def to_dict(self) -> dict[str, Any]:
        """A plain dict (JSON/pickle-safe) that `from_dict` turns back into this config."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Rebuild from `to_dict()` output (or an older checkpoint's, without the feature groups); unknown keys
        are an error naming them."""
        if not isinstance(data, dict):
            raise ValueError(f"model config must be a dict, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"model config: unknown field(s) {unknown}; expected some of {sorted(names)}")
        return cls(**data)

    # ------------------------------------------------------------------ counts (the planner reads these)
    # Every count is of the model `TransformerLM(config)` builds, per block `layer` (dense and MoE blocks differ).
    # "Active" counts are what one token uses: in a MoE block the router, its top_k routed experts and the shared
    # expert, not the other experts. `layer` may be left out only when every block has the same count.
    def _layer_arg(self, layer: int | None, count: str) -> int:
        if layer is not None:
            return layer
        if self.moe.n_experts and 0 < len(set(self.moe.dense_layers) & set(range(self.n_layers))) < self.n_layers:
            raise ValueError(f"ModelConfig.{count}: dense and MoE blocks differ (moe.dense_layers="
                             f"{self.moe.dense_layers}); name the layer")
        return 0

    def attention_parameters(self) -> int:
        """Parameters of one block's attention (projections, biases, q/k-norms; MLA: its low-rank projections and
        their norms)."""
        d, hd, h, kv = self.d_model, self.head_dim, self.n_heads, self.n_kv_heads
        if self.mla.kv_lora_rank:
            m = self.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            if m.q_lora_rank:  # q_a (with the q/k/v bias), its norm, q_b
                q = d * m.q_lora_rank + m.q_lora_rank * (2 if self.qkv_bias else 1) + m.q_lora_rank * h * qk
            else:
                q = d * h * qk
            kv_a = (d + (1 if self.qkv_bias else 0)) * (m.kv_lora_rank + m.qk_rope_head_dim)  # latent + rope key
            kv_b = m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + m.kv_lora_rank  # and the latent's norm
            return q + kv_a + kv_b + h * m.v_head_dim * d + (d if self.attn.o_bias else 0)
        attn = d * hd * h * 2 + d * hd * kv * 2 + (hd * (h + 2 * kv) if self.qkv_bias else 0)
        attn += (d if self.attn.o_bias else 0) + (h if self.attn.sinks else 0)
        return attn + {"none": 0, "head": 2 * hd, "full": hd * (h + kv)}[self.attn.qk_norm]

    def expert_parameters(self) -> int:
        """Parameters of one routed expert (a gated MLP of width d_expert, with its biases when mlp.bias)."""
        return 3 * self.d_model * self.d_expert + (2 * self.d_expert + self.d_model if self.mlp.bias else 0)

    def ffn_parameters(self, layer: int | None = None, active: bool = False) -> int:
        """Parameters of block `layer`'s feed-forward: the dense MLP, or the router, the routed experts (all, or
        with `active` the top_k one token uses), the shared expert and its gate."""
        d, f = self.d_model, self.d_ff
        if not self.is_moe_layer(self._layer_arg(layer, "ffn_parameters")):
            return (3 if self.mlp.gated else 2) * d * f + ((2 * f if self.mlp.gated else f) + d if self.mlp.bias else 0)
        e = self.moe
        router = d * e.n_experts + (e.n_experts if e.score_bias else 0) + (e.n_experts if e.router_bias else 0)
        shared = 3 * d * e.d_shared + (d if e.shared_gate else 0)
        return router + (e.top_k if active else e.n_experts) * self.expert_parameters() + shared

    def layer_parameters(self, layer: int | None = None, active: bool = False) -> int:
        """Parameters of block `layer` (all, or with `active` those one token uses)."""
        norm = (2 if self.norm.bias else 1) * self.d_model
        n_norms = 4 if self.norm.placement == "sandwich" else 2
        return self.attention_parameters() + self.ffn_parameters(layer, active) + n_norms * norm

    def _outside_parameters(self) -> int:
        d = self.d_model
        head = 0 if self.tie_embeddings else self.vocab_size * d
        positions = self.max_seq_len * d if self.learned_positions else 0
        final_norm = (2 if self.norm.bias else 1) * d
        return self.vocab_size * d + positions + final_norm + head

    def num_parameters(self) -> int:
        """Parameter count of the model this config builds."""
        return self._outside_parameters() + sum(self.layer_parameters(i) for i in range(self.n_layers))

    def active_parameters(self) -> int:
        """Parameters one token uses: everything but the routed experts it is not sent to (the embedding and the
        head included, as DeepSeek-V3's "37B activated" counts them); a dense model's `num_parameters()`."""
        return self._outside_parameters() + sum(self.layer_parameters(i, active=True) for i in range(self.n_layers))

    def attention_matmul_weights(self) -> int:
        """Weights one token multiplies in a block's attention (q/k/v/o; MLA: q_a, q_b or q, kv_a, kv_b, o, with
        K and V expanded from the latent as in a prefill)."""
        d, hd = self.d_model, self.head_dim
        if self.mla.kv_lora_rank:
            m, h = self.mla, self.n_heads
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            q = (d * m.q_lora_rank + m.q_lora_rank * h * qk) if m.q_lora_rank else d * h * qk
            return (q + d * (m.kv_lora_rank + m.qk_rope_head_dim)
                    + m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + h * m.v_head_dim * d)
        return d * hd * (2 * self.n_heads + 2 * self.n_kv_heads)

    def matmul_weights_per_layer(self, layer: int | None = None) -> int:
        """Weights one token multiplies in block `layer` (attention and the feed-forward; a MoE block: the
        router, its top_k experts, the shared expert and its gate)."""
        d = self.d_model
        i = self._layer_arg(layer, "matmul_weights_per_layer")
        if not self.is_moe_layer(i):
            return self.attention_matmul_weights() + (3 if self.mlp.gated else 2) * d * self.d_ff
        e = self.moe
        ffn = d * e.n_experts + e.top_k * self.expert_parameters() + 3 * d * e.d_shared + (d if e.shared_gate else 0)
        return self.attention_matmul_weights() + ffn

    def attention_head_dims(self) -> tuple[int, int]:
        """(q.k width, value width) of one head: head_dim twice, or MLA's (nope + rope, v_head_dim)."""
        if self.mla.kv_lora_rank:
            return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim, self.mla.v_head_dim
        return self.head_dim, self.head_dim

    def kv_elements_per_token(self, layer: int) -> int:
        """Elements one token keeps in `layer`'s KV cache: K and V of every KV head, or MLA's latent plus its
        shared RoPE key (kv_lora_rank + qk_rope_head_dim, one for all heads)."""
        if self.mla.kv_lora_rank:
            return self.mla.kv_lora_rank + self.mla.qk_rope_head_dim
        spec = self.kv_spec()[layer]
        return spec.n_kv_heads * (spec.head_dim + spec.value_dim)

    def attended_tokens(self, layer: int, seq_len: int) -> int:
        """Keys one query at position seq_len - 1 attends to in `layer` (its window caps it)."""
        w = self.window(layer)
        return seq_len if w is None else min(seq_len, w)

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward): 6 x the matmul weights the token multiplies (a MoE
        block: its active experts), plus 6 * L * H * (d_qk + d_v) * T for attention scores and values (PaLM,
        appendix B: 12 L H D T when both widths are the head's; a windowed layer counts its window). The embedding
        lookup is not a matmul; the head always is."""
        t = seq_len or self.max_seq_len
        n_matmul = sum(self.matmul_weights_per_layer(i) for i in range(self.n_layers)) + self.vocab_size * self.d_model
        attended = sum(self.attended_tokens(i, t) for i in range(self.n_layers))
        dqk, dv = self.attention_head_dims()
        return 6 * n_matmul + 6 * self.n_heads * (dqk + dv) * attended


def _group_from_dict(cls: type, data: dict[str, Any], where: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"model config: unknown field(s) {unknown} in {where!r}; expected some of {sorted(names)}")
    return cls(**data)
