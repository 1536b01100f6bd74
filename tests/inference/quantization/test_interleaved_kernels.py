"""The 8-row integer kernels (path 6 of `quant_linear`, csrc/quant_gemm.h): every format, ragged row counts and
1-13 rows of x against path 2 (the same integer sums) and against float64 within the int8-activation bound; the
default dispatch, and the switch back to float activations."""

from __future__ import annotations

import pytest
import torch

from scratchlm.inference.quantization import kernels
from scratchlm.inference.quantization import reference as ref
from tests.inference.quantization.helpers import assert_within_integer_bound, engine_kernels_or_fail


@pytest.fixture(scope="module")
def ext():
    module = engine_kernels_or_fail()
    if module.quant_best_path() < 2:
        pytest.skip("no AVX512-VNNI on this CPU: path 6 falls back to path 1 / 0 (tested in test_quant_gemm)")
    return module


def _weight(fmt: str, n: int, k: int, group: int | None, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt == "int8":
        q, s = ref.quantize_int8(w, group)
        return [q, s], ref.dequantize_int8(q, s), group or k
    q, d, m = ref.quantize_int4(w, group, fmt == "int4-sym")
    return [q, d] + ([] if m is None else [m]), ref.dequantize_int4(q, d, m, group), group


# n = 8 tiles exactly, or a ragged end (path 2 takes the last n % 8 rows); gate/up-like and head-like K
CASES = [("int4-asym", 64, 576, 32), ("int4-sym", 21, 576, 32), ("int4-asym", 19, 1536, 32),
         ("int4-asym", 24, 576, 128), ("int4-sym", 13, 64, 64), ("int8", 40, 576, None), ("int8", 27, 576, 32),
         ("int8", 16, 1536, 32), ("int8", 9, 256, 128)]


@pytest.mark.parametrize("fmt,n,k,group", CASES)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 13])  # every chunk of the x-row loop (8, 4, 2, 1)
def test_t8_matches_integer_path_and_bound(ext, fmt, n, k, group, rows):
    tensors, wd, g = _weight(fmt, n, k, group, seed=n * rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, 7] *= 40.0  # an outlier channel, as SmolLM2's activations have
    assert ext.quant_resolved_path(tensors, g, k, rows, 6) == 6
    got = ext.quant_linear(x, tensors, g, 6)
    torch.testing.assert_close(got, ext.quant_linear(x, tensors, g, 2), rtol=1e-5, atol=1e-5)
    assert_within_integer_bound(got, x, wd, f"path 6 {fmt}")
    for r in range(rows):  # a row's result does not depend on the other rows (the fused step's batching)
        torch.testing.assert_close(got[r : r + 1], ext.quant_linear(x[r : r + 1], tensors, g, 6), rtol=0, atol=0)


def test_default_dispatch_and_float_switch(ext):
    tensors, wd, g = _weight("int4-asym", 32, 576, 32, seed=3)
    x = torch.randn(1, 576)
    previous = kernels.float_activations()
    try:
        kernels.float_activations(False)
        assert ext.quant_resolved_path(tensors, g, 576, 1) == 6
        assert ext.quant_resolved_path(tensors, g, 576, 64) == 6
        assert ext.quant_resolved_path(tensors, g, 576, 65) == 0  # above kMaxRows: dequantize + ATen
        torch.testing.assert_close(ext.quant_linear(x, tensors, g), ext.quant_linear(x, tensors, g, 6), rtol=0, atol=0)
        q8, s8 = ref.quantize_int8(torch.randn(8, 172))
        assert ext.quant_resolved_path([q8, s8], 172, 172, 1) != 6  # K % 32 != 0: not for the 8-row int8 kernel
        assert not kernels.float_activations()
        kernels.float_activations(True)
        assert ext.quant_resolved_path(tensors, g, 576, 1) == 4 and ext.quant_resolved_path(tensors, g, 576, 8) == 3
        torch.testing.assert_close(ext.quant_linear(x, tensors, g), x @ wd.t(), rtol=1e-5, atol=1e-5)
    finally:
        kernels.float_activations(previous)


def test_t8_extreme_codes(ext):
    """All-15 / all-0 nibbles and +-127 int8 codes with large x: the int32 sums cannot overflow or saturate."""
    n, k = 16, 1536
    q4 = torch.full((n, k // 2), 0xFF, dtype=torch.uint8)
    q4[::2] = 0
    d = torch.full((n, k // 32), 0.01, dtype=torch.float16)
    m = torch.full((n, k // 32), -0.07, dtype=torch.float16)
    x = torch.full((2, k), 3.0)
    x[1] = -3.0
    wd = ref.dequantize_int4(q4, d, m, 32)
    assert_within_integer_bound(ext.quant_linear(x, [q4, d, m], 32, 6), x, wd, "int4 extremes")
    q8 = torch.full((n, k), 127, dtype=torch.int8)
    q8[1::2] = -127
    s8 = torch.full((n, k // 32), 0.01)
    wd8 = ref.dequantize_int8(q8, s8)
    assert_within_integer_bound(ext.quant_linear(x, [q8, s8], 32, 6), x, wd8, "int8 extremes")
