"""The C++ kernels (csrc/quant_kernels.cpp): JIT build with a cache, and dispatch with a pure-torch fallback.

`load_extension()` compiles once through `scratchlm.inference.cpp_extensions` (cache directory, one
warning and the pure-torch reference path when the build fails: nothing crashes).

`int8_linear` / `int4_linear` are what the quantized modules call. They use the extension for
CPU tensors (AVX2 path when the CPU has it, the portable scalar path otherwise) and the
reference (dequantize, then matmul) elsewhere, e.g. on CUDA (a Triton kernel is future work).
For more than `GEMM_ROWS` rows of x (prefill chunks) the weight is dequantized once per call and
torch's blocked GEMM does the compute-bound work: the fused kernel only pays off when reading the
weights is the bottleneck (decode).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from scratchlm.inference import cpp_extensions
from scratchlm.inference.cpp_extensions import build_dir  # noqa: F401  (re-exported: build.py prints it)
from scratchlm.inference.quantization import reference

SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_kernels.cpp"
EXTENSION_NAME = "scratchlm_quant_kernels"
GEMM_ROWS = 16  # above this many rows of x (prefill), dequantize once and use torch's blocked GEMM
_extension = cpp_extensions.CppExtension(EXTENSION_NAME, SOURCE, "quantized layers")
_state = _extension.state  # loaded module or the failure, per process (a cache, not configuration)


def load_extension(verbose: bool = False) -> Any | None:
    """The compiled kernel module, building it if needed; None (with one logged warning) on failure."""
    _extension.state = _state  # tests may swap the cache dict
    return _extension.load(verbose)


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
