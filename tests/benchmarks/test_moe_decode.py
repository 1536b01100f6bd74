"""benchmarks/moe_decode.py's synthetic model: the counts its report states against transformers' own model of the
same shapes (built on the meta device: no weights, no download)."""

import pytest

from benchmarks.moe_decode import SHAPE, param_counts


@pytest.mark.parametrize("shape", [SHAPE, dict(SHAPE, hidden_size=256, num_hidden_layers=2, num_experts=8,
                                                num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2)])
def test_counts_equal_transformers(shape):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**shape))
    params = dict(model.named_parameters())
    counts = param_counts(shape)
    assert counts["total"] == sum(p.numel() for p in params.values())
    experts = sum(p.numel() for n, p in params.items() if ".mlp.experts." in n)
    assert counts["experts"] == experts
    # a token reads one embedding row, top_k of each layer's experts, and everything else
    embedding = params["model.embed_tokens.weight"]
    share = shape["num_experts_per_tok"] / shape["num_experts"]
    assert counts["active"] == counts["total"] - embedding.numel() + embedding.shape[1] - experts + experts * share


def test_every_k_is_a_multiple_of_256():
    """K-quants (Q4_K, Q6_K) need rows of a multiple of 256 weights: no tensor of the model may fall back."""
    head_dim = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    for k in (SHAPE["hidden_size"], SHAPE["moe_intermediate_size"], SHAPE["num_attention_heads"] * head_dim):
        assert k % 256 == 0
