"""PA1's module name for the core: `scratchlm.autodiff.auto_diff` is the CSE234 PA1 interface.

It is `scratchlm.autodiff` (every name of its `__all__`) with PA1's semantics where scratchlm's own API is
stricter. One difference today: `layernorm` (and `fused_ops.matmul_layernorm`) normalise over the last
len(normalized_shape) dims whatever their sizes, as PA1's reference does (its public tests pass
``normalized_shape=[3]`` for a (3, 4) matmul), with a `NormalizedShapeWarning` naming the mismatch;
`scratchlm.autodiff.layernorm` refuses it with a ValueError.

Drop-in for a PA1 checkout: its ``auto_diff.py`` becomes ``from scratchlm.autodiff.auto_diff import *`` and its
``fused_ops.py`` ``from scratchlm.autodiff.fused_ops import *``; PA1's 40 public tests then pass.
"""

from scratchlm.autodiff import *  # noqa: F403  (the whole API under PA1's module name)
from scratchlm.autodiff import __all__ as _API

from .fused import MatMulLayerNormOp
from .ops import LayerNormOp, NormalizedShapeWarning

layernorm = LayerNormOp(strict_shape=False)
matmul_layernorm = MatMulLayerNormOp(strict_shape=False)

__all__ = [*_API, "NormalizedShapeWarning"]
