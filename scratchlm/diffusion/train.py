"""Training the three components on MNIST, time-budgeted like the project's other recipes.

Stages (each with a wall-clock budget; the cosine learning-rate schedule follows the clock):

1. VAE: reconstruction (L1 + L2) + a small KL weight, on the 8k split; then the latent scale
   (scaling_factor = 1 / std of the posterior means) so diffusion sees unit-variance latents.
2. Text encoder + DiT, jointly: DDPM objective (eps or v), prompts drawn from the templates in
   `data.py`, the empty prompt with probability `p_uncond` (classifier-free guidance).

`run_training(cfg)` writes a pipeline folder (diffusers-format vae/ and transformer/) to
`out_dir/pipeline` and a JSON log `out_dir/train_log.json`. Threads: `threads` (default 2).
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
class DiffusionTrainConfig:
    """The MNIST latent-diffusion recipe (recipes/diffusion_mnist.toml)."""

    data_dir: str = field(default="../shared/data/images/mnist", metadata={"help": "folder with the t10k IDX files"})
    out_dir: str = field(default="runs/diffusion_mnist", metadata={"help": "where the pipeline and logs go"})
    threads: int = field(default=2, metadata={"help": "torch threads"})
    seed: int = field(default=0, metadata={"help": "random seed"})
    # VAE
    vae_channels: list[int] = field(default_factory=lambda: [16, 32, 32], metadata={"help": "VAE width per level"})
    vae_groups: int = field(default=8, metadata={"help": "VAE GroupNorm groups"})
    latent_channels: int = field(default=4, metadata={"help": "latent channels"})
    vae_batch: int = field(default=64, metadata={"help": "VAE batch size"})
    vae_lr: float = field(default=2e-3, metadata={"help": "VAE peak learning rate"})
    vae_kl: float = field(default=1e-6, metadata={"help": "KL weight"})
    vae_time_s: float = field(default=300, metadata={"help": "VAE wall-clock budget"})
    vae_max_steps: int = field(default=3000, metadata={"help": "VAE step cap"})
    vae_from: str = field(default="", metadata={
        "help": "a trained VAE folder (e.g. runs/x/vae_stage) to reuse instead of training one; the DiT then "
                "gets the whole max_wall_s"})
    # text encoder
    vocab_size: int = field(default=300, metadata={"help": "BPE vocabulary (256 bytes + pad + merges)"})
    max_len: int = field(default=8, metadata={"help": "prompt tokens"})
    text_layers: int = field(default=2, metadata={"help": "text encoder blocks"})
    # DiT
    dit_width: int = field(default=96, metadata={"help": "DiT width (heads * head_dim)"})
    dit_heads: int = field(default=4, metadata={"help": "DiT heads"})
    dit_layers: int = field(default=4, metadata={"help": "DiT blocks"})
    dit_batch: int = field(default=128, metadata={"help": "DiT batch size"})
    dit_lr: float = field(default=1e-3, metadata={"help": "DiT + text encoder peak learning rate"})
    dit_time_s: float = field(default=1200, metadata={"help": "DiT wall-clock budget"})
    dit_max_steps: int = field(default=20000, metadata={"help": "DiT step cap"})
    p_uncond: float = field(default=0.1, metadata={"help": "prompt dropout for classifier-free guidance"})
    prediction_type: str = field(default="epsilon", metadata={"help": "epsilon | v_prediction"})
    beta_schedule: str = field(default="squaredcos_cap_v2", metadata={"help": "noise schedule"})
    timestep_spacing: str = field(default="leading", metadata={
        "help": "sampling grid saved with the pipeline: 'leading' (first step t = T - T/n) or 'trailing' (t = T-1); "
                "with squaredcos_cap_v2, alpha_bar(999) = 2.4e-9 makes an eps model's x0 estimate at t = 999 blow up "
                "(1/sqrt(alpha_bar) = 2e4), so trailing needs v_prediction"})
    log_every: int = field(default=25, metadata={"help": "log every N steps"})
    budget_clock: str = field(default="wall", metadata={
        "help": "what the *_time_s budgets count: 'wall' seconds, or 'cpu' seconds of this process (all threads; "
                "the fair measure on a shared machine: 1800 wall-s on 2 dedicated cores = 3600 cpu-s)"})
    max_wall_s: float = field(default=0, metadata={"help": "a wall-clock cap on the whole run (0: none)"})

    def __post_init__(self):
        if self.budget_clock not in ("wall", "cpu"):
            raise ValueError(f"budget_clock must be 'wall' or 'cpu', got {self.budget_clock!r}")


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
                                  sample_size=28))
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


def train_dit(cfg: DiffusionTrainConfig, vae: AutoencoderKL, x: torch.Tensor, y: torch.Tensor, log,
              wall_left: float = 0) -> DiffusionPipeline:
    torch.manual_seed(cfg.seed + 1)
    rng = random.Random(cfg.seed)
    tok = PromptTokenizer.train(prompt_corpus(), cfg.vocab_size, cfg.max_len)
    with torch.no_grad():
        post = [vae.encode(x[i:i + 500]) for i in range(0, len(x), 500)]
        mean, std = torch.cat([p.mean for p in post]), torch.cat([p.std for p in post])
    latent = mean.shape[-1]
    d = cfg.dit_width
    text = TextEncoder(TextEncoderConfig(vocab_size=tok.vocab_size, d_model=d, n_layers=cfg.text_layers,
                                         n_heads=cfg.dit_heads, d_ff=2 * d, max_len=cfg.max_len))
    dit = DiT(DiTConfig(sample_size=latent, in_channels=cfg.latent_channels, out_channels=cfg.latent_channels,
                        patch_size=1, num_layers=cfg.dit_layers, num_attention_heads=cfg.dit_heads,
                        attention_head_dim=d // cfg.dit_heads, cross_attention_dim=d))
    sched_cfg = ScheduleConfig(prediction_type=cfg.prediction_type, beta_schedule=cfg.beta_schedule,
                               timestep_spacing=cfg.timestep_spacing)
    schedule = NoiseSchedule(sched_cfg)
    params = list(dit.parameters()) + list(text.parameters())
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
        out = dit(schedule.add_noise(z0, noise, t), t, text(tok(prompts)))
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
            log({"stage": "dit", "step": step, "loss": round(loss.item(), 5), **budget.used()})
    with torch.no_grad():
        for e, p in zip(ema, params):
            p.copy_(e)
    log({"stage": "dit", "done_steps": step, **budget.used()})
    return DiffusionPipeline(tok, text, dit, vae, sched_cfg, latent)


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
    # the wall cap: the VAE may use its share of it, the DiT whatever is left (minus a minute to save)
    if cfg.vae_from:
        vae = AutoencoderKL.from_pretrained(cfg.vae_from)
        log({"stage": "vae", "reused": cfg.vae_from, "scaling_factor": vae.config.scaling_factor})
    else:
        share = cfg.vae_time_s / (cfg.vae_time_s + cfg.dit_time_s)
        vae = train_vae(cfg, x, log, wall_left=cfg.max_wall_s * share)
        vae.save_pretrained(out / "vae_stage")
    left = max(60.0, cfg.max_wall_s - (time.perf_counter() - t0) - 60) if cfg.max_wall_s else 0
    pipe = train_dit(cfg, vae, x, y, log, wall_left=left)
    pipe.save_pretrained(out / "pipeline")
    total = time.perf_counter() - t0
    log({"stage": "total", "wall_seconds": round(total, 1), "cpu_seconds": round(time.process_time() - c0, 1)})
    (out / "train_log.json").write_text(json.dumps({"config": asdict(cfg), "log": records,
                                                    "total_seconds": total}, indent=2))
    return pipe
