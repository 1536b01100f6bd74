"""`kv_cache_dtype`: the paged KV cache in float32 / bfloat16 / float16 / int8 (per-token-head scales).

- the C++ decode-attention kernel (AVX2 and scalar paths) equals the torch-ops reference reading the same
  stored cache, on every dtype (atol/rtol 1e-5: both read identical stored values, only the summation order
  differs);
- the fused C++ decode step stores the same bytes as the Python path (`KVCache.write`) and gives the same
  hidden states (2e-4, the fused-step tolerance of test_fused_decoder.py);
- the torch-ops path (what CUDA runs) on every dtype, decode and prefill over a cached prefix, against
  attention over the dequantized values;
- int8 quantization error bounds, pool bytes = the formula, config validation and the CLI flag.
The engine-level tests (greedy agreement, prefix caching + forks) are in test_kv_dtype_engine.py.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from scratchlm.inference.attention import AttentionMetadata, PagedAttention, PrefillChunk
from scratchlm.inference.cpp_extensions import load_engine_kernels
from scratchlm.inference.kv_cache import KVCache, bytes_per_block, num_blocks_for_budget, quantize_int8

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8]


@pytest.fixture(scope="module")
def kernels():
    ext = load_engine_kernels()
    # Loud: the loader falls back to torch silently, and a kernel test that passes on the fallback proves nothing.
    assert ext is not None, "the engine's C++ kernels (csrc/engine_kernels.cpp) did not build"
    return ext


def _filled_cache(dtype: torch.dtype, n_layers: int, num_blocks: int, bs: int, hkv: int, d: int, seed: int) -> KVCache:
    """A cache of `dtype` holding random K/V (written through `KVCache.write`, so int8 gets real scales)."""
    g = torch.Generator().manual_seed(seed)
    cache = KVCache.allocate(n_layers, num_blocks, bs, hkv, d, dtype, "cpu")
    slots = torch.arange(num_blocks * bs)
    for layer in range(n_layers):
        k = torch.randn(num_blocks * bs, hkv, d, generator=g) * torch.rand(num_blocks * bs, hkv, 1, generator=g) * 3
        v = torch.randn(num_blocks * bs, hkv, d, generator=g)
        cache.write(layer, slots, k, v)
    return cache


def _tables(lens: list[int], bs: int, num_blocks: int, seed: int) -> torch.Tensor:
    perm = list(range(num_blocks))
    random.Random(seed).shuffle(perm)
    width = -(-max(lens) // bs)
    rows = []
    for n in lens:
        blocks = [perm.pop() for _ in range(-(-n // bs))]
        rows.append(blocks + [0] * (width - len(blocks)))
    return torch.tensor(rows)


def _dequantized(cache: KVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 values the cache stands for, (num_blocks, bs, Hkv, D) each."""
    every = torch.arange(cache.num_blocks)
    return cache.gather(layer, every, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("d,h,hkv", [(64, 9, 3), (32, 4, 4), (32, 8, 2), (80, 4, 2), (128, 2, 1), (16, 4, 2)])
# G = 3, 1, 4 (head tiles 3 + 1), 2; D = 80: value chunks of 2 registers; D = 16: the scalar path only
@pytest.mark.parametrize("use_simd", [True, False])
def test_kernel_matches_torch_on_every_dtype(kernels, dtype, d, h, hkv, use_simd) -> None:
    bs, num_blocks = 4, 48
    cache = _filled_cache(dtype, 2, num_blocks, bs, hkv, d, seed=d + h)
    assert cache.k.dtype == dtype
    lens = [1, 3, 4, 5, 37, 61]
    tables = _tables(lens, bs, num_blocks, seed=d)
    meta = AttentionMetadata(torch.empty(0, dtype=torch.long), len(lens), tables, torch.tensor(lens))
    q = torch.randn(len(lens), h, d)
    layer = 1
    want = PagedAttention(cache, meta, use_kernel=False)._decode(layer, q)
    scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.quantized else (None, None)
    got = kernels.paged_decode_attention(q, cache.k[layer], cache.v[layer], tables, torch.tensor(lens), d ** -0.5,
                                         use_simd, *scales)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the reference itself is attention over the dequantized cache (one sequence, by hand)
    kd, vd = _dequantized(cache, layer)
    n, table = lens[-1], tables[-1]
    keys = kd[table].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, dim=1)  # (n, H, D)
    values = vd[table].reshape(-1, hkv, d)[:n].repeat_interleave(h // hkv, dim=1)
    probs = torch.einsum("hd,nhd->hn", q[-1], keys).mul(d ** -0.5).softmax(-1)
    torch.testing.assert_close(want[-1], torch.einsum("hn,nhd->hd", probs, values), atol=1e-5, rtol=1e-5)


def test_kernel_rejects_bad_int8_inputs(kernels) -> None:
    cache = _filled_cache(torch.int8, 1, 8, 4, 2, 32, seed=0)
    q, tables, lens = torch.randn(1, 2, 32), torch.tensor([[1, 2]]), torch.tensor([5])
    with pytest.raises(RuntimeError, match="needs k_scale and v_scale"):
        kernels.paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens, 0.1)
    with pytest.raises(RuntimeError, match="scales must be contiguous float32"):
        kernels.paged_decode_attention(q, cache.k[0], cache.v[0], tables, lens, 0.1, True, cache.k_scale[0][:4],
                                       cache.v_scale[0])
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.paged_decode_attention(q, cache.k[0], cache.v[0], torch.tensor([[1, 8]]), lens, 0.1, True,
                                       cache.k_scale[0], cache.v_scale[0])
    with pytest.raises(RuntimeError, match="is not float32, bfloat16, float16 or int8"):
        kernels.paged_decode_attention(q, cache.k[0].double(), cache.v[0].double(), tables, lens, 0.1)


def test_int8_quantization_error_bound() -> None:
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 2, 50)[:, None, None]
    x[0, 0] = 0.0  # an all-zero row: scale 0, q 0, exact
    q, s = quantize_int8(x)
    assert q.dtype == torch.int8 and s.shape == (50, 3) and int(q.abs().max()) == 127
    err = (q.float() * s[..., None] - x).abs()
    assert bool((err <= s[..., None] / 2 * (1 + 1e-5) + 1e-30).all())  # at most half a step per element
    assert float(err[0, 0].max()) == 0.0 and float(s[0, 0]) == 0.0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_torch_path_prefill_over_cached_prefix_reads_compact_cache(dtype) -> None:
    """The torch-ops path (CUDA's too): a chunk after a cached prefix attends to the stored (dequantized) prefix
    and to itself as stored; a decode query attends to the stored context."""
    torch.manual_seed(3)
    h, hkv, d, bs = 4, 2, 16, 4
    cache = KVCache.allocate(1, 16, bs, hkv, d, dtype, "cpu")
    prefix, chunk = 10, 5
    table = torch.tensor([7, 2, 11, 5])
    slots = lambda pos: table[pos // bs] * bs + pos % bs  # noqa: E731
    k, v = torch.randn(prefix + chunk, hkv, d), torch.randn(prefix + chunk, hkv, d)
    cache.write(0, slots(torch.arange(prefix)), k[:prefix], v[:prefix])  # the cached prefix
    q = torch.randn(chunk, h, d)
    meta = AttentionMetadata(slots(torch.arange(prefix, prefix + chunk)), 0, None, None,
                             [PrefillChunk(0, chunk, prefix + chunk, table)])
    got = PagedAttention(cache, meta, use_kernel=False)(0, q[None], k[None, prefix:], v[None, prefix:])[0]
    kd, vd = (t.reshape(-1, hkv, d)[: prefix + chunk] for t in cache.gather(0, table, torch.float32))
    if dtype == torch.float32:
        torch.testing.assert_close(kd, k, atol=0, rtol=0)
    else:  # what was read is the stored rounding, not the float32 input
        assert not torch.equal(kd, k)
        torch.testing.assert_close(kd, k, atol=0.05 * float(k.abs().max()), rtol=0.02)
    mask = torch.arange(prefix + chunk)[None, :] <= torch.arange(prefix, prefix + chunk)[:, None]  # (T, S)
    want = F.scaled_dot_product_attention(q.transpose(0, 1), kd.transpose(0, 1).repeat_interleave(2, 0),
                                          vd.transpose(0, 1).repeat_interleave(2, 0), attn_mask=mask)
    torch.testing.assert_close(got, want.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_copy_blocks_carries_int8_scales() -> None:
    cache = _filled_cache(torch.int8, 2, 6, 4, 2, 16, seed=5)
    cache.copy_blocks([(1, 4), (3, 0)])
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        assert torch.equal(t[:, 4], t[:, 1]) and torch.equal(t[:, 0], t[:, 3])


@pytest.mark.parametrize("dtype,per_token_head", [(torch.float32, 4 * 64), (torch.bfloat16, 2 * 64),
                                                  (torch.float16, 2 * 64), (torch.int8, 64 + 4)], ids=str)
def test_pool_bytes_match_the_formula(dtype, per_token_head) -> None:
    layers, hkv, d, bs = 3, 2, 64, 16
    per_block = 2 * layers * bs * hkv * per_token_head  # K and V, every layer, scales included
    assert bytes_per_block(layers, hkv, d, bs, dtype) == per_block
    n = num_blocks_for_budget(1 << 20, layers, hkv, d, bs, dtype)
    assert n == (1 << 20) // per_block
    cache = KVCache.allocate(layers, n, bs, hkv, d, dtype, "cpu")
    assert cache.nbytes == n * per_block <= 1 << 20


def test_config_validates_kv_cache_dtype_and_cli_flag() -> None:
    import argparse

    from scratchlm.config import add_dataclass_arguments
    from scratchlm.inference.config import EngineConfig

    assert EngineConfig().kv_torch_dtype == torch.float32
    assert EngineConfig(dtype="bfloat16").kv_torch_dtype == torch.bfloat16
    assert EngineConfig(kv_cache_dtype="int8").kv_torch_dtype == torch.int8
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' must be one of \['auto', 'float32', 'bfloat16', "
                                         r"'float16', 'int8'\]"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="not supported with tensor/pipeline/context parallelism"):
        EngineConfig(kv_cache_dtype="int8", tensor_parallel_size=2)
    parser = argparse.ArgumentParser()
    add_dataclass_arguments(parser, EngineConfig)
    assert parser.parse_args(["--kv-cache-dtype", "bfloat16"]).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])
    assert "per token and KV head" in parser.format_help().replace("\n", " ").replace("  ", " ")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("batch", [1, 6])
def test_fused_step_stores_the_same_bytes_as_python(kernels, dtype, batch) -> None:
    """The fused decode step (csrc/decoder.h) writes K/V as `KVCache.write` does (bit-equal, int8 scales too) and
    attends to the compact cache as the Python model with paged attention does."""
    from scratchlm.inference.fast_linear import use_skinny_linears
    from scratchlm.inference.runner import fused_decoder_for
    from scratchlm.model import ModelConfig, TransformerLM

    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=256)
    model = TransformerLM(cfg).eval()
    use_skinny_linears(model)
    bs = 4
    cache = _filled_cache(dtype, cfg.n_layers, 4 * batch + 4, bs, cfg.n_kv_heads, cfg.head_dim, seed=batch)
    lens = [random.Random(batch + i).randint(1, 3 * bs) for i in range(batch)]
    tables = _tables(lens, bs, cache.num_blocks, seed=batch)
    slots = torch.tensor([int(tables[i][(n - 1) // bs]) * bs + (n - 1) % bs for i, n in enumerate(lens)])
    lens_t = torch.tensor(lens)
    ref = KVCache(*(None if t is None else t.clone() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale)))
    tokens = torch.randint(0, cfg.vocab_size, (batch,))
    with torch.inference_mode():
        want = model.hidden_states(tokens[None], lens_t - 1, PagedAttention(ref, AttentionMetadata(
            slots, batch, tables, lens_t)))[0]  # (B, d)
        fused = fused_decoder_for(model, cache)
        assert fused is not None
        cos, sin = model.rope.cos_sin(lens_t - 1, torch.float32)
        got = fused.forward(model.tok_embeddings(tokens), cache.k, cache.v, slots, cos[:, 0], sin[:, 0], tables,
                            lens_t, cache.k_scale, cache.v_scale)
    # The projections differ in summation order (skinny GEMM vs torch), so a K/V value may round to the
    # neighbouring bf16/fp16/int8 step: compare the stored values within one step, and exactly elsewhere.
    for got_t, want_t in ((cache.k, ref.k), (cache.v, ref.v)):
        diff = (got_t.float() - want_t.float()).abs()
        step = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.int8: 1}[dtype]
        assert float(diff.max()) <= step * max(1.0, float(want_t.float().abs().max())), dtype
        untouched = torch.ones(cache.num_blocks * bs, dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(got_t.flatten(1, 2)[:, untouched], want_t.flatten(1, 2)[:, untouched])
    if cache.quantized:
        torch.testing.assert_close(cache.k_scale, ref.k_scale, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=2e-4 if dtype == torch.float32 else 2e-3,
                               rtol=2e-4 if dtype == torch.float32 else 2e-3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpp_writer_is_bit_equal_to_torch(kernels, dtype) -> None:
    """Same float32 K/V in -> identical stored bytes (and int8 scales) from the C++ writer the fused step uses
    (store_rows) and from `KVCache.write`: round to nearest even, int8 by division by max|x| / 127."""
    torch.manual_seed(2)
    n, hkv, d = 40, 3, 32
    x = torch.randn(n, hkv, d) * torch.logspace(-4, 3, n)[:, None, None]
    x[3, 0] = (torch.arange(d) - 15.5) * (127 / 15.5)  # halves after scaling: ties to even
    x[4, 1] = 0.0
    slots = torch.randperm(16 * 4)[:n]
    ours, ref = (KVCache.allocate(1, 16, 4, hkv, d, dtype, "cpu") for _ in range(2))
    ref.write(0, slots, x, x)
    kernels.kv_store(ours.k[0], ours.k_scale[0] if ours.quantized else None, slots, x)
    assert torch.equal(ours.k, ref.k)
    if dtype == torch.int8:
        assert torch.equal(ours.k_scale, ref.k_scale)
