"""Paged attention (decode + chunked prefill over block tables) against plain causal attention."""

from __future__ import annotations

import pytest
import torch

from scratchlm.inference.attention import AttentionMetadata, PagedAttention, PrefillChunk
from scratchlm.inference.kv_cache import KVCache
from scratchlm.model.layers import causal_attention


@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)])
def test_paged_attention_matches_causal(block_size: int, heads: tuple[int, int]) -> None:
    """Several sequences, each split into a cached prefix, then a mixed step of decodes + chunks."""
    torch.manual_seed(0)
    h, hkv = heads
    d = 8
    lengths = [1, 5, 17, 9]  # total tokens per sequence after the step
    new = [1, 1, 6, 9]  # tokens computed in the step: two decodes, a chunk with prefix, a fresh prefill
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    cache = KVCache.allocate(1, num_blocks, block_size, hkv, d, torch.float32, "cpu")
    perm = torch.randperm(num_blocks).tolist()  # scattered, non-contiguous blocks
    tables, qs, ks, vs = [], [], [], []
    for n in lengths:
        nb = -(-n // block_size)
        tables.append([perm.pop() for _ in range(nb)])
        qs.append(torch.randn(n, h, d))
        ks.append(torch.randn(n, hkv, d))
        vs.append(torch.randn(n, hkv, d))
    # write the prefixes into the cache as earlier steps would have
    for t, k, v, n, m in zip(tables, ks, vs, lengths, new):
        for p in range(n - m):
            cache.k[0, t[p // block_size], p % block_size] = k[p]
            cache.v[0, t[p // block_size], p % block_size] = v[p]
    rows_q, rows_k, rows_v, slots, prefills = [], [], [], [], []
    start = 0
    for i, (t, n, m) in enumerate(zip(tables, lengths, new)):
        rows_q.append(qs[i][n - m:])
        rows_k.append(ks[i][n - m:])
        rows_v.append(vs[i][n - m:])
        slots += [t[p // block_size] * block_size + p % block_size for p in range(n - m, n)]
        if m > 1:
            prefills.append(PrefillChunk(start, m, n, torch.tensor(t)))
        start += m
    width = max(len(t) for t in tables[:2])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), num_decode_tokens=2,
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables[:2]]),
        decode_context_lens=torch.tensor(lengths[:2]), prefills=prefills,
    )
    out = PagedAttention(cache, meta)(0, torch.cat(rows_q)[None], torch.cat(rows_k)[None], torch.cat(rows_v)[None])
    start = 0
    for i, (n, m) in enumerate(zip(lengths, new)):
        ref = causal_attention(qs[i][None], ks[i][None], vs[i][None])[0, n - m:]
        torch.testing.assert_close(out[0, start:start + m], ref, atol=1e-5, rtol=1e-5)
        start += m


def test_copy_blocks() -> None:
    cache = KVCache.allocate(2, 4, 2, 1, 3, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    before_k = cache.k[:, 1].clone()
    cache.copy_blocks([(1, 3)])
    torch.testing.assert_close(cache.k[:, 3], before_k)
    torch.testing.assert_close(cache.v[:, 3], cache.v[:, 1])


@pytest.mark.parametrize("d", [6, 8, 32, 64, 80, 128])
@pytest.mark.parametrize("use_simd", [True, False])
def test_decode_kernel_matches_torch_ops(d: int, use_simd: bool) -> None:
    """The C++ decode kernel (AVX2 and scalar paths) against the torch-ops gather path, GQA, ragged lengths."""
    from scratchlm.inference.attention import load_kernels

    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the C++ paged-attention kernel could not be built here (the torch path is tested above)")
    torch.manual_seed(1)
    h, hkv, bs, num_blocks = 9, 3, 4, 40
    cache = KVCache.allocate(1, num_blocks, bs, hkv, d, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    lens = [1, 4, 5, 37]
    perm = torch.randperm(num_blocks).tolist()
    width = -(-max(lens) // bs)
    tables = torch.tensor([[perm.pop() for _ in range(-(-n // bs))] + [0] * (width - -(-n // bs)) for n in lens])
    meta = AttentionMetadata(slot_mapping=torch.empty(0, dtype=torch.long), num_decode_tokens=len(lens),
                             decode_block_tables=tables, decode_context_lens=torch.tensor(lens))
    q = torch.randn(len(lens), h, d)
    want = PagedAttention(cache, meta, use_kernel=False)._decode(0, q)
    got = kernels.paged_decode_attention(q, cache.k[0], cache.v[0], tables, torch.tensor(lens), d ** -0.5, use_simd)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_kernel_rejects_bad_lengths() -> None:
    from scratchlm.inference.attention import load_kernels

    kernels = load_kernels()
    if kernels is None:
        pytest.skip("the C++ paged-attention kernel could not be built here")
    cache = KVCache.allocate(1, 4, 4, 1, 8, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.paged_decode_attention(torch.randn(1, 1, 8), cache.k[0], cache.v[0], torch.tensor([[0]]),
                                       torch.tensor([5]), 1.0)
