"""`BackgroundServer`: run an app under uvicorn in a daemon thread, on a free loopback port."""

from __future__ import annotations

import threading
import time
from typing import Any


class BackgroundServer:
    """``with BackgroundServer(app) as srv: httpx.get(srv.url + "/health")``.

    Binds ``host`` on ``port`` (0 = a free port chosen by the OS); ``start`` waits, bounded by
    ``start_timeout_s``, until uvicorn listens and the app's lifespan (the engine loop) has started.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 start_timeout_s: float = 60.0):
        import uvicorn

        self.host = host
        self.start_timeout_s = start_timeout_s
        from scratchlm.server.http import uvicorn_options

        state = getattr(getattr(app, "state", None), "server", None)
        options = uvicorn_options(state.config) if state is not None else {}  # a scratchlm app: its limits
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                                    timeout_graceful_shutdown=3, **options))
        self.thread: threading.Thread | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self.thread = threading.Thread(target=self.server.run, name="scratchlm-uvicorn", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server thread exited during start-up (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server did not start within {self.start_timeout_s:.0f} s")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout_s)
            self.thread = None

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
