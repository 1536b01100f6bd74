"""Llama 1/2/3.x (RoPE scaling llama3, tied or untied head) and SmolLM2: the plain block.

HF `LlamaForCausalLM` (`attention_bias` puts biases on q/k/v/o, `mlp_bias` on the MLP); GGUF arch `llama`, whose
converter stores q/k rows in the adjacent-pair order (undone at load). Mistral-shaped GGUFs are arch `llama` too:
their window is not in the GGUF metadata. So are Mixtral's: `llama.expert_count` > 0 makes the MLP a mixture of
experts (`base.gguf_moe`: the router `ffn_gate_inp`, stacked `ffn_{gate,down,up}_exps`; llama.cpp's llama graph
renormalises the top-k weights), exported to HF as Mixtral.
"""

from __future__ import annotations

from typing import Any

from scratchlm.model.config import AttentionFeatures, MLPFeatures, ModelConfig
from scratchlm.model.families.base import (
    Family,
    FamilyError,
    base_config,
    base_hf_config,
    check_act,
    gguf_base_config,
    gguf_llama_rules,
    gguf_moe,
    llama_rules,
)


def config_from_hf(cfg: dict[str, Any], source: str) -> ModelConfig:
    bias = bool(cfg.get("attention_bias"))
    if cfg.get("pretraining_tp", 1) not in (1, None):
        raise FamilyError(f"{source}: pretraining_tp={cfg['pretraining_tp']} is not supported")
    return base_config(cfg, source, qkv_bias=bias, attn=AttentionFeatures(o_bias=bias),
                       mlp=MLPFeatures(act=check_act(cfg, source), bias=bool(cfg.get("mlp_bias"))))


def hf_config(config: ModelConfig) -> dict[str, Any]:
    return base_hf_config(config, "llama", "LlamaForCausalLM") | {"attention_bias": config.qkv_bias,
                                                                    "mlp_bias": config.mlp.bias}


def config_from_gguf(meta: dict[str, Any], tensors: dict[str, Any], source: str) -> ModelConfig:
    d_ff = int(meta.get("llama.feed_forward_length", 0))
    return gguf_base_config(meta, tensors, "llama", source,
                            moe=gguf_moe(meta, tensors, "llama", source, norm_topk=True, d_ff=d_ff))


FAMILY = Family(
    name="llama",
    export_rank=0,
    hf_model_types=("llama",),
    hf_architectures=("LlamaForCausalLM",),
    gguf_archs=("llama",),
    config_from_hf=config_from_hf,
    hf_config=hf_config,
    hf_rules=llama_rules,
    config_from_gguf=config_from_gguf,
    gguf_rules=lambda c: gguf_llama_rules(c, permute_qk=True),
)
