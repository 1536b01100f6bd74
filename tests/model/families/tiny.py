"""Tiny random checkpoints of every family, built by transformers' own config classes (no downloads).

`FAMILIES` maps a case name to a function returning the HF config object; `save_tiny(name, dir)` writes the
checkpoint with `save_pretrained` (random weights, seeded, norms perturbed away from 1 so a missed norm offset or a
swapped norm shows). The HF model itself is the oracle of every test that uses these.
"""

from __future__ import annotations

from pathlib import Path

import torch

BASE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)


def _llama(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(**(BASE | kw))


def _llama3():
    return _llama(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}, rope_theta=500000.0, tie_word_embeddings=True)


def _mistral():
    from transformers import MistralConfig

    return MistralConfig(**(BASE | dict(sliding_window=8)))


def _qwen2():
    from transformers import Qwen2Config

    return Qwen2Config(**BASE, tie_word_embeddings=False)


def _qwen3():
    from transformers import Qwen3Config

    return Qwen3Config(**BASE, head_dim=32, tie_word_embeddings=True)


def _gemma():
    from transformers import GemmaConfig

    return GemmaConfig(**(BASE | dict(head_dim=16)), hidden_activation="gelu_pytorch_tanh")


def _gemma2():
    from transformers import Gemma2Config

    return Gemma2Config(**(BASE | dict(head_dim=16, num_hidden_layers=4)), sliding_window=6,
                        query_pre_attn_scalar=24, attn_logit_softcapping=5.0, final_logit_softcapping=30.0)


def _gemma3():
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(**(BASE | dict(head_dim=16, num_hidden_layers=4)), sliding_window=6,
                            query_pre_attn_scalar=24, rope_local_base_freq=100.0,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                         "sliding_attention"],
                            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                "rope_theta": 1_000_000.0},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})


def _phi3():
    from transformers import Phi3Config

    half = 8  # head_dim 16 -> 8 rotated frequencies
    return Phi3Config(**(BASE | dict(max_position_embeddings=64)), original_max_position_embeddings=32,
                      rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
                                    "long_factor": [2.0 + 0.3 * i for i in range(half)]},
                      tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _phi4_mini():
    from transformers import Phi3Config

    rotated = 6  # head_dim 16, partial_rotary_factor 0.75 -> 12 dims, 6 frequencies
    return Phi3Config(**(BASE | dict(max_position_embeddings=64)), original_max_position_embeddings=32,
                      partial_rotary_factor=0.75,
                      rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(rotated)],
                                    "long_factor": [2.0 + 0.3 * i for i in range(rotated)]},
                      tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _olmo2():
    from transformers import Olmo2Config

    return Olmo2Config(**BASE, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _granite():
    from transformers import GraniteConfig

    return GraniteConfig(**BASE, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.2,
                         logits_scaling=2.5, tie_word_embeddings=True)


def _gpt2():
    from transformers import GPT2Config

    return GPT2Config(vocab_size=160, n_embd=64, n_layer=3, n_head=4, n_positions=128, activation_function="gelu_new",
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def _smollm3():
    from transformers import SmolLM3Config

    return SmolLM3Config(**(BASE | dict(num_hidden_layers=4)), tie_word_embeddings=True, pad_token_id=0,
                         bos_token_id=1, eos_token_id=2)  # layer 3 has no RoPE


MLA = dict(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12)
MOE = dict(moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2,
           first_k_dense_replace=1)


def _deepseek_v2(**kw):
    from transformers import DeepseekV2Config

    return DeepseekV2Config(**(BASE | dict(num_key_value_heads=4) | MLA | MOE | kw))


def _deepseek_v3(**kw):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(**(BASE | dict(num_key_value_heads=4) | MLA | MOE | kw))


FAMILIES = {
    "llama": lambda: _llama(tie_word_embeddings=False),
    "llama_tied": lambda: _llama(tie_word_embeddings=True),
    "llama3": _llama3,
    "llama_bias": lambda: _llama(attention_bias=True, mlp_bias=True),
    "llama_yarn": lambda: _llama(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                               "original_max_position_embeddings": 32}),
    "llama_dynamic": lambda: _llama(max_position_embeddings=8, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "phi4_mini": _phi4_mini,
    "olmo2": _olmo2,
    "granite": _granite,
    "gpt2": _gpt2,
    "smollm3": _smollm3,
}

#: DeepSeek-V2/V3 (MLA + MoE), kept apart from FAMILIES: the backends that FAMILIES' other tests run (the fused
#: step, TP, GGUF through llama.cpp's converter, the planner) do not take MLA yet; tests/model/families/
#: test_deepseek.py runs these through the HF loader, the engine and the exporter.
MLA_FAMILIES = {
    # MLA + MoE: q through q_lora_rank or straight from x, greedy or group-limited routing, V3's sigmoid router with
    # groups and its correction bias, a YaRN with DeepSeek's mscale (query scale and cos/sin factor)
    "deepseek_v2": lambda: _deepseek_v2(q_lora_rank=None, topk_method="greedy"),
    "deepseek_v2_groups": lambda: _deepseek_v2(q_lora_rank=24, topk_method="group_limited_greedy", n_group=4,
                                               topk_group=2, routed_scaling_factor=1.5),
    "deepseek_v3": lambda: _deepseek_v3(q_lora_rank=24, n_group=4, topk_group=2),
    "deepseek_v3_yarn": lambda: _deepseek_v3(q_lora_rank=None, n_group=2, topk_group=1, rope_interleave=False,
                                             rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                              "original_max_position_embeddings": 64, "mscale": 0.8,
                                                              "mscale_all_dim": 1.0}),
    # DeepSeek-V3's own YaRN (mscale = mscale_all_dim = 1: cos/sin unscaled, the query scale x mscale^2), which a GGUF
    # can say (yarn_log_multiplier)
    "deepseek_v3_mscale": lambda: _deepseek_v3(q_lora_rank=24, n_group=4, topk_group=2,
                                               rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                                                "rope_theta": 10000.0, "mscale": 1.0,
                                                                "original_max_position_embeddings": 64,
                                                                "mscale_all_dim": 1.0}),
}


def _mixtral():
    from transformers import MixtralConfig

    return MixtralConfig(**BASE, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)


def _qwen2_moe():
    from transformers import Qwen2MoeConfig

    # layer 1 dense (mlp_only_layers), a gated shared expert, top-k weights not renormalised (Qwen1.5-MoE's)
    return Qwen2MoeConfig(**BASE, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False,
                          tie_word_embeddings=False)


def _qwen2_moe_all_sparse():
    from transformers import Qwen2MoeConfig

    return Qwen2MoeConfig(**BASE, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=48, norm_topk_prob=False,
                          tie_word_embeddings=False)  # llama.cpp's qwen2moe needs output.weight


def _qwen3_moe():
    from transformers import Qwen3MoeConfig

    # layers 0 and 2 dense (decoder_sparse_step 2: layer i is sparse when (i + 1) % 2 == 0), renormalised top-k
    return Qwen3MoeConfig(**(BASE | dict(num_hidden_layers=4)), head_dim=32, num_experts=8, num_experts_per_tok=3,
                          moe_intermediate_size=24, decoder_sparse_step=2, norm_topk_prob=True,
                          tie_word_embeddings=True)


def _qwen3_moe_all_sparse():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**BASE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                          tie_word_embeddings=False)


def _qwen2_moe_window():
    from transformers import Qwen2MoeConfig

    # HF's layer_types from use_sliding_window: every other layer below max_window_layers slides (layer 0 here)
    return Qwen2MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                          shared_expert_intermediate_size=32, use_sliding_window=True, sliding_window=8,
                          max_window_layers=2, tie_word_embeddings=False)


def _qwen3_moe_window():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**BASE, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                          use_sliding_window=True, sliding_window=8, tie_word_embeddings=False)  # every layer


#: Mixture-of-experts families (`model/moe.py`), apart from `FAMILIES` (the dense ones, whose tests also cover the
#: fused C++ step, tensor parallelism and the planner's dense counts): tests/model/families/test_moe_families.py.
MOE_FAMILIES = {
    "mixtral": _mixtral,
    "qwen2_moe": _qwen2_moe,
    "qwen2_moe_sparse": _qwen2_moe_all_sparse,
    "qwen3_moe": _qwen3_moe,
    "qwen3_moe_sparse": _qwen3_moe_all_sparse,
    "qwen2_moe_window": _qwen2_moe_window,
    "qwen3_moe_window": _qwen3_moe_window,
}


def hf_model(name: str):
    """A seeded random HF model of case `name` (of `FAMILIES`, `MOE_FAMILIES` or `MLA_FAMILIES`), in float32 eval
    mode, norms perturbed."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = (FAMILIES | MOE_FAMILIES | MLA_FAMILIES)[name]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    deepseek = config.model_type.startswith("deepseek")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or "ln_" in pname or pname.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "embed" in pname or "wte" in pname or "wpe" in pname:
                p.normal_(0.0, 0.5)
            elif deepseek and (pname.endswith("gate.weight") or "experts" in pname and p.dim() == 3):
                p.normal_(0.0, 0.2)  # the router and the fused experts start at zeros / tiny: make routing matter
            elif deepseek and "self_attn" in pname:
                p.normal_(0.0, 0.15)  # MLA: attention strong enough that a wrong RoPE layout or scale shows
        for bname, b in model.named_buffers():
            if deepseek and "correction_bias" in bname:  # DeepSeek-V3's router bias (a buffer): choices it changes
                b.normal_(0.0, 0.1)
    return model


def save_tiny(name: str, directory: Path):
    """Write the tiny checkpoint of `name` to `directory`; returns the HF model (the oracle)."""
    model = hf_model(name)
    model.save_pretrained(directory)
    return model
