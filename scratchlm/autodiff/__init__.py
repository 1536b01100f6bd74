"""A graph-based reverse-mode automatic differentiation engine on torch tensors (CSE234 PA1 style).

    import scratchlm.autodiff as ad
    x, w = ad.Variable("x"), ad.Variable("w")
    loss = ad.sum_op(ad.relu(x @ w))
    grad_w, = ad.gradients(loss, [w])          # a graph, too: differentiate it again if you like
    loss_val, gw = ad.Evaluator([loss, grad_w]).run({x: torch.randn(4, 3), w: torch.randn(3, 2)})

torch.autograd is never used here: tensors are only data, every derivative is an op's `gradient`.
"""

from .evaluator import Evaluator, GraphRunError, gradients, gradients_or_none, substitute
from .fused import matmul_layernorm, matmul_softmax
from .graph import Node, Op, Variable, placeholder, topological_sort
from .nn_ops import (
    causal_mask,
    cross_entropy,
    embedding,
    linear,
    log_softmax,
    merge_heads,
    one_hot_like,
    repeat_kv,
    rms_normalize,
    rmsnorm,
    rotary,
    rotary_tables,
    rotate_pairs,
    sigmoid,
    silu,
    split_heads,
)
from .ops import (
    add,
    add_by_const,
    broadcast,
    constant,
    div,
    div_by_const,
    exp,
    expand_as,
    greater,
    layernorm,
    log,
    matmul,
    mean,
    mul,
    mul_by_const,
    neg,
    ones_like,
    power,
    rdiv_by_const,
    relu,
    reshape,
    reshape_as,
    softmax,
    sqrt,
    sub,
    sum_op,
    sum_to,
    transpose,
    zeros_like,
)

__all__ = [
    "Evaluator", "GraphRunError", "Node", "Op", "Variable", "add", "add_by_const", "broadcast", "causal_mask",
    "constant", "cross_entropy", "div", "div_by_const", "embedding", "exp", "expand_as", "gradients",
    "gradients_or_none", "greater", "layernorm", "linear", "log", "log_softmax", "matmul", "matmul_layernorm",
    "matmul_softmax", "mean", "merge_heads", "mul", "mul_by_const", "neg", "one_hot_like", "ones_like",
    "placeholder", "power", "rdiv_by_const", "relu", "repeat_kv", "reshape", "reshape_as", "rms_normalize",
    "rmsnorm", "rotary", "rotary_tables", "rotate_pairs", "sigmoid", "silu", "softmax", "split_heads", "sqrt",
    "sub", "substitute", "sum_op", "sum_to", "topological_sort", "transpose", "zeros_like",
]
