"""The CLIP text encoder against transformers' CLIPTextModel / CLIPTextModelWithProjection (random tiny configs)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from scratchlm.diffusion.clip import (  # noqa: E402
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    encode_prompt_hidden,
)

TOL = 1e-5


def _hf_config(act: str = "quick_gelu", eos: int = 98, **kw):
    base = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                max_position_embeddings=12, projection_dim=24, hidden_act=act, eos_token_id=eos, bos_token_id=97,
                pad_token_id=1)
    return transformers.CLIPTextConfig(**{**base, **kw})


def _ids(eos: int, b: int = 3, t: int = 12) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 90, (b, t), generator=g)
    ids[:, 0] = 97
    for r, n in enumerate((4, 12, 7)[:b]):  # an eos at a different place per row, padding after it
        ids[r, n - 1] = eos
        ids[r, n:] = eos if eos != 2 else 1
    return ids


def _perturb(m):
    with torch.no_grad():  # LayerNorms at 1/0 and zero biases would hide mistakes
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


@pytest.mark.parametrize("act,eos", [("quick_gelu", 98), ("gelu", 2), ("quick_gelu", 2)])
def test_text_model_matches_transformers(tmp_path, act, eos):
    torch.manual_seed(0)
    ref = _perturb(transformers.CLIPTextModel(_hf_config(act, eos)).eval())
    ref.save_pretrained(tmp_path)  # transformers 5 writes the bare keys (no text_model. prefix)
    ours = CLIPTextModel.from_pretrained(tmp_path)
    ids = _ids(eos if eos != 2 else 98)
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True)
        got = ours(ids, output_hidden_states=True)
        masked_want = ref(ids, attention_mask=(ids != 1).long())
        masked_got = ours(ids, attention_mask=(ids != 1).long())
    assert (want.last_hidden_state - got.last_hidden_state).abs().max() <= TOL
    assert (want.pooler_output - got.pooler_output).abs().max() <= TOL
    assert len(want.hidden_states) == len(got.hidden_states) == 4
    for w, g in zip(want.hidden_states, got.hidden_states, strict=True):
        assert (w - g).abs().max() <= TOL
    assert (masked_want.last_hidden_state - masked_got.last_hidden_state).abs().max() <= TOL
    skip = encode_prompt_hidden(got, ours.text_model.final_layer_norm, clip_skip=1)
    assert (skip - ref.final_layer_norm(want.hidden_states[-2])).abs().max() <= TOL


def test_with_projection_and_round_trip(tmp_path):
    torch.manual_seed(0)
    ref = _perturb(transformers.CLIPTextModelWithProjection(_hf_config("gelu", 2)).eval())
    ref.save_pretrained(tmp_path / "hf")  # keys under text_model. + text_projection.weight
    ours = CLIPTextModelWithProjection.from_pretrained(tmp_path / "hf")
    ids = _ids(98)
    with torch.no_grad():
        want = ref(ids, output_hidden_states=True)
        got = ours(ids, output_hidden_states=True)
    assert (want.text_embeds - got.text_embeds).abs().max() <= TOL
    assert (want.last_hidden_state - got.last_hidden_state).abs().max() <= TOL
    assert (want.hidden_states[-2] - got.hidden_states[-2]).abs().max() <= TOL

    # ours -> transformers, fp16 variant and fp32
    ours.save_pretrained(tmp_path / "fp16", dtype=torch.float16, variant="fp16")
    assert (tmp_path / "fp16" / "model.fp16.safetensors").is_file()
    back = transformers.CLIPTextModelWithProjection.from_pretrained(tmp_path / "fp16", variant="fp16",
                                                                    dtype=torch.float32).eval()
    ours16 = CLIPTextModelWithProjection.from_pretrained(tmp_path / "fp16")  # the only model.*.safetensors
    with torch.no_grad():
        assert (back(ids).text_embeds - ours16(ids).text_embeds).abs().max() <= TOL
        assert (back(ids).text_embeds - want.text_embeds).abs().max() <= 1e-2  # fp16 rounding of the weights
    ours.save_pretrained(tmp_path / "fp32")
    cfg = json.loads((tmp_path / "fp32" / "config.json").read_text())
    assert cfg["architectures"] == ["CLIPTextModelWithProjection"] and cfg["torch_dtype"] == "float32"
    back32 = transformers.CLIPTextModelWithProjection.from_pretrained(tmp_path / "fp32").eval()
    with torch.no_grad():
        assert torch.equal(back32(ids).text_embeds, want.text_embeds)


def test_round_trip_text_model_prefixed_and_position_ids(tmp_path):
    torch.manual_seed(0)
    ours = _perturb(CLIPTextModel(CLIPTextConfig(**{k: v for k, v in _hf_config(eos=98).to_dict().items()
                                                    if k in CLIPTextConfig.__dataclass_fields__})))
    ours.save_pretrained(tmp_path)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(tmp_path / "model.safetensors"))
    assert all(k.startswith("text_model.") for k in sd)
    ref = transformers.CLIPTextModel.from_pretrained(tmp_path).eval()
    ids = _ids(98)
    with torch.no_grad():
        assert (ref(ids).last_hidden_state - ours(ids).last_hidden_state).abs().max() <= TOL
    # an old checkpoint with the position_ids buffer still loads
    sd["text_model.embeddings.position_ids"] = torch.arange(12)[None]
    save_file(sd, str(tmp_path / "model.safetensors"))
    CLIPTextModel.from_pretrained(tmp_path)


def test_config_errors_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="hidden_act"):
        CLIPTextConfig(hidden_act="relu")
    with pytest.raises(ValueError, match="rope_theta"):
        CLIPTextConfig.from_hf({"hidden_size": 32, "rope_theta": 1.0})
    with pytest.raises(ValueError, match="attention_dropout"):
        CLIPTextConfig.from_hf({"attention_dropout": 0.1})
    CLIPTextConfig.from_hf({"transformers_version": "4.22.0", "torch_dtype": "float16", "dropout": 0.0})
    transformers.CLIPTextModel(_hf_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="text_projection"):
        CLIPTextModelWithProjection.from_pretrained(tmp_path)


_SD15 = {"_name_or_path": "openai/clip-vit-large-patch14", "architectures": ["CLIPTextModel"], "attention_dropout": 0.0,
         "bos_token_id": 0, "dropout": 0.0, "eos_token_id": 2, "hidden_act": "quick_gelu", "hidden_size": 768,
         "initializer_factor": 1.0, "initializer_range": 0.02, "intermediate_size": 3072, "layer_norm_eps": 1e-05,
         "max_position_embeddings": 77, "model_type": "clip_text_model", "num_attention_heads": 12,
         "num_hidden_layers": 12, "pad_token_id": 1, "projection_dim": 768, "torch_dtype": "float32",
         "transformers_version": "4.22.0.dev0", "vocab_size": 49408}
_SD21 = {**_SD15, "hidden_act": "gelu", "hidden_size": 1024, "intermediate_size": 4096, "num_attention_heads": 16,
         "num_hidden_layers": 23, "projection_dim": 512, "transformers_version": "4.25.0.dev0"}
_SDXL2 = {**_SD15, "architectures": ["CLIPTextModelWithProjection"], "hidden_act": "gelu", "hidden_size": 1280,
          "intermediate_size": 5120, "num_attention_heads": 20, "num_hidden_layers": 32, "projection_dim": 1280}


@pytest.mark.parametrize("hf_cfg", [_SD15, _SD21, _SDXL2], ids=["sd15", "sd21", "sdxl_text_encoder_2"])
def test_shipped_configs_build_transformers_keys(hf_cfg):
    """The hub's text_encoder configs (as shipped, old bookkeeping keys included): our parameter names and shapes are
    the checkpoints' (`text_model.` + transformers' names), built on the meta device."""
    proj = hf_cfg["architectures"] == ["CLIPTextModelWithProjection"]
    ours_cls = CLIPTextModelWithProjection if proj else CLIPTextModel
    ref_cls = transformers.CLIPTextModelWithProjection if proj else transformers.CLIPTextModel
    hf_fields = {k: v for k, v in hf_cfg.items() if k in CLIPTextConfig.__dataclass_fields__}
    with torch.device("meta"):
        ours = ours_cls(CLIPTextConfig.from_hf(hf_cfg))
        ref = ref_cls(transformers.CLIPTextConfig(**hf_fields))
    want = {(k if k.startswith(("text_model.", "text_projection")) else "text_model." + k): tuple(v.shape)
            for k, v in ref.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == want


def test_sharded_folder_loads(tmp_path):
    torch.manual_seed(0)
    ref = _perturb(transformers.CLIPTextModel(_hf_config()).eval())
    ref.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    ours = CLIPTextModel.from_pretrained(tmp_path)
    ids = _ids(98)
    with torch.no_grad():
        assert (ref(ids).last_hidden_state - ours(ids).last_hidden_state).abs().max() <= TOL
