"""gpt-oss (HF `GptOssForCausalLM`) exact against transformers on a tiny random checkpoint of its own config class:
four layers with alternating sliding windows (window 6, prompts longer), attention sinks, q/k/v/o biases, YaRN
without truncation, six experts with biases, top-2 of the router's biased logits softmaxed, the clamped SwiGLU
(limit lowered to 1.5 so the clamps act on these activations).

HF's logits within 1e-4 (HF safetensors as transformers' save_pretrained writes them), `scratchlm.model.generate`
and `scratchlm.LLM` (the engine's Python step: paged attention with the sinks, prefill in chunks over a cached
prefix) greedy ids equal to HF `generate`, the export loads in transformers with equal logits, the config round
trip, and the pieces against HF's own modules: the router, YaRN with truncate false.
"""

from __future__ import annotations

import functools
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from scratchlm.model import families, load
from scratchlm.model.families.gpt_oss import ARCH
from scratchlm.model.loading import export_hf
from scratchlm.model.transformer import TransformerLM

PROMPTS = [[5, 17, 3, 99, 42, 7, 150, 8, 23, 61, 2, 77, 9, 31, 44, 12, 100, 6, 59], [11, 4, 120],
           [90, 91, 92, 93, 94, 95, 96, 97, 98, 1, 2, 3]]
NEW_TOKENS = 12


def _hf_config(swiglu_limit: float = 1.5):
    from transformers import GptOssConfig

    return GptOssConfig(vocab_size=160, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=6,
                        num_experts_per_tok=2, sliding_window=6, max_position_embeddings=256,
                        swiglu_limit=swiglu_limit)


@functools.cache
def _checkpoint(root: str, swiglu_limit: float = 1.5):
    """The HF model (seeded, weights scaled so routing, sinks, clamps and biases all matter) and its directory."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(_hf_config(swiglu_limit), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(torch.randn_like(p) * 0.5)
            elif "embed" in name:
                p.normal_(0.0, 0.5)
            elif "experts" in name or "router" in name:
                p.normal_(0.0, 0.2)
            elif "self_attn" in name:
                p.normal_(0.0, 0.15)
    directory = Path(root) / f"gpt_oss_{swiglu_limit}"
    hf.save_pretrained(directory)
    return directory, hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return _checkpoint(str(tmp_path_factory.mktemp("gpt_oss")))


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def test_hf_load_logits(checkpoint):
    directory, hf = checkpoint
    loaded = load(directory)
    c = loaded.config
    assert c.attn.sinks and c.attn.sliding_layers == [0, 2] and c.attn.sliding_window == 6
    assert c.moe.scoring == "topk_softmax" and c.moe.router_bias and c.mlp.bias and c.mlp.swiglu_limit == 1.5
    assert c.rope.scaling == "yarn" and not c.rope.truncate
    assert loaded.model.layers[0].attn.sinks.abs().min() > 0
    ids = torch.randint(0, 160, (2, 40), generator=torch.Generator().manual_seed(1))
    want = hf(ids).logits
    assert (loaded.model(ids) - want).abs().max().item() < 1e-4


def test_generate_equals_hf_generate(checkpoint):
    from scratchlm.model.generate import generate

    directory, hf = checkpoint
    model = load(directory).model
    for p in PROMPTS:
        assert generate(model, p, NEW_TOKENS) == _hf_greedy(hf, p), p


def test_llm_greedy_equals_hf_generate(checkpoint):
    """The engine's Python step (the fused C++ step names gpt-oss's features as unsupported): decode through
    PagedAttention's torch ops with the sinks, prompts in chunks of 8 so later chunks read a cached prefix."""
    from scratchlm.inference import LLM, SamplingParams
    from scratchlm.inference.runner import fused_step_unsupported

    directory, hf = checkpoint
    missing = " ".join(fused_step_unsupported(load(directory).config))
    assert all(k in missing for k in ("sinks", "swiglu", "biases", "topk_softmax", "router_bias"))
    with LLM(str(directory), threads=1, block_size=4, kv_cache_memory=8 << 20, max_model_len=64,
             max_num_batched_tokens=8) as llm:
        assert llm.engine.executor.runner.fused_decoder is None
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, p), p


@torch.no_grad()
def test_export_loads_equal_in_transformers(checkpoint, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    directory, hf = checkpoint
    loaded = load(directory)
    out = export_hf(loaded.model, out_dir=tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt_oss"
    with safe_open(out / "model.safetensors", "pt") as f, safe_open(directory / "model.safetensors", "pt") as g:
        names = set(g.keys())
        assert set(f.keys()) == names
        assert all(torch.equal(f.get_tensor(k), g.get_tensor(k)) for k in names)  # the layouts, bit for bit
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])
    assert (back(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
    assert load(out).config == loaded.config


def test_config_round_trip():
    cfg = _hf_config().to_dict()
    family = families.for_hf_config(cfg)
    config = family.config_from_hf(cfg, "gpt_oss")
    assert family.name == "gpt_oss" and family.config_from_hf(family.hf_config(config), "x") == config
    assert families.for_export(config) is family
    # GptOssConfig's defaults when config.json leaves them out: YaRN x32 untruncated, theta 150000, every other layer
    bare = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling", "layer_types")}
    config = family.config_from_hf(bare, "bare")
    assert config.rope_theta == 150_000.0 and config.rope.factor == 32.0 and not config.rope.truncate
    assert config.attn.sliding_layers == [0, 2]


def test_mxfp4_checkpoint_is_an_error():
    cfg = _hf_config().to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    with pytest.raises(families.FamilyError, match="mxfp4"):
        families.config_from_hf(cfg)


@torch.no_grad()
def test_router_equals_hf():
    """Top-k of the biased logits, softmax over the chosen k (HF `GptOssTopKRouter`), ties included."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from scratchlm.model.config import MoEFeatures
    from scratchlm.model.moe import route

    torch.manual_seed(0)
    router = GptOssTopKRouter(_hf_config())
    router.weight.normal_(0.0, 0.5)
    router.bias.normal_(0.0, 0.5)
    x = torch.randn(64, 64)
    x[:4] = 0.0  # logits = the bias alone
    router.bias[1] = router.bias[3] = router.bias.max() + 1  # a tie for the first choice
    _, weights, ids = router(x)
    f = MoEFeatures(n_experts=6, top_k=2, scoring="topk_softmax", norm_topk=False, router_bias=True)
    ours_w, ours_ids = route(x @ router.weight.t(), f, router_bias=router.bias)
    assert torch.equal(ours_ids, ids)
    assert torch.allclose(ours_w, weights, atol=1e-6)


def test_yarn_untruncated_equals_hf():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from scratchlm.model.config import RopeFeatures
    from scratchlm.model.rope import inv_freq

    for truncate in (False, True):
        cfg = _hf_config()
        cfg.rope_parameters = cfg.rope_parameters | {"truncate": truncate}
        want, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
        rope = RopeFeatures(scaling="yarn", factor=32.0, original_max_seq_len=4096, truncate=truncate)
        got, ours_factor = inv_freq(16, 150_000.0, rope)
        assert torch.equal(got, want) and ours_factor == factor


@torch.no_grad()
def test_int8_weights_agree_with_fp32(checkpoint):
    """int8 per-32 groups on every linear but the router (kept float32): logits within 3 % of their spread (measured
    2.6 %), the same top token at most positions (measured: all). Stated agreement, not exactness: where rounding
    moves a token to another expert its logits move further, and later rows attend to it (a 30-token prompt: 35 %
    at the row whose layer-0 choice changed, under 3 % at the rows before the first changed choice)."""
    from scratchlm.inference.quantization import quantize_model

    directory, _ = checkpoint
    model = load(directory).model
    q = quantize_model(model, "int8")
    ids = torch.tensor([PROMPTS[0]])
    fp, qq = model(ids), q(ids)
    assert (qq - fp).abs().max() <= 0.03 * (fp.max() - fp.min())
    assert (qq.argmax(-1) == fp.argmax(-1)).float().mean() >= 0.8


@pytest.mark.distributed
@pytest.mark.parametrize("ep, tp", [(2, 1), (2, 2)], ids=["ep2", "ep2xtp2"])
def test_expert_parallel_equals_hf(checkpoint, ep, tp):
    """EP=2 (3 experts a rank, the router bias replicated, data-parallel attention with the sinks) and EP=2 x TP=2
    (each expert's hidden units and biases b1/b3 split, its output bias on TP rank 0 only, the sinks split by query
    head): every prompt row's logits within 1e-4 of HF, greedy ids equal to HF `generate`."""
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.inference.runner import ModelInput

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    directory, hf = checkpoint
    engine = LLMEngine.from_pretrained(directory, EngineConfig(expert_parallel_size=ep, tensor_parallel_size=tp,
                                                               block_size=4, max_num_seqs=4))
    try:
        prompt = PROMPTS[0]
        n = len(prompt)
        inp = ModelInput(prompt, list(range(n)), list(range(n)), 0, [], [], [(0, n, n, list(range(-(-n // 4))))],
                         list(range(n)))
        got = engine.runner.execute(inp)  # (n, vocab)
        assert (got - hf(torch.tensor([prompt])).logits[0]).abs().max().item() < 1e-4
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, params)
        out = {}
        while engine.has_unfinished_requests():
            for r in engine.step():
                if r.finished:
                    out[int(r.request_id)] = r.outputs[0].token_ids
        assert [out[i] for i in range(len(PROMPTS))] == [_hf_greedy(hf, p) for p in PROMPTS]
    finally:
        engine.runner.shutdown()
        torch.set_num_threads(before)


@functools.cache
def _gguf(root: str) -> Path:
    """llama.cpp's convert_hf_to_gguf.py (F32 `gpt_oss.f32.gguf`, Q8_0 `gpt_oss.q8_0.gguf`) of the checkpoint with
    gpt-oss's own limit 7 (llama.cpp's graph and this reader take the limit as the architecture's: the file does
    not carry it)."""
    from tests.model.families.gguf_convert import BPE_PRE, convert, write_byte_level_bpe

    directory, _ = _checkpoint(root, 7.0)
    write_byte_level_bpe(directory, 160)
    convert([{"dir": str(directory), "out": str(Path(root) / f"gpt_oss.{t}.gguf"), "outtype": t, "bpe_pre": BPE_PRE}
             for t in ("f32", "q8_0")])
    return Path(root) / "gpt_oss.f32.gguf"


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    from tests.model.families.gguf_convert import convert_dir

    if convert_dir() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is not in .peers/")
    root = str(tmp_path_factory.mktemp("gpt_oss_gguf"))
    return _gguf(root), _checkpoint(root, 7.0)[1]


@torch.no_grad()
def test_gguf_logits_and_llm_greedy_equal_hf(gguf_file):
    """The `gpt-oss` GGUF (stacked experts and biases, sinks, router bias; the window pattern, YaRN and SwiGLU
    constants from the arch): logits within 1e-4 of HF, `LLM` greedy ids equal to HF `generate`."""
    from scratchlm.inference import LLM, SamplingParams

    path, hf = gguf_file
    loaded = load(path)
    c = loaded.config
    assert c.attn.sliding_layers == [0, 2] and c.attn.sinks and c.moe.router_bias and c.mlp.swiglu_limit == 7.0
    ids = torch.randint(0, 160, (2, 40), generator=torch.Generator().manual_seed(1))
    assert (loaded.model(ids) - hf(ids).logits).abs().max().item() < 1e-4
    with LLM(str(path), threads=1, block_size=4, kv_cache_memory=8 << 20, max_model_len=64) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, p), p


@torch.no_grad()
def test_gguf_q8_0_packed_experts_agree_with_dequantized(gguf_file):
    """The Q8_0 file loads packed (each expert an int8 linear, a view of the stacked buffer): with float
    activations its logits equal the same file dequantized within 1e-4 and its engine greedy ids are the
    dequantized model's. (Against HF the Q8_0 file's router moves some tokens to other experts.)"""
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.inference.quantization import load_gguf_packed
    from scratchlm.inference.quantization.modules import QuantLinear
    from tests.inference.helpers import CharTokenizer, run_all
    from tests.model.families.test_gguf_families import _float_activations

    path = gguf_file[0].with_name("gpt_oss.q8_0.gguf")
    packed, plain = load_gguf_packed(path), load(path)
    assert packed.config == plain.config
    experts = packed.model.layers[0].ffn.experts
    assert all(type(e.w1) is QuantLinear and e.w1.fmt.bits == 8 and e.b1 is not None for e in experts)
    ids = torch.randint(0, 160, (2, 24), generator=torch.Generator().manual_seed(2))
    want = plain.model(ids)
    prompt = [5, 17, 3, 99, 42, 7, 150, 8]
    greedy = list(prompt)
    for _ in range(10):
        greedy.append(int(plain.model(torch.tensor([greedy]))[0, -1].argmax()))
    with _float_activations():
        assert (packed.model(ids) - want).abs().max().item() < 1e-4
        engine = LLMEngine(packed.model, CharTokenizer(packed.config.vocab_size), packed.config,
                           EngineConfig(block_size=4, kv_cache_memory=8 << 20, max_model_len=64))
        engine.add_request("0", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        assert run_all(engine)["0"] == greedy[len(prompt):]


@torch.no_grad()
def test_llamacpp_logits_equal_ours(gguf_file):
    """llama.cpp (built by benchmarks/llamacpp_decode.py --setup-peers) on the same F32 GGUF, its own gpt-oss graph
    (sinks, SWIGLU_OAI, softmax over the top-k logits, windows): logits equal ours within 2e-4 of the largest
    (measured 1.1e-6) once our YaRN ramp is rounded as ggml's `rope_yarn_corr_dims` rounds it (rope.truncate True).
    gpt-oss's own YaRN (HF, truncate false: what this family reads) is 2.4e-3 away from llama.cpp here, of logits
    up to 0.7: llama.cpp does not follow the untruncated ramp."""
    import os
    import subprocess

    from benchmarks.llamacpp_decode import LIB_DIR, VENV
    from tests.model.families.test_gguf_families import LLAMA_CPP

    python = VENV / "bin" / "python"
    if not (python.exists() and LIB_DIR.exists()):
        pytest.skip("llama.cpp is not built in .peers/ (python -m benchmarks.llamacpp_decode --setup-peers)")
    path = gguf_file[0]
    ids = [5, 17, 3, 99, 42, 7, 150, 8, 23, 61, 2, 77]
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(LIB_DIR))
    proc = subprocess.run([str(python), "-c", LLAMA_CPP, str(path), json.dumps(ids)], capture_output=True,
                          text=True, env=env, timeout=120, check=True)
    theirs = torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1]))
    loaded = load(path)
    c = loaded.config
    rounded = TransformerLM(replace(c, rope=replace(c.rope, truncate=True)))
    rounded.load_state_dict(loaded.model.state_dict())
    for model, name in ((rounded, "YaRN ramp rounded"), (loaded.model, "gpt-oss YaRN")):
        err = (model(torch.tensor([ids]))[0] - theirs).abs().max().item()
        print(f"gpt-oss, {name}: max |ours - llama.cpp| {err:.2e} of logits up to {theirs.abs().max().item():.2f}")
    assert (rounded(torch.tensor([ids]))[0] - theirs).abs().max().item() < 2e-4 * max(1.0, theirs.abs().max().item())


def _mxfp4_copy(src: Path, dst: Path) -> dict[str, np.ndarray]:
    """`src` rewritten with its stacked expert weights in MXFP4 where a row holds whole 32-blocks (gate and up here;
    the Hub's gpt-oss GGUFs keep all of them so), quantized by gguf-py; returns gguf-py's dequantization of each."""
    import gguf
    from gguf import quants

    reader, writer = gguf.GGUFReader(src), gguf.GGUFWriter(dst, ARCH)
    for f in reader.fields.values():
        if f.name != gguf.Keys.General.ARCHITECTURE and not f.name.startswith("GGUF."):
            kind = f.types[0]
            writer.add_key_value(f.name, f.contents(), kind,
                                 sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    dequantized = {}
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name.endswith("_exps.weight") and data.shape[-1] % 32 == 0:
            q = quants.quantize(data.astype(np.float32), gguf.GGMLQuantizationType.MXFP4)
            dequantized[t.name] = quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        else:
            writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dequantized


@torch.no_grad()
def test_gguf_mxfp4_experts_load_dequantized(gguf_file, tmp_path):
    """MXFP4 experts (the format of the published gpt-oss GGUFs): the reader dequantizes them to exactly gguf-py's
    values (an independent implementation); the packed loader names MXFP4 as a type it cannot keep packed."""
    from scratchlm.inference.quantization import load_gguf_packed
    from scratchlm.model.loading.common import CheckpointError

    path = tmp_path / "mxfp4.gguf"
    dequantized = _mxfp4_copy(gguf_file[0], path)
    assert len(dequantized) == 8  # gate and up of 4 layers (down's rows are 48 wide)
    loaded = load(path)
    state = load(gguf_file[0]).model.state_dict()
    for name, stacked in dequantized.items():
        layer, kind = name.split(".")[1:3]
        w = {"ffn_gate_exps": "w1", "ffn_up_exps": "w3"}[kind]
        for e in range(stacked.shape[0]):
            state[f"layers.{layer}.ffn.experts.{e}.{w}.weight"] = torch.from_numpy(np.ascontiguousarray(stacked[e]))
    assert all(torch.equal(v, state[k]) for k, v in loaded.model.state_dict().items())
    with pytest.raises(CheckpointError, match="MXFP4: no packed form"):
        load_gguf_packed(path)


@pytest.mark.parametrize("layers, experts, active", [(24, 32, 3.6e9), (36, 128, 5.1e9)], ids=["20b", "120b"])
def test_published_configs_translate_and_count(layers, experts, active):
    """gpt-oss-20b's and -120b's config.json values (the Hub's, less quantization_config): the parameter count
    equals HF's model built from them (on the meta device), and the active count less the embedding table is
    OpenAI's 3.6B / 5.1B (its model card counts the unembedding, not the embedding)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "experts_per_token": 4, "head_dim": 64,
           "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * (layers // 2), "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": layers,
           "num_key_value_heads": 8, "num_local_experts": experts, "rms_norm_eps": 1e-05,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
           "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
           "vocab_size": 201088}
    config = families.config_from_hf(cfg)
    assert config.attn.sliding_layers == list(range(0, layers, 2)) and config.attn.sliding_window == 128
    assert (config.rope.factor, config.rope.original_max_seq_len, config.rope.truncate) == (32.0, 4096, False)
    with torch.device("meta"):
        hf = GptOssForCausalLM(GptOssConfig(**{k: v for k, v in cfg.items()
                                               if k not in ("experts_per_token", "initial_context_length")}))
    assert config.num_parameters() == sum(p.numel() for p in hf.parameters())
    embedding = config.vocab_size * config.d_model
    assert abs(config.active_parameters() - embedding - active) < 0.05e9


def test_gradients_reach_the_gpt_oss_parameters(checkpoint):
    """Training: the loss's gradients reach the sinks, the router bias (through the softmax over the top-k
    logits) and the experts' biases, all finite."""
    directory, _ = checkpoint
    model = load(directory).model.train()
    ids = torch.tensor([PROMPTS[0]])
    logits = model(ids[:, :-1])
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[0, 1:]).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    assert all(g is None or torch.isfinite(g).all() for g in grads.values())
    for name in ("layers.0.attn.sinks", "layers.1.ffn.router_bias", "layers.2.ffn.experts.0.b1",
                 "layers.2.ffn.experts.0.b2", "layers.2.ffn.experts.0.b3"):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
