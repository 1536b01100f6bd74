"""The C++ `FusedDecoder` (a whole decode step in one call) against the Python model with paged attention."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from scratchlm.inference.attention import AttentionMetadata, PagedAttention
from scratchlm.inference.cpp_extensions import load_engine_kernels
from scratchlm.inference.engine_ops import RowPagedAttention, use_engine_ops
from scratchlm.inference.fast_linear import use_skinny_linears
from scratchlm.inference.kv_cache import KVCache
from scratchlm.inference.runner import ModelInput, ModelRunner, fused_decoder_for
from scratchlm.model import ModelConfig, TransformerLM
from tests.inference.helpers import greedy, make_engine, run_all, tiny_model


@pytest.fixture(scope="module")
def kernels():
    ext = load_engine_kernels()
    if ext is None:
        pytest.skip("the engine's C++ kernels could not be built here (the Python path is used instead)")
    return ext


def _model(rope_layout: str, qkv_bias: bool, n_heads: int = 4, n_kv_heads: int = 2) -> TransformerLM:
    torch.manual_seed(1)
    cfg = ModelConfig(vocab_size=50, d_model=64, n_layers=3, n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=96,
                      max_seq_len=256, rope_layout=rope_layout, qkv_bias=qkv_bias)
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():  # non-trivial norms and biases
            if p.dim() == 1:
                p.normal_(1.0 if p.shape[0] == cfg.d_model else 0.0, 0.3)
    use_skinny_linears(model)
    return model


def _decode_inputs(batch: int, cache: KVCache, seed: int):
    """Random context lengths, block tables over distinct blocks, and each token's slot (its last position)."""
    rng = random.Random(seed)
    bs = cache.block_size
    free = list(range(cache.num_blocks))
    rng.shuffle(free)
    lens, tables, slots = [], [], []
    for _ in range(batch):
        n = rng.randint(1, 3 * bs)
        blocks = [free.pop() for _ in range(-(-n // bs))]
        lens.append(n)
        tables.append(blocks)
        slots.append(blocks[(n - 1) // bs] * bs + (n - 1) % bs)
    width = max(len(t) for t in tables)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    return torch.tensor(lens), tables, torch.tensor(slots)


def _fused_and_python_decode(model, batch: int):
    """One decode step of `batch` sequences over a random paged cache, fused, through the model's torch layers,
    and through the engine's unfused path (the same model with the fused step's row ops swapped in,
    engine_ops.py): (fused hidden (B, d), torch-layers hidden (B, d), engine-ops hidden (B, d), the fused step's
    cache, the torch layers' cache)."""
    c = model.config
    cache = KVCache.allocate(c.n_layers, 4 * batch + 4, 4, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    lens, tables, slots = _decode_inputs(batch, cache, seed=batch)
    tokens = torch.randint(0, c.vocab_size, (batch,))
    positions = lens - 1
    ref_cache = KVCache(cache.k.clone(), cache.v.clone())
    ops_cache = KVCache(cache.k.clone(), cache.v.clone())
    meta = AttentionMetadata(slots, batch, tables, lens)
    swapped = copy.deepcopy(model)
    assert use_engine_ops(swapped) > 0
    with torch.inference_mode():
        want = model.hidden_states(tokens[None], positions, PagedAttention(ref_cache, meta))[0]  # (B, d)
        ops = swapped.hidden_states(tokens[None], positions, RowPagedAttention(ops_cache, meta, tables, lens))[0]
        fused = fused_decoder_for(model, cache)
        assert fused is not None
        cos, sin = model.rope.cos_sin(positions, torch.float32)
        got = fused.forward(model.tok_embeddings(tokens), cache.k, cache.v, slots, cos[:, 0], sin[:, 0], tables, lens)
    assert torch.equal(cache.k, ops_cache.k) and torch.equal(cache.v, ops_cache.v)
    return got, want, ops, cache, ref_cache


@pytest.mark.parametrize("rope_layout,qkv_bias,heads", [("half", False, (4, 2)), ("adjacent", True, (4, 4)),
                                                        ("half", True, (2, 1))])
@pytest.mark.parametrize("batch", [1, 5, 70])  # 70 > 64 rows: ATen's mm instead of the skinny kernel
def test_fused_step_matches_python(kernels, rope_layout: str, qkv_bias: bool, heads, batch: int) -> None:
    """Head dims 16 (scalar attention) and 32 (AVX2), GQA and MHA, biases, both RoPE layouts."""
    model = _model(rope_layout, qkv_bias, *heads)
    got, want, ops, cache, ref_cache = _fused_and_python_decode(model, batch)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    assert torch.equal(got, ops)  # the engine's unfused path runs the same code: the same bits
    torch.testing.assert_close(cache.k, ref_cache.k, atol=1e-5, rtol=1e-5)  # the new K/V landed in the same slots
    torch.testing.assert_close(cache.v, ref_cache.v, atol=1e-5, rtol=1e-5)


def test_fused_step_rejects_bad_input(kernels) -> None:
    model = _model("half", False)
    c = model.config
    cache = KVCache.allocate(c.n_layers, 8, 4, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
    fused = fused_decoder_for(model, cache)
    x = torch.randn(2, c.d_model)
    cos = sin = torch.zeros(2, c.head_dim // 2)
    tables, lens = torch.tensor([[0, 1], [2, 3]]), torch.tensor([5, 3])
    with pytest.raises(RuntimeError, match="slot 99 outside"):
        fused.forward(x, cache.k, cache.v, torch.tensor([4, 99]), cos, sin, tables, lens)
    with pytest.raises(RuntimeError, match="context length 9 out of range"):
        fused.forward(x, cache.k, cache.v, torch.tensor([4, 10]), cos, sin, tables, torch.tensor([5, 9]))
    with pytest.raises(RuntimeError, match="block 8 outside"):
        fused.forward(x, cache.k, cache.v, torch.tensor([4, 10]), cos, sin, torch.tensor([[0, 1], [2, 8]]), lens)
    with pytest.raises(RuntimeError, match="x must be"):
        fused.forward(torch.randn(2, 3), cache.k, cache.v, torch.tensor([4, 10]), cos, sin, tables, lens)
    with pytest.raises(RuntimeError, match="expected 9 or 12"):
        kernels.FusedDecoder([[torch.ones(4)]], 2, 1, 2, 1e-5, True)
    with pytest.raises(RuntimeError, match="wq has shape"):
        w = [torch.ones(8), torch.ones(3, 8)] + [torch.ones(1)] * 4 + [torch.ones(5, 8)] + [torch.ones(1)] * 2
        kernels.FusedDecoder([w], 2, 1, 4, 1e-5, True)


def test_fused_decoder_only_for_plain_float32_models() -> None:
    model = _model("half", False)
    c = model.config
    # a compact KV cache is fine (tests/inference/test_kv_dtype.py), bfloat16 weights are not
    assert fused_decoder_for(model, KVCache.allocate(c.n_layers, 4, 4, c.n_kv_heads, c.head_dim, torch.bfloat16,
                                                     "cpu")) is not None
    assert fused_decoder_for(_model("half", False).to(torch.bfloat16), KVCache.allocate(
        c.n_layers, 4, 4, c.n_kv_heads, c.head_dim, torch.float32, "cpu")) is None
    raw = TransformerLM(c).eval()  # Linear layers not swapped (e.g. quantized or custom): no fused path
    assert fused_decoder_for(raw, KVCache.allocate(c.n_layers, 4, 4, c.n_kv_heads, c.head_dim, torch.float32,
                                                   "cpu")) is None


def test_engine_greedy_same_with_and_without_fused_step(kernels) -> None:
    """Mixed prefill/decode streams: the engine's ids do not depend on which path ran the decode-only steps."""
    model, cfg = tiny_model(seed=3)
    prompts = [[random.Random(i).randrange(cfg.vocab_size) for _ in range(5 + 7 * i)] for i in range(6)]
    outs = []
    for use_fused in (True, False):
        engine = make_engine(model, cfg, num_blocks=64, block_size=4, max_num_seqs=4)
        assert engine.runner.fused_decoder is not None
        if not use_fused:
            engine.runner.fused_decoder = None
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, greedy(12 + i))
        outs.append(run_all(engine))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("rope_layout,qkv_bias,heads", [("half", False, (4, 2)), ("adjacent", True, (2, 1))])
def test_fused_mixed_step_matches_python(kernels, rope_layout: str, qkv_bias: bool, heads) -> None:
    """A step of decode rows and prefill chunks (one on a cached prefix, one fresh, one over 64 rows): the fused
    step, where each prefill row attends to its causal prefix, gives the Python path's logits and cache."""
    model = _model(rope_layout, qkv_bias, *heads)
    c = model.config
    bs = 4
    cache = KVCache.allocate(c.n_layers, 64, bs, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
    cache.k.normal_()
    cache.v.normal_()
    rng = random.Random(0)
    free = list(range(cache.num_blocks))
    rng.shuffle(free)
    token_ids, positions, slots, dec_tables, dec_lens, prefills, logits_rows = [], [], [], [], [], [], []

    def add_rows(table: list[int], start: int, n: int) -> None:
        token_ids.extend(rng.randrange(c.vocab_size) for _ in range(n))
        positions.extend(range(start, start + n))
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
        logits_rows.append(len(token_ids) - 1)

    for n in (7, 13):  # decode rows: context n, the new token at position n - 1
        table = [free.pop() for _ in range(-(-n // bs))]
        add_rows(table, n - 1, 1)
        dec_tables.append(table)
        dec_lens.append(n)
    for prefix, n in ((9, 6), (0, 11), (0, 70)):  # prefill chunks: (cached prefix, chunk length)
        table = [free.pop() for _ in range(-(-(prefix + n) // bs))]
        prefills.append((len(token_ids), n, prefix + n, table))
        add_rows(table, prefix, n)
    width = max(len(t) for t in dec_tables)
    inp = ModelInput(token_ids, positions, slots, 2, [t + [0] * (width - len(t)) for t in dec_tables], dec_lens,
                     prefills, logits_rows)
    results = []
    for fused in (True, False):
        run_cache = KVCache(cache.k.clone(), cache.v.clone())
        runner = ModelRunner(model, run_cache)
        assert runner.fused_decoder is not None
        if not fused:
            runner.fused_decoder = None
        results.append((runner.execute(inp), run_cache))
    (got, got_cache), (want, want_cache) = results
    assert torch.equal(got, want)  # the unfused path runs the fused step's row ops and attention (engine_ops.py)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got_cache.k, want_cache.k, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_cache.v, want_cache.v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scheme", ["int8", "int8-g32", "int4-g32-asym", "int4-g32-sym", "int4-g64-asym"])
@pytest.mark.parametrize("batch", [1, 3, 70])  # 1-2 rows: codes to floats in registers; 3-64: FMA tiles; 70: prefill
def test_fused_quantized_step_matches_python(kernels, scheme: str, batch: int) -> None:
    """Quantized linears in the fused step: the Python path's QuantLinear runs the same kernels, so the two agree
    to float32 rounding (tolerance 2e-4, measured <= 4e-6), and the K/V written are the same. With integer
    activations x is rounded to int8 per 32-block, and the torch layers' norms differ from the fused step's in
    float order, so a row can round differently (measured: 1 of 70 rows at int4-g32-sym, 0.017): that comparison
    runs with float activations; the default kernels are bit-equal to the engine's unfused path (engine_ops)."""
    from scratchlm.inference.quantization import kernels as qkernels
    from scratchlm.inference.quantization import quantize_model

    model = quantize_model(_model("half", False), scheme)
    use_skinny_linears(model)
    got, want, ops, cache, ref_cache = _fused_and_python_decode(model, batch)
    assert torch.equal(got, ops)  # bit-equal inputs to every linear: the same int8 rounding of x
    previous = qkernels.float_activations()
    try:
        qkernels.float_activations(True)
        got, want, ops, cache, ref_cache = _fused_and_python_decode(model, batch)
    finally:
        qkernels.float_activations(previous)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(cache.k, ref_cache.k, atol=1e-5, rtol=1e-5)
    assert torch.equal(got, ops)


def test_fused_quantized_engine_greedy_same_with_and_without(kernels) -> None:
    """int4 (asym, g32) and int8 models: the engine's greedy ids do not depend on the fused step."""
    from scratchlm.inference.quantization import quantize_model

    model, cfg = tiny_model(seed=3)
    prompts = [[random.Random(i).randrange(cfg.vocab_size) for _ in range(5 + 7 * i)] for i in range(5)]
    for scheme in ("int8", "int4-g32-asym"):
        try:
            qmodel = quantize_model(model, scheme)
        except ValueError:  # a tiny model whose d_ff is no multiple of 32 takes int8 only
            continue
        outs = []
        for use_fused in (True, False):
            engine = make_engine(qmodel, cfg, num_blocks=64, block_size=4, max_num_seqs=4)
            assert engine.runner.fused_decoder is not None
            if not use_fused:
                engine.runner.fused_decoder = None
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, greedy(12 + i))
            outs.append(run_all(engine))
        assert outs[0] == outs[1], scheme


def _prefill_logits(model, prompt: list[int], chunk: int, fused: bool) -> tuple[torch.Tensor, KVCache]:
    """Prefill `prompt` through a ModelRunner in chunks of `chunk` tokens: every chunk's last-row logits
    (chunks, vocab) and the cache it filled."""
    c = model.config
    bs = 4
    cache = KVCache.allocate(c.n_layers, -(-len(prompt) // bs) + 1, bs, c.n_kv_heads, c.head_dim, torch.float32,
                             "cpu")
    runner = ModelRunner(model, cache)
    assert runner.fused_decoder is not None
    if not fused:
        runner.fused_decoder = None
    table = list(range(cache.num_blocks))
    out = []
    for start in range(0, len(prompt), chunk):
        n = min(chunk, len(prompt) - start)
        slots = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        inp = ModelInput(prompt[start:start + n], list(range(start, start + n)), slots, 0, [], [],
                         [(0, n, start + n, table)], [n - 1])
        out.append(runner.execute(inp))
    return torch.cat(out), cache


def _integer_x(kernels, model: TransformerLM, rows: int) -> bool:
    """Whether the kernels round x to int8 for `rows` rows of the model's first quantized linear (then whole and
    chunked prefills agree bit for bit; float x paths, e.g. int4 without SIMD, round with the GEMM's blocking)."""
    from scratchlm.inference.quantization.build import INTEGER_PATHS
    from scratchlm.inference.runner import _linear_tensors

    q = model.layers[0].attn.q_proj
    tensors, group = _linear_tensors(q)
    return kernels.quant_resolved_path(tensors, group, q.d_in, rows, -1) in INTEGER_PATHS


@pytest.mark.parametrize("scheme", ["int4-g32-asym", "int8"])
def test_quantized_prefill_fused_and_chunked_consistent(kernels, scheme: str) -> None:
    """A 100-token prompt prefilled in one chunk (100 rows > 64: the integer panel kernels) or in chunks of 40 (the
    8-row integer decode kernels): the fused step and the unfused path give the same bits either way. Whole and
    chunked agree bit for bit too (the panel kernels round x as the 8-row kernels do, and every prefill row attends
    through the paged kernel; int8 where this CPU has its integer kernels, VNNI), and with float activations to
    float32 summation order."""
    from scratchlm.inference.quantization import kernels as qkernels
    from scratchlm.inference.quantization import quantize_model

    model = quantize_model(_model("half", False), scheme)
    use_skinny_linears(model)
    prompt = [random.Random(7).randrange(model.config.vocab_size) for _ in range(100)]
    previous = qkernels.float_activations()
    try:
        for float_act in (False, True):
            qkernels.float_activations(float_act)
            runs = {}
            for chunk in (100, 40):
                (got, got_cache), (want, want_cache) = (_prefill_logits(model, prompt, chunk, f) for f in (True, False))
                assert torch.equal(got, want) and torch.equal(got_cache.k, want_cache.k), (chunk, float_act)
                runs[chunk] = got[-1], got_cache
            (whole, whole_cache), (chunked, chunked_cache) = runs[100], runs[40]
            if not float_act and all(_integer_x(kernels, model, rows) for rows in (40, 100)):
                assert torch.equal(whole, chunked) and torch.equal(whole_cache.k, chunked_cache.k)
                continue
            # of the largest value; measured: float x 3.5e-7 (K 5.7e-7); int8 without VNNI: float kernels too
            tol = 1e-5
            assert float((whole - chunked).abs().max()) <= tol * float(whole.abs().max()), float_act
            torch.testing.assert_close(whole_cache.k, chunked_cache.k, atol=tol * float(whole_cache.k.abs().max()),
                                       rtol=0)
    finally:
        qkernels.float_activations(previous)
