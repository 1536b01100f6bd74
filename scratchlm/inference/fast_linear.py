"""Decode-sized matmuls: `skinny_linear(x, w)` = x @ w.T through the C++ kernel `csrc/skinny_gemm.h`.

A decode step multiplies every weight by only as many rows as there are running sequences (1..64).
BLAS GEMMs are tuned for large M; measured on one AVX2 core (`benchmarks/engine_throughput.py`
reports the end-to-end effect), the kernel reads each weight once and is 1.3-1.7x faster than MKL's
sgemm for M = 4..32. Larger M (prefill chunks), other dtypes and other devices keep torch's matmul,
as does a machine where the kernel cannot be built.

`use_skinny_linears(model)` swaps the plain `Linear` layers of a model for `SkinnyLinear` (same weight
Parameter, no copy); `logits(model, h)` computes the output head with the kernel for plain models.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scratchlm.inference.cpp_extensions import load_engine_kernels
from scratchlm.model.layers import Linear

MAX_ROWS = 64  # above this many rows, MKL's blocked GEMM is as fast (prefill)
def load_kernels(verbose: bool = False):
    """The compiled kernel module (`skinny_linear`), or None (torch's matmul) when it cannot be built."""
    return load_engine_kernels(verbose)


def skinny_linear(x: Tensor, w: Tensor) -> Tensor:
    """x (..., K) @ w (N, K).T -> (..., N); the C++ kernel for few float32 CPU rows, torch otherwise."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or rows > MAX_ROWS or x.device.type != "cpu" or x.dtype != torch.float32
            or w.dtype != torch.float32 or torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return x @ w.t()
    ext = load_kernels()
    if ext is None:
        return x @ w.t()
    return ext.skinny_linear(x.reshape(rows, x.shape[-1]), w).view(*x.shape[:-1], w.shape[0])


class SkinnyLinear(Linear):
    """`Linear` whose forward uses `skinny_linear` (same weight layout (d_out, d_in))."""

    @classmethod
    def from_linear(cls, linear: Linear) -> SkinnyLinear:
        new = cls.__new__(cls)
        torch.nn.Module.__init__(new)
        new.d_in, new.d_out, new.weight = linear.d_in, linear.d_out, linear.weight
        return new

    def forward(self, x: Tensor) -> Tensor:
        return skinny_linear(x, self.weight)


def use_skinny_linears(model: torch.nn.Module) -> int:
    """Replace every plain `Linear` in `model` by a `SkinnyLinear` sharing its weight; returns how many."""
    swaps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if type(child) is Linear]
    for parent, name, child in swaps:
        setattr(parent, name, SkinnyLinear.from_linear(child))
    return len(swaps)
