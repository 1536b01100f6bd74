"""Component-level parallelism: the text encoder, the denoiser (DiT or UNet) and the VAE decoder on different
ranks, a queue of image requests streaming through them point to point (the survey's component pipelining:
encode request k+1 and decode k-1 while k denoises).

Policy:

- **Requests and results.** A request (`ImageRequest`) is prompts + seed + steps + guidance (+ sampler, negative
  prompt, and the time it arrives, in seconds after the start). Its result is a dict (`RESULT_FIELDS`): the images
  (B, C, H, W) in [-1, 1], the latency (arrival -> decoded), each stage's (start, end) and the denoiser rank that
  ran it. Results come back in queue order, each with its request's id.
- **Layout**, one string: ranks separated by ``|``, a rank's roles joined by ``+``. ``"text|denoise|vae"`` is the
  survey's three ranks; ``"text+vae|denoise|denoise"`` puts two denoiser ranks data-parallel over requests and lets
  the light text encoder and VAE decoder share the third. The text encoder and the VAE sit on one rank each,
  the denoiser on one or more ranks that do nothing else.
- **Scheduling.** Requests go to the denoiser ranks round robin by queue position, so every receiver knows its
  sender and order is kept (no work stealing: a request with more steps holds its rank up). Sends are flow
  controlled: at most `lookahead` messages in flight per destination (a send completes when the peer takes the
  message, i.e. starts on that request), so a stage runs at most that far ahead of its consumer and requests wait
  in the queue, not as embeddings in memory. A rank that also decodes prefers decoding (a finished request's
  latency) and encodes at most `lookahead` requests per denoiser rank ahead of the decoded ones; it receives on an
  inbox thread (a gloo receive only completes inside `wait`, so it cannot be polled between encodings). After the
  last request the text rank sends each denoiser rank a stop message, which it forwards to the VAE rank, so no rank
  needs the queue's length: the queue may be any iterable (a generator fed by a server).
- **Same images as the serial run.** `serial_service` runs the same three stage functions (`Stages`) one after
  another on one process; each request's initial latents come from its own seed, never from the rank running it,
  so the pipelined images equal the serial ones request for request.
- **Fail fast.** A rank that dies closes its connections: its peers' waits fail at once with a `StageError`
  naming this stage and rank, the peer's, and the request, and `parallel.launch` (given the stage names) stops the
  other ranks and names the one that died. A hung peer: the rest of a message once its header came, and every
  send, wait at most the step timeout (`timeout_s`); the wait for a message to *start* is bounded by `idle_s`
  instead (default an hour: a service's queue may sit empty, and a request may denoise for long).
- **Timing.** Each rank's CPU seconds (its process, all threads) are counted too. Every rank's clock starts after a
  common barrier, so times compare across ranks (to the barrier's skew) without synchronised clocks. Per stage: its
  busy intervals, from which `summarize` derives utilisation (busy / makespan), fill (idle before its first
  request), bubbles (idle between its first start and last end) and drain (idle after its last end), and the queue's
  throughput and latency percentiles.
- Messages: a JSON header (the request, stage times, tensor shapes and dtypes; never a pickle) then the tensors.
  CPU ranks (gloo) only: CUDA ranks are a clear error (the stages would need device placement and NCCL p2p).
- The pipeline's public API is all it uses (`encode_prompts_pooled`, `initial_latents`, `denoise`, `decode`, and
  SDXL's `sdxl_time_ids`), the way the pipeline's own `__call__` uses it (`Stages.reference` is that call).
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import threading
import time
from collections import defaultdict, deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from scratchlm.diffusion.parallel import RankContext, launch
from scratchlm.diffusion.pipeline import DiffusionPipeline

ROLES = ("text", "denoise", "vae")
RESULT_FIELDS = ("id", "index", "images", "latency_s", "arrival_s", "stages", "denoise_rank")


@dataclass(frozen=True)
class ImageRequest:
    """One text-to-image request of the queue."""

    id: str  # returned with its result
    prompts: tuple[str, ...]  # one image per prompt (the request's batch)
    seed: int = 0  # initial latents and sampler noise; the same seed gives the same images on any layout
    steps: int = 25  # denoising steps
    guidance: float | None = None  # classifier-free guidance scale (1.0: no unconditional branch); None: the
    # pipeline's default (7.5 for SD folders, 5.0 SDXL, 3.0 scratchlm's DiT)
    sampler: str | None = None  # ddim | ddpm | euler; None: the pipeline's own (its folder's scheduler)
    negative_prompt: str | None = None  # the unconditional input's prompt; None: "" (SDXL folders that force zeros
    # for an empty prompt: zero embeddings, as the pipeline's own call)
    size: tuple[int, int] | None = None  # latent (h, w); None: the pipeline's native size
    guidance_rescale: float = 0.0  # CFG rescale (SD pipelines); 0: off
    arrival_s: float = 0.0  # when it joins the queue, seconds after the start (0: queued from the start)

    def __post_init__(self):
        if not self.prompts:
            raise ValueError(f"request {self.id!r}: no prompts")
        object.__setattr__(self, "prompts", tuple(self.prompts))
        if self.size is not None:
            object.__setattr__(self, "size", (self.size, self.size) if isinstance(self.size, int) else tuple(self.size))


class StageError(RuntimeError):
    """A stage could not receive from or send to its peer stage (dead, hung, or a protocol error)."""


# --- the three stages, over the pipeline's plain API -------------------------------------------------------
class Stages:
    """What each component does to a request, exactly as the pipeline's own `__call__` does it (DiT, SD and SDXL
    pipelines); the pipelined and the serial runs both call these. The text stage's output is a dict of named
    tensors: 'text' (B, L, d), and with CFG 'uncond'; SDXL adds 'pooled' / 'pooled_uncond' (B, p)."""

    def __init__(self, pipe: DiffusionPipeline):
        self.pipe = pipe

    def guidance(self, req: ImageRequest) -> float:
        return self.pipe.default_guidance if req.guidance is None else req.guidance

    @torch.no_grad()
    def encode(self, req: ImageRequest) -> dict[str, Tensor]:
        pipe, b = self.pipe, len(req.prompts)
        text, pooled = pipe.encode_prompts_pooled(list(req.prompts))
        cond = {"text": text} if pooled is None else {"text": text, "pooled": pooled}
        if self.guidance(req) == 1.0:  # no unconditional branch
            return cond
        if pipe.is_sdxl and req.negative_prompt is None and pipe.force_zeros_for_empty_prompt:
            cond.update(uncond=torch.zeros_like(text), pooled_uncond=torch.zeros_like(pooled))  # SDXL's rule
            return cond
        uncond, pooled_u = pipe.encode_prompts_pooled([req.negative_prompt or ""] * b)
        cond["uncond"] = uncond
        if pooled_u is not None:
            cond["pooled_uncond"] = pooled_u
        return cond

    @torch.no_grad()
    def denoise(self, req: ImageRequest, cond: dict[str, Tensor]) -> Tensor:
        pipe, b = self.pipe, len(req.prompts)
        lat = pipe.initial_latents(b, req.seed, req.size)  # (B, c, h, w)
        kw = {}
        if pipe.is_sdxl:
            f = pipe.vae.config.downsample
            ids = pipe.sdxl_time_ids(b, (lat.shape[-2] * f, lat.shape[-1] * f))
            kw["added"] = {"text_embeds": cond["pooled"], "time_ids": ids}
            if "pooled_uncond" in cond:
                kw["added_uncond"] = {"text_embeds": cond["pooled_uncond"], "time_ids": ids}
        return pipe.denoise(lat, cond["text"], cond.get("uncond"), req.steps, self.guidance(req), req.sampler,
                            seed=req.seed, guidance_rescale=req.guidance_rescale, **kw)

    @torch.no_grad()
    def decode(self, z: Tensor) -> Tensor:
        return self.pipe.decode(z)  # (B, C, H, W) in [-1, 1]

    def reference(self, req: ImageRequest) -> Tensor:
        """The pipeline's own text-to-image call for `req` (what the stages must reproduce)."""
        neg = None if req.negative_prompt is None else [req.negative_prompt] * len(req.prompts)
        return self.pipe(list(req.prompts), steps=req.steps, guidance=req.guidance, sampler=req.sampler, seed=req.seed,
                         negative_prompts=neg, guidance_rescale=req.guidance_rescale, size=req.size)


# --- layout ---------------------------------------------------------------------------------------------
def parse_layout(layout: str) -> list[frozenset[str]]:
    """'text|denoise|vae' -> [{'text'}, {'denoise'}, {'vae'}]; checks the rules in the module docstring."""
    ranks = [frozenset(r.strip() for r in part.split("+")) for part in layout.split("|")]
    for r, roles in enumerate(ranks):
        bad = roles - set(ROLES)
        if bad:
            raise ValueError(f"layout {layout!r}: rank {r} has unknown roles {sorted(bad)}; roles are {ROLES}")
        if "denoise" in roles and len(roles) > 1:
            raise ValueError(f"layout {layout!r}: rank {r} mixes the denoiser with {sorted(roles - {'denoise'})}; "
                             "a denoiser rank does nothing else")
    for role in ("text", "vae"):
        n = sum(role in roles for roles in ranks)
        if n != 1:
            raise ValueError(f"layout {layout!r}: the {role} role must be on exactly one rank, found {n}")
    if not any("denoise" in roles for roles in ranks):
        raise ValueError(f"layout {layout!r}: no denoiser rank")
    return ranks


def rank_names(layout: str) -> list[str]:
    """Each rank's stage name, for error messages: ['text', 'denoise', 'vae'] or ['text+vae', 'denoise', ...]."""
    return ["+".join(r for r in ROLES if r in roles) for roles in parse_layout(layout)]


# --- messages -------------------------------------------------------------------------------------------
@dataclass
class _Peer:
    """This rank's links to the others: a message is a JSON header then its tensors. Sends to a rank are flow
    controlled: at most `lookahead` of them in flight (a send completes once the peer took the message, i.e. when it
    starts on that request), so an upstream stage runs at most `lookahead` requests ahead of its consumer."""

    ctx: RankContext
    me: str  # this rank's stage name
    names: list[str]  # every rank's stage name
    idle_s: float  # waits for a peer to start a message or to take ours: bounded by this (a queue may sit idle)
    lookahead: int
    pending: dict[int, deque] = field(default_factory=lambda: defaultdict(deque))  # dst -> sends in flight

    def _where(self, peer: int, what: str) -> str:
        return f"{self.me} (rank {self.ctx.rank}) {what} {self.names[peer]} (rank {peer})"

    def wait(self, work, peer: int, what: str, seconds: float | None = None) -> None:
        seconds = self.ctx.timeout_s if seconds is None else seconds
        try:
            work.wait(timedelta(seconds=seconds))
        except RuntimeError as e:
            raise StageError(f"{self._where(peer, what)} failed within {seconds:g} s: {e}") from e

    def send(self, dst: int, meta: dict, tensors: dict[str, Tensor], what: str) -> None:
        q = self.pending[dst]
        while len(q) >= self.lookahead:  # back-pressure: wait for the peer to take the oldest message
            self._complete(dst, q.popleft())
        tensors = {k: t.detach().contiguous() for k, t in tensors.items()}
        specs = [[k, list(t.shape), str(t.dtype).removeprefix("torch.")] for k, t in tensors.items()]
        meta = {**meta, "tensors": specs}
        head = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
        size = torch.tensor([head.numel()], dtype=torch.int64)
        bufs = [size, head, *tensors.values()]  # kept alive until the sends complete
        works = [dist.isend(b, dst, group=self.ctx.group) for b in bufs]
        self.ctx.bytes_received["sent"] += sum(b.numel() * b.element_size() for b in bufs)
        q.append((works, bufs, f"sending {what} to"))

    def _complete(self, dst: int, item) -> None:
        works, _, what = item
        self.wait(works[0], dst, what, self.idle_s)  # the peer may be busy with earlier requests
        for w in works[1:]:
            self.wait(w, dst, what)

    def flush(self) -> None:
        """Wait for every send in flight."""
        for dst, q in self.pending.items():
            while q:
                self._complete(dst, q.popleft())

    def recv(self, src: int, what: str) -> tuple[dict, dict[str, Tensor]]:
        """The next message from `src`: its start waits up to `idle_s`, the rest up to the step timeout."""
        size = torch.empty(1, dtype=torch.int64)
        self.wait(dist.irecv(size, src, group=self.ctx.group), src, f"receiving {what} from", self.idle_s)
        head = torch.empty(int(size), dtype=torch.uint8)
        self.wait(dist.irecv(head, src, group=self.ctx.group), src, f"receiving {what} from")
        meta = json.loads(bytes(head.numpy()).decode())
        tensors = {}
        for name, shape, dtype in meta.pop("tensors"):
            t = torch.empty(shape, dtype=getattr(torch, dtype))
            self.wait(dist.irecv(t, src, group=self.ctx.group), src, f"receiving {what} from")
            self.ctx.bytes_received[self.names[src]] += t.numel() * t.element_size()
            tensors[name] = t
        return meta, tensors


class _Inbox:
    """A thread receiving the denoiser ranks' finished requests in queue order (round robin), so that the main
    thread can encode while it waits (a gloo receive only completes inside `wait`, so it cannot be polled) and
    the next latent arrives while the current one decodes. Items: (meta, tensors), then None after the stops;
    an exception is handed over as the item."""

    def __init__(self, peer: _Peer, den: list[int]):
        self.peer, self.den = peer, den
        self.items: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="component-inbox", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        k = 0
        try:
            while True:
                i = k % len(self.den)
                meta, tensors = self.peer.recv(self.den[i], f"request number {k}")
                if meta.get("stop"):  # no request k, nor any later one: collect the other ranks' stops
                    for r in self.den[i + 1:] + self.den[:i]:
                        self.peer.recv(r, "the stop message")
                    self.items.put(None)
                    return
                self.items.put((meta, tensors))
                k += 1
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
            self.items.put(e)

    def get(self, timeout: float | None) -> Any:
        """The next item, or `_NOTHING` after `timeout` seconds (0: do not block; None: until one comes)."""
        try:
            item = self.items.get(timeout=timeout) if timeout != 0 else self.items.get_nowait()
        except queue.Empty:
            return _NOTHING
        if isinstance(item, BaseException):
            raise item
        return item


_NOTHING = object()


class _Clock:
    """Seconds since the common start (taken right after a barrier on every rank)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def until(self, t: float) -> float:
        return max(0.0, t - self.now())


def _maybe_die(die: tuple[str, int] | None, stage: str, k: int) -> None:
    """Fault injection for the tests: the process exits abruptly when `stage` starts request number `k`."""
    if die is not None and die[0] == stage and die[1] == k:
        os._exit(3)


# --- the rank programs ----------------------------------------------------------------------------------
@torch.no_grad()
def serve_components(ctx: RankContext, stages: Stages, requests: Iterable[ImageRequest], layout: str,
                     lookahead: int = 1, idle_s: float = 3600.0, die: tuple[str, int] | None = None) -> dict:
    """This rank's part of the component pipeline (every rank calls it with the same layout). Returns
    {'rank', 'roles', 'busy': {stage: [(start, end), ...]}, 'results': [...] (on the VAE's rank only)}."""
    if ctx.device.type != "cpu":
        raise NotImplementedError(f"component pipelining runs on CPU ranks (gloo) only, got device {ctx.device}")
    ranks = parse_layout(layout)
    if len(ranks) != ctx.world:
        raise ValueError(f"layout {layout!r} has {len(ranks)} ranks, the group has {ctx.world}")
    if lookahead < 1:
        raise ValueError(f"lookahead must be >= 1 request per denoiser rank, got {lookahead}")
    names = rank_names(layout)
    peer = _Peer(ctx, names[ctx.rank], names, idle_s, lookahead)
    dist.barrier(group=ctx.group)
    clock, cpu0 = _Clock(), time.process_time()
    busy: dict[str, list[tuple[float, float]]] = {r: [] for r in ranks[ctx.rank]}
    out = {"rank": ctx.rank, "roles": names[ctx.rank], "busy": busy}
    if "denoise" in ranks[ctx.rank]:
        _denoise_rank(peer, stages, ranks, clock, busy, die)
    else:
        out["results"] = _edge_rank(peer, stages, ranks, requests, clock, busy, die)
    peer.flush()
    out["end_s"], out["cpu_s"] = clock.now(), time.process_time() - cpu0
    return out


def _denoise_rank(peer: _Peer, stages: Stages, ranks, clock: _Clock, busy, die) -> None:
    text = next(r for r, roles in enumerate(ranks) if "text" in roles)
    vae = next(r for r, roles in enumerate(ranks) if "vae" in roles)
    while True:
        meta, cond = peer.recv(text, "a request")
        if meta.get("stop"):
            peer.send(vae, {"stop": True}, {}, "the stop message")
            return
        req = ImageRequest(**meta["request"])
        _maybe_die(die, "denoise", meta["index"])
        t = clock.now()
        z = stages.denoise(req, cond)  # (B, c, h, w)
        busy["denoise"].append((t, clock.now()))
        stamps = {**meta["stages"], "denoise": busy["denoise"][-1]}
        peer.send(vae, {**meta, "stages": stamps, "denoise_rank": peer.ctx.rank}, {"latents": z}, f"request {req.id!r}")


def _edge_rank(peer: _Peer, stages: Stages, ranks, requests: Iterable[ImageRequest], clock: _Clock, busy,
               die) -> list[dict]:
    """A rank holding the text encoder, the VAE decoder, or both (then it interleaves them, decoding first)."""
    roles = ranks[peer.ctx.rank]
    den = [r for r, rr in enumerate(ranks) if "denoise" in rr]
    source = iter(requests) if "text" in roles else iter(())
    nxt = next(source, None)
    n_enc, k_dec = 0, 0  # requests encoded; decoded
    encoding, decoding = "text" in roles, "vae" in roles
    inbox = _Inbox(peer, den) if decoding else None
    results: list[dict] = []
    while encoding or decoding:
        block: float | None = None  # how long this rank may wait for a finished request (None: until one comes)
        if encoding:
            if nxt is None:  # the queue is exhausted: tell every denoiser rank
                for r in den:
                    peer.send(r, {"stop": True}, {}, "the stop message")
                encoding = False
                continue
            wait = clock.until(nxt.arrival_s)
            window_full = decoding and n_enc - k_dec >= peer.lookahead * len(den)  # no use encoding further ahead
            if wait == 0.0 and not window_full:
                if decoding:  # a finished request first: its latency
                    item = inbox.get(0)
                    if item is not _NOTHING:
                        decoding = _take(item, results, stages, clock, busy, die)
                        k_dec += decoding
                        continue
                _encode(peer, stages, nxt, n_enc, den[n_enc % len(den)], clock, busy, die)
                n_enc += 1
                nxt = next(source, None)
                continue
            block = None if window_full else wait
            if not decoding:
                time.sleep(wait)
                continue
        item = inbox.get(block)
        if item is not _NOTHING:
            decoding = _take(item, results, stages, clock, busy, die)
            k_dec += decoding
    return results


def _take(item, results: list[dict], stages: Stages, clock: _Clock, busy, die) -> bool:
    """Decode an inbox item into `results`; False when it was the end of the stream."""
    if item is None:
        return False
    meta, tensors = item
    results.append(_decode(stages, meta, tensors["latents"], clock, busy, die))
    return True


def _encode(peer: _Peer, stages: Stages, req: ImageRequest, k: int, dst: int, clock: _Clock, busy, die) -> None:
    _maybe_die(die, "text", k)
    t = clock.now()
    cond = stages.encode(req)
    busy["text"].append((t, clock.now()))
    meta = {"request": asdict(req), "index": k, "stages": {"text": busy["text"][-1]}}
    peer.send(dst, meta, cond, f"request {req.id!r}")


def _decode(stages: Stages, meta: dict, z: Tensor, clock: _Clock, busy, die) -> dict:
    _maybe_die(die, "vae", meta["index"])
    t = clock.now()
    images = stages.decode(z)
    busy["vae"].append((t, clock.now()))
    req = meta["request"]
    return {"id": req["id"], "index": meta["index"], "images": images, "arrival_s": req["arrival_s"],
            "latency_s": busy["vae"][-1][1] - req["arrival_s"], "stages": {**meta["stages"], "vae": busy["vae"][-1]},
            "denoise_rank": meta["denoise_rank"]}


@torch.no_grad()
def serial_service(stages: Stages, requests: Iterable[ImageRequest]) -> dict:
    """The reference: one process running the three stages one after another, request by request (same
    arrival times, same result fields; `serve_components`' output format with every role on rank 0)."""
    clock, cpu0 = _Clock(), time.process_time()
    busy: dict[str, list[tuple[float, float]]] = {r: [] for r in ROLES}
    results = []
    for k, req in enumerate(requests):
        time.sleep(clock.until(req.arrival_s))
        spans = {}
        for stage in ROLES:
            t = clock.now()
            if stage == "text":
                cond = stages.encode(req)
            elif stage == "denoise":
                z = stages.denoise(req, cond)
            else:
                images = stages.decode(z)
            busy[stage].append((t, clock.now()))
            spans[stage] = busy[stage][-1]
        results.append({"id": req.id, "index": k, "images": images, "arrival_s": req.arrival_s,
                        "latency_s": spans["vae"][1] - req.arrival_s, "stages": spans, "denoise_rank": 0})
    return {"rank": 0, "roles": "+".join(ROLES), "busy": busy, "results": results, "end_s": clock.now(),
            "cpu_s": time.process_time() - cpu0}


# --- summaries --------------------------------------------------------------------------------------------
def _percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (pos - lo)


def summarize(rank_outputs: list[dict]) -> dict:
    """Throughput, latency percentiles and per-stage utilisation / fill / bubbles / drain of one run (the
    per-rank outputs of `serve_components`, or `[serial_service(...)]`)."""
    results = next(o["results"] for o in rank_outputs if "results" in o and "vae" in o["roles"].split("+"))
    makespan = max(o["end_s"] for o in rank_outputs)
    done = sorted(r["stages"]["vae"][1] for r in results)
    lat = [r["latency_s"] for r in results]
    stages: dict[str, dict] = {}
    for o in rank_outputs:
        for stage, spans in o["busy"].items():
            key = stage if stage != "denoise" or sum("denoise" in x["busy"] for x in rank_outputs) == 1 \
                else f"denoise@{o['rank']}"
            b = sum(e - s for s, e in spans)
            first, last = (spans[0][0], spans[-1][1]) if spans else (makespan, makespan)
            stages[key] = {"rank": o["rank"], "requests": len(spans), "busy_s": b, "utilisation": b / makespan,
                           "fill_s": first, "bubbles_s": (last - first) - b, "drain_s": makespan - last,
                           "mean_s": b / max(1, len(spans))}
    return {"results": results, "n": len(results), "makespan_s": makespan,
            # CPU seconds of every rank's process (all its threads), start to end: the work, whatever the share of
            # the cores the scheduler gave each configuration
            "cpu_s": sum(o["cpu_s"] for o in rank_outputs),
            "throughput_rps": len(results) / makespan,
            # the steady state, without the fill: completions per second between the first and the last
            "steady_rps": (len(done) - 1) / (done[-1] - done[0]) if len(done) > 1 and done[-1] > done[0] else None,
            "latency_s": {"p50": _percentile(lat, 0.5), "p95": _percentile(lat, 0.95), "mean": statistics.mean(lat),
                          "max": max(lat)} if lat else {},
            "stages": stages}


# --- entry points (module level so that spawn can import them) --------------------------------------------
def load_stages(path: str, denoiser: bool = True) -> Stages:
    """The pipeline folder's stages; `denoiser=False` releases the denoiser after loading (a text or VAE rank never
    calls it, and it is most of the weights: SD 1.5's UNet is 860M of its 1.07B parameters)."""
    pipe = DiffusionPipeline.from_pretrained(path)
    if not denoiser:
        pipe.denoiser = None
    return Stages(pipe)


def run_components(ctx: RankContext, path: str, requests: list[ImageRequest], layout: str = "text|denoise|vae",
                   lookahead: int = 1, idle_s: float = 3600.0, die: tuple[str, int] | None = None) -> dict:
    """One rank of the component pipeline on the pipeline folder `path`."""
    stages = load_stages(path, denoiser="denoise" in parse_layout(layout)[ctx.rank])
    return serve_components(ctx, stages, requests, layout, lookahead, idle_s, die)


def run_serial(ctx: RankContext, path: str, requests: list[ImageRequest]) -> dict:
    """The serial reference in a spawned process (the same process set-up as the pipelined ranks)."""
    if ctx.world != 1:
        raise ValueError(f"the serial reference runs on 1 rank, got {ctx.world}")
    return serial_service(load_stages(path), requests)


def run_service(path: str, requests: list[ImageRequest], layout: str = "text|denoise|vae",
                threads: int | list[int] = 1, timeout_s: float = 60.0, lookahead: int = 1, idle_s: float = 3600.0,
                die: tuple[str, int] | None = None, deadline_s: float = 3600.0) -> dict:
    """Spawn the layout's ranks (or one process for layout 'serial'), run the queue, summarise it."""
    if layout == "serial":
        outs = launch(run_serial, 1, path, requests, threads=threads, timeout_s=timeout_s, deadline_s=deadline_s,
                      names=["serial"])
    else:
        names = rank_names(layout)
        outs = launch(run_components, len(names), path, requests, layout, lookahead, idle_s, die, threads=threads,
                      timeout_s=timeout_s, deadline_s=deadline_s, names=names)
    return summarize(outs)
