"""Layers and functional mirrors against torch's own implementations (oracles used in tests only)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from scratchlm.model import functional as sf
from scratchlm.model.config import ModelConfig, default_d_ff
from scratchlm.model.layers import (
    Attention,
    Embedding,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    SwiGLU,
    causal_attention,
)


def _double(*tensors):
    return [t.detach().double().requires_grad_(True) for t in tensors]


def test_linear_matches_matmul_and_init_scale():
    torch.manual_seed(0)
    lin = Linear(300, 500)
    std = math.sqrt(2 / 800)
    w = lin.weight.detach()
    assert w.shape == (500, 300)
    assert abs(w.std().item() - std * 0.9866) < 0.02 * std  # truncation at 3 sigma: std x 0.9866
    assert w.abs().max().item() <= 3 * std + 1e-6
    x = torch.randn(2, 7, 300)
    torch.testing.assert_close(lin(x), F.linear(x, w))


def test_embedding_lookup():
    emb = Embedding(50, 8)
    ids = torch.tensor([[1, 49, 0], [3, 3, 7]])
    torch.testing.assert_close(emb(ids), F.embedding(ids, emb.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_forward_backward(dtype):
    torch.manual_seed(0)
    norm = RMSNorm(16, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(16))
    x = torch.randn(3, 5, 16, dtype=dtype, requires_grad=True)
    y = norm(x)
    assert y.dtype == dtype
    ref = F.rms_norm(x.float(), (16,), norm.weight.float(), eps=1e-6).to(dtype)
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(sf.rmsnorm(x, norm.weight, 1e-6), ref)
    if dtype == torch.float32:
        g = torch.randn_like(y)
        gx, gw = torch.autograd.grad(y, (x, norm.weight), g)
        x2, w2 = _double(x, norm.weight)
        gx2, gw2 = torch.autograd.grad(F.rms_norm(x2, (16,), w2, eps=1e-6), (x2, w2), g.double())
        torch.testing.assert_close(gx, gx2.float(), atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(gw, gw2.float(), atol=1e-5, rtol=1e-4)


def test_swiglu_against_autograd():
    torch.manual_seed(0)
    ffn = SwiGLU(32, 96)
    x = torch.randn(2, 5, 32, requires_grad=True)
    y = ffn(x)
    ref_fn = lambda x: F.linear(F.silu(F.linear(x, ffn.w1.weight)) * F.linear(x, ffn.w3.weight), ffn.w2.weight)  # noqa: E731
    torch.testing.assert_close(y, ref_fn(x))
    g = torch.randn_like(y)
    params = [x, ffn.w1.weight, ffn.w2.weight, ffn.w3.weight]
    grads = torch.autograd.grad(y, params, g)
    ref = torch.autograd.grad(ref_fn(x), params, g)
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_functional_softmax_silu_match_torch():
    x = torch.randn(4, 9) * 50
    torch.testing.assert_close(sf.softmax(x, dim=-1), torch.softmax(x, dim=-1))
    torch.testing.assert_close(sf.softmax(x, dim=0), torch.softmax(x, dim=0))
    big = torch.tensor([1000.0, 1000.0, -1000.0])
    torch.testing.assert_close(sf.softmax(big, 0), torch.tensor([0.5, 0.5, 0.0]))  # stable at large inputs
    torch.testing.assert_close(sf.silu(x), F.silu(x))


def test_functional_sdpa_with_boolean_mask():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 4)
    mask = torch.rand(5, 7) > 0.3
    mask[:, 0] = True
    torch.testing.assert_close(
        sf.scaled_dot_product_attention(q, k, v, mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    )


def _hf_rotate_half(x, cos, sin):
    """HF Llama's RoPE: x * cos + rotate_half(x) * sin with cos/sin duplicated over the two halves."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * torch.cat((cos, cos), -1) + rot * torch.cat((sin, sin), -1)


def test_rope_half_matches_hf_formula_and_adjacent_is_its_permutation():
    torch.manual_seed(0)
    d, t = 16, 11
    x = torch.randn(2, t, 3, d)  # (B, T, H, D)
    pos = torch.arange(t)
    half = RotaryEmbedding(d, 500.0, "half").apply(x, pos)
    inv = 1.0 / (500.0 ** (torch.arange(0, d, 2).float() / d))
    ang = pos[:, None].float() * inv  # (T, D/2)
    ref = _hf_rotate_half(x, ang.cos()[:, None], ang.sin()[:, None])
    torch.testing.assert_close(half, ref)
    torch.testing.assert_close(sf.rope(x.transpose(1, 2), pos, 500.0, "half"), ref.transpose(1, 2))
    # adjacent layout = half layout applied after interleaving dims (0, D/2, 1, D/2+1, ...)
    perm = torch.stack((torch.arange(d // 2), torch.arange(d // 2) + d // 2), -1).flatten()
    adj = RotaryEmbedding(d, 500.0, "adjacent").apply(x[..., perm], pos)
    torch.testing.assert_close(adj, half[..., perm])
    torch.testing.assert_close(sf.rope(x[..., perm].transpose(1, 2), pos, 500.0, "adjacent"), adj.transpose(1, 2))


def test_rope_preserves_norm_and_relative_positions():
    torch.manual_seed(0)
    rope = RotaryEmbedding(8, 10_000.0, "adjacent")
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    dots = []
    for shift in (0, 5, 40):
        qr = rope.apply(q, torch.tensor([3 + shift]))
        kr = rope.apply(k, torch.tensor([1 + shift]))
        torch.testing.assert_close(qr.norm(), q.norm())
        dots.append((qr * kr).sum())
    torch.testing.assert_close(dots[0], dots[1])
    torch.testing.assert_close(dots[0], dots[2])


@settings(max_examples=15, deadline=None)
@given(b=st.integers(1, 2), t=st.integers(1, 9), hkv=st.integers(1, 3), group=st.integers(1, 3),
       d=st.sampled_from([2, 4, 8]), seed=st.integers(0, 1000))
def test_causal_attention_matches_torch_sdpa(b, t, hkv, group, d, seed):
    torch.manual_seed(seed)
    h = hkv * group
    q, k, v = torch.randn(b, t, h, d), torch.randn(b, t, hkv, d), torch.randn(b, t, hkv, d)
    q, k, v = (x.requires_grad_(True) for x in (q, k, v))
    out = causal_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)


def test_causal_attention_with_offset_matches_full_last_rows():
    """Queries at the end of a longer key sequence (KV-cache decode) see every earlier key."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 10, 4, 8), torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    full = causal_attention(q, k, v)
    tail = causal_attention(q[:, 7:], k, v, q_offset=7)
    torch.testing.assert_close(tail, full[:, 7:])


def test_attention_backend_hook_receives_rotated_qkv():
    torch.manual_seed(0)
    attn = Attention(32, 4, 2, 8)
    rope = RotaryEmbedding(8)
    x = torch.randn(1, 6, 32)
    cos, sin = rope.cos_sin(torch.arange(6), x.dtype)
    seen = {}

    def backend(layer_idx, q, k, v, spec):
        seen.update(layer=layer_idx, q=q.shape, k=k.shape, v=v.shape)
        return causal_attention(q, k, v)

    torch.testing.assert_close(attn(x, rope, cos, sin, backend, layer_idx=3), attn(x, rope, cos, sin))
    assert seen == {"layer": 3, "q": (1, 6, 4, 8), "k": (1, 6, 2, 8), "v": (1, 6, 2, 8)}


def test_config_derivations_and_errors():
    c = ModelConfig(d_model=256, n_heads=8)
    assert c.d_ff == default_d_ff(256) == 704 and c.d_ff % 64 == 0
    assert c.n_kv_heads == 8 and c.head_dim == 32
    assert ModelConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="n_heads=6 must be a multiple of n_kv_heads=4"):
        ModelConfig(d_model=48, n_heads=6, n_kv_heads=4)
    with pytest.raises(ValueError, match="not divisible"):
        ModelConfig(d_model=100, n_heads=3)
    with pytest.raises(ValueError, match="unknown field"):
        ModelConfig.from_dict({"dim": 3})
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig(vocab_size=0)


@pytest.mark.parametrize("t,hkv,group", [(192, 2, 2), (256, 4, 1), (150, 1, 3)])
def test_blocked_causal_attention_long_sequences(t, hkv, group, monkeypatch):
    """Several query blocks of QUERY_BLOCK rows (set to 64 here): values and gradients vs torch."""
    from scratchlm.model import layers

    monkeypatch.setattr(layers, "QUERY_BLOCK", 64)
    QUERY_BLOCK = 64
    assert t > 2 * QUERY_BLOCK  # 192 and 256: several query blocks; 150: one block (not a multiple)
    torch.manual_seed(t)
    q = torch.randn(2, t, hkv * group, 16, requires_grad=True)
    k = torch.randn(2, t, hkv, 16, requires_grad=True)
    v = torch.randn(2, t, hkv, 16, requires_grad=True)
    out = causal_attention(q, k, v)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         is_causal=True, enable_gqa=True).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    g = torch.randn_like(out)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), g), torch.autograd.grad(ref, (q, k, v), g)):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=1e-4)
    # the tail of the queries against all keys (KV-cache prefill of a second chunk), several blocks too
    with torch.no_grad():
        tail = t - 2 * QUERY_BLOCK
        torch.testing.assert_close(causal_attention(q[:, tail:], k, v, q_offset=tail), ref[:, tail:],
                                   atol=1e-5, rtol=1e-4)
