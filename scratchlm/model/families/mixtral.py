"""Mixtral: the Mistral block whose MLP is a mixture of `num_local_experts` experts, `num_experts_per_tok` per
token, softmax router with the top-k weights renormalised, every layer sparse, no shared expert (HF
`MixtralForCausalLM`: `block_sparse_moe.gate` / `block_sparse_moe.experts.N.w1|w2|w3`; transformers 5's fused
`mlp.experts.gate_up_proj` is read too). GGUF: arch `llama` with `llama.expert_count` (the llama family reads it).

`router_jitter_noise`, `router_aux_loss_coef` and `output_router_logits` act in training only.
"""

from __future__ import annotations

from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig, MoEFeatures
from scratchlm.model.families.base import (
    Family,
    FamilyError,
    MoENames,
    base_config,
    base_hf_config,
    check_act,
    llama_rules,
    need,
)

NAMES = MoENames(block="block_sparse_moe", experts=("w1", "w2", "w3"))


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    window = cfg.get("sliding_window")
    n = int(need(cfg, "num_local_experts", source))
    if n <= 0:
        raise FamilyError(f"{source}: num_local_experts={n} must be positive")
    return base_config(cfg, source, attn=AttentionFeatures(sliding_window=int(window) if window else None),
                       mlp=MLPFeatures(act=check_act(cfg, source)),
                       moe=MoEFeatures(n_experts=n, top_k=int(cfg.get("num_experts_per_tok", 2)), norm_topk=True))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    m = config.moe
    if not m.n_experts or m.dense_layers or m.d_shared or m.d_expert not in (None, config.d_ff):
        raise ValueError("mixtral: every layer sparse, experts of width intermediate_size, no shared expert")
    return base_hf_config(config, "mixtral", "MixtralForCausalLM") | {
        "sliding_window": config.attn.sliding_window, "num_local_experts": m.n_experts,
        "num_experts_per_tok": m.top_k, "router_jitter_noise": 0.0, "output_router_logits": False}


FAMILY = Family(
    name="mixtral",
    hf_model_types=("mixtral",),
    hf_architectures=("MixtralForCausalLM",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=lambda c: llama_rules(c, moe=NAMES),
    hf_file_rules=lambda c, names: llama_rules(c, moe=NAMES, present=names),
)
