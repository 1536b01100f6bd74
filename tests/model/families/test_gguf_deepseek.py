"""DeepSeek-V2 / V3 from GGUFs written by llama.cpp's own `convert_hf_to_gguf.py` (arch `deepseek2`), exact against
HF transformers on the tiny checkpoints of `tiny.MLA_FAMILIES`.

convert splits each layer's `kv_b_proj` into `attn_k_b` (H, c, n) and `attn_v_b` (H, v, c), stacks the experts
(`ffn_*_exps`, read per expert by `base.moe_gguf_rules`), writes the router as llama.cpp's metadata (gating
function, weights norm and scale, expert groups, `exp_probs_b` bias). The F32 file's logits are within 1e-4 of HF's
forward, the engine's greedy ids equal HF `generate`, and its config equals the one read from config.json.

The cases are those whose routing llama.cpp computes as HF does: V2 with greedy top-k, and V3 (sigmoid scores, the
correction bias, groups scored by their best two), once with DeepSeek-V3's own YaRN (mscale = mscale_all_dim = 1:
`rope.scaling.yarn_log_multiplier`). The V3 config.json gets DeepSeek's own `scoring_func` /
`topk_method` keys first (the published checkpoints have them; transformers' DeepseekV3Config does not write them,
and without `scoring_func` convert writes no gating function, which llama.cpp reads as softmax). llama.cpp scores a
group by its best two experts whatever the topk_method, so V2's group_limited_greedy (best one) is not among them.
Without the sdist in .peers/ every test skips (nothing here downloads).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from scratchlm.model import load
from tests.model.families import gguf_convert
from tests.model.families.tiny import save_tiny

CASES = ["deepseek_v2", "deepseek_v3", "deepseek_v3_mscale"]
ATOL = 1e-4


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, dict]:
    """(root with `<case>/` and `<case>.f32.gguf`, {case: the HF model}), converted once."""
    if gguf_convert.convert_dir() is None:
        pytest.skip("llama.cpp's convert_hf_to_gguf.py is missing: no llama-cpp-python sdist in .peers/ "
                    "(python -m benchmarks.llamacpp_decode --setup-peers)")
    root = tmp_path_factory.mktemp("gguf_deepseek")
    jobs, models = [], {}
    for name in CASES:
        directory = root / name
        models[name] = save_tiny(name, directory)
        if name.startswith("deepseek_v3"):
            cfg = json.loads((directory / "config.json").read_text())
            cfg |= {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
            (directory / "config.json").write_text(json.dumps(cfg))
        gguf_convert.write_tokenizer(name, directory, models[name].config.vocab_size)
        jobs.append({"dir": str(directory), "out": str(root / f"{name}.f32.gguf"), "outtype": "f32",
                     "bpe_pre": gguf_convert.BPE_PRE})
    gguf_convert.convert(jobs)
    return root, models


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_gguf_logits_match_hf(name, converted):
    from scratchlm.model.loading.gguf_reader import read_gguf

    root, models = converted
    meta, tensors = read_gguf(root / f"{name}.f32.gguf")
    assert meta["general.architecture"] == "deepseek2" and "blk.0.attn_k_b.weight" in tensors
    ours = load(root / f"{name}.f32.gguf")
    ids = torch.randint(0, 160, (2, 40), generator=torch.Generator().manual_seed(1))
    assert (ours.model(ids) - models[name](ids).logits).abs().max().item() < ATOL
    assert ours.config == load(root / name).config


@pytest.mark.parametrize("name", CASES)
def test_gguf_engine_greedy_equals_hf_generate(name, converted):
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from tests.inference.helpers import CharTokenizer, run_all

    root, models = converted
    loaded = load(root / f"{name}.f32.gguf")
    prompts = [[5, 17, 3, 99, 42, 7, 150, 8, 23, 61, 2, 77], [11, 4, 120]]
    engine = LLMEngine(loaded.model, CharTokenizer(loaded.config.vocab_size), loaded.config,
                       EngineConfig(block_size=4, kv_cache_memory=1 << 20, max_model_len=64))
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    out = run_all(engine)
    for i, p in enumerate(prompts):
        want = models[name].generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                     max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert out[str(i)] == want[0, len(p):].tolist(), f"prompt {i}"
