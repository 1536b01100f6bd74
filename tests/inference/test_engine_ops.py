"""The fused step's row ops on the unfused path (inference/engine_ops.py) against the model's torch layers."""

from __future__ import annotations

import pytest
import torch

from scratchlm.inference.attention import AttentionMetadata, PagedAttention, PrefillChunk
from scratchlm.inference.cpp_extensions import load_engine_kernels
from scratchlm.inference.engine_ops import (
    EngineAttention,
    EngineLayerNorm,
    EngineMLP,
    EngineRMSNorm,
    EngineRotaryEmbedding,
    RowPagedAttention,
    use_engine_ops,
)
from scratchlm.inference.kv_cache import KVCache
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.model.layers import MLP, LayerNorm, RMSNorm, RotaryEmbedding, SwiGLU


@pytest.fixture(scope="module")
def kernels():
    ext = load_engine_kernels()
    if ext is None:  # the swapped ops would silently run their torch parents: nothing would be tested
        pytest.fail("the engine's C++ kernels did not build: the row ops under test are not there")
    return ext


def _outliers(shape, seed: int = 0) -> torch.Tensor:
    """Random activations with a few large channels, as SmolLM2's residual stream has."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g)
    x[..., 3] *= 80.0
    x[..., -5] *= -30.0
    return x


@torch.no_grad()
def test_rms_norm_matches_torch_layer(kernels) -> None:
    """Within 1e-6 of float64 relative to each row's largest value (the torch layer too; the C++ op sums the squares
    in order, torch pairwise); rows are independent of the batch."""
    norm = RMSNorm(576, eps=1e-5)
    norm.weight.normal_(1.0, 0.5)
    x = _outliers((2, 7, 576))
    fast = EngineRMSNorm.__new__(EngineRMSNorm)
    fast.__dict__.update(norm.__dict__)
    got, want = fast(x), norm(x)
    x64, w64 = x.double(), norm.weight.double()
    exact = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * w64
    scale = exact.abs().amax(-1, keepdim=True)  # error relative to each row's largest value
    assert float(((got - exact).abs() / scale).max()) < 1e-6
    assert float(((want - exact).abs() / scale).max()) < 1e-6
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(scale.max()))
    assert torch.equal(fast(x[:, 3:4]), got[:, 3:4])  # one row alone gives the same bits


@pytest.mark.parametrize("layout", ["half", "adjacent"])
@torch.no_grad()
def test_rope_matches_torch_layer(kernels, layout: str) -> None:
    """Each output is x1 c - x2 s or x2 c + x1 s with each product rounded, as the torch ops: bit-equal."""
    rope = RotaryEmbedding(64, 10_000.0, layout)
    fast = EngineRotaryEmbedding(64, 10_000.0, layout)
    positions = torch.tensor([0, 5, 17, 300, 4095])
    cos, sin = rope.cos_sin(positions, torch.float32)  # (N, 1, D/2)
    x = torch.randn(1, 5, 3, 64)  # (B=1, N, H, D)
    got = fast.rotate(x, cos, sin)
    assert got.shape == x.shape
    assert torch.equal(got, rope.rotate(x, cos, sin))
    batched = torch.randn(2, 5, 3, 64)  # cos/sin broadcast over a batch: the torch ops
    assert torch.equal(fast.rotate(batched, cos, sin), rope.rotate(batched, cos, sin))


@torch.no_grad()
def test_silu_mul_and_swiglu_match_torch_layer(kernels) -> None:
    torch.manual_seed(0)
    ffn = SwiGLU(64, 96)
    fast = EngineMLP.__new__(EngineMLP)
    fast.__dict__.update(ffn.__dict__)
    x = _outliers((1, 9, 64)) / 10
    assert torch.equal(fast(x), ffn(x))  # the same ATen sigmoid and multiplies, in the same order
    g, u = torch.randn(4, 96), torch.randn(4, 96)
    assert torch.equal(kernels.silu_mul(g, u), torch.sigmoid(g) * g * u)


def _swap(module, cls):
    fast = cls.__new__(cls)
    fast.__dict__.update(module.__dict__)
    return fast


@pytest.mark.parametrize("bias", [False, True])
@torch.no_grad()
def test_layer_norm_matches_torch_layer(kernels, bias: bool) -> None:
    """decoder.h's LayerNorm (mean and variance in float64) within float32 rounding of torch's layer_norm."""
    norm = LayerNorm(200, eps=1e-5, bias=bias)
    norm.weight.normal_(1.0, 0.5)
    if bias:
        norm.bias.normal_(0.0, 0.5)
    x = _outliers((2, 5, 200)) + 3.0  # a mean far from 0
    got, want = _swap(norm, EngineLayerNorm)(x), norm(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(_swap(norm, EngineLayerNorm)(x[:, 2:3]), got[:, 2:3])  # one row alone: the same bits


@pytest.mark.parametrize("act", ["silu", "gelu_tanh", "gelu"])
@pytest.mark.parametrize("gated,bias", [(True, False), (True, True), (False, True)])
@torch.no_grad()
def test_mlp_activations_match_torch_layer(kernels, act: str, gated: bool, bias: bool) -> None:
    """Every activation, gated or plain, with biases: the torch layer's floats (ATen's gelu and sigmoid)."""
    torch.manual_seed(1)
    ffn = MLP(64, 96, act=act, gated=gated, bias=bias)
    for b in (ffn.b1, ffn.b2, ffn.b3):
        if b is not None:
            b.normal_(0.0, 0.5)
    x = _outliers((1, 7, 64)) / 10
    torch.testing.assert_close(_swap(ffn, EngineMLP)(x), ffn(x), rtol=1e-6, atol=1e-6)


@torch.no_grad()
def test_partial_rope_matches_torch_layer(kernels) -> None:
    """RoPE on the first 12 of 16 dims (the rest pass through): bit-equal to the torch layer."""
    rope, fast = RotaryEmbedding(16, 100.0, rotary_dim=12), EngineRotaryEmbedding(16, 100.0, rotary_dim=12)
    cos, sin = rope.cos_sin(torch.tensor([0, 3, 40]), torch.float32)  # (N, 1, 6)
    x = torch.randn(1, 3, 2, 16)
    got = fast.rotate(x, cos, sin)
    assert torch.equal(got, rope.rotate(x, cos, sin)) and torch.equal(got[..., 12:], x[..., 12:])


def _model(qkv_bias: bool) -> TransformerLM:
    torch.manual_seed(2)
    cfg = ModelConfig(vocab_size=40, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64,
                      qkv_bias=qkv_bias)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.normal_(1.0 if p.shape[0] == cfg.d_model else 0.0, 0.3)
    return model


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_swapped_model_matches_plain_model(kernels, qkv_bias: bool) -> None:
    """The whole swapped model (its own causal attention) gives the plain model's logits (tolerance 1e-5), shares
    its parameters, and trains through the torch layers (same gradients)."""
    model, plain = _model(qkv_bias), _model(qkv_bias)
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    assert use_engine_ops(model) == 2 * 4 + 2  # per layer 2 norms, attention, SwiGLU; the final norm; the RoPE
    assert type(model.layers[0].attn) is EngineAttention and type(model.rope) is EngineRotaryEmbedding
    assert type(model.norm) is EngineRMSNorm and type(model.layers[1].ffn) is EngineMLP
    assert use_engine_ops(model) == 0  # already swapped
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == before  # the same parameters, no copies
    tokens = torch.randint(0, 40, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), plain(tokens), rtol=1e-5, atol=1e-5)
    model(tokens).logsumexp(-1).sum().backward()
    plain(tokens).logsumexp(-1).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_row_paged_attention_matches_paged_attention(kernels) -> None:
    """Prefill rows through the decode kernel, each over its causal context, give the SDPA path's output."""
    torch.manual_seed(0)
    bs, hkv, d = 4, 2, 32
    cache = KVCache.allocate(1, 16, bs, hkv, d, torch.float32, "cpu")
    ref = KVCache(cache.k.clone(), cache.v.clone())
    n = 11
    table = torch.tensor([5, 2, 9])
    slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(n)])
    meta = AttentionMetadata(slots, 0, None, None, [PrefillChunk(0, n, n, table)])
    q, k, v = torch.randn(1, n, 4, d), torch.randn(1, n, hkv, d), torch.randn(1, n, hkv, d)
    rows = RowPagedAttention(cache, meta, table.expand(n, -1).contiguous(), torch.arange(1, n + 1))
    got = rows(0, q, k, v)
    want = PagedAttention(ref, meta)(0, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(cache.k, ref.k) and torch.equal(cache.v, ref.v)
