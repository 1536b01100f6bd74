"""Sequence parallelism: the LSE merge, ring attention and Ulysses against single-process attention,
and the model-level driver (prefill logits + greedy decode) against one rank, over local gloo ranks."""

from __future__ import annotations

import pytest
import torch

from scratchlm.model.layers import causal_attention
from scratchlm.parallel.sequence import (
    ContextParallelLM,
    attention_with_lse,
    block_attention,
    check_ulysses,
    merge_attention_states,
    merge_many,
    reference_generate,
    shard_positions,
    spawn_gloo,
    split_kv_attention,
)

torch.set_num_threads(1)


def _qkv(b=2, t=24, h=8, hkv=4, d=16, seed=0, s=None):
    g = torch.Generator().manual_seed(seed)
    s = t if s is None else s
    return (torch.randn(b, t, h, d, generator=g), torch.randn(b, s, hkv, d, generator=g),
            torch.randn(b, s, hkv, d, generator=g))


def _torch_reference(q, k, v, causal=True):
    g = q.shape[2] // k.shape[2]
    kr, vr = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kr.transpose(1, 2), vr.transpose(1, 2), is_causal=causal).transpose(1, 2)


def test_attention_with_lse_matches_torch():
    q, k, v = _qkv()
    pos = torch.arange(q.shape[1])
    o, lse = attention_with_lse(q, k, v, pos, pos)
    torch.testing.assert_close(o, _torch_reference(q, k, v), atol=1e-5, rtol=1e-5)
    # lse against a direct log-sum-exp of the scores of one head
    s = (q[0, :, 0] @ k[0, :, 0].T) / 4.0  # head 0 uses kv head 0; d = 16
    s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse[0, :, 0], torch.logsumexp(s, -1), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [2, 3, 7])
def test_merge_of_kv_shards_equals_full_attention(splits):
    q, k, v = _qkv(t=5, s=41, seed=1)
    full = _torch_reference(q, k, v, causal=False)
    parts = [attention_with_lse(q, ks, vs) for ks, vs in zip(k.tensor_split(splits, 1), v.tensor_split(splits, 1))]
    o, lse = merge_many(parts)
    torch.testing.assert_close(o, full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, attention_with_lse(q, k, v)[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split_kv_attention(q, k, v, splits), full, atol=1e-5, rtol=1e-5)


def test_merge_handles_empty_parts_and_rejects_bad_shapes():
    o = torch.randn(3, 4)
    lse = torch.randn(3)
    empty_o, empty_lse = torch.zeros(3, 4), torch.full((3,), float("-inf"))
    mo, ml = merge_attention_states(o, lse, empty_o, empty_lse)
    torch.testing.assert_close(mo, o)
    torch.testing.assert_close(ml, lse)
    mo, ml = merge_attention_states(empty_o, empty_lse, empty_o, empty_lse)
    assert torch.all(mo == 0) and torch.all(torch.isinf(ml))
    with pytest.raises(ValueError, match="matching shapes"):
        merge_attention_states(o, lse, o, torch.randn(4))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_zigzag_blocks_merged_equal_causal_attention(world):
    """The ring's arithmetic without the ring: each rank's queries over every rank's zig-zag block."""
    q, k, v = _qkv(b=1, t=32, seed=2)
    full = causal_attention(q, k, v)
    pos = [shard_positions(32, world, r, "zigzag") for r in range(world)]
    for r in range(world):
        parts = [block_attention(q[:, pos[r]], pos[r], k[:, pos[j]], v[:, pos[j]], pos[j], 2, 2)
                 for j in range(world)]
        o, _ = merge_many(parts)
        torch.testing.assert_close(o, full[:, pos[r]], atol=1e-5, rtol=1e-5)


def test_zigzag_is_balanced():
    """Every rank does the same causal work: count visible (query, key) pairs per rank."""
    t, world = 64, 4
    for r in range(world):
        p = shard_positions(t, world, r, "zigzag")
        assert p.numel() == t // world
        assert int((p + 1).sum()) == t * (t + 1) // 2 // world
    with pytest.raises(ValueError, match="multiple of 8 chunks"):
        shard_positions(30, world, 0, "zigzag")


def test_ulysses_limit_is_explained():
    check_ulysses(8, 4, 4)
    with pytest.raises(ValueError, match=r"must divide the number of KV heads \(3\).*at most 3 ranks"):
        check_ulysses(9, 3, 2)


def test_single_rank_driver_matches_reference(data_dir):
    from scratchlm.model import load

    model = load(data_dir / "models/stories260K/stories260K.bin").model.eval()
    ids = torch.randint(3, 512, (77,), generator=torch.Generator().manual_seed(0)).tolist()
    ref_tokens, ref_hidden = reference_generate(model, ids, 6)
    for backend in ("ring", "ulysses"):
        tokens, hidden = ContextParallelLM(model, backend).generate(ids, 6)
        assert tokens == ref_tokens
        torch.testing.assert_close(hidden, ref_hidden, atol=1e-5, rtol=1e-5)
    full = model(torch.tensor([ids]))[0]  # the plain model: the oracle of the oracle
    torch.testing.assert_close(ref_hidden @ model.output_weight.t(), full, atol=1e-4, rtol=1e-4)


def _cp_worker(rank, world, model_path, ids, new_tokens, backends):
    from scratchlm.model import load

    model = load(model_path).model.eval()
    out = {}
    for backend in backends:
        cp = ContextParallelLM(model, backend)
        tokens, hidden = cp.generate(ids, new_tokens)
        out[backend] = (tokens, hidden if rank == 0 else None, cp.kv_cache_bytes())
    return out


def _check_against_single_rank(model_path, ids, new_tokens, worlds, backends, atol):
    from scratchlm.model import load

    model = load(model_path).model.eval()
    ref_tokens, ref_hidden = reference_generate(model, ids, new_tokens)
    w = model.output_weight
    ref_logits = ref_hidden @ w.t()
    for world in worlds:
        results = spawn_gloo(_cp_worker, world, str(model_path), ids, new_tokens, backends)
        for backend in backends:
            tokens, hidden, _ = results[0][backend]
            torch.testing.assert_close(hidden @ w.t(), ref_logits, atol=atol, rtol=atol,
                                       msg=lambda m, b=backend, p=world: f"{b} P={p}: {m}")
            assert tokens == ref_tokens, f"{backend} P={world}: greedy decode diverged"
            kv = [r[backend][2] for r in results]
            # the KV cache is sharded: every rank holds about 1/P of it
            assert max(kv) <= sum(kv) / world * 1.05 + 4096, f"{backend} P={world}: KV per rank {kv}"


def test_context_parallel_prefill_and_decode_match_single_rank(data_dir):
    """stories260K over a 1,021-token prompt (twice its training context; padded to 2P chunks), ring and
    Ulysses, P = 2 and 4."""
    ids = torch.randint(3, 512, (1021,), generator=torch.Generator().manual_seed(1)).tolist()
    _check_against_single_rank(data_dir / "models/stories260K/stories260K.bin", ids, 8, [2, 4],
                               ["ring", "ulysses"], atol=1e-4)


@pytest.mark.distributed
def test_context_parallel_smollm2_4k(default_model_path, data_dir):
    """SmolLM2-135M over a ~4K-token prompt, ring attention, P = 2 and 4 (Ulysses cannot: 3 KV heads)."""
    from scratchlm.model import load

    loaded = load(default_model_path)
    text = (data_dir / "corpora/tinyshakespeare/input.txt").read_text()[:40_000]
    ids = loaded.tokenizer.encode(text)[:4000]
    assert len(ids) == 4000
    with pytest.raises(ValueError, match="KV heads"):
        check_ulysses(loaded.config.n_heads, loaded.config.n_kv_heads, 2)
    _check_against_single_rank(default_model_path, ids, 8, [2, 4], ["ring"], atol=2e-3)
