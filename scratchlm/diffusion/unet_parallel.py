"""Patch parallelism of the SD UNet over row bands of the latent: exact, and displaced (DistriFusion).

The latent's rows are split into P bands, one per rank; every rank runs the whole UNet on its band
(batch = the CFG batch [uncond; cond]), and the UNet's three whole-image operations go through a
`SpatialOps` subclass (`BandOps`), the only place where ranks communicate (scratchlm/diffusion/unet.py
threads `ops` through every block):

- `conv(name, conv, x)` (every conv with kernel > 1): the band is padded with its neighbours' boundary
  rows (the *halo*: `padding` rows from above, `dilation*(k-1) - padding - (stride-1)` from below:
  1 and 1 for a 3x3 conv, 1 and 0 for the stride-2 downsampler) or zeros at the image's top and
  bottom edges, then convolved with padding along the width only.
- `group_norm(name, gn, x)`: normalised with the whole image's per-(sample, group) mean and variance.
- `self_kv(name, k, v)`: a band's queries attend to the K/V of all bands.

Everything else (1x1 convs, nearest upsampling, the skip concatenations, time / text conditioning,
cross-attention, the linear layers) is per pixel or per sample and runs on the band as it is. So
that every stride-2 downsampler splits the bands exactly, each band has a multiple of 2^(levels-1)
latent rows (`band_rows`; a latent that cannot be split so is a clear error).

Two modes (`BandOps(mode=...)`):

- **exact**: halos exchanged point to point before each conv, GroupNorm statistics all-reduced
  (float64 sums of x and x^2 from a local two-pass var_mean), K/V all-gathered. Equal to one rank up
  to float rounding (tests/diffusion/test_unet_parallel.py: <= 1e-5 on the UNet output and on a whole
  sampling run).
- **displaced** (DistriFusion, Li et al. 2024, "displaced patch parallelism"): the first `warmup`
  steps run as exact (and keep what they received); after that, every whole-image operation uses the
  other bands' activations *from the previous step* and launches this step's exchange asynchronously,
  waited for at the same layer of the next step, so communication overlaps a whole step of compute:
  * convs pad with the halo rows the neighbours sent one step earlier;
  * GroupNorm uses the *corrected asynchronous* statistics: the whole image's E[x] and E[x^2] of the
    previous step corrected by this band's change, E_t ~= E_{t-1}(image) - E_{t-1}(band) + E_t(band)
    (the paper's formula: the stale global statistic plus the band's fresh minus stale local one);
    a variance that comes out negative falls back to the band's own (fresh) variance;
  * self-attention attends to its own fresh K/V and the other bands' K/V of the previous step.
  Same bytes as exact, off the critical path; the result is approximate (adjacent steps' activations
  are close), measured as per-pixel error against one rank.

Bytes received per rank and UNet call (B' = the CFG batch, fp32 activations, float64 statistics),
counted in `RankContext.bytes_received` per kind ("halo"/"halo_async", "gn_stats"/"gn_async",
"kv_all_gather"/"kv_async"):

- halo: per conv with C_in input channels at width W_l: (rows from above if rank > 0 + rows from below
  if rank < P-1) * B' * C_in * W_l * 4 (a 3x3 conv: one row each side; a stride-2 one: only from above);
- GroupNorm: exact, the all-reduced payload 3 * B' * G * 8 per norm; displaced, the all-gather of every
  band's (sum x, sum x^2, count): (P-1) * 3 * B' * G * 8 per norm;
- K/V: (P-1) * 2 * B' * max_band_tokens_l * C_l * 4 per self-attention layer;
- the final latent gather: (P-1) * B * C * max_band_rows * W * 4 once per sampling run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.diffusion.parallel import RankContext
from scratchlm.diffusion.schedulers import ScheduleConfig, cfg_combine, make_sampler
from scratchlm.diffusion.unet import SpatialOps, UNet2DConditionModel


def band_alignment(unet: UNet2DConditionModel) -> int:
    """Latent rows each band must be a multiple of: 2^(number of stride-2 downsamplers)."""
    return 2 ** (len(unet.config.block_out_channels) - 1)


def band_rows(h: int, world: int, align: int = 1) -> list[int]:
    """Latent rows per rank, each a multiple of `align`: as even as possible, the first ranks one unit more."""
    if h % align:
        raise ValueError(f"UNet patch parallel: {h} latent rows are not a multiple of {align} "
                         f"(2^(levels-1): every band must stay aligned through the stride-2 downsamplers)")
    units = h // align
    if units < world:
        raise ValueError(f"UNet patch parallel: {h} latent rows make {units} aligned units of {align} rows, "
                         f"too few for {world} ranks")
    return [align * (units // world + (1 if r < units % world else 0)) for r in range(world)]


class BandOps(SpatialOps):
    """One rank's `SpatialOps` over its band of latent rows (module doc: exact or displaced).

    `rows` are the latent rows of every rank's band at the UNet's input resolution; call `next_step()`
    after each UNet call and `finish()` after the last one (it waits for the exchanges still in flight)."""

    def __init__(self, ctx: RankContext, rows: list[int], mode: str = "exact", warmup: int = 1):
        if mode not in ("exact", "displaced"):
            raise ValueError(f"UNet patch parallel mode must be 'exact' or 'displaced', got {mode!r}")
        if mode == "displaced" and warmup < 1:
            raise ValueError("displaced patch parallel needs warmup >= 1 synchronous step (the first stale "
                             f"activations come from it), got {warmup}")
        if len(rows) != ctx.world:
            raise ValueError(f"{len(rows)} bands for {ctx.world} ranks")
        self.ctx, self.rows, self.mode, self.warmup = ctx, rows, mode, warmup
        self.step = 0
        self.tags: dict[str, int] = {}  # conv name -> its halo exchange's tag base (same order on every rank)
        self.halos: dict[str, tuple[Tensor, Tensor, list]] = {}  # stale (top, bottom, in-flight works)
        self.stats: dict[str, tuple[list[Tensor], Any]] = {}  # stale GroupNorm statistics of every band
        self.kv: dict[str, tuple[list[Tensor], Any]] = {}  # stale K/V of every band

    @property
    def synchronous(self) -> bool:
        return self.mode == "exact" or self.step < self.warmup

    def next_step(self) -> None:
        self.step += 1

    def finish(self) -> None:
        """Wait for the last step's exchanges (every rank must complete the same operations)."""
        for _, _, works in self.halos.values():
            for w in works:
                self.ctx.wait(w, "halo_async")
        for store, kind in ((self.stats, "gn_async"), (self.kv, "kv_async")):
            for _, work in store.values():
                if work is not None:
                    self.ctx.wait(work, kind)
        self.halos.clear()
        self.stats.clear()
        self.kv.clear()

    def _band_rows_here(self, x: Tensor) -> list[int]:
        """Every band's rows at x's resolution."""
        scale = self.rows[self.ctx.rank] // x.shape[2]
        if scale * x.shape[2] != self.rows[self.ctx.rank] or any(r % scale for r in self.rows):
            raise ValueError(f"UNet patch parallel: a band of {x.shape[2]} rows does not divide the latent band "
                             f"of {self.rows[self.ctx.rank]} rows (bands {self.rows})")
        return [r // scale for r in self.rows]

    # --- convolutions: halos ------------------------------------------------------------------------
    def conv(self, name: str, conv: nn.Conv2d, x: Tensor) -> Tensor:
        if conv.padding_mode != "zeros" or isinstance(conv.padding, str):
            raise ValueError(f"UNet patch parallel: conv {name} has padding {conv.padding!r} / "
                             f"{conv.padding_mode!r}; only numeric zero padding is supported")
        (k, _), (s, _), (p, pw), (d, _) = conv.kernel_size, conv.stride, conv.padding, conv.dilation
        top, bottom = p, d * (k - 1) - p - (s - 1)  # halo rows needed from above / below
        here = self._band_rows_here(x)
        if x.shape[2] % s or bottom < 0 or max(top, bottom) > min(here):
            raise ValueError(f"UNet patch parallel: conv {name} (kernel {k}, stride {s}, padding {p}) cannot run "
                             f"on bands of {here} rows")
        if self.synchronous:
            up, down, works = self._exchange(name, x, top, bottom, "halo")
            for w in works:
                self.ctx.wait(w, "halo")
            if self.mode == "displaced":
                self.halos[name] = (up, down, [])  # the next step's stale halo
        else:
            up, down, works = self.halos.pop(name)
            for w in works:
                self.ctx.wait(w, "halo_async")
            self.halos[name] = self._exchange(name, x, top, bottom, "halo_async")
        xp = torch.cat([up, x, down], dim=2) if top or bottom else x  # (B, C, top + h_band + bottom, W)
        return F.conv2d(xp, conv.weight, conv.bias, stride=conv.stride, padding=(0, pw), dilation=conv.dilation,
                        groups=conv.groups)

    def _exchange(self, name: str, x: Tensor, top: int, bottom: int, kind: str) -> tuple[Tensor, Tensor, list]:
        """Launch the halo exchange of x's boundary rows; returns (rows from above, rows from below, works).
        The buffers are zeros at the image's edges (the conv's own zero padding)."""
        ctx = self.ctx
        tag = self.tags.setdefault(name, 2 * len(self.tags))
        b, c, _, w = x.shape
        up, down = x.new_zeros(b, c, top, w), x.new_zeros(b, c, bottom, w)
        works: list = []
        if ctx.rank > 0:
            if bottom:  # the band above needs my first rows
                works.append(dist.isend(x[:, :, :bottom].contiguous(), ctx.rank - 1, group=ctx.group, tag=tag + 1))
            if top:
                works.append(dist.irecv(up, ctx.rank - 1, group=ctx.group, tag=tag))
        if ctx.rank < ctx.world - 1:
            if top:  # the band below needs my last rows
                works.append(dist.isend(x[:, :, -top:].contiguous(), ctx.rank + 1, group=ctx.group, tag=tag))
            if bottom:
                works.append(dist.irecv(down, ctx.rank + 1, group=ctx.group, tag=tag + 1))
        got = (up.numel() if ctx.rank > 0 else 0) + (down.numel() if ctx.rank < ctx.world - 1 else 0)
        ctx.bytes_received[kind] += got * x.element_size()
        return up, down, works

    # --- GroupNorm: statistics ----------------------------------------------------------------------
    def group_norm(self, name: str, gn: nn.GroupNorm, x: Tensor) -> Tensor:
        ctx = self.ctx
        b, c, _, _ = x.shape
        xg = x.reshape(b, gn.num_groups, -1)  # (B, G, C/G * h_band * W)
        n = xg.shape[-1]
        var, mean = torch.var_mean(xg, dim=-1, correction=0)  # (B, G) each, two-pass: no cancellation
        mean, var = mean.double(), var.double()
        local = torch.stack([n * mean, n * (var + mean.square()), torch.full_like(mean, n)])  # (3, B, G) sums
        if self.mode == "exact":
            t = time.perf_counter()
            dist.all_reduce(local, group=ctx.group)
            ctx.bytes_received["gn_stats"] += local.numel() * local.element_size()
            ctx.seconds["gn_stats"] += time.perf_counter() - t
            mean = local[0] / local[2]
            var = local[1] / local[2] - mean.square()
        elif self.synchronous:
            parts = ctx.all_gather(local, "gn_stats")
            self.stats[name] = (parts, None)
            tot = sum(parts)
            mean = tot[0] / tot[2]
            var = tot[1] / tot[2] - mean.square()
        else:
            parts, work = self.stats.pop(name)
            if work is not None:
                ctx.wait(work, "gn_async")
            stale, own = sum(parts), parts[ctx.rank]
            # E_t(image) ~= E_{t-1}(image) - E_{t-1}(band) + E_t(band), for x and x^2
            ex = stale[0] / stale[2] - own[0] / own[2] + mean
            ex2 = stale[1] / stale[2] - own[1] / own[2] + local[1] / n
            v = ex2 - ex.square()
            mean, var = ex, torch.where(v < 0, var, v)  # a negative estimate: the band's own variance
            self.stats[name] = ctx.all_gather_async(local, "gn_async")
        rstd = torch.rsqrt(var.clamp_min(0.0) + gn.eps)  # (B, G)
        per = c // gn.num_groups
        weight = gn.weight if gn.affine else torch.ones(c, dtype=x.dtype, device=x.device)
        bias = gn.bias if gn.affine else torch.zeros(c, dtype=x.dtype, device=x.device)
        scale = rstd.repeat_interleave(per, dim=1) * weight  # (B, C) float64
        shift = bias - (mean * rstd).repeat_interleave(per, dim=1) * weight
        return torch.addcmul(shift.to(x.dtype)[:, :, None, None], x, scale.to(x.dtype)[:, :, None, None])

    # --- self-attention: K/V ------------------------------------------------------------------------
    def self_kv(self, name: str, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, n_band, H, D) -> (B, N_image, H, D): the bands in rank (= row) order."""
        ctx = self.ctx
        n, own = k.shape[1], self.rows[ctx.rank]
        if any(n * r % own for r in self.rows):
            raise ValueError(f"UNet patch parallel: {n} tokens do not match the bands {self.rows}")
        tokens = [n * r // own for r in self.rows]  # every band's tokens: rows at this resolution * width
        kv = torch.stack([k, v])  # (2, B, n_band, H, D)
        pad = max(tokens) - n
        padded = F.pad(kv, (0, 0, 0, 0, 0, pad)) if pad else kv
        if self.synchronous:
            parts = ctx.all_gather(padded, "kv_all_gather")
            if self.mode == "displaced":
                self.kv[name] = (parts, None)
        else:
            parts, work = self.kv.pop(name)
            if work is not None:
                ctx.wait(work, "kv_async")
            parts = list(parts)
            parts[ctx.rank] = padded  # own band fresh, the others one step old
            self.kv[name] = ctx.all_gather_async(padded, "kv_async")
        full = torch.cat([p[:, :, :m] for p, m in zip(parts, tokens)], dim=2)  # (2, B, N_image, H, D)
        return full[0], full[1]


class _DyingOps(BandOps):
    """Fault injection for the tests: the process exits abruptly at its first conv of step `die_at_step`."""

    def __init__(self, *args, die_at_step: int, **kw):
        super().__init__(*args, **kw)
        self.die_at_step = die_at_step

    def conv(self, name: str, conv: nn.Conv2d, x: Tensor) -> Tensor:
        if self.step >= self.die_at_step:
            os._exit(3)
        return super().conv(name, conv, x)


def gather_rows(ctx: RankContext, x: Tensor, rows: list[int], kind: str = "latent_all_gather") -> Tensor:
    """Every rank's band (B, C, rows[rank], W) -> the whole (B, C, sum(rows), W) on every rank."""
    pad = max(rows) - rows[ctx.rank]
    parts = ctx.all_gather(F.pad(x, (0, 0, 0, pad)) if pad else x, kind)
    return torch.cat([p[:, :, :r] for p, r in zip(parts, rows)], dim=2)  # (B, C, H, W)


def _make_ops(ctx: RankContext, rows: list[int], mode: str, warmup: int, die_at_step: int | None) -> BandOps:
    if die_at_step is not None and ctx.rank == ctx.world - 1:
        return _DyingOps(ctx, rows, mode, warmup, die_at_step=die_at_step)
    return BandOps(ctx, rows, mode, warmup)


@torch.no_grad()
def unet_patch_denoise(ctx: RankContext, unet: UNet2DConditionModel, schedule: ScheduleConfig, latents: Tensor,
                       text: Tensor, uncond: Tensor | None, steps: int, guidance: float, sampler: str = "ddim",
                       mode: str = "exact", warmup: int = 1, seed: int = 0, added_cond_kwargs: dict | None = None,
                       die_at_step: int | None = None) -> Tensor:
    """A whole sampling run (the pipeline's sampler and CFG, as `DiffusionPipeline.denoise`) with the UNet split
    over row bands: the full unit-variance latent in, the full final latent out on every rank.
    `added_cond_kwargs` (SDXL) is passed to every UNet call as given (already [uncond; cond] with CFG)."""
    rows = band_rows(latents.shape[-2], ctx.world, band_alignment(unet))
    r0 = sum(rows[:ctx.rank])
    band = slice(r0, r0 + rows[ctx.rank])
    ops = _make_ops(ctx, rows, mode, warmup, die_at_step)
    sch = make_sampler(sampler, schedule)
    sch.set_timesteps(steps)
    x_full = latents.to(ctx.device) * sch.init_noise_sigma
    x = x_full[:, :, band].clone()  # (B, C, band rows, W)
    g = torch.Generator().manual_seed(seed + 1)
    use_cfg = uncond is not None and guidance != 1.0
    emb = torch.cat([uncond, text]) if use_cfg else text
    for t in sch.timesteps:
        xin = sch.scale_model_input(x, t)
        tt = torch.full((x.shape[0],), float(t), device=x.device)
        if use_cfg:
            out = unet(torch.cat([xin, xin]), torch.cat([tt, tt]), emb, added_cond_kwargs, ops=ops)
            out = cfg_combine(*out.chunk(2), guidance)
        else:
            out = unet(xin, tt, emb, added_cond_kwargs, ops=ops)
        ops.next_step()
        noise = None
        if sampler == "ddpm":  # the same full-size noise as one rank, sliced to the band
            noise = torch.randn(x_full.shape, generator=g)[:, :, band].to(x.device)
        x = sch.step(out, t, x, noise=noise)
    ops.finish()
    return gather_rows(ctx, x, rows)


@torch.no_grad()
def unet_denoise(unet: UNet2DConditionModel, schedule: ScheduleConfig, latents: Tensor, text: Tensor,
                 uncond: Tensor | None, steps: int, guidance: float, sampler: str = "ddim", seed: int = 0,
                 added_cond_kwargs: dict | None = None) -> Tensor:
    """The one-rank sampling run `unet_patch_denoise` splits (the benchmark's reference)."""
    sch = make_sampler(sampler, schedule)
    sch.set_timesteps(steps)
    x = latents * sch.init_noise_sigma
    g = torch.Generator().manual_seed(seed + 1)
    use_cfg = uncond is not None and guidance != 1.0
    emb = torch.cat([uncond, text]) if use_cfg else text
    for t in sch.timesteps:
        xin = sch.scale_model_input(x, t)
        tt = torch.full((x.shape[0],), float(t), device=x.device)
        if use_cfg:
            out = cfg_combine(*unet(torch.cat([xin, xin]), torch.cat([tt, tt]), emb, added_cond_kwargs).chunk(2),
                              guidance)
        else:
            out = unet(xin, tt, emb, added_cond_kwargs)
        x = sch.step(out, t, x, generator=g)
    return x


# --- rank entry points (module level so that spawn can import them) --------------------------------------
def _load(ctx: RankContext, unet_path: str) -> UNet2DConditionModel:
    return UNet2DConditionModel.from_pretrained(unet_path).to(ctx.device).eval()


def run_unet_forward(ctx: RankContext, unet_path: str, sample: Tensor, timestep: Tensor, emb: Tensor) -> dict:
    """One exact UNet call on row bands of `sample`; the whole output gathered on every rank."""
    unet = _load(ctx, unet_path)
    rows = band_rows(sample.shape[-2], ctx.world, band_alignment(unet))
    r0 = sum(rows[:ctx.rank])
    ops = BandOps(ctx, rows, "exact")
    with torch.no_grad():
        out = unet(sample[:, :, r0:r0 + rows[ctx.rank]], timestep, emb, ops=ops)
        return {"output": gather_rows(ctx, out, rows, "output_all_gather"), **ctx.stats()}


def run_unet_patch(ctx: RankContext, unet_path: str, schedule: dict, latents: Tensor, text: Tensor,
                   uncond: Tensor | None, steps: int, guidance: float, sampler: str = "ddim", mode: str = "exact",
                   warmup: int = 1, seed: int = 0, die_at_step: int | None = None) -> dict:
    """Load the UNet folder, run `unet_patch_denoise`; the latents, the denoise wall time and the counters."""
    unet = _load(ctx, unet_path)
    dist.barrier(group=ctx.group)
    t = time.perf_counter()
    z = unet_patch_denoise(ctx, unet, ScheduleConfig(**schedule), latents, text, uncond, steps, guidance, sampler,
                           mode, warmup, seed, die_at_step=die_at_step)
    return {"latents": z, "seconds": time.perf_counter() - t, **ctx.stats()}


def run_unet_reference(ctx: RankContext, unet_path: str, schedule: dict, latents: Tensor, text: Tensor,
                       uncond: Tensor | None, steps: int, guidance: float, sampler: str = "ddim", seed: int = 0
                       ) -> dict:
    """One rank's `unet_denoise` in a rank process of its own (the benchmark's side-by-side reference)."""
    unet = _load(ctx, unet_path)
    t = time.perf_counter()
    z = unet_denoise(unet, ScheduleConfig(**schedule), latents.to(ctx.device), text, uncond, steps, guidance,
                     sampler, seed)
    return {"latents": z, "seconds": time.perf_counter() - t}
