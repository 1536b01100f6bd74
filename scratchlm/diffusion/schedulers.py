"""Noise schedules, the DDPM training objective, and the DDPM / DDIM / Euler / Euler ancestral / LMS / PNDM
(PLMS) / DPM-Solver++ samplers.

Conventions follow diffusers (so a step equals `DDPMScheduler.step`, `DDIMScheduler.step`,
`EulerDiscreteScheduler.step`, `EulerAncestralDiscreteScheduler.step`, `LMSDiscreteScheduler.step`,
`PNDMScheduler.step` and
`DPMSolverMultistepScheduler.step` (dpmsolver++) on the same inputs and generator, checked in
tests/diffusion/test_schedulers.py):

- a schedule of T training steps: betas (linear, scaled_linear or squaredcos_cap_v2), alpha_bar_t =
  prod(1 - beta); the forward process x_t = sqrt(alpha_bar_t) x_0 + sqrt(1 - alpha_bar_t) eps;
- prediction types: "epsilon" (the model predicts eps) and "v_prediction" (v = sqrt(alpha_bar) eps -
  sqrt(1 - alpha_bar) x_0, Salimans & Ho 2022);
- samplers share one interface: `set_timesteps(n)`, `.timesteps`, `init_noise_sigma`,
  `scale_model_input(x, t)`, `step(model_output, t, x, noise=None) -> x_prev`; one model call per entry of
  `.timesteps`, in order (multistep samplers keep a history: a fresh `set_timesteps` resets it; PNDM's
  `.timesteps` repeats one timestep, so it has more entries than steps);
- a diffusers `scheduler_config.json` is read by `schedule_from_diffusers` (the field defaults of its class,
  `steps_offset`, `set_alpha_to_one`, `clip_sample`, ...). Every field is either used, required to have the value
  our samplers implement (else a ValueError naming it), or inert and listed in `_INERT` with the reason. A class
  we do not implement is refused by name (`PNDMScheduler`, Stable Diffusion 1.x's default, runs as itself).

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
    timestep_spacing: str = field(default="trailing", metadata={"help": "leading | trailing | linspace"})
    steps_offset: int = field(default=0, metadata={"help": "added to the 'leading' timesteps (Stable Diffusion: 1)"})
    set_alpha_to_one: bool = field(default=True, metadata={
        "help": "DDIM's last step goes to alpha_bar = 1 (True) or to alpha_bar_0 (False, Stable Diffusion)"})
    clip_sample: bool = field(default=False, metadata={
        "help": "DDIM / DDPM clamp the predicted x_0 to [-clip_sample_range, clip_sample_range]"})
    clip_sample_range: float = field(default=1.0, metadata={"help": "the clamp of clip_sample"})
    skip_prk_steps: bool = field(default=True, metadata={
        "help": "PNDM only: start with PLMS's own low-order steps (True, what Stable Diffusion ships) instead of "
                "12 pseudo Runge-Kutta evaluations (False, the paper's PNDM)"})
    # DPM-Solver++ (multistep) settings, diffusers' DPMSolverMultistepScheduler names
    solver_order: int = field(default=2, metadata={"help": "DPM-Solver++: 1 (DDIM-like) or 2 (2M, multistep)"})
    algorithm_type: str = field(default="dpmsolver++", metadata={
        "help": "DPM-Solver: only dpmsolver++ (data prediction, deterministic) is implemented"})
    solver_type: str = field(default="midpoint", metadata={"help": "DPM-Solver++ 2nd order: midpoint | heun"})
    lower_order_final: bool = field(default=True, metadata={
        "help": "DPM-Solver++: first order for the last step when there are fewer than 15 steps"})
    euler_at_final: bool = field(default=False, metadata={"help": "DPM-Solver++: first order for the last step"})
    final_sigmas_type: str = field(default="zero", metadata={
        "help": "DPM-Solver++: the last step goes to sigma 0 ('zero', always first order) or to sigma_min of the "
                "training schedule ('sigma_min')"})
    use_karras_sigmas: bool = field(default=False, metadata={
        "help": "DPM-Solver++: Karras et al. (2022)'s rho = 7 sigma spacing, timesteps from the sigmas"})

    def __post_init__(self):
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"prediction_type must be 'epsilon' or 'v_prediction', got {self.prediction_type!r}")
        if self.beta_schedule not in ("linear", "scaled_linear", "squaredcos_cap_v2"):
            raise ValueError(f"beta_schedule must be linear, scaled_linear or squaredcos_cap_v2, "
                             f"got {self.beta_schedule!r}")
        if self.timestep_spacing not in ("leading", "trailing", "linspace"):
            raise ValueError(f"timestep_spacing must be leading, trailing or linspace, got {self.timestep_spacing!r}")
        for key, allowed in (("solver_order", (1, 2)), ("algorithm_type", ("dpmsolver++",)),
                             ("solver_type", ("midpoint", "heun")), ("final_sigmas_type", ("zero", "sigma_min"))):
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key}={getattr(self, key)!r} is not supported (one of {list(allowed)})")

    def diffusers_config(self, sampler: str | None = None) -> dict:
        """The shared diffusers scheduler fields, plus the settings only `sampler`'s class reads (pndm, dpmpp)."""
        out = dict(num_train_timesteps=self.num_train_timesteps, beta_start=self.beta_start, beta_end=self.beta_end,
                   beta_schedule=self.beta_schedule, prediction_type=self.prediction_type,
                   timestep_spacing=self.timestep_spacing, clip_sample=self.clip_sample,
                   clip_sample_range=self.clip_sample_range, set_alpha_to_one=self.set_alpha_to_one,
                   steps_offset=self.steps_offset)
        own = {"pndm": ("skip_prk_steps",),
               "dpmpp": ("solver_order", "algorithm_type", "solver_type", "lower_order_final", "euler_at_final",
                         "final_sigmas_type", "use_karras_sigmas")}.get(sampler, ())
        return out | {k: getattr(self, k) for k in own}


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
        return (np.arange(0, n) * (t // n)).round()[::-1].copy().astype(np.int64) + cfg.steps_offset
    if cfg.timestep_spacing == "trailing":
        return np.round(np.arange(t, 0, -t / n)).astype(np.int64) - 1
    return np.linspace(0, t - 1, n).round()[::-1].copy().astype(np.int64)  # linspace


def _x0_eps(cfg: ScheduleConfig, out: Tensor, x: Tensor, ab: Tensor) -> tuple[Tensor, Tensor]:
    """(x_0, eps) from the model output at a step with alpha_bar = ab."""
    b = 1 - ab
    if cfg.prediction_type == "epsilon":
        return (x - b**0.5 * out) / ab**0.5, out
    return ab**0.5 * x - b**0.5 * out, ab**0.5 * out + b**0.5 * x


def _clip(cfg: ScheduleConfig, x0: Tensor) -> Tensor:
    return x0.clamp(-cfg.clip_sample_range, cfg.clip_sample_range) if cfg.clip_sample else x0


class _Sampler:
    # whether the sampler runs use_karras_sigmas / final_sigmas_type; the others refuse a non-default value
    runs_sigma_settings = False
    # whether step() adds fresh noise (x.shape, from `generator` unless `noise` is given): a caller that steps
    # pieces of x (patch parallel) must pass the pieces of one full-size draw as `noise`
    draws_noise = False

    def __init__(self, cfg: ScheduleConfig):
        if not self.runs_sigma_settings and (cfg.use_karras_sigmas or cfg.final_sigmas_type != "zero"):
            raise ValueError(f"the {type(self).__name__} runs use_karras_sigmas=False and final_sigmas_type='zero' "
                             f"only, got {cfg.use_karras_sigmas!r} and {cfg.final_sigmas_type!r}")
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

    draws_noise = True

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
        x0 = _clip(self.config, _x0_eps(self.config, out, x, ab)[0])
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
        self.draws_noise = eta > 0

    def step(self, out: Tensor, t, x: Tensor, noise: Tensor | None = None, generator=None) -> Tensor:
        t = int(t)
        prev = t - self._stride()
        ab = self._ab(t)
        # the step past t = 0 lands on alpha_bar = 1, or on alpha_bar_0 with set_alpha_to_one = False
        ab_prev = self._ab(prev) if prev >= 0 or self.config.set_alpha_to_one else self.alphas_cumprod[0]
        x0, eps = _x0_eps(self.config, out, x, ab)
        x0 = _clip(self.config, x0)  # eps stays the model's (diffusers: use_clipped_model_output=False)
        std = self.eta * ((1 - ab_prev) / (1 - ab) * (1 - ab / ab_prev)) ** 0.5
        prev_x = ab_prev**0.5 * x0 + (1 - ab_prev - std**2) ** 0.5 * eps
        if self.eta > 0:
            if noise is None:
                noise = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
            prev_x = prev_x + std * noise
        return prev_x


class EulerSampler(_Sampler):
    """Euler on the probability-flow ODE in sigma = sqrt((1 - ab) / ab) (Karras et al. 2022; diffusers'
    EulerDiscreteScheduler with s_churn = 0). Samples live at scale sqrt(1 + sigma^2). Karras sigmas and a
    sigma_min final sigma are not implemented here (refused by name)."""

    def set_timesteps(self, n: int, device=None) -> None:
        self.num_inference_steps = n
        t_train = self.config.num_train_timesteps
        if self.config.timestep_spacing == "linspace":  # not rounded, unlike DDIM / DDPM's
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

    def _x0(self, out: Tensor, x: Tensor, s) -> Tensor:
        """x_0 from the model output at sigma s (x in sigma scaling, float32)."""
        if self.config.prediction_type == "epsilon":
            return x - s * out
        return out * (-s / (s**2 + 1) ** 0.5) + x / (s**2 + 1)

    def step(self, out: Tensor, t, x: Tensor, noise: Tensor | None = None, generator=None) -> Tensor:
        i = self._index(t)
        s, s_next = self.sigmas[i], self.sigmas[i + 1]
        x = x.float()
        x0 = self._x0(out, x, s)
        return (x + (x - x0) / s * (s_next - s)).to(out.dtype)


class PNDMSampler(_Sampler):
    """PNDM (Liu et al. 2022, "Pseudo Numerical Methods for Diffusion Models"), diffusers' PNDMScheduler.

    Each step moves x along the DDIM-like transfer x_prev = sqrt(ab'/ab) x - (ab' - ab) eps / (ab sqrt(1 - ab') +
    sqrt(ab (1 - ab) ab')) (the paper's eq. 9) with eps a linear multistep combination of the model's recent outputs
    (PLMS: Adams-Bashforth orders 1..4, 55/-59/37/-9 over 24 once four are known). `skip_prk_steps` True (what SD
    ships): the first step is taken twice, so its timestep appears twice in `.timesteps` (25 steps -> 26 model
    calls): once with eps, then again from the same x with the mean of eps and the new output (a Heun-like
    start). False: the first three steps are 12 pseudo Runge-Kutta evaluations (at t, t - stride/2 twice and
    t - stride), then PLMS. Stateful: `set_timesteps` resets the history, and the steps must come in `.timesteps`
    order. x_0 is never clipped (clip_sample is not read, as in diffusers); the last step lands on alpha_bar = 1 or,
    with set_alpha_to_one False (SD), on alpha_bar_0."""

    def set_timesteps(self, n: int, device=None) -> None:
        self.num_inference_steps = n
        up = _spacing(self.config, n)[::-1].copy()  # ascending
        if self.config.skip_prk_steps:
            self._prk = np.zeros(0, dtype=np.int64)
            plms = np.concatenate([up[:-1], up[-2:-1], up[-1:]])[::-1]  # the second-highest timestep twice
        else:
            # the top four timesteps and their midpoints, each evaluated as RK4 needs: t, t-h/2, t-h/2, t-h
            prk = up[-4:].repeat(2) + np.tile(np.array([0, self._stride() // 2]), 4)
            self._prk = prk[:-1].repeat(2)[1:-1][::-1].copy()
            plms = up[:-3][::-1]
        self.timesteps = torch.from_numpy(np.concatenate([self._prk, plms]).astype(np.int64)).to(device)
        self._ets: list[Tensor] = []  # the model outputs PLMS combines, oldest first
        self._counter = 0
        self._rk_sum: Tensor | float = 0.0  # RK4's running weighted sum of the four evaluations
        self._x_start: Tensor | None = None  # the sample a multi-evaluation step started from

    def _final_ab(self) -> Tensor:
        return torch.tensor(1.0) if self.config.set_alpha_to_one else self.alphas_cumprod[0]

    def _transfer(self, x: Tensor, t: int, prev: int, eps: Tensor) -> Tensor:
        ab = self.alphas_cumprod[t]
        ab_prev = self.alphas_cumprod[prev] if prev >= 0 else self._final_ab()
        b, b_prev = 1 - ab, 1 - ab_prev
        if self.config.prediction_type == "v_prediction":
            eps = ab**0.5 * eps + b**0.5 * x
        denom = ab * b_prev**0.5 + (ab * b * ab_prev) ** 0.5
        return (ab_prev / ab) ** 0.5 * x - (ab_prev - ab) * eps / denom

    def step(self, out: Tensor, t, x: Tensor, noise: Tensor | None = None, generator=None) -> Tensor:
        t = int(t)
        if self._counter < len(self._prk):
            prev = self._step_prk(out, t, x)
        else:
            prev = self._step_plms(out, t, x)
        self._counter += 1
        return prev

    def _step_prk(self, out: Tensor, t: int, x: Tensor) -> Tensor:
        c = self._counter
        prev = t - (0 if c % 2 else self._stride() // 2)
        t = int(self._prk[c // 4 * 4])  # every evaluation of one RK step moves from its start
        if c % 4 == 0:
            self._rk_sum = self._rk_sum + 1 / 6 * out
            self._ets.append(out)
            self._x_start = x
        elif c % 4 in (1, 2):
            self._rk_sum = self._rk_sum + 1 / 3 * out
        else:
            out = self._rk_sum + 1 / 6 * out
            self._rk_sum = 0.0
        start = self._x_start if self._x_start is not None else x
        return self._transfer(start, t, prev, out)

    def _step_plms(self, out: Tensor, t: int, x: Tensor) -> Tensor:
        stride = self._stride()
        prev = t - stride
        if self._counter != 1:
            self._ets = self._ets[-3:] + [out]
        else:  # the repeated first step: again from its start, from t + stride to t
            prev, t = t, t + stride
        e = self._ets
        if len(e) == 1 and self._counter == 0:
            self._x_start = x
        elif len(e) == 1 and self._counter == 1:
            out = (out + e[-1]) / 2
            x, self._x_start = self._x_start, None
        elif len(e) == 2:
            out = (3 * e[-1] - e[-2]) / 2
        elif len(e) == 3:
            out = (23 * e[-1] - 16 * e[-2] + 5 * e[-3]) / 12
        else:
            out = (1 / 24) * (55 * e[-1] - 59 * e[-2] + 37 * e[-3] - 9 * e[-4])
        return self._transfer(x, t, prev, out)


class EulerAncestralSampler(EulerSampler):
    """Euler ancestral (k-diffusion's sample_euler_ancestral; diffusers' EulerAncestralDiscreteScheduler): the
    Euler sampler's sigmas, scaling and x_0, but each step goes deterministically down to sigma_down and adds fresh
    noise of std sigma_up, with sigma_up^2 = sigma_next^2 (sigma^2 - sigma_next^2) / sigma^2 and sigma_down^2 =
    sigma_next^2 - sigma_up^2 (eta 1). The noise is `noise` when given, else torch.randn(x.shape,
    generator=generator, dtype=model_output.dtype): the same draw as diffusers' step with that generator, so a
    pipeline run equals diffusers' image when both get the same generator (ours: `denoise(seed=s)` draws from
    torch.Generator().manual_seed(s + 1); pass that generator, and the latents, to StableDiffusionPipeline)."""

    draws_noise = True

    def step(self, out: Tensor, t, x: Tensor, noise: Tensor | None = None, generator=None) -> Tensor:
        i = self._index(t)
        s, s_next = self.sigmas[i], self.sigmas[i + 1]
        x = x.float()
        x0 = self._x0(out, x, s)
        s_up = (s_next**2 * (s**2 - s_next**2) / s**2) ** 0.5
        s_down = (s_next**2 - s_up**2) ** 0.5
        prev = x + (x - x0) / s * (s_down - s)
        if noise is None:
            noise = torch.randn(out.shape, generator=generator, dtype=out.dtype, device=out.device)
        return (prev + noise * s_up).to(out.dtype)


class LMSSampler(EulerSampler):
    """Linear multistep in sigma (Karras et al. 2022's k-diffusion sample_lms; diffusers' LMSDiscreteScheduler,
    order 4): the Euler sampler's sigmas and scaling; the ODE's derivative d = (x - x_0) / sigma is kept for the
    last four steps and x moves by sum_j c_j d_j, c_j the integral from sigma_i to sigma_{i+1} of the Lagrange
    basis polynomial through the sigmas of those steps (exact polynomial integration; diffusers integrates the
    same polynomial numerically with scipy's quad, equal to float32 rounding). Orders 1, 2, 3 for the first steps.
    Stateful: the steps come in `.timesteps` order."""

    order = 4

    def set_timesteps(self, n: int, device=None) -> None:
        super().set_timesteps(n, device)
        self._derivs: list[Tensor] = []  # the last `order` derivatives, oldest first

    def _coeff(self, order: int, i: int, j: int) -> float:
        nodes = [float(self.sigmas[i - k]) for k in range(order)]  # this step's sigma and the previous ones
        basis = np.poly1d([1.0])
        for k in range(order):
            if k != j:
                basis = basis * np.poly1d([1.0, -nodes[k]]) / (nodes[j] - nodes[k])
        integral = basis.integ()
        return float(integral(float(self.sigmas[i + 1])) - integral(float(self.sigmas[i])))

    def step(self, out: Tensor, t, x: Tensor, noise: Tensor | None = None, generator=None) -> Tensor:
        i = self._index(t)
        s = self.sigmas[i]
        x0 = self._x0(out, x, s)
        self._derivs = (self._derivs + [(x - x0) / s])[-self.order:]
        order = min(i + 1, self.order)
        coeffs = [self._coeff(order, i, j) for j in range(order)]
        return x + sum(c * d for c, d in zip(coeffs, reversed(self._derivs)))


def _sigma_to_t(sigma: float, log_sigmas: np.ndarray) -> float:
    """The (fractional) training timestep whose sigma is `sigma`: linear interpolation in log sigma."""
    log_sigma = np.log(np.maximum(sigma, 1e-10))
    dists = log_sigma - log_sigmas[:, np.newaxis]  # (T, 1)
    low = int(np.cumsum(dists >= 0, axis=0).argmax(axis=0).clip(max=log_sigmas.shape[0] - 2)[0])
    w = np.clip((log_sigmas[low] - log_sigma) / (log_sigmas[low] - log_sigmas[low + 1]), 0, 1)
    return float((1 - w) * low + w * (low + 1))


class DPMSolverSampler(_Sampler):
    """DPM-Solver++ multistep (Lu et al. 2022, "DPM-Solver++"), diffusers' DPMSolverMultistepScheduler with
    algorithm_type "dpmsolver++": solver_order 2 is the "DPM++ 2M" sampler. In sigma = sqrt((1 - ab) / ab) with
    alpha_t = 1 / sqrt(1 + sigma^2), sigma_t = sigma alpha_t and lambda = log(alpha_t / sigma_t), the model output is
    turned into a data prediction x_0 and the step from s to t (h = lambda_t - lambda_s) is
    x_t = (sigma_t / sigma_s) x - alpha_t (e^-h - 1) D, with D = x_0 (first order) or, second order, x_0 plus a
    correction from the previous x_0 (midpoint: D1 / 2; heun: D1 (1 + (e^-h - 1) / h) / -(e^-h - 1)), where
    D1 = (x_0 - x_0') h / h'. The first step is first order; so is the last one when final_sigmas_type is 'zero',
    euler_at_final is set, or lower_order_final with fewer than 15 steps. Timesteps: its own 'linspace' and
    'leading' spacings (n + 1 points, the lowest dropped: never t = 0), or Karras sigmas. Deterministic (no noise);
    `init_noise_sigma` 1, `scale_model_input` the identity. Stateful: the steps come in `.timesteps` order."""

    runs_sigma_settings = True

    def set_timesteps(self, n: int, device=None) -> None:
        cfg, t_train = self.config, self.config.num_train_timesteps
        if n > t_train:
            raise ValueError(f"{n} sampling steps exceed the {t_train} training timesteps")
        if cfg.timestep_spacing == "linspace":
            ts = np.linspace(0, t_train - 1, n + 1).round()[::-1][:-1].copy().astype(np.int64)
        elif cfg.timestep_spacing == "leading":
            ts = (np.arange(0, n + 1) * (t_train // (n + 1))).round()[::-1][:-1].copy().astype(np.int64)
            ts += cfg.steps_offset
        else:
            ts = np.arange(t_train, 0, -t_train / n).round().copy().astype(np.int64) - 1
        sig = (((1 - self.alphas_cumprod) / self.alphas_cumprod) ** 0.5).numpy()  # (T,) float32, rising in t
        log_sig = np.log(sig)
        if cfg.use_karras_sigmas:  # rho = 7 spacing between the training schedule's extreme sigmas
            lo, hi = float(sig[0]), float(sig[-1])
            ramp = np.linspace(0, 1, n)
            sig = (hi ** (1 / 7) + ramp * (lo ** (1 / 7) - hi ** (1 / 7))) ** 7
            ts = np.array([_sigma_to_t(s, log_sig) for s in sig])
            if cfg.beta_schedule != "squaredcos_cap_v2":
                ts = ts.round()
            if (ts.astype(np.int64) == int(ts[0])).sum() > 1:  # diffusers would start at the repeat and overrun
                raise ValueError(f"use_karras_sigmas with the {cfg.beta_schedule} betas gives the first timestep "
                                 f"{int(ts[0])} more than once at {n} steps; diffusers' DPMSolverMultistepScheduler "
                                 "fails on it (IndexError) and it is not supported")
        else:
            sig = np.interp(ts, np.arange(0, len(sig)), sig)
        last = float(((1 - self.alphas_cumprod[0]) / self.alphas_cumprod[0]) ** 0.5)
        last = last if cfg.final_sigmas_type == "sigma_min" else 0.0
        self.sigmas = torch.from_numpy(np.concatenate([sig, [last]]).astype(np.float32))  # (n + 1,)
        self.timesteps = torch.from_numpy(ts).to(device=device, dtype=torch.int64)
        self.num_inference_steps = len(ts)
        self._x0s: list[Tensor] = []  # the data predictions of the previous steps, oldest first
        self._i = 0

    def _alpha_sigma_lambda(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        s = self.sigmas[i]
        alpha = 1 / ((s**2 + 1) ** 0.5)
        sigma = s * alpha
        return alpha, sigma, torch.log(alpha) - torch.log(sigma)  # sigma 0: lambda = inf, e^-h = 0

    def step(self, out: Tensor, t, x: Tensor, noise: Tensor | None = None, generator=None) -> Tensor:
        cfg, i, n = self.config, self._i, len(self.timesteps)
        last = i == n - 1
        first_order = (cfg.solver_order == 1 or not self._x0s
                       or (last and (cfg.euler_at_final or (cfg.lower_order_final and n < 15)
                                     or cfg.final_sigmas_type == "zero")))
        a_s, s_s, l_s = self._alpha_sigma_lambda(i)
        x0 = (x - s_s * out) / a_s if cfg.prediction_type == "epsilon" else a_s * x - s_s * out
        self._x0s = (self._x0s + [x0])[-cfg.solver_order:]
        a_t, s_t, l_t = self._alpha_sigma_lambda(i + 1)
        x = x.float()
        h = l_t - l_s
        if first_order:
            prev = (s_t / s_s) * x - (a_t * (torch.exp(-h) - 1.0)) * x0
        else:
            h0 = l_s - self._alpha_sigma_lambda(i - 1)[2]
            d1 = (1.0 / (h0 / h)) * (x0 - self._x0s[-2])
            prev = (s_t / s_s) * x - (a_t * (torch.exp(-h) - 1.0)) * x0
            if cfg.solver_type == "midpoint":
                prev = prev - 0.5 * (a_t * (torch.exp(-h) - 1.0)) * d1
            else:
                prev = prev + (a_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * d1
        self._i += 1
        return prev.to(out.dtype)


SAMPLERS = {"ddpm": DDPMSampler, "ddim": DDIMSampler, "euler": EulerSampler, "pndm": PNDMSampler,
            "dpmpp": DPMSolverSampler, "euler_a": EulerAncestralSampler, "lms": LMSSampler}


def make_sampler(name: str, cfg: ScheduleConfig) -> _Sampler:
    if name not in SAMPLERS:
        raise ValueError(f"unknown sampler {name!r}: expected one of {sorted(SAMPLERS)}")
    return SAMPLERS[name](cfg)


def cfg_combine(out_uncond: Tensor, out_cond: Tensor, guidance: float) -> Tensor:
    """Classifier-free guidance (Ho & Salimans 2022): uncond + w (cond - uncond); w = 1 is plain conditional."""
    return out_uncond + guidance * (out_cond - out_uncond)


# --- diffusers scheduler_config.json ----------------------------------------------------------------------------
# class -> (our sampler, the class's defaults for the fields ScheduleConfig reads)
_BASE = dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02, beta_schedule="linear",
             prediction_type="epsilon", timestep_spacing="leading", steps_offset=0)
SCHEDULER_CLASSES: dict[str, tuple[str, dict]] = {
    "DDIMScheduler": ("ddim", {**_BASE, "set_alpha_to_one": True, "clip_sample": True, "clip_sample_range": 1.0}),
    "DDPMScheduler": ("ddpm", {**_BASE, "clip_sample": True, "clip_sample_range": 1.0}),
    "EulerDiscreteScheduler": ("euler", {**_BASE, "timestep_spacing": "linspace", "clip_sample": False}),
    "DPMSolverMultistepScheduler": ("dpmpp", {**_BASE, "timestep_spacing": "linspace", "solver_order": 2,
                                              "algorithm_type": "dpmsolver++", "solver_type": "midpoint",
                                              "lower_order_final": True, "euler_at_final": False,
                                              "final_sigmas_type": "zero", "use_karras_sigmas": False}),
    "EulerAncestralDiscreteScheduler": ("euler_a", {**_BASE, "timestep_spacing": "linspace", "clip_sample": False}),
    "LMSDiscreteScheduler": ("lms", {**_BASE, "timestep_spacing": "linspace", "clip_sample": False}),
    "PNDMScheduler": ("pndm", {**_BASE, "set_alpha_to_one": False, "clip_sample": False, "skip_prk_steps": False}),
}
# fields our samplers implement only at one value (diffusers' default); any other value is refused by name
_REQUIRED = {"trained_betas": None, "thresholding": False, "rescale_betas_zero_snr": False,
             "variance_type": "fixed_small", "interpolation_type": "linear",
             "use_exponential_sigmas": False, "use_beta_sigmas": False, "sigma_min": None, "sigma_max": None,
             "timestep_type": "discrete", "lambda_min_clipped": -math.inf, "use_lu_lambdas": False,
             "use_flow_sigmas": False, "use_dynamic_shifting": False}
_REQUIRED_BY_CLASS = {"DPMSolverMultistepScheduler": {"variance_type": None}}  # (its default; DDPM's differs)
# fields that change nothing in what we run, and why
_INERT = {"_class_name": "metadata", "_diffusers_version": "metadata", "_name_or_path": "metadata",
          "dynamic_thresholding_ratio": "used only with thresholding, which must be off",
          "sample_max_value": "used only with thresholding, which must be off",
          "flow_shift": "used only with use_flow_sigmas / use_dynamic_shifting, which must be off",
          "time_shift_type": "used only with use_dynamic_shifting, which must be off"}


def schedule_from_diffusers(cfg: dict, where: str = "scheduler_config.json") -> tuple[ScheduleConfig, str, str | None]:
    """(ScheduleConfig, sampler name, note) from a diffusers scheduler config dict. `note` would say what runs
    instead of a class that is only mapped (the caller logs it); every supported class runs as itself, so it is
    None. Unknown fields and unsupported values raise ValueError naming `where` and the field. Fields of other
    classes that diffusers writes into a config (SDXL's Euler config carries DDIM's set_alpha_to_one) are read:
    they matter if a different sampler is chosen at run time."""
    name = cfg.get("_class_name")
    if name not in SCHEDULER_CLASSES:
        raise ValueError(f"{where}: scheduler class {name!r} is not supported; supported: "
                         f"{sorted(SCHEDULER_CLASSES)}")
    sampler, defaults = SCHEDULER_CLASSES[name]
    ours = set(ScheduleConfig.__dataclass_fields__)
    required = {**_REQUIRED, **_REQUIRED_BY_CLASS.get(name, {})}
    kw = {k: v for k, v in defaults.items()}
    for key, value in cfg.items():
        if key in ours:
            kw[key] = value
        elif key in required:
            want = required[key]
            if value != want and not (want is False and value is None):
                raise ValueError(f"{where}: {key}={value!r} is not supported (only {want!r})")
        elif key not in _INERT:
            raise ValueError(f"{where}: unknown scheduler field {key!r} (class {name})")
    if kw["prediction_type"] not in ("epsilon", "v_prediction"):
        raise ValueError(f"{where}: prediction_type={kw['prediction_type']!r} is not supported "
                         "(epsilon or v_prediction)")
    try:
        schedule = ScheduleConfig(**kw)
        make_sampler(sampler, schedule)  # the folder's own sampler accepts its settings
    except ValueError as e:
        raise ValueError(f"{where} ({name}): {e}") from None
    return schedule, sampler, None


def scheduler_class_for(sampler: str) -> str:
    """The diffusers scheduler class that runs `sampler` with the same numerics (for export)."""
    return {"ddim": "DDIMScheduler", "ddpm": "DDPMScheduler", "euler": "EulerDiscreteScheduler",
            "pndm": "PNDMScheduler", "dpmpp": "DPMSolverMultistepScheduler",
            "euler_a": "EulerAncestralDiscreteScheduler", "lms": "LMSDiscreteScheduler"}[sampler]


def rescale_cfg(guided: Tensor, out_cond: Tensor, rescale: float) -> Tensor:
    """`guidance_rescale` (Lin et al. 2023, sec. 3.4; diffusers' rescale_noise_cfg): mix the guided output with
    itself rescaled to the conditional output's per-sample std; 0 leaves it unchanged."""
    if rescale == 0.0:
        return guided
    dims = list(range(1, guided.ndim))
    rescaled = guided * (out_cond.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return rescale * rescaled + (1 - rescale) * guided
