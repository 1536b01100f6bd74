"""Tiny random-weight pipelines for the tests (seconds to build, no training): scratchlm's DiT one, and a Stable
Diffusion folder written by diffusers' own StableDiffusionPipeline.save_pretrained."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from scratchlm.diffusion.data import prompt_corpus
from scratchlm.diffusion.dit import DiT, DiTConfig
from scratchlm.diffusion.pipeline import DiffusionPipeline
from scratchlm.diffusion.schedulers import ScheduleConfig
from scratchlm.diffusion.text import PromptTokenizer, TextEncoder, TextEncoderConfig
from scratchlm.diffusion.vae import AutoencoderKL, VAEConfig


def tiny_pipeline(path: Path | None = None, latent: int = 4, d: int = 32, seed: int = 0,
                  prediction: str = "v_prediction") -> DiffusionPipeline:
    torch.manual_seed(seed)
    tok = PromptTokenizer.train(prompt_corpus(), 280, 6)
    text = TextEncoder(TextEncoderConfig(vocab_size=tok.vocab_size, d_model=d, n_layers=1, n_heads=2, d_ff=64,
                                         max_len=6))
    dit = DiT(DiTConfig(sample_size=latent, in_channels=4, out_channels=4, patch_size=1, num_layers=2,
                        num_attention_heads=2, attention_head_dim=d // 2, cross_attention_dim=d))
    with torch.no_grad():
        for p in dit.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    vae = AutoencoderKL(VAEConfig(block_out_channels=(8, 8), norm_num_groups=4, scaling_factor=1.5))
    pipe = DiffusionPipeline(tok, text, dit, vae, ScheduleConfig(prediction_type=prediction), latent)
    if path is not None:
        pipe.save_pretrained(path)
    return pipe


CORPUS = ["a photo of a cat", "a painting of a red fox in the snow", "blurry, low quality", "an astronaut riding a "
          "horse on the moon", "a bowl of fruit, oil painting", "a dog", "the city at night, neon lights"]


# SD 1.5's UNet / VAE / text-encoder layout (4 levels, 2 ResNets per level, cross-attention in the first three,
# `attention_head_dim` 8 read as 8 heads, as SD 1.5's config has it) at a reduced width
SD15_SHAPE = dict(
    unet=dict(sample_size=32, layers_per_block=2, block_out_channels=(32, 64, 128, 128),
              down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
              up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3, cross_attention_dim=64,
              attention_head_dim=8, norm_num_groups=32),
    vae=dict(block_out_channels=(16, 32, 64, 64), down_block_types=["DownEncoderBlock2D"] * 4,
             up_block_types=["UpDecoderBlock2D"] * 4, norm_num_groups=16, layers_per_block=2, sample_size=256),
    text=dict(hidden_size=64, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4))
TINY_SHAPE = dict(
    unet=dict(sample_size=8, layers_per_block=1, block_out_channels=(8, 16),
              down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
              up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32, attention_head_dim=4,
              norm_num_groups=4),
    vae=dict(block_out_channels=(8, 16), down_block_types=["DownEncoderBlock2D"] * 2,
             up_block_types=["UpDecoderBlock2D"] * 2, norm_num_groups=4, sample_size=16),
    text=dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4))


def sd_folder(path, scheduler: str = "DDIMScheduler", dtype=torch.float32, variant=None, seed: int = 0,
              prediction: str = "epsilon", shape: dict = TINY_SHAPE):
    """An SD 1.x-shaped folder (tiny by default) written by diffusers' StableDiffusionPipeline.save_pretrained."""
    import diffusers
    import transformers

    from scratchlm.diffusion.clip_tokenizer import CLIPTokenizer

    torch.manual_seed(seed)
    tok = CLIPTokenizer.train(CORPUS, 60)
    tok.save_pretrained(path / "_tok")
    hf_tok = transformers.CLIPTokenizer.from_pretrained(path / "_tok")
    text = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=tok.vocab_size, max_position_embeddings=77, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shape["text"])).eval()
    unet = diffusers.UNet2DConditionModel(in_channels=4, out_channels=4, **shape["unet"]).eval()
    vae = diffusers.AutoencoderKL(**shape["vae"]).eval()
    with torch.no_grad():  # zero-initialised projections would hide mistakes
        for m in (unet, text, vae):
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    sched_kw = dict(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1,
                    prediction_type=prediction)
    if scheduler in ("DDIMScheduler", "DDPMScheduler"):
        sched_kw.update(clip_sample=False)
    if scheduler in ("DDIMScheduler", "PNDMScheduler"):
        sched_kw.update(set_alpha_to_one=False)
    if scheduler == "PNDMScheduler":
        sched_kw.update(skip_prk_steps=True)
    sched = getattr(diffusers, scheduler)(**sched_kw)
    pipe = diffusers.StableDiffusionPipeline(vae=vae, text_encoder=text, tokenizer=hf_tok, unet=unet, scheduler=sched,
                                             safety_checker=None, feature_extractor=None,
                                             requires_safety_checker=False)
    pipe.to(dtype).save_pretrained(path, variant=variant)
    shutil.rmtree(path / "_tok")
    return path


def sdxl_folder(path, seed: int = 0):
    """A tiny SDXL-shaped folder (two CLIPs, the second with projection and "!" padding, a text_time UNet with
    transformer_layers_per_block, Euler) written by diffusers' StableDiffusionXLPipeline.save_pretrained."""
    import diffusers
    import transformers

    from scratchlm.diffusion.clip_tokenizer import CLIPTokenizer

    torch.manual_seed(seed)
    toks = []
    for i, pad in enumerate(("<|endoftext|>", "!")):
        CLIPTokenizer.train(CORPUS, 60, pad_token=pad).save_pretrained(path / f"_tok{i}")
        toks.append(transformers.CLIPTokenizer.from_pretrained(path / f"_tok{i}"))
    ids = dict(bos_token_id=toks[0].bos_token_id, eos_token_id=toks[0].eos_token_id)
    te1 = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        vocab_size=len(toks[0]), hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
        pad_token_id=toks[0].pad_token_id, **ids)).eval()
    te2 = transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
        vocab_size=len(toks[1]), hidden_size=16, intermediate_size=29, num_hidden_layers=2, num_attention_heads=2,
        projection_dim=12, hidden_act="gelu", pad_token_id=toks[1].pad_token_id, **ids)).eval()
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=48, attention_head_dim=(2, 4), use_linear_projection=True, norm_num_groups=4,
        addition_embed_type="text_time", addition_time_embed_dim=4, projection_class_embeddings_input_dim=6 * 4 + 12,
        transformer_layers_per_block=(1, 2)).eval()
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=["DownEncoderBlock2D"] * 2,
                                  up_block_types=["UpDecoderBlock2D"] * 2, norm_num_groups=4, sample_size=16,
                                  scaling_factor=0.13025).eval()
    with torch.no_grad():
        for m in (unet, te1, te2, vae):
            for p in m.parameters():
                p.add_(torch.randn_like(p) * 0.02)
    sched = diffusers.EulerDiscreteScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                             steps_offset=1, timestep_spacing="leading")
    pipe = diffusers.StableDiffusionXLPipeline(vae=vae, text_encoder=te1, text_encoder_2=te2, tokenizer=toks[0],
                                               tokenizer_2=toks[1], unet=unet, scheduler=sched,
                                               force_zeros_for_empty_prompt=True, add_watermarker=False)
    pipe.save_pretrained(path)
    for i in range(2):
        shutil.rmtree(path / f"_tok{i}")
    return path
