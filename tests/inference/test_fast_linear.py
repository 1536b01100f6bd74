"""The skinny-GEMM kernel (decode matmuls) against torch's matmul, and the module swap."""

from __future__ import annotations

import pytest
import torch

from scratchlm.inference import fast_linear
from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import Linear
from scratchlm.model.transformer import TransformerLM


@pytest.fixture(scope="module")
def kernels():
    ext = fast_linear.load_kernels()
    if ext is None:
        pytest.skip("the skinny-GEMM kernel could not be built here (torch's matmul is used instead)")
    return ext


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 33])
@pytest.mark.parametrize("n,k", [(4, 8), (13, 64), (70, 576), (5, 6)])
@pytest.mark.parametrize("use_simd", [True, False])
def test_kernel_matches_matmul(kernels, m: int, n: int, k: int, use_simd: bool) -> None:
    torch.manual_seed(m * 100 + n)
    x, w = torch.randn(m, k), torch.randn(n, k)
    torch.testing.assert_close(kernels.skinny_linear(x, w, use_simd), x @ w.T, atol=1e-4, rtol=1e-4)


def test_kernel_rejects_bad_shapes(kernels) -> None:
    with pytest.raises(RuntimeError, match="K = "):
        kernels.skinny_linear(torch.randn(2, 8), torch.randn(3, 16))
    with pytest.raises(RuntimeError, match="float32"):
        kernels.skinny_linear(torch.randn(2, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64))


def test_skinny_linear_dispatch() -> None:
    """Few rows use the kernel; many rows, autograd and other dtypes fall back to torch with equal results."""
    w = torch.randn(32, 16)
    for rows in (1, 5, fast_linear.MAX_ROWS + 1):
        x = torch.randn(2, rows, 16)
        torch.testing.assert_close(fast_linear.skinny_linear(x, w), x @ w.T, atol=1e-5, rtol=1e-5)
    xg = torch.randn(3, 16, requires_grad=True)
    fast_linear.skinny_linear(xg, w).sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand(3, 16))
    xb = torch.randn(3, 16, dtype=torch.bfloat16)
    assert fast_linear.skinny_linear(xb, w.bfloat16()).dtype == torch.bfloat16


def test_swap_keeps_weights_and_outputs() -> None:
    """Without packing, the swapped linears share the plain weights (the fallback where kernels cannot be built)."""
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=32)
    model = TransformerLM(cfg).eval()
    tokens = torch.randint(0, 64, (1, 7))
    with torch.no_grad():
        want = model(tokens)
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    n = fast_linear.use_skinny_linears(model, pack=False)
    assert n == 2 * 7  # q, k, v, o, w1, w2, w3 per layer
    assert not any(type(m) is Linear for m in model.modules())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == weights  # shared, not copied
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), want, atol=1e-5, rtol=1e-5)


def test_kernels_build_where_a_compiler_exists() -> None:
    """The tests above skip without the extension; on an x86-64 Linux box with a C++ compiler it must build
    (a silent fallback to torch would make them prove nothing about the kernels)."""
    import platform
    import shutil

    if platform.machine() not in ("x86_64", "AMD64") or shutil.which("c++") is None:
        pytest.skip("no x86-64 C++ toolchain here")
    assert fast_linear.load_kernels() is not None


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 8, 9, 16, 17, 31, 64])
@pytest.mark.parametrize("n,k", [(7, 16), (9, 48), (33, 1536), (6, 24)])
def test_kernel_tiles_and_remainders(kernels, m: int, n: int, k: int) -> None:
    """Every row/column remainder of the 4 x 4 (AVX-512, K % 16 == 0) and 4 x 2 / 4 x 3 (AVX2) tiles."""
    torch.manual_seed(m * 1000 + n + k)
    x, w = torch.randn(m, k), torch.randn(n, k)
    torch.testing.assert_close(kernels.skinny_linear(x, w), x @ w.T, atol=1e-4 * (k / 64) ** 0.5, rtol=1e-4)


@pytest.mark.parametrize("m", [65, 130, 511, 512])
def test_large_rows_gemm_matches_matmul(kernels, m: int) -> None:
    """More than 64 rows (prefill): oneDNN's matmul up to 511 rows where torch has it, MKL above
    (csrc/skinny_gemm.h large_gemm), the same product as torch's to float32 rounding."""
    torch.manual_seed(m)
    x, w = torch.randn(m, 576), torch.randn(200, 576)
    torch.testing.assert_close(kernels.quant_linear(x, [w], 0), x @ w.T, atol=2e-4, rtol=1e-4)
