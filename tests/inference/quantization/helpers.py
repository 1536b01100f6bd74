"""Shared by the quantized-kernel tests: the error bound of a matmul whose x is rounded to int8 per 32-block."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F


def integer_bound(x: torch.Tensor, wd: torch.Tensor, rtol: float = 1e-4) -> torch.Tensor:
    """(M, N) bound on |x wd^T - y| for y from x rounded to int8 per 32-block (|error| <= amax_b / 254 per element
    of block b) plus float32 summation error: sum_b amax_b / 254 sum_{k in b} |w_k| + rtol |x| |w|^T + 1e-5."""
    k = x.shape[-1]
    xb = F.pad(x.abs(), (0, (-k) % 32)).view(x.shape[0], -1, 32).amax(-1).double()  # (M, blocks)
    wb = F.pad(wd.abs(), (0, (-k) % 32)).view(wd.shape[0], -1, 32).sum(-1).double()  # (N, blocks)
    return xb @ wb.t() / 254 + rtol * (x.abs().double() @ wd.abs().double().t()) + 1e-5


def assert_within_integer_bound(got: torch.Tensor, x: torch.Tensor, wd: torch.Tensor, msg: str = "") -> None:
    want = x.double() @ wd.double().t()
    err = (got.double() - want).abs()
    bound = integer_bound(x, wd)
    assert (err <= bound).all(), f"{msg}: error {err.max().item():.3g} above the int8-activation bound"


def engine_kernels_or_fail():
    """The engine extension; a failed build fails the test (a test on the torch fallback proves nothing about the
    kernels) unless the extension is turned off on purpose ($SCRATCHLM_QUANT_NO_EXTENSION)."""
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    module = load_engine_kernels()
    if module is None:
        if os.environ.get("SCRATCHLM_QUANT_NO_EXTENSION"):
            pytest.skip("SCRATCHLM_QUANT_NO_EXTENSION is set")
        pytest.fail("the engine's C++ kernels did not build (see the logged warning)")
    return module
