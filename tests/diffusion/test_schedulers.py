"""Every sampler step equals diffusers' scheduler on the same inputs; the training targets are right."""

from __future__ import annotations

import json
from inspect import signature

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from scratchlm.diffusion.schedulers import (  # noqa: E402
    DDIMSampler,
    DDPMSampler,
    DPMSolverSampler,
    EulerAncestralSampler,
    EulerSampler,
    LMSSampler,
    NoiseSchedule,
    PNDMSampler,
    ScheduleConfig,
    cfg_combine,
)

PAIRS = [(DDPMSampler, "DDPMScheduler"), (DDIMSampler, "DDIMScheduler"), (EulerSampler, "EulerDiscreteScheduler"),
         (EulerAncestralSampler, "EulerAncestralDiscreteScheduler"),  # ancestral: the same generator, same noise
         (LMSSampler, "LMSDiscreteScheduler")]


def _gen(ref, i: int) -> dict:
    """generator= for the schedulers whose step draws noise (PNDM's and LMS's step take none)."""
    return {"generator": torch.Generator().manual_seed(i)} if "generator" in signature(ref.step).parameters else {}


def _reference(name: str, cfg: ScheduleConfig):
    kw = cfg.diffusers_config()
    if name not in ("DDIMScheduler", "PNDMScheduler"):
        kw.pop("set_alpha_to_one")
    if name in ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler", "LMSDiscreteScheduler", "PNDMScheduler"):
        kw.pop("clip_sample")
        kw.pop("clip_sample_range")
    if name == "PNDMScheduler":
        kw["skip_prk_steps"] = cfg.skip_prk_steps
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
        want = ref.step(out, t, x, **_gen(ref, i)).prev_sample
        got = ours.step(out, t, x, generator=torch.Generator().manual_seed(i))
        assert (want - got).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
        x = want


@pytest.mark.parametrize("skip_prk", [True, False])
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("spacing,beta,alpha_one", [("leading", "scaled_linear", False), ("trailing", "linear", True),
                                                    ("linspace", "squaredcos_cap_v2", False)])
def test_pndm_steps_match_diffusers(skip_prk, prediction, spacing, beta, alpha_one):
    """PLMS (and PRK + PLMS): its repeated timestep, the multistep history, the last step to alpha_bar_0 or 1."""
    cfg = ScheduleConfig(prediction_type=prediction, timestep_spacing=spacing, beta_schedule=beta,
                         set_alpha_to_one=alpha_one, skip_prk_steps=skip_prk, steps_offset=1 if alpha_one else 0)
    ref, ours = _reference("PNDMScheduler", cfg), PNDMSampler(cfg)
    for n in (25, 7):  # set_timesteps again resets the history
        ref.set_timesteps(n)
        ours.set_timesteps(n)
        assert torch.equal(ref.timesteps, ours.timesteps)
        assert len(ours.timesteps) == (n + 1 if skip_prk else n + 9)
        torch.manual_seed(n)
        x = torch.randn(2, 4, 5, 5)
        for t in ref.timesteps:
            out = torch.randn(2, 4, 5, 5)
            assert torch.equal(ours.scale_model_input(x, t), x)
            want = ref.step(out, t, x).prev_sample
            got = ours.step(out, t, x)
            assert (want - got).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
            x = want


@pytest.mark.parametrize("order,solver,karras,final", [
    (2, "midpoint", False, "zero"), (2, "heun", False, "sigma_min"), (2, "midpoint", True, "zero"),
    (1, "midpoint", False, "zero"), (2, "midpoint", True, "sigma_min")])
@pytest.mark.parametrize("prediction,spacing,beta", [("epsilon", "linspace", "scaled_linear"),
                                                     ("v_prediction", "leading", "linear"),
                                                     ("epsilon", "trailing", "squaredcos_cap_v2")])
def test_dpmsolver_steps_match_diffusers(order, solver, karras, final, prediction, spacing, beta):
    """DPM-Solver++ (2M and 1S): timesteps, sigmas (Karras too), the first / last lower-order steps, every step."""
    cfg = ScheduleConfig(prediction_type=prediction, timestep_spacing=spacing, beta_schedule=beta, steps_offset=1,
                         solver_order=order, solver_type=solver, use_karras_sigmas=karras, final_sigmas_type=final)
    ref = diffusers.DPMSolverMultistepScheduler(
        num_train_timesteps=1000, beta_start=cfg.beta_start, beta_end=cfg.beta_end, beta_schedule=beta,
        prediction_type=prediction, timestep_spacing=spacing, steps_offset=1, solver_order=order, solver_type=solver,
        use_karras_sigmas=karras, final_sigmas_type=final)
    ours = DPMSolverSampler(cfg)
    if karras and beta == "squaredcos_cap_v2":  # its huge top sigma repeats the first (truncated) timestep
        ref.set_timesteps(25)
        with pytest.raises(ValueError, match="first timestep"):
            ours.set_timesteps(25)
        with pytest.raises(IndexError):  # diffusers starts at the repeat and runs past its sigmas
            x = torch.zeros(1, 4, 2, 2)
            for t in ref.timesteps:
                x = ref.step(x, t, x).prev_sample
        return
    for n in (25, 10):  # under 15 steps, lower_order_final makes the last step first order; a reset in between
        ref.set_timesteps(n)
        ours.set_timesteps(n)
        assert torch.equal(ref.timesteps, ours.timesteps)
        assert torch.equal(ref.sigmas, ours.sigmas)
        torch.manual_seed(n)
        x = torch.randn(2, 4, 5, 5)
        for t in ref.timesteps:
            out = torch.randn(2, 4, 5, 5)
            assert torch.equal(ours.scale_model_input(x, t), ref.scale_model_input(x, t))
            want = ref.step(out, t, x).prev_sample
            got = ours.step(out, t, x)
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


# --- scheduler_config.json as Stable Diffusion folders ship it ----------------------------------------------------
SD15_PNDM = {"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0", "beta_end": 0.012,
             "beta_schedule": "scaled_linear", "beta_start": 0.00085, "num_train_timesteps": 1000,
             "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1, "trained_betas": None,
             "clip_sample": False}
SD21_DDIM = {"_class_name": "DDIMScheduler", "_diffusers_version": "0.8.0", "beta_end": 0.012,
             "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False, "num_train_timesteps": 1000,
             "prediction_type": "v_prediction", "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
             "trained_betas": None}
SDXL_EULER = {"_class_name": "EulerDiscreteScheduler", "_diffusers_version": "0.19.0.dev0", "beta_end": 0.012,
              "beta_schedule": "scaled_linear", "beta_start": 0.00085, "clip_sample": False,
              "interpolation_type": "linear", "num_train_timesteps": 1000, "prediction_type": "epsilon",
              "sample_max_value": 1.0, "set_alpha_to_one": False, "skip_prk_steps": True, "steps_offset": 1,
              "timestep_spacing": "leading", "trained_betas": None, "use_karras_sigmas": False}


def _saved_config(tmp_path, sched) -> dict:
    """The config as diffusers writes it (save_config), so every default the class has is in it."""
    sched.save_config(tmp_path)
    return json.loads((tmp_path / "scheduler_config.json").read_text())


def _same_trajectory(ref, ours, steps: int = 25):
    ref.set_timesteps(steps)
    ours.set_timesteps(steps)
    assert torch.equal(ref.timesteps.float(), ours.timesteps.float())
    assert abs(float(ref.init_noise_sigma) - float(ours.init_noise_sigma)) <= 1e-5 * float(ref.init_noise_sigma)
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, 5) * float(ref.init_noise_sigma)
    for i, t in enumerate(ref.timesteps):
        out = torch.randn(2, 4, 5, 5) * 3  # large enough that clip_sample clamps
        assert (ref.scale_model_input(x, t) - ours.scale_model_input(x, t)).abs().max() <= 1e-5
        want = ref.step(out, t, x, **_gen(ref, i)).prev_sample
        got = ours.step(out, t, x, generator=torch.Generator().manual_seed(i))
        assert (want - got).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())
        x = want


@pytest.mark.parametrize("cls_name,kw,sampler", [
    ("DDIMScheduler", SD21_DDIM, "ddim"),                                     # SD 2.1: v, offset 1, alpha_0 last
    ("DDIMScheduler", {"timestep_spacing": "linspace"}, "ddim"),              # class defaults: clip_sample on
    ("DDIMScheduler", {"timestep_spacing": "trailing", "set_alpha_to_one": False, "clip_sample_range": 0.5}, "ddim"),
    ("EulerDiscreteScheduler", SDXL_EULER, "euler"),                          # SDXL's, with DDIM / PNDM keys in it
    ("EulerDiscreteScheduler", {"prediction_type": "v_prediction"}, "euler"),  # default spacing: linspace
    ("DDPMScheduler", {"steps_offset": 1, "beta_schedule": "scaled_linear"}, "ddpm"),  # clip_sample on
    ("EulerAncestralDiscreteScheduler", SDXL_EULER, "euler_a"),
    ("LMSDiscreteScheduler", SD15_PNDM, "lms"),
    ("PNDMScheduler", SD15_PNDM, "pndm"),                                     # SD 1.5's: PLMS, alpha_0 last
    ("PNDMScheduler", {"prediction_type": "v_prediction"}, "pndm"),           # class default: PRK steps first
    ("DPMSolverMultistepScheduler", {**SD15_PNDM, "use_karras_sigmas": True}, "dpmpp"),  # "DPM++ 2M Karras" on SD
    ("DPMSolverMultistepScheduler", {"prediction_type": "v_prediction", "solver_order": 1}, "dpmpp"),
])
def test_scheduler_config_reads_into_the_same_sampler(tmp_path, cls_name, kw, sampler):
    from scratchlm.diffusion.schedulers import make_sampler, schedule_from_diffusers

    kw = {k: v for k, v in kw.items() if not k.startswith("_")}
    ref = getattr(diffusers, cls_name).from_config(kw)
    cfg, name, note = schedule_from_diffusers(_saved_config(tmp_path, ref) | {k: v for k, v in kw.items()})
    assert name == sampler and note is None
    _same_trajectory(ref, make_sampler(name, cfg))


@pytest.mark.parametrize("sampler,kw", [("pndm", {"skip_prk_steps": False}), ("dpmpp", {"use_karras_sigmas": True}),
                                        ("dpmpp", {"solver_type": "heun", "final_sigmas_type": "sigma_min"})])
def test_export_config_reads_back_into_diffusers_and_us(tmp_path, sampler, kw):
    """What a pipeline without a folder config writes (diffusers_config(sampler)) keeps the sampler's own settings."""
    from scratchlm.diffusion.schedulers import make_sampler, schedule_from_diffusers, scheduler_class_for

    cfg = ScheduleConfig(beta_schedule="scaled_linear", prediction_type="v_prediction", **kw)
    written = {"_class_name": scheduler_class_for(sampler), **cfg.diffusers_config(sampler)}
    (tmp_path / "scheduler_config.json").write_text(json.dumps(written))
    ref = getattr(diffusers, written["_class_name"]).from_pretrained(tmp_path)
    assert all(ref.config[k] == v for k, v in kw.items())
    back, name, _ = schedule_from_diffusers(written)
    assert name == sampler and back == cfg
    _same_trajectory(ref, make_sampler(name, back))


@pytest.mark.parametrize("change,match", [
    ({"_class_name": "HeunDiscreteScheduler"}, "HeunDiscreteScheduler"),
    ({"use_karras_sigmas": True}, "use_karras_sigmas"),
    ({"rescale_betas_zero_snr": True}, "rescale_betas_zero_snr"),
    ({"trained_betas": [0.1, 0.2]}, "trained_betas"),
    ({"prediction_type": "sample"}, "prediction_type"),
    ({"timestep_spacing": "karras"}, "timestep_spacing"),
    ({"made_up_field": 1}, "made_up_field"),
    ({"final_sigmas_type": "sigma_min"}, "final_sigmas_type"),                   # Euler's is not implemented
    ({"_class_name": "DPMSolverMultistepScheduler", "algorithm_type": "sde-dpmsolver++"}, "algorithm_type"),
    ({"_class_name": "DPMSolverMultistepScheduler", "solver_order": 3}, "solver_order"),
    ({"_class_name": "DPMSolverMultistepScheduler", "lambda_min_clipped": -5.1}, "lambda_min_clipped"),
    ({"_class_name": "DPMSolverMultistepScheduler", "variance_type": "learned_range"}, "variance_type"),
])
def test_unsupported_scheduler_fields_are_named(change, match):
    from scratchlm.diffusion.schedulers import schedule_from_diffusers

    with pytest.raises(ValueError, match=match):
        schedule_from_diffusers(SDXL_EULER | change, "x/scheduler_config.json")


def test_draws_noise_says_which_samplers_add_noise():
    """Callers that step pieces of x (patch parallel) key their full-size noise draw on it."""
    from scratchlm.diffusion.schedulers import SAMPLERS

    noisy = {name for name, cls in SAMPLERS.items() if cls(ScheduleConfig()).draws_noise}
    assert noisy == {"ddpm", "euler_a"} and DDIMSampler(ScheduleConfig(), eta=0.5).draws_noise
    x, out = torch.randn(1, 2, 3, 3), torch.randn(1, 2, 3, 3)
    for name, cls in SAMPLERS.items():  # the others are deterministic: no generator, the same step twice
        if name not in noisy:
            a, b = cls(ScheduleConfig()), cls(ScheduleConfig())
            a.set_timesteps(5)
            b.set_timesteps(5)
            t = a.timesteps[0]
            assert torch.equal(a.step(out, t, x), b.step(out, t, x, generator=torch.Generator().manual_seed(3)))
