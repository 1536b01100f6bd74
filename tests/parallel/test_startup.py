"""Start-up of a TP engine: ranks never import the caller's `__main__` (no main guard needed, stdin and
`python -c` work), and a rank that dies while starting is reported, with its traceback, within seconds."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from scratchlm.inference import LLM, EngineConfig, LLMEngine, SamplingParams
from scratchlm.parallel.launch import WorkerStartupError
from tests.conftest import REPO_ROOT, shared_data_path

STORIES = shared_data_path() / "models/stories260K/stories260K.bin"
if not STORIES.is_file():
    pytest.skip(f"stories260K not found at {STORIES}", allow_module_level=True)

PROMPT = "Once upon a time"

# No `if __name__ == "__main__":` guard: with multiprocessing's spawn, each rank re-ran this whole file.
# The import-time side effect below shows it: a rank that re-imports __main__ prints MAIN-RAN again.
NO_GUARD = textwrap.dedent(f"""
    import torch
    from scratchlm.inference import LLM, SamplingParams
    print("MAIN-RAN", flush=True)
    torch.set_num_threads(1)
    llm = LLM({str(STORIES)!r}, tensor_parallel_size=2)
    out = llm.generate([{PROMPT!r}], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)
    print("TEXT=" + repr(out[0].outputs[0].text), flush=True)
""")


@pytest.fixture(scope="module")
def reference_text() -> str:
    torch.set_num_threads(1)
    llm = LLM(STORIES)
    return llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0].text


def _run(argv: list[str], stdin: str | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *argv], input=stdin, capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=120)


def _check(proc: subprocess.CompletedProcess, reference: str) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("MAIN-RAN") == 1, proc.stdout  # the ranks did not re-run the script
    assert f"TEXT={reference!r}" in proc.stdout  # and TP=2 equals one process


def test_tp2_from_stdin_without_main_guard(reference_text, tmp_path) -> None:
    """`python - < script.py` (the case that died, then hung 121 s, with spawn)."""
    _check(_run(["-"], stdin=NO_GUARD, cwd=tmp_path), reference_text)


@pytest.mark.distributed
@pytest.mark.parametrize("how", ["script", "-c"])
def test_tp2_from_a_script_file_or_dash_c_without_main_guard(reference_text, tmp_path, how) -> None:
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD)
    argv = [str(script)] if how == "script" else ["-c", NO_GUARD]
    _check(_run(argv, cwd=tmp_path), reference_text)


def _fake_package(folder, name: str, code: str) -> None:
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text(textwrap.dedent(code))


def test_a_rank_dying_at_import_is_reported_with_its_traceback_fast(tmp_path, monkeypatch) -> None:
    """Rank 1 cannot import torch (a broken environment on its side): rank 0 raises within 5 s, naming the rank,
    its exit code and its traceback (before: the rendezvous waited 121 s and said only 'exit code 1')."""
    _fake_package(tmp_path, "torch", 'raise ImportError("injected: this torch is broken")\n')
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # only the spawned rank picks it up: torch is loaded here
    torch.set_num_threads(1)
    t0 = time.monotonic()
    with pytest.raises(WorkerStartupError) as info:
        LLMEngine.from_pretrained(STORIES, EngineConfig(tensor_parallel_size=2))
    elapsed = time.monotonic() - t0
    message = str(info.value)
    print(f"start-up failure reported after {elapsed:.2f} s:\n{message}")
    assert elapsed < 5
    assert "rank 1" in message and "exited with code 1" in message
    assert "Traceback (most recent call last)" in message and "ImportError: injected: this torch is broken" in message
    assert not torch.distributed.is_initialized()  # nothing left behind: the next engine can start


@pytest.mark.distributed  # ~15 s on a busy 2-core machine (two torch imports, then a real TP=2 engine)
def test_a_rank_dying_while_loading_its_shard_is_reported_fast(tmp_path, monkeypatch) -> None:
    """Rank 1 fails in the middle of loading its shard (a bad file, out of memory, ...)."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import sys
        if "--spawned" in sys.argv:  # the spawned rank only
            import scratchlm.parallel.launch as launch

            def broken(*args, **kwargs):
                raise MemoryError("injected: rank 1 ran out of memory loading its shard")

            launch.load_shard = broken
    """))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    torch.set_num_threads(1)
    t0 = time.monotonic()
    with pytest.raises(WorkerStartupError, match="rank 1 .*exited with code 1") as info:
        LLMEngine.from_pretrained(STORIES, EngineConfig(tensor_parallel_size=2))
    elapsed = time.monotonic() - t0
    print(f"start-up failure reported after {elapsed:.2f} s")
    assert elapsed < 30  # the worker's own torch import is most of it; nothing waits for a rendezvous timeout
    assert "MemoryError: injected: rank 1 ran out of memory" in str(info.value)
    assert not torch.distributed.is_initialized()
    # and the engine starts normally afterwards in the same process
    monkeypatch.delenv("PYTHONPATH")
    engine = LLMEngine.from_pretrained(STORIES, EngineConfig(tensor_parallel_size=2))
    try:
        engine.add_request("a", PROMPT, SamplingParams(max_tokens=4, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in engine.runner.procs)


@pytest.mark.distributed
def test_tp2_inside_a_daemon_engine_process(reference_text, tmp_path) -> None:
    """`scratchlm serve --engine-process --tensor-parallel-size 2`: a daemonic multiprocessing child could not
    spawn ranks with multiprocessing; fresh-interpreter ranks work, and they leave with the server."""
    import json
    import signal
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"}
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        server = subprocess.Popen([sys.executable, "-m", "scratchlm", "serve", str(STORIES), "--engine-process",
                                   "--tensor-parallel-size", "2", "--threads", "1", "--port", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert server.poll() is None, log.read_text()
                time.sleep(0.5)
        body = json.dumps({"prompt": PROMPT, "max_tokens": 24, "temperature": 0}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        reply = json.loads(urllib.request.urlopen(request, timeout=60).read())
        assert reply["choices"][0]["text"] == reference_text
        pids = [p for p in _descendants(server.pid) if b"scratchlm.parallel.worker" in _cmdline(p)]
        assert len(pids) == 1, "expected rank 1 under the engine process"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids), "rank 1 outlived the server"


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                kids = []
            out += kids
            todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
