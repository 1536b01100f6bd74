"""Pipeline folders round-trip; the exported folder runs in diffusers' own modules and scheduler."""

from __future__ import annotations

import json

import pytest
import torch

from scratchlm.diffusion.pipeline import DiffusionPipeline, image_grid, is_pipeline_dir
from tests.diffusion.helpers import tiny_pipeline

diffusers = pytest.importorskip("diffusers")


def test_round_trip_and_diffusers_loop_give_the_same_image(tmp_path):
    pipe = tiny_pipeline(tmp_path, prediction="v_prediction")
    assert is_pipeline_dir(tmp_path)
    loaded = DiffusionPipeline.from_pretrained(tmp_path)
    prompts = ["a handwritten seven", "the digit 3"]
    lat = pipe.initial_latents(2, seed=5)
    ours = pipe(prompts, steps=6, guidance=3.0, latents=lat)
    assert torch.equal(ours, loaded(prompts, steps=6, guidance=3.0, latents=lat))

    # diffusers: its PixArt transformer, its AutoencoderKL and its DDIMScheduler, from the same folder
    transformer = diffusers.PixArtTransformer2DModel.from_pretrained(tmp_path / "transformer").eval()
    vae = diffusers.AutoencoderKL.from_pretrained(tmp_path / "vae").eval()
    sched = diffusers.DDIMScheduler.from_pretrained(tmp_path / "scheduler")
    assert json.loads((tmp_path / "scheduler" / "scheduler_config.json").read_text())["prediction_type"] == \
        "v_prediction"
    sched.set_timesteps(6)
    text, uncond = pipe.encode_prompts(prompts), pipe.encode_prompts([""] * 2)
    x = lat * sched.init_noise_sigma
    with torch.no_grad():
        for t in sched.timesteps:
            inp = sched.scale_model_input(torch.cat([x, x]), t)
            out = transformer(inp, encoder_hidden_states=torch.cat([uncond, text]),
                              timestep=torch.full((4,), float(t))).sample
            u, c = out.chunk(2)
            x = sched.step(u + 3.0 * (c - u), t, x).prev_sample
        img = vae.decode(x / vae.config.scaling_factor).sample.clamp(-1, 1)
    assert (img - ours).abs().max().item() <= 1e-5


def test_missing_folder_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_index.json"):
        DiffusionPipeline.from_pretrained(tmp_path)


def test_grid_shape():
    g = image_grid(torch.zeros(12, 1, 28, 28), nrow=5)
    assert g.shape == (3 * 30, 5 * 30, 1) and g.dtype == torch.uint8
