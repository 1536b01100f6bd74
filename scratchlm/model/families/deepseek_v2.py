"""DeepSeek-V2 (and -V2-Lite): multi-head latent attention (`model/mla.py`) and a mixture of experts with shared
experts after `first_k_dense_replace` dense layers (HF `DeepseekV2ForCausalLM`). The helpers here serve DeepSeek-V3
too (`deepseek_v3.py`), which differs in its router only. llama.cpp's GGUF arch `deepseek2` (V2, V3 and Kimi K2
alike) is read here too (`config_from_gguf`).

Config (HF config.json <-> ModelConfig):

- MLA: kv_lora_rank, q_lora_rank (None: q straight from x), qk_nope_head_dim, qk_rope_head_dim, v_head_dim ->
  `config.mla`; head_dim = qk_rope_head_dim (the RoPE width, as HF's config.head_dim), n_kv_heads = n_heads
  (num_key_value_heads is ignored: MLA has no KV heads). The RoPE pairs are
  interleaved (DeepSeek-V2's complex rotation; V3's `rope_interleave`, default true): rope_layout "adjacent".
  YaRN with mscale / mscale_all_dim (the real checkpoints) is supported (`ModelConfig.query_scale`).
- MoE: n_routed_experts, num_experts_per_tok, moe_intermediate_size -> d_expert; n_shared_experts x
  moe_intermediate_size -> d_shared; first_k_dense_replace (and DeepSeek's `moe_layer_freq`) -> dense_layers of
  width intermediate_size; V2's router is a softmax: topk_method greedy (n_groups 1) or group_limited_greedy
  (n_group, topk_group; a group scores its best expert); routed_scaling_factor multiplies the weights unless
  norm_topk_prob renormalises them (DeepSeek's MoEGate; HF 5.24's V2 router ignores norm_topk_prob, which every
  published V2 config has false).
- Not implemented (an error naming the field): attention_bias, mlp_bias, other activations than SiLU, other
  scoring_func / topk_method values.

Tensors: HF's per-expert names (`mlp.experts.{e}.gate_proj`, what transformers 5.24's save_pretrained writes and
the Hub holds; a file in transformers 5's fused 3D layout is read too: `base.moe_hf_rules`), `mlp.gate.weight`
(+ V3's `mlp.gate.e_score_correction_bias`), `mlp.shared_experts.*`,
`self_attn.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj` (split
per head into our `k_b_proj` / `v_b_proj`), `o_proj`. The multi-token-prediction layers the V3 checkpoints carry
after the last layer (`num_nextn_predict_layers`) are not used for decoding and are skipped (logged), as HF does.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import torch
from torch import Tensor

from scratchlm.model.config import MLAFeatures, MLPFeatures, ModelConfig, MoEFeatures
from scratchlm.model.families.base import (
    Family,
    FamilyError,
    MoENames,
    Rule,
    base_config,
    base_hf_config,
    check_act,
    gguf_base_config,
    gguf_meta,
    gguf_rope,
    moe_gguf_rules,
    moe_hf_rules,
    need,
    rename,
    rope_features,
    rope_parameters,
)

MOE_NAMES = MoENames(shared="shared_experts")  # mlp.gate, mlp.experts.{e}.*_proj, mlp.shared_experts.*_proj


def _int(cfg: dict[str, Any], key: str, source: str) -> int:
    return int(need(cfg, key, source))


def deepseek_config(cfg: dict[str, Any], source: str, *, v3: bool) -> ModelConfig:
    """`ModelConfig` of a DeepSeek-V2 (`v3` False) or -V3 / Kimi K2 config.json (see the module docstring)."""
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            raise FamilyError(f"{source}: {key}=true is not supported with multi-head latent attention")
    n_layers = _int(cfg, "num_hidden_layers", source)
    nope, rope_dim = int(cfg.get("qk_nope_head_dim", 128)), _int(cfg, "qk_rope_head_dim", source)
    q_lora = cfg.get("q_lora_rank")
    mla = MLAFeatures(kv_lora_rank=_int(cfg, "kv_lora_rank", source),
                      q_lora_rank=None if q_lora is None else int(q_lora), qk_nope_head_dim=nope,
                      qk_rope_head_dim=rope_dim, v_head_dim=_int(cfg, "v_head_dim", source))
    rope = rope_features(rope_parameters(cfg), cfg, rope_dim, source)
    if rope.rotary_dim is not None:
        raise FamilyError(f"{source}: partial_rotary_factor is not supported (MLA rotates qk_rope_head_dim dims)")
    interleaved = bool(cfg.get("rope_interleave", True)) if v3 else True
    return base_config(cfg, source, head_dim=rope_dim, n_kv_heads=int(need(cfg, "num_attention_heads", source)),
                       rope=rope, rope_layout="adjacent" if interleaved else "half", mla=mla,
                       moe=_moe(cfg, source, n_layers, v3), mlp=MLPFeatures(act=check_act(cfg, source)))


def _moe(cfg: dict[str, Any], source: str, n_layers: int, v3: bool) -> MoEFeatures:
    experts = cfg.get("n_routed_experts")
    if not experts:
        raise FamilyError(f"{source}: n_routed_experts is missing (a DeepSeek model has routed experts)")
    d_expert = _int(cfg, "moe_intermediate_size", source)
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    dense = [i for i in range(n_layers) if i < first_dense or i % freq]
    top_k = _int(cfg, "num_experts_per_tok", source)
    norm = bool(cfg.get("norm_topk_prob")) and top_k > 1
    scale = float(cfg.get("routed_scaling_factor") or 1.0)
    method, scoring = cfg.get("topk_method"), cfg.get("scoring_func")
    if v3:
        if method not in (None, "noaux_tc") or scoring not in (None, "sigmoid"):
            raise FamilyError(f"{source}: topk_method {method!r} / scoring_func {scoring!r} is not DeepSeek-V3's "
                              "(noaux_tc / sigmoid, the only router HF's DeepseekV3 implements)")
        groups, topk_groups = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        router = dict(scoring="sigmoid", group_score="top2", score_bias=True, routed_scale=scale, norm_topk=norm)
    else:
        method = method or "greedy"
        if method not in ("greedy", "group_limited_greedy") or scoring not in (None, "softmax"):
            raise FamilyError(f"{source}: topk_method {method!r} / scoring_func {scoring!r} is not supported for "
                              "DeepSeek-V2 (greedy or group_limited_greedy over a softmax)")
        grouped = method == "group_limited_greedy"
        groups = int(need(cfg, "n_group", source)) if grouped else 1
        topk_groups = int(need(cfg, "topk_group", source)) if grouped else 1
        router = dict(scoring="softmax", group_score="max", norm_topk=norm, routed_scale=1.0 if norm else scale)
    shared = int(cfg.get("n_shared_experts") or 0)
    return MoEFeatures(n_experts=int(experts), top_k=top_k, d_expert=d_expert, n_groups=groups,
                       topk_groups=topk_groups, d_shared=shared * d_expert, dense_layers=dense, **router)


def deepseek_hf_config(config: ModelConfig, *, v3: bool) -> dict[str, Any]:
    """The inverse of `deepseek_config`; a ValueError for what the HF config cannot express."""
    m, e = config.mla, config.moe
    if not m.kv_lora_rank or not e.n_experts:
        raise ValueError("a DeepSeek model has multi-head latent attention and routed experts")
    k = next((i for i in range(config.n_layers) if i not in e.dense_layers), config.n_layers)
    if e.dense_layers != list(range(k)):
        raise ValueError(f"dense layers {e.dense_layers} are not the first k layers (first_k_dense_replace)")
    if e.d_shared % config.d_expert:
        raise ValueError(f"d_shared={e.d_shared} is not a multiple of d_expert={config.d_expert}")
    want = ("sigmoid", "top2", True) if v3 else ("softmax", "max", False)
    if (e.scoring, e.group_score, e.score_bias) != want or (not v3 and e.norm_topk and e.routed_scale != 1.0):
        raise ValueError(f"the router is not DeepSeek-{'V3' if v3 else 'V2'}'s")
    if config.rope_layout == "half" and not v3:
        raise ValueError("DeepSeek-V2 rotates interleaved RoPE pairs (rope_layout 'adjacent')")
    model_type, arch = ("deepseek_v3", "DeepseekV3ForCausalLM") if v3 else ("deepseek_v2", "DeepseekV2ForCausalLM")
    out = base_hf_config(config, model_type, arch)
    out.pop("head_dim")  # HF derives it (= qk_rope_head_dim)
    out |= {
        "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim, "attention_bias": False,
        "n_routed_experts": e.n_experts, "num_experts_per_tok": e.top_k, "moe_intermediate_size": config.d_expert,
        "n_shared_experts": e.d_shared // config.d_expert, "first_k_dense_replace": k,
        "norm_topk_prob": e.norm_topk, "routed_scaling_factor": e.routed_scale, "n_group": e.n_groups,
        "topk_group": e.topk_groups,
    }
    if v3:
        out |= {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 0,
                "rope_interleave": config.rope_layout == "adjacent"}
    else:
        out |= {"topk_method": "greedy" if e.n_groups == 1 else "group_limited_greedy", "mlp_bias": False}
    return out


def deepseek_rules(config: ModelConfig, *, prefix: str = "model.",
                   present: Collection[str] | None = None) -> list[Rule]:
    """HF tensor names of `TransformerLM(config)` for a DeepSeek-V2/V3 checkpoint (see the module docstring); the
    experts per expert, or transformers 5's fused 3D tensors when `present` (the file's names) holds them."""
    rules = [rename("tok_embeddings.weight", f"{prefix}embed_tokens.weight"),
             rename("norm.weight", f"{prefix}norm.weight")]
    if not config.tie_embeddings:
        rules.append(rename("lm_head.weight", "lm_head.weight"))
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"{prefix}layers.{i}."
        a, sa = f"{ours}attn.", f"{theirs}self_attn."
        q = ["q_proj"] if config.mla.q_lora_rank is None else ["q_a_proj", "q_b_proj"]
        pairs = [(p, p) for p in q + ["o_proj"]] + [("kv_a_proj", "kv_a_proj_with_mqa")]
        rules += [rename(f"{a}{o}.weight", f"{sa}{t}.weight") for o, t in pairs]
        rules.append(kv_b_split(config, f"{sa}kv_b_proj.weight", a))
        norms = [("kv_a_norm", "kv_a_layernorm")] + ([("q_a_norm", "q_a_layernorm")] if config.mla.q_lora_rank else [])
        rules += [rename(f"{a}{o}.weight", f"{sa}{t}.weight") for o, t in norms]
        rules += [rename(f"{ours}attn_norm.weight", f"{theirs}input_layernorm.weight"),
                  rename(f"{ours}ffn_norm.weight", f"{theirs}post_attention_layernorm.weight")]
        if config.is_moe_layer(i):
            rules += moe_hf_rules(config, ours, theirs, MOE_NAMES, present)
        else:
            rules += [rename(f"{ours}ffn.{w}.weight", f"{theirs}mlp.{p}.weight")
                      for w, p in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj"))]
    return rules


def kv_b_split(config: ModelConfig, theirs: str, ours: str) -> Rule:
    """HF's `kv_b_proj` (H (n + v), c), per head its key rows then its value rows <-> `k_b_proj` (H n, c) and
    `v_b_proj` (H v, c) (rows only move: a row-blocked quantized tensor's planes split alike)."""
    m, h = config.mla, config.n_heads

    def load(t: Tensor) -> tuple[Tensor, Tensor]:
        k, v = t.reshape(h, m.qk_nope_head_dim + m.v_head_dim, -1).split((m.qk_nope_head_dim, m.v_head_dim), dim=1)
        return k.reshape(h * m.qk_nope_head_dim, -1), v.reshape(h * m.v_head_dim, -1)  # (H n, c), (H v, c)

    def save(k: Tensor, v: Tensor) -> Tensor:
        per_head = (k.reshape(h, m.qk_nope_head_dim, -1), v.reshape(h, m.v_head_dim, -1))
        return torch.cat(per_head, dim=1).reshape(h * (m.qk_nope_head_dim + m.v_head_dim), -1)

    return Rule(theirs, (f"{ours}k_b_proj.weight", f"{ours}v_b_proj.weight"), load, save)


def unused_hf_tensors(cfg: dict[str, Any]) -> dict[str, str]:
    """{tensor-name prefix: why} of the tensors a DeepSeek checkpoint carries that decoding does not use: the
    multi-token-prediction layers after the last one (`num_nextn_predict_layers`, DeepSeek-V3's layer 61)."""
    n, extra = int(cfg.get("num_hidden_layers") or 0), int(cfg.get("num_nextn_predict_layers") or 0)
    return {f"model.layers.{n + j}.": "a multi-token-prediction layer (num_nextn_predict_layers), not used to decode"
            for j in range(extra)}


# ---------------------------------------------------------------------------------------------- GGUF
GGUF_ARCH = "deepseek2"
_GATING = {None: "softmax", 0: "softmax", 1: "softmax", 2: "sigmoid"}  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    """llama.cpp's `deepseek2` (DeepSeek-V2/V3, Kimi K2 as convert_hf_to_gguf writes them), read as llama.cpp's graph
    computes it (src/models/deepseek2.cpp): MLA from `attention.kv_lora_rank`, `attention.q_lora_rank` (absent: q
    from x), `attention.key_length_mla` (nope + rope), `attention.value_length_mla`, `rope.dimension_count`; RoPE on
    adjacent pairs (LLAMA_ROPE_TYPE_NORM); `leading_dense_block_count` dense layers; the router's gating function
    (softmax, sigmoid), `expert_weights_norm`, `expert_weights_scale` (after the renormalisation, as llama.cpp
    does), `expert_group_count` / `expert_group_used_count` with a group scored by its best two (llama.cpp's only
    group rule, DeepSeek-V3's) and `exp_probs_b.bias` (V3's correction bias); the shared experts
    (`expert_shared_count` x `expert_feed_forward_length`). YaRN's `rope.scaling.yarn_log_multiplier` is
    0.1 x mscale_all_dim (the query scale's factor); llama.cpp keeps no separate mscale, i.e. mscale =
    mscale_all_dim (every published DeepSeek config). Files from converters before the k_b / v_b split (one
    `attn_kv_b`) are not supported."""
    arch = GGUF_ARCH
    if f"{arch}.attention.key_length_mla" not in meta:
        raise FamilyError(f"{source}: no {arch}.attention.key_length_mla: a GGUF from a converter before the MLA "
                          "k_b / v_b split is not supported (reconvert it with a current convert_hf_to_gguf.py)")
    rope_dim = int(gguf_meta(meta, arch, "rope.dimension_count", source))
    nope = int(meta[f"{arch}.attention.key_length_mla"]) - rope_dim
    q_lora = int(meta.get(f"{arch}.attention.q_lora_rank", 0) or 0)
    mla = MLAFeatures(kv_lora_rank=int(gguf_meta(meta, arch, "attention.kv_lora_rank", source)),
                      q_lora_rank=q_lora or None, qk_nope_head_dim=nope, qk_rope_head_dim=rope_dim,
                      v_head_dim=int(gguf_meta(meta, arch, "attention.value_length_mla", source)))
    theta = float(meta.get(f"{arch}.rope.freq_base", 10_000.0))
    rope = gguf_rope(meta, tensors, arch, rope_dim, theta, source)
    log_mul = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
    if log_mul:
        rope.mscale = rope.mscale_all_dim = float(log_mul) / 0.1
    n_heads = int(gguf_meta(meta, arch, "attention.head_count", source))
    return gguf_base_config(meta, tensors, arch, source, head_dim=rope_dim, n_kv_heads=n_heads, rope=rope,
                            rope_layout="adjacent", mla=mla, moe=_gguf_moe(meta, tensors, source))


def _gguf_moe(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> MoEFeatures:
    arch = GGUF_ARCH
    gating = meta.get(f"{arch}.expert_gating_func")
    if gating not in _GATING:
        raise FamilyError(f"{source}: {arch}.expert_gating_func={gating} is not supported (softmax or sigmoid)")
    n_layers = int(gguf_meta(meta, arch, "block_count", source))
    dense = int(meta.get(f"{arch}.leading_dense_block_count", 0) or 0)
    d_expert = int(gguf_meta(meta, arch, "expert_feed_forward_length", source))
    groups = int(meta.get(f"{arch}.expert_group_count", 1) or 1)
    scoring = _GATING[gating]
    return MoEFeatures(
        n_experts=int(gguf_meta(meta, arch, "expert_count", source)),
        top_k=int(gguf_meta(meta, arch, "expert_used_count", source)), d_expert=d_expert,
        scoring=scoring, norm_topk=bool(meta.get(f"{arch}.expert_weights_norm", False)),
        routed_scale=float(meta.get(f"{arch}.expert_weights_scale", 1.0) or 1.0), n_groups=groups,
        topk_groups=int(meta.get(f"{arch}.expert_group_used_count", 1) or 1) if groups > 1 else 1,
        group_score="top2" if groups > 1 or scoring == "sigmoid" else "max",
        score_bias=f"blk.{dense}.exp_probs_b.bias" in tensors,
        d_shared=int(meta.get(f"{arch}.expert_shared_count", 0) or 0) * d_expert,
        dense_layers=list(range(min(dense, n_layers))))


def gguf_rules(config: ModelConfig) -> list[Rule]:
    """llama.cpp's `deepseek2` tensor names: `attn_q` or `attn_q_a` / `attn_q_a_norm` / `attn_q_b`,
    `attn_kv_a_mqa`, `attn_kv_a_norm`, `attn_k_b` (H, c, n: each head's key part transposed), `attn_v_b`
    (H, v, c), `attn_output`; the dense layers' `ffn_*`, the MoE layers' `base.moe_gguf_rules`."""
    m, h = config.mla, config.n_heads
    rules = [rename("tok_embeddings.weight", "token_embd.weight"), rename("norm.weight", "output_norm.weight")]
    if not config.tie_embeddings:
        rules.append(rename("lm_head.weight", "output.weight"))
    c = m.kv_lora_rank

    def k_b(theirs: str, ours: str) -> Rule:  # (H, c, n) <-> (H n, c)
        return Rule(theirs, (ours,), lambda t: (t.reshape(h, c, -1).transpose(1, 2).reshape(-1, c),),
                    lambda w: w.reshape(h, -1, c).transpose(1, 2).contiguous(), rows=False)

    def v_b(theirs: str, ours: str) -> Rule:  # (H, v, c) <-> (H v, c)
        return Rule(theirs, (ours,), lambda t: (t.reshape(-1, t.shape[-1]),), lambda w: w.reshape(h, -1, c))

    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"blk.{i}."
        a = f"{ours}attn."
        q = [("q_proj", "attn_q")] if m.q_lora_rank is None else [("q_a_proj", "attn_q_a"), ("q_b_proj", "attn_q_b"),
                                                                  ("q_a_norm", "attn_q_a_norm")]
        named = q + [("kv_a_proj", "attn_kv_a_mqa"), ("kv_a_norm", "attn_kv_a_norm"), ("o_proj", "attn_output")]
        rules += [rename(f"{a}{o}.weight", f"{theirs}{t}.weight") for o, t in named]
        rules += [k_b(f"{theirs}attn_k_b.weight", f"{a}k_b_proj.weight"),
                  v_b(f"{theirs}attn_v_b.weight", f"{a}v_b_proj.weight")]
        rules += [rename(f"{ours}attn_norm.weight", f"{theirs}attn_norm.weight"),
                  rename(f"{ours}ffn_norm.weight", f"{theirs}ffn_norm.weight")]
        if config.is_moe_layer(i):
            rules += moe_gguf_rules(config, ours, theirs)
        else:
            rules += [rename(f"{ours}ffn.{w}.weight", f"{theirs}{g}.weight")
                      for w, g in (("w1", "ffn_gate"), ("w2", "ffn_down"), ("w3", "ffn_up"))]
    return rules


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    return deepseek_config(cfg, source, v3=False)


def hf_config(config: ModelConfig) -> dict[str, Any]:
    return deepseek_hf_config(config, v3=False)


FAMILY = Family(
    name="deepseek_v2",
    hf_model_types=("deepseek_v2",),
    hf_architectures=("DeepseekV2ForCausalLM",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=deepseek_rules,
    hf_file_rules=lambda c, names: deepseek_rules(c, present=names),
    hf_unused=unused_hf_tensors,
    gguf_archs=(GGUF_ARCH,),
    config_from_gguf=config_from_gguf,
    gguf_rules=gguf_rules,
)
