"""Noise schedules, the DDPM training objective, and the DDPM / DDIM / Euler samplers.

Conventions follow diffusers (so a step equals `DDPMScheduler.step`, `DDIMScheduler.step` and
`EulerDiscreteScheduler.step` on the same inputs, checked in tests/diffusion/test_schedulers.py):

- a schedule of T training steps: betas (linear, scaled_linear or squaredcos_cap_v2), alpha_bar_t =
  prod(1 - beta); the forward process x_t = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) eps;
- prediction types: "epsilon" (the model predicts eps) and "v_prediction" (v = sqrt(alpha_bar) eps -
  sqrt(1 - alpha_bar) x_0, Salimans & Ho 2022);
- samplers share one interface: `set_timesteps(n)`, `.timesteps`, `init_noise_sigma`,
  `scale_model_input(x, t)`, `step(model_output, t, x, noise=None) -> x_prev`.

Classifier-free guidance: eps = eps_uncond + w (eps_cond - eps_uncond) (`cfg_combine`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor


@dataclass
class ScheduleConfig:
    """The training noise schedule and the sampler settings (diffusers scheduler config names)."""

    num_train_timesteps: int = field(default=1000, metadata={"help": "T, the training diffusion steps"})
    beta_start: float = field(default=0.0001, metadata={"help": "first beta"})
    beta_end: float = field(default=0.02, metadata={"help": "last beta"})
    beta_schedule: str = field(default="linear", metadata={"help": "linear | scaled_linear | squaredcos_cap_v2"})
    prediction_type: str = field(default="epsilon", metadata={"help": "epsilon | v_prediction"})
    timestep_spacing: str = field(default="trailing", metadata={"help": "leading | trailing (| linspace for Euler)"})

    def __post_init__(self):
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {self.prediction_type!r}")
        if self.beta_schedule not in ("linear", "scaled_linear", "squaredcos_cap_v2"):
            raise ValueError(f"beta_schedule must be linear, scaled_linear or squaredcos_cap_v2, "
                             f"got {self.beta_schedule!r}")

    def diffusers_config(self) -> dict:
        return dict(num_train_timesteps=self.num_train_timesteps, beta_start=self.beta_start, beta_end=self.beta_end,
                    beta_schedule=self.beta_schedule, prediction_type=self.prediction_type,
                    timestep_spacing=self.timestep_spacing, clip_sample=False, set_alpha_to_one=True, steps_offset=0)


def make_betas(cfg: ScheduleConfig) -> Tensor:
    t = cfg.num_train_timesteps
    if cfg.beta_schedule == "linear":
        return torch.linspace(cfg.beta_start, cfg.beta_end, t, dtype=torch.float32)
    if cfg.beta_schedule == "scaled_linear":
        return torch.linspace(cfg.beta_start**0.5, cfg.beta_end**0.5, t, dtype=torch.float32) ** 2
    abar = [math.cos((i / t + 0.008) / 1.008 * math.pi / 2) ** 2 for i in range(t + 1)]
    return torch.tensor([min(1 - abar[i + 1] / abar[i], 0.999) for i in range(t)], dtype=torch.float32)


class NoiseSchedule:
    """alpha_bar_t and the training side: add_noise, the prediction target, x_0 / eps from a prediction."""

    def __init__(self, cfg: ScheduleConfig):
        self.config = cfg
        self.betas = make_betas(cfg)
        self.alphas_cumprod = torch.cumprod(1.0 - self.betas, dim=0)  # (T,) float32

    def _ab(self, t: Tensor, like: Tensor) -> Tensor:
        ab = self.alphas_cumprod.to(like.device)[t.long()].to(like.dtype)
        return ab.view(-1, *([1] * (like.ndim - 1)))  # (B, 1, 1, 1)

    def add_noise(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        ab = self._ab(t, x0)
        return ab.sqrt() * x0 + (1 - ab).sqrt() * noise

    def target(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        """What the model is trained to predict: eps, or v = sqrt(ab) eps - sqrt(1 - ab) x_0."""
        if self.config.prediction_type == "epsilon":
            return noise
        ab = self._ab(t, x0)
        return ab.sqrt() * noise - (1 - ab).sqrt() * x0

    def training_loss(self, model_out: Tensor, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        return (model_out.float() - self.target(x0, noise, t).float()).square().mean()

    def sample_timesteps(self, n: int, generator: torch.Generator | None = None, device=None) -> Tensor:
        return torch.randint(0, self.config.num_train_timesteps, (n,), generator=generator).to(device)


def _spacing(cfg: ScheduleConfig, n: int) -> np.ndarray:
    t = cfg.num_train_timesteps
    if n > t:
        raise ValueError(f"{n} sampling steps exceed the {t} training timesteps")
    if cfg.timestep_spacing == "leading":
        return (np.arange(0, n) * (t // n)).round()[::-1].copy().astype(np.int64)
    if cfg.timestep_spacing == "trailing":
        return np.round(np.arange(t, 0, -t / n)).astype(np.int64) - 1
    raise ValueError(f"timestep_spacing must be 'leading' or 'trailing', got {cfg.timestep_spacing!r}")


def _x0_eps(cfg: ScheduleConfig, out: Tensor, x: Tensor, ab: Tensor) -> tuple[Tensor, Tensor]:
    """(x_0, eps) from the model output at a step with alpha_bar = ab."""
    b = 1 - ab
    if cfg.prediction_type == "epsilon":
        return (x - b**0.5 * out) / ab**0.5, out
    return ab**0.5 * x - b**0.5 * out, ab**0.5 * out + b**0.5 * x


class _Sampler:
    def __init__(self, cfg: ScheduleConfig):
        self.config = cfg
        self.schedule = NoiseSchedule(cfg)
        self.alphas_cumprod = self.schedule.alphas_cumprod
        self.timesteps = torch.empty(0)
        self.init_noise_sigma = 1.0

    def scale_model_input(self, x: Tensor, t) -> Tensor:
        return x

    def _ab(self, t: int) -> Tensor:
        return self.alphas_cumprod[t] if t >= 0 else torch.tensor(1.0)

    def _stride(self) -> int:
        return self.config.num_train_timesteps // self.num_inference_steps

    def set_timesteps(self, n: int, device=None) -> None:
        self.num_inference_steps = n
        self.timesteps = torch.from_numpy(_spacing(self.config, n)).to(device)

    def step(self, out: Tensor, t, x: Tensor, noise: Tensor | None = None, generator=None) -> Tensor:
        raise NotImplementedError


class DDPMSampler(_Sampler):
    """Ancestral DDPM (Ho et al. 2020) with "fixed_small" variance, on a (possibly strided) timestep grid."""

    def _prev(self, t: int) -> int:
        ts = self.timesteps.tolist()
        i = ts.index(t)
        return ts[i + 1] if i + 1 < len(ts) else -1

    def step(self, out: Tensor, t, x: Tensor, noise: Tensor | None = None, generator=None) -> Tensor:
        t = int(t)
        prev = self._prev(t)
        ab, ab_prev = self._ab(t), self._ab(prev)
        alpha = ab / ab_prev
        beta = 1 - alpha
        x0, _ = _x0_eps(self.config, out, x, ab)
        mean = (ab_prev**0.5 * beta / (1 - ab)) * x0 + (alpha**0.5 * (1 - ab_prev) / (1 - ab)) * x
        if t > 0:
            var = torch.clamp((1 - ab_prev) / (1 - ab) * beta, min=1e-20)
            if noise is None:
                noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
            mean = mean + var**0.5 * noise
        return mean


class DDIMSampler(_Sampler):
    """DDIM (Song et al. 2021); eta = 0 is deterministic."""

    def __init__(self, cfg: ScheduleConfig, eta: float = 0.0):
        super().__init__(cfg)
        self.eta = eta

    def step(self, out: Tensor, t, x: Tensor, noise: Tensor | None = None, generator=None) -> Tensor:
        t = int(t)
        prev = t - self._stride()
        ab, ab_prev = self._ab(t), self._ab(prev)
        x0, eps = _x0_eps(self.config, out, x, ab)
        std = self.eta * ((1 - ab_prev) / (1 - ab) * (1 - ab / ab_prev)) ** 0.5
        prev_x = ab_prev**0.5 * x0 + (1 - ab_prev - std**2) ** 0.5 * eps
        if self.eta > 0:
            if noise is None:
                noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
            prev_x = prev_x + std * noise
        return prev_x


class EulerSampler(_Sampler):
    """Euler on the probability-flow ODE in sigma = sqrt((1 - ab) / ab) (Karras et al. 2022; diffusers'
    EulerDiscreteScheduler with s_churn = 0). Samples live at scale sqrt(1 + sigma^2)."""

    def set_timesteps(self, n: int, device=None) -> None:
        self.num_inference_steps = n
        t_train = self.config.num_train_timesteps
        if self.config.timestep_spacing in ("linspace",):
            ts = np.linspace(0, t_train - 1, n, dtype=np.float32)[::-1].copy()
        else:
            ts = _spacing(self.config, n).astype(np.float32)
        sig = np.array(((1 - self.alphas_cumprod) / self.alphas_cumprod) ** 0.5)
        sig = np.interp(ts, np.arange(0, len(sig)), sig)
        self.sigmas = torch.from_numpy(np.concatenate([sig, [0.0]]).astype(np.float32)).to(device)
        self.timesteps = torch.from_numpy(ts.astype(np.float32)).to(device)
        smax = self.sigmas.max()
        spaced_to_max = self.config.timestep_spacing in ("linspace", "trailing")
        self.init_noise_sigma = smax if spaced_to_max else (smax**2 + 1) ** 0.5

    def _index(self, t) -> int:
        return int((self.timesteps == float(t)).nonzero()[0])

    def scale_model_input(self, x: Tensor, t) -> Tensor:
        s = self.sigmas[self._index(t)]
        return x / ((s**2 + 1) ** 0.5)

    def step(self, out: Tensor, t, x: Tensor, noise: Tensor | None = None, generator=None) -> Tensor:
        i = self._index(t)
        s, s_next = self.sigmas[i], self.sigmas[i + 1]
        x = x.float()
        if self.config.prediction_type == "epsilon":
            x0 = x - s * out
        else:
            x0 = out * (-s / (s**2 + 1) ** 0.5) + x / (s**2 + 1)
        return (x + (x - x0) / s * (s_next - s)).to(out.dtype)


SAMPLERS = {"ddpm": DDPMSampler, "ddim": DDIMSampler, "euler": EulerSampler}


def make_sampler(name: str, cfg: ScheduleConfig) -> _Sampler:
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}: expected one of {sorted(SAMPLERS)}")
    return SAMPLERS[name](cfg)


def cfg_combine(out_uncond: Tensor, out_cond: Tensor, guidance: float) -> Tensor:
    """Classifier-free guidance (Ho & Salimans 2022): uncond + w (cond - uncond); w = 1 is plain conditional."""
    return out_uncond + guidance * (out_cond - out_uncond)
