"""PA1's module name for the fused ops: `from scratchlm.autodiff.fused_ops import matmul_layernorm` works like
PA1's `from fused_ops import matmul_layernorm, matmul_softmax`. The ops live in `fused.py`."""

from .fused import MatMulLayerNormOp, MatMulSoftmaxOp, matmul_layernorm, matmul_softmax

__all__ = ["MatMulLayerNormOp", "MatMulSoftmaxOp", "matmul_layernorm", "matmul_softmax"]
