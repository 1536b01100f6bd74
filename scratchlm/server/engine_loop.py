"""One background thread that owns the engine; asyncio handlers talk to it through queues.

``LLMEngine`` is not thread-safe, so exactly one thread calls it: it takes new requests and aborts
from a thread-safe inbox between steps, runs ``engine.step()`` while anything is unfinished (that is
continuous batching: requests from every connection join the running batch at the next step), and
hands each ``RequestOutput`` back to the event loop with ``loop.call_soon_threadsafe``.

Handlers see a request as a :class:`RequestStream`: ``await stream.accepted`` (raises what
``add_request`` raised: a bad prompt, a prompt too long), then ``async for out in stream``.

Health (the policy is in server/health.py): the loop beats on every iteration (also while it waits for
work), times each step, and asks the engine's runner for its ranks' heartbeats (``runner.liveness()``, when
the runner has ranks); a watchdog thread judges them every ``interval_s``. A hung engine (a step past
``step_timeout_s``, a rank silent that long) fails the requests in flight with :class:`EngineHungError` and
calls ``failure_callbacks`` (the server exits); so does a runner that reports a dead rank.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from scratchlm.server.health import (
    EXIT_ENGINE_FAILED,
    EXIT_ENGINE_HUNG,
    FailureCallback,
    HealthConfig,
    HealthReport,
    assess,
    monotonic,
    watch,
)

log = logging.getLogger("scratchlm.server")


class EngineDeadError(RuntimeError):
    """The engine raised inside step(); the requests that were in flight are failed with this."""


class EngineHungError(EngineDeadError):
    """The engine made no progress within the bound (a stuck step, or a part without heartbeat): the requests in
    flight fail with this, and the server exits with `EXIT_ENGINE_HUNG` (server/health.py)."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request (sampling, detokenizing or stop checking it raised); the others go on.
    It arrives as a finished RequestOutput whose ``error`` is set, and is raised to that request's handler."""


@dataclass
class TimedOutput:
    """A RequestOutput with the monotonic time at which the engine produced it."""

    output: Any
    time: float


class RequestStream:
    """Outputs of one engine request, delivered on the event loop."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.accepted: asyncio.Future[None] = loop.create_future()
        self._items: asyncio.Queue[TimedOutput | BaseException] = asyncio.Queue()
        self.finished = False
        self.arrival = time.monotonic()
        self.on_done: Callable[[], None] | None = None  # called once: finished, failed or released
        self._closed = False

    def close(self) -> None:
        """Mark the request over (idempotent); runs `on_done` once, even if nobody reads the stream."""
        if not self._closed:
            self._closed = True
            if self.on_done is not None:
                self.on_done()

    # Called on the event loop (scheduled from the engine thread).
    def _accept(self, error: BaseException | None) -> None:
        if self.accepted.done():
            return
        if error is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(error)

    def _put(self, item: TimedOutput | BaseException) -> None:
        if isinstance(item, TimedOutput) and getattr(item.output, "error", None):
            item = RequestFailedError(item.output.error)
        if isinstance(item, BaseException) and not self.accepted.done():
            self.accepted.set_exception(item)  # failed before the engine answered (it died, or shut down)
        self._items.put_nowait(item)
        if isinstance(item, BaseException) or item.output.finished:
            self.close()

    def __aiter__(self) -> AsyncIterator[TimedOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TimedOutput]:
        while not self.finished:
            item = await self._items.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.output.finished:
                self.finished = True
            yield item


def settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    """Resolve `future` (on its event loop) unless its awaiter gave up."""
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _put_all(items: list[tuple[RequestStream, TimedOutput]]) -> None:
    for stream, item in items:
        stream._put(item)


class EngineLoop:
    """Runs `engine` in a daemon thread; every method except the thread's own is called from asyncio."""

    def __init__(self, engine: Any, idle_poll_s: float = 0.05, health: HealthConfig | None = None):
        self.engine = engine
        self.idle_poll_s = idle_poll_s
        self.health_config = health or HealthConfig()
        self.failure_callbacks: list[FailureCallback] = []  # (message, exit code) once the engine cannot go on
        self.failure: str | None = None  # why the engine cannot go on (hung, or a rank died)
        self.failure_status = "failed"  # "hung" when it was given up for want of progress
        self._beat_at = monotonic()  # the loop's last iteration
        self._step_started: float | None = None  # when the running step began (None between steps)
        self._watchdog: threading.Thread | None = None
        runner = getattr(engine, "runner", None)
        if isinstance(getattr(runner, "failure_callbacks", None), list):  # TP/PP: a dead or hung rank
            runner.failure_callbacks.append(lambda message: self._fail(message, EXIT_ENGINE_FAILED, hung=False))
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._stats: Any | None = None
        self._stats_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.steps = 0
        self.step_seconds = 0.0  # time spent inside engine.step(), for the busy fraction
        self.last_error: str | None = None

    # ------------------------------------------------------------------ asyncio side

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._refresh_stats()
        self._beat_at = monotonic()
        self._thread = threading.Thread(target=self._run, name="scratchlm-engine", daemon=True)
        self._thread.start()
        self._watchdog = threading.Thread(target=self._watch, name="scratchlm-watchdog", daemon=True)
        self._watchdog.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._inbox.put(("wake", None))
        self._thread.join(0.5 if self.failure else timeout)  # a hung step never returns: do not wait for it
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failure is None

    def health(self) -> HealthReport:
        """The engine's health now (server/health.py): the loop's and the ranks' heartbeats, the step's clock."""
        return self._assess()[0]

    def _assess(self) -> tuple[HealthReport, str | None]:
        now = monotonic()
        started = self._step_started
        ages: dict[str, float] = {} if started is not None else {"engine loop": now - self._beat_at}
        liveness = getattr(getattr(self.engine, "runner", None), "liveness", None)
        if callable(liveness):
            try:
                ages.update(liveness())
            except Exception:  # informational: a runner that cannot say is judged by its steps
                log.exception("runner.liveness() failed")
        failure = self.failure or (None if self.alive or self._thread is None else "the engine loop stopped")
        return assess(self.health_config, ages, None if started is None else now - started, self.steps, failure,
                      self.failure_status)

    def _watch(self) -> None:
        """The watchdog thread: a hung engine fails its requests and calls `failure_callbacks` (server/health.py)."""
        watch(self._stop, self.health_config.interval_s, self._assess,
              lambda message: self._fail(message, EXIT_ENGINE_HUNG, hung=True))

    def _fail(self, message: str, code: int, hung: bool) -> None:
        """The engine cannot go on: fail every request in flight, refuse new ones, tell `failure_callbacks`."""
        if self.failure is not None:
            return
        self.failure, self.failure_status = message, "hung" if hung else "failed"
        log.critical("%s", message)
        abandon = getattr(getattr(self.engine, "runner", None), "abandon", None)
        if hung and callable(abandon):  # do not wait on hung ranks when stopping them
            abandon(message)
        error = (EngineHungError if hung else EngineDeadError)(message)
        for stream in list(self._streams.values()):  # the engine thread may be stuck: deliver from here
            self._deliver(stream, error)
        for callback in list(self.failure_callbacks):
            try:
                callback(message, code)
            except Exception:
                log.exception("failure callback failed")

    def submit(self, request_id: str, prompt: str | list[int], params: Any) -> RequestStream:
        """Queue a request for the engine; the returned stream yields its outputs."""
        stream = RequestStream(request_id, asyncio.get_running_loop())
        self._inbox.put(("add", (stream, prompt, params)))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op when it already finished); its blocks are freed at the next step."""
        self._inbox.put(("abort", request_id))

    async def embed(self, token_lists: list[list[int]], pooling: str, normalize: bool) -> list[list[float]]:
        """Pooled embeddings of `token_lists` (``LLMEngine.embed``), computed in the engine thread between steps;
        raises what it raised (ValueError: a bad input; NotImplementedError: this engine cannot)."""
        future = asyncio.get_running_loop().create_future()
        self._inbox.put(("embed", (future, token_lists, pooling, normalize)))
        return await future

    def stats(self) -> Any | None:
        """The EngineStats snapshot taken after the latest step (or when the engine went idle)."""
        with self._stats_lock:
            return self._stats

    # ------------------------------------------------------------------ engine thread

    def _refresh_stats(self) -> None:
        try:
            stats = self.engine.stats()
        except Exception:  # stats are informational; never let them kill the loop
            log.exception("engine.stats() failed")
            return
        with self._stats_lock:
            self._stats = stats

    def _deliver(self, stream: RequestStream, item: TimedOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):  # a closed event loop: nobody listens any more
            stream.loop.call_soon_threadsafe(stream._put, item)

    def _deliver_batch(self, batch: list[tuple[RequestStream, TimedOutput]]) -> None:
        """One wake-up of the event loop per step and loop, not one per request."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, TimedOutput]]] = {}
        for stream, item in batch:
            by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody listens any more
                loop.call_soon_threadsafe(_put_all, items)

    def _handle(self, kind: str, payload: Any) -> None:
        if kind == "add":
            stream, prompt, params = payload
            try:
                self.engine.add_request(stream.request_id, prompt, params)
            except Exception as e:  # a bad request must never take the loop down
                stream.loop.call_soon_threadsafe(stream._accept, e)
                return
            self._streams[stream.request_id] = stream
            stream.loop.call_soon_threadsafe(stream._accept, None)
        elif kind == "embed":
            future, token_lists, pooling, normalize = payload
            self._step_started = monotonic()  # a forward like a step's: timed like one
            try:
                if not hasattr(self.engine, "embed"):
                    raise NotImplementedError(f"this engine ({type(self.engine).__name__}) does not compute embeddings")
                result, error = self.engine.embed(token_lists, pooling, normalize), None
            except Exception as e:  # a bad input must never take the loop down
                result, error = None, e
            finally:
                self._step_started = None
            with contextlib.suppress(RuntimeError):
                future.get_loop().call_soon_threadsafe(settle, future, result, error)
        elif kind == "abort":
            stream = self._streams.pop(payload, None)
            if stream is not None:
                try:
                    self.engine.abort_request(payload)
                except Exception:
                    log.exception("abort_request(%s) failed", payload)

    def _drain(self, block: bool) -> None:
        try:
            kind, payload = self._inbox.get(timeout=self.idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._handle(kind, payload)
        while True:
            try:
                kind, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._handle(kind, payload)

    def _run(self) -> None:
        log.info("engine loop started")
        was_busy = False
        while not self._stop.is_set() and self.failure is None:
            self._beat_at = monotonic()
            busy = self.engine.has_unfinished_requests()
            if not busy and was_busy:
                self._refresh_stats()  # the idle state (empty KV pool) is visible in /metrics
            was_busy = busy
            self._drain(block=not busy)
            if not self.engine.has_unfinished_requests():
                continue
            t0 = time.perf_counter()
            self._step_started = monotonic()
            try:
                outputs = self.engine.step()
            except Exception as e:
                self._step_started = None
                log.exception("engine.step() failed; failing the %d requests in flight", len(self._streams))
                self.last_error = f"{type(e).__name__}: {e}"
                self._fail_all(EngineDeadError(f"the engine failed while running this request: {self.last_error}"))
                continue
            self._step_started = None
            now = time.monotonic()
            self.steps += 1
            self.step_seconds += time.perf_counter() - t0
            batch: list[tuple[RequestStream, TimedOutput]] = []
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                batch.append((stream, TimedOutput(out, now)))
            self._deliver_batch(batch)
            self._refresh_stats()
        self._fail_all(EngineDeadError(self.failure or "the server is shutting down"))
        log.info("engine loop stopped")

    def _fail_all(self, error: BaseException) -> None:
        for request_id, stream in list(self._streams.items()):
            try:
                self.engine.abort_request(request_id)
            except Exception:
                log.exception("abort_request(%s) failed", request_id)
            self._deliver(stream, error)
        self._streams.clear()
