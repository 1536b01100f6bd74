"""scratchlm's fused CPU attention kernel for the diffusion models (csrc/attention.cpp), with torch's SDPA as fallback.

Policy: `attention(q, k, v)` on (B, T, H, D) float32 CPU tensors runs the C++ kernel when it is built, this CPU
has AVX-512F and `$SCRATCHLM_ISA` (scratchlm.isa) does not cap the kernels below it, the head dim is a multiple of 8
and autograd is not recording (the kernel has no backward); otherwise torch's `scaled_dot_product_attention`. The
fallback is logged once per reason (a warning; at info level while training, where SDPA is the intended path).
`prepare()` builds the kernel ahead (multi-process launchers call it before starting ranks).
Both are exact attention: they differ by float rounding only (~1e-7 relative; the kernel sums in another order).

Why a kernel: at a UNet's top level (thousands of tokens, head dim 8 at reduced width) torch's flash kernel spends its
time outside the arithmetic (GEMM calls with K = head dim, separate max / exp / rescale passes); the kernel keeps a
(batch, head)'s K and V transposed in L2 and each query tile's scores in L1 (keys in lanes), 1.5-2.7x faster there
(benchmarks/sd_pipeline.py --parts attention). Like SDPA it never holds the (T, S) score matrix: 8 x 512 floats.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from scratchlm import isa
from scratchlm.inference.cpp_extensions import CppExtension

log = logging.getLogger(__name__)

EXTENSION = CppExtension("scratchlm_diffusion_attention", Path(__file__).resolve().parent / "csrc" / "attention.cpp",
                         "diffusion attention (small head dims)", expected_s=60.0)
_logged: set[str] = set()


def _fallback(reason: str, level: int = logging.WARNING) -> None:
    if reason not in _logged:
        _logged.add(reason)
        log.log(level, "diffusion attention: torch's SDPA instead of the fused kernel (%s)", reason)


def _isa_allows() -> bool:
    return isa.ISA_CAPS[isa.isa_cap()] >= isa.ISA_CAPS["avx512"]


def kernel_available() -> bool:
    """Whether the C++ kernel is built (building it on first use) and runs on this CPU under the ISA cap."""
    mod = EXTENSION.load()
    return mod is not None and mod.supported() and _isa_allows()


def prepare() -> None:
    """Build the kernel now if it is not (a failure is only logged: `attention` then uses SDPA)."""
    if os.environ.get("SCRATCHLM_QUANT_NO_EXTENSION"):
        return
    try:
        EXTENSION.ensure_built()
    except Exception as e:
        log.warning("could not build %s (%s: %s); attention will use torch's SDPA", EXTENSION.purpose,
                    type(e).__name__, e)


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D)) v: q (B, T, H, D), k/v (B, S, H, D) -> (B, T, H, D)."""
    mod = EXTENSION.load()
    reason = None
    if mod is None:
        reason = "the C++ kernel could not be built"
    elif not mod.supported():
        reason = "this CPU has no AVX-512F"
    elif not _isa_allows():
        reason = f"SCRATCHLM_ISA={isa.isa_cap()} caps the kernels below AVX-512"
    elif q.dtype != torch.float32 or q.device.type != "cpu":
        reason = f"{q.dtype} on {q.device.type}: the kernel takes float32 on the CPU"
    elif q.shape[-1] % 8:
        reason = f"head dim {q.shape[-1]} is not a multiple of 8"
    elif torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        _fallback("autograd is recording: the kernel has no backward", logging.INFO)
    elif q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1:
        return mod.attention(q, k, v, q.shape[-1] ** -0.5)
    else:
        reason = "the head dim is not contiguous in memory"
    if reason is not None:
        _fallback(reason)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2)  # (B, T, H, D)
