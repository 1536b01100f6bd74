"""Every family, exact against HF transformers on a tiny random checkpoint of its own config class.

For each case of `tiny.FAMILIES`: the HF safetensors load (logits within 1e-4, the oracle is HF's own forward),
the engine's greedy ids equal HF `generate` (prompts longer than the sliding windows, a batch of several), int8
weights agree with fp32 (stated: most greedy ids, logits close), the export back to HF loads in transformers with
equal logits, and the config survives HF -> ModelConfig -> HF. The fused C++ step, GGUF and TP = 2 have their own
files (tests/inference/test_fused_families.py, test_gguf_families.py, tests/parallel).
"""

from __future__ import annotations

import functools

import pytest
import torch

from scratchlm.model import families, load
from scratchlm.model.loading import export_hf
from tests.model.families.tiny import FAMILIES, save_tiny

CASES = sorted(FAMILIES)
PROMPTS = [[5, 17, 3, 99, 42, 7, 150, 8, 23, 61, 2, 77, 9, 31, 44, 12, 100, 6, 59],  # longer than every window
           [11, 4, 120], [90, 91, 92, 93, 94, 95, 96, 97, 98, 1, 2, 3]]
NEW_TOKENS = 12


@functools.cache
def _checkpoint(name: str, root: str):
    from pathlib import Path

    directory = Path(root) / name
    hf = save_tiny(name, directory)
    return directory, hf


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("families"))


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_hf_load_logits(name, root):
    directory, hf = _checkpoint(name, root)
    ours = load(directory).model
    ids = torch.randint(0, 160, (2, 40), generator=torch.Generator().manual_seed(1))
    want = hf(ids).logits
    got = ours(ids)
    assert (got - want).abs().max().item() < 1e-4
    short = ids[:, :9]  # within every window and LongRoPE's original context
    assert (ours(short) - hf(short).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", CASES)
def test_engine_greedy_equals_hf_generate(name, root):
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from tests.inference.helpers import CharTokenizer, run_all

    directory, hf = _checkpoint(name, root)
    loaded = load(directory)
    engine = LLMEngine(loaded.model, CharTokenizer(loaded.config.vocab_size), loaded.config,
                       EngineConfig(block_size=4, kv_cache_memory=8 << 20, max_model_len=64))
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    out = run_all(engine)
    # shortest first: HF's dynamic NTK RoPE keeps state between calls, which a short prompt resets
    for i in sorted(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i])):
        assert out[str(i)] == _hf_greedy(hf, PROMPTS[i]), f"prompt {i}"


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_int8_weights_agree_with_fp32(name, root):
    from scratchlm.inference.quantization import quantize_model

    directory, _ = _checkpoint(name, root)
    model = load(directory).model
    q = quantize_model(model, "int8")
    ids = torch.tensor([PROMPTS[0]])
    fp, qq = model(ids), q(ids)
    # int8 per-32 groups: logits within 2 % of their spread, and the same top token at most positions
    assert (qq - fp).abs().max() <= 0.02 * (fp.max() - fp.min())
    assert (qq.argmax(-1) == fp.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_export_loads_equal_in_transformers(name, root, tmp_path):
    from transformers import AutoModelForCausalLM

    directory, hf = _checkpoint(name, root)
    loaded = load(directory)
    out = export_hf(loaded.model, out_dir=tmp_path / "export")
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])
    assert (back(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
    assert load(out).config == loaded.config  # and back again


@pytest.mark.parametrize("name", CASES)
def test_config_round_trip(name):
    cfg = FAMILIES[name]().to_dict()
    family = families.for_hf_config(cfg)
    config = family.config_from_hf(cfg, name)
    assert family.config_from_hf(family.hf_config(config), name) == config
    assert families.for_export(config).config_from_hf(families.for_export(config).hf_config(config), name) == config


def test_unknown_features_are_errors():
    from scratchlm.model.families import FamilyError

    cfg = FAMILIES["llama"]().to_dict()
    with pytest.raises(FamilyError, match="hidden_act 'relu'"):
        families.config_from_hf(cfg | {"hidden_act": "relu"})
    with pytest.raises(FamilyError, match="RoPE scaling 'mrope'"):
        families.config_from_hf(cfg | {"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}})
    with pytest.raises(FamilyError, match="model_type 'bert'"):
        families.config_from_hf(cfg | {"model_type": "bert"})
