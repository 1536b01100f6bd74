"""Fused ops: `matmul_layernorm(A, B)` = layernorm(A @ B) and `matmul_softmax(A, B)` = softmax(A @ B),
each with a hand-derived backward.

Both take exactly the two inputs (A, B), as in CSE234 PA1: `op.compute(node, [A, B])` and `op.gradient`
returns two nodes. What fusion buys here: one forward node instead of two; the layer norm keeps its 1/std from
the forward pass (on the output tensor; the unfused backward recomputes the variance from the matmul output);
the backward of the normalisation is one ATen kernel (`native_layer_norm_backward`, `_softmax_backward_data`)
feeding the two matmuls, instead of separate node evaluations. Second-order gradients through a fused backward
are derived from the unfused definition (`composite_gradient`), so they stay correct.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .evaluator import composite_gradient
from .graph import Node, Op
from .ops import _layernorm_composite, _name, matmul, matmul_grad_b, mean, mul, sub, sum_op, sum_to, transpose

aten = torch.ops.aten


def _check_matmul(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dim() < 2 or b.dim() < 2:
        raise ValueError("matmul needs inputs with at least 2 dims")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"inner dimensions differ: {a.shape[-1]} (last of A) vs {b.shape[-2]} (2nd-last of B)")


def _matmul_input_grads(node: Node, dz: Node) -> list[Node]:
    a, b = node.inputs[0], node.inputs[1]
    return [sum_to(matmul(dz, transpose(b, -1, -2)), a), matmul_grad_b(a, dz, b)]


# ----------------------------------------------------------------------------------------------- matmul_layernorm
_RSTD = "_scratchlm_layernorm_rstd"  # the forward's 1/std, kept on its output tensor for the backward


class MatMulLayerNormOp(Op):
    """layernorm(A @ B) over the last len(normalized_shape) dims (no affine weight). Two inputs, as in PA1.

    `compute` leaves the (..., 1) reciprocal std on the value it returns (a private tensor attribute), so the
    backward does not recompute A @ B; a value that lacks it (fed from outside) makes the backward recompute.
    """

    name = "matmul_layernorm"

    def __call__(self, a: Node, b: Node, normalized_shape: Sequence[int] | int, eps: float = 1e-5) -> Node:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        return Node([a, b], self, {"normalized_shape": shape, "eps": eps}, _name("matmul_layernorm", a, b))

    def compute(self, node, input_values):
        if len(input_values) != 2:
            raise ValueError(f"matmul_layernorm takes 2 input values (A, B), got {len(input_values)}")
        y, _, _, rstd = _layernorm_of_matmul(*input_values, node.attrs["normalized_shape"], node.attrs["eps"])
        setattr(y, _RSTD, rstd)
        return y

    def gradient(self, node, output_grad):
        return _matmul_input_grads(node, _matmul_layernorm_grad_z(node, output_grad))


def _layernorm_of_matmul(a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...], eps: float):
    """(y, z, mean, rstd) for z = a @ b, y = layernorm(z); the shapes are checked."""
    _check_matmul(a, b)
    z = torch.matmul(a, b)
    if tuple(z.shape[z.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized_shape {shape} does not match the trailing dims of A @ B {tuple(z.shape)}")
    y, mu, rstd = aten.native_layer_norm(z, list(shape), None, None, eps)
    return y, z, mu, rstd


class _MatMulLayerNormGradZOp(Op):
    """dL/dz for y = layernorm(z), z = A @ B: r (g - mean(g) - y mean(g y)) (see ops.LayerNormGradOp).

    Inputs (A, B, y, g). With the forward's rstd r on y, this is ATen's layer-norm backward run on y itself
    (mean 0, rstd 1 make its x-hat equal y) and scaled by r: one kernel and one multiply, A @ B not needed.
    """

    name = "matmul_layernorm_grad_z"

    def __call__(self, node: Node, g: Node) -> Node:
        a, b = node.inputs
        return Node([a, b, node, g], self, dict(node.attrs), _name("matmul_layernorm_grad_z", g))

    def compute(self, node, input_values):
        a, b, y, g = input_values
        shape = node.attrs["normalized_shape"]
        n = len(shape)
        rstd = getattr(y, _RSTD, None)
        if rstd is None or rstd.shape[: rstd.dim() - n] != y.shape[: y.dim() - n]:
            _, z, mu, rstd = _layernorm_of_matmul(a, b, shape, node.attrs["eps"])
            return aten.native_layer_norm_backward(g, z, list(shape), mu, rstd, None, None, [True, False, False])[0]
        dz = aten.native_layer_norm_backward(g, y, list(shape), torch.zeros_like(rstd), torch.ones_like(rstd), None,
                                             None, [True, False, False])[0]
        return dz.mul_(rstd)

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
        z = torch.matmul(a, b)
        return aten._softmax(z, node.attrs["dim"] % z.dim(), False)

    def gradient(self, node, output_grad):
        return _matmul_input_grads(node, _matmul_softmax_grad_z(node, output_grad))


class _MatMulSoftmaxGradZOp(Op):
    """dL/dz for y = softmax(z): y (g - sum(g y)) (see ops.SoftmaxGradOp), one ATen kernel."""

    name = "matmul_softmax_grad_z"

    def __call__(self, node: Node, g: Node) -> Node:
        return Node([node, g], self, dict(node.attrs), _name("matmul_softmax_grad_z", g))

    def compute(self, node, input_values):
        y, g = input_values
        return aten._softmax_backward_data(g, y, node.attrs["dim"] % y.dim(), y.dtype)

    def gradient(self, node, output_grad):
        dim = node.attrs["dim"]
        # y here is the matmul_softmax node; expressing through softmax(...) keeps second order exact
        return composite_gradient(node, output_grad, lambda y, g: mul(y, sub(g, sum_op(mul(g, y), dim, keepdim=True))))


_matmul_layernorm_grad_z = _MatMulLayerNormGradZOp()
_matmul_softmax_grad_z = _MatMulSoftmaxGradZOp()
matmul_layernorm = MatMulLayerNormOp()
matmul_softmax = MatMulSoftmaxOp()

__all__ = ["MatMulLayerNormOp", "MatMulSoftmaxOp", "matmul_layernorm", "matmul_softmax"]
