"""Training the three components on MNIST, time-budgeted like the project's other recipes.

Two architectures (`architecture`), one recipe:

- "dit" (recipes/diffusion_mnist.toml): scratchlm's BPE tokenizer + text encoder and a DiT; the folder has
  vae/ and transformer/ (diffusers' PixArtTransformer2DModel format) beside text_encoder/ and tokenizer/.
- "sd" (recipes/diffusion_sd_mnist.toml): Stable Diffusion's shape: a CLIP-format BPE tokenizer trained on the
  prompt corpus, a CLIPTextModel and the SD UNet2DConditionModel (`[unet]` and `[clip]` tables of the recipe);
  the folder is an SD pipeline folder (model_index.json, unet/, vae/, text_encoder/, tokenizer/, scheduler/).

Stages (each with a budget; the cosine learning-rate schedule follows the clock):

1. VAE: reconstruction (L1 + L2) + a small KL weight, on the 8k split; then the latent scale
   (scaling_factor = 1 / std of the posterior means) so diffusion sees unit-variance latents. Or a trained
   VAE reused (`vae_from`, "shipped" = the VAE of the shipped MNIST pipeline); with `image_pad` the images are
   padded with background first (28 + 2*2 = 32 -> 8x8 latents, which the UNet halves evenly) and the scale is
   measured again on the padded images.
2. Text encoder + denoiser, jointly: DDPM objective (eps or v), prompts drawn from the templates in
   `data.py`, the empty prompt with probability `p_uncond` (classifier-free guidance), EMA of the weights.

`run_training(cfg)` writes the pipeline folder to `out_dir/pipeline` and a JSON log `out_dir/train_log.json`.
Threads: `threads` (default 2).
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from scratchlm.diffusion.data import load_mnist, prompt_corpus, prompt_for
from scratchlm.diffusion.dit import DiT, DiTConfig
from scratchlm.diffusion.pipeline import DiffusionPipeline
from scratchlm.diffusion.schedulers import NoiseSchedule, ScheduleConfig
from scratchlm.diffusion.text import PromptTokenizer, TextEncoder, TextEncoderConfig
from scratchlm.diffusion.vae import AutoencoderKL, VAEConfig


@dataclass
class SDUNetRecipe:
    """The SD UNet of architecture "sd" (diffusers' UNet2DConditionModel fields; the rest are SD 1.x's)."""

    block_out_channels: list[int] = field(default_factory=lambda: [32, 64, 64], metadata={
        "help": "channels per level; each level but the last halves the latent"})
    down_block_types: list[str] = field(default_factory=lambda: ["DownBlock2D", "CrossAttnDownBlock2D",
                                                                  "CrossAttnDownBlock2D"], metadata={
        "help": "per level, DownBlock2D or CrossAttnDownBlock2D; the up blocks mirror them (UpBlock2D / "
                "CrossAttnUpBlock2D, reversed) and the mid block always cross-attends"})
    layers_per_block: int = field(default=1, metadata={"help": "resnets per down level (up levels get one more)"})
    attention_head_dim: int = field(default=8, metadata={
        "help": "diffusers' SD 1.x field: the number of attention *heads* (head dim = channels / this)"})
    norm_num_groups: int = field(default=8, metadata={"help": "GroupNorm groups (divides every level's channels)"})

    def __post_init__(self):
        if len(self.down_block_types) != len(self.block_out_channels):
            raise ValueError(f"unet.down_block_types has {len(self.down_block_types)} entries for "
                             f"{len(self.block_out_channels)} levels (unet.block_out_channels)")
        bad = sorted(set(self.down_block_types) - {"DownBlock2D", "CrossAttnDownBlock2D"})
        if bad:
            raise ValueError(f"unet.down_block_types: {bad} not supported here (DownBlock2D, CrossAttnDownBlock2D)")

    @property
    def up_block_types(self) -> list[str]:
        return [t.replace("Down", "Up") for t in reversed(self.down_block_types)]


@dataclass
class CLIPRecipe:
    """The CLIP text encoder and tokenizer of architecture "sd" (transformers' CLIPTextConfig field names)."""

    num_merges: int = field(default=200, metadata={
        "help": "BPE merges learned on the prompt corpus (vocabulary: 512 byte symbols + merges + start/end)"})
    model_max_length: int = field(default=16, metadata={
        "help": "tokens per prompt with the start/end tokens, padded (SD: 77; the prompts here need <= 12)"})
    hidden_size: int = field(default=64, metadata={"help": "width (= the UNet's cross_attention_dim)"})
    intermediate_size: int = field(default=256, metadata={"help": "MLP hidden width"})
    num_hidden_layers: int = field(default=2, metadata={"help": "transformer blocks"})
    num_attention_heads: int = field(default=4, metadata={"help": "attention heads"})


@dataclass
class DiffusionTrainConfig:
    """The MNIST latent-diffusion recipes (recipes/diffusion_mnist.toml: DiT; recipes/diffusion_sd_mnist.toml: SD)."""

    data_dir: str = field(default="../shared/data/images/mnist", metadata={"help": "folder with the t10k IDX files"})
    out_dir: str = field(default="runs/diffusion_mnist", metadata={"help": "where the pipeline and logs go"})
    threads: int = field(default=2, metadata={"help": "torch threads"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    architecture: str = field(default="dit", metadata={
        "help": "'dit': scratchlm text encoder + DiT; 'sd': CLIP text encoder + SD UNet (the [clip] and [unet] "
                "tables), an SD pipeline folder"})
    image_pad: int = field(default=0, metadata={
        "help": "background pixels added on each side of the 28x28 digits (2: 32x32 images, 8x8 latents with a "
                "4x VAE; generated images are then 32x32, the digit in the middle 28x28)"})
    max_images: int = field(default=0, metadata={"help": "train on the first N images of the 8k split (0: all)"})
    vae_channels: list[int] = field(default_factory=lambda: [16, 32, 32], metadata={"help": "VAE width per level"})
    vae_groups: int = field(default=8, metadata={"help": "VAE GroupNorm groups"})
    latent_channels: int = field(default=4, metadata={"help": "latent channels"})
    vae_batch: int = field(default=64, metadata={"help": "VAE batch size"})
    vae_lr: float = field(default=2e-3, metadata={"help": "VAE peak learning rate"})
    vae_kl: float = field(default=1e-6, metadata={"help": "KL weight"})
    vae_time_s: float = field(default=300, metadata={"help": "VAE wall-clock budget"})
    vae_max_steps: int = field(default=3000, metadata={"help": "VAE step cap"})
    vae_from: str = field(default="", metadata={
        "help": "a trained VAE folder (e.g. runs/x/vae_stage) to reuse instead of training one ('shipped': the "
                "shipped MNIST pipeline's VAE); the denoiser then gets the whole max_wall_s"})
    # text encoder
    vocab_size: int = field(default=300, metadata={"help": "BPE vocabulary (256 bytes + pad + merges)"})
    max_len: int = field(default=8, metadata={"help": "prompt tokens"})
    text_layers: int = field(default=2, metadata={"help": "text encoder blocks"})
    # denoiser: the DiT's shape (architecture "dit"); batch, learning rate and budget of either denoiser
    dit_width: int = field(default=96, metadata={"help": "DiT width (heads * head_dim)"})
    dit_heads: int = field(default=4, metadata={"help": "DiT heads"})
    dit_layers: int = field(default=4, metadata={"help": "DiT blocks"})
    dit_batch: int = field(default=128, metadata={"help": "denoiser (DiT or UNet) batch size"})
    dit_lr: float = field(default=1e-3, metadata={"help": "denoiser + text encoder peak learning rate"})
    dit_time_s: float = field(default=1200, metadata={"help": "denoiser stage budget (seconds of budget_clock)"})
    dit_max_steps: int = field(default=20000, metadata={"help": "denoiser stage step cap"})
    p_uncond: float = field(default=0.1, metadata={"help": "prompt dropout for classifier-free guidance"})
    prediction_type: str = field(default="epsilon", metadata={"help": "epsilon | v_prediction"})
    beta_schedule: str = field(default="squaredcos_cap_v2", metadata={"help": "noise schedule"})
    timestep_spacing: str = field(default="leading", metadata={
        "help": "sampling grid saved with the pipeline: 'leading' (first step t = T - T/n) or 'trailing' (t = T-1); "
                "with squaredcos_cap_v2, alpha_bar(999) = 2.4e-9 makes an eps model's x0 estimate at t = 999 blow up "
                "(1/sqrt(alpha_bar) = 2e4), so trailing needs v_prediction"})
    steps_offset: int = field(default=0, metadata={
        "help": "added to the 'leading' sampling timesteps, saved with the pipeline (SD folders: 1, which diffusers' "
                "StableDiffusionPipeline imposes on load whatever the folder says)"})
    log_every: int = field(default=25, metadata={"help": "log every N steps"})
    budget_clock: str = field(default="wall", metadata={
        "help": "what the *_time_s budgets count: 'wall' seconds, or 'cpu' seconds of this process (all threads; "
                "the fair measure on a shared machine: 1800 wall-s on 2 dedicated cores = 3600 cpu-s)"})
    max_wall_s: float = field(default=0, metadata={"help": "a wall-clock cap on the whole run (0: none)"})
    unet: SDUNetRecipe = field(default_factory=SDUNetRecipe, metadata={"help": "the SD UNet (architecture 'sd')"})
    clip: CLIPRecipe = field(default_factory=CLIPRecipe, metadata={
        "help": "the CLIP text encoder and tokenizer (architecture 'sd')"})

    def __post_init__(self):
        if self.budget_clock not in ("wall", "cpu"):
            raise ValueError(f"budget_clock must be 'wall' or 'cpu', got {self.budget_clock!r}")
        if self.architecture not in ("dit", "sd"):
            raise ValueError(f"architecture must be 'dit' or 'sd', got {self.architecture!r}")


def _lr(peak: float, frac: float, warm: float = 0.03) -> float:
    """Warm-up then cosine to 10% over the fraction of the budget used so far."""
    if frac < warm:
        return peak * frac / warm
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (frac - warm) / (1 - warm)))))


class _Budget:
    """Fraction of a stage's budget used: the max of its clock (wall or process CPU), its step cap and the
    run's wall cap."""

    def __init__(self, cfg: DiffusionTrainConfig, seconds: float, max_steps: int, run_t0: float, run_left_s: float):
        self.clock = time.process_time if cfg.budget_clock == "cpu" else time.perf_counter
        self.t0, self.seconds, self.max_steps = self.clock(), seconds, max_steps
        self.wall0, self.wall_left = time.perf_counter(), run_left_s

    def frac(self, step: int) -> float:
        f = max((self.clock() - self.t0) / self.seconds, step / self.max_steps)
        if self.wall_left > 0:
            f = max(f, (time.perf_counter() - self.wall0) / self.wall_left)
        return f

    def used(self) -> dict:
        return {"clock": "cpu" if self.clock is time.process_time else "wall",
                "budget_seconds_used": round(self.clock() - self.t0, 1),
                "wall_seconds": round(time.perf_counter() - self.wall0, 1),
                "cpu_seconds": round(time.process_time() - self._cpu0, 1)}


def _budget(cfg: DiffusionTrainConfig, seconds: float, max_steps: int, wall_left: float) -> _Budget:
    b = _Budget(cfg, seconds, max_steps, time.perf_counter(), wall_left)
    b._cpu0 = time.process_time()
    return b


def train_vae(cfg: DiffusionTrainConfig, x: torch.Tensor, log, wall_left: float = 0) -> AutoencoderKL:
    torch.manual_seed(cfg.seed)
    vae = AutoencoderKL(VAEConfig(in_channels=1, out_channels=1, latent_channels=cfg.latent_channels,
                                  block_out_channels=tuple(cfg.vae_channels), norm_num_groups=cfg.vae_groups,
                                  sample_size=x.shape[-1]))
    opt = torch.optim.AdamW(vae.parameters(), lr=cfg.vae_lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(cfg.seed)
    budget, step = _budget(cfg, cfg.vae_time_s, cfg.vae_max_steps, wall_left), 0
    while (frac := budget.frac(step)) < 1.0:
        for pg in opt.param_groups:
            pg["lr"] = _lr(cfg.vae_lr, frac)
        idx = torch.randint(0, len(x), (cfg.vae_batch,), generator=g)
        xb = x[idx]
        post = vae.encode(xb)
        rec = vae.decode(post.sample(g))
        loss = F.l1_loss(rec, xb) + F.mse_loss(rec, xb) + cfg.vae_kl * post.kl().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % cfg.log_every == 0:
            log({"stage": "vae", "step": step, "loss": round(loss.item(), 5), **budget.used()})
    vae.eval()
    with torch.no_grad():
        means = torch.cat([vae.encode(x[i:i + 500]).mean for i in range(0, len(x), 500)])
    vae.config.scaling_factor = float(1.0 / means.std())
    log({"stage": "vae", "done_steps": step, **budget.used(), "scaling_factor": vae.config.scaling_factor})
    return vae


@dataclass
class _Parts:
    """What the denoiser stage trains: tokenizer, text encoder (+ how its features are read), denoiser."""

    tokenizer: object
    text_encoder: torch.nn.Module
    denoiser: torch.nn.Module
    tokenize: object  # prompts -> ids (B, L)
    encode: object  # ids (B, L) -> text features (B, L, d)


def _dit_parts(cfg: DiffusionTrainConfig, latent: int) -> _Parts:
    tok = PromptTokenizer.train(prompt_corpus(), cfg.vocab_size, cfg.max_len)
    d = cfg.dit_width
    text = TextEncoder(TextEncoderConfig(vocab_size=tok.vocab_size, d_model=d, n_layers=cfg.text_layers,
                                         n_heads=cfg.dit_heads, d_ff=2 * d, max_len=cfg.max_len))
    dit = DiT(DiTConfig(sample_size=latent, in_channels=cfg.latent_channels, out_channels=cfg.latent_channels,
                        patch_size=1, num_layers=cfg.dit_layers, num_attention_heads=cfg.dit_heads,
                        attention_head_dim=d // cfg.dit_heads, cross_attention_dim=d))
    return _Parts(tok, text, dit, tok, text)


def _sd_parts(cfg: DiffusionTrainConfig, latent: int) -> _Parts:
    """CLIP-format tokenizer trained on the prompt corpus, CLIPTextModel, SD UNet (SD 1.x conventions: the UNet
    cross-attends to the text encoder's last_hidden_state)."""
    from scratchlm.diffusion.clip import CLIPTextConfig, CLIPTextModel
    from scratchlm.diffusion.clip_tokenizer import CLIPTokenizer
    from scratchlm.diffusion.unet import UNet2DConditionModel, UNetConfig

    c, u = cfg.clip, cfg.unet
    tok = CLIPTokenizer.train(prompt_corpus(), c.num_merges, model_max_length=c.model_max_length)
    text = CLIPTextModel(CLIPTextConfig(
        vocab_size=tok.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
        max_position_embeddings=c.model_max_length, projection_dim=c.hidden_size,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    unet = UNet2DConditionModel(UNetConfig(
        sample_size=latent, in_channels=cfg.latent_channels, out_channels=cfg.latent_channels,
        down_block_types=tuple(u.down_block_types), up_block_types=tuple(u.up_block_types),
        block_out_channels=tuple(u.block_out_channels), layers_per_block=u.layers_per_block,
        attention_head_dim=u.attention_head_dim, norm_num_groups=u.norm_num_groups,
        cross_attention_dim=c.hidden_size))
    return _Parts(tok, text, unet, lambda prompts: tok(prompts)["input_ids"], lambda ids: text(ids).last_hidden_state)


def train_denoiser(cfg: DiffusionTrainConfig, vae: AutoencoderKL, x: torch.Tensor, y: torch.Tensor, log,
                   wall_left: float = 0) -> DiffusionPipeline:
    """Text encoder + denoiser (the DiT, or the SD UNet for architecture "sd") jointly on `vae`'s latents of x."""
    torch.manual_seed(cfg.seed + 1)
    rng = random.Random(cfg.seed)
    with torch.no_grad():
        post = [vae.encode(x[i:i + 500]) for i in range(0, len(x), 500)]
        mean, std = torch.cat([p.mean for p in post]), torch.cat([p.std for p in post])
    latent = mean.shape[-1]
    parts = (_sd_parts if cfg.architecture == "sd" else _dit_parts)(cfg, latent)
    sched_cfg = ScheduleConfig(prediction_type=cfg.prediction_type, beta_schedule=cfg.beta_schedule,
                               timestep_spacing=cfg.timestep_spacing, steps_offset=cfg.steps_offset)
    schedule = NoiseSchedule(sched_cfg)
    params = list(parts.denoiser.parameters()) + list(parts.text_encoder.parameters())
    stage = "dit" if cfg.architecture == "dit" else "unet"
    log({"stage": stage, "architecture": cfg.architecture, "latent": list(mean.shape[1:]),
         "denoiser_params": sum(p.numel() for p in parts.denoiser.parameters()),
         "text_encoder_params": sum(p.numel() for p in parts.text_encoder.parameters())})
    opt = torch.optim.AdamW(params, lr=cfg.dit_lr, weight_decay=0.0, betas=(0.9, 0.99))
    ema = [p.detach().clone() for p in params]
    g = torch.Generator().manual_seed(cfg.seed + 2)
    s = vae.config.scaling_factor
    budget, step = _budget(cfg, cfg.dit_time_s, cfg.dit_max_steps, wall_left), 0
    while (frac := budget.frac(step)) < 1.0:
        for pg in opt.param_groups:
            pg["lr"] = _lr(cfg.dit_lr, frac)
        idx = torch.randint(0, len(x), (cfg.dit_batch,), generator=g)
        z0 = (mean[idx] + std[idx] * torch.randn(mean[idx].shape, generator=g)) * s  # (B, c, h, w)
        prompts = ["" if rng.random() < cfg.p_uncond else prompt_for(int(k), rng) for k in y[idx]]
        noise = torch.randn(z0.shape, generator=g)
        t = schedule.sample_timesteps(len(idx), g)
        out = parts.denoiser(schedule.add_noise(z0, noise, t), t, parts.encode(parts.tokenize(prompts)))
        loss = schedule.training_loss(out, z0, noise, t)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        decay = min(0.999, (1 + step) / (10 + step))
        with torch.no_grad():
            for e, p in zip(ema, params):
                e.lerp_(p, 1 - decay)
        if step % cfg.log_every == 0:
            log({"stage": stage, "step": step, "loss": round(loss.item(), 5), **budget.used()})
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    log({"stage": stage, "done_steps": step, **budget.used()})
    return DiffusionPipeline(parts.tokenizer, parts.text_encoder, parts.denoiser, vae, sched_cfg, latent)


def _reuse_vae(cfg: DiffusionTrainConfig, x: torch.Tensor, log) -> AutoencoderKL:
    """`vae_from`'s VAE; on padded images its latent scale is measured again (the padding is background, which
    the VAE encodes to a different spread than the digits' 28x28 frame)."""
    from scratchlm.diffusion.pipeline import SHIPPED_MNIST

    src = SHIPPED_MNIST / "vae" if cfg.vae_from == "shipped" else Path(cfg.vae_from)
    vae = AutoencoderKL.from_pretrained(src).eval()
    rec = {"stage": "vae", "reused": str(src), "scaling_factor": vae.config.scaling_factor}
    if cfg.image_pad:
        with torch.no_grad():
            means = torch.cat([vae.encode(x[i:i + 500]).mean for i in range(0, len(x), 500)])
        vae.config.scaling_factor = float(1.0 / means.std())
        rec["scaling_factor_on_padded"] = vae.config.scaling_factor
    log(rec)
    return vae


def run_training(cfg: DiffusionTrainConfig, log_fn=print) -> DiffusionPipeline:
    torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []

    def log(rec: dict) -> None:
        records.append(rec)
        log_fn(json.dumps(rec))

    t0, c0 = time.perf_counter(), time.process_time()
    x, y = load_mnist(cfg.data_dir, "train")
    if cfg.max_images:
        x, y = x[:cfg.max_images], y[:cfg.max_images]
    if cfg.image_pad:
        x = F.pad(x, (cfg.image_pad,) * 4, value=-1.0)  # (N, 1, 28 + 2 pad, 28 + 2 pad), background = -1
    # the wall cap: the VAE may use its share of it, the denoiser whatever is left (minus a minute to save)
    if cfg.vae_from:
        vae = _reuse_vae(cfg, x, log)
    else:
        share = cfg.vae_time_s / (cfg.vae_time_s + cfg.dit_time_s)
        vae = train_vae(cfg, x, log, wall_left=cfg.max_wall_s * share)
        vae.save_pretrained(out / "vae_stage")
    left = max(60.0, cfg.max_wall_s - (time.perf_counter() - t0) - 60) if cfg.max_wall_s else 0
    pipe = train_denoiser(cfg, vae, x, y, log, wall_left=left)
    pipe.save_pretrained(out / "pipeline")
    total = time.perf_counter() - t0
    log({"stage": "total", "wall_seconds": round(total, 1), "cpu_seconds": round(time.process_time() - c0, 1)})
    (out / "train_log.json").write_text(json.dumps({"config": asdict(cfg), "log": records,
                                                    "total_seconds": total}, indent=2))
    return pipe
