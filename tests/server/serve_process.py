"""`serve_process(*args)`: a real `scratchlm serve` subprocess on a free loopback port, up once `/health` answers."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ServeProcess:
    port: int
    url: str
    output: str = ""  # the process's stdout and stderr, filled when it has stopped


@contextmanager
def serve_process(*args: str, timeout: float = 120) -> Iterator[ServeProcess]:
    """Start `scratchlm serve ARGS --port P`, wait (at most `timeout` s) for a 200 from /health, yield it, stop it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ServeProcess(port, f"http://127.0.0.1:{port}")
    proc = subprocess.Popen([sys.executable, "-m", "scratchlm", "serve", *args, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail(f"scratchlm serve did not become healthy within {timeout:g} s")
        yield server
    finally:
        proc.terminate()
        server.output, _ = proc.communicate(timeout=30)
