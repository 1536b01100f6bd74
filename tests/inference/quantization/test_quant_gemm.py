"""The engine's quantized matmuls (`csrc/quant_gemm.h` via `quant_linear`): every code path against float64
dequantize-then-matmul, the dequantization bit-equal to the reference and to gguf.quants, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from scratchlm.inference.quantization import reference as ref
from scratchlm.inference.quantization.gguf_packed import unpack_gguf_blocks
from tests.inference.quantization.helpers import assert_within_integer_bound, engine_kernels_or_fail, integer_bound


@pytest.fixture(scope="module")
def ext():
    return engine_kernels_or_fail()


def _weight(fmt: str, n: int, k: int, group: int | None, seed: int):
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if fmt == "int8":
        q, s = ref.quantize_int8(w, group)
        return [q, s], ref.dequantize_int8(q, s), group or k
    q, d, m = ref.quantize_int4(w, group, fmt == "int4-sym")
    return [q, d] + ([] if m is None else [m]), ref.dequantize_int4(q, d, m, group), group


FORMATS = [("int8", 37, 576, None), ("int8", 20, 172, None), ("int8", 33, 96, 32), ("int4-sym", 21, 576, 32),
           ("int4-asym", 19, 576, 32), ("int4-asym", 18, 576, 128), ("int4-sym", 9, 64, 64)]
EXACT_PATHS = [0, 3, 4]  # portable (dequantize + ATen), FMA tiles, codes to floats in registers + FMA
# x rounded to int8 per 32-block: AVX2, VNNI, scalar, 8-row VNNI, 8-row AVX2, panel VNNI, panel AVX2 (each runs at
# any row count when asked for; a path this CPU or layout lacks resolves to another)
INTEGER_PATHS = [1, 2, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("fmt,n,k,group", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 64, 70])  # 70 > 64: the prefill paths (int4: panels; float: GEMM)
def test_quant_linear_paths_match_dequantized_matmul(ext, fmt, n, k, group, rows):
    tensors, wd, g = _weight(fmt, n, k, group, seed=n + rows)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    want = x.double() @ wd.double().t()
    for path in EXACT_PATHS:  # the same float32 weights: only the summation order differs
        got = ext.quant_linear(x, tensors, g, path)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4, msg=f"path {path}")
    # Integer paths round x to int8 per 32-block (|error| <= amax / 254 per element): bounded by that. The default
    # (-1) is one of the two kinds, by CPU.
    bound = integer_bound(x, wd)
    outs = [ext.quant_linear(x, tensors, g, p) for p in INTEGER_PATHS + [-1]]
    for path, got in zip(INTEGER_PATHS + [-1], outs):
        assert ((got.double() - want).abs() <= bound).all(), f"integer path {path}"
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # AVX2 and VNNI: same integer sums, same order
    # the 8-row kernel: the same integer sums, its float sums in another order
    torch.testing.assert_close(outs[3], outs[1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[4], outs[0], rtol=1e-4, atol=1e-4)
    # the panels: the 8-row kernels' sums and order (their ragged ends run paths 2 / 1: another order)
    torch.testing.assert_close(outs[5], outs[3], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(outs[6], outs[4], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt,n,k,group", FORMATS)
def test_quant_dequantize_is_bit_equal_to_reference(ext, fmt, n, k, group):
    tensors, wd, g = _weight(fmt, n, k, group, seed=1)
    assert torch.equal(ext.quant_dequantize(tensors, g, k), wd)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_dequantize_bit_equal_to_gguf_quants(ext, type_name):
    from gguf import GGMLQuantizationType, quants

    w = np.random.default_rng(0).standard_normal((24, 96)).astype(np.float32)
    qtype = GGMLQuantizationType[type_name]
    raw = quants.quantize(w, qtype)
    oracle = torch.from_numpy(np.array(quants.dequantize(raw, qtype), dtype=np.float32)).reshape(24, 96)
    planes = unpack_gguf_blocks(raw, type_name, 24, 96)
    tensors = [planes["qweight"], planes["scales"]] + ([planes["mins"]] if "mins" in planes else [])
    assert torch.equal(ext.quant_dequantize(tensors, 32, 96), oracle)
    x = torch.randn(3, 96)
    torch.testing.assert_close(ext.quant_linear(x, tensors, 32, 4), x @ oracle.T, rtol=1e-5, atol=1e-5)  # float x
    assert_within_integer_bound(ext.quant_linear(x, tensors, 32), x, oracle, "default path")


def test_quant_linear_rejects_bad_input(ext):
    q, s = ref.quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="int8 needs q"):
        ext.quant_linear(torch.randn(2, 64), [q, s[:4]], 64)
    with pytest.raises(RuntimeError, match="group_size must be positive"):
        ext.quant_linear(torch.randn(2, 64), [q, s], 0)
    q4, d, _ = ref.quantize_int4(torch.randn(8, 64), 32, True)
    with pytest.raises(RuntimeError, match="float16"):
        ext.quant_linear(torch.randn(2, 64), [q4, d.float()], 32)
    q8, s8 = ref.quantize_int8(torch.randn(8, 64), 16)
    with pytest.raises(RuntimeError, match="not supported by the integer kernels"):
        ext.quant_linear(torch.randn(2, 64), [q8, s8], 16)
