"""RoPE frequencies: plain, and the context-extension scalings checkpoints ship with.

`inv_freq(dim, theta, scaling, seq_len)` returns the (dim/2,) inverse frequencies of the rotated dims and the
attention factor that multiplies cos and sin, as HF transformers' `modeling_rope_utils` computes them (the
oracle in the tests):

- none: 1 / theta^(2i/dim);
- linear (position interpolation): divided by `factor`;
- dynamic (NTK-aware): once the sequence is longer than the original context, theta grows to
  theta * (factor * L / L0 - (factor - 1))^(dim / (dim - 2));
- llama3: low frequencies (wavelength > L0 / low_freq_factor) divided by factor, high ones
  (wavelength < L0 / high_freq_factor) kept, a smooth blend between;
- yarn: extrapolated and interpolated frequencies blended by a linear ramp over the dims whose rotation count
  in L0 lies between beta_slow and beta_fast (its ends rounded to whole dims unless `truncate` is off, as
  gpt-oss); attention factor 0.1 ln(factor) + 1 (DeepSeek: the ratio mscale(mscale) / mscale(mscale_all_dim)
  when both are given);
- longrope (Phi-3): per-frequency divisors, the short set within L0 and the long set beyond; attention factor
  sqrt(1 + ln(factor) / ln(L0)).

`seq_len` (the longest position of the call + 1) only matters to dynamic and longrope, which switch on it as
HF does per forward.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _plain(dim: int, theta: float, device) -> Tensor:
    exponent = torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim
    return 1.0 / (theta**exponent)  # (dim/2,)


def inv_freq(dim: int, theta: float, scaling, seq_len: int = 0, device=None) -> tuple[Tensor, float]:
    """(inverse frequencies (dim/2,), attention factor) for `scaling` (a `RopeFeatures`, or None = plain)."""
    kind = "none" if scaling is None else scaling.scaling
    if kind == "none":
        return _plain(dim, theta, device), 1.0
    factor, orig = scaling.factor, scaling.original_max_seq_len
    if kind == "linear":
        return _plain(dim, theta, device) / factor, 1.0
    if kind == "dynamic":
        length = max(seq_len, orig)
        base = theta * ((factor * length / orig) - (factor - 1)) ** (dim / (dim - 2))
        return _plain(dim, base, device), 1.0
    if kind == "llama3":
        freq = _plain(dim, theta, device)
        low_wavelen, high_wavelen = orig / scaling.low_freq_factor, orig / scaling.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
        smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    if kind == "yarn":
        return _yarn(dim, theta, scaling, device)
    if kind == "longrope":
        attention = scaling.attention_factor
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
        ext = scaling.long_factor if seq_len > orig else scaling.short_factor
        if len(ext) != dim // 2:
            raise ValueError(f"longrope: {len(ext)} factors for {dim // 2} frequencies")
        shape = torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim
        return 1.0 / (torch.tensor(ext, dtype=torch.float32, device=device) * theta**shape), attention
    raise ValueError(f"RoPE scaling {kind!r} is not implemented")


def _yarn(dim: int, theta: float, s, device) -> tuple[Tensor, float]:
    factor, orig = s.factor, s.original_max_seq_len
    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = s.attention_factor
    if attention is None:  # DeepSeek's mscale / mscale_all_dim ratio when both are set, as HF
        attention = mscale(s.mscale) / mscale(s.mscale_all_dim) if s.mscale and s.mscale_all_dim else mscale()

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:  # the ramp's ends on whole dims (HF's default; gpt-oss: truncate false keeps them fractional)
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1).to(device)
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate
    return interpolation * (1 - keep) + extrapolation * keep, attention
