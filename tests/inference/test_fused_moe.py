"""The fused C++ step's mixture-of-experts feed-forward (csrc/moe.h) against the Python model (model/moe.py).

Tiny MoE configs (ModelConfig with MoEFeatures, random weights) covering each router: softmax + renormalised top-k
(Mixtral, Qwen3-MoE), softmax without renormalisation plus a gated shared expert (Qwen2-MoE), sigmoid + score bias
+ top-2 groups + routed scale + shared expert + a dense first layer (DeepSeek-V3), softmax + max groups (V2):

- `MoELayer` alone equals a plain (unswapped) `MoE` within 1e-5 for batches where several tokens pick the same
  expert (repeated rows), where most experts get no token, and for one token;
- the runner's fused step gives the Python step's logits within 1e-4 over a prefill, a mixed decode + prefill
  step and decode rows; the engine's greedy ids with and without the fused step equal a plain model's
  (recomputing the whole sequence, no engine kernels);
- the tiny HF MoE checkpoints of tests/model/families/tiny.py (`MOE_FAMILIES`) through the fused step: HF's logits
  within 1e-4; a Q8_0 GGUF (llama.cpp's converter) with its stacked experts kept packed: the Python step's;
- int8 and int4 experts (`quantize_model`): the router stays float32; the fused step equals the Python step of
  the quantized model within 1e-4, greedy ids equal; the int8 model agrees with float32 on the top-1 token at
  91 of 96 teacher-forced positions (stated in docs/moe.md);
- h rounded to int8 once per layer and gathered per expert (the default) is bit-equal to each expert's GEMMs
  rounding their rows themselves (`round_once=False`), for raw K-quant, int8 and int4 experts.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from scratchlm.inference.cpp_extensions import load_engine_kernels
from scratchlm.inference.fast_linear import use_skinny_linears
from scratchlm.inference.kv_cache import KVCache
from scratchlm.inference.quantization import quantize_model
from scratchlm.inference.runner import ModelInput, ModelRunner, _moe_layer, fused_step_unsupported
from scratchlm.model import ModelConfig, TransformerLM
from scratchlm.model.config import MoEFeatures
from scratchlm.model.layers import Linear
from scratchlm.model.loading import load
from scratchlm.model.moe import MoE
from tests.inference.helpers import greedy, make_engine, naive_greedy, run_all
from tests.inference.test_fused_families import _hf_steps
from tests.model.families.tiny import MOE_FAMILIES, save_tiny

BS = 4  # KV block size

ROUTERS = {
    "mixtral": MoEFeatures(n_experts=8, top_k=2, d_expert=32),
    "qwen2moe": MoEFeatures(n_experts=8, top_k=3, d_expert=32, norm_topk=False, d_shared=64, shared_gate=True),
    "deepseek_v3": MoEFeatures(n_experts=8, top_k=3, d_expert=32, scoring="sigmoid", score_bias=True, n_groups=4,
                               topk_groups=2, group_score="top2", routed_scale=2.5, d_shared=32, dense_layers=[0]),
    "deepseek_v2": MoEFeatures(n_experts=8, top_k=2, d_expert=32, norm_topk=False, n_groups=4, topk_groups=2,
                               routed_scale=1.5, d_shared=32),
}


@pytest.fixture(scope="module")
def ext():
    kernels = load_engine_kernels()
    if kernels is None:
        pytest.skip("the engine's C++ kernels could not be built here (the Python path is used instead)")
    return kernels


def moe_model(router: str, seed: int = 0, vocab: int = 64) -> TransformerLM:
    """A 3-layer MoE model with random weights: non-trivial norms, a score bias that changes choices."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=128,
                      moe=copy.deepcopy(ROUTERS[router]))
    model = TransformerLM(cfg).eval()
    with torch.no_grad():
        model.tok_embeddings.weight.mul_(4.0)  # sharper logits: greedy ties are rare
        for name, p in model.named_parameters():
            if p.dim() == 1 and "score_bias" not in name:
                p.normal_(1.0, 0.2)
        for m in model.modules():
            if isinstance(m, MoE):
                m.gate.weight.mul_(8.0)  # router logits of a few units, as trained routers have
                if m.score_bias is not None:
                    m.score_bias.normal_(0.0, 0.3)
    return model


def _moe_layers(model: TransformerLM) -> list[int]:
    return [i for i, b in enumerate(model.layers) if isinstance(b.ffn, MoE)]


@pytest.mark.parametrize("router", list(ROUTERS))
@pytest.mark.parametrize("rows", ["one", "repeats", "few_experts", "many"])
def test_moe_layer_matches_python(ext, router: str, rows: str) -> None:
    """MoELayer (the fused step's MoE) on the engine's packed weights = the plain model's MoE."""
    plain = moe_model(router)
    engine = copy.deepcopy(plain)
    use_skinny_linears(engine)
    i = _moe_layers(plain)[-1]
    layer = _moe_layer(ext, engine.layers[i].ffn, engine.config)
    assert layer is not None
    g = torch.Generator().manual_seed(7)
    d = plain.config.d_model
    h = {"one": torch.randn(1, d, generator=g),
         "repeats": torch.randn(3, d, generator=g).repeat(5, 1),  # 15 rows, 3 distinct: experts with 5+ tokens
         "few_experts": torch.randn(1, d, generator=g).repeat(6, 1),  # every token the same top_k experts
         "many": torch.randn(70, d, generator=g)}[rows]  # more rows than the skinny kernels' 64
    with torch.inference_mode():
        want = plain.layers[i].ffn(h)
        got = layer.forward(h)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if rows == "few_experts":
        _, ids = plain.layers[i].ffn.route(h)
        assert len(set(ids.flatten().tolist())) == plain.config.moe.top_k  # the others got no token


def test_router_ties_as_torch_topk(ext) -> None:
    """Three experts tie for two places: the fused step picks the two torch.topk (model/moe.py, HF) picks. (Not
    the lower ids: torch.topk on the CPU leaves ties to libstdc++'s nth_element; here it picks 6 and 5.)"""
    plain = moe_model("mixtral")
    i = _moe_layers(plain)[0]
    with torch.no_grad():
        w = plain.layers[i].ffn.gate.weight
        w[3] = w[5] = w[6] = 10.0 * w[0].sign()  # experts 3, 5, 6 tie and beat the rest on h = sign(w0)
    engine = copy.deepcopy(plain)
    use_skinny_linears(engine)
    layer = _moe_layer(ext, engine.layers[i].ffn, engine.config)
    h = plain.layers[i].ffn.gate.weight[0].sign()[None].clone()  # (1, d)
    with torch.inference_mode():
        _, ids = plain.layers[i].ffn.route(h)
        assert sorted(ids[0].tolist()) != [3, 5]  # not the lower ids: the case the test is for
        torch.testing.assert_close(layer.forward(h), plain.layers[i].ffn(h), atol=1e-5, rtol=1e-5)


def _prompt(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


def _run_steps(model, steps, fused: bool) -> list[torch.Tensor]:
    """Run `steps` (each a list of (sequence, start, tokens)) through a ModelRunner; every row's logits."""
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


def _steps(vocab: int):
    a, b, xa, yb = _prompt(1, 10, vocab), _prompt(2, 16, vocab), _prompt(3, 3, vocab), _prompt(4, 1, vocab)
    return [[(0, 0, a)], [(0, 10, xa[:1]), (1, 0, b[:9])], [(0, 11, xa[1:2]), (1, 9, b[9:])],
            [(0, 12, xa[2:]), (1, 16, yb)]]


def _fused_equals_python(model) -> None:
    steps = _steps(model.config.vocab_size)
    got = _run_steps(copy.deepcopy(model), steps, fused=True)
    want = _run_steps(copy.deepcopy(model), steps, fused=False)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"step {i}: {m}")


def _engine_greedy(model, fused: bool, n: int = 12) -> dict[str, list[int]]:
    cfg = model.config
    engine = make_engine(copy.deepcopy(model), cfg, num_blocks=48, block_size=BS)
    assert (engine.runner.fused_decoder is not None) or not fused
    if not fused:
        engine.runner.fused_decoder = None
    for i in range(4):
        engine.add_request(f"r{i}", _prompt(10 + i, 5 + 4 * i, cfg.vocab_size), greedy(n))
    return run_all(engine)


@pytest.mark.parametrize("router", list(ROUTERS))
def test_fused_step_matches_python_step(ext, router: str) -> None:
    """Prefill, a decode row beside a prefill chunk, decode rows: the fused step's logits = the Python step's."""
    _fused_equals_python(moe_model(router))


@pytest.mark.parametrize("router", ["mixtral", "deepseek_v3"])
def test_engine_greedy_ids(ext, router: str) -> None:
    """Four requests decoding together (several tokens per expert in a step): the fused and the Python step give
    the ids a plain model gives recomputing each whole sequence."""
    model = moe_model(router)
    fused, python = _engine_greedy(model, True), _engine_greedy(model, False)
    assert fused == python
    for i in range(4):
        prompt = _prompt(10 + i, 5 + 4 * i, model.config.vocab_size)
        assert fused[f"r{i}"] == naive_greedy(model, prompt, 12)


@pytest.mark.parametrize("name", sorted(MOE_FAMILIES))
def test_hf_moe_families(ext, name: str, tmp_path) -> None:
    """Each tiny HF MoE checkpoint (Mixtral, Qwen2-MoE with its gated shared expert, Qwen3-MoE; dense layers
    between sparse ones), loaded by scratchlm: the fused step's logits are HF's within 1e-4 (HF stepping each
    sequence alone through the same chunks) and the Python step's within 1e-4."""
    hf = save_tiny(name, tmp_path)
    model = load(tmp_path).model.eval()
    vocab = model.config.vocab_size
    a, b, xa, yb = _prompt(1, 10, vocab), _prompt(2, 16, vocab), _prompt(3, 3, vocab), _prompt(4, 1, vocab)
    want_a = _hf_steps(hf, [a, xa[:1], xa[1:2], xa[2:]])
    want_b = _hf_steps(hf, [b[:9], b[9:], yb])
    want = [want_a[0], torch.cat([want_a[1], want_b[0]]), torch.cat([want_a[2], want_b[1]]),
            torch.cat([want_a[3], want_b[2]])]
    steps = _steps(vocab)
    got = _run_steps(copy.deepcopy(model), steps, fused=True)
    python = _run_steps(copy.deepcopy(model), steps, fused=False)
    for i, (g, p, w) in enumerate(zip(got, python, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"step {i} vs HF: {m}")
        torch.testing.assert_close(g, p, atol=1e-4, rtol=1e-4, msg=lambda m, i=i: f"step {i} vs Python: {m}")


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_experts(ext, scheme: str) -> None:
    """int8 / int4 experts, float32 router: the fused step = the Python step of the quantized model."""
    model = moe_model("qwen2moe")
    q = quantize_model(model, scheme)
    for i in _moe_layers(q):
        ffn = q.layers[i].ffn
        assert type(ffn.gate) is Linear and type(ffn.shared_gate) is Linear  # the router stays float32
        assert type(ffn.experts[0].w1) is not Linear and type(ffn.shared.w2) is not Linear
    _fused_equals_python(q)
    assert _engine_greedy(q, True) == _engine_greedy(q, False)


def test_int8_experts_top1_agreement(ext) -> None:
    """`--quantization int8` (experts, attention and head int8, the router float32) against float32: the top-1
    token at 96 teacher-forced positions (2 sequences of 48) of the random model: 91 / 96 (94.8 %) here; a random
    model's logits are nearly flat, so this is a floor for what a trained model shows."""
    model = moe_model("mixtral", seed=3)
    q = quantize_model(model, "int8")
    tokens = torch.tensor([_prompt(20, 48, 64), _prompt(21, 48, 64)])
    with torch.inference_mode():
        want = model(tokens).argmax(-1)
        got = q(tokens).argmax(-1)
    agree = (got == want).float().mean().item()
    assert agree >= 0.9, f"int8 experts agree with float32 on {agree:.1%} of top-1 tokens"


@pytest.fixture(scope="module")
def q8_0_gguf(tmp_path_factory):
    """A tiny all-sparse Qwen2-MoE (shared expert behind its gate) converted to Q8_0 GGUF by llama.cpp's own
    converter: stacked `ffn_*_exps` experts."""
    from tests.model.families import gguf_convert

    if gguf_convert.convert_dir() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is missing: no llama-cpp-python sdist in .peers/")
    root = tmp_path_factory.mktemp("fused_moe_gguf")
    name = "qwen2_moe_sparse"
    hf = save_tiny(name, root / name)
    kind = gguf_convert.write_tokenizer(name, root / name, hf.config.vocab_size)
    out = root / f"{name}.q8_0.gguf"
    gguf_convert.convert([{"dir": str(root / name), "out": str(out), "outtype": "q8_0",
                           "bpe_pre": gguf_convert.BPE_PRE if kind == "bpe" else None}])
    return out


def test_gguf_packed_experts(ext, q8_0_gguf) -> None:
    """Q8_0 experts kept packed (`load_gguf_packed`: each expert an int8 view of the stacked `ffn_*_exps`
    buffer): the fused step reads them in place and gives the Python step's logits within 1e-4."""
    from scratchlm.inference.quantization import load_gguf_packed

    model = load_gguf_packed(q8_0_gguf).model.eval()
    experts = model.layers[0].ffn.experts
    assert experts[0].w1.qweight.untyped_storage().data_ptr() == experts[1].w1.qweight.untyped_storage().data_ptr()
    _fused_equals_python(model)


def _expert_tensors(fmt: str, n: int, k: int, g: torch.Generator) -> tuple[list[torch.Tensor], int]:
    """One linear (n, k) of `fmt` as MoELayer takes it (qlinear.h's forms) and its group size: raw K-quant blocks
    (random codes, finite fp16 scales: tests/inference/quantization/test_gguf_kquants.py's `random_blocks`) or
    int8 / int4 planes with random codes and scales."""
    if fmt in ("Q4_K", "Q5_K", "Q6_K"):
        from tests.inference.quantization.test_gguf_kquants import TYPES, random_blocks

        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=g))
        return [torch.from_numpy(random_blocks(fmt, n, k, seed))], -int(TYPES[fmt])
    gs = {"int8_row": k, "int8_g32": 32, "int4_g32": 32, "int4_sym_g64": 64}[fmt]
    groups = k // gs
    if fmt.startswith("int8"):
        q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        return [q, torch.rand(n, groups, generator=g) * 1e-2 + 1e-3], gs
    q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8)
    d = (torch.rand(n, groups, generator=g) * 1e-2 + 1e-3).half()
    return ([q, d, (-8 * d.float()).half()] if fmt == "int4_g32" else [q, d]), gs


@pytest.mark.parametrize("fmt", ["Q4_K", "Q5_K", "int8_row", "int8_g32", "int4_g32", "int4_sym_g64"])
def test_rounding_h_once_equals_per_expert(ext, fmt: str) -> None:
    """The MoE step rounds h to int8 once per layer and gathers each expert's rows of it (`round_once`, moe.h):
    outputs bit-equal (torch.equal) to each expert's GEMMs rounding their gathered float rows themselves, for raw
    K-quant experts (Q4_K / Q5_K gate and up, Q6_K down as llama.cpp's Q4_K_M) and int8 / int4 planes (Q8_0 is
    int8 per 32), at 1 row, a decode batch and a prefill chunk (> 64 rows: the panel kernels), SIMD and portable
    paths. (Each path's values against float oracles: the kernel tests and the fused-step tests above.)"""
    if fmt.endswith("_K"):
        pytest.importorskip("gguf")
    g = torch.Generator().manual_seed(11)
    E, top_k, d, de = 8, 4, 256, 256  # K-quants: K a multiple of 256
    down = "Q6_K" if fmt.endswith("_K") else fmt
    experts, gs = [], []
    for _ in range(E):
        lins = [_expert_tensors(fmt, de, d, g), _expert_tensors(down, d, de, g), _expert_tensors(fmt, de, d, g)]
        experts.append([t for t, _ in lins])
        gs.append([s for _, s in lins])
    values = {"n_experts": E, "top_k": top_k, "d_model": d, "d_expert": de, "d_shared": 0, "scoring": 0,
              "norm_topk": 1.0, "routed_scale": 1.0, "n_groups": 1, "topk_groups": 1, "group_score": 0, "act": 0}
    gate = torch.randn(E, d, generator=g)
    layer = ext.MoELayer([gate], 0, experts, gs, [], [], [], None, values)
    for rows in (1, 24, 70):
        h = torch.randn(rows, d, generator=g)
        for simd in (True, False):
            want = layer.forward(h, simd, round_once=False)
            got = layer.forward(h, simd, round_once=True)
            assert torch.isfinite(want).all() and want.abs().max() > 0
            assert torch.equal(got, want), (fmt, rows, simd, (got - want).abs().max().item())
