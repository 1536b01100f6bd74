"""The ops a transformer LM needs: embedding, rmsnorm, silu, rotary, causal mask, log_softmax, cross_entropy,
and head reshapes. Backward ops with a hand-written fast `compute` get their own (second-order) gradient
from a `composite` definition in primitive ops (see `evaluator.composite_gradient`)."""

from __future__ import annotations

import torch

from .evaluator import composite_gradient
from .graph import Node, Op
from .ops import (
    _name,
    add,
    add_by_const,
    expand_as,
    mean,
    mul,
    neg,
    power,
    reshape_as,
    softmax,
    sub,
    sum_op,
    sum_to,
    zeros_like,
)


# ----------------------------------------------------------------------------------------------- sigmoid, silu
class SigmoidOp(Op):
    name = "sigmoid"

    def __call__(self, a: Node) -> Node:
        return Node([a], self, name=_name("sigmoid", a))

    def compute(self, node, input_values):
        return torch.sigmoid(input_values[0])

    def gradient(self, node, output_grad):
        # σ' = σ (1 - σ)
        return [mul(output_grad, mul(node, add_by_const(neg(node), 1.0)))]


class SiluOp(Op):
    name = "silu"

    def __call__(self, a: Node) -> Node:
        return Node([a], self, name=_name("silu", a))

    def compute(self, node, input_values):
        return torch.nn.functional.silu(input_values[0])

    def gradient(self, node, output_grad):
        return [silu_grad(node.inputs[0], output_grad)]


class SiluGradOp(Op):
    """d silu(x) = g * σ(x) (1 + x (1 - σ(x))), from silu = x σ(x) and σ' = σ (1 - σ)."""

    name = "silu_grad"

    def __call__(self, x: Node, g: Node) -> Node:
        return Node([x, g], self, name=_name("silu_grad", x, g))

    def compute(self, node, input_values):
        x, g = input_values
        s = torch.sigmoid(x)
        return torch.rsub(s, 1.0).mul_(x).add_(1.0).mul_(s).mul_(g)  # fresh buffer, updated in place

    def gradient(self, node, output_grad):
        def composite(x, g):
            s = sigmoid(x)
            return mul(g, mul(s, add_by_const(mul(x, add_by_const(neg(s), 1.0)), 1.0)))

        return composite_gradient(node, output_grad, composite)


# ----------------------------------------------------------------------------------------------- log_softmax, CE
class LogSoftmaxOp(Op):
    name = "log_softmax"

    def __call__(self, a: Node, dim: int = -1) -> Node:
        return Node([a], self, {"dim": dim}, _name("log_softmax", a))

    def compute(self, node, input_values):
        return torch.log_softmax(input_values[0], dim=node.attrs["dim"])

    def gradient(self, node, output_grad):
        return [log_softmax_grad(node, output_grad, node.attrs["dim"])]


class LogSoftmaxGradOp(Op):
    """dx = g - exp(y) * sum(g), from y = x - logsumexp(x): dy_i/dx_j = δ_ij - softmax_j."""

    name = "log_softmax_grad"

    def __call__(self, y: Node, g: Node, dim: int) -> Node:
        return Node([y, g], self, {"dim": dim}, _name("log_softmax_grad", y, g))

    def compute(self, node, input_values):
        y, g = input_values
        return torch.exp(y).mul_(g.sum(dim=node.attrs["dim"], keepdim=True)).neg_().add_(g)

    def gradient(self, node, output_grad):
        from .ops import exp

        dim = node.attrs["dim"]
        return composite_gradient(node, output_grad,
                                  lambda y, g: sub(g, mul(exp(y), sum_op(g, dim, keepdim=True))))


class OneHotLikeOp(Op):
    """one_hot(targets) with as many classes as the last dim of `like`, in like's dtype. No gradient."""

    name = "one_hot_like"

    def __call__(self, targets: Node, like: Node) -> Node:
        return Node([targets, like], self, name=_name("one_hot", targets))

    def compute(self, node, input_values):
        t, like = input_values
        return torch.nn.functional.one_hot(t, like.shape[-1]).to(like.dtype)

    def gradient(self, node, output_grad):
        return [zeros_like(node.inputs[0]), zeros_like(node.inputs[1])]


def _check_targets(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if targets.dtype not in (torch.int64, torch.int32, torch.uint8, torch.int16):
        raise ValueError(f"targets must be an integer tensor, got {targets.dtype}")
    if tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal logits shape without the class dim "
                         f"{tuple(logits.shape[:-1])}")
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= logits.shape[-1]):
        raise ValueError(f"targets must lie in [0, {logits.shape[-1]}), got range "
                         f"[{int(targets.min())}, {int(targets.max())}]")


class CrossEntropyOp(Op):
    """Mean over all positions of -log softmax(logits)[target]; logits (..., V), targets (...) integers."""

    name = "cross_entropy"

    def __call__(self, logits: Node, targets: Node) -> Node:
        return Node([logits, targets], self, name=_name("cross_entropy", logits, targets))

    def compute(self, node, input_values):
        logits, targets = input_values
        _check_targets(logits, targets)
        v = logits.shape[-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, v), targets.reshape(-1).long())

    def gradient(self, node, output_grad):
        return [cross_entropy_grad(node.inputs[0], node.inputs[1], output_grad), zeros_like(node.inputs[1])]


class CrossEntropyGradOp(Op):
    """d CE / d logits = (softmax(logits) - one_hot(targets)) * g / N, N = number of positions."""

    name = "cross_entropy_grad"

    def __call__(self, logits: Node, targets: Node, g: Node) -> Node:
        return Node([logits, targets, g], self, name=_name("cross_entropy_grad", logits, g))

    def compute(self, node, input_values):
        logits, targets, g = input_values
        p = torch.softmax(logits, dim=-1)
        flat = p.view(-1, p.shape[-1])
        flat[torch.arange(flat.shape[0], device=p.device), targets.reshape(-1).long()] -= 1.0
        return p.mul_(g / max(targets.numel(), 1))

    def gradient(self, node, output_grad):
        def composite(logits, targets, g):
            diff = sub(softmax(logits, -1), one_hot_like(targets, logits))
            # g / N spread over (..., V): expand g with the 1/(N*V) of a mean, then undo the 1/V
            return mul(diff, mul_by_const_like_classes(expand_as(g, logits, mean=True), logits))

        return composite_gradient(node, output_grad, composite)


class _TimesClassesOp(Op):
    """x * V where V = size of the last dim of `like` (turns a 1/(N V) mean-spread into 1/N)."""

    name = "times_classes"

    def __call__(self, x: Node, like: Node) -> Node:
        return Node([x, like], self, name=_name("times_classes", x))

    def compute(self, node, input_values):
        return input_values[0] * input_values[1].shape[-1]

    def gradient(self, node, output_grad):
        return [mul_by_const_like_classes(output_grad, node.inputs[1]), zeros_like(node.inputs[1])]



# ----------------------------------------------------------------------------------------------- linear
class LinearOp(Op):
    """x @ weight^T (+ bias): x (..., in), weight (out, in) as torch.nn.Linear stores it."""

    name = "linear"

    def __call__(self, x: Node, weight: Node, bias: Node | None = None) -> Node:
        inputs = [x, weight] if bias is None else [x, weight, bias]
        return Node(inputs, self, name=_name("linear", x, weight))

    def compute(self, node, input_values):
        x, w = input_values[0], input_values[1]
        if w.dim() != 2 or x.shape[-1] != w.shape[1]:
            raise ValueError(f"linear needs x (..., in) and weight (out, in) with matching in, "
                             f"got x {tuple(x.shape)} and weight {tuple(w.shape)}")
        return torch.nn.functional.linear(x, w, input_values[2] if len(input_values) == 3 else None)

    def gradient(self, node, output_grad):
        x, w = node.inputs[0], node.inputs[1]
        grads = [linear_grad_input(output_grad, w), linear_grad_weight(output_grad, x)]
        if len(node.inputs) == 3:
            grads.append(sum_to(output_grad, node.inputs[2]))
        return grads


class LinearGradInputOp(Op):
    """dx = g @ weight: (..., out) @ (out, in) -> (..., in)."""

    name = "linear_grad_input"

    def __call__(self, g: Node, weight: Node) -> Node:
        return Node([g, weight], self, name=_name("linear_grad_input", g))

    def compute(self, node, input_values):
        return torch.matmul(input_values[0], input_values[1])

    def gradient(self, node, output_grad):
        g, w = node.inputs
        # d/dg: og @ w^T = linear(og, w); d/dw: g^T og summed over leading dims
        return [linear(output_grad, w), linear_grad_weight(g, output_grad)]


class LinearGradWeightOp(Op):
    """dW = g^T x with all leading dims flattened: (N, out)^T (N, in) -> (out, in), one 2-D matmul."""

    name = "linear_grad_weight"

    def __call__(self, g: Node, x: Node) -> Node:
        return Node([g, x], self, name=_name("linear_grad_weight", g, x))

    def compute(self, node, input_values):
        g, x = input_values
        return g.reshape(-1, g.shape[-1]).t() @ x.reshape(-1, x.shape[-1])  # (out, in)

    def gradient(self, node, output_grad):
        g, x = node.inputs
        # dW[o, i] = sum_n g[n, o] x[n, i]: d/dg = x @ og^T = linear(x, og); d/dx = g @ og
        return [linear(x, output_grad), linear_grad_input(g, output_grad)]


# ----------------------------------------------------------------------------------------------- embedding
class EmbeddingOp(Op):
    """weight[ids]: (V, D) gathered by integer ids (...) -> (..., D)."""

    name = "embedding"

    def __call__(self, weight: Node, ids: Node) -> Node:
        return Node([weight, ids], self, name=_name("embedding", weight, ids))

    def compute(self, node, input_values):
        weight, ids = input_values
        if ids.dtype.is_floating_point:
            raise ValueError(f"embedding ids must be integers, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= weight.shape[0]):
            raise ValueError(f"ids must lie in [0, {weight.shape[0]}), got [{int(ids.min())}, {int(ids.max())}]")
        return torch.nn.functional.embedding(ids, weight)

    def gradient(self, node, output_grad):
        weight, ids = node.inputs
        return [embedding_grad(output_grad, ids, weight), zeros_like(ids)]


class EmbeddingGradOp(Op):
    """Scatter-add of the rows of g into a zero (V, D) tensor at `ids` (repeated ids accumulate)."""

    name = "embedding_grad"

    def __call__(self, g: Node, ids: Node, weight: Node) -> Node:
        return Node([g, ids, weight], self, name=_name("embedding_grad", g))

    def compute(self, node, input_values):
        g, ids, weight = input_values
        out = torch.zeros_like(weight)
        out.index_add_(0, ids.reshape(-1), g.reshape(-1, weight.shape[-1]))  # (V, D)
        return out

    def gradient(self, node, output_grad):
        _, ids, _ = node.inputs
        # scatter-add is linear in g; its adjoint is a gather
        return [embedding(output_grad, ids), zeros_like(ids), zeros_like(node.inputs[2])]


# ----------------------------------------------------------------------------------------------- rmsnorm
class RMSNormalizeOp(Op):
    """x / sqrt(mean(x², last dim) + eps), no weight (`rmsnorm` multiplies the weight on)."""

    name = "rms_normalize"

    def __call__(self, a: Node, eps: float) -> Node:
        return Node([a], self, {"eps": eps}, _name("rms_normalize", a))

    def compute(self, node, input_values):
        x = input_values[0]
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + node.attrs["eps"])

    def gradient(self, node, output_grad):
        return [rms_normalize_grad(node.inputs[0], node, output_grad, node.attrs["eps"])]


class RMSNormalizeGradOp(Op):
    """dx = r (g - y mean(g y)), for y = x r, r = (mean(x²) + ε)^(-1/2).

    Derivation: dr/dx_j = -r³ x_j / N, so dy_i/dx_j = r δ_ij - x_i r³ x_j / N = r (δ_ij - y_i y_j / N).
    """

    name = "rms_normalize_grad"

    def __call__(self, x: Node, y: Node, g: Node, eps: float) -> Node:
        return Node([x, y, g], self, {"eps": eps}, _name("rms_normalize_grad", x, g))

    def compute(self, node, input_values):
        x, y, g = input_values
        r = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + node.attrs["eps"])  # (..., 1)
        dot = (g * y).mean(dim=-1, keepdim=True)  # (..., 1)
        return torch.addcmul(g, y, dot, value=-1.0).mul_(r)

    def gradient(self, node, output_grad):
        eps = node.attrs["eps"]

        def composite(x, y, g):
            r = power(add_by_const(mean(mul(x, x), -1, keepdim=True), eps), -0.5)
            yy = mul(x, r)
            return mul(r, sub(g, mul(yy, mean(mul(g, yy), -1, keepdim=True))))

        return composite_gradient(node, output_grad, composite)


def rmsnorm(x: Node, weight: Node, eps: float = 1e-5) -> Node:
    """RMSNorm with a learned weight over the last dim: rms_normalize(x) * weight."""
    return mul(rms_normalize(x, eps), weight)


# ----------------------------------------------------------------------------------------------- rotary
class RotatePairsOp(Op):
    """The 90° rotation of each RoPE pair: (x0, x1) -> (-x1, x0).

    layout "adjacent": pairs are (2i, 2i+1) (llama2.c, CS336); "half": pairs are (i, i + D/2) (HF rotate_half).
    Linear with transpose R^T = -R, so the gradient is -R(g).
    """

    name = "rotate_pairs"

    def __call__(self, a: Node, layout: str = "adjacent", sign: float = 1.0) -> Node:
        if layout not in ("adjacent", "half"):
            raise ValueError(f"rotary layout must be 'adjacent' or 'half', got {layout!r}")
        return Node([a], self, {"layout": layout, "sign": sign}, _name("rotate_pairs", a))

    def compute(self, node, input_values):
        x = input_values[0]
        if x.shape[-1] % 2:
            raise ValueError(f"rotary needs an even last dim, got {x.shape[-1]}")
        if node.attrs["layout"] == "adjacent":
            pairs = x.unflatten(-1, (-1, 2))  # (..., D/2, 2)
            out = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
        else:
            half = x.shape[-1] // 2
            out = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return out if node.attrs["sign"] == 1.0 else out * node.attrs["sign"]

    def gradient(self, node, output_grad):
        return [rotate_pairs(output_grad, node.attrs["layout"], -node.attrs["sign"])]


def rotary_tables(
    positions: torch.Tensor, head_dim: int, theta: float = 10000.0, layout: str = "adjacent",
    dtype: torch.dtype = torch.float32, angle_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables, (..., T, 1, head_dim), to feed `rotary` for x of shape (..., T, H, head_dim).

    Frequencies are theta^(-2i/head_dim); each pair's angle is repeated on both of its dims. Angles are
    computed in `angle_dtype` (float32, as scratchlm.model and HF do) and the tables cast to `dtype`.
    """
    if head_dim % 2:
        raise ValueError(f"rotary needs an even head_dim, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=angle_dtype, device=positions.device) / head_dim
    angles = positions.to(angle_dtype)[..., None] * (1.0 / theta**exponent)  # (..., T, D/2)
    if layout == "adjacent":
        angles = angles.repeat_interleave(2, dim=-1)  # (..., T, D)
    elif layout in ("half", "none"):  # "none": identity tables (cos 1, sin 0); `rotary` skips them anyway
        angles = torch.cat((angles, angles), dim=-1) * (layout == "half")  # (..., T, D)
    else:
        raise ValueError(f"rotary layout must be 'adjacent', 'half' or 'none', got {layout!r}")
    return angles.cos().to(dtype).unsqueeze(-2), angles.sin().to(dtype).unsqueeze(-2)  # (..., T, 1, D)


def rotary(x: Node, cos: Node, sin: Node, layout: str = "adjacent") -> Node:
    """Rotary position embedding: x cos + R(x) sin (R rotates each pair by 90°). cos/sin from `rotary_tables`.
    layout "none" (a model without position embedding) returns x itself."""
    if layout == "none":
        return x
    return add(mul(x, cos), mul(rotate_pairs(x, layout), sin))


# ----------------------------------------------------------------------------------------------- attention helpers
class CausalMaskOp(Op):
    """Fill scores (..., Tq, Tk) above the causal diagonal with `fill` (query i sees keys j <= i + Tk - Tq)."""

    name = "causal_mask"

    def __call__(self, a: Node, fill: float = float("-inf")) -> Node:
        return Node([a], self, {"fill": fill}, _name("causal_mask", a))

    def compute(self, node, input_values):
        x = input_values[0]
        if x.dim() < 2:
            raise ValueError("causal_mask needs scores with at least 2 dims (..., Tq, Tk)")
        tq, tk = x.shape[-2:]
        mask = torch.ones(tq, tk, dtype=torch.bool, device=x.device).triu_(1 + tk - tq)
        return x.masked_fill(mask, node.attrs["fill"])

    def gradient(self, node, output_grad):
        return [causal_mask(output_grad, 0.0)]  # masked entries are constants: zero gradient


class SplitHeadsOp(Op):
    """(..., H * D) -> (..., H, D)."""

    name = "split_heads"

    def __call__(self, a: Node, n_heads: int) -> Node:
        return Node([a], self, {"n_heads": n_heads}, _name("split_heads", a, n_heads))

    def compute(self, node, input_values):
        x = input_values[0]
        h = node.attrs["n_heads"]
        if x.shape[-1] % h:
            raise ValueError(f"last dim {x.shape[-1]} is not divisible by n_heads={h}")
        return x.unflatten(-1, (h, x.shape[-1] // h))

    def gradient(self, node, output_grad):
        return [reshape_as(output_grad, node.inputs[0])]


class MergeHeadsOp(Op):
    """(..., H, D) -> (..., H * D)."""

    name = "merge_heads"

    def __call__(self, a: Node) -> Node:
        return Node([a], self, name=_name("merge_heads", a))

    def compute(self, node, input_values):
        return input_values[0].flatten(-2)

    def gradient(self, node, output_grad):
        return [reshape_as(output_grad, node.inputs[0])]


class RepeatKVOp(Op):
    """(..., Hkv, D) -> (..., Hkv * n_rep, D), each kv head repeated n_rep times (grouped-query attention)."""

    name = "repeat_kv"

    def __call__(self, a: Node, n_rep: int) -> Node:
        return Node([a], self, {"n_rep": n_rep}, _name("repeat_kv", a, n_rep))

    def compute(self, node, input_values):
        x = input_values[0]
        n = node.attrs["n_rep"]
        if n == 1:
            return x
        return x.unsqueeze(-2).expand(*x.shape[:-1], n, x.shape[-1]).flatten(-3, -2)

    def gradient(self, node, output_grad):
        return [repeat_kv_grad(output_grad, node.attrs["n_rep"])]


class RepeatKVGradOp(Op):
    """Sum the n_rep copies of each kv head back: (..., Hkv * n, D) -> (..., Hkv, D)."""

    name = "repeat_kv_grad"

    def __call__(self, a: Node, n_rep: int) -> Node:
        return Node([a], self, {"n_rep": n_rep}, _name("repeat_kv_grad", a, n_rep))

    def compute(self, node, input_values):
        g = input_values[0]
        n = node.attrs["n_rep"]
        return g if n == 1 else g.unflatten(-2, (-1, n)).sum(dim=-2)

    def gradient(self, node, output_grad):
        return [repeat_kv(output_grad, node.attrs["n_rep"])]


sigmoid = SigmoidOp()
silu = SiluOp()
silu_grad = SiluGradOp()
log_softmax = LogSoftmaxOp()
log_softmax_grad = LogSoftmaxGradOp()
one_hot_like = OneHotLikeOp()
cross_entropy = CrossEntropyOp()
cross_entropy_grad = CrossEntropyGradOp()
mul_by_const_like_classes = _TimesClassesOp()
linear = LinearOp()
linear_grad_input = LinearGradInputOp()
linear_grad_weight = LinearGradWeightOp()
embedding = EmbeddingOp()
embedding_grad = EmbeddingGradOp()
rms_normalize = RMSNormalizeOp()
rms_normalize_grad = RMSNormalizeGradOp()
rotate_pairs = RotatePairsOp()
causal_mask = CausalMaskOp()
split_heads = SplitHeadsOp()
merge_heads = MergeHeadsOp()
repeat_kv = RepeatKVOp()
repeat_kv_grad = RepeatKVGradOp()

__all__ = [
    "linear", "sigmoid", "silu", "log_softmax", "cross_entropy", "embedding", "rmsnorm", "rms_normalize",
    "rotate_pairs", "rotary", "rotary_tables", "causal_mask", "split_heads", "merge_heads", "repeat_kv",
    "sum_to", "one_hot_like",
]
