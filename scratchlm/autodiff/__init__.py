"""A graph-based reverse-mode automatic differentiation engine on torch tensors (CSE234 PA1 style).

    import scratchlm.autodiff as ad
    x, w = ad.Variable("x"), ad.Variable("w")
    loss = ad.sum_op(ad.relu(x @ w))
    grad_w, = ad.gradients(loss, [w])          # a graph, too: differentiate it again if you like
    loss_val, gw = ad.Evaluator([loss, grad_w]).run({x: torch.randn(4, 3), w: torch.randn(3, 2)})

It is a drop-in for PA1's `auto_diff` module (`import scratchlm.autodiff as auto_diff`): the same names for the
op instances and classes (`ReLUOp`, `GreaterThanOp`, `MatMulLayerNormOp`, ...), `Variable` as a class,
`node.constant`-style access to attrs, two-input fused ops, and gradient lists of nodes (zeros_like where
nothing flows). torch.autograd is never used here: tensors are only data, every derivative is an op's
`gradient`.
"""

from .evaluator import Evaluator, GraphRunError, gradients, gradients_or_none, substitute
from .fused import MatMulLayerNormOp, MatMulSoftmaxOp, matmul_layernorm, matmul_softmax
from .graph import Node, NodeAttributeError, Op, PlaceholderOp, Variable, placeholder, topological_sort
from .nn_ops import (
    CausalMaskOp,
    CrossEntropyOp,
    EmbeddingOp,
    LinearOp,
    LogSoftmaxOp,
    MergeHeadsOp,
    OneHotLikeOp,
    RepeatKVOp,
    RMSNormalizeOp,
    RotatePairsOp,
    SigmoidOp,
    SiluOp,
    SplitHeadsOp,
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
    AddByConstOp,
    AddOp,
    BroadcastOp,
    ConstantOp,
    DivByConstOp,
    DivOp,
    ExpandAsOp,
    ExpandAsOp3d,
    ExpOp,
    GreaterThanOp,
    LayerNormOp,
    LogOp,
    MatMulOp,
    MeanOp,
    MulByConstOp,
    MulOp,
    NegOp,
    OnesLikeOp,
    PowerOp,
    RDivByConstOp,
    ReLUOp,
    ReshapeAsOp,
    ReshapeOp,
    SoftmaxOp,
    SqrtOp,
    SubOp,
    SumOp,
    SumToOp,
    TransposeOp,
    ZerosLikeOp,
    add,
    add_by_const,
    broadcast,
    constant,
    div,
    div_by_const,
    exp,
    expand_as,
    expand_as_3d,
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
    # graph, evaluation, gradients
    "Evaluator", "GraphRunError", "Node", "NodeAttributeError", "Op", "PlaceholderOp", "Variable", "gradients",
    "gradients_or_none", "placeholder", "substitute", "topological_sort",
    # op instances
    "add", "add_by_const", "broadcast", "causal_mask", "constant", "cross_entropy", "div", "div_by_const",
    "embedding", "exp", "expand_as", "expand_as_3d", "greater", "layernorm", "linear", "log", "log_softmax",
    "matmul", "matmul_layernorm", "matmul_softmax", "mean", "merge_heads", "mul", "mul_by_const", "neg",
    "one_hot_like", "ones_like", "power", "rdiv_by_const", "relu", "repeat_kv", "reshape", "reshape_as",
    "rms_normalize", "rmsnorm", "rotary", "rotary_tables", "rotate_pairs", "sigmoid", "silu", "softmax",
    "split_heads", "sqrt", "sub", "sum_op", "sum_to", "transpose", "zeros_like",
    # op classes (PA1 spellings)
    "AddByConstOp", "AddOp", "BroadcastOp", "CausalMaskOp", "ConstantOp", "CrossEntropyOp", "DivByConstOp", "DivOp",
    "EmbeddingOp", "ExpOp", "ExpandAsOp", "ExpandAsOp3d", "GreaterThanOp", "LayerNormOp", "LinearOp", "LogOp",
    "LogSoftmaxOp", "MatMulLayerNormOp", "MatMulOp", "MatMulSoftmaxOp", "MeanOp", "MergeHeadsOp", "MulByConstOp",
    "MulOp", "NegOp", "OneHotLikeOp", "OnesLikeOp", "PowerOp", "RDivByConstOp", "ReLUOp", "RMSNormalizeOp",
    "RepeatKVOp", "ReshapeAsOp", "ReshapeOp", "RotatePairsOp", "SigmoidOp", "SiluOp", "SoftmaxOp", "SplitHeadsOp",
    "SqrtOp", "SubOp", "SumOp", "SumToOp", "TransposeOp", "ZerosLikeOp",
]
