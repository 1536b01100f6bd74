"""Multi-head latent attention (`model/mla.py`): the absorbed form equals the expanded one, the reference sampler's
contiguous cache equals the full forward, the config validates MLA and `kv_spec()` describes the latent cache.
(The HF oracle tests are tests/model/families/test_deepseek.py.)"""

from __future__ import annotations

import pytest
import torch

from scratchlm.model.config import MLAFeatures, ModelConfig, MoEFeatures, RopeFeatures
from scratchlm.model.generate import generate
from scratchlm.model.mla import MLAttention, absorbed_attention, expanded_attention
from scratchlm.model.transformer import TransformerLM


def _config(**kw) -> ModelConfig:
    mla = MLAFeatures(kv_lora_rank=16, q_lora_rank=kw.pop("q_lora_rank", 12), qk_nope_head_dim=8, qk_rope_head_dim=4,
                      v_head_dim=6)
    return ModelConfig(**(dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4, head_dim=4, rope_layout="adjacent",
                               mla=mla) | kw))


@torch.no_grad()
def test_absorbed_equals_expanded():
    torch.manual_seed(0)
    c = _config()
    m = MLAttention(c, spec=TransformerLM(c).layers[0].attn.spec)
    n, s, h = 3, 7, c.n_heads
    q_nope, q_rope = torch.randn(n, h, 8), torch.randn(n, h, 4)
    latent, k_rope = torch.randn(n, s, 16), torch.randn(n, s, 4)
    lens = torch.tensor([7, 3, 5])
    masked = torch.arange(s)[None, :] >= lens[:, None]
    got = absorbed_attention(q_nope, q_rope, latent, k_rope, *m.absorbed_weights(), m.spec.scale, masked)
    for i in range(n):  # row i: its query at position lens - 1 over its first lens keys, expanded
        k_nope, value = m.expand(latent[i, : lens[i]])
        want = expanded_attention(q_nope[None, None, i], q_rope[None, None, i], k_nope[None],
                                  k_rope[None, i, : lens[i]], value[None], m.spec, int(lens[i]) - 1)[0, 0]
        assert torch.allclose(got[i], want, atol=1e-5), i


@pytest.mark.parametrize("q_lora_rank", [None, 12])
@torch.no_grad()
def test_contiguous_cache_generate_equals_full_forward(q_lora_rank):
    torch.manual_seed(0)
    c = _config(q_lora_rank=q_lora_rank, moe=MoEFeatures(n_experts=4, top_k=2, d_expert=16, dense_layers=[0]))
    model = TransformerLM(c).eval()
    prompt = [3, 9, 27, 17, 51]
    new = generate(model, prompt, 6)
    ids = list(prompt)
    for _ in range(6):  # no cache: the whole sequence each step
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert new == ids[len(prompt):]


def test_config_validation_and_kv_spec():
    c = _config()
    assert [s.latent for s in c.kv_spec()] == [True, True]
    assert c.kv_spec()[0].elements_per_token() == 16 + 4
    assert c.query_scale() == 12 ** -0.5
    with pytest.raises(ValueError, match="head_dim=12 .* must be mla.qk_rope_head_dim=4"):
        _config(head_dim=12, rope=RopeFeatures(rotary_dim=4))
    with pytest.raises(ValueError, match="n_kv_heads=2 must equal n_heads=4"):
        _config(n_kv_heads=2)
    with pytest.raises(ValueError, match="does not implement qkv_bias"):
        _config(qkv_bias=True)
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_trains():
    """The expanded form (no backend) under autograd: every parameter gets a finite gradient."""
    torch.manual_seed(0)
    model = TransformerLM(_config(moe=MoEFeatures(n_experts=4, top_k=2, d_expert=16, dense_layers=[0])))
    ids = torch.randint(0, 64, (2, 12))
    loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad and "experts" not in name:  # an expert no token chose gets no gradient
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
