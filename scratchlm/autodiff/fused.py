"""Fused ops: `matmul_layernorm(A, B)` = layernorm(A @ B) and `matmul_softmax(A, B)` = softmax(A @ B),
each with a hand-derived backward written out in torch tensor arithmetic (no ATen backward kernels).

Both take exactly the two inputs (A, B), as in CSE234 PA1: `op.compute(node, [A, B])` and `op.gradient`
returns two nodes. What fusion buys here: one forward node instead of two; the layer norm keeps its 1/std from
the forward pass (on the output tensor; the unfused backward recomputes the variance from the matmul output), so
its backward is r (g - mean(g) - y mean(g y)) on y and g alone, and the softmax's is y (g - sum(g y)), each
feeding the two matmuls, instead of separate node evaluations. Second-order gradients through a fused backward
are derived from the unfused definition (`composite_gradient`), so they stay correct.

`matmul_layernorm` here checks that `normalized_shape` is the trailing dims of A @ B (scratchlm's API); PA1's
interface (`fused_ops.matmul_layernorm`) takes a mismatch as PA1's reference does (`ops.layernorm_dims`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .evaluator import composite_gradient
from .graph import Node, Op
from .ops import (
    _layernorm_composite,
    _name,
    layernorm_dims,
    matmul,
    matmul_grad_b,
    mean,
    mul,
    sub,
    sum_op,
    sum_to,
    transpose,
)


def _check_matmul(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError("matmul needs inputs with at least 2 dims")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"inner dimensions differ: {a.shape[-1]} (last of A) vs {b.shape[-2]} (2nd-last of B)")


def _matmul_input_grads(node: Node, dz: Node) -> list[Node]:
    a, b = node.inputs[0], node.inputs[1]
    return [sum_to(matmul(dz, transpose(b, -1, -2)), a), matmul_grad_b(a, dz, b)]


# ----------------------------------------------------------------------------------------------- layer norm, by hand
def layernorm_forward(z: torch.Tensor, dims: tuple[int, ...], eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, r): y = (z - mean) r over `dims`, r = 1 / sqrt(var + eps) (biased variance), r keeping `dims` as 1s."""
    zc = z - z.mean(dims, keepdim=True)
    rstd = torch.rsqrt((zc * zc).mean(dims, keepdim=True) + eps)
    return zc.mul_(rstd), rstd


def layernorm_backward(g: torch.Tensor, y: torch.Tensor, rstd: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """dL/dz = r (g - mean(g) - y mean(g y)) over `dims`, for y = layernorm(z) with 1/std r (ops.LayerNormGradOp
    derives it: dy_i/dz_j = r (δ_ij - 1/N - y_i y_j / N))."""
    gy_mean = (g * y).mean(dims, keepdim=True)
    return (g - g.mean(dims, keepdim=True)).addcmul_(y, gy_mean, value=-1.0).mul_(rstd)


def softmax_backward(g: torch.Tensor, y: torch.Tensor, dim: int) -> torch.Tensor:
    """dL/dz = y (g - sum(g y)) along `dim`, for y = softmax(z) (dy_i/dz_j = y_i (δ_ij - y_j))."""
    gy = g * y
    return gy.addcmul_(y, gy.sum(dim, keepdim=True), value=-1.0)


# ----------------------------------------------------------------------------------------------- matmul_layernorm
_RSTD = "_scratchlm_layernorm_rstd"  # the forward's 1/std, kept on its output tensor for the backward


class MatMulLayerNormOp(Op):
    """layernorm(A @ B) over the last len(normalized_shape) dims (no affine weight). Two inputs, as in PA1.

    `compute` leaves the reciprocal std (its normalised dims kept as 1s) on the value it returns (a private tensor
    attribute), so the backward does not recompute A @ B; a value that lacks it (fed from outside) makes the
    backward recompute. `strict_shape` as in `ops.LayerNormOp`: False for the PA1 interface's instance.
    """

    name = "matmul_layernorm"

    def __init__(self, strict_shape: bool = True):
        self.strict_shape = strict_shape

    def __call__(self, a: Node, b: Node, normalized_shape: Sequence[int] | int, eps: float = 1e-5) -> Node:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        return Node([a, b], self, {"normalized_shape": shape, "eps": eps}, _name("matmul_layernorm", a, b))

    def compute(self, node, input_values):
        if len(input_values) != 2:
            raise ValueError(f"matmul_layernorm takes 2 input values (A, B), got {len(input_values)}")
        y, rstd = _layernorm_of_matmul(node, *input_values)
        setattr(y, _RSTD, rstd)
        return y

    def gradient(self, node, output_grad):
        return _matmul_input_grads(node, _matmul_layernorm_grad_z(node, output_grad))


def _layernorm_of_matmul(node: Node, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd) of the matmul_layernorm `node` for inputs (a, b); the shapes are checked."""
    _check_matmul(a, b)
    z = torch.matmul(a, b)
    strict = getattr(node.op, "strict_shape", True)
    dims = layernorm_dims(z, node.attrs["normalized_shape"], strict, f"matmul_layernorm node {node.name!r}")
    return layernorm_forward(z, dims, node.attrs["eps"])


class _MatMulLayerNormGradZOp(Op):
    """dL/dz for y = layernorm(z), z = A @ B: r (g - mean(g) - y mean(g y)) (`layernorm_backward`).

    Inputs (A, B, y, g). With the forward's rstd r on y this needs y and g only, not A @ B.
    """

    name = "matmul_layernorm_grad_z"

    def __call__(self, node: Node, g: Node) -> Node:
        a, b = node.inputs
        return Node([a, b, node, g], self, dict(node.attrs), _name("matmul_layernorm_grad_z", g))

    def compute(self, node, input_values):
        a, b, y, g = input_values
        n = len(node.attrs["normalized_shape"])
        dims = tuple(range(-n, 0))
        rstd = getattr(y, _RSTD, None)
        if rstd is None or rstd.shape[: rstd.dim() - n] != y.shape[: y.dim() - n]:
            y, rstd = _layernorm_of_matmul(node.inputs[2], a, b)  # a value fed from outside: recompute
        return layernorm_backward(g, y, rstd, dims)

    def gradient(self, node, output_grad):
        shape, eps = node.attrs["normalized_shape"], node.attrs["eps"]
        dims = tuple(range(-len(shape), 0))

        def composite(a, b, y, g):  # y is recomputed from a and b here, so the y input gets a zero gradient
            yy, rstd = _layernorm_composite(matmul(a, b), len(shape), eps)
            return mul(rstd, sub(sub(g, mean(g, dims, keepdim=True)), mul(yy, mean(mul(g, yy), dims, keepdim=True))))

        return composite_gradient(node, output_grad, composite)


# ----------------------------------------------------------------------------------------------- matmul_softmax
class MatMulSoftmaxOp(Op):
    """softmax(A @ B, dim)."""

    name = "matmul_softmax"

    def __call__(self, a: Node, b: Node, dim: int = -1) -> Node:
        return Node([a, b], self, {"dim": dim}, _name("matmul_softmax", a, b))

    def compute(self, node, input_values):
        if len(input_values) != 2:
            raise ValueError(f"matmul_softmax takes 2 input values (A, B), got {len(input_values)}")
        a, b = input_values
        _check_matmul(a, b)
        return torch.softmax(torch.matmul(a, b), node.attrs["dim"])

    def gradient(self, node, output_grad):
        return _matmul_input_grads(node, _matmul_softmax_grad_z(node, output_grad))


class _MatMulSoftmaxGradZOp(Op):
    """dL/dz for y = softmax(z): y (g - sum(g y)) (`softmax_backward`; ops.SoftmaxGradOp derives it)."""

    name = "matmul_softmax_grad_z"

    def __call__(self, node: Node, g: Node) -> Node:
        return Node([node, g], self, dict(node.attrs), _name("matmul_softmax_grad_z", g))

    def compute(self, node, input_values):
        y, g = input_values
        return softmax_backward(g, y, node.attrs["dim"])

    def gradient(self, node, output_grad):
        dim = node.attrs["dim"]
        # y here is the matmul_softmax node; expressing through softmax(...) keeps second order exact
        return composite_gradient(node, output_grad, lambda y, g: mul(y, sub(g, sum_op(mul(g, y), dim, keepdim=True))))


_matmul_layernorm_grad_z = _MatMulLayerNormGradZOp()
_matmul_softmax_grad_z = _MatMulSoftmaxGradZOp()
matmul_layernorm = MatMulLayerNormOp()
matmul_softmax = MatMulSoftmaxOp()

__all__ = ["MatMulLayerNormOp", "MatMulSoftmaxOp", "matmul_layernorm", "matmul_softmax"]
