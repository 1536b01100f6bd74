"""The SD-shaped MNIST recipe (recipes/diffusion_sd_mnist.toml) end to end on a tiny config through the CLI:
a few steps on 64 images, an SD pipeline folder that loads and samples. No quality asserts (docs/diffusion.md and
benchmarks/diffusion_sd_mnist.py measure the trained model)."""

from __future__ import annotations

import json

import pytest

from scratchlm.cli import main
from scratchlm.config import load_config
from scratchlm.diffusion.train import DiffusionTrainConfig, SDUNetRecipe
from tests.conftest import REPO_ROOT

RECIPE = REPO_ROOT / "recipes" / "diffusion_sd_mnist.toml"


def test_recipe_reads_as_sd():
    cfg = load_config(DiffusionTrainConfig, RECIPE)
    assert cfg.architecture == "sd" and cfg.image_pad == 2 and cfg.vae_from == "shipped"
    assert cfg.unet.up_block_types == ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"]


def test_bad_recipe_values_are_errors():
    with pytest.raises(ValueError, match="architecture"):
        DiffusionTrainConfig(architecture="sdxl")
    with pytest.raises(ValueError, match="down_block_types"):
        SDUNetRecipe(block_out_channels=[8, 16], down_block_types=["DownBlock2D"])
    with pytest.raises(ValueError, match="AttnDownBlock2D"):
        SDUNetRecipe(block_out_channels=[8], down_block_types=["AttnDownBlock2D"])


def test_cli_trains_a_tiny_sd_pipeline_that_loads(tmp_path, data_dir, capsys):
    from scratchlm.diffusion.pipeline import DiffusionPipeline
    from scratchlm.diffusion.unet import UNet2DConditionModel

    out = tmp_path / "run"
    rc = main(["diffusion", "train", "--config", str(RECIPE), "--data-dir", str(data_dir / "images" / "mnist"),
               "--out-dir", str(out), "--max-images", "64", "--dit-batch", "4", "--dit-max-steps", "2",
               "--log-every", "1", "--unet-block-out-channels", "8", "16", "--unet-down-block-types", "DownBlock2D",
               "CrossAttnDownBlock2D", "--unet-attention-head-dim", "2", "--unet-norm-num-groups", "4",
               "--clip-hidden-size", "16", "--clip-intermediate-size", "32", "--clip-num-hidden-layers", "1",
               "--clip-num-attention-heads", "2"])
    assert rc == 0, capsys.readouterr().err
    folder = out / "pipeline"
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline"
    for sub in ("unet", "vae", "text_encoder", "tokenizer", "scheduler"):
        assert (folder / sub).is_dir(), sub
    log = json.loads((out / "train_log.json").read_text())["log"]
    assert [r["done_steps"] for r in log if "done_steps" in r] == [2]
    assert any("scaling_factor_on_padded" in r for r in log)  # the shipped VAE's scale, measured on 32x32
    assert json.loads((folder / "scheduler" / "scheduler_config.json").read_text())["steps_offset"] == 1
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert isinstance(pipe.denoiser, UNet2DConditionModel) and pipe.latent_hw == (8, 8)
    assert pipe(["a handwritten seven"], steps=2).shape == (1, 1, 32, 32)
