"""The layers of the transformer, written from tensor operations (CS336 assignment 1).

Hot paths (RMSNorm, SwiGLU's gate, causal attention) are `torch.autograd.Function`s with a
hand-written backward: fewer saved tensors, in-place work, one pass where autograd would take
several. `functional.py` holds the plain readable versions; the tests check both against torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

# attn(layer_idx, q (B, T, H, D), k (B, T, Hkv, D), v (B, T, Hkv, D)) -> (B, T, H, D); q/k already rotated.
AttentionBackend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


def trunc_normal_(t: Tensor, std: float) -> Tensor:
    """In-place truncated normal N(0, std^2) clipped at +-3 std."""
    return nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Linear(nn.Module):
    """y = x W^T, no bias. W: (d_out, d_in), init truncated normal with sigma^2 = 2 / (d_in + d_out)."""

    def __init__(self, d_in: int, d_out: int, device=None, dtype=None):
        super().__init__()
        self.d_in, self.d_out = d_in, d_out
        self.weight = nn.Parameter(torch.empty(d_out, d_in, device=device, dtype=dtype))
        trunc_normal_(self.weight, math.sqrt(2.0 / (d_in + d_out)))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.t()

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


class Embedding(nn.Module):
    """Lookup table: ids (...) -> rows of weight (num_embeddings, dim). Init truncated N(0, std^2), +-3 std."""

    def __init__(self, num_embeddings: int, dim: int, std: float = 1.0, device=None, dtype=None):
        super().__init__()
        self.num_embeddings, self.dim = num_embeddings, dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, device=device, dtype=dtype))
        trunc_normal_(self.weight, std)

    def forward(self, ids: Tensor) -> Tensor:
        return self.weight[ids]

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, dim={self.dim}"


class _RMSNormFunction(torch.autograd.Function):
    """y = w * x * r, r = rsqrt(mean(x^2) + eps), computed in float32. Saves x and r only."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        xf = x.float()
        r = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True).add_(eps))  # (..., 1)
        y = (xf * r).mul_(weight.float()).to(x.dtype)
        ctx.save_for_backward(x, weight, r)
        return y

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight, r = ctx.saved_tensors
        xhat = x.float() * r  # (..., d)
        gf = grad.float()
        grad_w = (gf * xhat).reshape(-1, xhat.shape[-1]).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            gw = gf * weight.float()  # (..., d): never modify the incoming grad in place
            dot = (gw * xhat).mean(dim=-1, keepdim=True)  # (..., 1)
            grad_x = gw.sub_(xhat.mul_(dot)).mul_(r).to(x.dtype)
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim with a learned gain; computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return _RMSNormFunction.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in either pair layout, with no stored buffers (meta-device friendly).

    layout "half": rotate (x_i, x_{i+D/2}) as HF Llama; "adjacent": rotate (x_{2i}, x_{2i+1}) as llama2.c.
    """

    def __init__(self, head_dim: int, theta: float = 10_000.0, layout: str = "half"):
        super().__init__()
        if layout not in ("half", "adjacent"):
            raise ValueError(f"RoPE layout must be 'half' or 'adjacent', got {layout!r}")
        self.head_dim, self.theta, self.layout = head_dim, theta, layout

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos, sin of shape (*positions.shape, 1, D/2), ready to broadcast over heads."""
        exponent = torch.arange(0, self.head_dim, 2, device=positions.device, dtype=torch.float32) / self.head_dim
        inv_freq = 1.0 / (self.theta**exponent)  # (D/2,)
        angles = positions.to(torch.float32)[..., None] * inv_freq  # (..., T, D/2)
        return angles.cos().unsqueeze(-2).to(dtype), angles.sin().unsqueeze(-2).to(dtype)  # (..., T, 1, D/2)

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (..., T, H, D) rotated by precomputed cos/sin (..., T, 1, D/2)."""
        if self.layout == "half":
            h = x.shape[-1] // 2
            x1, x2 = x[..., :h], x[..., h:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        pairs = x.unflatten(-1, (-1, 2))  # (..., T, H, D/2, 2)
        x1, x2 = pairs[..., 0], pairs[..., 1]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

    def apply(self, x: Tensor, positions: Tensor) -> Tensor:
        """Rotate x (..., T, H, D) at absolute positions (..., T) (or (T,))."""
        cos, sin = self.cos_sin(positions, x.dtype)
        return self.rotate(x, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}, layout={self.layout!r}"


class _SiluMulFunction(torch.autograd.Function):
    """silu(gate) * up in one step; saves gate and up, recomputes the sigmoid in backward."""

    @staticmethod
    def forward(ctx, gate: Tensor, up: Tensor) -> Tensor:
        ctx.save_for_backward(gate, up)
        return torch.sigmoid(gate).mul_(gate).mul_(up)

    @staticmethod
    def backward(ctx, grad: Tensor):
        gate, up = ctx.saved_tensors
        s = torch.sigmoid(gate)
        silu = gate * s
        grad_up = grad * silu
        # d silu / d gate = s * (1 + gate * (1 - s)) = s + silu * (1 - s)
        grad_gate = silu.mul_(1 - s).add_(s).mul_(grad).mul_(up)
        return grad_gate, grad_up


class SwiGLU(nn.Module):
    """w2( silu(w1 x) * w3 x ): w1 = gate, w3 = up, w2 = down."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(_SiluMulFunction.apply(self.w1(x), self.w3(x)))


def _causal_mask(t_q: int, t_k: int, q_offset: int, device) -> Tensor:
    """(t_q, t_k) bool, True where key position > query position (i.e. masked out)."""
    q_pos = torch.arange(q_offset, q_offset + t_q, device=device)[:, None]
    return torch.arange(t_k, device=device)[None, :] > q_pos


class _CausalAttentionFunction(torch.autograd.Function):
    """Causal GQA attention on grouped layout: q (N, Hkv, G*T, D), k/v (N, Hkv, S, D) -> (N, Hkv, G*T, D).

    Scores are one batched matmul per kv head (no repeat of k/v); masking and softmax are in place;
    backward uses the saved probabilities: dS = P * (dP - rowsum(dO * O)).
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: int, q_offset: int) -> Tensor:
        n, hkv, gt, d = q.shape
        t, s = gt // group, k.shape[2]
        scale = 1.0 / math.sqrt(d)
        p = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # (N, Hkv, G*T, S)
        if s > 1:
            mask = _causal_mask(t, s, q_offset, q.device)
            p.view(n, hkv, group, t, s).masked_fill_(mask, float("-inf"))
        p.sub_(p.amax(dim=-1, keepdim=True)).exp_()
        p.div_(p.sum(dim=-1, keepdim=True))
        out = torch.matmul(p, v)  # (N, Hkv, G*T, D)
        ctx.save_for_backward(q, k, v, p, out)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, p, out = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        grad_v = torch.matmul(p.transpose(-1, -2), grad_out)  # (N, Hkv, S, D)
        dp = torch.matmul(grad_out, v.transpose(-1, -2))  # (N, Hkv, G*T, S)
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (N, Hkv, G*T, 1)
        ds = dp.sub_(delta).mul_(p).mul_(ctx.scale)
        grad_q = torch.matmul(ds, k)  # (N, Hkv, G*T, D)
        grad_k = torch.matmul(ds.transpose(-1, -2), q)  # (N, Hkv, S, D)
        return grad_q, grad_k, grad_v, None, None


def causal_attention(q: Tensor, k: Tensor, v: Tensor, q_offset: int = 0) -> Tensor:
    """Causal grouped-query attention.

    q: (B, T, H, D); k, v: (B, S, Hkv, D) with H a multiple of Hkv; query t sits at absolute position
    q_offset + t and keys at 0..S-1 (S = q_offset + T for a KV cache, S = T without one).
    Returns (B, T, H, D).
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    if h % hkv:
        raise ValueError(f"causal_attention: {h} query heads is not a multiple of {hkv} kv heads")
    group = h // hkv
    qg = q.view(b, t, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, group * t, d)  # (B, Hkv, G*T, D)
    kg = k.transpose(1, 2)  # (B, Hkv, S, D)
    vg = v.transpose(1, 2)  # (B, Hkv, S, D)
    out = _CausalAttentionFunction.apply(qg, kg, vg, group, q_offset)  # (B, Hkv, G*T, D)
    return out.view(b, hkv, group, t, d).permute(0, 3, 1, 2, 4).reshape(b, t, h, d)  # (B, T, H, D)


class Attention(nn.Module):
    """Causal multi-head self-attention with grouped-query heads, RoPE and optional q/k/v biases."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, qkv_bias: bool = False,
                 device=None, dtype=None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.q_proj = Linear(d_model, n_heads * head_dim, device=device, dtype=dtype)
        self.k_proj = Linear(d_model, n_kv_heads * head_dim, device=device, dtype=dtype)
        self.v_proj = Linear(d_model, n_kv_heads * head_dim, device=device, dtype=dtype)
        self.o_proj = Linear(n_heads * head_dim, d_model, device=device, dtype=dtype)
        if qkv_bias:
            self.q_bias = nn.Parameter(torch.zeros(n_heads * head_dim, device=device, dtype=dtype))
            self.k_bias = nn.Parameter(torch.zeros(n_kv_heads * head_dim, device=device, dtype=dtype))
            self.v_bias = nn.Parameter(torch.zeros(n_kv_heads * head_dim, device=device, dtype=dtype))
        else:
            self.q_bias = self.k_bias = self.v_bias = None

    def _project(self, x: Tensor, proj: Linear, bias: Tensor | None, heads: int) -> Tensor:
        y = proj(x) if bias is None else torch.addmm(bias, x.flatten(0, -2), proj.weight.t()).view(
            *x.shape[:-1], -1)
        return y.view(*x.shape[:-1], heads, self.head_dim)  # (B, T, heads, D)

    def forward(self, x: Tensor, rope: RotaryEmbedding, cos: Tensor, sin: Tensor,
                attn: AttentionBackend | None = None, layer_idx: int = 0) -> Tensor:
        """x (B, T, d_model) -> (B, T, d_model); cos/sin from `rope.cos_sin(positions)`."""
        b, t, _ = x.shape
        q = rope.rotate(self._project(x, self.q_proj, self.q_bias, self.n_heads), cos, sin)  # (B, T, H, D)
        k = rope.rotate(self._project(x, self.k_proj, self.k_bias, self.n_kv_heads), cos, sin)  # (B, T, Hkv, D)
        v = self._project(x, self.v_proj, self.v_bias, self.n_kv_heads)  # (B, T, Hkv, D)
        out = causal_attention(q, k, v) if attn is None else attn(layer_idx, q, k, v)  # (B, T, H, D)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))
