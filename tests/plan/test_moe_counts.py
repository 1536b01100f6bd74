"""`ModelConfig`'s counts of MoE and MLA models against the HF models built from transformers' own config classes
(the oracle: `sum(p.numel())` of the HF model, on the meta device): total parameters per block and in all, and
the *active* parameters per token, computed here from the HF model's expert tensors (total less the routed experts
a token is not sent to). The `ModelConfig`s are written out by hand from the HF configs' documented fields, so the
test shares no translation code with the families."""

from __future__ import annotations

import pytest
import torch

from scratchlm.model.config import MLAFeatures, ModelConfig, MoEFeatures

transformers = pytest.importorskip("transformers")


def _hf_model(config):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _hf_counts(model, n_experts: int, top_k: int) -> tuple[int, int, int, list[int]]:
    """(parameters, buffers named score bias, active parameters, per-layer parameters) of an HF MoE model."""
    total = sum(p.numel() for p in model.parameters())
    bias = sum(b.numel() for n, b in model.named_buffers() if "e_score_correction_bias" in n)
    layers = model.model.layers
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    inactive = 0
    for layer in layers:
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None:
            experts = getattr(getattr(layer, "block_sparse_moe", None), "experts", None)
        if experts is not None:  # fused (E, ...) expert tensors: one expert's share is 1/E of each
            one = sum(p.numel() for p in experts.parameters()) // n_experts
            inactive += (n_experts - top_k) * one
    return total, bias, total - inactive, per_layer


def _check(ours: ModelConfig, model, n_experts: int, top_k: int, score_bias_layers: int = 0) -> None:
    total, bias, active, per_layer = _hf_counts(model, n_experts, top_k)
    # scratchlm keeps DeepSeek-V3's score correction bias as a (frozen) parameter; HF as a buffer
    assert bias == score_bias_layers * n_experts
    assert ours.num_parameters() == total + bias
    assert ours.active_parameters() == active + bias
    hf_layers = [n + (n_experts if ours.moe.score_bias and ours.is_moe_layer(i) else 0)
                 for i, n in enumerate(per_layer)]
    assert [ours.layer_parameters(i) for i in range(ours.n_layers)] == hf_layers


def test_mixtral() -> None:
    hf = transformers.MixtralConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                    num_experts_per_tok=2, tie_word_embeddings=False)
    ours = ModelConfig(vocab_size=101, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
                       tie_embeddings=False, moe=MoEFeatures(n_experts=4, top_k=2))
    _check(ours, _hf_model(hf), 4, 2)
    # one token: attention, the router and two of the four experts
    assert ours.matmul_weights_per_layer() == 32 * 8 * (2 * 4 + 2 * 2) + 32 * 4 + 2 * 3 * 32 * 48


def test_qwen3_moe_with_a_dense_layer() -> None:
    hf = transformers.Qwen3MoeConfig(vocab_size=97, hidden_size=32, intermediate_size=40, moe_intermediate_size=24,
                                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1],
                                     tie_word_embeddings=True)
    ours = ModelConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=40,
                       tie_embeddings=True, attn={"qk_norm": "head"},
                       moe=MoEFeatures(n_experts=8, top_k=3, d_expert=24, dense_layers=[1]))
    _check(ours, _hf_model(hf), 8, 3)
    with pytest.raises(ValueError, match="name the layer"):
        ours.layer_parameters()


def test_qwen2_moe_shared_expert_and_biases() -> None:
    hf = transformers.Qwen2MoeConfig(vocab_size=89, hidden_size=32, intermediate_size=40, moe_intermediate_size=16,
                                     shared_expert_intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
                                     tie_word_embeddings=False)
    ours = ModelConfig(vocab_size=89, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=40, qkv_bias=True,
                       tie_embeddings=False,
                       moe=MoEFeatures(n_experts=6, top_k=2, d_expert=16, d_shared=56, shared_gate=True,
                                       norm_topk=False))
    _check(ours, _hf_model(hf), 6, 2)


def _deepseek_v3(hf) -> ModelConfig:
    return ModelConfig(
        vocab_size=hf.vocab_size, d_model=hf.hidden_size, n_layers=hf.num_hidden_layers,
        n_heads=hf.num_attention_heads, n_kv_heads=hf.num_attention_heads, head_dim=hf.qk_rope_head_dim,
        d_ff=hf.intermediate_size, tie_embeddings=hf.tie_word_embeddings,
        moe=MoEFeatures(n_experts=hf.n_routed_experts, top_k=hf.num_experts_per_tok, d_expert=hf.moe_intermediate_size,
                        scoring="sigmoid", n_groups=hf.n_group, topk_groups=hf.topk_group, group_score="top2",
                        score_bias=True, d_shared=hf.n_shared_experts * hf.moe_intermediate_size,
                        routed_scale=hf.routed_scaling_factor,
                        dense_layers=list(range(hf.first_k_dense_replace))),
        mla=MLAFeatures(kv_lora_rank=hf.kv_lora_rank, q_lora_rank=hf.q_lora_rank,
                        qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim,
                        v_head_dim=hf.v_head_dim))


@pytest.mark.parametrize("q_lora", [12, None])
def test_deepseek_v3_tiny(q_lora) -> None:
    hf = transformers.DeepseekV3Config(vocab_size=83, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                       num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                       n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
                                       n_shared_experts=2, first_k_dense_replace=1, q_lora_rank=q_lora,
                                       kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5)
    ours = _deepseek_v3(hf)
    _check(ours, _hf_model(hf), 8, 2, score_bias_layers=2)
    # what a token caches per layer: the latent and the shared RoPE key, for all heads at once
    assert ours.kv_elements_per_token(0) == 10 + 4
    assert ours.attention_head_dims() == (6 + 4, 5)


def test_deepseek_v3_full_size() -> None:
    """The real DeepSeek-V3 (transformers' defaults are its config): 671B parameters, 37B active."""
    hf = transformers.DeepseekV3Config()
    ours = _deepseek_v3(hf)
    _check(ours, _hf_model(hf), hf.n_routed_experts, hf.num_experts_per_tok, score_bias_layers=58)
    assert 670e9 < ours.num_parameters() < 672e9 and 37e9 < ours.active_parameters() < 38e9
