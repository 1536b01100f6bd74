"""The text-to-image pipeline: prompt -> text tokens -> DiT denoising loop (with CFG) -> VAE decode.

A pipeline folder is laid out like a diffusers one, and its `vae/` and `transformer/` folders *are*
diffusers checkpoints (AutoencoderKL, PixArtTransformer2DModel), `scheduler/scheduler_config.json` is
a diffusers scheduler config; the text encoder (scratchlm's own) and its BPE tokenizer sit beside them:

    model_index.json  vae/  transformer/  scheduler/  text_encoder/  tokenizer/

A trained MNIST pipeline ships inside the package (`SHIPPED_MNIST`, weights stored in fp16, computed in
fp32): `scratchlm diffusion sample|serve` use it when no `--model` is given.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from torch import Tensor

from scratchlm.diffusion.dit import DiT
from scratchlm.diffusion.schedulers import ScheduleConfig, cfg_combine, make_sampler
from scratchlm.diffusion.text import PromptTokenizer, TextEncoder
from scratchlm.diffusion.vae import AutoencoderKL

# the trained MNIST pipeline shipped with the package (docs/diffusion.md: how it was trained, its accuracy)
SHIPPED_MNIST = Path(__file__).resolve().parent / "pretrained" / "mnist"

# denoiser(x (B, C, h, w), t (B,), text (B, L, d)) -> model output
Denoiser = Callable[[Tensor, Tensor, Tensor], Tensor]


class DiffusionPipeline:
    """Tokenizer + text encoder + DiT + VAE + noise schedule; `__call__(prompts)` -> images in [-1, 1]."""

    def __init__(self, tokenizer: PromptTokenizer, text_encoder: TextEncoder, transformer: DiT,
                 vae: AutoencoderKL, schedule: ScheduleConfig, latent_size: int):
        self.tokenizer, self.text_encoder, self.transformer, self.vae = tokenizer, text_encoder, transformer, vae
        self.schedule = schedule
        self.latent_size = latent_size
        for m in (text_encoder, transformer, vae):
            m.eval()

    @property
    def latent_channels(self) -> int:
        return self.vae.config.latent_channels

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str]) -> Tensor:
        return self.text_encoder(self.tokenizer(prompts))  # (B, L, d)

    def initial_latents(self, n: int, seed: int = 0, size: int | None = None) -> Tensor:
        s = size or self.latent_size
        g = torch.Generator().manual_seed(seed)
        return torch.randn(n, self.latent_channels, s, s, generator=g)  # (B, c, h, w), unit variance

    @torch.no_grad()
    def denoise(self, latents: Tensor, text: Tensor, uncond: Tensor | None, steps: int = 25, guidance: float = 3.0,
                sampler: str = "ddim", denoiser: Denoiser | None = None, seed: int = 0,
                progress: Callable[[int], None] | None = None) -> Tensor:
        """Run the sampler from unit-variance `latents`; with `uncond` and guidance != 1, CFG on a batch of
        [uncond; cond]. `denoiser` replaces the DiT call (the parallel variants plug in here)."""
        den = denoiser or self.transformer
        sch = make_sampler(sampler, self.schedule)
        sch.set_timesteps(steps)
        x = latents * sch.init_noise_sigma
        g = torch.Generator().manual_seed(seed + 1)
        use_cfg = uncond is not None and guidance != 1.0
        for i, t in enumerate(sch.timesteps):
            xin = sch.scale_model_input(x, t)
            tt = torch.full((x.shape[0],), float(t))
            if use_cfg:
                out = den(torch.cat([xin, xin]), torch.cat([tt, tt]), torch.cat([uncond, text]))
                out_u, out_c = out.chunk(2)
                out = cfg_combine(out_u, out_c, guidance)
            else:
                out = den(xin, tt, text)
            x = sch.step(out, t, x, generator=g)
            if progress is not None:
                progress(i)
        return x

    @torch.no_grad()
    def decode(self, latents: Tensor, tile: int | None = None) -> Tensor:
        return self.vae.decode(latents / self.vae.config.scaling_factor, tile=tile).clamp(-1, 1)

    @torch.no_grad()
    def __call__(self, prompts: list[str], steps: int = 25, guidance: float = 3.0, sampler: str = "ddim",
                 seed: int = 0, latents: Tensor | None = None, progress=None) -> Tensor:
        text = self.encode_prompts(prompts)
        uncond = self.encode_prompts([""] * len(prompts))
        lat = latents if latents is not None else self.initial_latents(len(prompts), seed)
        z = self.denoise(lat, text, uncond, steps, guidance, sampler, seed=seed, progress=progress)
        return self.decode(z)

    # --- folders ------------------------------------------------------------------------------------
    def save_pretrained(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        """Write the pipeline folder; `dtype` (e.g. torch.float16) stores the weights in that precision
        (loading casts them back into the fp32 modules)."""
        if dtype is not None:
            stored = copy.deepcopy(self)
            for m in (stored.vae, stored.transformer, stored.text_encoder):
                m.to(dtype)
            stored.save_pretrained(path)
            return
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.vae.save_pretrained(path / "vae")
        self.transformer.save_pretrained(path / "transformer")
        self.text_encoder.save_pretrained(path / "text_encoder")
        self.tokenizer.save(path / "tokenizer")
        (path / "scheduler").mkdir(exist_ok=True)
        (path / "scheduler" / "scheduler_config.json").write_text(json.dumps(
            {"_class_name": "DDIMScheduler", **self.schedule.diffusers_config()}, indent=2))
        (path / "model_index.json").write_text(json.dumps({
            "_class_name": "scratchlm.DiffusionPipeline", "latent_size": self.latent_size,
            "schedule": asdict(self.schedule), "vae": ["diffusers", "AutoencoderKL"],
            "transformer": ["diffusers", "PixArtTransformer2DModel"], "scheduler": ["diffusers", "DDIMScheduler"],
            "text_encoder": ["scratchlm", "TextEncoder"], "tokenizer": ["scratchlm", "PromptTokenizer"]}, indent=2))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> DiffusionPipeline:
        path = Path(path)
        idx = path / "model_index.json"
        if not idx.is_file():
            raise FileNotFoundError(f"{idx} not found: expected a scratchlm diffusion pipeline folder "
                                    "(model_index.json, vae/, transformer/, text_encoder/, tokenizer/, scheduler/)")
        meta = json.loads(idx.read_text())
        return cls(PromptTokenizer.load(path / "tokenizer"), TextEncoder.from_pretrained(path / "text_encoder"),
                   DiT.from_pretrained(path / "transformer"), AutoencoderKL.from_pretrained(path / "vae"),
                   ScheduleConfig(**meta["schedule"]), meta["latent_size"])


def is_pipeline_dir(path: str | Path) -> bool:
    return (Path(path) / "model_index.json").is_file() and (Path(path) / "transformer").is_dir()


def image_grid(images: Tensor, nrow: int) -> Tensor:
    """(N, C, H, W) in [-1, 1] -> uint8 (rows*H, nrow*W, C) grid with 2-px gaps."""
    n, c, h, w = images.shape
    rows = (n + nrow - 1) // nrow
    grid = torch.zeros(c, rows * (h + 2), nrow * (w + 2))
    for i in range(n):
        r, k = divmod(i, nrow)
        grid[:, r * (h + 2):r * (h + 2) + h, k * (w + 2):k * (w + 2) + w] = (images[i] + 1) / 2
    return (grid.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)


def save_png(images: Tensor, path: str | Path, nrow: int = 10) -> None:
    from PIL import Image

    g = image_grid(images, nrow).numpy()
    Image.fromarray(g[..., 0] if g.shape[-1] == 1 else g).save(path)
