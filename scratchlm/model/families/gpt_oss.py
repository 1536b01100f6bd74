"""gpt-oss (OpenAI's gpt-oss-20b / 120b; HF `GptOssForCausalLM`): the Llama block with q/k/v/o biases
(`attention_bias`), attention sinks (`self_attn.sinks`, one logit per query head in each softmax denominator),
sliding windows on the layers `layer_types` marks (every other one, from layer 0), YaRN RoPE without truncation of
its ramp (`truncate: false`), and every layer a mixture of `num_local_experts` experts of width `intermediate_size`:
a router with a bias whose top `num_experts_per_tok` logits are softmaxed (`moe.scoring="topk_softmax"`), experts
with biases on gate, up and down and the clamped SwiGLU min(g, limit) * sigmoid(alpha * min(g, limit)) *
(clamp(u, -limit, limit) + 1) (`swiglu_alpha` 1.702, `swiglu_limit` 7). `hidden_act` is not read by HF's experts
either.

Tensors (what transformers 5's `save_pretrained` writes): `mlp.router.weight` / `.bias`, and per layer the experts
stacked, `mlp.experts.gate_up_proj` (E, D, 2F) with gate and up interleaved in its columns (gate even, up odd),
`gate_up_proj_bias` (E, 2F) likewise, `down_proj` (E, F, D) and `down_proj_bias` (E, D): x @ W, where our
linears hold W^T. The Hub's own files keep the experts MXFP4-quantized (`*_blocks` / `*_scales`,
`quantization_config` mxfp4): an error naming it; transformers loads them with `Mxfp4Config(dequantize=True)` and
saves the float checkpoint this reads.

GGUF (llama.cpp's `gpt-oss` arch, its converter's names: `attn_sinks`, `post_attention_norm`, `ffn_gate_inp` with a
bias, stacked `ffn_{gate,up,down}_exps` with stacked biases): llama.cpp's graph hard-codes what the file does not
say, and so does this reader: alpha 1.702 and limit 7 of the clamped SwiGLU, the softmax over the top-k logits, the
windows on every other layer from layer 0 (`attention.sliding_window_pattern` 2, or the file's), and YaRN as
gpt-oss configures it (HF's untruncated ramp; llama.cpp's ggml rounds the ramp's ends).

`router_aux_loss_coef` and `output_router_logits` act in training only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig, MoEFeatures
from scratchlm.model.families.base import (
    Family,
    FamilyError,
    Rule,
    base_config,
    base_hf_config,
    gguf_base_config,
    gguf_llama_rules,
    gguf_meta,
    gguf_moe,
    layer_types,
    llama_rules,
    need,
    rename,
    sliding_layers_from_types,
)

# GptOssConfig's defaults where a config.json leaves them out
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
DEFAULT_THETA = 150_000.0


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    quant = cfg.get("quantization_config")
    if quant:
        raise FamilyError(f"{source}: quantization_config {quant.get('quant_method', quant)!r} (the Hub's MXFP4 "
                          "experts) is not supported; load the model in transformers with "
                          "Mxfp4Config(dequantize=True), save_pretrained it, and load that")
    if not cfg.get("rope_parameters") and not cfg.get("rope_scaling"):
        cfg = cfg | {"rope_parameters": DEFAULT_ROPE | {"rope_theta": cfg.get("rope_theta", DEFAULT_THETA)}}
    cfg = {"rope_theta": DEFAULT_THETA, "rms_norm_eps": 1e-5} | cfg
    n_layers = int(need(cfg, "num_hidden_layers", source))
    sliding = sliding_layers_from_types(cfg, n_layers)
    if sliding is None:  # GptOssConfig's layer_types: layer i slides when (i + 1) % 2
        sliding = [i for i in range(n_layers) if (i + 1) % 2]
    window = cfg.get("sliding_window")
    window = int(window) if window and sliding else None
    n = int(need(cfg, "num_local_experts", source))
    if n <= 0:
        raise FamilyError(f"{source}: num_local_experts={n} must be positive")
    bias = bool(cfg.get("attention_bias", True))
    return base_config(
        cfg, source, qkv_bias=bias,
        attn=AttentionFeatures(o_bias=bias, sliding_window=window, sliding_layers=sliding if window else None,
                               sinks=True),
        mlp=MLPFeatures(bias=True, swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                        swiglu_limit=float(cfg.get("swiglu_limit", 7.0))),
        moe=MoEFeatures(n_experts=n, top_k=int(cfg.get("num_experts_per_tok", 4)), scoring="topk_softmax",
                        norm_topk=False, router_bias=True))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    m, e, a = config.mlp, config.moe, config.attn
    if (not a.sinks or e.scoring != "topk_softmax" or not e.router_bias or not m.bias or m.swiglu_limit is None
            or e.dense_layers or e.d_shared or e.d_expert not in (None, config.d_ff) or a.o_bias != config.qkv_bias):
        raise ValueError("gpt_oss: sinks, the top-k softmax router with a bias, biased clamped-SwiGLU experts of "
                         "width intermediate_size in every layer, biases on q/k/v/o or none")
    return base_hf_config(config, "gpt_oss", "GptOssForCausalLM") | {
        "attention_bias": config.qkv_bias, "layer_types": layer_types(config), "sliding_window": a.sliding_window,
        "num_local_experts": e.n_experts, "num_experts_per_tok": e.top_k, "swiglu_alpha": m.swiglu_alpha,
        "swiglu_limit": m.swiglu_limit, "output_router_logits": False}


ARCH = "gpt-oss"


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    n_layers = int(gguf_meta(meta, ARCH, "block_count", source))
    pattern = meta.get(f"{ARCH}.attention.sliding_window_pattern", 2)  # llama.cpp's set_swa_pattern
    if isinstance(pattern, list):
        sliding = [i for i, s in enumerate(pattern[:n_layers]) if s]
    else:
        p = int(pattern)
        sliding = [i for i in range(n_layers) if p == 0 or i % p < p - 1]
    window = meta.get(f"{ARCH}.attention.sliding_window")
    window = int(window) if window and sliding else None
    theta = float(meta.get(f"{ARCH}.rope.freq_base", DEFAULT_THETA))
    if float(meta.get(f"{ARCH}.rope.freq_base_swa", theta)) != theta:
        raise FamilyError(f"{source}: {ARCH}.rope.freq_base_swa differs from rope.freq_base: not supported")
    config = gguf_base_config(meta, tensors, ARCH, source, attn=AttentionFeatures(
        sliding_window=window, sliding_layers=sliding if window else None, sinks=True))
    moe = gguf_moe(meta, tensors, ARCH, source, norm_topk=False, d_ff=config.d_ff)
    try:
        return replace(config, rope=replace(config.rope, truncate=False),
                       mlp=MLPFeatures(bias="blk.0.ffn_gate_exps.bias" in tensors, swiglu_alpha=1.702,
                                       swiglu_limit=7.0),
                       moe=replace(moe, scoring="topk_softmax", router_bias="blk.0.ffn_gate_inp.bias" in tensors))
    except ValueError as e:
        raise FamilyError(f"{source}: {e}") from None


def gguf_rules(config: ModelConfig) -> list[Rule]:
    """llama.cpp's names (`gguf_llama_rules` with its MoE tensors), the sinks, the router bias and the experts'
    stacked biases (E, F) / (E, D)."""
    rules = gguf_llama_rules(config, norms={"attn_norm": "attn_norm", "ffn_norm": "post_attention_norm"})
    for i in range(config.n_layers):
        ours, theirs = f"layers.{i}.", f"blk.{i}."
        rules.append(rename(f"{ours}attn.sinks", f"{theirs}attn_sinks.weight"))
        if config.moe.router_bias:
            rules.append(rename(f"{ours}ffn.router_bias", f"{theirs}ffn_gate_inp.bias"))
        if config.mlp.bias:
            rules += [Rule(f"{theirs}{g}.bias", _names(config, ours, b), lambda t: tuple(t.unbind(0)),
                           lambda *p: torch.stack(p), rows=False)
                      for b, g in (("b1", "ffn_gate_exps"), ("b2", "ffn_down_exps"), ("b3", "ffn_up_exps"))]
    return rules


def _names(config: ModelConfig, ours: str, name: str) -> tuple[str, ...]:
    return tuple(f"{ours}ffn.experts.{e}.{name}" for e in range(config.moe.n_experts))


def _load_gate_up(t: Tensor) -> tuple[Tensor, ...]:
    """(E, D, 2F) gate/up interleaved -> E gate weights (F, D), then E up weights (F, D)."""
    gate, up = t[..., 0::2].transpose(1, 2).contiguous(), t[..., 1::2].transpose(1, 2).contiguous()  # (E, F, D)
    return tuple(gate.unbind(0)) + tuple(up.unbind(0))


def _save_gate_up(*parts: Tensor) -> Tensor:
    n = len(parts) // 2
    gate, up = torch.stack(parts[:n]).transpose(1, 2), torch.stack(parts[n:]).transpose(1, 2)  # (E, D, F) each
    return torch.stack((gate, up), dim=-1).flatten(-2)  # (E, D, F, 2) -> (E, D, 2F): gate even, up odd


def _load_gate_up_bias(t: Tensor) -> tuple[Tensor, ...]:
    """(E, 2F) interleaved -> E gate biases (F,), then E up biases (F,)."""
    return tuple(t[:, 0::2].contiguous().unbind(0)) + tuple(t[:, 1::2].contiguous().unbind(0))


def _save_gate_up_bias(*parts: Tensor) -> Tensor:
    n = len(parts) // 2
    return torch.stack((torch.stack(parts[:n]), torch.stack(parts[n:])), dim=-1).flatten(-2)  # (E, F, 2) -> (E, 2F)


def _transposed_stack(t: Tensor) -> tuple[Tensor, ...]:
    """down_proj (E, F, D) -> E weights (D, F)."""
    return tuple(t.transpose(1, 2).contiguous().unbind(0))


def experts_rules(config: ModelConfig, ours: str, theirs: str) -> list[Rule]:
    """One layer's router and stacked experts (`ours` = "layers.N.", `theirs` = "model.layers.N.")."""
    w1, w2, w3 = (_names(config, ours, f"{w}.weight") for w in ("w1", "w2", "w3"))
    b1, b2, b3 = (_names(config, ours, b) for b in ("b1", "b2", "b3"))
    block = f"{theirs}mlp."
    return [rename(f"{ours}ffn.gate.weight", f"{block}router.weight"),
            rename(f"{ours}ffn.router_bias", f"{block}router.bias"),
            Rule(f"{block}experts.gate_up_proj", w1 + w3, _load_gate_up, _save_gate_up, rows=False),
            Rule(f"{block}experts.gate_up_proj_bias", b1 + b3, _load_gate_up_bias, _save_gate_up_bias, rows=False),
            Rule(f"{block}experts.down_proj", w2, _transposed_stack,
                 lambda *p: torch.stack(p).transpose(1, 2).contiguous(), rows=False),
            Rule(f"{block}experts.down_proj_bias", b2, lambda t: tuple(t.unbind(0)), lambda *p: torch.stack(p))]


def hf_rules(config: ModelConfig) -> list[Rule]:
    """Llama's names for attention, norms and embeddings, the sinks, and the experts of `experts_rules`."""
    rules = [r for r in llama_rules(config) if ".ffn." not in r.ours[0]]  # the MoE layers' Llama/Qwen names: ours
    for i in range(config.n_layers):
        rules.append(rename(f"layers.{i}.attn.sinks", f"model.layers.{i}.self_attn.sinks"))
        rules += experts_rules(config, f"layers.{i}.", f"model.layers.{i}.")
    return rules


FAMILY = Family(
    name="gpt_oss",
    hf_model_types=("gpt_oss",),
    hf_architectures=("GptOssForCausalLM",),
    gguf_archs=(ARCH,),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=hf_rules,
    config_from_gguf=config_from_gguf,
    gguf_rules=gguf_rules,
)
