"""The mixture-of-experts families from GGUFs written by llama.cpp's own `convert_hf_to_gguf.py`, exact against HF.

Mixtral (arch `llama` with `llama.expert_count`), Qwen2-MoE (`qwen2moe`: shared expert `ffn_*_shexp` behind
`ffn_gate_inp_shexp`) and Qwen3-MoE (`qwen3moe`), each a tiny random checkpoint of its own transformers config
class (`tiny.MOE_FAMILIES`), converted to F32 and Q8_0. The experts are stored stacked, `ffn_{gate,up,down}_exps`
(E, F, D). The F32 load gives logits within 1e-4 of HF's forward and the engine's greedy ids equal HF `generate`;
its config equals the one read from config.json. The Q8_0 file loads packed (`load_gguf_packed`): each expert is
its own int8 linear, a view of the one stacked buffer (no expert dequantized or copied); with float activations it
equals the same file dequantized within 1e-4 and its engine greedy ids are the dequantized model's; with
llama.cpp's integer activations, within 1 % of the logits.

Only all-sparse checkpoints: llama.cpp's converter has no tensor names for the dense layers of `qwen2moe` /
`qwen3moe` (`mlp_only_layers`, `decoder_sparse_step`; it fails on them), and llama.cpp's graphs fix the top-k
renormalisation per arch (`qwen2moe` never, `qwen3moe` and `llama` always), which the tiny configs follow.
Without the sdist in .peers/ every test skips (nothing here downloads).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scratchlm.model import load
from tests.model.families import gguf_convert
from tests.model.families.test_gguf_families import _float_activations
from tests.model.families.tiny import save_tiny

CASES = ["mixtral", "qwen2_moe_sparse", "qwen3_moe_sparse"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """`<case>/`, `<case>.f32.gguf` and `<case>.q8_0.gguf`, converted once."""
    if gguf_convert.convert_dir() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is missing: no llama-cpp-python sdist in .peers/ "
                    "(python -m benchmarks.llamacpp_decode --setup-peers)")
    pytest.importorskip("sentencepiece", reason="sentencepiece (the SPM families' tokenizer.model) is missing")
    root = tmp_path_factory.mktemp("gguf_moe_families")
    jobs = []
    for name in CASES:
        directory = root / name
        hf = save_tiny(name, directory)
        kind = gguf_convert.write_tokenizer(name, directory, hf.config.vocab_size)
        pre = gguf_convert.BPE_PRE if kind == "bpe" else None
        for outtype in ("f32", "q8_0"):
            jobs.append({"dir": str(directory), "out": str(root / f"{name}.{outtype}.gguf"), "outtype": outtype,
                         "bpe_pre": pre})
    gguf_convert.convert(jobs)
    return root


def _hf(converted: Path, name: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(converted / name, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_gguf_logits_match_hf(name, converted):
    from scratchlm.model.loading.gguf_reader import read_gguf

    hf = _hf(converted, name)
    meta, tensors = read_gguf(converted / f"{name}.f32.gguf")
    stacked = tensors["blk.0.ffn_gate_exps.weight"].shape  # (E, F, D)
    assert stacked[0] == meta[f"{meta['general.architecture']}.expert_count"] == hf.config.num_experts
    ours = load(converted / f"{name}.f32.gguf")
    ids = torch.randint(0, 160, (2, 40), generator=torch.Generator().manual_seed(1))
    assert (ours.model(ids) - hf(ids).logits).abs().max().item() < ATOL
    assert ours.config == load(converted / name).config


@pytest.mark.parametrize("name", CASES)
def test_gguf_engine_greedy_equals_hf_generate(name, converted):
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from tests.inference.helpers import CharTokenizer, run_all

    hf = _hf(converted, name)
    loaded = load(converted / f"{name}.f32.gguf")
    prompts = [[5, 17, 3, 99, 42, 7, 150, 8, 23, 61, 2, 77], [11, 4, 120]]
    engine = LLMEngine(loaded.model, CharTokenizer(loaded.config.vocab_size), loaded.config,
                       EngineConfig(block_size=4, kv_cache_memory=8 << 20, max_model_len=64))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    out = run_all(engine)
    for i, p in enumerate(prompts):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out[str(i)] == want[0, len(p):].tolist(), f"prompt {i}"


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_q8_0_packed_experts_agree_with_dequantized(name, converted):
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from scratchlm.inference.quantization import load_gguf_packed
    from scratchlm.inference.quantization.modules import QuantLinear
    from tests.inference.helpers import CharTokenizer, run_all

    path = converted / f"{name}.q8_0.gguf"
    packed, plain = load_gguf_packed(path), load(path)
    assert packed.config == plain.config
    experts = packed.model.layers[0].ffn.experts
    assert all(type(e.w1) is QuantLinear and e.w1.fmt.bits == 8 for e in experts)
    base = experts[0].w1.qweight.untyped_storage().data_ptr()  # every expert a view of the stacked tensor
    assert all(e.w1.qweight.untyped_storage().data_ptr() == base for e in experts)
    ids = torch.randint(0, 160, (2, 24), generator=torch.Generator().manual_seed(2))
    want = plain.model(ids)
    assert (packed.model(ids) - want).abs().max().item() <= 0.01 * want.abs().max().item()
    prompt = [5, 17, 3, 99, 42, 7]
    greedy = list(prompt)
    for _ in range(10):
        greedy.append(int(plain.model(torch.tensor([greedy]))[0, -1].argmax()))
    with _float_activations():
        assert (packed.model(ids) - want).abs().max().item() < ATOL
        engine = LLMEngine(packed.model, CharTokenizer(packed.config.vocab_size), packed.config,
                           EngineConfig(block_size=4, kv_cache_memory=8 << 20, max_model_len=64))
        engine.add_request("0", prompt, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
        assert run_all(engine)["0"] == greedy[len(prompt):]


def test_gguf_moe_metadata_errors(converted, tmp_path):
    """A gating function or expert groups these archs' llama.cpp graphs do not read: an error naming the key."""
    from scratchlm.model.families import FamilyError
    from scratchlm.model.families.qwen3_moe import config_from_gguf
    from scratchlm.model.loading.gguf_reader import read_gguf

    meta, tensors = read_gguf(converted / "qwen3_moe_sparse.f32.gguf")
    assert config_from_gguf(meta, tensors, "t").moe.norm_topk
    for key, value in (("qwen3moe.expert_gating_func", 2), ("qwen3moe.expert_group_count", 4)):
        with pytest.raises(FamilyError, match=key):
            config_from_gguf(meta | {key: value}, tensors, "t")


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_llamacpp_logits_equal_ours(name, converted):
    """llama.cpp (built by benchmarks/llamacpp_decode.py --setup-peers) on the same F32 GGUF, its own MoE graph
    (its routing, its top-k renormalisation per arch): logits equal ours within 2e-4 of the largest (measured
    1.8e-7 Mixtral, 1.2e-7 Qwen2-MoE, 2.4e-7 Qwen3-MoE, of logits up to 0.56)."""
    import json
    import os
    import subprocess

    from benchmarks.llamacpp_decode import LIB_DIR, VENV
    from tests.model.families.test_gguf_families import LLAMA_CPP

    python = VENV / "bin" / "python"
    if not (python.exists() and LIB_DIR.exists()):
        pytest.skip("llama.cpp is not built in .peers/ (python -m benchmarks.llamacpp_decode --setup-peers)")
    path = converted / f"{name}.f32.gguf"
    ids = [5, 17, 3, 99, 42, 7, 150, 8]
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(LIB_DIR))
    proc = subprocess.run([str(python), "-c", LLAMA_CPP, str(path), json.dumps(ids)], capture_output=True,
                          text=True, env=env, timeout=120, check=True)
    theirs = torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1]))
    ours = load(path).model(torch.tensor([ids]))[0]
    assert (ours - theirs).abs().max().item() < 2e-4 * max(1.0, theirs.abs().max().item())
