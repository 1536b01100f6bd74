"""Stable Diffusion folders: a tiny SD pipeline built from diffusers' / transformers' own classes and saved with
`save_pretrained` loads into `DiffusionPipeline`, and a whole 25-step text-to-image run equals diffusers'
`StableDiffusionPipeline` from the same latents and prompts; fp16 folders, export round trip, errors."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

from scratchlm.diffusion.pipeline import DiffusionPipeline, is_pipeline_dir  # noqa: E402
from tests.diffusion.helpers import sd_folder  # noqa: E402

TOL = 1e-4  # images in [0, 1] after 25 fp32 steps with CFG (measured below 1e-6: see docs/diffusion.md)
PROMPTS = ["a red fox in the snow", "an astronaut riding a horse"]
NEGATIVE = ["blurry, low quality", ""]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on a shared 2-core machine: one thread each (two oversubscribe and run ~20x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def reference_images(path, latents, steps=25, guidance=7.5, negative=None, variant=None, **kw) -> torch.Tensor:
    ref = diffusers.StableDiffusionPipeline.from_pretrained(path, variant=variant, torch_dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    with torch.no_grad():
        return ref(PROMPTS, negative_prompt=negative, latents=latents.clone(), num_inference_steps=steps,
                   guidance_scale=guidance, output_type="pt", **kw).images  # (B, 3, H, W) in [0, 1]


def ours_images(pipe, latents, steps=25, guidance=7.5, negative=None, **kw) -> torch.Tensor:
    return (pipe(PROMPTS, steps=steps, guidance=guidance, latents=latents, negative_prompts=negative, **kw) + 1) / 2


@pytest.mark.parametrize("scheduler,prediction", [("DDIMScheduler", "epsilon"),
                                                  ("EulerDiscreteScheduler", "v_prediction"),
                                                  ("LMSDiscreteScheduler", "epsilon")])
def test_25_step_run_equals_stable_diffusion_pipeline(tmp_path, scheduler, prediction):
    sd_folder(tmp_path, scheduler, prediction=prediction)
    assert is_pipeline_dir(tmp_path)
    pipe = DiffusionPipeline.from_pretrained(tmp_path)
    assert pipe.is_sd and pipe.unet is not None and pipe.transformer is None
    assert pipe.sampler == {"DDIMScheduler": "ddim", "EulerDiscreteScheduler": "euler",
                            "LMSDiscreteScheduler": "lms"}[scheduler]
    assert pipe.image_hw == (16, 16) and pipe.notes == []
    lat = pipe.initial_latents(2, seed=3)
    want = reference_images(tmp_path, lat, negative=NEGATIVE)
    got = ours_images(pipe, lat, negative=NEGATIVE)
    assert got.shape == want.shape == (2, 3, 16, 16)
    err = (got - want).abs().max().item()
    print(f"{scheduler}: max |ours - diffusers| over the 25-step image = {err:.2e}")
    assert err <= TOL
    # the loop really depends on the prompt and the negative prompt (else equality would prove little)
    assert (ours_images(pipe, lat) - got).abs().max() > 1e-3


def test_guidance_rescale_and_clip_skip_match(tmp_path):
    sd_folder(tmp_path)
    pipe = DiffusionPipeline.from_pretrained(tmp_path)
    lat = pipe.initial_latents(2, seed=1)
    want = reference_images(tmp_path, lat, steps=6, guidance_rescale=0.7)
    assert (ours_images(pipe, lat, steps=6, guidance_rescale=0.7) - want).abs().max().item() <= TOL
    # clip_skip: diffusers 0.42's own clip_skip path reaches for `text_encoder.text_model`, which transformers 5's
    # CLIPTextModel no longer has, so the reference embeddings come from transformers directly (hidden_states[-2]
    # through the final layer norm, as diffusers means it) and go in as prompt_embeds
    pipe.clip_skip = 1
    ref = diffusers.StableDiffusionPipeline.from_pretrained(tmp_path)
    ids = ref.tokenizer(PROMPTS + ["", ""], padding="max_length", max_length=77, truncation=True,
                        return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = ref.text_encoder(ids, output_hidden_states=True).hidden_states[-2]
        emb = ref.text_encoder.final_layer_norm(hidden)
        assert (pipe.encode_prompts(PROMPTS + ["", ""]) - emb).abs().max().item() <= 1e-5
        want = ref(prompt_embeds=emb[:2], negative_prompt_embeds=emb[2:], latents=lat.clone(), num_inference_steps=6,
                   guidance_scale=7.5, output_type="pt").images
    assert (ours_images(pipe, lat, steps=6) - want).abs().max().item() <= TOL


def test_fp16_variant_folder_and_export_round_trip(tmp_path):
    src = sd_folder(tmp_path / "fp16", dtype=torch.float16, variant="fp16")
    assert (src / "unet" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    pipe = DiffusionPipeline.from_pretrained(src, variant="fp16")
    assert all(p.dtype == torch.float32 for p in pipe.unet.parameters())  # fp16 storage, fp32 compute
    lat = pipe.initial_latents(2, seed=2)
    ours = ours_images(pipe, lat, steps=8)
    assert (ours - reference_images(src, lat, steps=8, variant="fp16")).abs().max().item() <= TOL

    out = tmp_path / "export"
    pipe.save_pretrained(out)
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionPipeline" and index["unet"] == ["diffusers", "UNet2DConditionModel"]
    assert (ours - reference_images(out, lat, steps=8)).abs().max().item() <= TOL  # diffusers loads the export
    assert torch.equal(ours_images(DiffusionPipeline.from_pretrained(out), lat, steps=8), ours)

    out16 = tmp_path / "export16"
    pipe.save_pretrained(out16, dtype=torch.float16, variant="fp16")
    again = DiffusionPipeline.from_pretrained(out16, variant="fp16")
    assert torch.equal(ours_images(again, lat, steps=8), ours)  # fp16 -> fp32 -> fp16 is lossless


@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
def test_pndm_folder_25_step_run_equals_stable_diffusion_pipeline(tmp_path, caplog, prediction):
    """SD 1.5's own scheduler (PNDMScheduler, PLMS with skip_prk_steps) runs as itself: diffusers' default image."""
    sd_folder(tmp_path, "PNDMScheduler", prediction=prediction)
    with caplog.at_level("WARNING"):
        pipe = DiffusionPipeline.from_pretrained(tmp_path)
    assert pipe.sampler == "pndm" and pipe.notes == [] and "PNDM" not in caplog.text
    lat = pipe.initial_latents(2, seed=4)
    want = reference_images(tmp_path, lat, negative=NEGATIVE)
    got = ours_images(pipe, lat, negative=NEGATIVE)
    err = (got - want).abs().max().item()
    print(f"PNDMScheduler ({prediction}): max |ours - diffusers| over the 25-step image = {err:.2e}")
    assert err <= TOL
    # and it is not DDIM on the same schedule (what used to run): the equality above says something about PLMS
    assert (ours_images(pipe, lat, negative=NEGATIVE, sampler="ddim") - got).abs().max().item() > 10 * TOL


@pytest.mark.parametrize("settings", [{}, {"use_karras_sigmas": True, "prediction_type": "v_prediction"}])
def test_dpmsolver_folder_25_step_run_equals_stable_diffusion_pipeline(tmp_path, settings):
    """DPM-Solver++ 2M (and "2M Karras" on a v-prediction model) as a folder's scheduler: diffusers' image."""
    sd_folder(tmp_path, "DPMSolverMultistepScheduler", prediction=settings.get("prediction_type", "epsilon"))
    sch = tmp_path / "scheduler" / "scheduler_config.json"
    sch.write_text(json.dumps(json.loads(sch.read_text()) | settings))
    pipe = DiffusionPipeline.from_pretrained(tmp_path)
    assert pipe.sampler == "dpmpp" and pipe.notes == [] and pipe.schedule.use_karras_sigmas == bool(settings)
    lat = pipe.initial_latents(2, seed=5)
    want = reference_images(tmp_path, lat, negative=NEGATIVE)
    got = ours_images(pipe, lat, negative=NEGATIVE)
    err = (got - want).abs().max().item()
    print(f"DPMSolverMultistepScheduler {settings}: max |ours - diffusers| over the 25-step image = {err:.2e}")
    assert err <= TOL
    # the equality says something about the solver (vs DDIM) and about the Karras sigmas (vs without them)
    other = dict(sampler="ddim")
    if settings:
        pipe.schedule, other = dataclasses.replace(pipe.schedule, use_karras_sigmas=False), {}
    assert (ours_images(pipe, lat, negative=NEGATIVE, **other) - got).abs().max().item() > 10 * TOL


def test_euler_ancestral_folder_25_step_run_equals_stable_diffusion_pipeline(tmp_path):
    """Euler ancestral adds fresh noise every step: ours draws it from torch.Generator().manual_seed(seed + 1), so
    diffusers given that generator (and the same latents) draws the same noise and makes the same image."""
    sd_folder(tmp_path, "EulerAncestralDiscreteScheduler")
    pipe = DiffusionPipeline.from_pretrained(tmp_path)
    assert pipe.sampler == "euler_a" and pipe.notes == []
    lat = pipe.initial_latents(2, seed=6)
    want = reference_images(tmp_path, lat, negative=NEGATIVE, generator=torch.Generator().manual_seed(7 + 1))
    got = ours_images(pipe, lat, negative=NEGATIVE, seed=7)
    err = (got - want).abs().max().item()
    print(f"EulerAncestralDiscreteScheduler: max |ours - diffusers| over the 25-step image = {err:.2e}")
    assert err <= TOL
    assert (ours_images(pipe, lat, negative=NEGATIVE, seed=8) - got).abs().max().item() > 10 * TOL  # noise matters


def test_long_prompt_is_cut_at_77_and_said(tmp_path, caplog):
    sd_folder(tmp_path)
    pipe = DiffusionPipeline.from_pretrained(tmp_path)
    long = " ".join(["a red fox in the snow"] * 30)
    with caplog.at_level("WARNING"):
        emb = pipe.encode_prompts([long])
    assert emb.shape[1] == 77 and "the text encoder reads the first 77" in caplog.text


def test_outdated_scheduler_config_is_rewritten_as_diffusers_does(tmp_path):
    """StableDiffusionPipeline forces steps_offset 1 and clip_sample False on load, and sample_size 64 for an old
    (< 0.9) UNet config below it: so do we, with notes."""
    sd_folder(tmp_path)
    cfg_path = tmp_path / "scheduler" / "scheduler_config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["clip_sample"]  # DDIM's default: True
    cfg["steps_offset"] = 0
    cfg_path.write_text(json.dumps(cfg))
    _edit(tmp_path / "unet" / "config.json", _diffusers_version="0.3.0")  # sample_size 8 < 64: SD 1.4's old case
    pipe = DiffusionPipeline.from_pretrained(tmp_path)
    assert pipe.latent_size == 64 and any("sample_size 8 from diffusers 0.3.0 -> 64" in n for n in pipe.notes)
    assert pipe.schedule.steps_offset == 1 and not pipe.schedule.clip_sample
    assert any("steps_offset 0 -> 1" in n for n in pipe.notes) and any("clip_sample True" in n for n in pipe.notes)
    lat = pipe.initial_latents(2, seed=6, size=8)
    assert (ours_images(pipe, lat, steps=5) - reference_images(tmp_path, lat, steps=5)).abs().max().item() <= TOL


def test_safety_checker_entries_are_said_not_run(tmp_path):
    sd_folder(tmp_path)
    idx = json.loads((tmp_path / "model_index.json").read_text())
    idx["safety_checker"] = ["stable_diffusion", "StableDiffusionSafetyChecker"]
    idx["feature_extractor"] = ["transformers", "CLIPImageProcessor"]
    (tmp_path / "model_index.json").write_text(json.dumps(idx))
    notes = DiffusionPipeline.from_pretrained(tmp_path).notes
    assert any("safety_checker" in n and "not run" in n for n in notes)
    assert any("feature_extractor" in n and "not run" in n for n in notes)


@pytest.mark.parametrize("breakage,error,match", [
    (lambda p: shutil.rmtree(p / "unet"), FileNotFoundError, "unet"),
    (lambda p: (p / "vae" / "diffusion_pytorch_model.safetensors").unlink(), FileNotFoundError,
     "vae/diffusion_pytorch_model.safetensors"),
    (lambda p: (p / "text_encoder" / "config.json").unlink(), FileNotFoundError, "text_encoder/config.json"),
    (lambda p: (p / "scheduler" / "scheduler_config.json").unlink(), FileNotFoundError, "scheduler_config.json"),
    (lambda p: (p / "tokenizer" / "tokenizer.json").unlink(), FileNotFoundError, "tokenizer"),
    (lambda p: _edit(p / "model_index.json", _class_name="StableDiffusionXLInpaintPipeline"), ValueError,
     "StableDiffusionXLInpaintPipeline"),
    (lambda p: _edit(p / "model_index.json", text_encoder=["transformers", "T5EncoderModel"]), ValueError,
     "T5EncoderModel"),
    (lambda p: _edit(p / "model_index.json", controlnet=["diffusers", "ControlNetModel"]), ValueError, "controlnet"),
    (lambda p: _edit(p / "scheduler" / "scheduler_config.json", use_karras_sigmas=True), ValueError,
     "use_karras_sigmas"),
    (lambda p: _edit(p / "unet" / "config.json", made_up_field=3), ValueError, "made_up_field"),
])
def test_broken_folders_are_named(tmp_path, breakage, error, match):
    sd_folder(tmp_path)
    breakage(tmp_path)
    with pytest.raises(error, match=match):
        DiffusionPipeline.from_pretrained(tmp_path)


def _edit(path, **changes):
    path.write_text(json.dumps(json.loads(path.read_text()) | changes))


def test_sdxl_folder_25_steps_equal_stable_diffusion_xl_pipeline(tmp_path):
    from tests.diffusion.helpers import sdxl_folder

    sdxl_folder(tmp_path)
    pipe = DiffusionPipeline.from_pretrained(tmp_path)
    assert pipe.is_sdxl and pipe.sampler == "euler" and pipe.force_zeros_for_empty_prompt
    ref = diffusers.StableDiffusionXLPipeline.from_pretrained(tmp_path, add_watermarker=False)
    ref.set_progress_bar_config(disable=True)
    lat = pipe.initial_latents(2, seed=5)
    images = []
    for negative in (NEGATIVE, None):  # None: SDXL's all-zero unconditional embeddings
        with torch.no_grad():
            want = ref(PROMPTS, negative_prompt=negative, latents=lat.clone(), num_inference_steps=25,
                       guidance_scale=5.0, output_type="pt").images
        got = ours_images(pipe, lat, guidance=5.0, negative=negative)
        err = (got - want).abs().max().item()
        print(f"SDXL (negative={negative}): max |ours - diffusers| over the 25-step image = {err:.2e}")
        assert err <= TOL
        images.append(got)
    assert (images[0] - images[1]).abs().max() > 1e-3  # the two unconditional inputs really differ
    pipe.save_pretrained(tmp_path / "export", dtype=torch.float16)
    index = json.loads((tmp_path / "export" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusionXLPipeline" and index["force_zeros_for_empty_prompt"] is True
    again = diffusers.StableDiffusionXLPipeline.from_pretrained(tmp_path / "export", add_watermarker=False)
    assert again.text_encoder_2.config.projection_dim == 12 and again.tokenizer_2.pad_token == "!"


@pytest.mark.slow
def test_sd15_shaped_25_steps_equal_stable_diffusion_pipeline(tmp_path):
    """SD 1.5's layout at reduced width (UNet 32/64/128/128, 32x32 latents -> 256x256 images), 25 DDIM steps with
    CFG 7.5 and a negative prompt: the same image as diffusers within TOL (measured in docs/diffusion.md)."""
    from tests.diffusion.helpers import SD15_SHAPE

    sd_folder(tmp_path, shape=SD15_SHAPE)
    pipe = DiffusionPipeline.from_pretrained(tmp_path)
    lat = pipe.initial_latents(2, seed=3)
    want = reference_images(tmp_path, lat, negative=NEGATIVE)
    got = ours_images(pipe, lat, negative=NEGATIVE)
    assert got.shape == (2, 3, 256, 256)
    err = (got - want).abs().max().item()
    print(f"SD 1.5-shaped: max |ours - diffusers| over the 25-step 256x256 image = {err:.2e}")
    assert err <= TOL
