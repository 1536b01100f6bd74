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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scratchlm.server.engine_loop import EngineDeadError, RequestStream, TimedOutput, _put_all, settle

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


def _engine_main(model: str | None, engine_config: Any, threads: int | None, inbox: Any, outbox: Any,
                 idle_poll_s: float, credits: Any = None, events_in_flight: int = EVENTS_IN_FLIGHT) -> None:
    """The child process: load the engine, then drain requests and step until told to stop."""
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
    while True:
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
                for rid in list(live):
                    engine.abort_request(rid)
                outbox.put(("stopped", None, None))
                return
            if kind == "add":
                rid, prompt, params = payload
                try:
                    engine.add_request(rid, prompt, params)
                except Exception as e:
                    outbox.put(("accepted", rid, f"{type(e).__name__}: {e}" if not isinstance(e, ValueError)
                                else str(e)))
                    continue
                live.add(rid)
                outbox.put(("accepted", rid, None))
            elif kind == "embed":  # a plain forward between steps (LLMEngine.embed); ValueError: a bad input
                eid, token_lists, pooling, normalize = payload
                try:
                    outbox.put(("embedded", eid, (engine.embed(token_lists, pooling, normalize), None, None)))
                except Exception as e:  # sent back as its kind: ValueError (a bad input), NotImplementedError, other
                    kind_ = type(e).__name__ if isinstance(e, ValueError | NotImplementedError) else None
                    outbox.put(("embedded", eid, (None, str(e) if kind_ else f"{type(e).__name__}: {e}", kind_)))
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
        try:
            outputs = engine.step()
        except Exception as e:
            log.exception("engine.step() failed")
            failed = sorted(live)
            for rid in failed:
                engine.abort_request(rid)
            live.clear()
            outbox.put(("failed", failed, f"{type(e).__name__}: {e}"))
            continue
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
                 events_in_flight: int = EVENTS_IN_FLIGHT):
        if events_in_flight < 1:
            raise ValueError(f"events_in_flight must be >= 1, got {events_in_flight}")
        ctx = mp.get_context("spawn")
        self._inbox = ctx.Queue()
        self._outbox = ctx.Queue()
        self._credits = ctx.Semaphore(events_in_flight)  # inspector events the child may have unread in the outbox
        self._proc = ctx.Process(target=_engine_main, name="scratchlm-engine",
                                 args=(None if model is None else str(model), engine_config, threads, self._inbox,
                                       self._outbox, idle_poll_s, self._credits, events_in_flight), daemon=True)
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
        self._reader = threading.Thread(target=self._read, name="scratchlm-engine-reader", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 10.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        with contextlib.suppress(Exception):
            self._inbox.put(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()
        if self._reader is not None:
            self._reader.join(timeout)
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def alive(self) -> bool:
        return self._proc.is_alive() and self._reader is not None and self._reader.is_alive()

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
                    log.error("the engine process died (exit code %s)", self._proc.exitcode)
                    self._fail_all(EngineDeadError("the engine process died"))
                    return
                continue
            except (EOFError, OSError):
                return
            if kind == "stopped":
                return
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
                    error = None if extra is None else ValueError(extra)
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
