"""The decode rows of the paged attention kernel (csrc/paged_attention.h's decode_row_avx2), the fused step's stage
profile (decoder.h) and the KV cache on huge pages (inference/huge_pages.py).

A decode row (a row whose block table no neighbour shares) runs as one work item over all its KV heads, reading
each block's K/V rows of every head front to back. Checked: against float64 attention on the cache's
(dequantized) values for every KV dtype, GQA ratios 1/3/4/8, head dims 32/64/80/128, ragged lengths across block
edges, AVX-512 and AVX2; and that its floats equal the per-KV-head tile kernel's (`set_decode_rows(0)`) bit for bit,
alone and beside prefill tiles, so the fused and unfused steps and differently chunked prefills stay equal.
"""

from __future__ import annotations

import os

import pytest
import torch

from scratchlm.inference import huge_pages
from scratchlm.inference.attention import load_kernels
from scratchlm.inference.kv_cache import KVCache
from tests.inference.helpers import random_paged_cache

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]
LENS = [1, 15, 16, 17, 40, 100, 161]  # inside one block, at and across block edges, several blocks


@pytest.fixture(scope="module")
def ext():
    if os.environ.get("SCRATCHLM_QUANT_NO_EXTENSION") == "1":
        pytest.skip("C++ extensions turned off (SCRATCHLM_QUANT_NO_EXTENSION=1)")
    kernels = load_kernels()
    assert kernels is not None, "the C++ paged-attention kernel failed to build: this test checks that kernel"
    return kernels


@pytest.fixture
def decode_rows(ext):
    """Restores the decode-row switch after a test that flips it."""
    old = ext.set_decode_rows(-1)
    yield
    ext.set_decode_rows(int(old))


def _rows(lens: list[int], bs: int, num_blocks: int, gen: torch.Generator):
    """Decode rows of the given context lengths on distinct random blocks: tables (B, width), lens (B,)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // bs) for n in lens)
    tables = []
    for n in lens:
        t = [perm.pop() for _ in range(-(-n // bs))]
        tables.append(t + [0] * (width - len(t)))
    return torch.tensor(tables), torch.tensor(lens)


def _attention64(q: torch.Tensor, k64: torch.Tensor, v64: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor):
    """float64 attention of each row's query q (B, H, D) over its context -> (B, H, D)."""
    out = []
    h, d = q.shape[1:]
    hkv = k64.shape[2]
    for b, n in enumerate(lens.tolist()):
        k = k64[tables[b]].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, dim=1)  # (n, H, D)
        v = v64[tables[b]].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].double(), k) / d ** 0.5, dim=-1)  # (H, n)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2), (16, 2)], ids=["gqa1", "gqa3", "gqa4", "gqa8"])
@pytest.mark.parametrize("d", [32, 64, 80, 128])
def test_decode_rows_match_float64(ext, decode_rows, dtype: torch.dtype, heads: tuple[int, int], d: int) -> None:
    """The row kernel (AVX-512 and AVX2) against float64 attention, and bit-equal to the tile kernel per KV head."""
    h, hkv = heads
    bs, num_blocks = 16, 48
    gen = torch.Generator().manual_seed(d * 100 + h)
    k_cache, v_cache, scales, (k64, v64) = random_paged_cache(ext, dtype, num_blocks, bs, hkv, d, gen)
    tables, lens = _rows(LENS, bs, num_blocks, gen)
    q = torch.randn(len(LENS), h, d, generator=gen)
    want = _attention64(q, k64, v64, tables, lens)
    for avx512 in (True, False):
        got = {}
        for rows in (1, 0):
            ext.set_decode_rows(rows)
            got[rows] = ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, True, *scales,
                                                   avx512=avx512)
        torch.testing.assert_close(got[1].double(), want, atol=2e-5, rtol=1e-5,
                                   msg=lambda m, w=avx512: f"avx512 {w}: {m}")
        assert torch.equal(got[1], got[0]), f"row kernel != tile kernel (avx512 {avx512})"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_rows_beside_prefill_tiles(ext, decode_rows, dtype: torch.dtype) -> None:
    """A mixed step (decode rows, a prefill chunk, rows sharing a prefix) gives the same bits with and without the
    row kernel, on 1 and 2 threads; a decode row equals the same row computed inside its chunk's tile."""
    h, hkv, d, bs, num_blocks = 9, 3, 64, 16, 40
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, scales, _ = random_paged_cache(ext, dtype, num_blocks, bs, hkv, d, gen)
    dec_tables, dec_lens = _rows([33, 70, 5], bs, num_blocks // 2, gen)
    chunk_table = torch.arange(num_blocks // 2, num_blocks // 2 + 4)  # a 50-token chunk on blocks of its own
    width = max(dec_tables.shape[1], 4)
    pad = torch.zeros(width, dtype=torch.long)
    tables = torch.stack([torch.cat([t, pad])[:width] for t in dec_tables] +
                         [torch.cat([chunk_table, pad])[:width]] * 50)
    lens = torch.cat([dec_lens, torch.arange(1, 51)])
    q = torch.randn(len(lens), h, d, generator=gen)
    outs = []
    threads = torch.get_num_threads()
    try:
        for rows in (1, 0):
            ext.set_decode_rows(rows)
            for n in (1, 2):
                torch.set_num_threads(n)
                outs.append(ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, True, *scales))
    finally:
        torch.set_num_threads(threads)
    for o in outs[1:]:
        assert torch.equal(outs[0], o)
    ext.set_decode_rows(1)  # the chunk's row 37 on its own: a decode row of the row kernel
    alone = ext.paged_decode_attention(q[3 + 36 : 3 + 37], k_cache, v_cache, tables[3 + 36 : 3 + 37],
                                       lens[3 + 36 : 3 + 37], d ** -0.5, True, *scales)
    assert torch.equal(alone[0], outs[0][3 + 36])


def test_decoder_profile_counts_stages(ext) -> None:
    """With profiling on, every fused forward adds its stages' thread seconds and one step; off, nothing."""
    from scratchlm.inference.fast_linear import use_skinny_linears
    from scratchlm.inference.runner import fused_decoder_for
    from scratchlm.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=64)
    model = TransformerLM(cfg).eval()
    use_skinny_linears(model)
    cache = KVCache.allocate(cfg.n_layers, 8, 4, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
    fused = fused_decoder_for(model, cache)
    assert fused is not None
    pos = torch.tensor([5, 9])
    cos, sin = model.rope.cos_sin(pos, torch.float32)
    args = (cache.k, cache.v, torch.tensor([5, 13]), cos[:, 0], sin[:, 0], torch.tensor([[0, 1, 0], [2, 3, 4]]),
            pos + 1)
    ext.decoder_profile(0, True)
    with torch.inference_mode():
        fused.forward(model.tok_embeddings(torch.tensor([1, 2])), *args)
        assert ext.decoder_profile(1, True)["steps"] == 0  # off: nothing counted
        for _ in range(3):
            fused.forward(model.tok_embeddings(torch.tensor([1, 2])), *args)
    prof = ext.decoder_profile(0, True)
    assert prof["steps"] == 3
    stages = {k: v for k, v in prof.items() if k != "steps"}
    assert set(stages) >= {"attention", "qkv_gemm", "o_gemm", "gate_up_gemm", "down_gemm", "attn_norm", "rope"}
    assert all(v >= 0 for v in stages.values()) and sum(stages.values()) > 0
    assert ext.decoder_profile()["steps"] == 0  # reset


def test_huge_page_zeros(monkeypatch) -> None:
    """`huge_pages.zeros` is torch.zeros (shape, dtype, all zero) whether or not huge pages are taken; the KV cache
    allocates through it; small buffers and SCRATCHLM_HUGE_PAGES=0 are not advised."""
    big = huge_pages.zeros((3, 1 << 20), torch.float32)  # 12 MiB
    assert big.shape == (3, 1 << 20) and big.dtype == torch.float32 and not big.any()
    small = torch.empty(1024)
    assert huge_pages.advise(small) is False
    monkeypatch.setenv(huge_pages.ENV, "0")
    assert not huge_pages.enabled() and huge_pages.advise(torch.empty(2 << 20)) is False
    off = huge_pages.zeros((2, 1 << 20), torch.int8)
    assert off.dtype == torch.int8 and not off.any()
    monkeypatch.delenv(huge_pages.ENV)
    cache = KVCache.allocate(2, 64, 16, 3, 64, torch.bfloat16, "cpu")
    assert cache.k.dtype == torch.bfloat16 and not cache.k.any() and not cache.v.any()


@pytest.mark.parametrize("d", [7, 40, 100, 576, 1000])
def test_rms_norm_rows_match_float64(ext, d: int) -> None:
    """decoder.h's RMSNorm (8-lane partial sums of squares where the CPU has AVX2, any d: 32-element steps, an 8-lane
    step, a scalar tail) within 1e-6 of float64 relative to each row's largest value; a row alone gives the same
    bits as inside a batch."""
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    kernels = load_engine_kernels()
    gen = torch.Generator().manual_seed(d)
    x = torch.randn(9, d, generator=gen) * torch.logspace(-3, 3, 9)[:, None]
    x[:, 0] *= 50.0  # an outlier channel, as SmolLM2 has
    w = torch.randn(d, generator=gen) * 0.5 + 1.0
    got = kernels.rms_norm(x, w, 1e-5)
    x64 = x.double()
    exact = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + 1e-5) * w.double()
    scale = exact.abs().amax(-1, keepdim=True)
    assert float(((got - exact).abs() / scale).max()) < 1e-6
    for i in (0, 4, 8):
        assert torch.equal(kernels.rms_norm(x[i : i + 1], w, 1e-5)[0], got[i])
