"""JIT-built C++ CPU kernels (quantized matmuls, paged attention), cached, with a pure-torch fallback.

`CppExtension(name, source, purpose).load()` returns the compiled module, building it at most once per set of
inputs on this machine. Policy:

- **Cache key = what determines the binary, never a path.** The folder ``<name>-<key>`` (under
  ``$SCRATCHLM_QUANT_BUILD_DIR`` or ``~/.cache/scratchlm/quant_kernels``, then ``torch-<version>``) is keyed by the
  C++ files beside the source (the headers it includes) and their contents, the compile and link flags, the
  compiler (resolved path and ``--version``), torch (version, git revision, C++11 ABI) and the Python extension
  ABI (``EXT_SUFFIX``, since the module links pybind11/libpython). Two checkouts or two virtual environments with
  the same inputs share one build; an edited header gets a fresh one.
- **Built once, atomically.** A cold build copies the sources into a temporary folder in the cache, compiles
  there with `torch.utils.cpp_extension.load` in a child process (its own process group, killed with its
  parent), and renames the folder into place only when the module built and imported. A finished folder is never
  rebuilt in place, so a killed build leaves no half-built module: only a stale temporary folder, removed by the
  next build. Concurrent builders take an `fcntl` lock per key: one compiles, the others wait (logged, bounded by
  ``$SCRATCHLM_KERNEL_BUILD_WAIT_S``, default 1800 s) and load its result.
- **Loud.** A cold build logs a WARNING before it starts, "compiling C++ kernels (once per build of the sources,
  ~N s): <what>" (N: this machine's last build of that extension, else a per-extension estimate), and one when
  it is done; waiting for another process's build is logged the same way.
- **Failures.** Ctrl-C (KeyboardInterrupt) during a build stops the child and propagates: the command stops.
  Any other failure (no compiler, a compile error, a wait past the bound) logs one warning with the reason, and
  `load()` returns None: every caller then runs its pure-torch reference path. ``SCRATCHLM_QUANT_NO_EXTENSION=1``
  turns every extension off (the reference paths everywhere).
- Builds that no process has used for 14 days are removed after a build (each load touches its folder).

`prepare_kernels()` builds (or waits for) the kernels without importing them: multi-process launchers call it
before starting ranks, so no rank compiles while its peers wait on a collective with a timeout.
`python -m scratchlm.inference.quantization.build` builds them all at install time and checks them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

import torch

from scratchlm import atomic

log = logging.getLogger(__name__)

CFLAGS = ["-O3", "-fopenmp", "-std=c++17"]  # AVX2 functions carry their own target attributes
LDFLAGS = ["-fopenmp"]
SOURCE_SUFFIXES = (".cpp", ".cc", ".h", ".hpp")
LAYOUT = "2"  # the cache layout and build recipe; part of the key, bump it when either changes
WAIT_ENV = "SCRATCHLM_KERNEL_BUILD_WAIT_S"
DEFAULT_WAIT_S = 1800.0
UNUSED_BUILD_S = 14 * 86400.0  # a build nobody loaded for this long is removed after the next build
STALE_TMP_S = 86400.0  # a temporary build folder this old belongs to a build that died

# The build child: fresh interpreter, own process group, killed with its parent (PR_SET_PDEATHSIG sends SIGTERM).
# On SIGTERM it passes the signal to its group: ninja then stops its compilers (each in a process group of its
# own) and exits; after that (or 5 s) everything left in the group is killed. It builds with torch's JIT loader,
# which also imports the module (a module that does not import is a failed build).
_CHILD = r"""
import ctypes, glob, json, os, signal, sys, time
spec = json.loads(sys.argv[1])

def running_children():
    pids = [p for f in glob.glob("/proc/self/task/*/children") for p in open(f).read().split()]
    return [p for p in pids if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split(") ")[1][0] != "Z"]

def stop(*_):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while running_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(0, signal.SIGKILL)

signal.signal(signal.SIGTERM, stop)
ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
if os.getppid() != spec["parent"]:
    sys.exit("the process that started this build is gone")
from torch.utils.cpp_extension import load
load(name=spec["name"], sources=spec["sources"], extra_cflags=spec["cflags"], extra_ldflags=spec["ldflags"],
     build_directory=spec["build"], verbose=spec["verbose"])
"""


class KernelBuildError(RuntimeError):
    """A C++ extension could not be built (the message says why and where the full log is)."""


def build_dir() -> Path:
    """Where compiled extensions are cached (one subfolder per torch version)."""
    root = os.environ.get("SCRATCHLM_QUANT_BUILD_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "scratchlm" / "quant_kernels"
    return base / f"torch-{torch.__version__.replace('+', '_')}"


def compiler_identity() -> dict[str, str]:
    """The C++ compiler torch's JIT build runs (``$CXX`` or ``c++``): resolved path and first ``--version`` line."""
    cxx = os.environ.get("CXX", "c++")
    found = shutil.which(cxx)
    if found is None:
        return {"cxx": cxx, "path": "", "version": "not found"}
    try:
        out = subprocess.run([found, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        out = f"unknown ({type(e).__name__})"
    return {"cxx": cxx, "path": os.path.realpath(found), "version": (out.strip().splitlines() or [""])[0]}


def toolchain_identity() -> dict[str, Any]:
    """Everything besides the sources that determines the binary: compiler, flags, torch and Python ABIs."""
    return {"layout": LAYOUT, "compiler": compiler_identity(), "cflags": CFLAGS, "ldflags": LDFLAGS,
            "torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", ""),
            "cxx11_abi": bool(torch._C._GLIBCXX_USE_CXX11_ABI), "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
            "machine": platform.machine()}


def _environment_for_build() -> dict[str, str]:
    """The child's environment: PATH gains this interpreter's folder when `ninja` is only there (the `ninja`
    wheel installs it next to a venv's Python, which is not on PATH without activating the venv)."""
    env = dict(os.environ)
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja", path=env.get("PATH")) is None and shutil.which("ninja", path=venv_bin):
        env["PATH"] = venv_bin + os.pathsep + env.get("PATH", "")
    return env


class CppExtension:
    """One C++ source (and the headers beside it) built into a Python module on first use; `state` caches the
    module or None per process. `expected_s` is the build-time estimate logged before this machine's first build."""

    def __init__(self, name: str, source: Path, purpose: str, expected_s: float = 120.0):
        self.name, self.source, self.purpose, self.expected_s = name, Path(source), purpose, expected_s
        self.state: dict[str, Any] = {}
        self._lock = threading.Lock()

    def source_files(self) -> list[Path]:
        """The source and every C++ file beside it, sorted by name (all are copied and hashed)."""
        return sorted(p for p in self.source.parent.iterdir() if p.suffix in SOURCE_SUFFIXES and p.is_file())

    def content_hash(self) -> str:
        """A digest of the source, every C++ file beside it (the headers it includes) and the compile flags."""
        digest = hashlib.sha1(" ".join(CFLAGS).encode())
        for path in self.source_files():
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()[:10]

    def cache_key(self) -> str:
        """The build's identity: name, main source name, sources' contents and the toolchain (no paths)."""
        ident = {"name": self.name, "main": self.source.name, "content": self.content_hash(),
                 "toolchain": toolchain_identity()}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]

    def cached_module(self, key: str | None = None) -> Path:
        """Where the built module of this key lives (it may not exist yet)."""
        return build_dir() / f"{self.name}-{key or self.cache_key()}" / "build" / f"{self.name}.so"

    def ensure_built(self, verbose: bool = False) -> Path:
        """The built module's path, compiling it (or waiting for another process's build) if needed.
        Raises KernelBuildError when it cannot be built; KeyboardInterrupt stops the build and propagates."""
        key = self.cache_key()
        module = self.cached_module(key)
        if module.exists():
            _touch(module.parent.parent)
            return module
        root = module.parent.parent.parent
        root.mkdir(parents=True, exist_ok=True)
        with _BuildLock(root / f"{self.name}-{key}.lock", self.describe_build(root)):
            if not module.exists():  # nobody built it while this process waited
                shutil.rmtree(module.parent.parent, ignore_errors=True)  # a folder without its module: not ours
                self._build(root, key, verbose)
        return module

    def describe_build(self, root: Path) -> str:
        """'C++ kernels (once per build of the sources, ~N s): PURPOSE' for the log lines."""
        return f"C++ kernels (once per build of the sources, ~{self.estimated_seconds(root):.0f} s): {self.purpose}"

    def estimated_seconds(self, root: Path) -> float:
        """This machine's last build time of this extension, else `expected_s`."""
        with contextlib.suppress(OSError, ValueError):
            return float((root / f"{self.name}.build-seconds").read_text())
        return self.expected_s

    def _build(self, root: Path, key: str, verbose: bool) -> None:
        """Compile into a temporary folder in `root` and rename it to ``<name>-<key>`` (the caller holds the lock)."""
        final = root / f"{self.name}-{key}"
        for stale in root.glob(f".{final.name}.tmp-*"):  # builds of this key that died (we hold its lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = root / f".{final.name}.tmp-{os.getpid()}"
        log.warning("compiling %s, in %s", self.describe_build(root), final)
        start = time.monotonic()
        try:
            (tmp / "src").mkdir(parents=True)
            for path in self.source_files():
                shutil.copy2(path, tmp / "src" / path.name)
            self._run_build_child(tmp, verbose)
            seconds = time.monotonic() - start
            for obj in (tmp / "build").glob("*.o"):
                obj.unlink()
            record = {"name": self.name, "key": key, "seconds": round(seconds, 1), "built_at": time.time(),
                      "toolchain": toolchain_identity(), "sources": [p.name for p in self.source_files()]}
            (tmp / "build.json").write_text(json.dumps(record, indent=1))
            with open(tmp / "build" / f"{self.name}.so", "rb") as so:
                os.fsync(so.fileno())
            os.rename(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; else a failed or interrupted build
        with contextlib.suppress(OSError):  # a read-only cache is fine: the estimate falls back to expected_s
            atomic.write_text(root / f"{self.name}.build-seconds", f"{seconds:.1f}")
        log.warning("compiled C++ kernels in %.0f s: %s (cached in %s)", seconds, self.purpose, final)
        _sweep(root, self.name, keep=final)

    def _run_build_child(self, tmp: Path, verbose: bool) -> None:
        """Run the build child; KernelBuildError with the compiler's first error line when it fails."""
        spec = {"name": self.name, "sources": [str(tmp / "src" / self.source.name)], "cflags": CFLAGS,
                "ldflags": LDFLAGS, "build": str(tmp / "build"), "verbose": verbose, "parent": os.getpid()}
        (tmp / "build").mkdir()
        log_path = tmp / "build.log"
        with open(log_path, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(spec)], stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT, env=_environment_for_build(),
                                    cwd=tmp, start_new_session=True)
            try:
                rc = proc.wait()
            except BaseException:  # Ctrl-C (or any exception): stop the compiler too, then propagate
                _stop_build_child(proc)
                raise
        text = log_path.read_text(errors="replace")
        if verbose:
            sys.stderr.write(text)
        if rc != 0:
            kept = tmp.parent / f"{self.name}.failed-build.log"
            shutil.copyfile(log_path, kept)
            raise KernelBuildError(f"the build exited with status {rc}: {_first_error(text)} (full log: {kept})")

    def load(self, verbose: bool = False) -> Any | None:
        """The compiled module, building it if needed; None (with one logged warning) on failure."""
        with self._lock:
            if "module" in self.state:
                return self.state["module"]
            module = None
            if os.environ.get("SCRATCHLM_QUANT_NO_EXTENSION"):
                log.warning("SCRATCHLM_QUANT_NO_EXTENSION is set: %s use the pure-torch reference path", self.purpose)
            else:
                try:
                    module = _import_extension(self.name, self.ensure_built(verbose))
                except Exception as e:  # compiler missing, build error, ninja missing: all fall back
                    msg = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                    log.warning("the C++ kernels of %s could not be built (%s: %s); using the slower pure-torch "
                                "reference path", self.purpose, type(e).__name__, msg)
            self.state["module"] = module
            return module


class _BuildLock:
    """An exclusive `fcntl` lock on one key's lock file, dying with its holder. Waiting is logged (with the
    holder's pid, which the holder writes into the file) and bounded by ``$SCRATCHLM_KERNEL_BUILD_WAIT_S``."""

    def __init__(self, path: Path, what: str):
        self.path, self.what = path, what
        self.file: Any = None

    def __enter__(self) -> _BuildLock:
        self.file = open(self.path, "a+")  # noqa: SIM115  (closed in __exit__)
        try:
            self._acquire()
        except BaseException:
            self.file.close()
            raise
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()
        return self

    def _acquire(self) -> None:
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        self.file.seek(0)
        holder = self.file.read().strip() or "?"
        bound = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
        log.warning("waiting for process %s, which is compiling %s", holder, self.what)
        deadline = time.monotonic() + bound
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise KernelBuildError(f"gave up after {bound:.0f} s (${WAIT_ENV}) waiting for process "
                                           f"{holder}'s build (lock {self.path})") from None
                time.sleep(0.2)

    def __exit__(self, *exc: object) -> None:
        self.file.close()  # releases the lock


def _import_extension(name: str, path: Path) -> Any:
    """Import the built module from `path` (as torch's JIT loader does)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stop_build_child(proc: subprocess.Popen) -> None:
    """SIGTERM to the build child's group (it stops ninja and the compilers), SIGKILL after 10 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _first_error(text: str) -> str:
    """The reason in a build log: the compiler's first error line, else the first line a failed command printed
    (ninja prints ``FAILED: target``, the command, then its output), else the last line naming an error."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    compiler = [line for line in lines if ": error:" in line or ": fatal error:" in line]
    failed = next((i for i, line in enumerate(lines) if line.startswith("FAILED:")), None)
    printed = [line for line in lines[failed + 2:] if not line.startswith("ninja:")][:1] if failed is not None else []
    named = [line for line in lines if "error" in line.lower() and not line.startswith(("[", "File "))]
    return (compiler or printed or named[-1:] or lines[-1:] or ["(no output)"])[0][:300]


def _touch(path: Path) -> None:
    """Mark a build as used now (its folder's mtime); a read-only cache is fine."""
    with contextlib.suppress(OSError):
        os.utime(path)


def _sweep(root: Path, name: str, keep: Path) -> None:
    """Remove this extension's builds unused for `UNUSED_BUILD_S` and temporary folders of builds that died."""
    now = time.time()
    for entry in root.iterdir():
        with contextlib.suppress(OSError):
            if entry == keep or not entry.is_dir():
                continue
            age = now - entry.stat().st_mtime
            if (entry.name.startswith(f"{name}-") and age > UNUSED_BUILD_S) or \
                    (entry.name.startswith(f".{name}-") and ".tmp-" in entry.name and age > STALE_TMP_S):
                shutil.rmtree(entry)


ENGINE_KERNELS = CppExtension("scratchlm_engine_kernels",
                              Path(__file__).resolve().parent / "csrc" / "engine_kernels.cpp",
                              "the engine's decode kernels (skinny GEMM, paged attention, fused decode step)",
                              expected_s=180.0)


def load_engine_kernels(verbose: bool = False) -> Any | None:
    """The compiled `csrc/engine_kernels.cpp` module, or None (torch-ops paths) when it cannot be built."""
    return ENGINE_KERNELS.load(verbose)


def prepare_kernels(quantized: bool = False) -> None:
    """Build (or wait for another process's build of) the engine kernels, and the older quantized-layer kernels
    when `quantized`, without importing them: launchers call this before starting ranks. A failure is only
    logged (each rank then falls back, as `load()` does); KeyboardInterrupt propagates."""
    if os.environ.get("SCRATCHLM_QUANT_NO_EXTENSION"):
        return
    extensions = [ENGINE_KERNELS]
    if quantized:
        from scratchlm.inference.quantization import kernels

        extensions.append(kernels.EXTENSION)
    for ext in extensions:
        try:
            ext.ensure_built()
        except Exception as e:
            log.warning("could not build the C++ kernels of %s before starting the ranks (%s: %s); each rank will "
                        "try again and otherwise use the pure-torch path", ext.purpose, type(e).__name__, e)
