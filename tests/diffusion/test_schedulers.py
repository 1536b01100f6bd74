"""Every sampler step equals diffusers' scheduler on the same inputs; the training targets are right."""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from scratchlm.diffusion.schedulers import (  # noqa: E402
    DDIMSampler,
    DDPMSampler,
    EulerSampler,
    NoiseSchedule,
    ScheduleConfig,
    cfg_combine,
)

PAIRS = [(DDPMSampler, "DDPMScheduler"), (DDIMSampler, "DDIMScheduler"), (EulerSampler, "EulerDiscreteScheduler")]


def _reference(name: str, cfg: ScheduleConfig):
    kw = cfg.diffusers_config()
    if name != "DDIMScheduler":
        kw.pop("set_alpha_to_one")
    if name == "EulerDiscreteScheduler":
        kw.pop("clip_sample")
    return getattr(diffusers, name)(**kw)


@pytest.mark.parametrize("ours_cls,ref_name", PAIRS)
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("spacing,beta", [("leading", "linear"), ("trailing", "squaredcos_cap_v2"),
                                          ("trailing", "scaled_linear")])
def test_steps_match_diffusers(ours_cls, ref_name, prediction, spacing, beta):
    cfg = ScheduleConfig(prediction_type=prediction, timestep_spacing=spacing, beta_schedule=beta)
    ref, ours = _reference(ref_name, cfg), ours_cls(cfg)
    ref.set_timesteps(25)
    ours.set_timesteps(25)
    assert torch.equal(ref.timesteps.float(), ours.timesteps.float())
    assert abs(float(ref.init_noise_sigma) - float(ours.init_noise_sigma)) <= 1e-5 * float(ref.init_noise_sigma)
    torch.manual_seed(0)
    x = torch.randn(2, 4, 7, 7) * float(ref.init_noise_sigma)
    for i, t in enumerate(ref.timesteps):  # every step of a whole trajectory, from the same state
        out = torch.randn(2, 4, 7, 7)
        assert (ref.scale_model_input(x, t) - ours.scale_model_input(x, t)).abs().max() <= 1e-5
        want = ref.step(out, t, x, generator=torch.Generator().manual_seed(i)).prev_sample
        got = ours.step(out, t, x, generator=torch.Generator().manual_seed(i))
        assert (want - got).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
        x = want


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_training_side_matches_diffusers(prediction):
    cfg = ScheduleConfig(prediction_type=prediction)
    ref, ours = _reference("DDPMScheduler", cfg), NoiseSchedule(cfg)
    x0, noise, t = torch.randn(3, 4, 7, 7), torch.randn(3, 4, 7, 7), torch.tensor([0, 500, 999])
    assert torch.allclose(ref.add_noise(x0, noise, t), ours.add_noise(x0, noise, t), atol=1e-6)
    want = noise if prediction == "epsilon" else ref.get_velocity(x0, noise, t)
    assert torch.allclose(want, ours.target(x0, noise, t), atol=1e-6)


def test_cfg_combine():
    u, c = torch.randn(5), torch.randn(5)
    assert torch.equal(cfg_combine(u, c, 1.0), c) or torch.allclose(cfg_combine(u, c, 1.0), c)
    assert torch.allclose(cfg_combine(u, c, 3.0), u + 3 * (c - u))


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="prediction_type"):
        ScheduleConfig(prediction_type="sample")
    with pytest.raises(ValueError, match="exceed"):
        DDIMSampler(ScheduleConfig(num_train_timesteps=10)).set_timesteps(20)
