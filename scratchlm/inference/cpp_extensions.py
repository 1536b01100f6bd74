"""JIT-built C++ CPU kernels (quantized matmuls, paged attention), cached, with a pure-torch fallback.

`CppExtension(name, source).load()` compiles once with `torch.utils.cpp_extension.load` into a cache directory
(``$SCRATCHLM_QUANT_BUILD_DIR`` or ``~/.cache/scratchlm/quant_kernels``, one subfolder per torch version, then
one per checkout and content of the C++ sources); later processes reuse the shared object. Keying the folder by
content means an edited header always gets a fresh build: ninja's mtime check alone keeps a stale binary when a
header changes while a build that started before the edit is still compiling. If no compiler is found or the
build fails, a warning is logged once and `load()` returns None: every caller then runs its pure-torch reference
path. ``SCRATCHLM_QUANT_NO_EXTENSION=1`` turns every extension off (the reference paths everywhere). `python -m
scratchlm.inference.quantization.build` builds them all at install time.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

CFLAGS = ["-O3", "-fopenmp", "-std=c++17"]  # AVX2 functions carry their own target attributes


def build_dir() -> Path:
    """Where compiled extensions are cached (one subfolder per torch version)."""
    root = os.environ.get("SCRATCHLM_QUANT_BUILD_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "scratchlm" / "quant_kernels"
    return base / f"torch-{torch.__version__.replace('+', '_')}"


def _put_venv_ninja_on_path() -> None:
    """torch's JIT build runs `ninja` from PATH; the `ninja` wheel installs it next to this Python, which is
    not on PATH when the venv is used without activation (e.g. `.venv/bin/python`)."""
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")


class CppExtension:
    """One C++ source built into a Python module on first use; `state` caches the module or None per process."""

    def __init__(self, name: str, source: Path, purpose: str):
        self.name, self.source, self.purpose = name, source, purpose
        self.state: dict[str, Any] = {}
        self._lock = threading.Lock()

    def content_hash(self) -> str:
        """A digest of the source, every C++ file beside it (the headers it includes) and the compile flags."""
        digest = hashlib.sha1(" ".join(CFLAGS).encode())
        for path in sorted(self.source.parent.iterdir()):
            if path.suffix in (".cpp", ".cc", ".h", ".hpp"):
                digest.update(path.name.encode() + b"\0" + path.read_bytes())
        return digest.hexdigest()[:10]

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
                    from torch.utils.cpp_extension import load

                    _put_venv_ninja_on_path()
                    # One build folder per source location: torch writes the source path into its build.ninja,
                    # so two checkouts sharing a folder would rebuild (about a minute) every time they alternate.
                    where = hashlib.sha1(str(self.source.resolve().parent).encode()).hexdigest()[:10]
                    directory = build_dir() / f"{self.name}-{where}-{self.content_hash()}"
                    directory.mkdir(parents=True, exist_ok=True)
                    # torch's own build lock is a file that a killed build leaves behind, and every later
                    # build then waits on it forever. An flock dies with its process: whoever holds it may
                    # delete torch's lock file, which can then only be stale.
                    with open(directory / "scratchlm.flock", "w") as lock:
                        fcntl.flock(lock, fcntl.LOCK_EX)
                        (directory / "lock").unlink(missing_ok=True)
                        module = load(name=self.name, sources=[str(self.source)], extra_cflags=CFLAGS,
                                      extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=verbose)
                    _remove_superseded(directory, f"{self.name}-{where}")
                except Exception as e:  # compiler missing, build error, ninja missing: all fall back
                    msg = str(e).strip().splitlines()[-1] if str(e).strip() else ""
                    log.warning("the C++ kernels of %s could not be built (%s: %s); using the slower pure-torch "
                                "reference path", self.purpose, type(e).__name__, msg)
            self.state["module"] = module
            return module


def _remove_superseded(current: Path, prefix: str) -> None:
    """Delete this checkout's older builds (other content), except one that a process is building right now."""
    for other in current.parent.glob(f"{prefix}*"):
        if other == current or not other.is_dir():
            continue
        try:
            with open(other / "scratchlm.flock", "a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a build in progress: leave it
                shutil.rmtree(other)
        except OSError:
            pass  # a loaded .so stays mapped after its file is removed; a busy or vanished folder is skipped


ENGINE_KERNELS = CppExtension("scratchlm_engine_kernels",
                              Path(__file__).resolve().parent / "csrc" / "engine_kernels.cpp",
                              "the engine's decode kernels (skinny GEMM, paged attention, fused decode step)")


def load_engine_kernels(verbose: bool = False) -> Any | None:
    """The compiled `csrc/engine_kernels.cpp` module, or None (torch-ops paths) when it cannot be built."""
    return ENGINE_KERNELS.load(verbose)
