"""Exact patch parallelism of the VAE decoder: the latent's rows split into P bands, one per rank.

Every operation of `vae.Decoder` is either per pixel (SiLU, 1x1 convs, nearest upsampling, the
residual adds) and runs on the band as it is, or needs the rest of the image, and then communicates:

- **3x3 convolutions exchange halos.** Before each one, a rank sends its first row to the rank above
  and its last row to the rank below (point to point, at the current resolution) and pads its band
  with the rows it received; at the image's top and bottom edges it pads with zeros, exactly as the
  conv's `padding=1` would. The conv then runs with padding only along the width.
- **GroupNorms reduce statistics.** Each rank sums x and x^2 per (sample, group) over its band, the
  sums (float64, so E[x^2] - E[x]^2 does not cancel) and the element count are all-reduced, and
  every rank normalises with the whole image's mean and (biased) variance.
- **Mid-block attention all-gathers K/V** (bands padded to the largest for the gather, cut back);
  queries stay local.
- Nearest x2 upsampling doubles a band's rows, so bands stay aligned at every resolution.

The decoded bands are gathered on rank 0. The result equals one rank's `AutoencoderKL.decode` up to
float rounding (tests/diffusion/test_vae_parallel.py, <= 1e-5). Bytes received per rank, counted in
`RankContext.bytes_received` and given by formula in docs/diffusion.md:

- "halo": per 3x3 conv with C_in input channels at width W: n_nb * B * C_in * W * 4 bytes
  (n_nb = number of neighbour bands: 1 at the edges, 2 inside, 0 at P = 1);
- "gn_stats": per GroupNorm, the all-reduced payload B * G * 3 float64 = 24 * B * G bytes;
- "vae_kv_all_gather": (P - 1) * 2 * B * max_band_tokens * C * 4 bytes per attention layer;
- "image_gather" (rank 0 only): (P - 1) * B * C_out * max_band_rows * f * W_img * 4 bytes.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.diffusion.layers import attention
from scratchlm.diffusion.parallel import RankContext
from scratchlm.diffusion.vae import AutoencoderKL, MidBlock, ResnetBlock, SpatialAttention, UpBlock, VAEConfig


def band_rows(h: int, world: int) -> list[int]:
    """Latent rows per rank: as even as possible, the first h % world ranks one row more."""
    if h < world:
        raise ValueError(f"VAE patch parallel: {h} latent rows cannot be split over {world} ranks")
    return [h // world + (1 if r < h % world else 0) for r in range(world)]


def decode_bytes(cfg: VAEConfig, b: int, h: int, w: int, world: int, rank: int) -> dict[str, int]:
    """Bytes `rank` receives decoding a (b, c, h, w) latent over `world` bands: the module doc's formulas
    summed over the decoder's layers (fp32 activations, float64 GroupNorm statistics)."""
    ch, n, l1 = tuple(reversed(cfg.block_out_channels)), len(cfg.block_out_channels), cfg.layers_per_block + 1
    convs = [(cfg.latent_channels, w)] + [(ch[0], w)] * 4  # (C_in, width) of every 3x3 conv, in order
    for i in range(n):
        width = w * 2**i
        convs += [(ch[max(i - 1, 0)], width)] + [(ch[i], width)] * (2 * l1 - 1)
        if i < n - 1:
            convs.append((ch[i], 2 * width))
    convs.append((ch[-1], w * 2 ** (n - 1)))
    rows, n_nb = band_rows(h, world), (rank > 0) + (rank < world - 1)
    out = {"halo": sum(n_nb * b * c * width * 4 for c, width in convs),
           "gn_stats": (4 + cfg.mid_block_add_attention + n * 2 * l1 + 1) * 24 * b * cfg.norm_num_groups}
    if cfg.mid_block_add_attention:
        out["vae_kv_all_gather"] = (world - 1) * 2 * b * max(rows) * w * ch[0] * 4
    if rank == 0:
        f = cfg.downsample
        out["image_gather"] = (world - 1) * b * cfg.out_channels * max(rows) * f * w * f * 4
    return out


class BandDecoder:
    """Runs `vae.decoder` on this rank's band of latent rows, communicating as the module doc says."""

    def __init__(self, vae: AutoencoderKL, ctx: RankContext):
        self.vae, self.ctx = vae, ctx
        self.tokens: list[int] = [0] * ctx.world  # tokens per band at the attention's resolution

    # --- the three communicating operations ---------------------------------------------------------
    def conv3x3(self, conv: nn.Conv2d, x: Tensor) -> Tensor:
        """x (B, C, h_band, W) -> conv(x) over the whole image, restricted to the band. The halos are in
        flight while the interior rows (which need none) are convolved; the two edge rows follow."""
        ctx = self.ctx
        above, below = ctx.rank - 1, ctx.rank + 1
        top = torch.zeros_like(x[:, :, :1])  # (B, C, 1, W): zeros at the image's edges
        bottom = torch.zeros_like(x[:, :, :1])
        works = []
        if above >= 0:
            works.append(dist.isend(x[:, :, :1].contiguous(), above, group=ctx.group, tag=1))
            works.append(dist.irecv(top, above, group=ctx.group, tag=0))
        if below < ctx.world:
            works.append(dist.isend(x[:, :, -1:].contiguous(), below, group=ctx.group, tag=0))
            works.append(dist.irecv(bottom, below, group=ctx.group, tag=1))
        ctx.bytes_received["halo"] += (len(works) // 2) * top.numel() * top.element_size()
        conv2d = lambda v: F.conv2d(v, conv.weight, conv.bias, padding=(0, 1))  # noqa: E731
        inner = conv2d(x) if x.shape[2] >= 3 else None  # output rows 1 .. h_band-2
        for w in works:
            ctx.wait(w, "halo")
        if inner is None:
            return conv2d(torch.cat([top, x, bottom], dim=2))  # (B, C, h_band + 2, W) -> h_band rows
        first, last = conv2d(torch.cat([top, x[:, :, :2]], dim=2)), conv2d(torch.cat([x[:, :, -2:], bottom], dim=2))
        return torch.cat([first, inner, last], dim=2)  # (B, C_out, h_band, W)

    def group_norm(self, gn: nn.GroupNorm, x: Tensor) -> Tensor:
        """GroupNorm with the whole image's statistics: (sum, sum of squares, count) all-reduced. The
        band's sums come from a local two-pass var_mean (fp32, no cancellation), widened to float64
        for the reduction, so the global E[x^2] - E[x]^2 loses nothing either."""
        ctx, t = self.ctx, time.perf_counter()
        b, c, h, w = x.shape
        xg = x.reshape(b, gn.num_groups, -1)  # (B, G, C/G * h_band * W)
        n = xg.shape[-1]
        var, mean = torch.var_mean(xg, dim=-1, correction=0)  # (B, G) each
        mean, var = mean.double(), var.double()
        stats = torch.stack([n * mean, n * (var + mean.square()), torch.full_like(mean, n)], dim=-1)  # (B, G, 3)
        dist.all_reduce(stats, group=ctx.group)
        ctx.bytes_received["gn_stats"] += stats.numel() * stats.element_size()
        ctx.seconds["gn_stats"] += time.perf_counter() - t
        mean = stats[..., 0] / stats[..., 2]  # (B, G)
        var = (stats[..., 1] / stats[..., 2] - mean.square()).clamp_min(0.0)
        rstd = torch.rsqrt(var + gn.eps)
        scale = (rstd.repeat_interleave(c // gn.num_groups, dim=1) * gn.weight).to(x.dtype)  # (B, C)
        shift = gn.bias - (mean * rstd).repeat_interleave(c // gn.num_groups, dim=1) * gn.weight
        return torch.addcmul(shift.to(x.dtype)[:, :, None, None], x, scale[:, :, None, None])

    def attention(self, attn: SpatialAttention, x: Tensor) -> Tensor:
        """Single-head self-attention: local queries against the K/V of all bands (all-gathered)."""
        b, c, h, w = x.shape
        t = self.group_norm(attn.group_norm, x).view(b, c, h * w).transpose(1, 2)  # (B, n_local, C)
        q, k, v = (p(t).view(b, h * w, 1, c) for p in (attn.to_q, attn.to_k, attn.to_v))  # (B, n_local, 1, C)
        kv = torch.stack([k, v])  # (2, B, n_local, 1, C)
        pad = max(self.tokens) - kv.shape[2]
        parts = self.ctx.all_gather(F.pad(kv, (0, 0, 0, 0, 0, pad)) if pad else kv, "vae_kv_all_gather")
        full = torch.cat([p[:, :, :n] for p, n in zip(parts, self.tokens)], dim=2)  # (2, B, N, 1, C)
        out = attn.to_out[0](attention(q, full[0], full[1]).reshape(b, h * w, c))  # (B, n_local, C)
        return x + out.transpose(1, 2).reshape(b, c, h, w)

    # --- the decoder, block by block (mirrors vae.py) -------------------------------------------------
    def resnet(self, blk: ResnetBlock, x: Tensor) -> Tensor:
        h = self.conv3x3(blk.conv1, F.silu(self.group_norm(blk.norm1, x)))
        h = self.conv3x3(blk.conv2, F.silu(self.group_norm(blk.norm2, h)))
        return (x if blk.conv_shortcut is None else blk.conv_shortcut(x)) + h

    def mid(self, blk: MidBlock, x: Tensor) -> Tensor:
        x = self.resnet(blk.resnets[0], x)
        if blk.attentions is not None:
            x = self.attention(blk.attentions[0], x)
        return self.resnet(blk.resnets[1], x)

    def up(self, blk: UpBlock, x: Tensor) -> Tensor:
        for r in blk.resnets:
            x = self.resnet(r, x)
        if blk.upsamplers is not None:  # nearest x2 is per pixel: the band's rows double, halos follow
            x = self.conv3x3(blk.upsamplers[0].conv, F.interpolate(x, scale_factor=2.0, mode="nearest"))
        return x

    def __call__(self, z_band: Tensor, rows: list[int]) -> Tensor:
        """z_band (B, c, rows[rank], w) -> this band of the image (B, C_out, rows[rank] * f, w * f)."""
        dec = self.vae.decoder
        self.tokens = [r * z_band.shape[-1] for r in rows]
        x = self.conv3x3(dec.conv_in, self.vae.post_quant_conv(z_band))
        x = self.mid(dec.mid_block, x)
        for blk in dec.up_blocks:
            x = self.up(blk, x)
        return self.conv3x3(dec.conv_out, F.silu(self.group_norm(dec.conv_norm_out, x)))


@torch.no_grad()
def patch_parallel_decode(ctx: RankContext, vae: AutoencoderKL, z: Tensor) -> Tensor | None:
    """The full latent z (B, c, h, w) in on every rank; the decoded image (B, C, h*f, w*f) on rank 0
    (None elsewhere). Each rank decodes its band of latent rows; equal to `vae.decode(z)`."""
    rows = band_rows(z.shape[-2], ctx.world)
    r0 = sum(rows[:ctx.rank])
    img = BandDecoder(vae, ctx)(z[:, :, r0:r0 + rows[ctx.rank]].to(ctx.device), rows)  # (B, C, band*f, W)
    f = img.shape[-2] // rows[ctx.rank]
    pad = (max(rows) - rows[ctx.rank]) * f
    img = F.pad(img, (0, 0, 0, pad)).contiguous() if pad else img.contiguous()
    t = time.perf_counter()
    parts = [torch.empty_like(img) for _ in range(ctx.world)] if ctx.rank == 0 else None
    work = dist.gather(img, parts, dst=0, group=ctx.group, async_op=True)
    ctx.wait(work, "image_gather")
    ctx.seconds["image_gather"] += time.perf_counter() - t
    if ctx.rank != 0:
        return None
    ctx.bytes_received["image_gather"] += (ctx.world - 1) * img.numel() * img.element_size()
    return torch.cat([p[:, :, :n * f] for p, n in zip(parts, rows)], dim=2)  # (B, C, h*f, w*f)


def run_vae_decode(ctx: RankContext, vae_path: str, z: Tensor, die_at_norm: int | None = None) -> dict:
    """Rank entry point (module level so spawn can import it): load the VAE folder, decode z in bands.
    `die_at_norm` (fault injection for the tests): the last rank exits abruptly at that GroupNorm."""
    vae = AutoencoderKL.from_pretrained(vae_path).to(ctx.device).eval()
    dist.barrier(group=ctx.group)
    t = time.perf_counter()
    if die_at_norm is not None and ctx.rank == ctx.world - 1:
        calls, norm = {"n": 0}, BandDecoder.group_norm

        def dying(self, gn, x):
            calls["n"] += 1
            if calls["n"] > die_at_norm:
                os._exit(3)
            return norm(self, gn, x)

        BandDecoder.group_norm = dying  # this rank's process only
    img = patch_parallel_decode(ctx, vae, z)
    return {"image": img, "seconds": time.perf_counter() - t, **ctx.stats()}


def run_vae_reference(ctx: RankContext, vae_path: str, z: Tensor) -> dict:
    """One rank's `vae.decode(z)` in a rank process of its own (the benchmark's side-by-side reference)."""
    vae = AutoencoderKL.from_pretrained(vae_path).to(ctx.device).eval()
    t = time.perf_counter()
    with torch.no_grad():
        img = vae.decode(z.to(ctx.device))
    return {"image": img, "seconds": time.perf_counter() - t}
