"""TransformerLM against HF transformers (logits and gradients), and the contract's hooks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from scratchlm.model import ModelConfig, TransformerLM, load
from scratchlm.model.generate import ContiguousKVCache, generate
from scratchlm.model.layers import causal_attention
from tests.model.helpers import hf_logits, tiny_llama, tiny_qwen2


@pytest.mark.parametrize("tie", [False, True])
def test_llama_logits_equal_hf(tmp_path, tie):
    path = tiny_llama(tmp_path / "llama", tie=tie)
    loaded = load(path)
    assert loaded.config.tie_embeddings is tie and loaded.config.n_kv_heads == 2
    assert (loaded.model.lm_head is None) is tie
    tokens = torch.randint(0, 97, (3, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = loaded.model(tokens)
    torch.testing.assert_close(ours, hf_logits(path, tokens), atol=1e-4, rtol=0)


def test_qwen2_logits_equal_hf(tmp_path):
    path = tiny_qwen2(tmp_path / "qwen2")
    loaded = load(path)
    assert loaded.config.qkv_bias and not loaded.config.tie_embeddings
    assert loaded.model.layers[0].attn.q_bias is not None
    tokens = torch.randint(0, 101, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = loaded.model(tokens)
    torch.testing.assert_close(ours, hf_logits(path, tokens), atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_training_gradients_equal_hf(tmp_path, arch, monkeypatch):
    """One loss.backward() through our fused autograd functions gives HF's gradients for every weight."""
    from transformers import AutoModelForCausalLM

    from scratchlm.model import layers

    monkeypatch.setattr(layers, "QUERY_BLOCK", 32)  # two query blocks at T=64

    from scratchlm.model.loading.hf import hf_name_map

    path = tiny_llama(tmp_path / "m") if arch == "llama" else tiny_qwen2(tmp_path / "m")
    vocab = 97 if arch == "llama" else 101
    ours = load(path).model.train()
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    tokens = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(3))  # 2 query blocks
    targets = torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(4))
    F.cross_entropy(ours(tokens).flatten(0, 1), targets.flatten()).backward()
    F.cross_entropy(theirs(tokens).logits.flatten(0, 1), targets.flatten()).backward()
    hf_params = dict(theirs.named_parameters())
    for name, hf_name in hf_name_map(ours.config).items():
        ours_grad = ours.get_parameter(name).grad
        torch.testing.assert_close(ours_grad, hf_params[hf_name].grad, atol=1e-5, rtol=1e-3, msg=name)


def test_logits_index_and_positions():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)).eval()
    tokens = torch.randint(0, 50, (2, 7))
    with torch.no_grad():
        full = model(tokens)
        idx = torch.tensor([0, 6, 13])
        torch.testing.assert_close(model(tokens, logits_index=idx), full.reshape(14, 50)[idx])
        torch.testing.assert_close(model(tokens, positions=torch.arange(7).expand(2, 7)), full)
        shifted = model(tokens, positions=torch.arange(7) + 5)
    assert not torch.allclose(shifted, full)


def test_kv_cache_backend_matches_full_forward():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=50, d_model=32, n_layers=3, n_heads=4, n_kv_heads=1)).eval()
    tokens = torch.randint(0, 50, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        cache = ContiguousKVCache(model, 2, 12)
        parts = []
        for start, end in ((0, 5), (5, 6), (6, 12)):
            parts.append(model(tokens[:, start:end], positions=torch.arange(start, end), attn=cache))
            cache.advance(end - start)
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def test_generate_matches_recompute_and_sampling_is_seeded():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4)).eval()
    prompt = [3, 7, 1]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert generate(model, prompt, 8) == ids[3:]
    a = generate(model, prompt, 10, temperature=1.0, top_k=5, top_p=0.9, seed=7)
    assert a == generate(model, prompt, 10, temperature=1.0, top_k=5, top_p=0.9, seed=7)
    assert len(a) == 10 and all(0 <= t < 40 for t in a)
    eos = ids[5]
    first = ids[3:].index(eos)
    assert generate(model, prompt, 8, eos_id=eos) == ids[3:4 + first]  # stops after the first eos
    with pytest.raises(ValueError, match="non-empty prompt"):
        generate(model, [], 3)


def test_top_k_one_is_greedy():
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=40, d_model=32, n_layers=1, n_heads=4)).eval()
    assert generate(model, [1, 2], 6, temperature=0.8, top_k=1, seed=1) == generate(model, [1, 2], 6)


def test_meta_construction_allocates_nothing():
    with torch.device("meta"):
        model = TransformerLM(ModelConfig(vocab_size=50_000, d_model=1024, n_layers=8, n_heads=16))
    assert all(p.device.type == "meta" for p in model.parameters())
    assert model.num_parameters() == model.config.num_parameters()


def test_backend_hook_changes_attention():
    """The `attn` argument really replaces attention (a backend that attends only to itself differs)."""
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=30, d_model=32, n_layers=1, n_heads=4)).eval()
    tokens = torch.randint(0, 30, (1, 6))

    def self_only(layer_idx, q, k, v, spec):
        return v.repeat_interleave(q.shape[2] // v.shape[2], dim=2)

    def default(layer_idx, q, k, v, spec):
        return causal_attention(q, k, v)

    with torch.no_grad():
        torch.testing.assert_close(model(tokens, attn=default), model(tokens))
        assert not torch.allclose(model(tokens, attn=self_only), model(tokens))
