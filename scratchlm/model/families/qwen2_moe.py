"""Qwen1.5-MoE / Qwen2-MoE: the Qwen2 block (q/k/v biases) whose MLP is a mixture of `num_experts` experts of
width `moe_intermediate_size`, `num_experts_per_tok` per token, softmax router (top-k weights renormalised only
when `norm_topk_prob`), plus a shared expert of width `shared_expert_intermediate_size` behind a sigmoid gate
(`shared_expert_gate`). Dense layers (MLP of `intermediate_size`): those in `mlp_only_layers` and those off the
`decoder_sparse_step` (layer i is sparse when (i + 1) % step == 0). HF `Qwen2MoeForCausalLM`
(`mlp.gate`, `mlp.experts.N.gate_proj|up_proj|down_proj`, or transformers 5's fused `mlp.experts.gate_up_proj`);
GGUF arch `qwen2moe` (`ffn_*_exps`, `ffn_*_shexp`, `ffn_gate_inp_shexp`), where llama.cpp never renormalises
the top-k weights: a file of that arch reads as norm_topk False.

`router_aux_loss_coef` and `output_router_logits` act in training only.
"""

from __future__ import annotations

from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig, MoEFeatures
from scratchlm.model.families.base import (
    Family,
    FamilyError,
    base_config,
    base_hf_config,
    check_act,
    gguf_base_config,
    gguf_llama_rules,
    gguf_moe,
    layer_types,
    llama_rules,
    need,
    sliding_layers_from_types,
)


def qwen_moe_features(cfg: dict[str, Any], source: str, *, shared: bool) -> MoEFeatures:
    """The MoE fields Qwen2-MoE and Qwen3-MoE spell alike (`shared`: the shared expert and its gate, Qwen2's)."""
    n = int(cfg.get("num_experts", cfg.get("num_local_experts")) or 0)
    if n == 0:
        return MoEFeatures()
    layers = int(need(cfg, "num_hidden_layers", source))
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = set(cfg.get("mlp_only_layers") or [])
    d_shared = int(cfg.get("shared_expert_intermediate_size") or 0) if shared else 0
    if shared and d_shared <= 0:
        raise FamilyError(f"{source}: shared_expert_intermediate_size={d_shared} is not supported (HF builds the "
                          "shared expert and its gate whatever its width)")
    return MoEFeatures(
        n_experts=n, top_k=int(need(cfg, "num_experts_per_tok", source)),
        d_expert=int(need(cfg, "moe_intermediate_size", source)), norm_topk=bool(cfg.get("norm_topk_prob", False)),
        d_shared=d_shared, shared_gate=shared,
        dense_layers=[i for i in range(layers) if i in only or (i + 1) % step])


def qwen_moe_to_hf(config: ModelConfig) -> dict[str, Any]:
    """The inverse of `qwen_moe_features` (dense layers as `mlp_only_layers`, `decoder_sparse_step` 1)."""
    m = config.moe
    if not m.n_experts or m.scoring != "softmax" or m.n_groups != 1 or m.score_bias or m.routed_scale != 1.0:
        raise ValueError("qwen MoE: a softmax router over ungrouped experts")
    return {"num_experts": m.n_experts, "num_experts_per_tok": m.top_k, "moe_intermediate_size": config.d_expert,
            "norm_topk_prob": m.norm_topk, "decoder_sparse_step": 1, "mlp_only_layers": list(m.dense_layers),
            "output_router_logits": False}


def _window_from_hf(cfg: dict[str, Any], n: int) -> dict[str, Any]:
    """Qwen2-MoE's windows: on the `layer_types` marked sliding; without them, HF's default pattern (every other
    layer from 0, below `max_window_layers`)."""
    if not (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
        return {}
    layers = sliding_layers_from_types(cfg, n)
    if layers is None:
        layers = [i for i in range(n) if (i + 1) % 2 and i < int(cfg.get("max_window_layers", 28))]
    return {"sliding_window": int(cfg["sliding_window"]), "sliding_layers": layers}


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    n = int(need(cfg, "num_hidden_layers", source))
    return base_config(cfg, source, qkv_bias=bool(cfg.get("qkv_bias", True)),
                       attn=AttentionFeatures(**_window_from_hf(cfg, n)), mlp=MLPFeatures(act=check_act(cfg, source)),
                       moe=qwen_moe_features(cfg, source, shared=True))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    m = config.moe
    if config.attn.o_bias or not (m.d_shared and m.shared_gate):
        raise ValueError("qwen2_moe: no o_proj bias, a gated shared expert")
    window = config.attn.sliding_window
    return base_hf_config(config, "qwen2_moe", "Qwen2MoeForCausalLM") | qwen_moe_to_hf(config) | {
        "qkv_bias": config.qkv_bias, "shared_expert_intermediate_size": m.d_shared,
        "use_sliding_window": window is not None, "sliding_window": window, "layer_types": layer_types(config),
        "max_window_layers": config.n_layers}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    return gguf_base_config(meta, tensors, "qwen2moe", source,
                            moe=gguf_moe(meta, tensors, "qwen2moe", source, norm_topk=False))


FAMILY = Family(
    name="qwen2_moe",
    hf_model_types=("qwen2_moe",),
    hf_architectures=("Qwen2MoeForCausalLM",),
    gguf_archs=("qwen2moe",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=llama_rules,
    hf_file_rules=lambda c, names: llama_rules(c, present=names),
    config_from_gguf=config_from_gguf,
    gguf_rules=gguf_llama_rules,
)
