"""The DiT and the VAE against diffusers (random weights, tiny configs, fp32, save_pretrained -> our loader)."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from scratchlm.diffusion.dit import DiT, DiTConfig  # noqa: E402
from scratchlm.diffusion.layers import attention_impl, chunked_attention  # noqa: E402
from scratchlm.diffusion.vae import AutoencoderKL, VAEConfig  # noqa: E402

TOL = 1e-5


@pytest.mark.parametrize("patch,caption,size", [(1, None, 6), (2, 24, 8), (2, None, 12)])
def test_dit_matches_pixart(tmp_path, patch, caption, size):
    torch.manual_seed(0)
    cfg = DiTConfig(sample_size=8, in_channels=4, out_channels=4, patch_size=patch, num_layers=2,
                    num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, caption_channels=caption)
    ref = diffusers.PixArtTransformer2DModel(**cfg.diffusers_config()).eval()
    with torch.no_grad():  # the zero-initialised parts would hide mistakes
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(tmp_path)
    ours = DiT.from_pretrained(tmp_path).eval()
    x = torch.randn(2, 4, size, size)
    t = torch.tensor([3.0, 711.5])
    text = torch.randn(2, 5, caption or 32)
    with torch.no_grad():
        want = ref(x, encoder_hidden_states=text, timestep=t).sample
        got = ours(x, t, text)
        with chunked_attention(5):
            got_chunked = ours(x, t, text)
        with attention_impl("math"), chunked_attention(7):
            got_math = ours(x, t, text)
    assert (want - got).abs().max().item() <= TOL
    assert (want - got_chunked).abs().max().item() <= TOL
    assert (want - got_math).abs().max().item() <= TOL


@pytest.mark.parametrize("attn", [True, False])
def test_vae_matches_autoencoder_kl(tmp_path, attn):
    torch.manual_seed(0)
    cfg = VAEConfig(in_channels=1, out_channels=1, latent_channels=4, block_out_channels=(8, 16, 16),
                    norm_num_groups=4, layers_per_block=1, mid_block_add_attention=attn, scaling_factor=0.5)
    ref = diffusers.AutoencoderKL(**cfg.diffusers_config()).eval()
    ref.save_pretrained(tmp_path)
    ours = AutoencoderKL.from_pretrained(tmp_path).eval()
    assert ours.config.scaling_factor == 0.5
    x = torch.randn(2, 1, 28, 28)
    z = torch.randn(2, 4, 7, 7)
    with torch.no_grad():
        pr, po = ref.encode(x).latent_dist, ours.encode(x)
        assert (pr.mean - po.mean).abs().max().item() <= TOL
        assert (pr.logvar - po.logvar).abs().max().item() <= TOL
        assert (ref.decode(z).sample - ours.decode(z)).abs().max().item() <= TOL
        assert (ref(x).sample - ours(x)).abs().max().item() <= TOL


def test_sd_shaped_vae_config_and_fp16_variant_load(tmp_path):
    """SD's VAE config as diffusers writes it (3 channels, 4 levels, scaling 0.18215, force_upcast, null
    shift_factor / latents_mean, quant convs), stored as an fp16 variant: loads, decodes within fp16 rounding of
    the fp16-weighted oracle, and writes force_upcast back."""
    torch.manual_seed(0)
    ref = diffusers.AutoencoderKL(block_out_channels=(8, 8, 16, 16), down_block_types=["DownEncoderBlock2D"] * 4,
                                  up_block_types=["UpDecoderBlock2D"] * 4, norm_num_groups=4, layers_per_block=2,
                                  sample_size=32).eval()
    ref.to(torch.float16).save_pretrained(tmp_path, variant="fp16")
    (tmp_path / "diffusion_pytorch_model.fp32.safetensors").write_bytes(b"")  # two variants: one must be named
    with pytest.raises(FileNotFoundError, match="variant"):
        AutoencoderKL.from_pretrained(tmp_path)
    ours = AutoencoderKL.from_pretrained(tmp_path, variant="fp16").eval()
    c = ours.config
    assert (c.in_channels, c.out_channels, c.downsample, c.scaling_factor, c.force_upcast) == (3, 3, 8, 0.18215, True)
    assert next(ours.parameters()).dtype == torch.float32  # fp16 storage, fp32 compute
    ref.float()
    z = torch.randn(1, 4, 4, 4)
    with torch.no_grad():
        assert (ref.decode(z).sample - ours.decode(z)).abs().max().item() <= TOL
    ours.save_pretrained(tmp_path / "out")
    assert diffusers.AutoencoderKL.from_pretrained(tmp_path / "out").config.force_upcast is True
    with pytest.raises(ValueError, match="latents_mean"):
        VAEConfig.from_diffusers({**ref.config, "latents_mean": [0.0] * 4})
    with pytest.raises(ValueError, match="made_up"):
        VAEConfig.from_diffusers({**ref.config, "made_up": 1})


def test_loader_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        DiT.from_pretrained(tmp_path)
    cfg = DiTConfig(num_layers=1, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16)
    bad = {**cfg.diffusers_config(), "norm_type": "ada_norm_zero"}
    with pytest.raises(ValueError, match="norm_type"):
        DiTConfig.from_diffusers(bad)
    with pytest.raises(ValueError, match="cross_attention_dim"):
        DiT(DiTConfig(num_attention_heads=2, attention_head_dim=8, cross_attention_dim=32))


def test_tiled_decode_blends_tiles_exactly():
    """With a local (pointwise) decoder the overlapping tiles agree, so the blend must reproduce the untiled
    decode exactly; the real decoder's seam error (GroupNorm statistics differ per tile) is measured in
    benchmarks/diffusion.py on the trained VAE."""
    torch.manual_seed(0)
    vae = AutoencoderKL(VAEConfig(block_out_channels=(8, 16), norm_num_groups=4, mid_block_add_attention=False)).eval()

    class Local(torch.nn.Module):
        def forward(self, z):
            return torch.nn.functional.interpolate(z[:, :1], scale_factor=2.0) * 3.0 + 1.0

    vae.decoder = Local()
    z = torch.randn(2, 4, 13, 11)
    with torch.no_grad():
        full, tiled = vae.decode(z), vae.decode(z, tile=6, overlap=2)
    assert tiled.shape == full.shape == (2, 1, 26, 22)
    assert (full - tiled).abs().max().item() <= 1e-5


@pytest.mark.parametrize("extra,scale,upcast", [
    ({"_diffusers_version": "0.6.0"}, 0.18215, False),  # SD 1.5 / 2.1: no scaling_factor key (the default)
    ({"_name_or_path": "x", "force_upcast": True, "scaling_factor": 0.13025}, 0.13025, True),  # SDXL
])
def test_hub_sd_vae_configs_parse(extra, scale, upcast):
    hub = {"_class_name": "AutoencoderKL", "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
           "down_block_types": ["DownEncoderBlock2D"] * 4, "in_channels": 3, "latent_channels": 4,
           "layers_per_block": 2, "norm_num_groups": 32, "out_channels": 3, "sample_size": 512,
           "up_block_types": ["UpDecoderBlock2D"] * 4, **extra}
    cfg = VAEConfig.from_diffusers(hub)
    assert (cfg.downsample, cfg.scaling_factor, cfg.force_upcast, cfg.layers_per_block) == (8, scale, upcast, 2)
