"""Building blocks shared by the diffusion components, on top of `scratchlm.model.layers`.

- `BiasLinear`: the project's `Linear` (y = x W^T) plus a bias, the shape diffusers' checkpoints need.
- `attention`: bidirectional multi-head attention on (B, T, H, D) tensors, optionally chunked over
  queries (the memory wall: the (T, S) score matrix is the term that grows with the square of the
  latent's token count; chunking bounds it at (chunk, S) for the price of more, smaller GEMMs).
  Three implementations (`attention_impl`): "fused" (the default: scratchlm's C++ kernel,
  `fused_attention.py`, where it beats torch's (`fused_kernel_pays`); torch's SDPA for the others),
  "sdpa" (torch's fused kernel always), "math" (the scores materialised). All exact up to float rounding.
- sinusoidal timestep and 2-D position embeddings, bit-for-bit the formulas diffusers uses
  (`get_timestep_embedding`, `get_2d_sincos_pos_embed`), so weights move between the two.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.model.layers import Linear

# Query rows per attention chunk (None: the whole score matrix at once). Set by `chunked_attention`.
ATTENTION_CHUNK: int | None = None
# "fused": scratchlm's kernel (fused_attention.py) where `fused_kernel_pays`, torch's SDPA otherwise;
# "sdpa": torch's fused scaled_dot_product_attention (on CPU a flash-style kernel that never holds the
# (T, S) scores); "math": scores materialised, softmax, then @ V (what a plain implementation, or
# diffusers' AttnProcessor, holds in memory). Set by `attention_impl`.
ATTENTION_IMPL: str = "fused"
IMPLS = ("fused", "sdpa", "math")


def fused_kernel_pays(head_dim: int, keys: int) -> bool:
    """Where scratchlm's kernel beats torch's SDPA on this CPU (benchmarks/sd_pipeline.py --parts attention): head
    dim 8 (1.5-2.7x); 16 over short key sets (cross-attention to 77 text tokens ~1.8x, but 0.7-0.9x over 1024 keys);
    from 32 on torch's GEMM-based kernel wins."""
    return head_dim == 8 or (head_dim == 16 and keys <= 512)


class BiasLinear(Linear):
    """`scratchlm.model.layers.Linear` with an additive bias: y = x W^T + b. Parameter names match nn.Linear."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True, device=None, dtype=None):
        super().__init__(d_in, d_out, device=device, dtype=dtype)
        self.bias = nn.Parameter(torch.zeros(d_out, device=device, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        if self.bias is None:
            return super().forward(x)
        return torch.addmm(self.bias, x.reshape(-1, self.d_in), self.weight.t()).view(*x.shape[:-1], self.d_out)


def attention(q: Tensor, k: Tensor, v: Tensor, chunk: int | None = None) -> Tensor:
    """Full (non-causal) attention: q (B, T, H, D), k/v (B, S, H, D) -> (B, T, H, D).

    `chunk` (or the module default ATTENTION_CHUNK): process queries `chunk` rows at a time, so the
    score matrix held at once is (B, H, chunk, S) instead of (B, H, T, S). Exact either way.
    """
    chunk = chunk if chunk is not None else ATTENTION_CHUNK
    if ATTENTION_IMPL == "fused" and fused_kernel_pays(q.shape[-1], k.shape[1]):
        from scratchlm.diffusion.fused_attention import attention as fused

        return fused(q, k, v)  # holds 8 rows of scores at a time: already chunked, finer than any `chunk`
    qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T|S, D)
    core = _math_attention if ATTENTION_IMPL == "math" else F.scaled_dot_product_attention
    if not chunk or chunk >= q.shape[1]:
        return core(qh, kh, vh).transpose(1, 2)
    out = torch.empty_like(qh)
    for s in range(0, q.shape[1], chunk):
        out[:, :, s:s + chunk] = core(qh[:, :, s:s + chunk], kh, vh)
    return out.transpose(1, 2)  # (B, T, H, D)


def _math_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """softmax(q k^T / sqrt(D)) v with the (B, H, T, S) scores materialised."""
    scores = (q * q.shape[-1] ** -0.5) @ k.transpose(-1, -2)  # (B, H, T, S)
    return torch.softmax(scores, dim=-1) @ v


class attention_impl:
    """Context manager: `with attention_impl("math"): ...` materialises the attention scores ("sdpa": torch's
    fused kernel for every head dim; "fused": the default)."""

    def __init__(self, impl: str):
        if impl not in IMPLS:
            raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
        self.impl = impl

    def __enter__(self):
        global ATTENTION_IMPL
        self.prev, ATTENTION_IMPL = ATTENTION_IMPL, self.impl
        return self

    def __exit__(self, *exc):
        global ATTENTION_IMPL
        ATTENTION_IMPL = self.prev


class chunked_attention:
    """Context manager: `with chunked_attention(256): ...` runs every diffusion attention in query chunks."""

    def __init__(self, chunk: int | None):
        self.chunk = chunk

    def __enter__(self):
        global ATTENTION_CHUNK
        self.prev, ATTENTION_CHUNK = ATTENTION_CHUNK, self.chunk
        return self

    def __exit__(self, *exc):
        global ATTENTION_CHUNK
        ATTENTION_CHUNK = self.prev


def timestep_embedding(t: Tensor, dim: int, flip_sin_to_cos: bool = True, shift: float = 0.0,
                       max_period: int = 10_000) -> Tensor:
    """Sinusoidal embedding (N,) -> (N, dim), as diffusers' `get_timestep_embedding`."""
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / (half - shift)
    emb = t[:, None].float() * torch.exp(exponent)[None, :]  # (N, half)
    emb = torch.cat([emb.sin(), emb.cos()], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)
    return F.pad(emb, (0, 1)) if dim % 2 else emb


def _sincos_1d(dim: int, pos: Tensor) -> Tensor:
    omega = torch.arange(dim // 2, dtype=torch.float64, device=pos.device) / (dim / 2.0)
    omega = 1.0 / 10000**omega  # (D/2,)
    out = torch.outer(pos.reshape(-1).double(), omega)  # (M, D/2)
    return torch.cat([out.sin(), out.cos()], dim=1)  # (M, D)


def sincos_pos_embed_2d(dim: int, grid_h: int, grid_w: int, base_size: int, interpolation_scale: float,
                        device=None) -> Tensor:
    """(grid_h * grid_w, dim) float32 2-D sin-cos position table, row-major over (h, w), as diffusers'."""
    gh = torch.arange(grid_h, dtype=torch.float32, device=device) / (grid_h / base_size) / interpolation_scale
    gw = torch.arange(grid_w, dtype=torch.float32, device=device) / (grid_w / base_size) / interpolation_scale
    grid = torch.stack(torch.meshgrid(gw, gh, indexing="xy"), dim=0).reshape(2, 1, grid_h, grid_w)  # (2, 1, H, W)
    emb = torch.cat([_sincos_1d(dim // 2, grid[0]), _sincos_1d(dim // 2, grid[1])], dim=1)
    return emb.float()
