"""VAE decoder patch parallelism on real processes (gloo): equals one rank's decode; bytes match the formula."""

from __future__ import annotations

import time

import pytest
import torch

from scratchlm.diffusion import parallel as pp
from scratchlm.diffusion.vae import AutoencoderKL, VAEConfig
from scratchlm.diffusion.vae_parallel import band_rows, decode_bytes, run_vae_decode

B, C_LAT, GROUPS = 2, 4, 4


def _vae(path, attention: bool = True, channels: tuple[int, ...] = (8, 8)) -> AutoencoderKL:
    torch.manual_seed(0)
    vae = AutoencoderKL(VAEConfig(block_out_channels=channels, norm_num_groups=GROUPS,
                                  mid_block_add_attention=attention))
    with torch.no_grad():  # random GroupNorm affines too, so a wrong statistic cannot hide behind weight 1 / bias 0
        for name, p in vae.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    vae.save_pretrained(path)
    return vae.eval()


def _expected_bytes(h: int, w: int, world: int, rank: int, attention: bool = True) -> dict[str, int]:
    """docs/diffusion.md's formulas, written out for the (8, 8)-channel decoder, 1 layer per block (+1)."""
    # 3x3 convs as (C_in, width): conv_in; mid 2 ResNets x 2 convs; up block 0: 2 ResNets x 2 convs, then
    # the upsampler's conv at 2w; up block 1: 2 ResNets x 2 convs at 2w; conv_out at 2w.
    convs = [(C_LAT, w)] + [(8, w)] * 4 + [(8, w)] * 4 + [(8, 2 * w)] + [(8, 2 * w)] * 4 + [(8, 2 * w)]
    n_nb = (rank > 0) + (rank < world - 1)
    n_norms = 4 + attention + 4 + 4 + 1  # mid ResNets, mid attention, up blocks' ResNets, conv_norm_out
    rows = band_rows(h, world)
    out = {"halo": sum(n_nb * B * c * width * 4 for c, width in convs), "gn_stats": n_norms * 24 * B * GROUPS}
    if attention:
        out["vae_kv_all_gather"] = (world - 1) * 2 * B * max(rows) * w * 8 * 4
    if rank == 0:
        out["image_gather"] = (world - 1) * B * 1 * max(rows) * 2 * (2 * w) * 4
    return out


def _check(tmp_path, h: int, w: int, world: int, attention: bool = True, channels=(8, 8)) -> None:
    vae = _vae(tmp_path, attention, channels)
    f = vae.config.downsample
    z = torch.randn(B, C_LAT, h, w, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = vae.decode(z)
    res = pp.launch(run_vae_decode, world, str(tmp_path), z, timeout_s=30)
    got = res[0]["image"]
    assert got.shape == want.shape == (B, 1, f * h, f * w)
    assert (got - want).abs().max().item() <= 1e-5
    assert all(r["image"] is None for r in res[1:])
    for rank, r in enumerate(res):
        counted = {k: v for k, v in r["bytes_received"].items()}
        if channels == (8, 8):
            assert counted == _expected_bytes(h, w, world, rank, attention), f"rank {rank}"
        assert counted == decode_bytes(vae.config, B, h, w, world, rank)  # the general formula, same numbers


def test_vae_patch_parallel_p2_uneven_equals_one_rank(tmp_path):
    """Default suite: 5 latent rows over 2 ranks (bands of 3 and 2), mid-block attention on."""
    _check(tmp_path, 5, 6, 2)


@pytest.mark.distributed
@pytest.mark.parametrize("attention", [True, False])
def test_vae_patch_parallel_p4(tmp_path, attention):
    """4 ranks, 9 rows (3, 2, 2, 2): interior ranks exchange halos with both neighbours; bands of one row too."""
    _check(tmp_path, 9, 4, 4, attention)


@pytest.mark.distributed
def test_vae_patch_parallel_one_row_bands_three_levels(tmp_path):
    """Bands of one latent row, a 3-level decoder (two upsamplings, widths 16 -> 8 -> 8)."""
    _check(tmp_path, 4, 5, 4, channels=(8, 8, 16))


@pytest.mark.distributed
def test_vae_patch_parallel_dead_rank_fails_fast(tmp_path):
    _vae(tmp_path)
    z = torch.randn(B, C_LAT, 6, 6)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exit code 3"):  # rank 1 dies at its 4th GroupNorm
        pp.launch(run_vae_decode, 2, str(tmp_path), z, 3, timeout_s=20)
    assert time.monotonic() - t < 60


def test_band_rows_refuses_too_few_rows():
    assert band_rows(7, 3) == [3, 2, 2]
    with pytest.raises(ValueError, match="3 latent rows cannot be split over 4 ranks"):
        band_rows(3, 4)
