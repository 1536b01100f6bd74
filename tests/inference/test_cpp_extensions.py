"""The C++ kernel cache (`scratchlm.inference.cpp_extensions`), through a tiny extension (cpp_tiny/, a bare
Python C API module that compiles in about a second) built by the same `CppExtension` as the real kernels.

Every build here runs in real subprocesses with an empty cache folder (``SCRATCHLM_QUANT_BUILD_DIR``), and the
compiler is a wrapper script (``$CXX``) that appends a line to a counter file each time it compiles tiny_ext.cpp
(and can stall, to interrupt a build in the middle): the number of compiles is counted outside the code under
test. Every wait is bounded. The default suite runs the concurrent cold start, the shared build across checkouts
and environments, and Ctrl-C; the slow ones add alternation and edits, a killed builder, a compile error
(tests/inference/quantization/test_kernels.py has one in the default suite) and TP=2 on the real kernels.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
TINY = Path(__file__).resolve().parent / "cpp_tiny"

LOADER = textwrap.dedent("""
    import logging, os, sys, time
    from pathlib import Path
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    import torch
    from scratchlm.inference.cpp_extensions import CppExtension
    ext = CppExtension("scratchlm_tiny_test", Path(sys.argv[1]), "the tiny test extension", expected_s=3)
    if len(sys.argv) > 2:  # a start barrier: say ready, wait for the go file
        go = Path(sys.argv[2])
        Path(f"{go}.ready-{os.getpid()}").touch()
        deadline = time.monotonic() + 60
        while not go.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    module = ext.load()
    print("TORCH", torch.__file__)
    print("VALUE", module.value() if module is not None else None, flush=True)
""")

WRAPPER = textwrap.dedent("""\
    #!/bin/sh
    # counts compiles of $COUNT_SOURCE into $TINY_COUNT; with $TINY_STALL set, touches that file and stalls
    for arg in "$@"; do
      case "$arg" in
        *"/$COUNT_SOURCE")
          echo $$ >> "$TINY_COUNT"
          if [ -n "$TINY_STALL" ]; then touch "$TINY_STALL"; sleep 120; fi ;;
      esac
    done
    exec c++ "$@"
""")


@pytest.fixture
def sandbox(tmp_path):
    """(environment for the loader processes, counter file): empty cache, counting compiler, this checkout."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler (c++) on PATH")
    wrapper = tmp_path / "cxx"
    wrapper.write_text(WRAPPER)
    wrapper.chmod(0o755)
    count = tmp_path / "compiles"
    env = {k: v for k, v in os.environ.items() if k not in ("SCRATCHLM_QUANT_NO_EXTENSION", "TINY_STALL")}
    env.update(SCRATCHLM_QUANT_BUILD_DIR=str(tmp_path / "cache"), CXX=str(wrapper), TINY_COUNT=str(count),
               COUNT_SOURCE="tiny_ext.cpp", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    return env, count


def compiles(count: Path) -> int:
    return len(count.read_text().split()) if count.exists() else 0


def start_loader(env: dict, source: Path, *extra: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LOADER, str(source), *extra], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the loader did not finish within {timeout} s:\n{err[-3000:]}")
    return out, err


def run_loader(env: dict, source: Path) -> tuple[str, str]:
    out, err = finish(start_loader(env, source))
    assert "VALUE 42" in out, f"the loader did not get the module:\n{out}\n{err[-3000:]}"
    return out, err


def copy_tiny(dest: Path) -> Path:
    shutil.copytree(TINY, dest)
    return dest / "tiny_ext.cpp"


def wait_for(path: Path, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"{path.name} did not appear within {timeout} s:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)


def test_concurrent_cold_starts_compile_once(sandbox, tmp_path):
    """Two processes with an empty cache start loading at the same moment: one compiles, the other waits for
    that build (and says so), and both get the module."""
    env, count = sandbox
    go = tmp_path / "go"
    procs = [start_loader(env, TINY / "tiny_ext.cpp", str(go)) for _ in range(2)]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("go.ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    results = [finish(p) for p in procs]
    for out, err in results:
        assert "VALUE 42" in out, err[-3000:]
    assert compiles(count) == 1
    logs = "".join(err for _, err in results)
    said = "compiling C++ kernels (once per build of the sources, ~3 s): the tiny test extension"
    assert logs.count(f": {said}") == 1 and logs.count(f"which is {said}") == 1, logs
    assert "pure-torch" not in logs


def second_environment(env: dict, tmp_path: Path) -> dict:
    """The loader's environment with torch imported from another folder (a symlink), as a second virtual
    environment with its own torch has: torch's JIT build writes that folder into its build commands."""
    (tmp_path / "env_b").mkdir()
    (tmp_path / "env_b" / "torch").symlink_to(Path(torch.__file__).parent)
    return {**env, "PYTHONPATH": os.pathsep.join([str(tmp_path / "env_b"), str(REPO)])}


def test_same_sources_from_another_checkout_and_environment_reuse_the_build(sandbox, tmp_path):
    """The same sources at another path (a second checkout), imported from another environment: no compile."""
    env, count = sandbox
    env_b = second_environment(env, tmp_path)
    run_loader(env, copy_tiny(tmp_path / "checkout_a"))
    out, _ = run_loader(env_b, copy_tiny(tmp_path / "checkout_b"))
    assert str(tmp_path / "env_b") in out  # the second environment really imported torch from elsewhere
    assert compiles(count) == 1


@pytest.mark.slow
def test_two_checkouts_and_environments_alternating_build_once_and_a_header_edit_rebuilds(sandbox, tmp_path):
    """Two checkouts imported alternately from two environments: one compile. An edited header (the only
    difference) gets its own build."""
    env, count = sandbox
    env_b = second_environment(env, tmp_path)
    a, b = copy_tiny(tmp_path / "checkout_a"), copy_tiny(tmp_path / "checkout_b")
    for source, environment in ((a, env), (b, env_b), (a, env_b), (b, env)):
        run_loader(environment, source)
    assert compiles(count) == 1

    header = b.parent / "tiny_value.h"
    header.write_text(header.read_text().replace("42", "7"))
    out, _ = finish(start_loader(env, b))
    assert "VALUE 7" in out
    assert compiles(count) == 2
    run_loader(env_b, a)  # the other build is still there
    assert compiles(count) == 2


def test_ctrl_c_during_the_build_stops_the_command(sandbox, tmp_path):
    """SIGINT to the loader's process group (what Ctrl-C in a terminal sends) while the compiler runs: the
    process stops with KeyboardInterrupt instead of falling back to the pure-torch path, the compiler is gone
    and no module is left in the cache."""
    env, count = sandbox
    stall = tmp_path / "compiling"
    proc = start_loader({**env, "TINY_STALL": str(stall)}, TINY / "tiny_ext.cpp", start_new_session=True)
    wait_for(stall, 60, proc)
    compiler_pid = int(count.read_text().split()[0])
    os.killpg(proc.pid, signal.SIGINT)
    out, err = finish(proc, timeout=30)
    assert proc.returncode != 0
    assert "KeyboardInterrupt" in err
    assert "pure-torch" not in err and "VALUE" not in out
    assert not any((tmp_path / "cache").rglob("*.so")), "an interrupted build left a module in the cache"
    assert_gone(compiler_pid, 10)


@pytest.mark.slow
def test_a_killed_builder_leaves_no_module_and_no_compiler(sandbox, tmp_path):
    """SIGKILL to the process that is building: its compiler dies with it, no module is left in the cache, and
    the next process builds one that loads."""
    env, count = sandbox
    stall = tmp_path / "compiling"
    proc = start_loader({**env, "TINY_STALL": str(stall)}, TINY / "tiny_ext.cpp")
    wait_for(stall, 60, proc)
    compiler_pid = int(count.read_text().split()[0])
    proc.kill()
    proc.wait(10)
    assert_gone(compiler_pid, 10)
    assert not any((tmp_path / "cache").rglob("*.so"))

    run_loader(env, TINY / "tiny_ext.cpp")
    assert compiles(count) == 2


@pytest.mark.slow
def test_a_compile_error_falls_back_with_the_reason(sandbox, tmp_path):
    """A source that does not compile: the loader gets None and one warning naming the compiler's error."""
    env, _ = sandbox
    source = copy_tiny(tmp_path / "broken")
    source.write_text(source.read_text() + "\nthis is not C++;\n")
    out, err = finish(start_loader(env, source))
    assert "VALUE None" in out
    assert "pure-torch reference path" in err
    assert "error" in err and "this" in err  # the compiler's message about the bad line


def assert_gone(pid: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{pid}/stat").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return  # a zombie: dead, waiting for its (orphaned) reaping
        time.sleep(0.1)
    pytest.fail(f"the compiler (pid {pid}) is still running {timeout} s after its builder stopped")


TP_SCRIPT = textwrap.dedent("""
    import logging, sys, torch
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from scratchlm.inference import LLM, SamplingParams
    torch.set_num_threads(1)
    llm = LLM(sys.argv[1], tensor_parallel_size=2)
    out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    print("TEXT=" + repr(out[0].outputs[0].text), flush=True)
""")


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_with_an_empty_kernel_cache_builds_before_the_ranks_start(sandbox):
    """`LLM(model, tensor_parallel_size=2)` with an empty cache: the parent builds the real engine kernels once
    before starting the ranks, so no rank compiles while its peer waits on a collective (before: the peer's gloo
    recv timed out after 60 s). Minutes: a cold build of the real kernels."""
    from tests.conftest import shared_data_path

    stories = shared_data_path() / "models/stories260K/stories260K.bin"
    if not stories.is_file():
        pytest.skip(f"stories260K not found at {stories}")
    env, count = sandbox
    env = {**env, "COUNT_SOURCE": "engine_kernels.cpp"}
    proc = subprocess.run([sys.executable, "-c", TP_SCRIPT, str(stories)], env=env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0 and "TEXT=" in proc.stdout, proc.stderr[-5000:]
    assert compiles(count) == 1
    assert proc.stderr.count("compiling C++ kernels (once per build of the sources") == 1, proc.stderr[-5000:]
    assert "pure-torch" not in proc.stderr
