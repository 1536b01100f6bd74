"""DeepSeek-V2 / V3 (multi-head latent attention + mixture of experts), exact against HF transformers on tiny random
checkpoints of their own config classes (`tiny.MLA_FAMILIES`: q through q_lora_rank and straight from x, greedy
and group-limited V2 routing, V3's sigmoid router with groups and its correction bias, YaRN with mscale).

The HF safetensors load (logits within 1e-4 of HF's forward), the engine (the latent paged KV cache, absorbed
decode) greedy ids equal to HF `generate` on a batch of prompts, int8 weights agreeing with fp32 (stated), the
export back to HF loading in transformers with equal logits, the config round trip, Kimi K2's model_type, the
multi-token-prediction layer skipped, and the fields MLA does not implement refused by name.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch

from scratchlm.model import families, load
from scratchlm.model.loading import export_hf
from tests.model.families.tiny import MLA_FAMILIES, save_tiny

CASES = sorted(MLA_FAMILIES)
PROMPTS = [[5, 17, 3, 99, 42, 7, 150, 8, 23, 61, 2, 77, 9, 31, 44, 12, 100, 6, 59], [11, 4, 120],
           [90, 91, 92, 93, 94, 95, 96, 97, 98, 1, 2, 3]]
NEW_TOKENS = 12


@functools.cache
def _checkpoint(name: str, root: str):
    from pathlib import Path

    directory = Path(root) / name
    return directory, save_tiny(name, directory)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("deepseek"))


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_hf_load_logits(name, root):
    directory, hf = _checkpoint(name, root)
    ours = load(directory).model
    ids = torch.randint(0, 160, (2, 40), generator=torch.Generator().manual_seed(1))
    assert (ours(ids) - hf(ids).logits).abs().max().item() < 1e-4


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", CASES)
def test_engine_greedy_equals_hf_generate(name, root):
    """The engine stores latents in its paged cache and decodes with kv_b absorbed; prompts run as chunks of 8 so
    some chunks attend to a cached prefix (expanded from the cache's latents)."""
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from tests.inference.helpers import CharTokenizer, run_all

    directory, hf = _checkpoint(name, root)
    loaded = load(directory)
    engine = LLMEngine(loaded.model, CharTokenizer(loaded.config.vocab_size), loaded.config,
                       EngineConfig(block_size=4, kv_cache_memory=1 << 20, max_model_len=64,
                                    max_num_batched_tokens=8))
    assert engine.executor.runner.cache.k.shape[-2:] == (1, loaded.config.mla.kv_lora_rank)
    assert engine.executor.runner.cache.v.shape[-2:] == (1, loaded.config.mla.qk_rope_head_dim)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
    out = run_all(engine)
    for i, p in enumerate(PROMPTS):
        assert out[str(i)] == _hf_greedy(hf, p), f"prompt {i}"


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
    assert load(out).config == loaded.config


@pytest.mark.parametrize("name", CASES)
def test_config_round_trip(name):
    cfg = MLA_FAMILIES[name]().to_dict()
    family = families.for_hf_config(cfg)
    config = family.config_from_hf(cfg, name)
    assert family.config_from_hf(family.hf_config(config), name) == config
    assert families.for_export(config) is family


def test_config_translation():
    """What the DeepSeek fields become: MLA widths, head_dim = the RoPE width, the router, the dense first layers, the
    YaRN mscale in the query scale and the cos/sin factor, Kimi K2 answered by the V3 family."""
    import math

    from scratchlm.model.rope import inv_freq

    c = families.config_from_hf(MLA_FAMILIES["deepseek_v3_yarn"]().to_dict())
    assert (c.head_dim, c.rotary_dim, c.n_kv_heads, c.rope_layout) == (4, 4, 4, "half")
    assert c.moe.dense_layers == [0] and c.moe.d_shared == 64 and c.moe.scoring == "sigmoid" and c.moe.score_bias
    m = 0.1 * math.log(4.0) + 1
    assert c.query_scale() == pytest.approx(12 ** -0.5 * m * m)
    assert inv_freq(4, c.rope_theta, c.rope)[1] == pytest.approx((0.08 * math.log(4.0) + 1) / m)
    v2 = families.config_from_hf(MLA_FAMILIES["deepseek_v2_groups"]().to_dict())
    assert (v2.rope_layout, v2.moe.scoring, v2.moe.n_groups, v2.moe.topk_groups, v2.moe.routed_scale) == (
        "adjacent", "softmax", 4, 2, 1.5)
    kimi = MLA_FAMILIES["deepseek_v3"]().to_dict() | {"model_type": "kimi_k2"}
    assert families.for_hf_config(kimi).name == "deepseek_v3"
    spec = v2.kv_spec()
    assert spec[0].latent and spec[0].elements_per_token() == 16 + 4


def test_unsupported_fields_are_errors():
    from scratchlm.model.families import FamilyError

    v2 = MLA_FAMILIES["deepseek_v2"]().to_dict()
    v3 = MLA_FAMILIES["deepseek_v3"]().to_dict()
    with pytest.raises(FamilyError, match="attention_bias"):
        families.config_from_hf(v2 | {"attention_bias": True})
    with pytest.raises(FamilyError, match="topk_method 'noaux_tc'"):
        families.config_from_hf(v2 | {"topk_method": "noaux_tc"})
    with pytest.raises(FamilyError, match="scoring_func 'softmax'"):
        families.config_from_hf(v3 | {"scoring_func": "softmax"})


def test_mtp_layer_is_skipped(root, tmp_path):
    """DeepSeek-V3 checkpoints carry the multi-token-prediction layer after the last one: skipped (logged); any other
    tensor the family does not read is still an error."""
    import shutil

    from safetensors.torch import load_file, save_file

    from scratchlm.model.loading.common import CheckpointError

    directory, _ = _checkpoint("deepseek_v3", root)
    out = tmp_path / "mtp"
    shutil.copytree(directory, out)
    cfg = json.loads((out / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    state = load_file(out / "model.safetensors")
    save_file(state | {f"model.layers.{n}.eh_proj.weight": torch.zeros(4, 4)}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 0}))
    with pytest.raises(CheckpointError, match="does not use"):
        load(out)
    (out / "config.json").write_text(json.dumps(cfg | {"num_nextn_predict_layers": 1}))
    assert load(out).config.n_layers == n


@torch.no_grad()
def test_fused_3d_experts_layout(root, tmp_path):
    """A file holding transformers 5's in-memory layout (experts fused into `gate_up_proj` (E, 2F, D) and
    `down_proj` (E, D, F)) loads to the same model."""
    import shutil

    from safetensors.torch import save_file

    directory, hf = _checkpoint("deepseek_v3", root)
    out = tmp_path / "fused"
    out.mkdir()
    shutil.copy(directory / "config.json", out / "config.json")
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, out / "model.safetensors")
    ids = torch.tensor([PROMPTS[0]])
    assert (load(out).model(ids) - hf(ids).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_int8_weights_agree_with_fp32(name, root):
    """int8 weights (per-32 groups; the attention's k_b / v_b too, which decode absorbs dequantized): most top
    tokens equal and the logits close. Stated, not exact: a router choice near a tie may flip under int8 noise,
    which moves that token's logits by much more than the weights' error."""
    from scratchlm.inference.quantization import quantize_model

    directory, _ = _checkpoint(name, root)
    model = load(directory).model
    q = quantize_model(model, "int8")
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])
    fp, qq = model(ids), q(ids)
    assert (qq - fp).abs().median() <= 0.01 * (fp.max() - fp.min())
    assert (qq.argmax(-1) == fp.argmax(-1)).float().mean() >= 0.8
    # the engine on the int8 model (absorbed decode through the dequantized k_b / v_b) = its own full forward
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from tests.inference.helpers import CharTokenizer, run_all

    prompt, greedy = PROMPTS[1], list(PROMPTS[1])
    for _ in range(8):
        greedy.append(int(q(torch.tensor([greedy]))[0, -1].argmax()))
    engine = LLMEngine(q, CharTokenizer(q.config.vocab_size), q.config,
                       EngineConfig(block_size=4, kv_cache_memory=1 << 20, max_model_len=64))
    engine.add_request("0", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert run_all(engine)["0"] == greedy[len(prompt):]


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_llm_greedy_equals_hf_generate(name, root):
    from scratchlm.inference import LLM, SamplingParams

    directory, hf = _checkpoint(name, root)
    with LLM(str(directory), threads=1, block_size=4, kv_cache_memory=1 << 20, max_model_len=64) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, p), p


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_latent_cache_dtypes(kv_dtype, root):
    """The latent cache stored in bfloat16, or int8 with one scale per token for the latent and one for the RoPE
    key: decode reads the rounded latents; stated agreement with the float32 cache's greedy ids (>= 80 %)."""
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
    from tests.inference.helpers import CharTokenizer, run_all

    directory, _ = _checkpoint("deepseek_v3", root)
    loaded = load(directory)
    outs = {}
    for dtype in ("float32", kv_dtype):
        engine = LLMEngine(loaded.model, CharTokenizer(loaded.config.vocab_size), loaded.config,
                           EngineConfig(block_size=4, kv_cache_memory=1 << 20, max_model_len=64, kv_cache_dtype=dtype))
        cache = engine.executor.runner.cache
        assert cache.k.dtype == getattr(torch, dtype) and (cache.k_scale is not None) == (dtype == "int8")
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
        outs[dtype] = run_all(engine)
    same = sum(a == b for i in outs["float32"] for a, b in zip(outs["float32"][i], outs[kv_dtype][i], strict=True))
    assert same >= 0.8 * NEW_TOKENS * len(PROMPTS)
