"""The VAE: an AutoencoderKL (Stable Diffusion's first stage), parameter-compatible with diffusers.

    encoder: conv_in -> [ResNet x L (+ stride-2 conv downsample)] per level -> mid (ResNet, attention,
             ResNet) -> GroupNorm, SiLU, conv_out -> quant_conv -> moments (B, 2c, h, w)
    latent:  diagonal Gaussian: mean, logvar (clamped to [-30, 20]); z = mean + exp(logvar / 2) * eps
    decoder: post_quant_conv -> conv_in -> mid -> [ResNet x (L+1) (+ nearest x2 + conv)] per level
             -> GroupNorm, SiLU, conv_out

Diffusion runs on z * scaling_factor. `decode(..., tile=...)` decodes overlapping latent tiles and
blends them linearly (diffusers' tiled decoding scheme): peak activation memory is bounded by the
tile, at the price of a small seam error against the untiled decode (measured in benchmarks/).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.diffusion.layers import BiasLinear, attention


@dataclass
class VAEConfig:
    """AutoencoderKL architecture; names follow diffusers' config.json."""

    in_channels: int = field(default=1, metadata={"help": "image channels"})
    out_channels: int = field(default=1, metadata={"help": "decoded image channels"})
    latent_channels: int = field(default=4, metadata={"help": "latent channels c"})
    block_out_channels: tuple[int, ...] = field(default=(32, 64, 64), metadata={
        "help": "width per level; len-1 stride-2 downsamples"})
    layers_per_block: int = field(default=1, metadata={"help": "ResNet blocks per encoder level (decoder: +1)"})
    norm_num_groups: int = field(default=16, metadata={"help": "GroupNorm groups"})
    scaling_factor: float = field(default=1.0, metadata={"help": "latents are multiplied by this for diffusion"})
    mid_block_add_attention: bool = field(default=True, metadata={"help": "self-attention in the mid blocks"})
    sample_size: int = field(default=28, metadata={"help": "image side the model was trained on"})
    force_upcast: bool = field(default=False, metadata={
        "help": "diffusers decodes this VAE in fp32 inside an fp16 pipeline (SD's VAE overflows in fp16); "
                "scratchlm's modules compute in fp32 whatever the stored dtype, so this is kept for export only"})

    def diffusers_config(self) -> dict:
        n = len(self.block_out_channels)
        return dict(in_channels=self.in_channels, out_channels=self.out_channels,
                    down_block_types=["DownEncoderBlock2D"] * n, up_block_types=["UpDecoderBlock2D"] * n,
                    block_out_channels=list(self.block_out_channels), layers_per_block=self.layers_per_block,
                    act_fn="silu", latent_channels=self.latent_channels, norm_num_groups=self.norm_num_groups,
                    sample_size=self.sample_size, scaling_factor=self.scaling_factor, shift_factor=None,
                    force_upcast=self.force_upcast, use_quant_conv=True, use_post_quant_conv=True,
                    mid_block_add_attention=self.mid_block_add_attention)

    @classmethod
    def from_diffusers(cls, cfg: dict) -> VAEConfig:
        for key, want in (("act_fn", "silu"), ("use_quant_conv", True), ("use_post_quant_conv", True)):
            if cfg.get(key, want) != want:
                raise ValueError(f"VAE config: {key}={cfg[key]!r} is not supported (expected {want!r})")
        for key, want in (("down_block_types", "DownEncoderBlock2D"), ("up_block_types", "UpDecoderBlock2D")):
            if any(b != want for b in cfg.get(key, [want])):
                raise ValueError(f"VAE config: {key}={cfg[key]} is not supported (only {want})")
        for key in ("shift_factor", "latents_mean", "latents_std"):  # SD3 / Flux / SDXL-refiner conventions
            if cfg.get(key) not in (None, 0, 0.0):
                raise ValueError(f"VAE config: {key}={cfg[key]} is not supported (only null)")
        names = set(cls.__dataclass_fields__)
        checked = {"act_fn", "use_quant_conv", "use_post_quant_conv", "down_block_types", "up_block_types",
                   "shift_factor", "latents_mean", "latents_std", "_class_name", "_diffusers_version", "_name_or_path"}
        unknown = sorted(set(cfg) - names - checked)
        if unknown:
            raise ValueError(f"VAE config: unknown field(s) {unknown}")
        kw = {k: v for k, v in cfg.items() if k in names}
        kw["block_out_channels"] = tuple(kw.get("block_out_channels", (64,)))
        kw.setdefault("in_channels", 3)
        kw.setdefault("out_channels", 3)
        kw.setdefault("layers_per_block", 1)
        kw.setdefault("norm_num_groups", 32)
        kw.setdefault("scaling_factor", 0.18215)
        kw.setdefault("sample_size", 32)
        kw.setdefault("block_out_channels", (64,))
        return cls(**kw)

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)


class ResnetBlock(nn.Module):
    """GroupNorm, SiLU, conv3x3, GroupNorm, SiLU, conv3x3, + (1x1 conv) shortcut: diffusers ResnetBlock2D."""

    def __init__(self, c_in: int, c_out: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, c_in, eps=1e-6)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, c_out, eps=1e-6)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        self.conv_shortcut = nn.Conv2d(c_in, c_out, 1) if c_in != c_out else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.conv_shortcut is None else self.conv_shortcut(x)) + h


class SpatialAttention(nn.Module):
    """Single-head self-attention over the h*w positions, GroupNorm in front, residual: diffusers' VAE attention."""

    def __init__(self, c: int, groups: int):
        super().__init__()
        self.group_norm = nn.GroupNorm(groups, c, eps=1e-6)
        self.to_q, self.to_k, self.to_v = BiasLinear(c, c), BiasLinear(c, c), BiasLinear(c, c)
        self.to_out = nn.ModuleList([BiasLinear(c, c)])

    def forward(self, x: Tensor) -> Tensor:
        b, c, h, w = x.shape
        t = self.group_norm(x).view(b, c, h * w).transpose(1, 2)  # (B, HW, C)
        q, k, v = (p(t).view(b, h * w, 1, c) for p in (self.to_q, self.to_k, self.to_v))  # (B, HW, 1, C)
        out = self.to_out[0](attention(q, k, v).reshape(b, h * w, c))  # (B, HW, C)
        return x + out.transpose(1, 2).reshape(b, c, h, w)


class MidBlock(nn.Module):
    def __init__(self, c: int, groups: int, add_attention: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(c, c, groups), ResnetBlock(c, c, groups)])
        self.attentions = nn.ModuleList([SpatialAttention(c, groups)]) if add_attention else None

    def forward(self, x: Tensor) -> Tensor:
        x = self.resnets[0](x)
        if self.attentions is not None:
            x = self.attentions[0](x)
        return self.resnets[1](x)


class _Conv(nn.Module):
    def __init__(self, c: int, stride: int = 1, padding: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=stride, padding=padding)


class DownBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, layers: int, groups: int, downsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(c_in if i == 0 else c_out, c_out, groups) for i in range(layers)])
        self.downsamplers = nn.ModuleList([_Conv(c_out, stride=2, padding=0)]) if downsample else None

    def forward(self, x: Tensor) -> Tensor:
        for r in self.resnets:
            x = r(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0].conv(F.pad(x, (0, 1, 0, 1)))  # asymmetric pad, stride 2: h -> h/2
        return x


class UpBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, layers: int, groups: int, upsample: bool):
        super().__init__()
        self.resnets = nn.ModuleList([ResnetBlock(c_in if i == 0 else c_out, c_out, groups) for i in range(layers)])
        self.upsamplers = nn.ModuleList([_Conv(c_out)]) if upsample else None

    def forward(self, x: Tensor) -> Tensor:
        for r in self.resnets:
            x = r(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0].conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return x


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        ch, g = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = nn.Conv2d(cfg.in_channels, ch[0], 3, padding=1)
        self.down_blocks = nn.ModuleList([
            DownBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block, g, i < len(ch) - 1) for i in range(len(ch))])
        self.mid_block = MidBlock(ch[-1], g, cfg.mid_block_add_attention)
        self.conv_norm_out = nn.GroupNorm(g, ch[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(ch[-1], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        x = self.conv_in(x)
        for blk in self.down_blocks:
            x = blk(x)
        x = self.mid_block(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        ch, g = tuple(reversed(cfg.block_out_channels)), cfg.norm_num_groups
        self.conv_in = nn.Conv2d(cfg.latent_channels, ch[0], 3, padding=1)
        self.mid_block = MidBlock(ch[0], g, cfg.mid_block_add_attention)
        self.up_blocks = nn.ModuleList([
            UpBlock(ch[max(i - 1, 0)], ch[i], cfg.layers_per_block + 1, g, i < len(ch) - 1) for i in range(len(ch))])
        self.conv_norm_out = nn.GroupNorm(g, ch[-1], eps=1e-6)
        self.conv_out = nn.Conv2d(ch[-1], cfg.out_channels, 3, padding=1)

    def forward(self, z: Tensor) -> Tensor:
        x = self.mid_block(self.conv_in(z))
        for blk in self.up_blocks:
            x = blk(x)
        return self.conv_out(F.silu(self.conv_norm_out(x)))


class DiagonalGaussian:
    """The encoder's posterior: mean and log-variance split along channels."""

    def __init__(self, moments: Tensor):
        self.mean, logvar = moments.chunk(2, dim=1)
        self.logvar = logvar.clamp(-30.0, 20.0)
        self.std = torch.exp(0.5 * self.logvar)

    def sample(self, generator: torch.Generator | None = None) -> Tensor:
        eps = torch.randn(self.mean.shape, generator=generator, device=self.mean.device, dtype=self.mean.dtype)
        return self.mean + self.std * eps

    def mode(self) -> Tensor:
        return self.mean

    def kl(self) -> Tensor:
        """KL(q || N(0, I)) per sample, summed over latent elements: (B,)."""
        return 0.5 * (self.mean.square() + self.logvar.exp() - 1.0 - self.logvar).flatten(1).sum(1)


class AutoencoderKL(nn.Module):
    """encode(x (B, C, H, W)) -> DiagonalGaussian over (B, c, H/f, W/f); decode(z) -> (B, C, H, W)."""

    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quant_conv = nn.Conv2d(2 * cfg.latent_channels, 2 * cfg.latent_channels, 1)
        self.post_quant_conv = nn.Conv2d(cfg.latent_channels, cfg.latent_channels, 1)

    def encode(self, x: Tensor) -> DiagonalGaussian:
        return DiagonalGaussian(self.quant_conv(self.encoder(x)))

    def decode(self, z: Tensor, tile: int | None = None, overlap: int = 2) -> Tensor:
        """z (B, c, h, w) -> image. `tile`: decode (tile x tile)-latent tiles overlapping by `overlap`
        latent pixels, blended linearly across the overlap (bounded peak memory, small seam error)."""
        if tile is None or (z.shape[-2] <= tile and z.shape[-1] <= tile):
            return self.decoder(self.post_quant_conv(z))
        return self._tiled_decode(z, tile, overlap)

    def _tiled_decode(self, z: Tensor, tile: int, overlap: int) -> Tensor:
        f = self.config.downsample
        stride = tile - overlap
        if stride <= 0:
            raise ValueError(f"VAE tiled decode: overlap {overlap} must be smaller than tile {tile}")
        b, _, h, w = z.shape
        out = torch.zeros(b, self.config.out_channels, h * f, w * f, dtype=z.dtype, device=z.device)
        weight = torch.zeros(1, 1, h * f, w * f, dtype=z.dtype, device=z.device)
        for y0 in range(0, h, stride):
            for x0 in range(0, w, stride):
                y1, x1 = min(y0 + tile, h), min(x0 + tile, w)
                y0_, x0_ = max(y1 - tile, 0), max(x1 - tile, 0)  # full-size tiles at the edges
                img = self.decoder(self.post_quant_conv(z[:, :, y0_:y1, x0_:x1]))
                ramp = _ramp(img.shape[-2], overlap * f, y0_ > 0, y1 < h, z)[:, None] * \
                    _ramp(img.shape[-1], overlap * f, x0_ > 0, x1 < w, z)[None, :]
                out[:, :, y0_ * f:y1 * f, x0_ * f:x1 * f] += img * ramp
                weight[:, :, y0_ * f:y1 * f, x0_ * f:x1 * f] += ramp
                if x1 == w:
                    break
            if y1 == h:
                break
        return out / weight

    def forward(self, x: Tensor) -> Tensor:
        return self.decode(self.encode(x).mode())

    @classmethod
    def from_pretrained(cls, path: str | Path, variant: str | None = None) -> AutoencoderKL:
        """Load a diffusers AutoencoderKL folder (config.json + diffusion_pytorch_model[.<variant>].safetensors);
        fp16 weights are cast into the fp32 modules."""
        from scratchlm.diffusion.dit import _load_strict
        from scratchlm.diffusion.io import load_diffusers_dir

        cfg, sd = load_diffusers_dir(path, variant)
        model = cls(VAEConfig.from_diffusers(cfg))
        _load_strict(model, sd, path)
        return model

    def save_pretrained(self, path: str | Path, variant: str | None = None) -> None:
        from scratchlm.diffusion.io import save_diffusers_dir

        save_diffusers_dir(path, "AutoencoderKL", self.config.diffusers_config(), self.state_dict(), variant)


def _ramp(n: int, overlap: int, fade_in: bool, fade_out: bool, like: Tensor) -> Tensor:
    """(n,) blending weights: linear ramps over `overlap` pixels at the sides that overlap a neighbour."""
    r = torch.ones(n, dtype=like.dtype, device=like.device)
    if overlap > 0:
        ramp = (torch.arange(overlap, dtype=like.dtype, device=like.device) + 0.5) / overlap
        if fade_in:
            r[:overlap] = torch.minimum(r[:overlap], ramp)
        if fade_out:
            r[-overlap:] = torch.minimum(r[-overlap:], ramp.flip(0))
    return r
