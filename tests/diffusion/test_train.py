"""The training recipe end to end on a few steps (slow: it encodes the whole 8k split through the VAE)."""

from __future__ import annotations

import dataclasses

import pytest

from scratchlm.config import load_config
from scratchlm.diffusion.pipeline import DiffusionPipeline
from scratchlm.diffusion.train import DiffusionTrainConfig, run_training
from tests.conftest import REPO_ROOT


@pytest.mark.slow
def test_recipe_runs_and_saves_a_loadable_pipeline(tmp_path, data_dir):
    cfg = load_config(DiffusionTrainConfig, REPO_ROOT / "recipes" / "diffusion_mnist.toml")
    cfg = dataclasses.replace(cfg, data_dir=str(data_dir / "images" / "mnist"), out_dir=str(tmp_path),
                              vae_max_steps=2, dit_max_steps=2, log_every=1)
    pipe = run_training(cfg, log_fn=lambda s: None)
    again = DiffusionPipeline.from_pretrained(tmp_path / "pipeline")
    assert again.schedule.timestep_spacing == "leading"
    assert pipe(["a handwritten seven"], steps=2).shape == (1, 1, 28, 28)


def test_budget_clock_is_validated():
    with pytest.raises(ValueError, match="budget_clock"):
        DiffusionTrainConfig(budget_clock="gpu")


@pytest.mark.slow
def test_vae_from_reuses_a_trained_vae(tmp_path, data_dir):
    import torch

    cfg = load_config(DiffusionTrainConfig, REPO_ROOT / "recipes" / "diffusion_mnist.toml")
    cfg = dataclasses.replace(cfg, data_dir=str(data_dir / "images" / "mnist"), out_dir=str(tmp_path / "a"),
                              vae_max_steps=3, dit_max_steps=1, log_every=1)
    first = run_training(cfg, log_fn=lambda s: None)
    logs: list[str] = []
    cfg = dataclasses.replace(cfg, out_dir=str(tmp_path / "b"), vae_from=str(tmp_path / "a" / "vae_stage"))
    second = run_training(cfg, log_fn=logs.append)
    assert "reused" in logs[0] and not (tmp_path / "b" / "vae_stage").exists()
    for k, v in first.vae.state_dict().items():
        assert torch.equal(v, second.vae.state_dict()[k]), k
    assert second.vae.config.scaling_factor == first.vae.config.scaling_factor
