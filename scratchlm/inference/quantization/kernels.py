"""The C++ kernels (csrc/quant_kernels.cpp): JIT build with a cache, and dispatch with a pure-torch fallback.

`load_extension()` compiles once through `scratchlm.inference.cpp_extensions` (cache directory, one
warning and the pure-torch reference path when the build fails: nothing crashes).

`int8_linear` / `int4_linear` are what the quantized modules call. On CPU they run the engine extension's
`quant_linear` (`inference/csrc/quant_gemm.h`, `qlinear.h`) for any number of rows, the very kernels (and
dispatch) of the fused decode step, so the Python path and the fused step give the same logits in decode and in
prefill: int4 with integer activations (x rounded to int8 per 32-block, as llama.cpp) runs the 8-row integer
kernels up to 64 rows and the panel kernels above (prefill chunks); with `float_activations(True)`, and int8 by
default, float kernels up to 64 rows and, above, the weight dequantized once per call for the float GEMM.
Layouts those kernels do not take (int8 groups that are not multiples of 32) use this module's own older extension
(`csrc/quant_kernels.cpp`: dequantize in registers + FMA) up to `GEMM_ROWS` rows. Above that, and on other devices
(CUDA: no kernel yet), the weight is dequantized and torch's GEMM does the compute-bound work.

`gguf_linear` / `gguf_dequantize` serve GGUF weights kept in their file blocks (K-quants, Q5_0/Q5_1, IQ4_NL,
IQ4_XS: `scheme.GGUF_RAW_TYPES`): on CPU the engine extension's `gguf_linear` (csrc/gguf_gemm.h, the fused step's
kernels and path choice); without it, or on other devices, the reference (`reference.dequantize_gguf`, then a float
matmul). A type the built kernels do not take is refused when the model is loaded (`check_gguf_kernels`), not here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from scratchlm.inference import cpp_extensions
from scratchlm.inference.cpp_extensions import build_dir  # noqa: F401  (re-exported: build.py prints it)
from scratchlm.inference.quantization import reference
from scratchlm.inference.quantization.scheme import GGUF_RAW_TYPES

SOURCE = Path(__file__).resolve().parent / "csrc" / "quant_kernels.cpp"
EXTENSION_NAME = "scratchlm_quant_kernels"
GEMM_ROWS = 64  # the older extension's limit: above this many rows of x, dequantize once and use torch's GEMM
EXTENSION = cpp_extensions.CppExtension(EXTENSION_NAME, SOURCE, "quantized layers", expected_s=60.0)
_extension = EXTENSION
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


def _engine_kernels(x: Tensor, use_simd: bool) -> Any | None:
    """The engine extension for `quant_linear` when it applies to x (CPU float rows, any number)."""
    if not use_simd or x.device.type != "cpu" or x.numel() == 0:
        return None
    return cpp_extensions.load_engine_kernels()


def float_activations(enabled: bool | None = None) -> bool:
    """Whether the CPU kernels keep activations in float32 (exact up to the summation order) instead of rounding
    them to int8 per 32-block for the faster integer dot products (the default on AVX512-VNNI CPUs, as
    llama.cpp; see docs/quantization.md "Kernels"); raw GGUF weights then run dequantize + fp32 GEMM at every row
    count (gguf_gemm.h's kDequantPath). `enabled` switches it for the process (also the fused step);
    ``$SCRATCHLM_QUANT_FLOAT_ACTIVATIONS=1`` sets it at start. True without the engine extension (the reference)."""
    eng = cpp_extensions.load_engine_kernels()
    if eng is None:
        return True
    return bool(eng.quant_float_activations(-1 if enabled is None else int(enabled)))


def integer_prefill(enabled: bool | None = None) -> bool:
    """Whether prefill chunks (more than 64 rows) of weights whose decode kernels round x to int8 run the integer
    panel kernels (the default) instead of dequantizing the weight once per call for the fp32 GEMM. `enabled`
    switches it for the process (also the fused step); ``$SCRATCHLM_QUANT_INTEGER_PREFILL=0`` turns it off at
    start. False without the engine extension."""
    eng = cpp_extensions.load_engine_kernels()
    if eng is None:
        return False
    return bool(eng.quant_integer_prefill(-1 if enabled is None else int(enabled)))


def int8_takes(k: int, group_size: int) -> bool:
    """Whether the engine's integer kernels take an int8 layout: one scale per row, or groups of 32s."""
    return group_size >= k or (group_size % 32 == 0 and k % 32 == 0)


def int8_linear(x: Tensor, q: Tensor, scales: Tensor, group_size: int, use_simd: bool = True,
                use_extension: bool = True) -> Tensor:
    """y (..., N) = x (..., K) @ dequant(q, scales)^T; fused C++ kernel on CPU, reference elsewhere."""
    eng = _engine_kernels(x, use_simd) if use_extension and int8_takes(q.shape[1], group_size) else None
    if eng is not None:
        x2 = x.reshape(-1, x.shape[-1]).float()  # (M, K)
        return eng.quant_linear(x2, [q, scales.float()], group_size).view(*x.shape[:-1], q.shape[0]).to(x.dtype)
    ext = _use_extension(x) if use_extension else None
    if ext is None:
        return reference.reference_linear(x, reference.dequantize_int8(q, scales))
    x2 = x.reshape(-1, x.shape[-1]).float()  # (M, K)
    y = ext.int8_linear(x2, q, scales.float(), group_size, use_simd)  # (M, N)
    return y.view(*x.shape[:-1], q.shape[0]).to(x.dtype)


def int4_linear(x: Tensor, q: Tensor, d: Tensor, m: Tensor | None, group_size: int, use_simd: bool = True,
                use_extension: bool = True) -> Tensor:
    """y (..., N) = x (..., K) @ dequant(q, d, m)^T; fused C++ kernel on CPU, reference elsewhere."""
    eng = _engine_kernels(x, use_simd) if use_extension else None
    if eng is not None:
        x2 = x.reshape(-1, x.shape[-1]).float()  # (M, K)
        w = [q, d.half()] + ([] if m is None else [m.half()])
        return eng.quant_linear(x2, w, group_size).view(*x.shape[:-1], q.shape[0]).to(x.dtype)
    ext = _use_extension(x) if use_extension else None
    if ext is None:
        return reference.reference_linear(x, reference.dequantize_int4(q, d, m, group_size))
    x2 = x.reshape(-1, x.shape[-1]).float()  # (M, K)
    y = ext.int4_linear(x2, q, d.half(), None if m is None else m.half(), group_size, use_simd)  # (M, N)
    return y.view(*x.shape[:-1], q.shape[0]).to(x.dtype)


def gguf_kernel_types() -> set[str] | None:
    """The raw GGUF types the engine extension has kernels for; None without the extension (the reference path)."""
    eng = cpp_extensions.load_engine_kernels()
    if eng is None:
        return None
    ids = set(eng.gguf_types())
    return {name for name, (type_id, _, _) in GGUF_RAW_TYPES.items() if type_id in ids}


def check_gguf_kernels(types: dict[str, str], device: str) -> None:
    """Raise ValueError naming every weight (name -> raw GGUF type) whose type the CPU kernels of this build do
    not take, when they would run it (device CPU, extension built); the reference path takes every raw type."""
    if device != "cpu":
        return
    have = gguf_kernel_types()
    if have is None:
        return
    missing = {name: t for name, t in types.items() if t not in have}
    if missing:
        listed = ", ".join(f"{name} ({t})" for name, t in list(missing.items())[:6])
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise ValueError(f"no CPU kernel in this build for GGUF type(s) {', '.join(sorted(set(missing.values())))}: "
                         f"{listed}{more}; kernels here take: {', '.join(sorted(have)) or 'none'}")


def gguf_linear(x: Tensor, raw: Tensor, type_name: str, k: int, use_simd: bool = True,
                use_extension: bool = True) -> Tensor:
    """y (..., N) = x (..., K) @ W^T for W a raw GGUF weight uint8 (N, row_bytes); CPU kernel or the reference."""
    eng = _engine_kernels(x, use_simd) if use_extension else None
    if eng is not None:
        x2 = x.reshape(-1, k).float()  # (M, K)
        y = eng.gguf_linear(x2, raw, GGUF_RAW_TYPES[type_name][0], k)  # (M, N)
        return y.view(*x.shape[:-1], raw.shape[0]).to(x.dtype)
    return reference.reference_linear(x, reference.dequantize_gguf(raw, type_name, k))


def gguf_dequantize(raw: Tensor, type_name: str, k: int, use_extension: bool = True) -> Tensor:
    """Rows of a raw GGUF weight, uint8 (n, row_bytes) -> float32 (n, k): the engine's dequantizer on CPU, the
    reference elsewhere (both gguf.quants' values)."""
    eng = _engine_kernels(raw, True) if use_extension else None
    if eng is not None:
        return eng.gguf_dequantize(raw.contiguous(), GGUF_RAW_TYPES[type_name][0], k)
    return reference.dequantize_gguf(raw, type_name, k)
