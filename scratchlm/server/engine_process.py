"""The engine in its own process (as vLLM's engine core): the HTTP process keeps the GIL to itself.

With the engine in a thread of the HTTP process (:class:`EngineLoop`), the event loop's work (JSON,
SSE writes) and the engine's Python code (scheduling, the small torch ops of a small model) take
turns on one GIL. Here the engine runs in a child process (``spawn``) that owns it entirely:

    HTTP process                                       engine process
    handlers ── submit/abort ──► multiprocessing queue ──► add_request / abort_request, step()
    reader thread ◄── ("outputs", [RequestOutput], t, stats) ◄── one message per step

:class:`EngineProcessLoop` has the same interface as :class:`EngineLoop` (``start``, ``stop``,
``alive``, ``submit``, ``abort``, ``stats``), and an ``engine`` stand-in (tokenizer, configs, chat
template) for the handlers' validation, sent over by the child once the model is loaded.

Back-pressure on the child's side: request outputs, acceptances and stats are never dropped (the HTTP
process needs every one). The inspector's step events are *bounded*: at most ``events_in_flight`` of
them are in the outbox unread (a semaphore the child takes per event and the reader thread gives back per
event received); beyond that the child keeps the newest ``events_in_flight`` in a local ring and drops the
oldest, counting them (``outbox_dropped`` on every event it sends, shown by the inspector page). So a
stalled HTTP process costs the child a bounded amount of memory, never a blocked step.

Embeddings (``/v1/embeddings``) are a request kind of their own, off the generation path: ``("embed", id,
token_lists, pooling, normalize)`` is run by the child between two steps (``LLMEngine.embed``: one plain forward
per distinct length, no KV cache) and answered with ``("embedded", id, (vectors, error, error_kind))``.

Health and lifecycle (the policy is in server/health.py):

- the child's heartbeat thread sends ``("beat", {loop_age, step_running, steps, ranks}, None)`` every
  ``interval_s``, during steps too; the HTTP process notes when each arrived, so a stopped (SIGSTOP) child goes
  stale within ``heartbeat_timeout_s`` and is judged hung after ``step_timeout_s``: the requests in flight fail
  with ``EngineHungError``, the child is killed and ``failure_callbacks`` run (the server exits, code 4);
- a child that dies (or whose TP/PP rank died: it sends ``("fatal", message)`` and exits) fails the requests in
  flight and runs ``failure_callbacks`` (the server exits, code 3) instead of answering 503 forever;
- the child dies with the HTTP process (``lifecycle.die_with_parent``, SIGKILL: a stopped child dies too) and
  ignores SIGINT and SIGTERM, which a terminal or a supervisor also sends to it: the HTTP process stops it
  (``("stop",)``, then SIGKILL after the grace time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchlm.server.engine_loop import EngineDeadError, EngineHungError, RequestStream, TimedOutput, _put_all, settle
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


@dataclass
class EngineInfo:
    """What the HTTP process needs of the engine it does not own: the parts of the contract that are data."""

    tokenizer: Any
    model_config: Any
    config: Any
    max_model_len: int

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """As `LLMEngine.apply_chat_template` (``tools=...`` and the other `render_chat` keywords)."""
        from scratchlm.inference.chat_template import render_chat

        return render_chat(self.tokenizer, messages, add_generation_prompt, **kwargs)


EVENTS_IN_FLIGHT = 64  # inspector events unread in the outbox before the child holds them back


class EventOutbox:
    """The child's bounded sender of inspector events (see the module docstring).

    ``credits`` is a semaphore of ``limit`` (shared with the reader thread, which releases one per event it
    takes off the outbox); ``offer`` queues an event locally (a ring of ``limit``: the oldest is dropped and
    counted when it is full) and sends what the credits allow. ``flush`` sends more as credits come back."""

    def __init__(self, outbox: Any, credits: Any, limit: int):
        self.outbox, self.credits = outbox, credits
        self.pending: deque[dict] = deque()
        self.limit = limit
        self.dropped = 0  # events never sent (the oldest of a full ring)
        self.sent = 0

    def offer(self, event: dict) -> None:
        if len(self.pending) >= self.limit:
            self.pending.popleft()
            self.dropped += 1
        self.pending.append(event)
        self.flush()

    def flush(self) -> None:
        while self.pending and self.credits.acquire(False):
            event = self.pending.popleft()
            event["outbox_dropped"] = self.dropped
            self.outbox.put(("event", event, None))
            self.sent += 1

    def clear(self) -> None:
        self.pending.clear()


class _ChildStatus:
    """What the child's heartbeat thread reports: written by the main loop, read by the heartbeat thread."""

    def __init__(self) -> None:
        self.beat_at = monotonic()  # the main loop's last iteration
        self.step_started: float | None = None  # when the running step (or embed forward) began
        self.steps = 0


def _heartbeat(outbox: Any, status: _ChildStatus, engine: Any, interval_s: float, stop: threading.Event) -> None:
    """The child's heartbeat thread: one ``("beat", ...)`` every `interval_s` (ages, so no clock is shared)."""
    liveness = getattr(getattr(engine, "runner", None), "liveness", None)
    while not stop.wait(interval_s):
        ranks: dict[str, float] = {}
        if callable(liveness):
            with contextlib.suppress(Exception):  # informational: a failed runner is judged by its steps
                ranks = liveness()
        now, started = monotonic(), status.step_started
        beat = {"loop_age": now - status.beat_at, "step_running": None if started is None else now - started,
                "steps": status.steps, "ranks": ranks}
        try:
            outbox.put(("beat", beat, None))
        except (ValueError, OSError):  # the outbox is closed: the process is ending
            return


def _engine_main(model: str | None, engine_config: Any, threads: int | None, inbox: Any, outbox: Any,
                 idle_poll_s: float, credits: Any = None, events_in_flight: int = EVENTS_IN_FLIGHT,
                 parent_pid: int | None = None, heartbeat_s: float = 0.5) -> None:
    """The child process: load the engine, then drain requests and step until told to stop."""
    from scratchlm.lifecycle import die_with_parent

    if parent_pid is not None:
        die_with_parent(parent_pid, signal.SIGKILL)  # first thing: SIGKILL, so that even a stopped child dies
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C and a supervisor's SIGTERM reach the whole group:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the HTTP process stops this one (or it dies with it)
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    try:
        from scratchlm.inference import LLMEngine

        engine = LLMEngine.from_pretrained(model, engine_config)
        info = EngineInfo(engine.tokenizer, engine.model_config, engine.config,
                          int(getattr(engine, "max_model_len", None) or engine.config.max_model_len
                              or engine.model_config.max_seq_len))
        outbox.put(("ready", info, engine.stats()))
    except BaseException as e:  # reported to the parent, which raises it
        outbox.put(("error", f"{type(e).__name__}: {e}", None))
        return
    live: set[str] = set()
    watching: list = []  # the inspector's listener while it watches (server/inspector.py)
    events = EventOutbox(outbox, credits if credits is not None else threading.Semaphore(events_in_flight),
                         events_in_flight)
    status, beating = _ChildStatus(), threading.Event()
    threading.Thread(target=_heartbeat, args=(outbox, status, engine, heartbeat_s, beating), name="scratchlm-heartbeat",
                     daemon=True).start()
    fatal: list[str] = []  # a TP/PP rank died: the runner refuses every step, so this process ends
    runner = getattr(engine, "runner", None)
    if isinstance(getattr(runner, "failure_callbacks", None), list):
        runner.failure_callbacks.append(fatal.append)
    while True:
        status.beat_at = monotonic()
        if fatal:  # a rank died (between steps, or in the step below): the engine cannot step again
            beating.set()
            outbox.put(("fatal", fatal[0], None))
            return
        events.flush()  # credits the reader gave back since the last step
        busy = engine.has_unfinished_requests()
        messages = []
        try:
            messages.append(inbox.get(timeout=idle_poll_s) if not busy else inbox.get_nowait())
            while True:
                messages.append(inbox.get_nowait())
        except queue.Empty:
            pass
        for kind, *payload in messages:
            if kind == "stop":
                beating.set()
                for rid in list(live):
                    engine.abort_request(rid)
                outbox.put(("stopped", None, None))
                return
            if kind == "add":
                rid, prompt, params = payload
                try:
                    engine.add_request(rid, prompt, params)
                except Exception as e:
                    # (text, kind): only a ValueError is the request's fault (a 400); the parent raises anything
                    # else as a RuntimeError, which the server answers with its generic internal error
                    outbox.put(("accepted", rid, (str(e), "ValueError") if isinstance(e, ValueError)
                                else (f"{type(e).__name__}: {e}", None)))
                    continue
                live.add(rid)
                outbox.put(("accepted", rid, None))
            elif kind == "embed":  # a plain forward between steps (LLMEngine.embed); ValueError: a bad input
                eid, token_lists, pooling, normalize = payload
                status.step_started = monotonic()  # a forward like a step's: timed like one
                try:
                    outbox.put(("embedded", eid, (engine.embed(token_lists, pooling, normalize), None, None)))
                except Exception as e:  # sent back as its kind: ValueError (a bad input), NotImplementedError, other
                    kind_ = type(e).__name__ if isinstance(e, ValueError | NotImplementedError) else None
                    outbox.put(("embedded", eid, (None, str(e) if kind_ else f"{type(e).__name__}: {e}", kind_)))
                finally:
                    status.step_started = None
            elif kind == "inspect":
                _inspect(engine, events, payload[0], watching)
            elif kind == "abort" and payload[0] in live:
                live.discard(payload[0])
                engine.abort_request(payload[0])
                outbox.put(("stats", engine.stats(), None))
        if not engine.has_unfinished_requests():
            if busy:
                outbox.put(("stats", engine.stats(), None))
            continue
        status.step_started = monotonic()
        try:
            outputs = engine.step()
        except Exception as e:
            status.step_started = None
            log.exception("engine.step() failed")
            failed = sorted(live)
            for rid in failed:
                engine.abort_request(rid)
            live.clear()
            outbox.put(("failed", failed, f"{type(e).__name__}: {e}"))
            continue
        status.step_started = None
        status.steps += 1
        outputs = [o for o in outputs if o.request_id in live]
        for o in outputs:
            if o.finished:
                live.discard(o.request_id)
        outbox.put(("outputs", (outputs, time.monotonic()), engine.stats()))


def _inspect(engine: Any, events: EventOutbox, on: bool, watching: list) -> None:
    """Start or stop sending the engine's step events to the HTTP process (as dicts, for the inspector)."""
    while watching:
        engine.events.unsubscribe(watching.pop())
    events.clear()
    if on:
        watching.append(lambda event: events.offer(event.to_dict()))
        engine.events.subscribe(watching[0])


class EngineProcessLoop:
    """Runs the engine of `model` in a child process; same interface as :class:`EngineLoop`."""

    def __init__(self, model: str | Path | None, engine_config: Any, threads: int | None = None,
                 startup_timeout_s: float = 1800.0, idle_poll_s: float = 0.05,
                 events_in_flight: int = EVENTS_IN_FLIGHT, health: HealthConfig | None = None):
        if events_in_flight < 1:
            raise ValueError(f"events_in_flight must be >= 1, got {events_in_flight}")
        self.health_config = health or HealthConfig()
        ctx = mp.get_context("spawn")
        self._inbox = ctx.Queue()
        self._outbox = ctx.Queue()
        self._credits = ctx.Semaphore(events_in_flight)  # inspector events the child may have unread in the outbox
        self._proc = ctx.Process(target=_engine_main, name="scratchlm-engine",
                                 args=(None if model is None else str(model), engine_config, threads, self._inbox,
                                       self._outbox, idle_poll_s, self._credits, events_in_flight, os.getpid(),
                                       self.health_config.interval_s), daemon=True)
        self._proc.start()
        kind, payload, stats = self._get_ready(startup_timeout_s)
        if kind != "ready":
            self._proc.join(10)
            raise RuntimeError(f"the engine process failed to start: {payload}")
        self.engine: EngineInfo = payload
        self._stats = stats
        self._streams: dict[str, RequestStream] = {}
        self._embeds: dict[int, asyncio.Future] = {}  # embed calls awaiting the child's answer
        self._next_embed = 0
        self._lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._stopped = False
        self.steps = 0
        self.on_event: Any = None  # called in the reader thread with each step event (dict) while inspecting
        self.events_received = 0  # inspector events taken off the outbox
        self.events_dropped = 0  # the child's count of events it dropped for want of credits (latest seen)
        self.failure_callbacks: list[FailureCallback] = []  # (message, exit code) once the engine cannot go on
        self.failure: str | None = None  # why the engine cannot go on (hung, died, a rank died)
        self.failure_status = "failed"  # "hung" when it was given up for want of progress
        self._beat_at = monotonic()  # when the latest beat arrived (the child is ready: count from now)
        self._beat: dict = {}  # its content
        self._halt = threading.Event()  # stops the watchdog

    def _get_ready(self, timeout_s: float) -> tuple[str, Any, Any]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                return self._outbox.get(timeout=1.0)
            except queue.Empty:
                if not self._proc.is_alive():
                    return "error", f"the process exited with code {self._proc.exitcode}", None
        self._proc.kill()
        return "error", f"the model did not load within {timeout_s:.0f} s", None

    # ------------------------------------------------------------------ asyncio side

    def start(self) -> None:
        if self._reader is not None:
            return
        self._beat_at = monotonic()
        self._reader = threading.Thread(target=self._read, name="scratchlm-engine-reader", daemon=True)
        self._reader.start()
        threading.Thread(target=watch, name="scratchlm-watchdog", daemon=True,
                         args=(self._halt, self.health_config.interval_s, self._assess,
                               lambda message: self._fail(message, EXIT_ENGINE_HUNG, hung=True))).start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._halt.set()
        with contextlib.suppress(Exception):
            self._inbox.put(("stop",))
        self._proc.join(0 if self.failure else timeout)  # a hung child cannot answer: kill it at once
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        if self._reader is not None:
            self._reader.join(timeout)
        self._fail_all(EngineDeadError(self.failure or "the server is shutting down"))

    @property
    def alive(self) -> bool:
        return (self._proc.is_alive() and self._reader is not None and self._reader.is_alive()
                and self.failure is None)

    def health(self) -> HealthReport:
        """The engine's health now (server/health.py): the child's heartbeat, its loop's, its ranks', its step."""
        return self._assess()[0]

    def _assess(self) -> tuple[HealthReport, str | None]:
        since = monotonic() - self._beat_at  # how long ago the child last showed a sign of life
        beat = self._beat
        ages = {"engine process": since}
        running = beat.get("step_running")
        if running is None:  # as the child last saw them (a stopped child is the stale part, not its loop)
            ages["engine loop"] = beat.get("loop_age", 0.0)
        ages.update(beat.get("ranks", {}))
        failure = self.failure
        if failure is None and self._reader is not None and not self.alive and not self._stopped:
            failure = f"the engine process is not running (exit code {self._proc.exitcode})"
        return assess(self.health_config, ages, None if running is None else running + since,
                      int(beat.get("steps", self.steps)), failure, self.failure_status)

    def _fail(self, message: str, code: int, hung: bool) -> None:
        """The engine cannot go on: fail every request in flight, refuse new ones, tell `failure_callbacks`
        (the server then exits); a hung child is killed now (SIGKILL also ends a stopped one)."""
        if self.failure is not None or self._stopped:
            return
        self.failure, self.failure_status = message, "hung" if hung else "failed"
        log.critical("%s", message)
        if hung:
            self._proc.kill()
        self._fail_all((EngineHungError if hung else EngineDeadError)(message))
        for callback in list(self.failure_callbacks):
            try:
                callback(message, code)
            except Exception:
                log.exception("failure callback failed")

    def submit(self, request_id: str, prompt: str | list[int], params: Any) -> RequestStream:
        stream = RequestStream(request_id, asyncio.get_running_loop())
        with self._lock:
            self._streams[request_id] = stream
        self._inbox.put(("add", request_id, prompt, params))
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
        if known:
            self._inbox.put(("abort", request_id))

    def stats(self) -> Any | None:
        return self._stats

    async def embed(self, token_lists: list[list[int]], pooling: str, normalize: bool) -> list[list[float]]:
        """Pooled embeddings of `token_lists`, computed by the engine process between steps (``LLMEngine.embed``);
        raises ValueError for a bad input, NotImplementedError when the engine cannot, EngineDeadError when the
        process died."""
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._next_embed += 1
            eid = self._next_embed
            self._embeds[eid] = future
        self._inbox.put(("embed", eid, token_lists, pooling, normalize))
        try:
            return await future
        finally:
            with self._lock:
                self._embeds.pop(eid, None)

    def inspect(self, on: bool) -> None:
        """Ask the engine process to start (or stop) sending its step events to `on_event`."""
        with contextlib.suppress(Exception):
            self._inbox.put(("inspect", on))

    # ------------------------------------------------------------------ reader thread

    def _read(self) -> None:
        while True:
            try:
                kind, payload, extra = self._outbox.get(timeout=1.0)
            except queue.Empty:
                if not self._proc.is_alive():
                    self._died()
                    return
                continue
            except (EOFError, OSError):
                self._died()
                return
            if kind == "stopped":
                return
            if kind == "beat":
                self._beat, self._beat_at = payload, monotonic()
            elif kind == "fatal":  # a TP/PP rank of the child died: the child ends, the server must too
                self._fail(f"the engine process cannot continue: {payload}", EXIT_ENGINE_FAILED, hung=False)
            if kind == "event":
                self._credits.release()  # the child may send one more
                self.events_received += 1
                self.events_dropped = payload.get("outbox_dropped", 0)
                if self.on_event is not None:
                    self.on_event(payload)
            elif kind == "stats":
                self._stats = payload
            elif kind == "accepted":
                with self._lock:
                    stream = self._streams.get(payload) if extra is None else self._streams.pop(payload, None)
                if stream is not None:
                    error = None if extra is None else (ValueError if extra[1] == "ValueError" else RuntimeError)(
                        extra[0])
                    with contextlib.suppress(RuntimeError):
                        stream.loop.call_soon_threadsafe(stream._accept, error)
            elif kind == "embedded":
                vectors, error, error_kind = extra
                with self._lock:
                    future = self._embeds.pop(payload, None)
                if future is not None:
                    kinds = {"ValueError": ValueError, "NotImplementedError": NotImplementedError}
                    exc = None if error is None else kinds.get(error_kind, RuntimeError)(error)
                    with contextlib.suppress(RuntimeError):
                        future.get_loop().call_soon_threadsafe(settle, future, vectors, exc)
            elif kind == "outputs":
                outputs, at = payload
                self._stats = extra
                self.steps += 1
                by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, TimedOutput]]] = {}
                with self._lock:
                    for out in outputs:
                        stream = self._streams.get(out.request_id)
                        if stream is None:
                            continue
                        if out.finished:
                            del self._streams[out.request_id]
                        by_loop.setdefault(stream.loop, []).append((stream, TimedOutput(out, at)))
                for loop, items in by_loop.items():
                    with contextlib.suppress(RuntimeError):
                        loop.call_soon_threadsafe(_put_all, items)
            elif kind == "failed":
                error = EngineDeadError(f"the engine failed while running this request: {extra}")
                with self._lock:
                    streams = [self._streams.pop(rid) for rid in payload if rid in self._streams]
                for stream in streams:
                    with contextlib.suppress(RuntimeError):
                        stream.loop.call_soon_threadsafe(stream._put, error)

    def _died(self) -> None:
        """The child is gone (or its pipe broke): unless the server stopped it, fail everything and exit."""
        if self._stopped or self.failure is not None:
            self._fail_all(EngineDeadError(self.failure or "the engine process died"))
            return
        self._proc.join(1.0)
        self._fail(f"the engine process died (exit code {self._proc.exitcode}); the server exits so that a "
                   "supervisor can restart it", EXIT_ENGINE_FAILED, hung=False)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams = list(self._streams.values())
            self._streams.clear()
            embeds = list(self._embeds.values())
            self._embeds.clear()
        for future in embeds:
            with contextlib.suppress(RuntimeError):
                future.get_loop().call_soon_threadsafe(settle, future, None, error)
        for stream in streams:
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream._put, error)
