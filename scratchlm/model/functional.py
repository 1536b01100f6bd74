"""Plain-function versions of the model's building blocks, with the CS336 assignment-1 signatures.

These are the readable reference: each is a few tensor operations. The layers in `layers.py` use
faster fused forms of the same math (custom autograd functions), and the tests check both against
torch's own implementations.
"""

from __future__ import annotations

import torch
from torch import Tensor


def softmax(x: Tensor, dim: int) -> Tensor:
    """Numerically stable softmax along `dim` (the max is subtracted before exp)."""
    shifted = x - x.amax(dim=dim, keepdim=True)
    e = shifted.exp()
    return e / e.sum(dim=dim, keepdim=True)


def silu(x: Tensor) -> Tensor:
    """SiLU (swish): x * sigmoid(x)."""
    return x * torch.sigmoid(x)


def rmsnorm(x: Tensor, weight: Tensor, eps: float = 1e-5) -> Tensor:
    """RMSNorm over the last dim, computed in float32 and cast back to x's dtype."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def scaled_dot_product_attention(Q: Tensor, K: Tensor, V: Tensor, mask: Tensor | None = None) -> Tensor:
    """softmax(Q K^T / sqrt(d_k)) V.

    Q: (..., n_q, d_k), K: (..., n_k, d_k), V: (..., n_k, d_v); mask: bool (..., n_q, n_k) where
    True means "may attend". Returns (..., n_q, d_v).
    """
    scores = Q @ K.transpose(-1, -2) / Q.shape[-1] ** 0.5  # (..., n_q, n_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return softmax(scores, dim=-1) @ V


def rope_angles(head_dim: int, positions: Tensor, theta: float = 10_000.0) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (*positions.shape, head_dim // 2): angle_i = pos * theta^(-2i/head_dim)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., D/2)
    return angles.cos(), angles.sin()


def rope(x: Tensor, positions: Tensor, theta: float = 10_000.0, layout: str = "adjacent") -> Tensor:
    """Rotary position embedding of x (..., T, D) at `positions` (..., T).

    layout "adjacent" rotates pairs (x0, x1), (x2, x3), ... (llama2.c, CS336); "half" rotates
    (x_i, x_{i+D/2}) (HF rotate-half).
    """
    d = x.shape[-1]
    cos, sin = rope_angles(d, positions, theta)  # (..., T, D/2)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if layout == "adjacent":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)  # (..., T, D/2, 2)
        return out.flatten(-2)
    if layout == "half":
        x1, x2 = x[..., : d // 2], x[..., d // 2 :]
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    raise ValueError(f"rope layout must be 'adjacent' or 'half', got {layout!r}")
