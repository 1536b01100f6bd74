"""Parallel variants on real processes (gloo): each equals one rank; a dead rank fails fast."""

from __future__ import annotations

import time

import pytest
import torch

from scratchlm.diffusion import parallel as pp
from tests.diffusion.helpers import tiny_pipeline

PROMPTS = ["a handwritten seven", "the digit 2"]


def _one_rank(path, steps=4, guidance=3.0, sampler="ddim", size=None):
    from scratchlm.diffusion.pipeline import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(path)
    text, uncond = pipe.encode_prompts(PROMPTS), pipe.encode_prompts([""] * 2)
    return pipe.denoise(pipe.initial_latents(2, 0, size=size), text, uncond, steps, guidance, sampler)


def test_exact_patch_parallel_equals_one_rank(tmp_path):
    """Default suite: 2 gloo ranks, tiny model, 4x4 latent split into two bands of 2 rows."""
    tiny_pipeline(tmp_path)
    want = _one_rank(tmp_path)
    res = pp.launch(pp.run_patch, 2, str(tmp_path), PROMPTS, 4, 3.0, "ddim", "exact", 0, 0)
    for r in res:
        assert (r["latents"] - want).abs().max().item() <= 1e-5
    # K and V of the other band, per layer and step: (P-1) * 2 * B' * (N/P) * d floats
    n_layers, steps, b2, n, d, p = 2, 4, 4, 16, 32, 2
    assert res[0]["bytes_received"]["kv_all_gather"] == n_layers * steps * (p - 1) * 2 * b2 * (n // p) * d * 4


@pytest.mark.distributed
@pytest.mark.parametrize("sampler", ["ddpm", "euler"])
def test_exact_patch_parallel_p4_and_other_samplers(tmp_path, sampler):
    tiny_pipeline(tmp_path, latent=8)
    want = _one_rank(tmp_path, sampler=sampler)
    res = pp.launch(pp.run_patch, 4, str(tmp_path), PROMPTS, 4, 3.0, sampler, "exact", 0, 0)
    for r in res:
        assert (r["latents"] - want).abs().max().item() <= 1e-5
    n_layers, steps, b2, n, d, p = 2, 4, 4, 64, 32, 4
    assert res[0]["bytes_received"]["kv_all_gather"] == n_layers * steps * (p - 1) * 2 * b2 * (n // p) * d * 4


@pytest.mark.distributed
def test_uneven_bands(tmp_path):
    """7 patch rows over 2 ranks (the MNIST latent): bands of 4 and 3 rows, padded for the gather."""
    tiny_pipeline(tmp_path, latent=7)
    want = _one_rank(tmp_path)
    res = pp.launch(pp.run_patch, 2, str(tmp_path), PROMPTS, 4, 3.0, "ddim", "exact", 0, 0)
    assert (res[0]["latents"] - want).abs().max().item() <= 1e-5


@pytest.mark.distributed
def test_displaced_patch_parallel(tmp_path):
    tiny_pipeline(tmp_path)
    want = _one_rank(tmp_path, steps=6)
    # all steps synchronous warm-up: the displaced path must reduce to the exact one
    full_warm = pp.launch(pp.run_patch, 2, str(tmp_path), PROMPTS, 6, 3.0, "ddim", "displaced", 6, 0)
    assert (full_warm[0]["latents"] - want).abs().max().item() <= 1e-5
    stale = pp.launch(pp.run_patch, 2, str(tmp_path), PROMPTS, 6, 3.0, "ddim", "displaced", 2, 0)
    err = (stale[0]["latents"] - want).abs().max().item()
    assert 0 < err < want.abs().max().item()  # one-step-stale K/V: close, not equal
    assert torch.equal(stale[0]["latents"], stale[1]["latents"])
    assert stale[0]["bytes_received"]["kv_async"] > 0


@pytest.mark.distributed
def test_cfg_parallel_equals_one_rank(tmp_path):
    tiny_pipeline(tmp_path)
    want = _one_rank(tmp_path)
    res = pp.launch(pp.run_cfg, 2, str(tmp_path), PROMPTS, 4, 3.0, "ddim", 0)
    for r in res:
        assert (r["latents"] - want).abs().max().item() <= 1e-5


@pytest.mark.distributed
def test_dead_rank_fails_fast(tmp_path):
    tiny_pipeline(tmp_path)
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exit code 3"):  # rank 1 dies inside its third DiT call
        pp.launch(pp.run_patch, 2, str(tmp_path), PROMPTS, 8, 3.0, "ddim", "exact", 0, 0, None, 2, timeout_s=20)
    assert time.monotonic() - t < 60
