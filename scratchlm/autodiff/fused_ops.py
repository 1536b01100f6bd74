"""PA1's module name for the fused ops: `from scratchlm.autodiff.fused_ops import matmul_layernorm, matmul_softmax`
works like PA1's `from fused_ops import ...`, with PA1's semantics (see `auto_diff`: `matmul_layernorm` takes a
`normalized_shape` that is not the trailing dims of A @ B, with a warning). The ops live in `fused.py`."""

from .auto_diff import matmul_layernorm
from .fused import MatMulLayerNormOp, MatMulSoftmaxOp, matmul_softmax

__all__ = ["MatMulLayerNormOp", "MatMulSoftmaxOp", "matmul_layernorm", "matmul_softmax"]
