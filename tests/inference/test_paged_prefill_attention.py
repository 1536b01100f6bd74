"""The paged attention kernel on prefill chunks (csrc/paged_attention.h's tiles of query rows).

A chunk's rows share a block table and attend causally (row j: the tokens up to its own). The kernel groups such
rows into tiles that read each K/V block once per tile. Checked here: against torch SDPA in float64 on the
cache's (dequantized) values, for every KV dtype, GQA ratios 1/3/4, head dims 64/128, block sizes 16/32, ragged
prefixes and chunks; and that a row's floats do not depend on the tiling (tiled == one row at a time, bit for
bit), which keeps the fused and the unfused engine step and differently chunked prefills equal.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from scratchlm.inference.attention import load_kernels
from tests.inference.helpers import random_paged_cache

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


@pytest.fixture(scope="module")
def ext():
    if os.environ.get("SCRATCHLM_QUANT_NO_EXTENSION") == "1":
        pytest.skip("C++ extensions turned off (SCRATCHLM_QUANT_NO_EXTENSION=1)")
    kernels = load_kernels()
    assert kernels is not None, "the C++ paged-attention kernel failed to build: this test checks that kernel"
    return kernels


def _sdpa_chunk(q: torch.Tensor, k64: torch.Tensor, v64: torch.Tensor, table: list[int], prefix: int) -> torch.Tensor:
    """float64 causal SDPA of a chunk's queries q (C, H, D) after `prefix` cached tokens -> (C, H, D)."""
    c, h, d = q.shape
    hkv = k64.shape[2]
    n = prefix + c
    k = k64[table].reshape(-1, hkv, d)[:n]  # (n, Hkv, D)
    v = v64[table].reshape(-1, hkv, d)[:n]
    k, v = (x.repeat_interleave(h // hkv, dim=1).transpose(0, 1) for x in (k, v))  # (H, n, D)
    mask = torch.arange(n)[None, :] <= prefix + torch.arange(c)[:, None]  # (C, n): the causal mask
    return F.scaled_dot_product_attention(q.double().transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


def _step(seqs: list[tuple[int, int]], bs: int, num_blocks: int, gen: torch.Generator):
    """Rows of a step: per (prefix, chunk) sequence, its chunk's rows (lens prefix+1 .. prefix+chunk) on its own
    random blocks. Returns per-row tables (N, width), lens (N,), and each sequence's (table, first row)."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-(p + c) // bs) for p, c in seqs)
    tables, lens, layout = [], [], []
    for prefix, chunk in seqs:
        table = [perm.pop() for _ in range(-(-(prefix + chunk) // bs))]
        layout.append((table, len(lens)))
        for j in range(chunk):
            tables.append(table + [0] * (width - len(table)))
            lens.append(prefix + j + 1)
    return torch.tensor(tables), torch.tensor(lens), layout


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bs", [16, 32])
def test_prefill_chunks_match_sdpa_float64(ext, dtype: torch.dtype, heads: tuple[int, int], d: int, bs: int) -> None:
    """A mixed step (a decode row, chunks with and without a cached prefix, ragged lengths) against float64 SDPA;
    the AVX-512 and AVX2 tiles and the scalar path."""
    h, hkv = heads
    gen = torch.Generator().manual_seed(d * 1000 + bs * 10 + h)
    seqs = [(40, 1), (0, 37), (bs + 3, 21), (2 * bs, 1), (5, 2 * bs + 7)]  # (cached prefix, chunk rows)
    num_blocks = 24
    k_cache, v_cache, scales, (k64, v64) = random_paged_cache(ext, dtype, num_blocks, bs, hkv, d, gen)
    tables, lens, layout = _step(seqs, bs, num_blocks, gen)
    q = torch.randn(len(lens), h, d, generator=gen)
    for use_simd, avx512 in ((True, True), (True, False), (False, False)):  # AVX-512 (where the CPU has it), AVX2
        got = ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, use_simd, *scales,
                                         avx512=avx512)
        for (prefix, chunk), (table, first) in zip(seqs, layout, strict=True):
            want = _sdpa_chunk(q[first : first + chunk], k64, v64, table, prefix)
            torch.testing.assert_close(got[first : first + chunk].double(), want, atol=2e-5, rtol=1e-5,
                                       msg=lambda m, p=prefix, c=chunk, s=use_simd, w=avx512: f"prefix {p} "
                                       f"chunk {c} simd {s} avx512 {w}: {m}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "avx2"])
def test_tiling_does_not_change_a_bit(ext, dtype: torch.dtype, d: int, avx512: bool) -> None:
    """Tiled rows == the same rows one tile of one at a time == each row in its own call == the chunk split in
    two calls (torch.equal); rows of sequences sharing cached blocks are tiled together too."""
    h, hkv, bs, num_blocks = 9, 3, 16, 40
    gen = torch.Generator().manual_seed(d)
    k_cache, v_cache, scales, _ = random_paged_cache(ext, dtype, num_blocks, bs, hkv, d, gen)
    tables, lens, _ = _step([(0, 45), (17, 30), (3, 1), (50, 9)], bs, num_blocks, gen)
    shared = tables[45].clone()  # two decode rows on the second sequence's blocks (a shared prefix), then more
    tables = torch.cat([tables, shared[None].expand(3, -1)])
    lens = torch.cat([lens, torch.tensor([20, 33, 47])])
    q = torch.randn(len(lens), h, d, generator=gen)

    def attend(rows: slice, tile_rows: int = 8) -> torch.Tensor:
        return ext.paged_decode_attention(q[rows], k_cache, v_cache, tables[rows], lens[rows], d ** -0.5, True,
                                          *scales, tile_rows=tile_rows, avx512=avx512)

    tiled = attend(slice(None))
    assert torch.equal(tiled, attend(slice(None), tile_rows=1))
    assert torch.equal(tiled, attend(slice(None), tile_rows=16))
    assert torch.equal(tiled, torch.cat([attend(slice(i, i + 1)) for i in range(len(lens))]))
    assert torch.equal(tiled, torch.cat([attend(slice(0, 13)), attend(slice(13, None))]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,d,bs", [((9, 3), 64, 16), ((8, 2), 128, 32), ((4, 4), 128, 16), ((6, 2), 80, 16)],
                         ids=["gqa3-d64-bs16", "gqa4-d128-bs32", "gqa1-d128-bs16", "gqa3-d80-bs16"])
def test_keys_in_lanes_equal_the_tiles_of_before(ext, dtype: torch.dtype, heads: tuple[int, int], d: int,
                                                 bs: int) -> None:
    """The AVX-512 tiles with keys in lanes (K transposed, shared by a chunk's tiles) give the floats of the
    lanes-over-D tiles and of each row alone, bit for bit: chunks with and without a cached prefix, a chunk whose
    context is long enough that its transposed blocks are not kept (d 128, 4 KV heads, 300 tokens), a decode row
    between chunks, sequences sharing cached blocks."""
    if not ext.has_avx2():
        pytest.skip("no AVX2 on this CPU")
    h, hkv = heads
    gen = torch.Generator().manual_seed(d + bs + h)
    num_blocks = 64 if bs == 16 else 40
    k_cache, v_cache, scales, _ = random_paged_cache(ext, dtype, num_blocks, bs, hkv, d, gen)
    tables, lens, _ = _step([(0, 45), (3 * bs + 5, 30), (200, 1), (260, 40)], bs, num_blocks, gen)
    q = torch.randn(len(lens), h, d, generator=gen)

    def attend(tile_rows: int) -> torch.Tensor:
        return ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5, True, *scales,
                                          tile_rows=tile_rows)

    before = ext.prefill_keys_in_lanes(-1)
    try:
        ext.prefill_keys_in_lanes(1)
        lanes = attend(8)
        assert torch.equal(lanes, attend(16))
        assert torch.equal(lanes, attend(1))
        ext.prefill_keys_in_lanes(0)
        assert torch.equal(lanes, attend(8))
    finally:
        ext.prefill_keys_in_lanes(int(before))


def test_long_context_chunk_runs_in_the_fused_step(ext, monkeypatch) -> None:
    """A prefill chunk whose context is over 512 tokens (a cached prefix of 560, then 40 rows) runs in the fused
    C++ step by default (runner.FUSED_PREFILL_MAX_CONTEXT = None) and gives the logits and cache of the Python
    step with torch SDPA (the limit of before, 512), to float tolerance."""
    from scratchlm.inference import runner as runner_mod
    from scratchlm.inference.fast_linear import use_skinny_linears
    from scratchlm.inference.kv_cache import KVCache
    from scratchlm.inference.runner import ModelInput, ModelRunner
    from scratchlm.model import ModelConfig, TransformerLM

    assert runner_mod.FUSED_PREFILL_MAX_CONTEXT is None
    torch.manual_seed(2)
    cfg = ModelConfig(vocab_size=50, d_model=384, n_layers=2, n_heads=6, n_kv_heads=2, d_ff=128, max_seq_len=1024)
    model = TransformerLM(cfg).eval()
    use_skinny_linears(model)
    bs, prefix, n = 16, 560, 40
    cache = KVCache.allocate(cfg.n_layers, 48, bs, cfg.n_kv_heads, cfg.head_dim, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    table = torch.randperm(48, generator=torch.Generator().manual_seed(0))[: -(-(prefix + n) // bs)].tolist()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()
    slots = [table[p // bs] * bs + p % bs for p in range(prefix, prefix + n)]
    inp = ModelInput(tokens, list(range(prefix, prefix + n)), slots, 0, [], [], [(0, n, prefix + n, table)],
                     [n - 1, n // 2])
    fused_runs: list[bool] = []
    runs_fused = ModelRunner._runs_fused
    monkeypatch.setattr(ModelRunner, "_runs_fused", lambda self, i: fused_runs.append(runs_fused(self, i)) or
                        fused_runs[-1])
    results = []
    for limit in (None, 512):
        monkeypatch.setattr(runner_mod, "FUSED_PREFILL_MAX_CONTEXT", limit)
        run_cache = KVCache(cache.k.clone(), cache.v.clone())
        runner = ModelRunner(model, run_cache)
        assert runner.fused_decoder is not None
        results.append((runner.execute(inp), run_cache))
    assert fused_runs == [True, False]
    (got, got_cache), (want, want_cache) = results
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got_cache.k, want_cache.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cache.v, want_cache.v, atol=1e-5, rtol=1e-5)
