"""The fused C++ step (csrc/decoder.h) on every model family, and the paged attention kernel's window and soft-cap.

For each case of tests/model/families/tiny.py (a tiny random HF checkpoint per family), loaded by scratchlm:

- the engine takes the fused step (`runner.fused_decoder is not None`: `fused_step_unsupported` is empty);
- a runner stepping two sequences through a prefill, a mixed step (a decode row beside a prefill chunk), a second
  chunk and decode rows gives HF's logits for every row within 1e-4, HF stepping each sequence alone through
  the same chunks with its KV cache (its prompts are longer than the tiny sliding windows, 6 and 8 tokens); the
  Python step (the engine's unfused path, engine_ops.py) gives the same bits where both compute RoPE alike;
- the engine's greedy ids equal HF `generate(do_sample=False)` for 16 new tokens, with a request added while
  others decode (mixed decode + prefill steps).

And the kernel (`paged_decode_attention`, csrc/paged_attention.h) against the torch reference
`scratchlm.model.layers.spec_attention` with sliding windows and soft-caps, decode rows and prefill tiles,
AVX-512 and AVX2: within float32 rounding, a row alone equal bit for bit to the same row inside its tile.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from scratchlm.inference.attention import load_kernels
from scratchlm.inference.kv_cache import KVCache
from scratchlm.inference.runner import ModelInput, ModelRunner, fused_step_unsupported
from scratchlm.model.layers import AttentionSpec, spec_attention
from scratchlm.model.loading import load
from tests.inference.helpers import greedy, make_engine, random_paged_cache, run_all
from tests.model.families.tiny import FAMILIES, save_tiny

BS = 4  # KV block size: the tiny windows (6, 8) span block edges


@pytest.fixture(scope="module")
def ext():
    if os.environ.get("SCRATCHLM_QUANT_NO_EXTENSION") == "1":
        pytest.skip("C++ extensions turned off (SCRATCHLM_QUANT_NO_EXTENSION=1)")
    kernels = load_kernels()
    assert kernels is not None, "the C++ engine kernels failed to build: this test checks them"
    return kernels


@pytest.fixture(scope="module")
def family(tmp_path_factory, request):
    """(HF model, scratchlm model, config) of one tiny family checkpoint."""
    name = request.param
    path = tmp_path_factory.mktemp(name)
    hf = save_tiny(name, path)
    loaded = load(path)
    return hf, loaded.model.eval(), loaded.config


def _hf_steps(hf, chunks: list[list[int]]) -> list[torch.Tensor]:
    """HF's logits (len(chunk), vocab) of each chunk of one sequence, fed one after another with its KV cache."""
    out, cache = [], None
    with torch.no_grad():
        for chunk in chunks:
            r = hf(input_ids=torch.tensor([chunk]), cache=cache, use_cache=True)
            out.append(r.logits[0].float())
            cache = r.past_key_values
    return out


def _run_steps(model, steps, fused: bool) -> list[torch.Tensor]:
    """Run `steps` (each a list of (sequence, start, tokens)) through a ModelRunner, every row's logits returned;
    sequences 0 and 1 on their own blocks. Returns per step (rows, vocab)."""
    c = model.config
    cache = KVCache.allocate(c.n_layers, 24, BS, c.n_kv_heads, c.head_dim, torch.float32, "cpu")
    runner = ModelRunner(model, cache)
    assert runner.fused_decoder is not None, fused_step_unsupported(c)
    if not fused:
        runner.fused_decoder = None
    blocks = {0: list(range(0, 12)), 1: list(range(12, 24))}
    out = []
    for step in steps:
        step = sorted(step, key=lambda e: len(e[2]) != 1)  # decode rows first
        ids, pos, slots, dec_tables, dec_lens, prefills = [], [], [], [], [], []
        for seq, start, tokens in step:
            table, n = blocks[seq], len(tokens)
            if n == 1:
                dec_tables.append(table)
                dec_lens.append(start + 1)
            else:
                prefills.append((len(ids), n, start + n, table))
            ids += tokens
            pos += range(start, start + n)
            slots += [table[p // BS] * BS + p % BS for p in range(start, start + n)]
        inp = ModelInput(ids, pos, slots, len(dec_tables), dec_tables, dec_lens, prefills, list(range(len(ids))))
        out.append(runner.execute(inp))
    return out


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_fused_step_matches_hf(ext, family) -> None:
    """Prefill, a decode row beside a prefill chunk, a second chunk, decode rows: every row's logits within 1e-4 of
    HF's; the Python step gives the same bits (both compute a length-dependent RoPE's frequencies per row, from
    each sequence's own length: runner._rope_lengths)."""
    hf, model, cfg = family
    a, b = _prompt(1, 10, cfg.vocab_size), _prompt(2, 16, cfg.vocab_size)
    xa, yb = _prompt(3, 3, cfg.vocab_size), _prompt(4, 1, cfg.vocab_size)
    steps = [[(0, 0, a)],
             [(0, 10, xa[:1]), (1, 0, b[:9])],
             [(0, 11, xa[1:2]), (1, 9, b[9:])],
             [(0, 12, xa[2:]), (1, 16, yb)]]
    want_a = _hf_steps(hf, [a, xa[:1], xa[1:2], xa[2:]])
    want_b = _hf_steps(hf, [b[:9], b[9:], yb])
    want = [want_a[0], torch.cat([want_a[1], want_b[0]]), torch.cat([want_a[2], want_b[1]]),
            torch.cat([want_a[3], want_b[2]])]
    got = _run_steps(model, steps, fused=True)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"step {i}: {m}")
    python = _run_steps(model, steps, fused=False)
    for i, (g, p) in enumerate(zip(got, python, strict=True)):
        assert torch.equal(g, p), f"step {i}: fused != Python step"


@pytest.mark.parametrize("family", list(FAMILIES), indirect=True)
def test_engine_greedy_matches_hf_generate(ext, family) -> None:
    """The engine's greedy ids (fused step; a request joins while two decode) equal HF generate's, 16 tokens."""
    hf, model, cfg = family
    prompts = [_prompt(10 + i, n, cfg.vocab_size) for i, n in enumerate((5, 13, 21))]
    engine = make_engine(model, cfg, num_blocks=48, block_size=BS, max_num_seqs=4, max_model_len=48)
    assert engine.runner.fused_decoder is not None
    engine.add_request("0", prompts[0], greedy(16))
    engine.add_request("1", prompts[1], greedy(16))
    out = {}
    for _ in range(3):  # the first two decode before the third arrives: its prefill shares steps with decodes
        for r in engine.step():
            assert not r.finished
    engine.add_request("2", prompts[2], greedy(16))
    out = run_all(engine)
    hf.generation_config.eos_token_id = None  # 16 tokens, as the engine's ignore_eos requests
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ids = hf.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False, pad_token_id=0)[0, len(p):]
            assert out[str(i)] == ids.tolist(), f"request {i}"


def test_no_family_left_to_the_python_step() -> None:
    """Every family's features are the fused step's (`fused_step_unsupported` empty)."""
    from scratchlm.model.families import config_from_hf

    for name, make in FAMILIES.items():
        assert fused_step_unsupported(config_from_hf(make().to_dict())) == [], name


# ---------------------------------------------------------------------------------------------- kernel: window, cap

def _rows(seqs, bs: int, num_blocks: int, gen: torch.Generator):
    """Rows of a step: per (prefix, rows) sequence, rows with context lengths prefix + 1 .. prefix + rows (one row:
    a decode row) on the sequence's own random blocks -> tables (N, width), lens (N,), [(table, first row)]."""
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-(p + n) // bs) for p, n in seqs)
    tables, lens, layout = [], [], []
    for prefix, n in seqs:
        table = [perm.pop() for _ in range(-(-(prefix + n) // bs))]
        layout.append((table, len(lens), prefix, n))
        for j in range(n):
            tables.append(table + [0] * (width - len(table)))
            lens.append(prefix + j + 1)
    return torch.tensor(tables), torch.tensor(lens), layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("d", [16, 64, 128])  # 16: the portable path; 64, 128: AVX-512 / AVX2
@pytest.mark.parametrize("window,softcap", [(5, None), (16, None), (37, 3.0), (None, 3.0)])
def test_kernel_window_softcap_match_spec_attention(ext, dtype, d: int, window, softcap) -> None:
    """Decode rows (short and long contexts) and a prefill chunk over a cached prefix, against spec_attention in
    float64 on the cache's values; AVX-512 and AVX2, row kernel and tile kernel (bit-equal), a row alone equal to
    the same row inside its chunk."""
    h, hkv, bs, num_blocks = 8, 2, 16, 24
    gen = torch.Generator().manual_seed(d + (window or 0))
    k_cache, v_cache, scales, (k64, v64) = random_paged_cache(ext, dtype, num_blocks, bs, hkv, d, gen)
    tables, lens, layout = _rows([(2, 1), (39, 1), (20, 45), (69, 1)], bs, num_blocks, gen)
    q = torch.randn(len(lens), h, d, generator=gen) * 2
    spec = AttentionSpec(1.3 * d ** -0.5, softcap, window)
    want = torch.empty(q.shape, dtype=torch.float64)
    for table, first, prefix, n in layout:
        keys = k64[table].reshape(-1, hkv, d)[: prefix + n][None]  # (1, S, Hkv, D)
        values = v64[table].reshape(-1, hkv, d)[: prefix + n][None]
        want[first : first + n] = spec_attention(q[first : first + n][None].double(), keys, values, spec, prefix)[0]
    old = ext.set_decode_rows(-1)
    try:
        for avx512 in (True, False):
            outs = []
            for rows in (1, 0):
                ext.set_decode_rows(rows)
                outs.append(ext.paged_decode_attention(q, k_cache, v_cache, tables, lens, spec.scale, True, *scales,
                                                       avx512=avx512, softcap=softcap or 0.0, window=window or 0))
                torch.testing.assert_close(outs[-1].double(), want, atol=2e-5, rtol=1e-5,
                                           msg=lambda m, a=avx512, r=rows: f"avx512 {a}, rows {r}: {m}")
            assert torch.equal(outs[0], outs[1]), f"row kernel != tile kernel (avx512 {avx512})"
            alone = ext.paged_decode_attention(q[2 + 30 : 2 + 31], k_cache, v_cache, tables[32:33], lens[32:33],
                                               spec.scale, True, *scales, avx512=avx512, softcap=softcap or 0.0,
                                               window=window or 0)
            assert torch.equal(alone[0], outs[0][32]), f"a chunk's row alone != inside its tile (avx512 {avx512})"
    finally:
        ext.set_decode_rows(int(old))


def test_kernel_rejects_negative_window(ext) -> None:
    k = torch.zeros(2, 4, 1, 16)
    with pytest.raises(RuntimeError, match="softcap and window must be >= 0"):
        ext.paged_decode_attention(torch.zeros(1, 1, 16), k, k, torch.zeros(1, 1, dtype=torch.long),
                                   torch.ones(1, dtype=torch.long), 0.25, window=-1)
