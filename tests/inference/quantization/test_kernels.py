"""The fused C++ kernels (AVX2 and scalar paths) against the pure-torch reference, and the fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from scratchlm.inference.quantization import kernels
from scratchlm.inference.quantization import reference as ref
from tests.inference.quantization.helpers import assert_within_integer_bound, integer_bound


@pytest.fixture(scope="module")
def ext():
    module = kernels.load_extension()
    if module is None:
        pytest.skip("C++ extension unavailable (no compiler?): the reference path is tested elsewhere")
    return module


PATHS = [True, False]  # use_simd: AVX2 (when the CPU has it) and the portable scalar path


@pytest.mark.parametrize("use_simd", PATHS)
@pytest.mark.parametrize("m_rows", [1, 3, 9])  # 9 > 4: the decode-row-then-dot GEMM path
@pytest.mark.parametrize("k, group", [(172, None), (64, None), (96, 32), (576, None)])
def test_int8_kernel_matches_reference(ext, use_simd, m_rows, k, group):
    gen = torch.Generator().manual_seed(k + m_rows)
    w = torch.randn(40, k, generator=gen)
    x = torch.randn(m_rows, k, generator=gen)
    q, s = ref.quantize_int8(w, group)
    got = kernels.int8_linear(x, q, s, group or k, use_simd=use_simd)
    # float kernels match to float32 rounding; the integer ones (AVX512-VNNI default) within their x-rounding bound
    assert_within_integer_bound(got, x, ref.dequantize_int8(q, s), "int8_linear")


@pytest.mark.parametrize("use_simd", PATHS)
@pytest.mark.parametrize("m_rows", [1, 2, 7])
@pytest.mark.parametrize("k, group", [(64, 32), (576, 128), (256, 128), (96, 64)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_kernel_matches_reference(ext, use_simd, m_rows, k, group, symmetric):
    gen = torch.Generator().manual_seed(k * 3 + m_rows)
    w = torch.randn(33, k, generator=gen)
    x = torch.randn(m_rows, k, generator=gen)
    q, d, m = ref.quantize_int4(w, group, symmetric)
    got = kernels.int4_linear(x, q, d, m, group, use_simd=use_simd)
    assert_within_integer_bound(got, x, ref.dequantize_int4(q, d, m, group), "int4_linear")


def test_kernels_keep_batch_dims_and_dtype(ext):
    w = torch.randn(16, 64)
    q, d, m = ref.quantize_int4(w, 32)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    y = kernels.int4_linear(x, q, d, m, 32)
    assert y.shape == (2, 3, 16) and y.dtype == torch.bfloat16
    wd = ref.dequantize_int4(q, d, m, 32)
    x2 = x.float().reshape(-1, 64)
    err = (y.double().reshape(-1, 16) - x2.double() @ wd.double().t()).abs()
    assert (err <= integer_bound(x2, wd, rtol=1e-2)).all()  # bfloat16 in and out: 1 % of |x| |w|


def test_kernel_rejects_bad_input(ext):
    q, s = ref.quantize_int8(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match=r"x must be \(M, 64\)"):
        ext.int8_linear(torch.randn(2, 32), q, s, 64, True)


def test_reference_matches_dequantize_then_matmul():
    """The reference is itself checked against an independent float matmul of the dequantized weight."""
    w = torch.randn(24, 64, dtype=torch.float64)
    q, d, m = ref.quantize_int4(w.float(), 32, symmetric=True)
    deq = ref.dequantize_int4(q, d, m, 32).double()
    x = torch.randn(5, 64, dtype=torch.float64)
    torch.testing.assert_close(ref.reference_linear(x.float(), deq.float()).double(), x @ deq.T, rtol=1e-4, atol=1e-4)


def test_build_failure_falls_back_with_a_warning(monkeypatch, tmp_path, caplog):
    """A source that does not compile (a real build, in an empty cache) gives None and a warning naming the
    compiler's error; the quantized layers then run without the older extension."""
    from scratchlm.inference.cpp_extensions import CppExtension

    broken = tmp_path / "src" / "broken.cpp"
    broken.parent.mkdir()
    broken.write_text("this is not C++;\n")
    monkeypatch.setenv("SCRATCHLM_QUANT_BUILD_DIR", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        assert CppExtension("scratchlm_broken_test", broken, "a broken test extension", 1.0).load() is None
    assert "pure-torch reference path" in caplog.text and "error" in caplog.text
    monkeypatch.setattr(kernels, "_state", {"module": None})  # the older extension as a failed build left it
    assert kernels.load_extension() is None
    w = torch.randn(8, 64)
    q, d, m = ref.quantize_int4(w, 32)
    x = torch.randn(1, 64)
    # the engine's kernels (when an earlier test built them) or the reference: either within the int8-x bound
    assert_within_integer_bound(kernels.int4_linear(x, q, d, m, 32), x, ref.dequantize_int4(q, d, m, 32), "fallback")
