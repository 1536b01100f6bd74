"""Primitive ops: each class has `compute` (values) and `gradient` (new nodes) side by side.

Broadcasting: element-wise ops follow torch's rules; their gradients pass through `sum_to(grad, x)`,
which sums the broadcast dimensions away at run time, so every gradient has its input's exact shape.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch

from .evaluator import composite_gradient
from .graph import Node, Op

Dims = int | Sequence[int] | None


def _name(op: str, *parts: object) -> str:
    return f"{op}(" + ", ".join(p.name if isinstance(p, Node) else repr(p) for p in parts) + ")"


def _as_tuple(dim: Dims) -> tuple[int, ...] | None:
    if dim is None:
        return None
    return (dim,) if isinstance(dim, int) else tuple(dim)


def _norm_dims(dims: tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    if dims is None:
        return tuple(range(ndim))
    out = []
    for d in dims:
        if not -ndim <= d < max(ndim, 1):
            raise ValueError(f"dim {d} is out of range for a tensor with {ndim} dims")
        out.append(d % ndim if ndim else 0)
    return tuple(sorted(out))


def sum_to_shape(value: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Sum `value` over the dimensions that broadcasting added or expanded, giving `shape`."""
    if value.shape == shape:
        return value
    lead = value.dim() - len(shape)
    if lead < 0:
        raise ValueError(f"cannot reduce shape {tuple(value.shape)} to the larger shape {tuple(shape)}")
    dims = list(range(lead))
    for i, s in enumerate(shape):
        if s == 1 and value.shape[lead + i] != 1:
            dims.append(lead + i)
        elif s != value.shape[lead + i] and s != 1:
            raise ValueError(f"shape {tuple(value.shape)} does not broadcast from {tuple(shape)}")
    out = value.sum(dim=dims, keepdim=True) if dims else value
    return out.reshape(shape)


# ----------------------------------------------------------------------------------------------- arithmetic
class AddOp(Op):
    name = "add"

    def __call__(self, a: Node, b: Node) -> Node:
        return Node([a, b], self, name=f"({a.name}+{b.name})")

    def compute(self, node, input_values):
        return input_values[0] + input_values[1]

    def gradient(self, node, output_grad):
        a, b = node.inputs
        return [sum_to(output_grad, a), sum_to(output_grad, b)]


class SubOp(Op):
    name = "sub"

    def __call__(self, a: Node, b: Node) -> Node:
        return Node([a, b], self, name=f"({a.name}-{b.name})")

    def compute(self, node, input_values):
        return input_values[0] - input_values[1]

    def gradient(self, node, output_grad):
        a, b = node.inputs
        return [sum_to(output_grad, a), sum_to(neg(output_grad), b)]


class MulOp(Op):
    name = "mul"

    def __call__(self, a: Node, b: Node) -> Node:
        return Node([a, b], self, name=f"({a.name}*{b.name})")

    def compute(self, node, input_values):
        return input_values[0] * input_values[1]

    def gradient(self, node, output_grad):
        a, b = node.inputs
        return [sum_to(mul(output_grad, b), a), sum_to(mul(output_grad, a), b)]


class DivOp(Op):
    name = "div"

    def __call__(self, a: Node, b: Node) -> Node:
        return Node([a, b], self, name=f"({a.name}/{b.name})")

    def compute(self, node, input_values):
        return input_values[0] / input_values[1]

    def gradient(self, node, output_grad):
        a, b = node.inputs
        # d(a/b)/da = 1/b ; d(a/b)/db = -a/b^2 = -(a/b)/b
        return [sum_to(div(output_grad, b), a), sum_to(neg(div(mul(output_grad, node), b)), b)]


class AddByConstOp(Op):
    name = "add_by_const"

    def __call__(self, a: Node, c: float) -> Node:
        return Node([a], self, {"constant": c}, f"({a.name}+{c!r})")

    def compute(self, node, input_values):
        return input_values[0] + node.attrs["constant"]

    def gradient(self, node, output_grad):
        return [output_grad]


class MulByConstOp(Op):
    name = "mul_by_const"

    def __call__(self, a: Node, c: float) -> Node:
        return Node([a], self, {"constant": c}, f"({a.name}*{c!r})")

    def compute(self, node, input_values):
        return input_values[0] * node.attrs["constant"]

    def gradient(self, node, output_grad):
        return [mul_by_const(output_grad, node.attrs["constant"])]


class DivByConstOp(Op):
    name = "div_by_const"

    def __call__(self, a: Node, c: float) -> Node:
        if c == 0:
            raise ZeroDivisionError(f"div_by_const({a.name}, 0)")
        return Node([a], self, {"constant": c}, f"({a.name}/{c!r})")

    def compute(self, node, input_values):
        return input_values[0] / node.attrs["constant"]

    def gradient(self, node, output_grad):
        return [div_by_const(output_grad, node.attrs["constant"])]


class RDivByConstOp(Op):
    """c / x."""

    name = "rdiv_by_const"

    def __call__(self, a: Node, c: float) -> Node:
        return Node([a], self, {"constant": c}, f"({c!r}/{a.name})")

    def compute(self, node, input_values):
        return node.attrs["constant"] / input_values[0]

    def gradient(self, node, output_grad):
        # d(c/x)/dx = -c/x^2 = -(c/x)/x
        return [neg(div(mul(output_grad, node), node.inputs[0]))]


class NegOp(Op):
    name = "neg"

    def __call__(self, a: Node) -> Node:
        return Node([a], self, name=f"(-{a.name})")

    def compute(self, node, input_values):
        return -input_values[0]

    def gradient(self, node, output_grad):
        return [neg(output_grad)]


# ----------------------------------------------------------------------------------------------- shapes
class TransposeOp(Op):
    name = "transpose"

    def __call__(self, a: Node, dim0: int = -2, dim1: int = -1) -> Node:
        return Node([a], self, {"dim0": dim0, "dim1": dim1}, _name("transpose", a, dim0, dim1))

    def compute(self, node, input_values):
        return input_values[0].transpose(node.attrs["dim0"], node.attrs["dim1"])

    def gradient(self, node, output_grad):
        return [transpose(output_grad, node.attrs["dim0"], node.attrs["dim1"])]


class ReshapeOp(Op):
    name = "reshape"

    def __call__(self, a: Node, shape: Sequence[int]) -> Node:
        return Node([a], self, {"shape": tuple(shape)}, _name("reshape", a, tuple(shape)))

    def compute(self, node, input_values):
        x = input_values[0]
        shape = node.attrs["shape"]
        known = math.prod(s for s in shape if s != -1)
        if (-1 not in shape and known != x.numel()) or (-1 in shape and (known == 0 or x.numel() % known)):
            raise ValueError(f"cannot reshape {tuple(x.shape)} ({x.numel()} elements) to {shape}")
        return x.reshape(shape)

    def gradient(self, node, output_grad):
        return [reshape_as(output_grad, node.inputs[0])]


class ReshapeAsOp(Op):
    """Reshape `a` to the run-time shape of `like` (the gradient of reshapes)."""

    name = "reshape_as"

    def __call__(self, a: Node, like: Node) -> Node:
        return Node([a, like], self, name=_name("reshape_as", a, like))

    def compute(self, node, input_values):
        return input_values[0].reshape(input_values[1].shape)

    def gradient(self, node, output_grad):
        return [reshape_as(output_grad, node.inputs[0]), zeros_like(node.inputs[1])]


class SumToOp(Op):
    """Sum `a` down to the run-time shape of `like` (undoes broadcasting; a no-op when shapes agree)."""

    name = "sum_to"

    def __call__(self, a: Node, like: Node) -> Node:
        return Node([a, like], self, name=_name("sum_to", a, like))

    def compute(self, node, input_values):
        return sum_to_shape(input_values[0], input_values[1].shape)

    def gradient(self, node, output_grad):
        return [expand_as(output_grad, node.inputs[0]), zeros_like(node.inputs[1])]


class ExpandAsOp(Op):
    """Broadcast `a` to the run-time shape of `like`. With `dims`, first unsqueeze `a` at those dims of
    `like` (undoing a reduction with keepdim=False); with `mean`, divide by the number of elements
    each value was spread over (the gradient of `mean`)."""

    name = "expand_as"

    def __call__(self, a: Node, like: Node, dims: Dims = None, mean: bool = False, reduced: bool = False) -> Node:
        attrs = {"dims": _as_tuple(dims), "mean": mean, "reduced": reduced}
        return Node([a, like], self, attrs, _name("expand_as", a, like))

    def compute(self, node, input_values):
        a, like = input_values
        if node.attrs["reduced"]:  # `a` came from a reduction over `dims` of `like` without keepdim
            dims = _norm_dims(node.attrs["dims"], like.dim())
            shape = [1 if i in dims else s for i, s in enumerate(like.shape)]
            a = a.reshape(shape)
        out = a.expand_as(like)
        if node.attrs["mean"]:
            out = out * (max(a.numel(), 1) / max(like.numel(), 1))
        return out

    def gradient(self, node, output_grad):
        a, like = node.inputs
        attrs = node.attrs
        if attrs["reduced"]:
            g = sum_op(output_grad, attrs["dims"], keepdim=False) if attrs["dims"] is not None else sum_op(output_grad)
            g = reshape_as(g, a)
        else:
            g = sum_to(output_grad, a)
        if attrs["mean"]:
            g = _scale_like(g, a, like)
        return [g, zeros_like(like)]


class ExpandAsOp3d(ExpandAsOp):
    """PA1's expand_as_3d(a, like): `a` (B, D) unsqueezed at dim 1 and broadcast to `like` (B, T, D)."""

    name = "expand_as_3d"

    def __call__(self, a: Node, like: Node) -> Node:
        attrs = {"dims": (1,), "mean": False, "reduced": True}
        return Node([a, like], self, attrs, _name("expand_as_3d", a, like))


class _ScaleByRatioOp(Op):
    """x * numel(small) / numel(big): the scale of `mean`'s gradient, known only at run time."""

    name = "scale_by_numel_ratio"

    def __call__(self, x: Node, small: Node, big: Node) -> Node:
        return Node([x, small, big], self, name=_name("scale_by_numel_ratio", x))

    def compute(self, node, input_values):
        x, small, big = input_values
        return x * (max(small.numel(), 1) / max(big.numel(), 1))

    def gradient(self, node, output_grad):
        _, small, big = node.inputs
        return [_scale_like(output_grad, small, big), zeros_like(small), zeros_like(big)]


def _scale_like(x: Node, small: Node, big: Node) -> Node:
    return _ScaleByRatioOp()(x, small, big)


class BroadcastOp(Op):
    """PA1's broadcast(x, input_shape, target_shape): expand from a static shape to another."""

    name = "broadcast"

    def __call__(self, a: Node, input_shape: Sequence[int], target_shape: Sequence[int]) -> Node:
        attrs = {"input_shape": tuple(input_shape), "target_shape": tuple(target_shape)}
        return Node([a], self, attrs, _name("broadcast", a, tuple(target_shape)))

    def compute(self, node, input_values):
        x = input_values[0]
        if tuple(x.shape) != node.attrs["input_shape"]:
            raise ValueError(f"input has shape {tuple(x.shape)}, declared input_shape {node.attrs['input_shape']}")
        return x.expand(node.attrs["target_shape"])

    def gradient(self, node, output_grad):
        return [sum_to(output_grad, node.inputs[0])]


# ----------------------------------------------------------------------------------------------- element-wise
class ReLUOp(Op):
    name = "relu"

    def __call__(self, a: Node) -> Node:
        return Node([a], self, name=_name("relu", a))

    def compute(self, node, input_values):
        return torch.relu(input_values[0])

    def gradient(self, node, output_grad):
        return [mul(output_grad, greater(node.inputs[0], 0.0))]


class SqrtOp(Op):
    name = "sqrt"

    def __call__(self, a: Node) -> Node:
        return Node([a], self, name=_name("sqrt", a))

    def compute(self, node, input_values):
        return torch.sqrt(input_values[0])

    def gradient(self, node, output_grad):
        return [div(output_grad, mul_by_const(node, 2.0))]


class PowerOp(Op):
    name = "power"

    def __call__(self, a: Node, exponent: float) -> Node:
        return Node([a], self, {"exponent": exponent}, f"({a.name}**{exponent!r})")

    def compute(self, node, input_values):
        return torch.pow(input_values[0], node.attrs["exponent"])

    def gradient(self, node, output_grad):
        p = node.attrs["exponent"]
        if p == 0:
            return [zeros_like(node.inputs[0])]
        inner = node.inputs[0] if p == 2 else power(node.inputs[0], p - 1)
        return [mul(output_grad, mul_by_const(inner, p))]


class ExpOp(Op):
    name = "exp"

    def __call__(self, a: Node) -> Node:
        return Node([a], self, name=_name("exp", a))

    def compute(self, node, input_values):
        return torch.exp(input_values[0])

    def gradient(self, node, output_grad):
        return [mul(output_grad, node)]


class LogOp(Op):
    name = "log"

    def __call__(self, a: Node) -> Node:
        return Node([a], self, name=_name("log", a))

    def compute(self, node, input_values):
        return torch.log(input_values[0])

    def gradient(self, node, output_grad):
        return [div(output_grad, node.inputs[0])]


class GreaterThanOp(Op):
    """1.0 where a > b else 0.0 (in a's dtype); `b` is a node (as in PA1) or a scalar. Gradient: zero."""

    name = "greater"

    def __call__(self, a: Node, b: Node | float) -> Node:
        if isinstance(b, Node):
            return Node([a, b], self, {}, f"({a.name}>{b.name})")
        return Node([a], self, {"constant": b}, f"({a.name}>{b!r})")

    def compute(self, node, input_values):
        b = input_values[1] if len(input_values) == 2 else node.attrs["constant"]
        return (input_values[0] > b).to(input_values[0].dtype)

    def gradient(self, node, output_grad):
        return [zeros_like(inp) for inp in node.inputs]


class ZerosLikeOp(Op):
    name = "zeros_like"

    def __call__(self, a: Node) -> Node:
        return Node([a], self, name=_name("zeros_like", a))

    def compute(self, node, input_values):
        return torch.zeros_like(input_values[0])

    def gradient(self, node, output_grad):
        return [zeros_like(node.inputs[0])]


class OnesLikeOp(Op):
    name = "ones_like"

    def __call__(self, a: Node) -> Node:
        return Node([a], self, name=_name("ones_like", a))

    def compute(self, node, input_values):
        return torch.ones_like(input_values[0])

    def gradient(self, node, output_grad):
        return [zeros_like(node.inputs[0])]


class ConstantOp(Op):
    """A node with a fixed tensor value (held in attrs); no gradient flows to it."""

    name = "constant"

    def __call__(self, value: torch.Tensor, name: str = "constant") -> Node:
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"constant expects a torch.Tensor, got {type(value).__name__}")
        return Node([], self, {"value": value}, name)

    def compute(self, node, input_values):
        return node.attrs["value"]

    def gradient(self, node, output_grad):
        return []


# ----------------------------------------------------------------------------------------------- reductions
class SumOp(Op):
    name = "sum"

    def __call__(self, a: Node, dim: Dims = None, keepdim: bool = False) -> Node:
        return Node([a], self, {"dim": _as_tuple(dim), "keepdim": keepdim}, _name("sum", a, dim))

    def compute(self, node, input_values):
        x = input_values[0]
        dims = _norm_dims(node.attrs["dim"], x.dim())
        return x.sum(dim=dims, keepdim=node.attrs["keepdim"]) if dims else x.clone()

    def gradient(self, node, output_grad):
        keep = node.attrs["keepdim"]
        return [expand_as(output_grad, node.inputs[0], dims=node.attrs["dim"], reduced=not keep)]


class MeanOp(Op):
    name = "mean"

    def __call__(self, a: Node, dim: Dims = None, keepdim: bool = False) -> Node:
        return Node([a], self, {"dim": _as_tuple(dim), "keepdim": keepdim}, _name("mean", a, dim))

    def compute(self, node, input_values):
        x = input_values[0]
        dims = _norm_dims(node.attrs["dim"], x.dim())
        return x.mean(dim=dims, keepdim=node.attrs["keepdim"]) if dims else x.clone()

    def gradient(self, node, output_grad):
        keep = node.attrs["keepdim"]
        return [expand_as(output_grad, node.inputs[0], dims=node.attrs["dim"], mean=True, reduced=not keep)]


# ----------------------------------------------------------------------------------------------- matmul
class MatMulOp(Op):
    """a @ b for 2-D or batched inputs (..., m, k) @ (..., k, n); batch dims broadcast."""

    name = "matmul"

    def __call__(self, a: Node, b: Node) -> Node:
        return Node([a, b], self, name=f"({a.name}@{b.name})")

    def compute(self, node, input_values):
        a, b = input_values
        if a.dim() < 2 or b.dim() < 2:
            raise ValueError("matmul needs inputs with at least 2 dims")
        if a.shape[-1] != b.shape[-2]:
            raise ValueError(f"inner dimensions differ: {a.shape[-1]} (last of a) vs {b.shape[-2]} (2nd-last of b)")
        return torch.matmul(a, b)

    def gradient(self, node, output_grad):
        a, b = node.inputs
        return [sum_to(matmul(output_grad, transpose(b, -1, -2)), a), matmul_grad_b(a, output_grad, b)]


class MatMulGradBOp(Op):
    """d(a @ b)/db contracted with g: sum_to(a^T @ g, b). When b is 2-D and a is batched, the batch dims are
    flattened into one (k, N) @ (N, n) product instead of a batched product followed by a sum."""

    name = "matmul_grad_b"

    def __call__(self, a: Node, g: Node, b: Node) -> Node:
        return Node([a, g, b], self, name=_name("matmul_grad_b", a, g))

    def compute(self, node, input_values):
        a, g, b = input_values
        if b.dim() == 2 and a.dim() > 2:
            return a.reshape(-1, a.shape[-1]).t() @ g.reshape(-1, g.shape[-1])  # (k, n)
        return sum_to_shape(torch.matmul(a.transpose(-1, -2), g), b.shape)

    def gradient(self, node, output_grad):
        return composite_gradient(node, output_grad, lambda a, g, b: sum_to(matmul(transpose(a, -1, -2), g), b))


# ----------------------------------------------------------------------------------------------- softmax, layernorm
class SoftmaxOp(Op):
    name = "softmax"

    def __call__(self, a: Node, dim: int = -1) -> Node:
        return Node([a], self, {"dim": dim}, _name("softmax", a))

    def compute(self, node, input_values):
        return torch.softmax(input_values[0], dim=node.attrs["dim"])

    def gradient(self, node, output_grad):
        return [softmax_grad(node, output_grad, node.attrs["dim"])]


class SoftmaxGradOp(Op):
    """dx = y * (g - sum(g * y, dim)), from y = softmax(x). Derivation: dy_i/dx_j = y_i (δ_ij - y_j)."""

    name = "softmax_grad"

    def __call__(self, y: Node, g: Node, dim: int) -> Node:
        return Node([y, g], self, {"dim": dim}, _name("softmax_grad", y, g))

    def compute(self, node, input_values):
        y, g = input_values
        gy = g * y
        return gy.addcmul_(y, gy.sum(dim=node.attrs["dim"], keepdim=True), value=-1.0)

    @staticmethod
    def composite(y: Node, g: Node, dim: int) -> Node:
        return mul(y, sub(g, sum_op(mul(g, y), dim, keepdim=True)))

    def gradient(self, node, output_grad):
        dim = node.attrs["dim"]
        return composite_gradient(node, output_grad, lambda y, g: self.composite(y, g, dim))


class NormalizedShapeWarning(UserWarning):
    """A layer norm of the PA1 interface whose `normalized_shape` is not the trailing dims of its input: it
    normalises over the last len(normalized_shape) dims anyway, as PA1's reference does."""


PA1_MODULES = "scratchlm.autodiff.auto_diff / scratchlm.autodiff.fused_ops"


def layernorm_dims(x: torch.Tensor, shape: tuple[int, ...], strict: bool, what: str) -> tuple[int, ...]:
    """The dims a layer norm with `normalized_shape` = `shape` normalises: the last len(shape) of `x`.

    Strict (scratchlm's own API): they must be `shape`, else a ValueError naming both. Not strict (the PA1
    interface): their sizes may differ from `shape`; PA1's public tests pass ``normalized_shape=[3]`` for a (3, 4)
    tensor and compare with a layer norm over the last dim, so a mismatch normalises over the last len(shape)
    dims whatever their sizes, with a `NormalizedShapeWarning` naming the mismatch."""
    n = len(shape)
    if not 1 <= n <= x.dim():
        raise ValueError(f"{what}: normalized_shape {shape} needs 1 to {x.dim()} dims for an input of shape "
                         f"{tuple(x.shape)}")
    trailing = tuple(x.shape[x.dim() - n:])
    if trailing != shape:
        if strict:
            raise ValueError(f"{what}: normalized_shape {shape} does not match the trailing dims of {tuple(x.shape)} "
                             f"(PA1's interface, {PA1_MODULES}, normalises over the last {n} dim(s) whatever "
                             "their sizes)")
        warnings.warn(f"{what}: normalized_shape {shape} does not match the trailing dims {trailing} of the input "
                      f"{tuple(x.shape)}: normalising over the last {n} dim(s), of sizes {trailing}, as PA1's "
                      "reference does", NormalizedShapeWarning, stacklevel=3)
    return tuple(range(-n, 0))


class LayerNormOp(Op):
    """(x - mean) / sqrt(var + eps) over the last len(normalized_shape) dims (no affine weight, as in PA1).

    `strict_shape` (scratchlm's `layernorm`): those dims must equal `normalized_shape`. The PA1 interface's
    instance (`scratchlm.autodiff.auto_diff.layernorm`) takes any sizes there, with a warning (`layernorm_dims`).
    """

    name = "layernorm"

    def __init__(self, strict_shape: bool = True):
        self.strict_shape = strict_shape

    def __call__(self, a: Node, normalized_shape: Sequence[int], eps: float = 1e-5) -> Node:
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        return Node([a], self, {"normalized_shape": shape, "eps": eps}, _name("layernorm", a))

    def compute(self, node, input_values):
        x = input_values[0]
        dims = layernorm_dims(x, node.attrs["normalized_shape"], self.strict_shape, f"layernorm node {node.name!r}")
        return torch.nn.functional.layer_norm(x, x.shape[x.dim() + dims[0]:], eps=node.attrs["eps"])

    def gradient(self, node, output_grad):
        return [layernorm_grad(node.inputs[0], node, output_grad, len(node.attrs["normalized_shape"]),
                               node.attrs["eps"])]


def _layernorm_composite(x: Node, ndims: int, eps: float) -> tuple[Node, Node]:
    dims = tuple(range(-ndims, 0))
    xc = sub(x, mean(x, dims, keepdim=True))
    rstd = power(add_by_const(mean(mul(xc, xc), dims, keepdim=True), eps), -0.5)
    return mul(xc, rstd), rstd


class LayerNormGradOp(Op):
    """dx = rstd * (g - mean(g) - y * mean(g * y)) for y = layernorm(x), rstd = 1/sqrt(var + eps).

    Derivation: y = (x - μ) r with r = (σ² + ε)^(-1/2); dμ/dx = 1/N, dσ²/dx_j = 2 (x_j - μ)/N, so
    dy_i/dx_j = r (δ_ij - 1/N - y_i y_j / N); contracting with g gives the formula.
    """

    name = "layernorm_grad"

    def __call__(self, x: Node, y: Node, g: Node, ndims: int, eps: float) -> Node:
        return Node([x, y, g], self, {"ndims": ndims, "eps": eps}, _name("layernorm_grad", x, g))

    def compute(self, node, input_values):
        x, y, g = input_values
        dims = tuple(range(-node.attrs["ndims"], 0))
        rstd = torch.rsqrt(x.var(dim=dims, unbiased=False, keepdim=True) + node.attrs["eps"])
        return rstd * (g - g.mean(dim=dims, keepdim=True) - y * (g * y).mean(dim=dims, keepdim=True))

    def gradient(self, node, output_grad):
        ndims, eps = node.attrs["ndims"], node.attrs["eps"]
        dims = tuple(range(-ndims, 0))

        def composite(x, y, g):
            yy, rstd = _layernorm_composite(x, ndims, eps)
            return mul(rstd, sub(sub(g, mean(g, dims, keepdim=True)), mul(yy, mean(mul(g, yy), dims, keepdim=True))))

        return composite_gradient(node, output_grad, composite)


# ----------------------------------------------------------------------------------------------- instances
add = AddOp()
sub = SubOp()
mul = MulOp()
div = DivOp()
add_by_const = AddByConstOp()
mul_by_const = MulByConstOp()
div_by_const = DivByConstOp()
rdiv_by_const = RDivByConstOp()
neg = NegOp()
transpose = TransposeOp()
reshape = ReshapeOp()
reshape_as = ReshapeAsOp()
sum_to = SumToOp()
expand_as = ExpandAsOp()
expand_as_3d = ExpandAsOp3d()
broadcast = BroadcastOp()
relu = ReLUOp()
sqrt = SqrtOp()
power = PowerOp()
exp = ExpOp()
log = LogOp()
greater = GreaterThanOp()
zeros_like = ZerosLikeOp()
ones_like = OnesLikeOp()
constant = ConstantOp()
sum_op = SumOp()
mean = MeanOp()
matmul = MatMulOp()
matmul_grad_b = MatMulGradBOp()
softmax = SoftmaxOp()
softmax_grad = SoftmaxGradOp()
layernorm = LayerNormOp()
layernorm_grad = LayerNormGradOp()

ReluOp = ReLUOp  # earlier spellings
GreaterOp = GreaterThanOp
