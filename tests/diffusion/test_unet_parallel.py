"""UNet patch parallelism on real processes (gloo): exact equals one rank (output and whole sampling runs), bytes
match the module doc's formulas, displaced (DistriFusion) is close and gets closer with more warm-up, a dead rank
fails fast. The UNets are diffusers' own `UNet2DConditionModel` (random weights), saved by diffusers, loaded by ours."""

from __future__ import annotations

import time
from dataclasses import asdict

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from scratchlm.diffusion import parallel as pp  # noqa: E402
from scratchlm.diffusion import unet_parallel as up  # noqa: E402
from scratchlm.diffusion.schedulers import ScheduleConfig, cfg_combine, make_sampler  # noqa: E402
from scratchlm.diffusion.unet import UNet2DConditionModel  # noqa: E402

TOL = 1e-5  # on the UNet output; on a sampling run relative to the latent's largest value (`_rel`): a random
# UNet is no denoiser, and its samples grow to ~50 over a run, where fp32 rounding alone is ~1e-5 absolute
SD1 = dict(block_out_channels=[16, 32], down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"],
           up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], layers_per_block=1, norm_num_groups=8,
           cross_attention_dim=12, attention_head_dim=2, sample_size=8)
SD2 = dict(block_out_channels=[16, 16, 32], down_block_types=["CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                                               "DownBlock2D"],
           up_block_types=["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"], layers_per_block=1,
           norm_num_groups=8, cross_attention_dim=12, attention_head_dim=[2, 4, 4], use_linear_projection=True,
           upcast_attention=True, sample_size=8, prediction_type=None)
NO_ATTN = dict(block_out_channels=[16, 24], down_block_types=["DownBlock2D", "DownBlock2D"],
               up_block_types=["UpBlock2D", "UpBlock2D"], layers_per_block=1, norm_num_groups=8,
               cross_attention_dim=12, attention_head_dim=3, resnet_time_scale_shift="scale_shift",
               conv_in_kernel=1, conv_out_kernel=5)
SCHEDULE = ScheduleConfig(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012)


def _unet_dir(path, kw: dict) -> UNet2DConditionModel:
    """diffusers builds and saves the UNet (random weights, perturbed so no zero-initialised part hides a
    mistake, GroupNorm affines included); ours loads it."""
    kw = {k: v for k, v in kw.items() if k != "prediction_type"}
    torch.manual_seed(0)
    ref = diffusers.UNet2DConditionModel(**kw).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    ref.save_pretrained(path)
    return UNet2DConditionModel.from_pretrained(path)


def _inputs(kw: dict, h: int, w: int, b: int = 2, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, 4, h, w, generator=g), torch.randn(b, 5, kw["cross_attention_dim"], generator=g),
            torch.randn(b, 5, kw["cross_attention_dim"], generator=g))


@torch.no_grad()
def _one_rank(unet, latents, text, uncond, steps, guidance=4.0, sampler="ddim"):
    """The pipeline's sampling loop (DiffusionPipeline.denoise), written out: one rank, the whole latent."""
    sch = make_sampler(sampler, SCHEDULE)
    sch.set_timesteps(steps)
    x = latents * sch.init_noise_sigma
    g = torch.Generator().manual_seed(1)
    for t in sch.timesteps:
        xin = sch.scale_model_input(x, t)
        tt = torch.full((2 * x.shape[0],), float(t))
        out = unet(torch.cat([xin, xin]), tt, torch.cat([uncond, text])).chunk(2)
        x = sch.step(cfg_combine(*out, guidance), t, x, generator=g)
    return x


def _rel(got, want) -> float:
    return (got - want).abs().max().item() / max(1.0, want.abs().max().item())


def _sample(path, world, latents, text, uncond, steps, mode="exact", warmup=0, sampler="ddim", chunks=4):
    return pp.launch(up.run_unet_patch, world, str(path), asdict(SCHEDULE), latents, text, uncond, steps, 4.0,
                     sampler, mode, warmup, 0, None, chunks)


def test_exact_unet_output_p2_uneven_equals_one_rank(tmp_path):
    """Default suite: 10 latent rows over 2 ranks (bands of 6 and 4, aligned to 2), CFG-sized batch; bytes received
    per rank equal the module doc's formulas, written out for this UNet."""
    unet = _unet_dir(tmp_path, SD1)
    x, text, _ = _inputs(SD1, 10, 6)
    t = torch.tensor([3.0, 711.5])
    with torch.no_grad():
        want = unet(x, t, text)
    res = pp.launch(up.run_unet_forward, 2, str(tmp_path), x, t, text)
    for r in res:
        assert (r["output"] - want).abs().max().item() <= TOL
    b, g = 2, 8
    # every conv with kernel > 1 as (C_in, width, stride), in forward order (level 0: width 6, level 1: width 3)
    convs = [(4, 6, 1), (16, 6, 1), (16, 6, 1), (16, 6, 2),  # conv_in, down 0 ResNet, downsampler
             (16, 3, 1), (32, 3, 1), (32, 3, 1), (32, 3, 1), (32, 3, 1), (32, 3, 1),  # down 1 ResNet, mid ResNets
             (64, 3, 1), (32, 3, 1), (48, 3, 1), (32, 3, 1), (32, 6, 1),  # up 0 ResNets (with skips), upsampler
             (48, 6, 1), (16, 6, 1), (32, 6, 1), (16, 6, 1), (16, 6, 1)]  # up 1 ResNets, conv_out
    from_below = sum(b * c * w * 4 for c, w, s in convs if s == 1)  # rank 0: one row from below per 3x3 conv
    from_above = sum(b * c * w * 4 for c, w, s in convs)  # rank 1: one row from above, the downsampler's too
    n_norms = 3 + 2 + 5 + 4 + 6 + 1  # down 0 (ResNet + transformer), down 1, mid, up 0, up 1, conv_norm_out
    kv = 1 * 2 * b * (3 * 6 * 6 * 16 + 1 * 3 * 3 * 32) * 4  # 3 self-attentions at level 0, 1 at level 1, max bands
    for rank, halo in ((0, from_below), (1, from_above)):
        assert res[rank]["bytes_received"] == {"halo": halo, "gn_stats": n_norms * 2 * b * g * 4, "kv_all_gather": kv,
                                               "output_all_gather": 1 * b * 4 * 6 * 6 * 4}


def test_band_rows_alignment_errors():
    assert up.band_rows(24, 2, 8) == [16, 8]
    assert up.band_rows(32, 4, 4) == [8, 8, 8, 8]
    with pytest.raises(ValueError, match="not a multiple of 8"):
        up.band_rows(20, 2, 8)
    with pytest.raises(ValueError, match="too few for 4 ranks"):
        up.band_rows(24, 4, 8)


@pytest.mark.distributed
@pytest.mark.parametrize("kw", [SD2, NO_ATTN], ids=["sd2_p4", "no_attn_5x5_p2"])
def test_exact_unet_output_other_configs(tmp_path, kw):
    """3 levels (linear projections, upcast attention) over 4 ranks, bands of one row at the lowest level; a 1x1
    conv_in, a 5x5 conv_out (two halo rows each side) and scale-shift time conditioning over 2."""
    unet = _unet_dir(tmp_path, kw)
    world = 4 if kw is SD2 else 2
    x, text, _ = _inputs(kw, 16, 5)
    t = torch.tensor([3.0, 711.5])
    with torch.no_grad():
        want = unet(x, t, text)
    res = pp.launch(up.run_unet_forward, world, str(tmp_path), x, t, text)
    assert (res[-1]["output"] - want).abs().max().item() <= TOL


@pytest.mark.distributed
@pytest.mark.parametrize("sampler", ["ddim", "euler", "ddpm", "euler_a", "dpmpp"])  # ddpm, euler_a draw noise
def test_exact_sampling_run_equals_one_rank(tmp_path, sampler):
    unet = _unet_dir(tmp_path, SD1)
    lat, text, uncond = _inputs(SD1, 8, 8, b=1)
    want = _one_rank(unet, lat, text, uncond, 5, sampler=sampler)
    res = _sample(tmp_path, 2, lat, text, uncond, 5, sampler=sampler)
    for r in res:
        assert _rel(r["latents"], want) <= TOL


@pytest.mark.distributed
def test_exact_sampling_run_p4_three_levels(tmp_path):
    unet = _unet_dir(tmp_path, SD2)
    lat, text, uncond = _inputs(SD2, 16, 8, b=1)
    want = _one_rank(unet, lat, text, uncond, 4)
    res = _sample(tmp_path, 4, lat, text, uncond, 4)
    assert _rel(res[0]["latents"], want) <= TOL


@pytest.mark.distributed
def test_displaced_error_small_and_shrinks_with_warmup(tmp_path):
    """DistriFusion: all steps warm-up reduces to exact; with stale halos / GroupNorm statistics / K/V the
    per-pixel error against one rank is non-zero, small, and shrinks as more of the steps are synchronous."""
    unet = _unet_dir(tmp_path, SD1)
    steps = 8
    lat, text, uncond = _inputs(SD1, 8, 8, b=1)
    want = _one_rank(unet, lat, text, uncond, steps)
    full = _sample(tmp_path, 2, lat, text, uncond, steps, "displaced", steps)
    assert _rel(full[0]["latents"], want) <= TOL
    errs = []
    for warm in (1, 3, 6):
        res = _sample(tmp_path, 2, lat, text, uncond, steps, "displaced", warm)
        assert torch.equal(res[0]["latents"], res[1]["latents"])
        errs.append((res[0]["latents"] - want).abs().mean().item())
        counted = res[0]["bytes_received"]
        assert counted["halo_async"] > 0 and counted["gn_async"] > 0 and counted["kv_async"] > 0
    scale = want.abs().mean().item()
    assert 0 < errs[2] < errs[1] < errs[0] < 0.5 * scale, (errs, scale)
    # batching the exchanges (one per step, or one per hooked call) moves no data in time: bit-equal results
    one = _sample(tmp_path, 2, lat, text, uncond, steps, "displaced", 1, chunks=1)
    many = _sample(tmp_path, 2, lat, text, uncond, steps, "displaced", 1, chunks=1000)
    assert torch.equal(one[0]["latents"], many[0]["latents"])
    assert (one[0]["latents"] - want).abs().mean().item() == errs[0]


@pytest.mark.distributed
def test_dead_rank_fails_fast(tmp_path):
    _unet_dir(tmp_path, SD1)
    lat, text, uncond = _inputs(SD1, 8, 8, b=1)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exit code 3"):  # rank 1 dies at the first conv of step 2
        pp.launch(up.run_unet_patch, 2, str(tmp_path), asdict(SCHEDULE), lat, text, uncond, 6, 4.0, "ddim",
                  "displaced", 1, 0, 2, timeout_s=20)
    assert time.monotonic() - t < 60
