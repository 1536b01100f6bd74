"""A small AlphaFold3-style diffusion head: a transformer denoiser over token coordinates, sampled K times.

The denoiser D(x, sigma) follows EDM (Karras et al. 2022) as AlphaFold3 does: x (K, N, 3) noisy token
coordinates at noise level sigma, preconditioned with c_in = 1/sqrt(sigma^2 + sd^2),
c_skip = sd^2/(sigma^2 + sd^2), c_out = sigma sd/sqrt(sigma^2 + sd^2), c_noise = log(sigma/sd)/4, and
D = c_skip x + c_out F(c_in x, c_noise; s, z). F is a stack of pair-biased attention layers (the trunk's
`AttentionPairBias`, the bias from the trunk's z, computed once per trunk pass) with adaptive LayerNorm
conditioning on the trunk's single representation and the noise embedding, and `Transition`s.

Sampling is the deterministic EDM Euler sampler on the Karras schedule (sigma_max -> sigma_min, rho = 7),
sample k drawing its initial noise from a generator seeded (seed, k), so a sample is the same wherever
it runs: the K samples are data-parallel over the ranks that ran the trunk (`sample_data_parallel`),
each rank taking a contiguous share, and equal to one rank's K samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from scratchlm.fold.pairformer import AttentionPairBias, LayerNorm, Transition
from scratchlm.model.layers import Linear


@dataclass(frozen=True)
class DiffusionHeadConfig:
    """Shapes and sampler settings of the diffusion head."""

    c_token: int = field(default=128, metadata={"help": "channels of the denoiser's token activations"})
    n_layers: int = field(default=2, metadata={"help": "pair-biased transformer layers of the denoiser"})
    heads: int = field(default=4, metadata={"help": "attention heads per layer"})
    fourier_dim: int = field(default=64, metadata={"help": "random Fourier features of the noise level"})
    steps: int = field(default=20, metadata={"help": "Euler steps per sample"})
    sigma_data: float = field(default=16.0, metadata={"help": "EDM sigma_data (coordinates in Angstrom)"})
    sigma_min: float = field(default=4e-4, metadata={"help": "smallest noise level of the schedule"})
    sigma_max: float = field(default=160.0, metadata={"help": "largest noise level of the schedule"})
    rho: float = field(default=7.0, metadata={"help": "Karras schedule exponent"})

    def __post_init__(self) -> None:
        for name in ("c_token", "n_layers", "heads", "fourier_dim", "steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"DiffusionHeadConfig.{name}={v!r} must be a positive int")
        if self.c_token % self.heads:
            raise ValueError(f"DiffusionHeadConfig: c_token={self.c_token} is not a multiple of heads={self.heads}")
        if not 0 < self.sigma_min < self.sigma_max:
            raise ValueError(f"DiffusionHeadConfig: need 0 < sigma_min < sigma_max, got {self.sigma_min}, "
                             f"{self.sigma_max}")

    def schedule(self) -> list[float]:
        """Karras noise levels sigma_0 = sigma_max > ... > sigma_{steps-1} = sigma_min, then 0."""
        n, r = self.steps, self.rho
        if n == 1:
            return [self.sigma_max, 0.0]
        a, b = self.sigma_max ** (1 / r), self.sigma_min ** (1 / r)
        return [(a + i / (n - 1) * (b - a)) ** r for i in range(n)] + [0.0]


@dataclass
class Conditioning:
    """What the head reads from one trunk pass: token features (1, N, c_token), per-layer pair biases
    (1, H, N, N) and the token mask (1, N)."""

    tokens: Tensor
    biases: list[Tensor]
    mask: Tensor


class _AdaLN(nn.Module):
    """LayerNorm without affine, then scale and shift from the conditioning: LN(a) (1 + W_s c) + W_b c."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.scale = Linear(dim, dim)
        self.shift = Linear(dim, dim)

    def forward(self, a: Tensor, cond: Tensor) -> Tensor:
        return torch.nn.functional.layer_norm(a, (self.dim,)) * (1 + self.scale(cond)) + self.shift(cond)


class DiffusionHead(nn.Module):
    """The denoiser and its sampler; `condition` once per trunk pass, then `sample` any samples."""

    def __init__(self, cfg: DiffusionHeadConfig, c_s: int, c_z: int):
        super().__init__()
        self.cfg = cfg
        ct = cfg.c_token
        self.s_proj = nn.Sequential(LayerNorm(c_s), Linear(c_s, ct))
        self.x_proj = Linear(3, ct)
        self.register_buffer("fourier_w", torch.randn(cfg.fourier_dim // 2) * 2 * math.pi, persistent=True)
        self.noise_proj = Linear(cfg.fourier_dim, ct)
        self.norms = nn.ModuleList(_AdaLN(ct) for _ in range(cfg.n_layers))
        self.attn = nn.ModuleList(AttentionPairBias(ct, c_z, cfg.heads) for _ in range(cfg.n_layers))
        self.trans = nn.ModuleList(Transition(ct, 2 * ct) for _ in range(cfg.n_layers))
        self.out = nn.Sequential(LayerNorm(ct), Linear(ct, 3))

    def pair_biases(self, z: Tensor, chunk_rows: int | None = None) -> list[Tensor]:
        """Rows of z (1, R, N, c_z) -> per-layer bias rows (1, H, R, N) (a DAP rank all-gathers them)."""
        return [a.pair_bias(z, chunk_rows) for a in self.attn]

    def condition(self, s: Tensor, biases: list[Tensor], mask: Tensor) -> Conditioning:
        """Trunk s (1, N, c_s), full-pair biases from `pair_biases`, mask (1, N)."""
        return Conditioning(self.s_proj(s), biases, mask)

    def denoise(self, x: Tensor, sigma: float, cond: Conditioning) -> Tensor:
        """D(x, sigma): x (K, N, 3) -> denoised (K, N, 3)."""
        sd = self.cfg.sigma_data
        c_in, c_skip = 1 / math.sqrt(sigma**2 + sd**2), sd**2 / (sigma**2 + sd**2)
        c_out = sigma * sd / math.sqrt(sigma**2 + sd**2)
        c_noise = math.log(sigma / sd) / 4
        f = c_noise * self.fourier_w  # (F/2,)
        noise = self.noise_proj(torch.cat((f.cos(), f.sin())))  # (c_token,)
        ctx = cond.tokens + noise  # (1, N, c_token): the adaLN conditioning
        a = cond.tokens + self.x_proj(c_in * x)  # (K, N, c_token)
        for norm, attn, trans, bias in zip(self.norms, self.attn, self.trans, cond.biases):
            a = a + attn(norm(a, ctx), bias, cond.mask)
            a = a + trans(a)
        return c_skip * x + c_out * self.out(a)

    @torch.no_grad()
    def sample(self, cond: Conditioning, indices: list[int], seed: int = 0) -> Tensor:
        """Samples `indices` (their own seeded noise) together as one batch -> (len(indices), N, 3)."""
        n = cond.tokens.shape[1]
        if not indices:
            return cond.tokens.new_empty(0, n, 3)
        sig = self.cfg.schedule()
        noise = []
        for k in indices:
            g = torch.Generator().manual_seed(seed * 1_000_003 + k)
            noise.append(torch.randn(n, 3, generator=g))
        x = torch.stack(noise).to(cond.tokens) * sig[0]  # (K, N, 3)
        for s_cur, s_next in zip(sig[:-1], sig[1:]):
            d = (x - self.denoise(x, s_cur, cond)) / s_cur  # dx/dsigma
            x = x + (s_next - s_cur) * d
        return x


def sample_data_parallel(head: DiffusionHead, cond: Conditioning, k: int, comm, seed: int = 0) -> Tensor:
    """The K samples split in contiguous shares over `comm`'s ranks, gathered: (K, N, 3) on every rank."""
    from scratchlm.parallel.layout import split_range

    p, r = comm.world, comm.rank
    shares = split_range(k, p)
    lo, hi = shares[r]
    mine = head.sample(cond, list(range(lo, hi)), seed)
    width = shares[0][1] - shares[0][0]  # the largest share: pad so every rank sends the same size
    padded = torch.zeros(width, *mine.shape[1:], dtype=mine.dtype, device=mine.device)
    padded[: hi - lo] = mine
    every = comm.all_gather(padded, dim=0)  # (P * width, N, 3)
    return torch.cat([every[i * width:i * width + (b - a)] for i, (a, b) in enumerate(shares)])


def condition_from_shards(head: DiffusionHead, comm, s: Tensor, z_rows: Tensor, mask: Tensor, n: int,
                          chunk_rows: int | None = None) -> Conditioning:
    """The head's conditioning after a DAP trunk: each rank's bias rows all-gathered (1, H, N', N'), the
    padding cut back to the n real tokens (so samples match one rank's, noise included)."""
    biases = [comm.all_gather(b, dim=2)[:, :, :n, :n] for b in head.pair_biases(z_rows, chunk_rows)]
    return head.condition(s[:, :n], biases, mask[:, :n])
