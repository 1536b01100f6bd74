"""The 8-row integer kernels (paths 6, AVX512-VNNI, and 7, AVX2 int4, of `quant_linear`, csrc/quant_gemm.h): every
format, ragged row counts and 1-13 rows of x against paths 2 / 1 (the same integer sums) and against float64 within
the int8-activation bound; the default dispatch, and the switch back to float activations. The prefill panel
kernels (paths 8, AVX512-VNNI int4 / int8, and 9, AVX2 int4; more than 64 rows of x) against the 8-row kernels row
by row, the bound, batch independence, extreme codes, and the Python modules' path above 64 rows."""

from __future__ import annotations

import pytest
import torch

from scratchlm.inference.quantization import kernels
from scratchlm.inference.quantization import reference as ref
from tests.inference.quantization.helpers import assert_within_integer_bound, engine_kernels_or_fail


@pytest.fixture(scope="module")
def ext():
    module = engine_kernels_or_fail()
    if module.quant_best_path() < 1:
        pytest.skip("no AVX2 on this CPU: paths 6 and 7 fall back to the scalar path (tested in test_quant_gemm)")
    return module


def _paths(ext, fmt: str) -> list[tuple[int, int]]:
    """(8-row path, path with the same integer sums) that this CPU runs for fmt."""
    vnni = ext.quant_best_path() == 2
    out = [(6, 2)] if vnni else []
    return out + ([(7, 1)] if fmt.startswith("int4") else [])


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
    paths = _paths(ext, fmt)
    if not paths:
        pytest.skip("no AVX512-VNNI: no 8-row int8 kernel on this CPU")
    for path, twin in paths:
        assert ext.quant_resolved_path(tensors, g, k, rows, path) == path
        got = ext.quant_linear(x, tensors, g, path)
        torch.testing.assert_close(got, ext.quant_linear(x, tensors, g, twin), rtol=1e-5, atol=1e-5)
        assert_within_integer_bound(got, x, wd, f"path {path} {fmt}")
        for r in range(rows):  # a row's result does not depend on the other rows (the fused step's batching)
            one = ext.quant_linear(x[r : r + 1], tensors, g, path)
            torch.testing.assert_close(got[r : r + 1], one, rtol=0, atol=0)

def test_default_dispatch_and_float_switch(ext):
    tensors, wd, g = _weight("int4-asym", 32, 576, 32, seed=3)
    x = torch.randn(1, 576)
    t8 = 6 if ext.quant_best_path() == 2 else 7
    previous = kernels.float_activations()
    try:
        kernels.float_activations(False)
        assert ext.quant_resolved_path(tensors, g, 576, 1) == t8
        assert ext.quant_resolved_path(tensors, g, 576, 64) == t8
        assert ext.quant_resolved_path(tensors, g, 576, 65) == t8 + 2  # above kMaxRows: the panel kernels (8 / 9)
        assert ext.quant_resolved_path(tensors, g, 576, 512) == t8 + 2
        assert kernels.integer_prefill()
        kernels.integer_prefill(False)  # the switch back to dequantize + fp32 for prefill only
        assert ext.quant_resolved_path(tensors, g, 576, 65) == 0 and ext.quant_resolved_path(tensors, g, 576, 64) == t8
        kernels.integer_prefill(True)
        torch.testing.assert_close(ext.quant_linear(x, tensors, g), ext.quant_linear(x, tensors, g, t8), rtol=0, atol=0)
        q8, s8 = ref.quantize_int8(torch.randn(8, 172))
        assert ext.quant_resolved_path([q8, s8], 172, 172, 1) not in (6, 7)  # K % 32 != 0: no 8-row int8 kernel
        q8, s8 = ref.quantize_int8(torch.randn(8, 576), 32)
        if t8 == 6:  # int8 on VNNI: the 4-row integer kernel at 1 row (memory-bound), the 8-row one from 2 rows
            assert [ext.quant_resolved_path([q8, s8], 32, 576, m) for m in (1, 2, 8, 64)] == [2, 6, 6, 6]
        else:  # AVX2 without VNNI: no 8-row int8 kernel, float activations
            assert [ext.quant_resolved_path([q8, s8], 32, 576, m) for m in (1, 8)] == [4, 3]
        assert ext.quant_resolved_path([q8, s8], 32, 576, 65) == (8 if t8 == 6 else 0)  # int8 prefill: as decode
        assert not kernels.float_activations()
        kernels.float_activations(True)
        assert ext.quant_resolved_path(tensors, g, 576, 1) == 4 and ext.quant_resolved_path(tensors, g, 576, 8) == 3
        assert ext.quant_resolved_path(tensors, g, 576, 65) == 0
        assert [ext.quant_resolved_path([q8, s8], 32, 576, m) for m in (1, 8)] == [4, 3]
        torch.testing.assert_close(ext.quant_linear(x, tensors, g), x @ wd.t(), rtol=1e-5, atol=1e-5)
    finally:
        kernels.float_activations(previous)
        kernels.integer_prefill(True)

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
    for path in (6, 7):  # (6 resolves to path 1 without VNNI)
        assert_within_integer_bound(ext.quant_linear(x, [q4, d, m], 32, path), x, wd, f"int4 extremes, path {path}")
    q8 = torch.full((n, k), 127, dtype=torch.int8)
    q8[1::2] = -127
    s8 = torch.full((n, k // 32), 0.01)
    wd8 = ref.dequantize_int8(q8, s8)
    assert_within_integer_bound(ext.quant_linear(x, [q8, s8], 32, 6), x, wd8, "int8 extremes")


def _panel_paths(ext, fmt: str) -> list[tuple[int, int]]:
    """(panel path, 8-row path with the same integer sums and float order) that this CPU runs for fmt."""
    vnni = ext.quant_best_path() == 2
    out = [(8, 6)] if vnni else []
    return out + ([(9, 7)] if fmt.startswith("int4") else [])


# n: whole 16-row panels, a ragged end (zero-padded panel), fewer than 16 rows; K one block, 576, 1536; g32 / g128
PANEL_CASES = [("int4-asym", 32, 576, 32), ("int4-sym", 37, 576, 32), ("int4-asym", 5, 1536, 128),
               ("int4-sym", 24, 32, 32), ("int4-asym", 19, 1536, 32), ("int8", 40, 576, None), ("int8", 27, 576, 32),
               ("int8", 16, 1536, 128), ("int8", 9, 64, 32)]


@pytest.mark.parametrize("fmt,n,k,group", PANEL_CASES)
@pytest.mark.parametrize("rows", [65, 67, 130])  # x-row chunks of 4, 2, 1
def test_panel_matches_t8_row_by_row_and_bound(ext, fmt, n, k, group, rows):
    tensors, wd, g = _weight(fmt, n, k, group, seed=n + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, 3] *= 40.0  # an outlier channel
    paths = _panel_paths(ext, fmt)
    if not paths:
        pytest.skip("no AVX512-VNNI: no int8 panel kernel on this CPU")
    for path, twin in paths:
        assert ext.quant_resolved_path(tensors, g, k, rows, path) == path
        got = ext.quant_linear(x, tensors, g, path)
        # the 8-row kernel on the same x rows: the same integer sums, the same float order (a ragged end of the
        # 8-row kernels goes through path 2 / 1, another float order)
        torch.testing.assert_close(got, ext.quant_linear(x, tensors, g, twin), rtol=1e-5, atol=1e-5)
        assert_within_integer_bound(got, x, wd, f"panel path {path} {fmt}")
        # each row independent of the batch: a row alone, and the rows in another order and company
        for r in (0, rows // 2, rows - 1):
            torch.testing.assert_close(got[r : r + 1], ext.quant_linear(x[r : r + 1], tensors, g, path), rtol=0, atol=0)
        perm = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(ext.quant_linear(x[perm], tensors, g, path), got[perm], rtol=0, atol=0)
        torch.testing.assert_close(ext.quant_linear(x[: rows - 3], tensors, g, path), got[: rows - 3], rtol=0, atol=0)


def test_panel_extreme_codes(ext):
    """All-15 / all-0 nibbles and +-127 int8 codes with large x through the panels: no int32 overflow and no int16
    saturation in the AVX2 kernel (16 products of 15 * 127 per lane)."""
    n, k, rows = 24, 1536, 66
    q4 = torch.full((n, k // 2), 0xFF, dtype=torch.uint8)
    q4[::2] = 0
    d = torch.full((n, k // 32), 0.01, dtype=torch.float16)
    m = torch.full((n, k // 32), -0.07, dtype=torch.float16)
    x = torch.full((rows, k), 3.0)
    x[1::2] = -3.0
    wd = ref.dequantize_int4(q4, d, m, 32)
    for path in (8, 9):  # (8 resolves to 9 without VNNI)
        got = ext.quant_linear(x, [q4, d, m], 32, path)
        assert_within_integer_bound(got, x, wd, f"int4 extremes, path {path}")
    q8 = torch.full((n, k), 127, dtype=torch.int8)
    q8[1::2] = -127
    q8[:, ::7] = -128 + 1
    s8 = torch.full((n, k // 32), 0.01)
    wd8 = ref.dequantize_int8(q8, s8)
    assert_within_integer_bound(ext.quant_linear(x, [q8, s8], 32, 8), x, wd8, "int8 extremes")


def test_python_modules_take_the_panels_above_64_rows(ext):
    """`kernels.int4_linear` (the unfused path) runs quant_linear's default for a prefill chunk too: the same
    numbers as the fused step's dispatch (the panel kernel with integer activations, the dequantized matmul with
    float ones)."""
    tensors, wd, g = _weight("int4-asym", 48, 576, 32, seed=5)
    q, d, m = tensors
    x = torch.randn(2, 100, 576, generator=torch.Generator().manual_seed(2))
    previous = kernels.float_activations()
    try:
        kernels.float_activations(False)
        got = kernels.int4_linear(x, q, d, m, g)
        assert got.shape == (2, 100, 48)
        panel = ext.quant_linear(x.view(200, 576), tensors, g, 8 if ext.quant_best_path() == 2 else 9)
        torch.testing.assert_close(got.view(200, 48), panel, rtol=0, atol=0)
        kernels.float_activations(True)
        torch.testing.assert_close(kernels.int4_linear(x, q, d, m, g), x @ wd.t(), rtol=1e-5, atol=1e-4)
    finally:
        kernels.float_activations(previous)
