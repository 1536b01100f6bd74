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

- **exact**: halos exchanged point to point before each conv, every band's GroupNorm statistics (its
  mean and variance per (sample, group), from torch's own group-norm kernel) all-gathered and pooled
  (no E[x^2] - E[x]^2 cancellation), K/V all-gathered. Equal to one rank up
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
  are close), measured as per-pixel error against one rank. As distrifuser does, the exchanges are
  batched: a step's hooked calls are cut into `chunks` groups (default 4), each group's data leaving
  in one all-gather plus one message per neighbour as the group ends, waited for when the group
  starts in the next step (one exchange per layer costs ~1-3 ms of gloo overhead each on a busy CPU,
  ~130 per SD step; batching moves no data in time, so the result is bit-identical for any `chunks`).

Bytes received per rank and UNet call (B' = the CFG batch, fp32 activations and statistics),
counted in `RankContext.bytes_received` per kind ("halo"/"halo_async", "gn_stats"/"gn_async",
"kv_all_gather"/"kv_async"):

- halo: per conv with C_in input channels at width W_l: (rows from above if rank > 0 + rows from below
  if rank < P-1) * B' * C_in * W_l * 4 (a 3x3 conv: one row each side; a stride-2 one: only from above);
- GroupNorm: the all-gather of every band's (mean, variance): (P-1) * 2 * B' * G * 4 per norm;
- K/V: (P-1) * 2 * B' * max_band_tokens_l * C_l * 4 per self-attention layer;
- the final latent gather: (P-1) * B * C * max_band_rows * W * 4 once per sampling run.
"""

from __future__ import annotations

import math
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
    after each UNet call and `finish()` after the last one (it waits for the exchanges still in flight).
    Displaced steps batch their exchanges: the step's hooked calls (in the order the first step made them)
    are cut into `chunks` consecutive groups, and each group's halo rows, GroupNorm statistics and K/V
    leave in one all-gather (statistics, K/V) and one message per neighbour (halos), launched as the
    group's last call finishes and waited for at the group's first call of the next step. The price: a rank
    tolerates a neighbour lagging by (1 - 1/chunks) of a step instead of a whole one (`chunks` large: one
    exchange per call, as the paper describes it)."""

    def __init__(self, ctx: RankContext, rows: list[int], mode: str = "exact", warmup: int = 1, chunks: int = 4):
        if mode not in ("exact", "displaced"):
            raise ValueError(f"UNet patch parallel mode must be 'exact' or 'displaced', got {mode!r}")
        if mode == "displaced" and warmup < 1:
            raise ValueError("displaced patch parallel needs warmup >= 1 synchronous step (the first stale "
                             f"activations come from it), got {warmup}")
        if len(rows) != ctx.world:
            raise ValueError(f"{len(rows)} bands for {ctx.world} ranks")
        if chunks < 1:
            raise ValueError(f"chunks must be >= 1, got {chunks}")
        self.ctx, self.rows, self.mode, self.warmup, self.chunks = ctx, rows, mode, warmup, chunks
        self.share = torch.tensor(rows, dtype=torch.float64) / sum(rows)  # every band's share of the pixels
        self.step = 0
        self.tags: dict[str, int] = {}  # conv name -> its halo exchange's tag base (same order on every rank)
        self.order: list[str] = []  # the hooked calls of a step, in order (recorded by the first step)
        self.call = 0  # index of the next hooked call in this step
        self.stale: dict[str, Any] = {}  # name -> what the previous step received for it
        self.staged: list[tuple[str, str, list[Tensor]]] = []  # this chunk's (kind, name, payload)
        self.inflight: dict[int, tuple] = {}  # chunk -> (layout, gathered, from above, from below, works)

    @property
    def synchronous(self) -> bool:
        return self.mode == "exact" or self.step < self.warmup

    def next_step(self) -> None:
        if self.step == 0:
            n = len(self.order)
            self.bounds = [round(i * n / self.chunks) for i in range(self.chunks + 1)]
            self.chunk_of = [c for c in range(self.chunks) for _ in range(self.bounds[c], self.bounds[c + 1])]
        elif self.call != len(self.order):
            raise RuntimeError(f"UNet patch parallel: step {self.step} made {self.call} hooked calls, "
                               f"the first step {len(self.order)}")
        self.step += 1
        self.call = 0

    def finish(self) -> None:
        """Wait for the last step's exchanges (every rank must complete the same operations)."""
        for c in list(self.inflight):
            self._receive(c)
        self.stale.clear()

    def _enter(self, name: str) -> int:
        """Count a hooked call; on a displaced step, receive its chunk's stale data first if still in flight."""
        i = self.call
        self.call += 1
        if self.step == 0:
            self.order.append(name)
        elif i >= len(self.order) or self.order[i] != name:
            raise RuntimeError(f"UNet patch parallel: hooked call {i} of step {self.step} is {name!r}, "
                               f"the first step's was {self.order[i] if i < len(self.order) else None!r}")
        if not self.synchronous:
            c = self._chunk(i)
            if c in self.inflight:
                self._receive(c)
        return i

    def _chunk(self, i: int) -> int:
        return self.chunk_of[i]

    def _stage(self, i: int, kind: str, name: str, payload: list[Tensor]) -> None:
        """Queue this call's fresh data for the next step; the chunk's last call launches the exchange."""
        self.staged.append((kind, name, [t.contiguous() for t in payload]))
        c = self._chunk(i)
        if i == self.bounds[c + 1] - 1:
            self._launch(c)

    def _launch(self, c: int) -> None:
        """One all-gather of the chunk's statistics and K/V, one message per neighbour of its halo rows."""
        ctx, t = self.ctx, time.perf_counter()
        layout = [(kind, name, [(p.shape, p.dtype) for p in payload]) for kind, name, payload in self.staged]
        gather = _pack([p for kind, _, payload in self.staged if kind != "halo" for p in payload])
        to_above = _pack([payload[0] for kind, _, payload in self.staged if kind == "halo"])  # first rows
        to_below = _pack([payload[1] for kind, _, payload in self.staged if kind == "halo"])  # last rows
        self.staged = []
        works, gathered, from_above, from_below = [], None, torch.empty_like(to_below), torch.empty_like(to_above)
        if gather.numel():
            gathered = [torch.empty_like(gather) for _ in range(ctx.world)]
            works.append(dist.all_gather(gathered, gather, group=ctx.group, async_op=True))
        tag = 2 * c
        if ctx.rank > 0:
            if to_above.numel():
                works.append(dist.isend(to_above, ctx.rank - 1, group=ctx.group, tag=tag + 1))
            if from_above.numel():
                works.append(dist.irecv(from_above, ctx.rank - 1, group=ctx.group, tag=tag))
        if ctx.rank < ctx.world - 1:
            if to_below.numel():
                works.append(dist.isend(to_below, ctx.rank + 1, group=ctx.group, tag=tag))
            if from_below.numel():
                works.append(dist.irecv(from_below, ctx.rank + 1, group=ctx.group, tag=tag + 1))
        self.inflight[c] = (layout, gathered, from_above, from_below, works, (to_above, to_below, gather))
        ctx.seconds["async_launch"] += time.perf_counter() - t

    def _receive(self, c: int) -> None:
        """Wait for chunk c's exchange and unpack it into `stale`, per hooked call."""
        ctx = self.ctx
        layout, gathered, from_above, from_below, works, _ = self.inflight.pop(c)
        for w in works:
            ctx.wait(w, "async")
        parts = [_unpack(g, [s for kind, _, specs in layout if kind != "halo" for s in specs]) for g in gathered] \
            if gathered is not None else []
        above = _unpack(from_above, [specs[1] for kind, _, specs in layout if kind == "halo"])  # their last rows
        below = _unpack(from_below, [specs[0] for kind, _, specs in layout if kind == "halo"])  # their first rows
        j = h = 0
        for kind, name, _ in layout:
            if kind == "halo":
                up, down = above[h], below[h]
                h += 1
                if ctx.rank == 0:
                    up = torch.zeros_like(up)  # the image's top edge: the conv's zero padding
                if ctx.rank == ctx.world - 1:
                    down = torch.zeros_like(down)
                got = (up.numel() if ctx.rank > 0 else 0) + (down.numel() if ctx.rank < ctx.world - 1 else 0)
                ctx.bytes_received["halo_async"] += got * up.element_size()
                self.stale[name] = (up, down)
            else:
                self.stale[name] = [p[j] for p in parts]
                ctx.bytes_received[kind + "_async"] += (ctx.world - 1) * parts[0][j].numel() * \
                    parts[0][j].element_size()
                j += 1

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
        i = self._enter(name)
        if self.synchronous:
            up, down, works = self._exchange(name, x, top, bottom)
            for w in works:
                self.ctx.wait(w, "halo")
            if self.mode == "displaced":
                self.stale[name] = (up, down)  # the next step's stale halo
        else:
            up, down = self.stale.pop(name)
            self._stage(i, "halo", name, [x[:, :, :bottom], x[:, :, x.shape[2] - top:]])
        xp = torch.cat([up, x, down], dim=2) if top or bottom else x  # (B, C, top + h_band + bottom, W)
        return F.conv2d(xp, conv.weight, conv.bias, stride=conv.stride, padding=(0, pw), dilation=conv.dilation,
                        groups=conv.groups)

    def _exchange(self, name: str, x: Tensor, top: int, bottom: int) -> tuple[Tensor, Tensor, list]:
        """Launch the halo exchange of x's boundary rows; returns (rows from above, rows from below, works).
        The buffers are zeros at the image's edges (the conv's own zero padding)."""
        ctx = self.ctx
        tag = 2 * self.chunks + self.tags.setdefault(name, 2 * len(self.tags))  # apart from the chunks' tags
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
        ctx.bytes_received["halo"] += got * x.element_size()
        return up, down, works

    # --- GroupNorm: statistics ----------------------------------------------------------------------
    def group_norm(self, name: str, gn: nn.GroupNorm, x: Tensor) -> Tensor:
        ctx = self.ctx
        i = self._enter(name)
        b, c, h, w = x.shape
        g = gn.num_groups
        _, mean, rstd = torch.native_group_norm(x, None, None, b, c, h * w, g, 0.0)  # the band's (B, G) statistics
        local = torch.stack([mean, rstd.pow(-2)])  # (2, B, G): the band's mean and biased variance
        if self.synchronous:
            parts = ctx.all_gather(local, "gn_stats")
            if self.mode == "displaced":
                self.stale[name] = parts
            mean, var = _combine(parts, self.share)
        else:
            parts = self.stale.pop(name)
            stale_mean, stale_var = _combine(parts, self.share)
            own, fresh = parts[ctx.rank].double(), local.double()
            # E_t(image) ~= E_{t-1}(image) - E_{t-1}(band) + E_t(band), for x and x^2
            mean = stale_mean - own[0] + fresh[0]
            ex2 = stale_var + stale_mean.square() - own[1] - own[0].square() + fresh[1] + fresh[0].square()
            var = ex2 - mean.square()
            var = torch.where(var < 0, fresh[1], var)  # a negative estimate: the band's own variance
            self._stage(i, "gn", name, [local])
        rstd = torch.rsqrt(var + gn.eps).to(x.dtype)  # (B, G)
        weight = gn.weight.view(g, -1) if gn.affine else x.new_ones(g, c // g)
        scale = (rstd[:, :, None] * weight).view(b, c)  # (B, G, C/G) -> (B, C)
        shift = -(mean.to(x.dtype)[:, :, None] * scale.view(b, g, -1)).view(b, c)
        if gn.affine:
            shift = shift + gn.bias
        return torch.addcmul(shift[:, :, None, None], x, scale[:, :, None, None])

    # --- self-attention: K/V ------------------------------------------------------------------------
    def self_kv(self, name: str, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """k, v (B, n_band, H, D) -> (B, N_image, H, D): the bands in rank (= row) order."""
        ctx = self.ctx
        i = self._enter(name)
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
                self.stale[name] = parts
        else:
            parts = list(self.stale.pop(name))
            parts[ctx.rank] = padded  # own band fresh, the others one step old
            self._stage(i, "kv", name, [padded])
        full = torch.cat([p[:, :, :m] for p, m in zip(parts, tokens)], dim=2)  # (2, B, N_image, H, D)
        return full[0], full[1]


def _combine(parts: list[Tensor], share: Tensor) -> tuple[Tensor, Tensor]:
    """Every band's (mean, biased variance) (2, B, G) and its share of the pixels -> the image's mean and variance
    (B, G), float64: mean = sum_r s_r m_r, var = sum_r s_r (v_r + (m_r - mean)^2) (no E[x^2] - E[x]^2 cancellation)."""
    st = torch.stack(parts).double()  # (P, 2, B, G)
    s = share.view(-1, 1, 1)
    mean = (s * st[:, 0]).sum(0)
    return mean, (s * (st[:, 1] + (st[:, 0] - mean).square())).sum(0)


def _pack(tensors: list[Tensor]) -> Tensor:
    """Tensors of any dtypes -> one flat uint8 buffer, each padded to 8 bytes (so every dtype views back)."""
    if not tensors:
        return torch.empty(0, dtype=torch.uint8)
    flat = []
    for t in tensors:
        b = t.contiguous().view(-1).view(torch.uint8)
        flat.append(F.pad(b, (0, -b.numel() % 8)) if b.numel() % 8 else b)
    return torch.cat(flat)


def _unpack(buf: Tensor, specs: list[tuple[torch.Size, torch.dtype]]) -> list[Tensor]:
    """`_pack`'s inverse, given every tensor's (shape, dtype)."""
    out, o = [], 0
    for shape, dtype in specs:
        n = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        out.append(buf[o:o + n].view(dtype).view(shape))
        o += n + (-n % 8)
    return out


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


def _make_ops(ctx: RankContext, rows: list[int], mode: str, warmup: int, chunks: int, die_at_step: int | None
              ) -> BandOps:
    if die_at_step is not None and ctx.rank == ctx.world - 1:
        return _DyingOps(ctx, rows, mode, warmup, chunks, die_at_step=die_at_step)
    return BandOps(ctx, rows, mode, warmup, chunks)


@torch.no_grad()
def unet_patch_denoise(ctx: RankContext, unet: UNet2DConditionModel, schedule: ScheduleConfig, latents: Tensor,
                       text: Tensor, uncond: Tensor | None, steps: int, guidance: float, sampler: str = "ddim",
                       mode: str = "exact", warmup: int = 1, seed: int = 0, added_cond_kwargs: dict | None = None,
                       chunks: int = 4, die_at_step: int | None = None) -> Tensor:
    """A whole sampling run (the pipeline's sampler and CFG, as `DiffusionPipeline.denoise`) with the UNet split
    over row bands: the full unit-variance latent in, the full final latent out on every rank.
    `added_cond_kwargs` (SDXL) is passed to every UNet call as given (already [uncond; cond] with CFG);
    `chunks`: the displaced steps' exchanges per step (`BandOps`)."""
    rows = band_rows(latents.shape[-2], ctx.world, band_alignment(unet))
    r0 = sum(rows[:ctx.rank])
    band = slice(r0, r0 + rows[ctx.rank])
    ops = _make_ops(ctx, rows, mode, warmup, chunks, die_at_step)
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
        if sch.draws_noise:  # the same full-size noise as one rank, sliced to the band
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
                   warmup: int = 1, seed: int = 0, die_at_step: int | None = None, chunks: int = 4) -> dict:
    """Load the UNet folder, run `unet_patch_denoise`; the latents, the denoise wall time and the counters."""
    unet = _load(ctx, unet_path)
    dist.barrier(group=ctx.group)
    t, cpu = time.perf_counter(), time.process_time()
    z = unet_patch_denoise(ctx, unet, ScheduleConfig(**schedule), latents, text, uncond, steps, guidance, sampler,
                           mode, warmup, seed, chunks=chunks, die_at_step=die_at_step)
    return {"latents": z, "seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - cpu,
            **ctx.stats()}


def run_unet_reference(ctx: RankContext, unet_path: str, schedule: dict, latents: Tensor, text: Tensor,
                       uncond: Tensor | None, steps: int, guidance: float, sampler: str = "ddim", seed: int = 0
                       ) -> dict:
    """One rank's `unet_denoise` in a rank process of its own (the benchmark's side-by-side reference)."""
    unet = _load(ctx, unet_path)
    t, cpu = time.perf_counter(), time.process_time()
    z = unet_denoise(unet, ScheduleConfig(**schedule), latents.to(ctx.device), text, uncond, steps, guidance,
                     sampler, seed)
    return {"latents": z, "seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - cpu}
