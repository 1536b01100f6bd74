"""Parallel inference for the diffusion pipeline on torch.distributed (gloo on CPU, NCCL on CUDA).

Four forms, each a function run on every rank of a group (see `launch`):

- **CFG parallel** (`cfg_parallel_denoise`, 2 ranks): rank 0 runs the unconditional branch, rank 1 the
  conditional one; each step all-gathers the two outputs (B x C x h x w each) and both ranks apply the
  guidance and the sampler step, so they hold identical latents. Communication per step and rank:
  B*C*h*w floats; compute per rank halves.
- **Patch parallel, exact** (`patch_parallel_denoise(mode="exact")`): the latent's patch rows are split
  into P bands; every rank patchifies and runs its band through every block; self-attention
  all-gathers K and V of all bands (queries stay local); the adaLN, the cross-attention, the MLP
  and the sampler step are per token (local). Equal to one rank up to float rounding.
  Per step and rank it receives L * (P-1)/P * 2 * B' * N * d floats (B' = 2B with CFG, N tokens).
- **Displaced patch parallel** (DistriFusion, Li et al. 2024, `mode="displaced"`): after `warmup`
  synchronous steps, a rank attends to its own fresh K/V and to the other bands' K/V *from the
  previous step*; the all-gather of this step's K/V is launched asynchronously and only waited for
  at the same layer of the next step, so communication overlaps a whole step of compute. Same
  volume as exact, off the critical path; the result is approximate (activations change slowly
  between adjacent steps).
- **Component pipelining** lives in `components.py` (text encoder, denoiser and VAE decoder on
  different ranks, a queue of requests streaming through them point to point); it uses `launch`.

Groups and timeouts come from `scratchlm.parallel.comm` (`init_default_group`, `backend_for`); every
collective of a step has the step timeout, so a dead peer turns into an error, never a hang, and
`launch` stops the other ranks as soon as one fails.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from scratchlm.diffusion.pipeline import DiffusionPipeline
from scratchlm.diffusion.schedulers import cfg_combine, make_sampler
from scratchlm.parallel.comm import backend_for, init_default_group


@dataclass
class RankContext:
    """One rank's view: its group (with the step timeout) and the communication counters."""

    rank: int
    world: int
    group: Any
    device: torch.device
    timeout_s: float
    bytes_received: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def all_gather(self, x: Tensor, kind: str) -> list[Tensor]:
        t = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        self.seconds[kind] += time.perf_counter() - t
        self.bytes_received[kind] += (self.world - 1) * x.numel() * x.element_size()
        return parts

    def all_gather_async(self, x: Tensor, kind: str) -> tuple[list[Tensor], Any]:
        t = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        work = dist.all_gather(parts, x.contiguous(), group=self.group, async_op=True)
        self.seconds[kind + "_launch"] += time.perf_counter() - t
        self.bytes_received[kind] += (self.world - 1) * x.numel() * x.element_size()
        return parts, work

    def wait(self, work, kind: str) -> None:
        t = time.perf_counter()
        if self.device.type == "cpu":
            work.wait(timedelta(seconds=self.timeout_s))
        else:
            work.wait()
        self.seconds[kind + "_wait"] += time.perf_counter() - t

    def stats(self) -> dict:
        secs = {k: round(v, 4) for k, v in self.seconds.items()}
        return {"bytes_received": dict(self.bytes_received), "comm_seconds": secs}


# --- launching ----------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, fn: Callable, args: tuple, threads: int, timeout_s: float,
               device: str, out: Any) -> None:
    try:
        torch.set_num_threads(threads)
        dev = torch.device(device if device != "cuda" else f"cuda:{rank % max(1, torch.cuda.device_count())}")
        backend = backend_for(dev)
        init_default_group(backend, rank, world, init_method=f"tcp://127.0.0.1:{port}", timeout_s=timeout_s)
        group = dist.new_group(list(range(world)), timeout=timedelta(seconds=timeout_s), backend=backend)
        ctx = RankContext(rank, world, group, dev, timeout_s)
        result = fn(ctx, *args)
        out.put((rank, True, _wire(result, to_numpy=True)))
        dist.barrier(group=group)
        dist.destroy_process_group()
    except BaseException:  # reported to the launcher, which stops the other ranks
        out.put((rank, False, traceback.format_exc()))
        out.close()
        out.join_thread()  # flush the queue before the hard exit
        os._exit(1)


def launch(fn: Callable, world: int, *args, threads: int | Sequence[int] = 1, timeout_s: float = 30.0,
           device: str = "cpu", deadline_s: float = 600.0, names: Sequence[str] | None = None) -> list[Any]:
    """Run `fn(ctx, *args)` on `world` spawned ranks; returns the per-rank results (rank order).

    `threads`: torch threads per rank (one count for all, or one per rank). `timeout_s` bounds every
    collective of a step; if any rank fails (an exception, or a process that dies), the others are
    terminated and a RuntimeError names the rank (with its `names` entry, e.g. its pipeline stage), the
    ranks that died without a traceback first, and the first traceback received."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    per_rank = [threads] * world if isinstance(threads, int) else list(threads)
    if len(per_rank) != world or (names is not None and len(names) != world):
        raise ValueError(f"launch: {world} ranks, {len(per_rank)} thread counts, "
                         f"{'no' if names is None else len(names)} names")
    label = [f"rank {r}" + (f" ({names[r]})" if names else "") for r in range(world)]
    from scratchlm.diffusion.fused_attention import prepare

    prepare()  # build the attention kernel once here, not in every rank while its peers wait on a collective
    spawn = mp.get_context("spawn")
    out = spawn.Queue()
    port = _free_port()
    procs = [spawn.Process(target=_rank_main, args=(r, world, port, fn, args, per_rank[r], timeout_s, device, out),
                           daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    t_end = time.monotonic() + deadline_s
    try:
        while len(results) < world:
            item = _next_result(out, procs, results, world, t_end, deadline_s)
            rank, ok, val = item
            if not ok:
                time.sleep(0.5)
                reported = {rank} | _drain_failures(out)
                exits = ", ".join(f"rank {r} exit code {p.exitcode}" for r, p in enumerate(procs)
                                  if p.exitcode not in (None, 0))
                died = [label[r] for r, p in enumerate(procs) if p.exitcode not in (None, 0, 1) and r not in reported]
                cause = f"{', '.join(died)} died; " if died else ""
                raise RuntimeError(f"{cause}{label[rank]} of {world} failed ({exits or 'no rank exited yet'}):\n{val}")
            results[rank] = _wire(val, to_numpy=False)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
    return [results[r] for r in range(world)]


def _drain_failures(out) -> set[int]:
    """The ranks whose failure reports are already queued (after the first one)."""
    ranks = set()
    while True:
        try:
            rank, ok, _ = out.get(timeout=0.05)
        except queue.Empty:
            return ranks
        if not ok:
            ranks.add(rank)


def _wire(obj: Any, to_numpy: bool) -> Any:
    """Tensors <-> numpy arrays: results cross the queue by value (torch's fd-shared tensors would die
    with the rank that made them)."""
    if to_numpy and isinstance(obj, Tensor):
        return obj.detach().cpu().numpy()
    if not to_numpy and type(obj).__module__ == "numpy" and hasattr(obj, "shape"):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _wire(v, to_numpy) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_wire(v, to_numpy) for v in obj)
    return obj


def _next_result(out, procs, results, world, t_end, deadline_s):
    """The next (rank, ok, value) from the ranks' queue; raises when a rank died silently or time ran out."""
    while True:
        try:
            return out.get(timeout=0.2)
        except queue.Empty:
            pass
        dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
        if dead:
            try:  # its traceback may still be in flight
                return out.get(timeout=1.5)
            except queue.Empty:
                pass
            r, code = dead[0]
            return r, False, f"rank {r} died (exit code {code}) without a result"
        if time.monotonic() > t_end:
            missing = sorted(set(range(world)) - set(results))
            raise TimeoutError(f"ranks {missing} did not finish in {deadline_s} s")


# --- CFG parallel -------------------------------------------------------------------------------------
@torch.no_grad()
def cfg_parallel_denoise(ctx: RankContext, pipe: DiffusionPipeline, latents: Tensor, text: Tensor, uncond: Tensor,
                         steps: int, guidance: float, sampler: str = "ddim", seed: int = 0) -> Tensor:
    """Rank 0 the unconditional branch, rank 1 the conditional one; identical latents on both ranks."""
    if ctx.world != 2:
        raise ValueError(f"CFG parallelism needs exactly 2 ranks (uncond, cond), got {ctx.world}")
    sch = make_sampler(sampler, pipe.schedule)
    sch.set_timesteps(steps)
    x = latents * sch.init_noise_sigma
    g = torch.Generator().manual_seed(seed + 1)
    emb = uncond if ctx.rank == 0 else text
    for t in sch.timesteps:
        xin = sch.scale_model_input(x, t)
        out = pipe.transformer(xin, torch.full((x.shape[0],), float(t)), emb)
        out_u, out_c = ctx.all_gather(out, "cfg_all_gather")
        x = sch.step(cfg_combine(out_u, out_c, guidance), t, x, generator=g)
    return x


# --- patch parallel -----------------------------------------------------------------------------------
class PatchParallelDiT:
    """Runs a band of patch rows through the DiT; self-attention K/V exchanged per `mode` (see module doc)."""

    def __init__(self, pipe: DiffusionPipeline, ctx: RankContext, mode: str = "exact", warmup: int = 1):
        if mode not in ("exact", "displaced"):
            raise ValueError(f"patch parallel mode must be 'exact' or 'displaced', got {mode!r}")
        self.dit, self.ctx, self.mode, self.warmup = pipe.transformer, ctx, mode, warmup
        self.step = 0
        self.tokens = [0] * ctx.world
        self.pending: dict[int, tuple[list[Tensor], Any]] = {}

    def set_bands(self, tokens: list[int]) -> None:
        """Tokens per rank's band (bands may differ by one patch row: they are padded to the largest for
        the all-gather, and the padding is cut off again before attention)."""
        self.tokens = tokens

    def _gather(self, kv: Tensor, parts: list[Tensor]) -> Tensor:
        return torch.cat([p[:, :, :n] for p, n in zip(parts, self.tokens)], dim=2)  # (2, B, N, H, D)

    def _padded(self, kv: Tensor) -> Tensor:
        pad = max(self.tokens) - kv.shape[2]
        return kv if pad == 0 else torch.nn.functional.pad(kv, (0, 0, 0, 0, 0, pad))

    def _hook(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        kv = torch.stack([k, v])  # (2, B, n_local, H, D)
        if self.mode == "exact" or self.step < self.warmup:
            parts = self.ctx.all_gather(self._padded(kv), "kv_all_gather")
            if self.mode == "displaced":
                self.pending[layer] = (parts, None)  # fresh: the next step's "stale" K/V
        else:
            parts, work = self.pending.pop(layer)
            if work is not None:
                self.ctx.wait(work, "kv_async")
            parts = list(parts)
            parts[self.ctx.rank] = kv  # own band always fresh; the others one step old
        full = self._gather(kv, parts)  # bands in rank (= patch-row) order
        if self.mode == "displaced" and self.step >= self.warmup:
            self.pending[layer] = self.ctx.all_gather_async(self._padded(kv), "kv_async")
        return full[0], full[1]

    def __call__(self, x_band: Tensor, t: Tensor, text: Tensor, row0: int, grid_h: int) -> Tensor:
        out = self.dit(x_band, t, text, kv_hook=self._hook, row0=row0, grid_h=grid_h)
        self.step += 1
        return out

    def finish(self) -> None:
        """Wait for the last step's in-flight gathers (every rank must complete the same collectives)."""
        for _, work in self.pending.values():
            if work is not None:
                self.ctx.wait(work, "kv_async")
        self.pending.clear()


@torch.no_grad()
def patch_parallel_denoise(ctx: RankContext, pipe: DiffusionPipeline, latents: Tensor, text: Tensor,
                           uncond: Tensor | None, steps: int, guidance: float, sampler: str = "ddim",
                           mode: str = "exact", warmup: int = 1, seed: int = 0) -> Tensor:
    """The full latent in, the full latent out (on every rank); in between each rank holds its band."""
    p = pipe.transformer.config.patch_size
    grid_h, grid_w = latents.shape[-2] // p, latents.shape[-1] // p
    if grid_h < ctx.world:
        raise ValueError(f"patch parallel: {grid_h} patch rows cannot be split over {ctx.world} ranks")
    bands = [grid_h // ctx.world + (1 if r < grid_h % ctx.world else 0) for r in range(ctx.world)]  # rows/rank
    row0 = sum(bands[:ctx.rank])
    rows = slice(row0 * p, (row0 + bands[ctx.rank]) * p)
    runner = PatchParallelDiT(pipe, ctx, mode, warmup)
    runner.set_bands([b * grid_w for b in bands])
    sch = make_sampler(sampler, pipe.schedule)
    sch.set_timesteps(steps)
    x_full = latents * sch.init_noise_sigma
    x = x_full[:, :, rows].clone()  # (B, C, band*p, W)
    g = torch.Generator().manual_seed(seed + 1)
    use_cfg = uncond is not None and guidance != 1.0
    for t in sch.timesteps:
        xin = sch.scale_model_input(x, t)
        tt = torch.full((x.shape[0],), float(t))
        if use_cfg:
            out = runner(torch.cat([xin, xin]), torch.cat([tt, tt]), torch.cat([uncond, text]), row0, grid_h)
            out_u, out_c = out.chunk(2)
            out = cfg_combine(out_u, out_c, guidance)
        else:
            out = runner(xin, tt, text, row0, grid_h)
        noise = None
        if sch.draws_noise:  # the same full-size noise as one rank (ddpm, euler_a, ...), sliced to the band
            noise = torch.randn(x_full.shape, generator=g)[:, :, rows]
        x = sch.step(out, t, x, noise=noise)
    runner.finish()
    pad = (max(bands) - bands[ctx.rank]) * p
    x_pad = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
    parts = ctx.all_gather(x_pad, "latent_all_gather")
    return torch.cat([xp[:, :, :b * p] for xp, b in zip(parts, bands)], dim=2)  # (B, C, H, W)


# --- rank entry points (module level so that spawn can import them) --------------------------------------
def run_patch(ctx: RankContext, path: str, prompts: list[str], steps: int, guidance: float, sampler: str,
              mode: str, warmup: int, seed: int, latent_size: int | None = None, die_at_step: int | None = None
              ) -> dict:
    pipe = DiffusionPipeline.from_pretrained(path)
    text, uncond = pipe.encode_prompts(prompts), pipe.encode_prompts([""] * len(prompts))
    lat = pipe.initial_latents(len(prompts), seed, size=latent_size)
    if die_at_step is not None and ctx.rank == ctx.world - 1:
        _die_after(pipe, die_at_step)
    dist.barrier(group=ctx.group)
    t = time.perf_counter()
    z = patch_parallel_denoise(ctx, pipe, lat, text, uncond, steps, guidance, sampler, mode, warmup, seed)
    return {"latents": z, "seconds": time.perf_counter() - t, **ctx.stats()}


def run_cfg(ctx: RankContext, path: str, prompts: list[str], steps: int, guidance: float, sampler: str, seed: int,
            latent_size: int | None = None) -> dict:
    pipe = DiffusionPipeline.from_pretrained(path)
    text, uncond = pipe.encode_prompts(prompts), pipe.encode_prompts([""] * len(prompts))
    lat = pipe.initial_latents(len(prompts), seed, size=latent_size)
    dist.barrier(group=ctx.group)
    t = time.perf_counter()
    z = cfg_parallel_denoise(ctx, pipe, lat, text, uncond, steps, guidance, sampler, seed)
    return {"latents": z, "seconds": time.perf_counter() - t, **ctx.stats()}


def _die_after(pipe: DiffusionPipeline, step: int) -> None:
    """Fault injection for the tests: this process exits abruptly inside its `step`-th DiT call."""
    calls = {"n": 0}
    forward = pipe.transformer.forward

    def dying(*a, **kw):
        calls["n"] += 1
        if calls["n"] > step:
            os._exit(3)
        return forward(*a, **kw)

    pipe.transformer.forward = dying


def run_patch_latents(ctx: RankContext, path: str, prompts: list[str], steps: int, guidance: float, sampler: str,
                      mode: str, warmup: int, latents_file: str) -> dict:
    """`run_patch` from given initial latents (a torch.save'd tensor), for quality comparisons."""
    pipe = DiffusionPipeline.from_pretrained(path)
    text, uncond = pipe.encode_prompts(prompts), pipe.encode_prompts([""] * len(prompts))
    lat = torch.load(latents_file, weights_only=True)
    z = patch_parallel_denoise(ctx, pipe, lat, text, uncond, steps, guidance, sampler, mode, warmup)
    return {"latents": z, **ctx.stats()}


def run_cfg_latents(ctx: RankContext, path: str, prompts: list[str], steps: int, guidance: float, sampler: str,
                    latents_file: str) -> dict:
    pipe = DiffusionPipeline.from_pretrained(path)
    text, uncond = pipe.encode_prompts(prompts), pipe.encode_prompts([""] * len(prompts))
    lat = torch.load(latents_file, weights_only=True)
    return {"latents": cfg_parallel_denoise(ctx, pipe, lat, text, uncond, steps, guidance, sampler), **ctx.stats()}
