"""Faults: a killed or hung rank makes rank 0 raise a clear error within the timeout (no hang), and
workers do not outlive a killed rank 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams
from scratchlm.parallel.runner import ParallelWorkerError
from tests.conftest import REPO_ROOT, shared_data_path

STORIES = shared_data_path() / "models/stories260K/stories260K.bin"
if not STORIES.is_file():
    pytest.skip(f"stories260K not found at {STORIES}", allow_module_level=True)


def start(tp: int, pp: int, timeout_s: float) -> LLMEngine:
    torch.set_num_threads(1)
    engine = LLMEngine.from_pretrained(STORIES, EngineConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                             parallel_timeout_s=timeout_s, max_num_seqs=4))
    for i in range(3):
        engine.add_request(str(i), [1, 300 + i, 400], SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        engine.step()
    return engine


def steps_until_error(engine: LLMEngine, limit_s: float) -> tuple[ParallelWorkerError, float]:
    t0 = time.monotonic()
    with pytest.raises(ParallelWorkerError) as info:
        while time.monotonic() - t0 < limit_s:
            engine.step()
    return info.value, time.monotonic() - t0


def test_killed_worker_gives_clear_error_fast() -> None:
    engine = start(2, 1, timeout_s=60)
    worker = engine.runner.procs[0]
    try:
        os.kill(worker.pid, signal.SIGKILL)  # mid-generation: requests are running
        err, elapsed = steps_until_error(engine, 60)
        print(f"killed rank 1: ParallelWorkerError after {elapsed:.2f} s")
        assert elapsed < 60
        assert "rank 1" in str(err) and "exited with code -9" in str(err) and "restarted" in str(err)
        with pytest.raises(ParallelWorkerError, match="rank 1"):  # the engine stays failed, no hang
            engine.step()
    finally:
        engine.runner.shutdown()
    assert not any(p.is_alive() for p in engine.runner.procs)


@pytest.mark.distributed
def test_hung_worker_times_out() -> None:
    """A stopped (not dead) last pipeline stage: rank 0's step fails after parallel_timeout_s."""
    engine = start(1, 2, timeout_s=5)
    worker = engine.runner.procs[0]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        err, elapsed = steps_until_error(engine, 60)
        print(f"stopped rank 1: ParallelWorkerError after {elapsed:.2f} s (timeout 5 s)")
        assert elapsed < 30
        assert "did not answer within 5 s" in str(err)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        engine.runner.shutdown()


SCRIPT = textwrap.dedent("""
    import sys, time, torch
    from scratchlm.inference import EngineConfig, LLMEngine
    if __name__ == "__main__":
        torch.set_num_threads(1)
        engine = LLMEngine.from_pretrained(sys.argv[1], EngineConfig(tensor_parallel_size=2))
        print(" ".join(str(p.pid) for p in engine.runner.procs), flush=True)
        time.sleep(600)
""")


@pytest.mark.distributed
def test_workers_exit_when_rank0_is_killed(tmp_path) -> None:
    script = tmp_path / "rank0.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(script), str(STORIES)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    alive = pids
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [p for p in pids if _alive(p)]
    assert not alive, f"workers {alive} outlived rank 0"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead: its parent (rank 0) is gone and init reaps it
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.distributed
def test_server_exits_nonzero_when_a_rank_dies(tmp_path) -> None:
    """`scratchlm serve --tensor-parallel-size 2`: SIGKILL rank 1 during a request -> the server exits with
    status 3 within 60 s, saying which rank died."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "scratchlm", "serve", str(STORIES), "--tensor-parallel-size",
                                   "2", "--threads", "1", "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                                  env=env, cwd=REPO_ROOT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, log.read_text()
                time.sleep(0.5)
        children = Path(f"/proc/{server.pid}/task/{server.pid}/children").read_text().split()
        workers = [int(c) for c in children if "scratchlm.parallel.worker" in Path(f"/proc/{c}/cmdline").read_text()]
        assert workers, children
        os.kill(workers[0], signal.SIGKILL)
        t0 = time.monotonic()
        body = b'{"prompt": "Once upon a time", "max_tokens": 50}'
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with pytest.raises(OSError):  # urllib's HTTPError (5xx) or a closed connection
            urllib.request.urlopen(req, timeout=60)
        code = server.wait(timeout=60)
        assert time.monotonic() - t0 < 60
        assert code == 3  # EXIT_ENGINE_FAILED (server/health.py)
        text = log.read_text()
        assert "stopping the server (exit status 3): tensor/pipeline-parallel step failed" in text and "rank 1" in text
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
