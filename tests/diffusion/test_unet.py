"""The SD UNet against diffusers' UNet2DConditionModel (random weights, tiny configs, fp32), both folder directions."""

from __future__ import annotations

import pytest
import torch
from torch import nn

diffusers = pytest.importorskip("diffusers")

from scratchlm.diffusion.layers import attention_impl, chunked_attention  # noqa: E402
from scratchlm.diffusion.unet import SpatialOps, UNet2DConditionModel, UNetConfig  # noqa: E402

TOL = 1e-5

SD1 = dict(block_out_channels=[16, 32], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
           up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], layers_per_block=1, norm_num_groups=8,
           cross_attention_dim=24, attention_head_dim=2, sample_size=8)
SD2 = dict(block_out_channels=[16, 32, 32], down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                                               "DownBlock2D"],
           up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"], layers_per_block=[1, 2, 1],
           norm_num_groups=8, cross_attention_dim=24, attention_head_dim=[2, 4, 4], use_linear_projection=True,
           upcast_attention=True, sample_size=8)
NO_ATTN = dict(block_out_channels=[16, 24], down_block_types=["DownBlock2D", "DownBlock2D"],
               up_block_types=["UpBlock2D", "UpBlock2D"], layers_per_block=1, norm_num_groups=8,
               cross_attention_dim=12, attention_head_dim=3, resnet_time_scale_shift="scale_shift",
               mid_block_scale_factor=1.5, flip_sin_to_cos=False, freq_shift=1, center_input_sample=True,
               norm_eps=1e-6, time_embedding_dim=40, conv_in_kernel=1, conv_out_kernel=5)
SDXL = dict(block_out_channels=[16, 32, 32], down_block_types=["DownBlock2D", "CrossAttnDownBlock2D",
                                                                "CrossAttnDownBlock2D"],
            up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"], layers_per_block=1,
            norm_num_groups=8, cross_attention_dim=24, attention_head_dim=[1, 2, 4], use_linear_projection=True,
            transformer_layers_per_block=[1, 2, 3], addition_embed_type="text_time", addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=20 + 6 * 8, sample_size=8)


def _reference(kw: dict, seed: int = 0):
    torch.manual_seed(seed)
    ref = diffusers.UNet2DConditionModel(**kw).eval()
    with torch.no_grad():  # zero-initialised or tiny parts would hide mistakes
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return ref


def _inputs(kw: dict, size=(8, 8), batch: int = 2):
    x = torch.randn(batch, kw.get("in_channels", 4), *size)
    t = torch.tensor([3.0, 711.5])[:batch]
    text = torch.randn(batch, 5, kw["cross_attention_dim"])
    added = None
    if kw.get("addition_embed_type") == "text_time":
        added = dict(text_embeds=torch.randn(batch, 20), time_ids=torch.tensor([[64.0, 64, 0, 0, 64, 64]] * batch))
    return x, t, text, added


def _ref_out(ref, x, t, text, added):
    with torch.no_grad():
        return ref(x, t, encoder_hidden_states=text, added_cond_kwargs=added).sample


@pytest.mark.parametrize("name,kw,size", [("sd1", SD1, (8, 8)), ("sd1-odd", SD1, (7, 9)), ("sd2", SD2, (8, 8)),
                                          ("no-attn", NO_ATTN, (8, 6)), ("sdxl", SDXL, (8, 8))])
def test_unet_matches_diffusers(tmp_path, name, kw, size):
    ref = _reference(kw)
    ref.save_pretrained(tmp_path)
    ours = UNet2DConditionModel.from_pretrained(tmp_path)
    x, t, text, added = _inputs(kw, size)
    want = _ref_out(ref, x, t, text, added)
    with torch.no_grad():
        got = ours(x, t, text, added)
    assert got.shape == want.shape
    assert (want - got).abs().max().item() <= TOL, name


def test_unet_attention_variants_and_timestep_forms(tmp_path):
    """only_cross_attention per level, chunked / materialised attention, scalar and 0-d timesteps."""
    kw = dict(SD1, only_cross_attention=[True, False], transformer_layers_per_block=2)
    ref = _reference(kw, seed=1)
    ref.save_pretrained(tmp_path)
    ours = UNet2DConditionModel.from_pretrained(tmp_path)
    x, _, text, _ = _inputs(kw)
    with torch.no_grad():
        want = ref(x, 250, encoder_hidden_states=text).sample
        outs = [ours(x, 250, text), ours(x, torch.tensor(250), text), ours(x, torch.tensor([250.0, 250.0]), text)]
        with chunked_attention(5):
            outs.append(ours(x, 250.0, text))
        with attention_impl("math"):
            outs.append(ours(x, 250, text))
    for got in outs:
        assert (want - got).abs().max().item() <= TOL


def test_save_folder_loads_in_diffusers(tmp_path):
    ref = _reference(SDXL, seed=2)
    ref.save_pretrained(tmp_path / "a")
    ours = UNet2DConditionModel.from_pretrained(tmp_path / "a")
    ours.save_pretrained(tmp_path / "b")
    back = diffusers.UNet2DConditionModel.from_pretrained(tmp_path / "b").eval()
    x, t, text, added = _inputs(SDXL)
    assert (_ref_out(ref, x, t, text, added) - _ref_out(back, x, t, text, added)).abs().max().item() == 0
    public = lambda c: {k: v for k, v in dict(c).items() if not k.startswith("_")}  # noqa: E731
    assert public(back.config) == public(ref.config)


def test_fp16_variant_both_ways(tmp_path):
    ref = _reference(SD1, seed=3)
    ref.half().save_pretrained(tmp_path / "hub", variant="fp16")
    ref.float()  # the fp16-rounded weights, in fp32
    x, t, text, _ = _inputs(SD1)
    want = _ref_out(ref, x, t, text, None)
    ours = UNet2DConditionModel.from_pretrained(tmp_path / "hub", variant="fp16")  # computed in fp32
    assert next(ours.parameters()).dtype == torch.float32
    ours_only = UNet2DConditionModel.from_pretrained(tmp_path / "hub")  # the folder's only weights file
    with torch.no_grad():
        assert (want - ours(x, t, text)).abs().max().item() <= TOL
        assert (want - ours_only(x, t, text)).abs().max().item() <= TOL
    half = UNet2DConditionModel.from_pretrained(tmp_path / "hub", dtype=torch.float16)
    assert {p.dtype for p in half.parameters()} == {torch.float16}
    with torch.no_grad():
        got16 = half(x.half(), t, text.half()).float()
    assert (want - got16).abs().max().item() <= 5e-2 * want.abs().max().item()
    ours.save_pretrained(tmp_path / "ours", dtype=torch.float16, variant="fp16")
    assert (tmp_path / "ours" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    back = diffusers.UNet2DConditionModel.from_pretrained(tmp_path / "ours", variant="fp16").float().eval()
    assert (want - _ref_out(back, x, t, text, None)).abs().max().item() == 0


class _Recording(SpatialOps):
    def __init__(self):
        self.calls: dict[str, list[str]] = {"conv": [], "group_norm": [], "self_kv": []}

    def conv(self, name, conv, x):
        self.calls["conv"].append(name)
        return super().conv(name, conv, x)

    def group_norm(self, name, gn, x):
        self.calls["group_norm"].append(name)
        return super().group_norm(name, gn, x)

    def self_kv(self, name, k, v):
        self.calls["self_kv"].append(name)
        return super().self_kv(name, k, v)


@pytest.mark.parametrize("only_cross", [False, True])
def test_spatial_ops_see_every_spatial_op_by_name(only_cross):
    """The contract with patch parallelism: each kernel>1 conv, GroupNorm and self-attention, once, by its path."""
    torch.manual_seed(0)
    model = UNet2DConditionModel(UNetConfig(**dict(SD2, only_cross_attention=[only_cross, False, False])))
    mods = dict(model.named_modules())
    ops = _Recording()
    x, t, text, _ = _inputs(SD2)
    with torch.no_grad():
        got = model(x, t, text, ops=ops)
        assert (got - model(x, t, text)).abs().max().item() == 0
    want_conv = {n for n, m in mods.items() if isinstance(m, nn.Conv2d) and m.kernel_size != (1, 1)}
    want_gn = {n for n, m in mods.items() if isinstance(m, nn.GroupNorm)}
    # level 0 is down_blocks.0 and up_blocks.2 (the up path runs deepest first): only cross-attention there
    cross_only = ("down_blocks.0.", "up_blocks.2.") if only_cross else ()
    want_kv = {n for n in mods if n.endswith(".attn1") and not n.startswith(cross_only)}
    for kind, want in (("conv", want_conv), ("group_norm", want_gn), ("self_kv", want_kv)):
        assert sorted(ops.calls[kind]) == sorted(want), kind
    assert any(n.startswith("up_blocks.2.") for n in want_kv) != only_cross


def test_unsupported_fields_error_by_name():
    base = diffusers.UNet2DConditionModel(**SD1).config
    cfg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in dict(base).items()}
    UNetConfig.from_diffusers(cfg)  # everything diffusers writes for SD1 is understood
    for key, value in (("class_embed_type", "timestep"), ("attention_type", "gated"), ("downsample_padding", 0),
                       ("encoder_hid_dim", 8), ("down_block_types", ["SimpleCrossAttnDownBlock2D", "DownBlock2D"]),
                       ("addition_embed_type", "text"), ("time_cond_proj_dim", 4), ("act_fn", "gelu"),
                       ("dual_cross_attention", True), ("time_embedding_type", "fourier")):
        with pytest.raises(ValueError, match=key):
            UNetConfig.from_diffusers(dict(cfg, **{key: value}))
    with pytest.raises(ValueError, match="made_up_field"):
        UNetConfig.from_diffusers(dict(cfg, made_up_field=1))
    with pytest.raises(ValueError, match="addition_time_embed_dim"):
        UNetConfig(**dict(SD1, addition_embed_type="text_time"))


def test_num_attention_heads_is_heads():
    """num_attention_heads (diffusers refuses it) means heads; written back as attention_head_dim."""
    a = UNetConfig(**dict(SD1, attention_head_dim=7, num_attention_heads=4))
    assert a.heads == (4, 4) and a.diffusers_config()["attention_head_dim"] == 4
    assert a.diffusers_config()["num_attention_heads"] is None


# the unet/config.json of the shipped SD 1.5, SD 2.1 (768) and SDXL base folders (keys as they are on the hub)
HUB_SD15 = {"act_fn": "silu", "attention_head_dim": 8, "block_out_channels": [320, 640, 1280, 1280],
            "center_input_sample": False, "cross_attention_dim": 768,
            "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
            "downsample_padding": 1, "flip_sin_to_cos": True, "freq_shift": 0, "in_channels": 4, "layers_per_block": 2,
            "mid_block_scale_factor": 1, "norm_eps": 1e-05, "norm_num_groups": 32, "out_channels": 4,
            "sample_size": 64,
            "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"]}
HUB_SD21 = dict(HUB_SD15, attention_head_dim=[5, 10, 20, 20], cross_attention_dim=1024, use_linear_projection=True,
                upcast_attention=True, sample_size=96, dual_cross_attention=False, num_class_embeds=None,
                only_cross_attention=False)
HUB_SDXL = dict(HUB_SD15, attention_head_dim=[5, 10, 20], block_out_channels=[320, 640, 1280],
                cross_attention_dim=2048, down_block_types=["DownBlock2D", "CrossAttnDownBlock2D",
                                                            "CrossAttnDownBlock2D"],
                up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
                transformer_layers_per_block=[1, 2, 10], use_linear_projection=True, addition_embed_type="text_time",
                addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816, sample_size=128)


@pytest.mark.parametrize("cfg", [HUB_SD15, HUB_SD21, HUB_SDXL], ids=["sd15", "sd21", "sdxl"])
def test_full_size_configs_have_diffusers_state_dict(cfg):
    """Real checkpoints load strictly: same keys and shapes as diffusers' model (built on the meta device)."""
    with torch.device("meta"):
        ref = diffusers.UNet2DConditionModel(**cfg)
        ours = UNet2DConditionModel(UNetConfig.from_diffusers({"_class_name": "UNet2DConditionModel", **cfg}))
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in ref.state_dict().items()}


def test_loaded_model_trains(tmp_path):
    """from_pretrained assigns the file's tensors: they stay trainable parameters."""
    _reference(SD1).save_pretrained(tmp_path)
    ours = UNet2DConditionModel.from_pretrained(tmp_path).train()
    assert all(isinstance(p, nn.Parameter) and p.requires_grad for p in ours.parameters())
    x, t, text, _ = _inputs(SD1)
    ours(x, t, text).square().mean().backward()
    assert all(p.grad is not None for p in ours.parameters())
