"""A tiny random-weight pipeline for the tests (seconds to build, no training)."""

from __future__ import annotations

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
