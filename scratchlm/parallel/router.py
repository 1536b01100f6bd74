"""Data parallelism for serving: D engine replicas behind one router (`scratchlm serve --data-parallel-size D`).

Each replica is a whole `scratchlm serve` process (itself possibly tensor/pipeline parallel) on its
own port; the router is a small FastAPI app that proxies every endpoint to one of them with httpx,
streaming included. Routing and fault handling:

- **Least outstanding tokens.** A generation request costs an estimate of its prompt tokens plus
  `max_tokens` x `n`; the cost is held by the replica while the request is in flight. The request goes
  to a healthy replica with the fewest outstanding tokens.
- **Prefix-cache affinity as the tie-breaker.** Among the replicas within `affinity_slack_tokens` of
  that minimum, the one chosen is the rendezvous-hash winner for the start of the prompt (its first
  KV block or so), so requests sharing a prefix meet the same replica's prefix cache while loads are
  equal, and a replica leaving the pool moves only its own share of prefixes.
- **Health checks.** `/health` of every replica is polled; a replica that fails `unhealthy_after`
  checks in a row, refuses a connection, or whose process has exited leaves the rotation (a live one
  comes back when it answers again).
- **Retries.** A request whose replica fails (connection error, 502/503/504, or the replica is taken
  out of rotation while the request waits) *before any byte was sent to the client* is sent to another
  replica: a non-streaming request is only answered once its replica has answered in full, and a
  streaming one is committed only when its first chunk has arrived, so an accepted request is not
  lost when a replica dies. A stream that breaks after its first chunk cannot be replayed without
  duplicating text: it ends with an error event. A 429 (replica queue full) is tried on the others.
- **Streams on a replica that leaves rotation end.** A committed stream whose replica is marked unhealthy or
  dead ends at once with an OpenAI-style error event (code ``replica_unavailable``) instead of waiting for a
  replica that stopped answering until the request timeout. A stopped replica is detected within
  ``health_interval_s + unhealthy_after x (health_interval_s + health_timeout_s)``.
- **Error bodies name no internals.** What a client reads says which replica failed and how (refused, 5xx,
  left rotation); exception texts and addresses go to the router's log only.
- **Replicas live and die with the router.** Every replica it starts asks the kernel to be sent SIGTERM when
  the router dies (`scratchlm.lifecycle.die_with_parent`), so a SIGKILLed router leaves none behind. On
  SIGTERM or SIGINT the router stops serving, then reaps its replicas (SIGTERM, a wait of at most
  ``shutdown_timeout_s``, then SIGKILL) and only then ends, by that signal.
- **/health and /metrics** aggregate the replicas (metrics summed, KV-cache usage averaged) and add
  the router's own (`scratchlm:router_*`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

log = logging.getLogger("scratchlm.router")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
RELAY_QUEUE_CHUNKS = 64  # chunks read ahead of a slow client per stream
RETRY_STATUSES = (500, 502, 503, 504)  # a replica shutting down answers in-flight requests with 500
# hop-by-hop and length headers are the proxy's own business
_DROP_REQUEST_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "accept-encoding", "keep-alive"}
_DROP_RESPONSE_HEADERS = {"content-length", "connection", "transfer-encoding", "content-encoding", "keep-alive",
                          "date", "server"}


@dataclass
class RouterConfig:
    """Options of the data-parallel router; each is a `scratchlm serve --router-...` flag."""

    health_interval_s: float = field(default=1.0, metadata={"help": "seconds between health checks of each replica"})
    health_timeout_s: float = field(default=3.0, metadata={"help": "a replica's /health must answer within this"})
    unhealthy_after: int = field(
        default=3, metadata={"help": "failed health checks in a row that take a replica out of rotation"})
    affinity_chars: int = field(
        default=64, metadata={"help": "characters at the start of a prompt hashed for prefix-cache affinity "
                              "(about one 16-token KV block)"})
    affinity_slack_tokens: int = field(
        default=0, metadata={"help": "replicas within this many outstanding tokens of the least loaded one count "
                             "as tied, and the prefix-affinity replica among them wins"})
    default_max_tokens: int = field(
        default=256, metadata={"help": "cost assumed for a request that does not say its max_tokens"})
    request_timeout_s: float = field(default=600.0, metadata={"help": "longest wait for a replica's answer"})
    startup_timeout_s: float = field(default=600.0, metadata={"help": "longest wait for the replicas to load"})
    shutdown_timeout_s: float = field(
        default=10.0, metadata={"help": "on SIGTERM/SIGINT, how long the replicas get to exit after their SIGTERM "
                                "before they are killed"})
    replica_urls: list[str] | None = field(
        default=None, metadata={"help": "route to these running `scratchlm serve` URLs (e.g. one per node) instead "
                                "of starting --data-parallel-size local replicas"})

    def __post_init__(self) -> None:
        problems = []
        for name in ("health_interval_s", "health_timeout_s", "request_timeout_s", "startup_timeout_s",
                     "shutdown_timeout_s"):
            if not getattr(self, name) > 0:
                problems.append(f"router_{name}={getattr(self, name)} (expected a positive number)")
        for name in ("unhealthy_after", "affinity_chars", "default_max_tokens"):
            if getattr(self, name) < 1:
                problems.append(f"router_{name}={getattr(self, name)} (expected a positive integer)")
        for url in self.replica_urls or []:
            if not url.startswith(("http://", "https://")):
                problems.append(f"router_replica_urls: {url!r} (expected http://HOST:PORT)")
        if self.affinity_slack_tokens < 0:
            problems.append(f"router_affinity_slack_tokens={self.affinity_slack_tokens} (expected >= 0)")
        if problems:
            raise ValueError("invalid router options: " + "; ".join(problems))


@dataclass
class Replica:
    """One engine replica as the router sees it (mutated only on the router's event loop)."""

    index: int
    url: str
    process: subprocess.Popen | None = None
    healthy: bool = True
    dead: bool = False                      # its process exited: never comes back
    outstanding_tokens: int = 0
    outstanding_requests: int = 0
    requests_total: int = 0
    failures_total: int = 0
    consecutive_failures: int = 0
    down: asyncio.Event | None = None       # set when it leaves rotation; replaced when it returns
    down_reason: str | None = None          # why it last left rotation (for the log)

    @property
    def in_rotation(self) -> bool:
        return self.healthy and not self.dead

    def down_event(self) -> asyncio.Event:
        if self.down is None:
            self.down = asyncio.Event()
        return self.down


def estimate_cost(body: dict[str, Any], default_max_tokens: int) -> int:
    """Tokens a generation request will occupy: its prompts (about 4 characters a token, or the ids given) plus
    max_tokens x n for each prompt."""
    if "messages" in body:
        chars = sum(len(json.dumps(m.get("content", ""))) for m in body.get("messages") or [] if isinstance(m, dict))
        prompts_tokens, n_prompts = chars // 4 + 1, 1
    else:
        p = body.get("prompt", "")
        prompts = p if isinstance(p, list) and p and not isinstance(p[0], int) else [p]
        prompts_tokens = sum(len(x) if isinstance(x, list) else len(str(x)) // 4 + 1 for x in prompts)
        n_prompts = len(prompts)
    try:
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or default_max_tokens)
        n = int(body.get("n") or 1)
    except (TypeError, ValueError):  # the replica will answer 400; count it cheaply
        max_tokens, n = default_max_tokens, 1
    return prompts_tokens + max_tokens * n * n_prompts


def affinity_key(body: dict[str, Any], chars: int) -> str:
    """The start of the prompt (what the replica's first KV blocks will hold), as a string to hash."""
    if "messages" in body:
        parts = []
        for m in body.get("messages") or []:
            if isinstance(m, dict):
                parts.append(f"{m.get('role')}:{json.dumps(m.get('content'))}")
            if sum(map(len, parts)) >= chars:
                break
        return "\n".join(parts)[:chars]
    p = body.get("prompt", "")
    if isinstance(p, list) and p and not isinstance(p[0], int):
        p = p[0]
    if isinstance(p, list):  # token ids: about one block
        return ",".join(map(str, p[: max(1, chars // 4)]))
    return str(p)[:chars]


def _rendezvous(key: str, replica: Replica) -> bytes:
    return hashlib.blake2b(f"{key}\0{replica.index}".encode(), digest_size=8).digest()


def choose_replica(replicas: list[Replica], key: str | None, slack: int = 0,
                   exclude: set[int] = frozenset()) -> Replica | None:
    """The replica for a request: fewest outstanding tokens, ties (within `slack`) broken by prefix affinity
    (highest rendezvous hash of `key`); None when no replica is in rotation."""
    candidates = [r for r in replicas if r.in_rotation and r.index not in exclude]
    if not candidates:
        return None
    least = min(r.outstanding_tokens for r in candidates)
    tied = [r for r in candidates if r.outstanding_tokens <= least + slack]
    if key is None:
        return min(tied, key=lambda r: (r.outstanding_tokens, r.index))
    return max(tied, key=lambda r: _rendezvous(key, r))


class ReplicaFailed(Exception):
    """The replica could not answer (connection error, 5xx, or it left rotation while we waited).

    `take_down`: whether the replica leaves rotation at once. A plain 500 does not take it down (it may be
    this one request); the health checks decide, and the request is still retried on another replica."""

    def __init__(self, message: str, take_down: bool = True):
        super().__init__(message)
        self.take_down = take_down


class Router:
    """Routes and proxies requests over `replicas`; runs the health checks (see the module docstring)."""

    def __init__(self, replicas: list[Replica], config: RouterConfig | None = None, on_all_dead: Any = None):
        import httpx

        if not replicas:
            raise ValueError("the router needs at least one replica")
        self.replicas = replicas
        self.config = config or RouterConfig()
        self.on_all_dead = on_all_dead
        self.retries_total = 0
        self.rejected_total = 0
        self.streams_broken_total = 0
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(self.config.request_timeout_s, connect=5.0),
            limits=httpx.Limits(max_connections=4096, max_keepalive_connections=256))
        self._health_task: asyncio.Task | None = None

    # ----- health ---------------------------------------------------------------------------------------------

    def mark_down(self, replica: Replica, reason: str) -> None:
        """Take `replica` out of rotation and wake the requests waiting on it (they retry elsewhere)."""
        if replica.healthy:
            log.warning("replica %d (%s) out of rotation: %s; %d of %d in rotation", replica.index, replica.url,
                        reason, sum(r.in_rotation for r in self.replicas) - 1, len(self.replicas))
        replica.healthy = False
        replica.down_reason = reason
        replica.down_event().set()

    def mark_up(self, replica: Replica) -> None:
        if not replica.healthy and not replica.dead:
            replica.healthy = True
            replica.down = asyncio.Event()
            log.info("replica %d (%s) back in rotation", replica.index, replica.url)
        replica.consecutive_failures = 0

    async def check_once(self) -> None:
        """One round of health checks (process exit, then GET /health)."""

        async def check(r: Replica) -> None:
            if r.dead:
                return
            if r.process is not None and r.process.poll() is not None:
                r.dead = True
                self.mark_down(r, f"its process (pid {r.process.pid}) exited with code {r.process.returncode}")
                return
            try:
                resp = await self.client.get(r.url + "/health", timeout=self.config.health_timeout_s)
                ok = resp.status_code == 200
                reason = f"/health answered {resp.status_code}"
            except Exception as e:  # noqa: BLE001 - any failure to answer is a failed check
                ok, reason = False, f"/health failed: {type(e).__name__}: {e}"
            if ok:
                self.mark_up(r)
            else:
                r.consecutive_failures += 1
                if r.consecutive_failures >= self.config.unhealthy_after:
                    self.mark_down(r, f"{reason} ({r.consecutive_failures} checks in a row)")

        await asyncio.gather(*(check(r) for r in self.replicas))
        if all(r.dead for r in self.replicas) and self.on_all_dead is not None:
            self.on_all_dead()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_once()
            except Exception:  # noqa: BLE001 - the loop must survive anything
                log.exception("health check round failed")

    def start(self) -> None:
        """Start the health checks (call on the event loop that serves requests)."""
        for r in self.replicas:
            r.down = asyncio.Event()
            if not r.healthy:
                r.down.set()
        self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.client.aclose()

    # ----- proxying -------------------------------------------------------------------------------------------

    async def _attempt(self, replica: Replica, method: str, path: str, headers: dict[str, str], body: bytes,
                       stream: bool) -> tuple[Any, bytes]:
        """Send to `replica`; return (response, body) for a plain request or (open response, first chunk) for a
        stream. Raises ReplicaFailed when the replica fails or leaves rotation first."""
        import httpx

        request = self.client.build_request(method, replica.url + path, headers=headers, content=body)

        async def send() -> tuple[Any, bytes]:
            resp = await self.client.send(request, stream=True)
            try:
                if resp.status_code in RETRY_STATUSES:  # its body is logged; its status reaches the client
                    await resp.aread()
                    log.warning("replica %d answered %s %s with %d: %s", replica.index, method, path,
                                resp.status_code, resp.text[:500])
                    raise ReplicaFailed(f"answered {resp.status_code}", take_down=resp.status_code != 500)
                if not stream or not resp.headers.get("content-type", "").startswith("text/event-stream"):
                    data = await resp.aread()
                    await resp.aclose()
                    return resp, data
                first = b""
                chunks = resp.aiter_raw()
                async for chunk in chunks:
                    if chunk:
                        first = chunk
                        break
                resp.extensions["scratchlm_chunks"] = chunks
                return resp, first
            except BaseException:
                await resp.aclose()
                raise

        task = asyncio.create_task(send())
        down = asyncio.create_task(replica.down_event().wait())
        try:
            finished, _ = await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            down.cancel()
            raise
        if task not in finished:
            task.cancel()
            raise ReplicaFailed("it left rotation while the request waited")
        down.cancel()
        try:
            return task.result()
        except httpx.TransportError as e:  # the text (addresses, errno) goes to the log, not to the client
            log.warning("replica %d (%s): %s %s failed: %s: %s", replica.index, replica.url, method, path,
                        type(e).__name__, e)
            raise ReplicaFailed(f"{type(e).__name__} (connection failed or broken)") from e

    async def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Any:
        """Proxy one request; returns a Starlette response."""
        parsed: dict[str, Any] | None = None
        if method == "POST" and path.split("?", 1)[0] in GENERATION_PATHS:
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = None
            if not isinstance(parsed, dict):
                parsed = None
        stream = bool(parsed and parsed.get("stream"))
        cost = estimate_cost(parsed, self.config.default_max_tokens) if parsed else 0
        key = affinity_key(parsed, self.config.affinity_chars) if parsed else None
        fwd = {k: v for k, v in headers.items() if k.lower() not in _DROP_REQUEST_HEADERS}
        fwd["accept-encoding"] = "identity"
        tried: set[int] = set()
        last_429 = None
        failures: list[str] = []
        while True:
            replica = choose_replica(self.replicas, key, self.config.affinity_slack_tokens, exclude=tried)
            if replica is None:
                if last_429 is not None:
                    return last_429
                self.rejected_total += 1
                down = [r.index for r in self.replicas if not r.in_rotation]
                detail = "; ".join(failures) if failures else f"replicas out of rotation: {down}"
                return JSONResponse({"error": {
                    "message": f"No engine replica could take the request ({detail}).", "type": "service_unavailable",
                    "param": None, "code": None}}, status_code=503)
            tried.add(replica.index)
            replica.outstanding_tokens += cost
            replica.outstanding_requests += 1
            replica.requests_total += 1
            released = False

            def release(r: Replica = replica) -> None:
                nonlocal released
                if not released:
                    released = True
                    r.outstanding_tokens -= cost
                    r.outstanding_requests -= 1

            try:
                resp, data = await self._attempt(replica, method, path, fwd, body, stream)
            except ReplicaFailed as e:
                release()
                replica.failures_total += 1
                failures.append(f"replica {replica.index}: {e}")
                if e.take_down:
                    self.mark_down(replica, str(e))
                self.retries_total += 1
                log.warning("request %s %s failed on replica %d (%s); retrying on another", method, path,
                            replica.index, e)
                continue
            except BaseException:
                release()
                raise
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE_HEADERS}
            out_headers["x-scratchlm-replica"] = str(replica.index)
            if resp.status_code == 429:
                release()
                last_429 = Response(data, status_code=429, headers=out_headers)
                continue
            chunks = resp.extensions.get("scratchlm_chunks")
            if chunks is None:
                release()
                return Response(data, status_code=resp.status_code, headers=out_headers)
            return StreamingResponse(self._relay(replica, resp, data, chunks, release), status_code=resp.status_code,
                                     headers=out_headers)

    async def _relay(self, replica: Replica, resp: Any, first: bytes, chunks: AsyncIterator[bytes],
                     release: Any) -> AsyncIterator[bytes]:
        """The committed stream's bytes, relayed as they come; it ends with an error event when the replica's
        connection breaks, or as soon as the replica leaves rotation (a stopped replica sends nothing more)."""
        down = replica.down_event()
        queue: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue(maxsize=RELAY_QUEUE_CHUNKS)

        async def pump() -> None:  # reads the replica; the only task that touches `chunks`
            try:
                async for chunk in chunks:
                    await queue.put(chunk)
                await queue.put(None)
            except Exception as e:  # noqa: BLE001 - handed to the relay, which tells the client
                await queue.put(e)

        async def watch() -> None:  # the replica left rotation: stop reading it and tell the relay
            await down.wait()
            reader.cancel()
            await queue.put(ReplicaFailed("it left rotation mid-stream"))

        reader = asyncio.create_task(pump())
        watcher = asyncio.create_task(watch())
        try:
            if first:
                yield first
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    yield self._stream_failed(replica, item)
                    return
                yield item
        finally:
            release()  # first: the client may have stopped reading at `[DONE]` and counts on the slot being free
            for task in (watcher, reader):
                task.cancel()
            await asyncio.gather(watcher, reader, return_exceptions=True)
            await resp.aclose()

    def _stream_failed(self, replica: Replica, error: BaseException) -> bytes:
        """Count a stream cut by its replica, take the replica down, and return the client's error event (what
        happened in words; the exception's text goes to the log)."""
        self.streams_broken_total += 1
        replica.failures_total += 1
        if isinstance(error, ReplicaFailed):  # out of rotation: health checks failed or its process exited
            log.warning("replica %d left rotation (%s) with a stream in flight; ending it with an error event",
                        replica.index, replica.down_reason)
            what, code = "was taken out of rotation (failed health checks or exited)", "replica_unavailable"
        else:
            log.warning("replica %d broke a stream: %s: %s", replica.index, type(error).__name__, error)
            self.mark_down(replica, f"stream broken: {type(error).__name__}")
            what, code = f"failed mid-stream ({type(error).__name__})", "replica_failed"
        err = {"error": {"message": f"Engine replica {replica.index} {what}; the text so far is incomplete.",
                         "type": "service_unavailable", "param": None, "code": code}}
        return f"data: {json.dumps(err)}\n\n".encode()

    # ----- aggregate views ------------------------------------------------------------------------------------

    def health(self) -> tuple[int, dict[str, Any]]:
        """(status, body) of the router's /health: 200 while at least one replica is in rotation."""
        n = sum(r.in_rotation for r in self.replicas)
        body = {"status": "ok" if n else "unavailable", "replicas_in_rotation": n, "replicas": [
            {"index": r.index, "url": r.url, "pid": r.process.pid if r.process is not None else None,
             "healthy": r.healthy, "dead": r.dead, "outstanding_tokens": r.outstanding_tokens,
             "outstanding_requests": r.outstanding_requests, "requests_total": r.requests_total,
             "failures_total": r.failures_total} for r in self.replicas]}
        return (200 if n else 503), body

    async def metrics(self) -> str:
        """Replicas' metrics summed (KV-cache usage averaged) plus the router's own, in Prometheus text format."""
        from scratchlm.server.metrics import parse_prometheus

        async def fetch(r: Replica) -> str | None:
            if not r.in_rotation:
                return None
            try:
                resp = await self.client.get(r.url + "/metrics", timeout=self.config.health_timeout_s)
                return resp.text if resp.status_code == 200 else None
            except Exception:  # noqa: BLE001 - a replica that cannot answer is left out
                return None

        bodies = [b for b in await asyncio.gather(*(fetch(r) for r in self.replicas)) if b]
        meta: dict[str, list[str]] = {}
        sums: dict[str, float] = {}
        counts: dict[str, int] = {}
        for text in bodies:
            for line in text.splitlines():
                if line.startswith("# "):
                    name = line.split()[2]
                    lines = meta.setdefault(name, [])
                    if line not in lines:
                        lines.append(line)
            for k, v in parse_prometheus(text).items():
                sums[k] = sums.get(k, 0.0) + v
                counts[k] = counts.get(k, 0) + 1
        out: list[str] = []
        shown: set[str] = set()
        for k, v in sums.items():
            name = k.split("{", 1)[0]
            base = next((n for n in (name, name.rsplit("_", 1)[0]) if n in meta), None)
            if base is not None and base not in shown:
                shown.add(base)
                out.extend(meta[base])
            if name.endswith("kv_cache_usage_perc"):
                v = v / counts[k]
            out.append(f"{k} {_num(v)}")
        p = "scratchlm:router_"

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
            out.extend([f"# HELP {p}{name} {help_text}", f"# TYPE {p}{name} {kind}"])
            out.extend(f"{p}{name}{labels} {_num(v)}" for labels, v in samples)

        family("replicas_in_rotation", "gauge", "Replicas taking requests.",
               [("", sum(r.in_rotation for r in self.replicas))])
        family("replicas_total", "gauge", "Replicas configured.", [("", len(self.replicas))])
        per = [(r, f'{{replica="{r.index}"}}') for r in self.replicas]
        family("replica_in_rotation", "gauge", "1 while the replica takes requests.",
               [(lab, float(r.in_rotation)) for r, lab in per])
        family("replica_outstanding_tokens", "gauge", "Estimated tokens of the replica's in-flight requests.",
               [(lab, r.outstanding_tokens) for r, lab in per])
        family("replica_requests_total", "counter", "Requests sent to the replica (retries included).",
               [(lab, r.requests_total) for r, lab in per])
        family("replica_failures_total", "counter", "Requests that failed on the replica.",
               [(lab, r.failures_total) for r, lab in per])
        family("retries_total", "counter", "Requests retried on another replica.", [("", self.retries_total)])
        family("rejected_total", "counter", "Requests answered 503: no replica could take them.",
               [("", self.rejected_total)])
        family("streams_broken_total", "counter", "Streams cut by a replica failure after their first chunk.",
               [("", self.streams_broken_total)])
        return "\n".join(out) + "\n"


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def create_router_app(router: Router) -> Any:
    """The router's FastAPI app: /health and /metrics of its own; everything else proxied."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        router.start()
        try:
            yield
        finally:
            await router.close()

    app = FastAPI(title="scratchlm data-parallel router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.router = router

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = router.health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(await router.metrics(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD"])
    async def proxy(path: str, request: Request) -> Any:
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        body = await request.body()
        return await router.handle(request.method, target, dict(request.headers), body)

    return app


# ----- launching replicas -------------------------------------------------------------------------------------------


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that are free now (all held open while choosing, so they differ; another
    process may still take one before its server binds it: the usual small race)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def free_port(host: str = "127.0.0.1") -> int:
    """One TCP port that is free now (see `free_ports`)."""
    return free_ports(1, host)[0]


def replica_argv(args: argparse.Namespace) -> list[str]:
    """The `scratchlm serve` flags of one replica, rebuilt from the router's parsed flags: the model, the engine
    and server options the user typed, minus the router's own (host, port, data-parallel size, router-*)."""
    from scratchlm.inference import EngineConfig
    from scratchlm.server.config import ServerConfig

    argv: list[str] = [str(args.model)] if getattr(args, "model", None) is not None else []
    for cls in (ServerConfig, EngineConfig):
        for f in dataclasses.fields(cls):
            if f.name in ("host", "port") or not hasattr(args, f.name):
                continue
            value = getattr(args, f.name)
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag if value else "--no-" + f.name.replace("_", "-"))
            elif isinstance(value, (list, tuple)):
                argv += [flag, *map(str, value)]
            else:
                argv += [flag, "none" if value is None else str(value)]
    if getattr(args, "engine_process", False):
        argv.append("--engine-process")
    if getattr(args, "threads", None) is not None:
        argv += ["--threads", str(args.threads)]
    return argv


def _own_trace(argv: list[str], index: int) -> list[str]:
    """`--trace FILE` of replica i writes FILE with `.replica<i>` before its suffix (one trace per engine)."""
    out = list(argv)
    for j, a in enumerate(out[:-1]):
        if a == "--trace":
            p = Path(out[j + 1])
            out[j + 1] = str(p.with_name(f"{p.stem}.replica{index}{p.suffix}"))
    return out


def spawn_replica(cmd: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None
                  ) -> subprocess.Popen:
    """Start one replica process that dies with this one: between fork and exec it asks the kernel for SIGTERM when
    this process dies, and exits at once if this process is already gone (`scratchlm.lifecycle.die_with_parent`)."""
    from scratchlm.lifecycle import die_with_parent

    return subprocess.Popen(cmd, env=env, cwd=cwd, preexec_fn=functools.partial(die_with_parent, os.getpid()))


def launch_replicas(argv: list[str], count: int, config: RouterConfig, cwd: str | Path | None = None,
                    program: list[str] | None = None) -> list[Replica]:
    """Start `count` `scratchlm serve` processes on free local ports (or, with `config.replica_urls`, take those
    running servers) and wait until every one answers /health. Raises RuntimeError (after stopping the started
    ones) when one exits or does not come up in time. `program`: the command each replica runs before `argv`
    and its `--host/--port` (default: this Python's ``-m scratchlm serve``)."""
    replicas = [Replica(index=i, url=u.rstrip("/")) for i, u in enumerate(config.replica_urls or [])]
    env = dict(os.environ)
    ports = [] if replicas else free_ports(count)
    program = program or [sys.executable, "-m", "scratchlm", "serve"]
    try:
        for i, port in enumerate(ports):
            cmd = [*program, *_own_trace(argv, i), "--host", "127.0.0.1", "--port", str(port)]
            log.info("starting replica %d: %s", i, " ".join(cmd))
            replicas.append(Replica(index=i, url=f"http://127.0.0.1:{port}", process=spawn_replica(cmd, env, cwd)))
        _wait_ready(replicas, config.startup_timeout_s)
    except BaseException:
        stop_replicas(replicas, config.shutdown_timeout_s)
        raise
    return replicas


def _wait_ready(replicas: list[Replica], timeout_s: float) -> None:
    """Poll every replica's /health until each answers 200; RuntimeError when one exits or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    pending = list(replicas)
    while pending:
        for r in list(pending):
            if r.process is not None and r.process.poll() is not None:
                raise RuntimeError(f"replica {r.index} exited with code {r.process.returncode} during start-up "
                                   "(its log is above)")
            try:
                if httpx.get(r.url + "/health", timeout=2).status_code == 200:
                    pending.remove(r)
                    log.info("replica %d ready on %s", r.index, r.url)
            except httpx.HTTPError:
                pass
        if pending and time.monotonic() > deadline:
            raise RuntimeError(f"replicas {[r.index for r in pending]} did not answer /health within "
                               f"{timeout_s:g} s (--router-startup-timeout-s)")
        if pending:
            time.sleep(0.25)


def stop_replicas(replicas: list[Replica], timeout: float = 10.0) -> None:
    """Reap the replica processes this router started: SIGTERM each, wait at most `timeout` seconds in all, then
    SIGKILL (which also ends a stopped one) and wait for the ones still there. Returns when none is left."""
    procs = [(r.index, r.process) for r in replicas if r.process is not None and r.process.poll() is None]
    for _, p in procs:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    deadline = time.monotonic() + timeout
    for index, p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("replica %d (pid %d) still running %g s after SIGTERM: killing it", index, p.pid, timeout)
            p.kill()
            p.wait()
    if procs:
        log.info("stopped %d replica process(es)", len(procs))


class _Interrupted(BaseException):
    """SIGTERM or SIGINT arrived while the replicas were starting."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _ShutdownSignals:
    """SIGTERM and SIGINT for the router's whole life, so that the replicas are reaped before it ends.

    While the replicas start (`raising`), a signal raises `_Interrupted` (launch_replicas stops what it started).
    While uvicorn serves, its own handlers stop it; on the way out it restores these handlers and re-raises the
    signal it caught, which is then only remembered (`received`). `exit_by_signal` ends the process by the first
    signal remembered, with the default action (exit status 128 + signal number), as an unwrapped server would."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received: list[int] = []
        self.raising = True
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _ShutdownSignals:
        if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
            return self
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        self.received.append(signum)
        if self.raising:
            self.raising = False  # a second signal while unwinding is only remembered
            raise _Interrupted(signum)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def exit_by_signal(self) -> None:
        if self.received:
            sig = self.received[0]
            log.info("router stopped by %s; replicas reaped", signal.Signals(sig).name)
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)


def run_router(replicas: list[Replica], host: str, port: int, router_config: RouterConfig, log_level: str = "info",
               signals: _ShutdownSignals | None = None) -> int:
    """Serve the router over `replicas` on `host`:`port` until SIGTERM/SIGINT or until every replica
    process has died; then reap the replicas (`stop_replicas`). Returns 1 when every replica died, 0 on a normal
    stop; a stop by a signal ends the process by that signal once the replicas are reaped."""
    with contextlib.ExitStack() as stack:
        if signals is None:
            signals = stack.enter_context(_ShutdownSignals())
        signals.raising = False  # uvicorn handles them from here on; the finally below reaps the replicas
        try:
            exit_code = _serve_router(replicas, host, port, router_config, log_level)
        finally:
            stop_replicas(replicas, router_config.shutdown_timeout_s)
        signals.exit_by_signal()
    return exit_code


def _serve_router(replicas: list[Replica], host: str, port: int, router_config: RouterConfig, log_level: str) -> int:
    """uvicorn around the router app until it is stopped (1 when every replica process died, else 0)."""
    import uvicorn

    exit_code = 0
    server: uvicorn.Server | None = None

    def all_dead() -> None:
        nonlocal exit_code
        if exit_code == 0:
            log.error("every engine replica has exited; the router stops")
        exit_code = 1
        if server is not None:
            server.should_exit = True

    router = Router(replicas, router_config, on_all_dead=all_dead)
    log.info("data-parallel router for %d replicas on http://%s:%d (/health and /metrics aggregate them)",
             len(replicas), f"[{host}]" if ":" in host else host, port)
    server = uvicorn.Server(uvicorn.Config(create_router_app(router), host=host, port=port,
                                           log_level=log_level.lower(), timeout_graceful_shutdown=5))
    server.run()
    return exit_code


def serve_data_parallel(args: argparse.Namespace, data_parallel_size: int, server_config: Any,
                        router_config: RouterConfig) -> int:
    """`scratchlm serve --data-parallel-size D` (or `--router-replica-urls URL...`): launch D replicas (or take the
    given ones), serve the router on the configured host/port until interrupted (`run_router`); returns 1 when
    every replica process has died, 0 on a normal shutdown; ended by SIGTERM/SIGINT, it reaps the replicas first."""
    with _ShutdownSignals() as signals:
        replicas: list[Replica] = []
        try:
            replicas = launch_replicas(replica_argv(args), data_parallel_size, router_config)
            return run_router(replicas, server_config.host, server_config.port, router_config,
                              server_config.log_level, signals)
        except _Interrupted:  # while starting: launch_replicas stopped the ones it started
            stop_replicas(replicas, router_config.shutdown_timeout_s)
            signals.exit_by_signal()
            raise
