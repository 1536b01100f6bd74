"""The live engine inspector: ``GET /inspector`` (a page) fed by ``GET /inspector/events`` (server-sent events).

Every engine step's :class:`scratchlm.inference.events.StepEvent` (batch composition, KV block pool map and
block tables, prefix-cache hits, preemptions, aborts, stage times, speculative counts) goes to the page as
one SSE message ``data: {json}``. ``GET /inspector/snapshot`` returns the latest event and ``engine.stats()``
as JSON (for scripts and tests).

Policy:

- **Nothing runs while nobody watches.** The hub subscribes to the engine's event stream when the first
  client connects and unsubscribes when the last one leaves, so an unwatched server pays nothing (events.py).
  ``/inspector/snapshot`` alone does not subscribe: it answers with the latest event seen, if any.
- **The engine never waits for a viewer.** The engine thread (or, with ``--engine-process``, the reader
  thread that receives the child's events) turns the event into a dict and hands it to the event loop with
  one ``call_soon_threadsafe``; each client has a bounded queue (``QUEUE_SIZE`` events), and when a client
  is slower than the engine its oldest queued events are dropped and counted (the page shows the count).
- **Across the process boundary** (``--engine-process``): the hub asks the engine process to start or stop
  sending events (``EngineProcessLoop.inspect(on)``); the child then puts ``event.to_dict()`` on its outbox,
  and the reader thread publishes it here.
- **Auth:** with ``--api-key``, ``/inspector/events`` and ``/inspector/snapshot`` need
  ``Authorization: Bearer KEY`` by the API's own rule (server/auth.py: the scheme in any case). The page itself
  holds no data and is served to anyone; it asks for the key (or takes it from the URL fragment,
  ``/inspector#key=KEY``, which browsers never send to the server) and reads the stream with ``fetch`` and that
  header. There is no query-string token: a key in a URL ends up in access logs and browser history.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from scratchlm.server.auth import authorization_ok

log = logging.getLogger("scratchlm.server")

STATIC = Path(__file__).resolve().parent / "static" / "inspector.html"
QUEUE_SIZE = 256  # events queued per client before its oldest are dropped
KEEPALIVE_S = 2.0  # with nothing to send, the counters go out anyway (keeps the page's check current)


class _Client:
    """One SSE consumer on the event loop: a bounded deque and a wake-up event."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: deque[dict] = deque()
        self.ready = asyncio.Event()
        self.dropped = 0
        self.sent = 0

    def offer(self, item: dict) -> None:  # on the event loop
        if len(self.items) >= QUEUE_SIZE:
            self.items.popleft()
            self.dropped += 1
        self.items.append(item)
        self.ready.set()


class InspectorHub:
    """Fans the engine's step events out to SSE clients (see the module docstring)."""

    def __init__(self, engine_loop: Any):
        self.engine_loop = engine_loop
        self._clients: set[_Client] = set()
        self._lock = threading.Lock()
        self.latest: dict | None = None
        self.published = 0
        self._subscribed = False

    # --- the event source ------------------------------------------------------------------------
    def _source(self) -> Any:
        """The engine's EventStream when it lives in this process, else None."""
        events = getattr(getattr(self.engine_loop, "engine", None), "events", None)
        return events if hasattr(events, "subscribe") else None

    @property
    def available(self) -> bool:
        return self._source() is not None or hasattr(self.engine_loop, "inspect")

    def _set_watching(self, on: bool) -> None:
        if on == self._subscribed:
            return
        self._subscribed = on
        source = self._source()
        if source is not None:
            (source.subscribe if on else source.unsubscribe)(self._on_event)
        elif hasattr(self.engine_loop, "inspect"):  # the engine runs in a child process
            self.engine_loop.on_event = self.publish
            self.engine_loop.inspect(on)

    def _on_event(self, event: Any) -> None:  # the engine thread
        self.publish(event.to_dict())

    def publish(self, item: dict) -> None:
        """Hand one event (a dict) to every client; called from the engine or reader thread, never blocks."""
        self.latest = item
        self.published += 1
        with self._lock:
            by_loop: dict[asyncio.AbstractEventLoop, list[_Client]] = {}
            for c in self._clients:
                by_loop.setdefault(c.loop, []).append(c)
        for loop, clients in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the loop closed
                loop.call_soon_threadsafe(_offer_all, clients, item)

    # --- clients (event loop) ----------------------------------------------------------------------
    def add(self) -> _Client:
        client = _Client(asyncio.get_running_loop())
        with self._lock:
            self._clients.add(client)
            first = len(self._clients) == 1
        if first:
            self._set_watching(True)
        return client

    def remove(self, client: _Client) -> None:
        with self._lock:
            self._clients.discard(client)
            last = not self._clients
        if last:
            self._set_watching(False)

    @property
    def num_clients(self) -> int:
        return len(self._clients)


def _offer_all(clients: list[_Client], item: dict) -> None:
    for c in clients:
        c.offer(item)


def _authorized(request: Request, api_key: str | None) -> bool:
    """The API's rule (server/auth.py), so a key the API accepts opens the inspector too."""
    return api_key is None or authorization_ok(request.headers.get("authorization"), api_key)


def _unauthorized() -> JSONResponse:
    return JSONResponse({"error": {"message": "Invalid or missing API key: send the header `Authorization: Bearer "
                                              "KEY` (the inspector page asks for it, or takes /inspector#key=KEY).",
                                   "type": "authentication_error", "param": None, "code": "invalid_api_key"}},
                        status_code=401)


def _stats_dict(stats: Any) -> dict | None:
    if stats is None:
        return None
    return dict(vars(stats)) if hasattr(stats, "__dict__") else None


def router(state: Any) -> APIRouter:
    """The inspector's routes for the server state `state` (``app.state.server``)."""
    hub = InspectorHub(state.loop)
    api = APIRouter()
    api_key = state.config.api_key

    @api.get("/inspector", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(STATIC.read_text(encoding="utf-8"))

    @api.get("/inspector/snapshot", summary="the latest engine step event and the engine's counters (JSON)")
    async def snapshot(request: Request) -> Response:
        if not _authorized(request, api_key):
            return _unauthorized()
        return JSONResponse({"model": state.model_name, "event": hub.latest, "stats": _stats_dict(state.loop.stats()),
                             "clients": hub.num_clients, "published": hub.published, "available": hub.available})

    @api.get("/inspector/events", summary="the engine's step events as server-sent events (one JSON per step)")
    async def events(request: Request) -> Response:
        if not _authorized(request, api_key):
            return _unauthorized()
        if not hub.available:
            return JSONResponse({"error": {"message": "this engine publishes no step events", "type": "not_found",
                                           "param": None, "code": None}}, status_code=404)
        client = hub.add()

        async def stream() -> AsyncIterator[bytes]:
            try:
                hello = {"type": "hello", "model": state.model_name, "stats": _stats_dict(state.loop.stats()),
                         "event": hub.latest}
                yield _sse(hello)
                while True:
                    try:
                        await asyncio.wait_for(client.ready.wait(), timeout=KEEPALIVE_S)
                    except TimeoutError:
                        yield _sse({"type": "stats", "stats": _stats_dict(state.loop.stats())})
                        continue
                    client.ready.clear()
                    batch = list(client.items)
                    client.items.clear()
                    for item in batch:
                        client.sent += 1
                        yield _sse({"type": "step", "dropped": client.dropped, **item})
                    # after each batch, the counters of engine.stats() (what /metrics shows), for the page's check
                    yield _sse({"type": "stats", "stats": _stats_dict(state.loop.stats())})
            finally:
                hub.remove(client)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    api.hub = hub  # type: ignore[attr-defined]  # for tests and benchmarks
    return api


def _sse(payload: dict) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


def install(app: FastAPI, state: Any) -> InspectorHub:
    """Add the inspector's routes to `app`; returns its hub (also on ``app.state.inspector``)."""
    api = router(state)
    app.include_router(api)
    app.state.inspector = api.hub  # type: ignore[attr-defined]
    return api.hub  # type: ignore[attr-defined]
