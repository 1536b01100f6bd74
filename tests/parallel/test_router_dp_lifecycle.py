"""The router's lifecycle on real `scratchlm serve --data-parallel-size 2` processes (stories260K): the slow twin of
tests/parallel/test_router_lifecycle.py, which runs the same checks on stand-in replicas in the default suite.

- a replica stopped (SIGSTOP) under a committed stream: the client's stream ends with an error event within
  the detection bound (health every 0.25 s, 1 s timeout, out after 2 failures: 2.75 s) plus a margin;
- SIGTERM to the router: every replica (a stopped one included) is gone when the router has exited;
- SIGKILL to the router: the replicas die with it within a bound.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.parallel.test_router_lifecycle import MARGIN_S, cleanup, wait_gone, wait_health
from tests.server.supervised import alive

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")]
REPO = Path(__file__).resolve().parents[2]
DETECTION_BOUND_S = 0.25 + 2 * (0.25 + 1.0)


def start_dp(model: Path, log_path: Path) -> tuple[subprocess.Popen, str]:
    from scratchlm.parallel.router import free_port

    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", SCRATCHLM_QUANT_NO_EXTENSION="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "scratchlm", "serve", str(model), "--data-parallel-size", "2", "--port", str(port),
             "--threads", "1", "--router-health-interval-s", "0.25", "--router-health-timeout-s", "1",
             "--router-unhealthy-after", "2", "--router-shutdown-timeout-s", "3"],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_health(url, timeout=240, proc=proc)
    except BaseException:
        proc.kill()
        print(log_path.read_text()[-4000:])
        raise
    return proc, url


def replica_pids(url: str) -> list[int]:
    return [r["pid"] for r in httpx.get(url + "/health", timeout=10).json()["replicas"]]


@pytest.fixture
def model(data_dir) -> Path:
    return data_dir / "models" / "stories260K" / "stories260K.bin"


def test_stream_error_on_stopped_replica_then_sigterm_reaps_all(model, tmp_path):
    proc, url = start_dp(model, tmp_path / "serve.log")
    pids = replica_pids(url)
    try:
        # 32 prompts x 400 tokens in one stream: seconds of generation, so the replica is stopped mid-stream
        body = {"prompt": [f"Once upon a time, {i}" for i in range(32)], "max_tokens": 400, "ignore_eos": True,
                "temperature": 0, "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body,
                          timeout=httpx.Timeout(MARGIN_S, connect=5)) as resp:
            victim = int(resp.headers["x-scratchlm-replica"])
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if len(events) == 1:
                    os.kill(pids[victim], signal.SIGSTOP)
                    t0 = time.monotonic()
        elapsed = time.monotonic() - t0
        assert "error" in events[-1], events[-2:]
        assert events[-1]["error"]["code"] == "replica_unavailable"
        print(f"stream ended {elapsed:.2f} s after SIGSTOP (detection bound {DETECTION_BOUND_S:.2f} s)")
        # the stopped replica stays stopped: only SIGKILL can end it
        t1 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == -signal.SIGTERM
        print(f"router exited {time.monotonic() - t1:.2f} s after SIGTERM (shutdown timeout 3 s, one replica stopped)")
        left = [p for p in pids if alive(p)]
        assert not left, f"replica processes left after the router exited: {left}"
    finally:
        cleanup(pids)
        if proc.poll() is None:
            proc.kill()
        print((tmp_path / "serve.log").read_text()[-3000:])


def test_replicas_die_with_a_sigkilled_router(model, tmp_path):
    proc, url = start_dp(model, tmp_path / "serve.log")
    pids = replica_pids(url)
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        t0 = time.monotonic()
        left = wait_gone(pids, 30.0)
        print(f"replicas gone {time.monotonic() - t0:.2f} s after the router was SIGKILLed")
        assert not left, f"replica processes alive 30 s after the router was killed: {left}"
    finally:
        cleanup(pids)
