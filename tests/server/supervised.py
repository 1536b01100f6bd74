"""A real `scratchlm serve` subprocess seen as a supervisor sees it: its pid, its children, its exit status.

`served(*flags)` starts stories260K on a free loopback port (output to a file, so a stopped pipe never blocks
it), waits (bounded) for `/health` 200 and yields a :class:`Served`; on the way out it kills whatever is
left of the process tree, so a failing test leaves no orphan behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import REPO_ROOT, shared_data_path

STORIES = shared_data_path() / "models/stories260K/stories260K.bin"


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (a zombie is dead, waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def children(pid: int) -> list[int]:
    """The direct children of `pid` (Linux /proc)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, poll_s: float = 0.05) -> float:
    """Poll `predicate` until it is true; fail naming `what` after `timeout_s`. Returns the seconds it took."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(poll_s)
    return time.monotonic() - t0


@dataclass
class Served:
    proc: subprocess.Popen
    url: str
    log: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def engine_process(self) -> int:
        """The pid of the `--engine-process` child (not multiprocessing's resource tracker)."""
        pids = [c for c in children(self.pid) if "spawn_main" in cmdline(c)]
        assert len(pids) == 1, [(c, cmdline(c)) for c in children(self.pid)]
        return pids[0]

    def ranks(self, parent: int | None = None) -> list[int]:
        """The pids of the TP/PP ranks spawned by `parent` (default: the server)."""
        return [c for c in children(parent or self.pid) if "scratchlm.parallel.worker" in cmdline(c)]

    def health(self) -> httpx.Response:
        return httpx.get(self.url + "/health", timeout=5)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server did not exit within {timeout_s:g} s; its output:\n{self.output()[-3000:]}")


def _tree(pid: int) -> list[int]:
    out = [pid]
    for c in children(pid):
        out += _tree(c)
    return out


@contextmanager
def served(tmp_path: Path, *flags: str, timeout_s: float = 180, model: Path = STORIES) -> Iterator[Served]:
    """`scratchlm serve MODEL --threads 1 FLAGS` (default: stories260K) on a free port, up once /health is 200."""
    if not model.is_file():
        pytest.skip(f"model not found at {model}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / f"serve-{port}.log"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1",
           "SCRATCHLM_QUANT_NO_EXTENSION": "1"}  # lifecycles, not kernels: no JIT build in these tests
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "scratchlm", "serve", str(model), "--threads", "1",
                                 "--port", str(port), *flags], stdout=out, stderr=subprocess.STDOUT, env=env,
                                cwd=REPO_ROOT)
    server = Served(proc, f"http://127.0.0.1:{port}", log)
    tree: list[int] = [proc.pid]
    try:
        def up() -> bool:
            assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{server.output()[-3000:]}"
            try:
                return server.health().status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout_s, "scratchlm serve answering /health 200", poll_s=0.2)
        tree = _tree(proc.pid)
        yield server
    finally:
        for pid in {*tree, *_tree(proc.pid)}:  # whatever is left of ours, stopped ones too
            if alive(pid) and ("scratchlm" in cmdline(pid) or "multiprocessing" in cmdline(pid)):
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=30)
