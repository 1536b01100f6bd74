"""scratchlm's fused attention kernel (csrc/attention.cpp) against float64 attention and torch's SDPA."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from scratchlm.diffusion import fused_attention as fa
from scratchlm.diffusion.layers import attention, attention_impl


def _ref64(q, k, v):
    s = torch.einsum("bthd,bshd->bhts", q.double(), k.double()) * q.shape[-1] ** -0.5
    return torch.einsum("bhts,bshd->bthd", s.softmax(-1), v.double())


def _need_kernel():
    if not fa.kernel_available():
        pytest.skip("the fused attention kernel does not run here (no AVX-512F, capped, or not built)")


@pytest.mark.parametrize("b,t,s,h,d", [(1, 5, 7, 1, 8), (2, 64, 64, 4, 8), (2, 37, 77, 3, 16), (1, 130, 129, 2, 8),
                                       (1, 20, 1100, 2, 8), (1, 9, 1030, 1, 16),
                                       (1, 33, 17, 2, 32), (2, 16, 16, 1, 40)])
def test_kernel_equals_float64_attention(b, t, s, h, d):
    _need_kernel()
    g = torch.Generator().manual_seed(t * s + d)
    q, k, v = (torch.randn(b, n, h, d, generator=g) * 3 for n in (t, s, s))
    out = fa.attention(q, k, v)
    ref = _ref64(q, k, v)
    sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    assert out.shape == (b, t, h, d) and out.is_contiguous()
    # float32 rounding only: the kernel is no further from float64 than torch's SDPA is (with a little slack)
    assert (out - ref).abs().max().item() <= max(2e-6, 2 * (sdpa - ref).abs().max().item())


def test_kernel_takes_strided_projection_views():
    """q/k/v as a UNet hands them over: (B, T, H*D) projections viewed as heads, and slices of a fused QKV."""
    _need_kernel()
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(2, 50, 3 * 4 * 8, generator=g)
    q, k, v = (x.view(2, 50, 4, 8) for x in qkv.chunk(3, dim=-1))  # row stride 96, not contiguous
    assert not q.is_contiguous()
    assert torch.allclose(fa.attention(q, k, v), _ref64(q, k, v).float(), atol=2e-6)


def test_layers_attention_dispatch():
    """"fused" (default) and "sdpa" agree to float rounding, whichever kernel `fused_kernel_pays` picks."""
    g = torch.Generator().manual_seed(1)
    for d in (8, 16, 24):
        q, k, v = (torch.randn(1, 40, 2, d, generator=g) for _ in range(3))
        fused = attention(q, k, v)
        with attention_impl("sdpa"):
            sdpa = attention(q, k, v)
        with attention_impl("math"):
            math = attention(q, k, v)
        assert torch.allclose(fused, sdpa, atol=2e-6) and torch.allclose(math, sdpa, atol=2e-6)
    with pytest.raises(ValueError, match="attention impl"):
        attention_impl("flash")


def test_autograd_falls_back_to_sdpa(caplog):
    q, k, v = (torch.randn(1, 9, 2, 8, requires_grad=True) for _ in range(3))
    with caplog.at_level(logging.INFO, logger="scratchlm.diffusion.fused_attention"):
        out = fa.attention(q, k, v)
    out.sum().backward()  # SDPA's backward: the kernel has none
    assert q.grad is not None and q.grad.shape == q.shape
