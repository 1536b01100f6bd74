"""The C++ kernels (csrc/quant_kernels.cpp): JIT build with a cache, and dispatch with a pure-torch fallback.

`load_extension()` compiles once with `torch.utils.cpp_extension.load` into a cache directory
(``$SCRATCHLM_QUANT_BUILD_DIR`` or ``~/.cache/scratchlm/quant_kernels``); later processes reuse the
shared object. If no compiler is found or the build fails, a warning is logged once and every
call uses the pure-torch reference path instead: nothing crashes.

`int8_linear` / `int4_linear` are what the quantized modules call. They use the extension for
CPU tensors (AVX2 path when the CPU has it, the portable scalar path otherwise) and the
reference (dequantize, then matmul) elsewhere, e.g. on CUDA (a Triton kernel is future work).
For more than `GEMM_ROWS` rows of x (prefill chunks) the weight is dequantized once per call and
torch's blocked GEMM does the compute-bound work: the fused kernel only pays off when reading the
weights is the bottleneck (decode).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from scratchlm.inference.quantization import reference

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_kernels.cpp"
EXTENSION_NAME = "scratchlm_quant_kernels"
GEMM_ROWS = 16  # above this many rows of x (prefill), dequantize once and use torch's blocked GEMM
CFLAGS = ["-O3", "-fopenmp", "-std=c++17"]  # AVX2 functions carry their own target attributes
_lock = threading.Lock()
_state: dict[str, Any] = {}  # loaded module or the failure, per process (a cache, not configuration)


def build_dir() -> Path:
    """Where the compiled extension is cached (one subfolder per torch version)."""
    root = os.environ.get("SCRATCHLM_QUANT_BUILD_DIR")
    base = Path(root) if root else Path.home() / ".cache" / "scratchlm" / "quant_kernels"
    return base / f"torch-{torch.__version__.replace('+', '_')}"


def load_extension(verbose: bool = False) -> Any | None:
    """The compiled kernel module, building it if needed; None (with one logged warning) on failure."""
    with _lock:
        if "module" in _state:
            return _state["module"]
        if os.environ.get("SCRATCHLM_QUANT_NO_EXTENSION"):
            log.warning("SCRATCHLM_QUANT_NO_EXTENSION is set: quantized layers use the pure-torch reference path")
            _state["module"] = None
            return None
        try:
            from torch.utils.cpp_extension import load

            _put_venv_ninja_on_path()
            directory = build_dir()
            directory.mkdir(parents=True, exist_ok=True)
            module = load(name=EXTENSION_NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS,
                          extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=verbose)
        except Exception as e:  # compiler missing, build error, ninja missing: all fall back
            log.warning("quantized kernels could not be built (%s: %s); using the slower pure-torch reference path",
                        type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
            module = None
        _state["module"] = module
        return module


def _put_venv_ninja_on_path() -> None:
    """torch's JIT build runs `ninja` from PATH; the `ninja` wheel installs it next to this Python, which is
    not on PATH when the venv is used without activation (e.g. `.venv/bin/python`)."""
    venv_bin = str(Path(sys.executable).parent)
    if shutil.which("ninja") is None and shutil.which("ninja", path=venv_bin):
        os.environ["PATH"] = venv_bin + os.pathsep + os.environ.get("PATH", "")


def extension_available() -> bool:
    return load_extension() is not None


def _use_extension(x: Tensor) -> Any | None:
    if x.device.type != "cpu" or x.numel() > GEMM_ROWS * x.shape[-1]:
        return None
    return load_extension()


def int8_linear(x: Tensor, q: Tensor, scales: Tensor, group_size: int, use_simd: bool = True,
                use_extension: bool = True) -> Tensor:
    """y (..., N) = x (..., K) @ dequant(q, scales)^T; fused C++ kernel on CPU, reference elsewhere."""
    ext = _use_extension(x) if use_extension else None
    if ext is None:
        return reference.reference_linear(x, reference.dequantize_int8(q, scales))
    x2 = x.reshape(-1, x.shape[-1]).float()  # (M, K)
    y = ext.int8_linear(x2, q, scales.float(), group_size, use_simd)  # (M, N)
    return y.view(*x.shape[:-1], q.shape[0]).to(x.dtype)


def int4_linear(x: Tensor, q: Tensor, d: Tensor, m: Tensor | None, group_size: int, use_simd: bool = True,
                use_extension: bool = True) -> Tensor:
    """y (..., N) = x (..., K) @ dequant(q, d, m)^T; fused C++ kernel on CPU, reference elsewhere."""
    ext = _use_extension(x) if use_extension else None
    if ext is None:
        return reference.reference_linear(x, reference.dequantize_int4(q, d, m, group_size))
    x2 = x.reshape(-1, x.shape[-1]).float()  # (M, K)
    y = ext.int4_linear(x2, q, d.half(), None if m is None else m.half(), group_size, use_simd)  # (M, N)
    return y.view(*x.shape[:-1], q.shape[0]).to(x.dtype)
