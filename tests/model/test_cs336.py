"""CS336 assignment 1 drop-in: its state-dict names, its architecture preset, its layer signatures.

The oracle is a straightforward CS336 TransformerLM forward written here from the assignment's description
(float64, RoPE as complex multiplication, an explicit causal mask), reading CS336-named tensors.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.model import functional as F
from scratchlm.model.layers import Attention, Embedding, Linear, RMSNorm, RotaryPositionalEmbedding, SwiGLU
from scratchlm.model.loading import CheckpointError
from scratchlm.model.loading.cs336 import (
    CS336_KEY_MAP,
    cs336_config,
    cs336_key_to_scratchlm,
    from_cs336_state_dict,
    load_cs336,
    load_cs336_state_dict,
    scratchlm_key_to_cs336,
    to_cs336_state_dict,
)

F64 = torch.float64
# The model computes RMSNorm and the RoPE angles in float32 by design (as CS336 asks for RMSNorm), so a float64
# model matches the float64 reference to about 1e-6; a wrong name, layout or head split is off by O(1).
TOL = dict(rtol=1e-5, atol=1e-5)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "model.md"


# ----------------------------------------------------------------------------------------------- the reference
def ref_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x (..., T, d): pairs (x[2k], x[2k+1]) as complex numbers times exp(i * pos * theta^(-2k/d))."""
    d = x.shape[-1]
    freqs = theta ** (-torch.arange(0, d, 2, dtype=F64) / d)  # (d/2,)
    angle = positions.to(F64)[..., None] * freqs  # (T, d/2)
    z = torch.view_as_complex(x.to(F64).reshape(*x.shape[:-1], d // 2, 2).contiguous())
    return torch.view_as_real(z * torch.polar(torch.ones_like(angle), angle)).flatten(-2).to(x.dtype)


def ref_rmsnorm(x, g, eps=1e-5):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * g


def ref_mha(x, wq, wk, wv, wo, num_heads, theta=None, positions=None):
    """CS336's causal multi-head self-attention, RoPE on q and k when theta is given."""
    b, t, d = x.shape
    dk = d // num_heads
    q, k, v = ((x @ w.T).view(b, t, num_heads, dk).transpose(1, 2) for w in (wq, wk, wv))  # (B, H, T, dk)
    if theta is not None:
        pos = torch.arange(t) if positions is None else positions
        q, k = ref_rope(q, pos, theta), ref_rope(k, pos, theta)
    scores = q @ k.transpose(-1, -2) / math.sqrt(dk)
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    out = torch.softmax(scores, -1) @ v  # (B, H, T, dk)
    return out.transpose(1, 2).reshape(b, t, d) @ wo.T


def ref_transformer_lm(w: dict, tokens, num_layers, num_heads, theta):
    """CS336 TransformerLM forward from CS336-named weights `w` (theta None: no RoPE)."""
    x = w["token_embeddings.weight"][tokens]
    for i in range(num_layers):
        p = f"layers.{i}."
        h = ref_rmsnorm(x, w[p + "ln1.weight"])
        x = x + ref_mha(h, *(w[p + f"attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "output_proj")),
                        num_heads, theta)
        h = ref_rmsnorm(x, w[p + "ln2.weight"])
        gate, up = h @ w[p + "ffn.w1.weight"].T, h @ w[p + "ffn.w3.weight"].T
        x = x + (gate * torch.sigmoid(gate) * up) @ w[p + "ffn.w2.weight"].T
    return ref_rmsnorm(x, w["ln_final.weight"]) @ w["lm_head.weight"].T


def cs336_state(vocab=50, d_model=32, num_layers=2, d_ff=48, seed=0, dtype=F64) -> dict[str, torch.Tensor]:
    """Random weights under exactly the names CS336's adapters document."""
    gen = torch.Generator().manual_seed(seed)

    def r(*shape, scale=None):
        return (torch.randn(shape, generator=gen, dtype=F64) * (scale or 1 / math.sqrt(shape[-1]))).to(dtype)

    w = {"token_embeddings.weight": r(vocab, d_model, scale=1.0)}
    for i in range(num_layers):
        p = f"layers.{i}."
        w |= {p + "ln1.weight": 1 + 0.3 * r(d_model, scale=1.0), p + "ln2.weight": 1 + 0.3 * r(d_model, scale=1.0)}
        w |= {p + f"attn.{n}.weight": r(d_model, d_model) for n in ("q_proj", "k_proj", "v_proj", "output_proj")}
        w |= {p + "ffn.w1.weight": r(d_ff, d_model), p + "ffn.w3.weight": r(d_ff, d_model),
              p + "ffn.w2.weight": r(d_model, d_ff)}
    w |= {"ln_final.weight": 1 + 0.3 * r(d_model, scale=1.0), "lm_head.weight": r(vocab, d_model)}
    return w


TOKENS = torch.tensor([[3, 17, 42, 0, 9, 9, 31, 5, 12, 48], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]])


# ----------------------------------------------------------------------------------------------- the key map
def test_key_map_covers_every_parameter_of_a_cs336_config_model():
    model = TransformerLM(ModelConfig.cs336(vocab_size=50, context_length=16, d_model=32, num_layers=2,
                                            num_heads=4, d_ff=48))
    cs = to_cs336_state_dict(model)
    assert set(cs) == set(cs336_state(num_layers=2))
    assert {cs336_key_to_scratchlm(k) for k in cs} == set(model.state_dict())


def test_round_trip_both_directions():
    model = TransformerLM(ModelConfig.cs336(vocab_size=50, context_length=16, d_model=32, num_layers=3,
                                            num_heads=4, d_ff=48))
    ours = model.state_dict()
    back = from_cs336_state_dict(to_cs336_state_dict(ours))
    assert back.keys() == ours.keys() and all(back[k] is ours[k] for k in ours)
    cs = cs336_state(num_layers=2)
    again = to_cs336_state_dict(from_cs336_state_dict(cs))
    assert again.keys() == cs.keys() and all(again[k] is cs[k] for k in cs)
    assert cs336_key_to_scratchlm("_orig_mod.layers.7.attn.output_proj.weight") == "layers.7.attn.o_proj.weight"
    assert scratchlm_key_to_cs336("layers.12.ffn_norm.weight") == "layers.12.ln2.weight"


def test_key_map_table_is_in_the_docs():
    text = DOCS.read_text()
    for cs, ours in CS336_KEY_MAP:
        assert f"`{cs}`" in text and f"`{ours}`" in text, (cs, ours)


def test_block_level_names_load_into_a_transformer_block():
    """CS336's `run_transformer_block` passes one block's weights without the `layers.{i}.` prefix."""
    from scratchlm.model import TransformerBlock
    from scratchlm.model.layers import RotaryEmbedding

    w = {k.removeprefix("layers.0."): v for k, v in cs336_state(num_layers=1).items() if k.startswith("layers.0.")}
    cfg = ModelConfig.cs336(vocab_size=50, context_length=16, d_model=32, num_layers=1, num_heads=4, d_ff=48)
    block = TransformerBlock(cfg, dtype=F64)
    block.load_state_dict(from_cs336_state_dict(w))
    assert set(to_cs336_state_dict(block)) == set(w)
    x = torch.randn(2, 6, 32, dtype=F64)
    with torch.no_grad():
        got = block(x, RotaryEmbedding(8, 10_000.0, "adjacent"), None, None)
    h = x + ref_mha(ref_rmsnorm(x, w["ln1.weight"]),
                    *(w[f"attn.{n}.weight"] for n in ("q_proj", "k_proj", "v_proj", "output_proj")), 4, 10_000.0)
    u = ref_rmsnorm(h, w["ln2.weight"])
    gate, up = u @ w["ffn.w1.weight"].T, u @ w["ffn.w3.weight"].T
    torch.testing.assert_close(got, h + (gate * torch.sigmoid(gate) * up) @ w["ffn.w2.weight"].T, **TOL)


def test_unknown_names_are_errors_that_list_the_expected_ones():
    with pytest.raises(CheckpointError, match=r"'layers.0.attn.o_bias'.*layers.\{i\}.attn.output_proj.weight"):
        cs336_key_to_scratchlm("layers.0.attn.o_bias")
    with pytest.raises(CheckpointError, match="q_bias"):
        scratchlm_key_to_cs336("layers.0.attn.q_bias")  # Qwen2-style biases have no CS336 name


# ----------------------------------------------------------------------------------------------- logits vs reference
@pytest.mark.parametrize("theta", [10_000.0, 500.0])
def test_cs336_state_dict_gives_the_reference_logits(theta):
    w = cs336_state(num_layers=2)
    model = load_cs336({"_orig_mod." + k: v for k, v in w.items()}, num_heads=4, context_length=16,
                       rope_theta=theta, dtype=F64)
    assert model.config.rope_layout == "adjacent" and not model.config.tie_embeddings
    assert (model.config.vocab_size, model.config.d_model, model.config.n_layers, model.config.d_ff) == (50, 32, 2, 48)
    with torch.no_grad():
        got = model(TOKENS)
    torch.testing.assert_close(got, ref_transformer_lm(w, TOKENS, 2, 4, theta), **TOL)


def test_load_cs336_state_dict_into_an_existing_model_and_train_mode_gradients():
    w = cs336_state(num_layers=2, dtype=torch.float32)
    model = TransformerLM(cs336_config(w, num_heads=4, context_length=16))
    load_cs336_state_dict(model, w)
    ref_w = {k: v.to(F64) for k, v in w.items()}
    torch.testing.assert_close(model(TOKENS).double(), ref_transformer_lm(ref_w, TOKENS, 2, 4, 10_000.0),
                               rtol=1e-4, atol=1e-4)
    # the training path (fused QKV GEMM, hand-written backward) sees the same weights
    model(TOKENS).sum().backward()
    assert model.layers[1].attn.o_proj.weight.grad is not None


def test_no_rope_variant_matches_the_reference_without_position_embedding():
    w = cs336_state(num_layers=2)
    model = load_cs336(w, num_heads=4, context_length=16, dtype=F64, rope_layout="none")
    with torch.no_grad():
        got = model(TOKENS)
    torch.testing.assert_close(got, ref_transformer_lm(w, TOKENS, 2, 4, None), **TOL)
    # the engine-style paths (rope tables applied by other code) rotate by zero too
    cos, sin = model.rope.cos_sin(torch.arange(5), F64)
    assert torch.equal(cos, torch.ones_like(cos)) and torch.equal(sin, torch.zeros_like(sin))


def test_no_rope_model_serves_through_the_engine():
    """The engine's paths (Python paged attention and, when built, the fused C++ decoder, which applies the
    rope tables itself) give the same greedy ids as recomputing the whole sequence with the model."""
    import random

    from tests.inference.helpers import greedy, make_engine, naive_greedy, run_all

    torch.manual_seed(3)
    cfg = ModelConfig(vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=96,
                      rope_layout="none")
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(4.0)  # sharper logits: no greedy ties
    prompts = [[random.Random(i).randrange(cfg.vocab_size) for _ in range(5 + 7 * i)] for i in range(3)]
    want = {str(i): naive_greedy(model, p, 8) for i, p in enumerate(prompts)}
    for use_fused in (True, False):
        engine = make_engine(model, cfg, num_blocks=64, block_size=4, max_num_seqs=4)
        if not use_fused:
            engine.runner.fused_decoder = None
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(8))
        assert run_all(engine) == want, f"fused decoder: {engine.runner.fused_decoder is not None}"


def test_tied_model_rejects_a_separate_cs336_head():
    w = cs336_state(num_layers=1)
    tied = TransformerLM(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, d_ff=48,
                                     rope_layout="adjacent", tie_embeddings=True), dtype=F64)
    with pytest.raises(CheckpointError, match="ModelConfig.cs336"):
        load_cs336_state_dict(tied, w)
    w["lm_head.weight"] = w["token_embeddings.weight"].clone()  # a truly tied CS336 model loads
    load_cs336_state_dict(tied, w)
    assert torch.equal(tied.output_weight, w["token_embeddings.weight"])


# ----------------------------------------------------------------------------------------------- the preset, docs
def test_cs336_preset_and_the_documented_differences():
    c = ModelConfig.cs336()
    assert (c.vocab_size, c.max_seq_len, c.d_model, c.n_layers, c.n_heads, c.d_ff, c.rope_theta) == (
        10_000, 256, 512, 4, 16, 1344, 10_000.0)
    default = ModelConfig(d_model=c.d_model, n_heads=c.n_heads)
    differ = {f.name for f in dataclasses.fields(ModelConfig) if getattr(c, f.name) != getattr(default, f.name)}
    assert {"rope_layout", "tie_embeddings", "d_ff"} <= differ
    section = DOCS.read_text().split("## CS336", 1)[1]
    for name in differ:  # every field whose CS336 value is not our default is named in the docs section
        assert f"`{name}`" in section, name
    assert "ModelConfig.cs336(" in section


def test_export_refuses_a_model_without_rope(tmp_path):
    from scratchlm.model import export_hf

    model = TransformerLM(ModelConfig(vocab_size=20, d_model=16, n_layers=1, n_heads=2, rope_layout="none"))
    with pytest.raises(ValueError, match="rope_layout='none'"):
        export_hf(model, out_dir=tmp_path / "hf")


# ----------------------------------------------------------------------------------------------- layer signatures
def test_layers_take_cs336_argument_names():
    lin = Linear(in_features=6, out_features=4, device="cpu", dtype=F64)
    assert lin.weight.shape == (4, 6) and lin.weight.dtype == F64 and (lin.in_features, lin.out_features) == (6, 4)
    emb = Embedding(num_embeddings=11, embedding_dim=5, device="cpu", dtype=F64)
    assert emb.weight.shape == (11, 5) and emb.embedding_dim == 5
    emb2 = Embedding(11, 5, "cpu", F64)  # CS336 passes device and dtype positionally after the sizes
    assert emb2.weight.dtype == F64
    norm = RMSNorm(d_model=5, eps=1e-6, device="cpu", dtype=F64)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 3, 5, dtype=F64)
    torch.testing.assert_close(norm(x), ref_rmsnorm(x, norm.weight, 1e-6))
    ffn = SwiGLU(d_model=5, d_ff=7, device="cpu", dtype=F64)
    assert ffn.w1.weight.shape == (7, 5) and ffn.w2.weight.shape == (5, 7)


def test_rotary_positional_embedding_cs336_signature():
    rope = RotaryPositionalEmbedding(theta=10_000.0, d_k=8, max_seq_len=32, device="cpu")
    x = torch.randn(3, 6, 8, dtype=F64)  # (..., seq_len, d_k): no head dim
    pos = torch.tensor([0, 1, 2, 5, 9, 31])
    torch.testing.assert_close(rope(x, pos), ref_rope(x, pos, 10_000.0), **TOL)
    with pytest.raises(ValueError, match="max_seq_len"):
        rope(x, pos + 1)


@pytest.mark.parametrize("with_rope", [False, True])
def test_attention_cs336_style_with_and_without_rope(with_rope):
    d, h = 32, 4
    attn = Attention(d, h, dtype=F64)  # CS336's MultiHeadSelfAttention(d_model, num_heads)
    x = torch.randn(2, 7, d, dtype=F64)
    pos = torch.tensor([3, 4, 5, 6, 7, 8, 9])
    ws = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight]
    if with_rope:
        got = attn(x, RotaryPositionalEmbedding(500.0, d // h, 64), token_positions=pos)
        want = ref_mha(x, *ws, h, 500.0, pos)
    else:
        got = attn(x)
        want = ref_mha(x, *ws, h)
    torch.testing.assert_close(got, want.detach(), **TOL)


def test_functional_cs336_signatures():
    x = torch.randn(2, 5, 7, dtype=F64)
    torch.testing.assert_close(F.softmax(x, dim=1), torch.softmax(x, 1))
    q, k, v = torch.randn(2, 4, 8, dtype=F64), torch.randn(2, 6, 8, dtype=F64), torch.randn(2, 6, 3, dtype=F64)
    mask = torch.rand(4, 6) > 0.3
    mask[:, 0] = True
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(F.scaled_dot_product_attention(Q=q, K=k, V=v, mask=mask), want)


def test_docs_name_the_cs336_helpers():
    text = DOCS.read_text()
    for name in ("load_cs336(", "load_cs336_state_dict(", "to_cs336_state_dict(", "cs336_config("):
        assert name in text, name
