"""The mixture-of-experts families (Mixtral, Qwen2-MoE, Qwen3-MoE), exact against HF transformers on tiny random
checkpoints of their own config classes (`tiny.MOE_FAMILIES`: several layers, dense layers through
`mlp_only_layers` / `decoder_sparse_step`, Qwen2-MoE's gated shared expert, top-k renormalised or not, sliding
windows: Qwen2-MoE's on HF's layer pattern, Qwen3-MoE's on every layer; prompts longer than the window).

For each case: the HF safetensors load (logits within 1e-4 of HF's forward), the same weights saved in
transformers 5's fused 3D expert layout (`save_original_format=False`) load equal, `scratchlm.LLM`'s greedy ids
equal HF `generate` (a batch of prompts), int8 weights agree with fp32 (stated: logits within 2 % of their spread,
most greedy ids equal), the export back to HF loads in transformers with equal logits and back again, the config
survives HF -> ModelConfig -> HF, and the size guard names the config field of a wrong expert count or width.
GGUF: tests/model/families/test_gguf_moe_families.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch

from scratchlm.model import families, load
from scratchlm.model.loading import export_hf
from scratchlm.model.loading.common import CheckpointError
from tests.model.families.tiny import MOE_FAMILIES, save_tiny

CASES = sorted(MOE_FAMILIES)
PROMPTS = [[5, 17, 3, 99, 42, 7, 150, 8, 23, 61, 2, 77, 9, 31, 44, 12, 100, 6, 59], [11, 4, 120],
           [90, 91, 92, 93, 94, 95, 96, 97, 98, 1, 2, 3]]
NEW_TOKENS = 12


@functools.cache
def _checkpoint(name: str, root: str):
    directory = Path(root) / name
    hf = save_tiny(name, directory)
    return directory, hf


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_families"))


def _hf_greedy(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_hf_load_logits(name, root):
    directory, hf = _checkpoint(name, root)
    loaded = load(directory)
    assert loaded.config.moe.n_experts == hf.config.num_experts
    ids = torch.randint(0, 160, (2, 40), generator=torch.Generator().manual_seed(1))
    assert (loaded.model(ids) - hf(ids).logits).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
@torch.no_grad()
def test_fused_expert_layout_loads_equal(name, root, tmp_path):
    """transformers 5 keeps the experts as 3D `mlp.experts.gate_up_proj` (E, 2F, D) / `down_proj` (E, D, F); a
    checkpoint saved so (`save_original_format=False`) reads into the same model as the per-expert one."""
    directory, hf = _checkpoint(name, root)
    hf.save_pretrained(tmp_path, save_original_format=False)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(f.keys())
    want, got = load(directory).model.state_dict(), load(tmp_path).model.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


@pytest.mark.parametrize("name", CASES)
def test_llm_greedy_equals_hf_generate(name, root):
    from scratchlm.inference import LLM, SamplingParams

    directory, hf = _checkpoint(name, root)
    with LLM(str(directory), threads=1, block_size=4, kv_cache_memory=8 << 20, max_model_len=64) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy(hf, p), p


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_int8_weights_agree_with_fp32(name, root):
    """int8 per-32 groups on every linear (each expert's, the routers'): logits within 2 % of their spread and the
    same top token at most positions (a changed expert choice moves a token's logits more than a dense model's)."""
    from scratchlm.inference.quantization import quantize_model

    directory, _ = _checkpoint(name, root)
    model = load(directory).model
    q = quantize_model(model, "int8")
    ids = torch.tensor([PROMPTS[0]])
    fp, qq = model(ids), q(ids)
    assert (qq - fp).abs().max() <= 0.02 * (fp.max() - fp.min())
    assert (qq.argmax(-1) == fp.argmax(-1)).float().mean() >= 0.8


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_export_loads_equal_in_transformers(name, root, tmp_path):
    from transformers import AutoModelForCausalLM

    directory, hf = _checkpoint(name, root)
    loaded = load(directory)
    out = export_hf(loaded.model, out_dir=tmp_path / "export")
    assert json.loads((out / "config.json").read_text())["model_type"] == hf.config.model_type
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0] + PROMPTS[2]])
    assert (back(ids).logits - hf(ids).logits).abs().max().item() < 1e-4
    assert load(out).config == loaded.config  # and back again


@torch.no_grad()
def test_scratchlm_checkpoint_round_trip(root, tmp_path):
    """A MoE model saved as a scratchlm checkpoint loads equal; a state dict with fewer experts than its
    model_config says fails naming model_config.moe.n_experts."""
    from scratchlm.model.loading.checkpoint import read_checkpoint_config, save_model

    directory, _ = _checkpoint("qwen2_moe", root)
    loaded = load(directory)
    path = save_model(tmp_path / "ckpt.pt", loaded.model)
    back = load(path)
    ids = torch.tensor([PROMPTS[0]])
    assert back.config == loaded.config and torch.equal(back.model(ids), loaded.model(ids))
    state = {k: v for k, v in loaded.model.state_dict().items() if ".experts.5." not in k}
    state["layers.0.ffn.gate.weight"] = state["layers.0.ffn.gate.weight"][:5]
    torch.save({"format": "scratchlm", "model_config": loaded.config.to_dict(), "model": state}, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="model_config.moe.n_experts=6"):
        read_checkpoint_config(tmp_path / "bad.pt")


@pytest.mark.parametrize("name", CASES)
def test_config_round_trip(name):
    cfg = MOE_FAMILIES[name]().to_dict()
    family = families.for_hf_config(cfg)
    config = family.config_from_hf(cfg, name)
    assert config.moe.n_experts > 0
    assert family.config_from_hf(family.hf_config(config), name) == config
    assert families.for_export(config) is family


def test_dense_layers_and_shared_expert_from_hf_fields():
    """Qwen's dense layers: `mlp_only_layers`, and the layers off `decoder_sparse_step` ((i + 1) % step != 0)."""
    qwen2 = families.config_from_hf(MOE_FAMILIES["qwen2_moe"]().to_dict())
    assert qwen2.moe.dense_layers == [1] and (qwen2.moe.d_shared, qwen2.moe.shared_gate) == (48, True)
    assert not qwen2.moe.norm_topk and qwen2.d_expert == 32 and qwen2.d_ff == 96
    qwen3 = families.config_from_hf(MOE_FAMILIES["qwen3_moe"]().to_dict())
    assert qwen3.moe.dense_layers == [0, 2] and qwen3.moe.d_shared == 0 and qwen3.moe.norm_topk
    cfg = MOE_FAMILIES["qwen3_moe"]().to_dict() | {"decoder_sparse_step": 1, "mlp_only_layers": [3]}
    assert families.config_from_hf(cfg).moe.dense_layers == [3]
    mixtral = families.config_from_hf(MOE_FAMILIES["mixtral"]().to_dict())
    assert mixtral.moe.norm_topk and mixtral.moe.dense_layers == [] and mixtral.d_expert == mixtral.d_ff


def test_unsupported_moe_fields_are_errors():
    from scratchlm.model.families import FamilyError

    cfg = MOE_FAMILIES["qwen2_moe"]().to_dict()
    with pytest.raises(FamilyError, match="shared_expert_intermediate_size=0"):
        families.config_from_hf(cfg | {"shared_expert_intermediate_size": 0})
    with pytest.raises(FamilyError, match="num_local_experts=0"):
        families.config_from_hf(MOE_FAMILIES["mixtral"]().to_dict() | {"num_local_experts": 0})


@pytest.mark.parametrize(("field", "value", "message"), [
    ("num_experts", 8, "num_experts=8 but model.safetensors has model.layers.0.mlp.gate.weight of shape \\(6, 64\\)"),
    ("moe_intermediate_size", 16, "moe_intermediate_size=16 but model.safetensors has "
                                  "model.layers.0.mlp.experts.0.gate_proj.weight of shape \\(32, 64\\)"),
])
def test_guard_names_the_wrong_moe_size(field, value, message, root, tmp_path):
    """A config.json whose expert count or width disagrees with the tensors fails before anything is read, naming
    the field (the router's rows give the count, expert 0's gate rows the width)."""
    import shutil

    directory, _ = _checkpoint("qwen2_moe", root)
    shutil.copy(directory / "model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads((directory / "config.json").read_text()) | {field: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=message):
        load(tmp_path)
