"""The layers of the transformer, written from tensor operations (CS336 assignment 1).

Hot paths (RMSNorm, SwiGLU's gate, causal attention) are `torch.autograd.Function`s with a
hand-written backward: fewer saved tensors, in-place work, one pass where autograd would take
several. `functional.py` holds the plain readable versions; the tests check both against torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.model.rope import inv_freq


def trunc_normal_(t: Tensor, std: float) -> Tensor:
    """In-place truncated normal N(0, std^2) clipped at +-3 std."""
    return nn.init.trunc_normal_(t, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Linear(nn.Module):
    """y = x W^T, no bias. W: (d_out, d_in), init truncated normal with sigma^2 = 2 / (d_in + d_out).

    CS336's signature: `Linear(in_features, out_features, device=None, dtype=None)`; `d_in`/`d_out` are the
    same numbers under scratchlm's names.
    """

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.d_in, self.d_out = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype))
        trunc_normal_(self.weight, math.sqrt(2.0 / (in_features + out_features)))

    in_features = property(lambda self: self.d_in, doc="CS336 / torch name of d_in")
    out_features = property(lambda self: self.d_out, doc="CS336 / torch name of d_out")

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight.t()

    def extra_repr(self) -> str:
        return f"d_in={self.d_in}, d_out={self.d_out}"


class Embedding(nn.Module):
    """Lookup table: ids (...) -> rows of weight (num_embeddings, dim). Init truncated N(0, std^2), +-3 std.

    CS336's signature: `Embedding(num_embeddings, embedding_dim, device=None, dtype=None)`; `std` is
    keyword-only.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None, *, std: float = 1.0):
        super().__init__()
        self.num_embeddings, self.dim = num_embeddings, embedding_dim
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
        trunc_normal_(self.weight, std)

    embedding_dim = property(lambda self: self.dim, doc="CS336 / torch name of dim")

    def forward(self, ids: Tensor) -> Tensor:
        return self.weight[ids]  # (..., dim); measured faster to train than index_select at 2 threads

    def extra_repr(self) -> str:
        return f"num_embeddings={self.num_embeddings}, dim={self.dim}"


def _rmsnorm_forward(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """(y, r): y = w * x * r in x's dtype, r = rsqrt(mean(x^2) + eps) (..., 1) in float32."""
    xf = x.float()
    r = torch.rsqrt(xf.square().mean(dim=-1, keepdim=True).add_(eps))  # (..., 1)
    return (xf * r).mul_(weight.float()).to(x.dtype), r


class _RMSNormFunction(torch.autograd.Function):
    """y = w * x * r, r = rsqrt(mean(x^2) + eps), computed in float32. Saves x and r only."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        y, r = _rmsnorm_forward(x, weight, eps)
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
    """Root-mean-square norm over the last dim with a learned gain; computed in float32.

    CS336's signature: `RMSNorm(d_model, eps=1e-5, device=None, dtype=None)`.
    """

    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = d_model, eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    d_model = property(lambda self: self.dim, doc="CS336 name of dim")

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad):
            return _RMSNormFunction.apply(x, self.weight, self.eps)
        return _rmsnorm_forward(x, self.weight, self.eps)[0]  # inference: no autograd.Function overhead

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}"


ROPE_LAYOUTS = ("half", "adjacent", "none")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in either pair layout, with no stored buffers (meta-device friendly).

    layout "half": rotate (x_i, x_{i+R/2}) as HF Llama; "adjacent": rotate (x_{2i}, x_{2i+1}) as llama2.c and
    CS336; "none": no position embedding at all (NoPE): `rotate` returns x, and `cos_sin` gives the identity
    tables (cos 1, sin 0), so code that applies the tables itself (fused kernels) rotates by zero too.

    `rotary_dim` (R, default head_dim): only the first R dims of each head rotate (partial RoPE, Phi-4-mini);
    `scaling`: the frequency scaling of `model.rope.inv_freq` (llama3, YaRN, LongRoPE, ...), whose cos/sin may
    also carry an attention factor.
    """

    def __init__(self, head_dim: int, theta: float = 10_000.0, layout: str = "half", *, rotary_dim: int | None = None,
                 scaling=None):
        super().__init__()
        if layout not in ROPE_LAYOUTS:
            raise ValueError(f"RoPE layout must be one of {ROPE_LAYOUTS}, got {layout!r}")
        self.head_dim, self.theta, self.layout = head_dim, theta, layout
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.scaling = scaling  # a model.config.RopeFeatures, or None for plain RoPE

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on the sequence's length (dynamic NTK, LongRoPE): then `cos_sin` wants
        each row's sequence length (`lengths`), as HF computes them per sequence from its longest position."""
        return self.scaling is not None and self.scaling.scaling in ("dynamic", "longrope")

    def cos_sin(self, positions: Tensor, dtype: torch.dtype, lengths: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """cos, sin of shape (*positions.shape, 1, R/2), ready to broadcast over heads. `lengths` (like positions):
        each row's sequence length in this step, for length-dependent scalings; default: one sequence, the
        longest position + 1."""
        if self.length_dependent and lengths is not None and positions.numel():
            cos = torch.empty(*positions.shape, self.rotary_dim // 2, device=positions.device)
            sin = torch.empty_like(cos)
            for length in lengths.unique().tolist():
                rows = lengths == length
                freq, factor = inv_freq(self.rotary_dim, self.theta, self.scaling, int(length), positions.device)
                angles = positions[rows].to(torch.float32)[..., None] * freq  # (n, R/2)
                cos[rows], sin[rows] = angles.cos() * factor, angles.sin() * factor
            return cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)  # (..., T, 1, R/2)
        seq_len = int(positions.max()) + 1 if self.scaling is not None and positions.numel() else 0
        freq, factor = inv_freq(self.rotary_dim, self.theta, self.scaling, seq_len, positions.device)  # (R/2,)
        angles = positions.to(torch.float32)[..., None] * freq  # (..., T, R/2)
        if self.layout == "none":
            angles = torch.zeros_like(angles)  # identity rotation
        cos, sin = angles.cos(), angles.sin()
        if factor != 1.0:
            cos, sin = cos * factor, sin * factor
        return cos.unsqueeze(-2).to(dtype), sin.unsqueeze(-2).to(dtype)  # (..., T, 1, R/2)

    def rotate(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (..., T, H, D) rotated by precomputed cos/sin (..., T, 1, R/2); dims past R pass through."""
        if self.layout == "none":
            return x
        if self.rotary_dim != x.shape[-1]:
            r = self.rotary_dim
            return torch.cat((self.rotate(x[..., :r], cos, sin), x[..., r:]), dim=-1)
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
        extra = "" if self.rotary_dim == self.head_dim else f", rotary_dim={self.rotary_dim}"
        extra += "" if self.scaling is None else f", scaling={self.scaling.scaling!r}"
        return f"head_dim={self.head_dim}, theta={self.theta}, layout={self.layout!r}{extra}"


class RotaryPositionalEmbedding(RotaryEmbedding):
    """CS336's RoPE module: `RotaryPositionalEmbedding(theta, d_k, max_seq_len, device=None)`, adjacent pairs,
    `forward(x (..., seq_len, d_k), token_positions (..., seq_len)) -> (..., seq_len, d_k)` (no head dim).

    Nothing is precomputed (the angles are a few flops per position), so `max_seq_len` is only checked.
    """

    def __init__(self, theta: float, d_k: int, max_seq_len: int | None = None, device=None):
        super().__init__(d_k, theta, "adjacent")
        self.max_seq_len = max_seq_len

    def forward(self, x: Tensor, token_positions: Tensor | None = None) -> Tensor:
        if token_positions is None:
            token_positions = torch.arange(x.shape[-2], device=x.device)
        if self.max_seq_len is not None and token_positions.numel() and int(token_positions.max()) >= self.max_seq_len:
            raise ValueError(f"token position {int(token_positions.max())} >= max_seq_len={self.max_seq_len}")
        cos, sin = self.cos_sin(token_positions, x.dtype)  # (..., T, 1, D/2)
        return self.rotate(x.unsqueeze(-2), cos, sin).squeeze(-2)  # x as (..., T, 1, D): one "head"


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


def activation(name: str, x: Tensor) -> Tensor:
    """The MLP's activation: "silu", "gelu_tanh" (GPT-2's gelu_new, Gemma's gelu_pytorch_tanh) or "gelu" (erf)."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if name == "gelu":
        return F.gelu(x)
    raise ValueError(f"unknown activation {name!r}")


class MLP(nn.Module):
    """The feed-forward network: gated, w2( act(w1 x + b1) * (w3 x + b3) ) + b2 (SwiGLU, GeGLU), or plain,
    w2( act(w1 x + b1) ) + b2 (GPT-2). w1 = gate (or up when plain), w3 = up, w2 = down; biases optional.

    gpt-oss's experts (`swiglu_alpha`, `swiglu_limit`): with g = min(gate, limit) and u = clamp(up, -limit, limit),
    the gated product is g * sigmoid(alpha * g) * (u + 1) (`gated_act`)."""

    # How tensor parallelism splits each parameter (read by scratchlm.parallel only; see `Attention.tp_plan`):
    # w1/w3 (and b1/b3) by hidden unit, w2 by its input columns (all-reduced, then b2 added once).
    tp_plan = {"w1.weight": "column", "w3.weight": "column", "b1": "column", "b3": "column", "w2.weight": "row",
               "b2": "replicated"}

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None, *, act: str = "silu", gated: bool = True,
                 bias: bool = False, swiglu_alpha: float = 1.0, swiglu_limit: float | None = None):
        super().__init__()
        self.act, self.gated = act, gated
        self.alpha, self.limit = swiglu_alpha, swiglu_limit
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype) if gated else None
        if bias:
            self.b1 = nn.Parameter(torch.zeros(d_ff, device=device, dtype=dtype))
            self.b2 = nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype))
            self.b3 = nn.Parameter(torch.zeros(d_ff, device=device, dtype=dtype)) if gated else None
        else:
            self.b1 = self.b2 = self.b3 = None

    @staticmethod
    def _plus(y: Tensor, b: Tensor | None) -> Tensor:
        return y if b is None else y + b

    @property
    def plain_glu(self) -> bool:
        """Whether the gated product is act(gate) * up (not gpt-oss's clamped SwiGLU)."""
        return self.alpha == 1.0 and self.limit is None

    def gated_act(self, gate: Tensor, up: Tensor) -> Tensor:
        """act(gate) * up, or gpt-oss's clamped SwiGLU (see the class docstring)."""
        if self.plain_glu:
            return activation(self.act, gate) * up
        if self.limit is not None:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit) + 1
        return gate * torch.sigmoid(gate * self.alpha) * up

    def forward(self, x: Tensor) -> Tensor:
        if self.act == "silu" and self.gated and self.b1 is None and self.plain_glu:
            # (A gate/up GEMM on concatenated weights was measured slower: the elementwise work on the
            # strided halves costs more than the GEMM saves.)
            gate, up = self.w1(x), self.w3(x)
            if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
                return self.w2(_SiluMulFunction.apply(gate, up))
            return self.w2(torch.sigmoid(gate).mul_(gate).mul_(up))
        h = self._plus(self.w1(x), self.b1)
        h = self.gated_act(h, self._plus(self.w3(x), self.b3)) if self.gated else activation(self.act, h)
        return self._plus(self.w2(h), self.b2)


class SwiGLU(MLP):
    """w2( silu(w1 x) * w3 x ): w1 = gate, w3 = up, w2 = down (CS336's `SwiGLU(d_model, d_ff)`)."""

    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__(d_model, d_ff, device=device, dtype=dtype)


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with a gain and an optional bias (GPT-2), computed in float32."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, device=None, dtype=None):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(dim, device=device, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), (self.dim,), self.weight.float(), b, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, eps={self.eps}, bias={self.bias is not None}"


# Query rows per block of the causal attention, or None for no blocking (the default). A block skips the
# keys after its last query (fewer FLOPs) but multiplies the op count, and the blocked backward accumulates
# into key-range slices; measured at T=256 on 2 threads, one attention layer's forward+backward took
# 2.45 s with 128-row blocks, 3.76 s with 64-row blocks and 0.46 s unblocked (SDPA: 0.18 s). So blocking
# stays off until it is made faster; the tests turn it on to check the blocked path against torch.
QUERY_BLOCK: int | None = None


def _diagonal_mask(rows: int, group: int, cols: int, device) -> Tensor:
    """(rows*group, cols) bool, True where key j > query t (row r = t*group + g): the causal block diagonal."""
    t = torch.arange(rows, device=device).repeat_interleave(group)[:, None]
    return torch.arange(cols, device=device)[None, :] > t


def _attention_forward(qs: Tensor, k: Tensor, v: Tensor, group: int, q_offset: int):
    """Blocked causal attention; `qs` (nb, B*Hkv, Tb*G, D) is q scaled by 1/sqrt(D), rows t*G + g per block;
    k, v: (B*Hkv, S, D) contiguous. Everything is a 3-D `bmm` on contiguous views (no hidden copies).

    Query block i (queries i*Tb .. (i+1)*Tb-1) only multiplies the keys up to its last query (about 56%
    of the full T x T work with 8 blocks), only its diagonal sub-block is masked, and the softmax
    is left unnormalised: out = (E @ V) / l with E = exp(S - rowmax), l = rowsum(E).
    Returns (out (nb, B*Hkv, Tb*G, D), [E per block], [l per block]).
    """
    nb, _, rows, _ = qs.shape
    tb = rows // group
    out = torch.empty_like(qs)
    es, ls = [], []
    for i in range(nb):
        diag, kend = q_offset + i * tb, min(k.shape[1], q_offset + (i + 1) * tb)
        e = torch.bmm(qs[i], k[:, :kend].transpose(1, 2))  # (B*Hkv, Tb*G, kend)
        if kend > diag + 1:  # keys after the block's first query exist: mask the diagonal sub-block
            e[..., diag:kend].masked_fill_(_diagonal_mask(tb, group, kend - diag, qs.device), float("-inf"))
        e.sub_(e.amax(dim=-1, keepdim=True)).exp_()  # numerically stable, unnormalised softmax
        l = e.sum(dim=-1, keepdim=True)  # (B*Hkv, Tb*G, 1)
        torch.bmm(e, v[:, :kend], out=out[i]).div_(l)  # (B*Hkv, Tb*G, D)
        es.append(e)
        ls.append(l)
    return out, es, ls


class _CausalAttentionFunction(torch.autograd.Function):
    """Causal GQA attention: q (nb, B*Hkv, Tb*G, D) in query blocks, k/v (B*Hkv, S, D) -> like q.

    Backward per query block with P = E / l: dV += P^T dO, dS = P * (dO V^T - rowsum(dO * O)),
    folding 1/l into the small (rows, D) tensors so each (rows, keys) matrix is touched twice.
    """

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group: int, q_offset: int) -> Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        qs = q * scale
        out, es, ls = _attention_forward(qs, k, v, group, q_offset)
        ctx.save_for_backward(qs, k, v, out, *es, *ls)
        ctx.group, ctx.q_offset, ctx.scale, ctx.n_blocks = group, q_offset, scale, len(es)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        qs, k, v, out, *rest = ctx.saved_tensors
        es, ls = rest[:ctx.n_blocks], rest[ctx.n_blocks:]
        grad_out = grad_out.contiguous()
        delta = (grad_out * out).sum(dim=-1, keepdim=True)  # (nb, B*Hkv, Tb*G, 1)
        grad_q = torch.empty_like(qs)
        grad_k = torch.zeros_like(k)
        grad_v = torch.zeros_like(v)
        for i, (e, l) in enumerate(zip(es, ls)):
            kend = e.shape[-1]
            do = grad_out[i] / l  # (B*Hkv, Tb*G, D): dO / l
            gv = grad_v[:, :kend]
            gv.baddbmm_(e.transpose(1, 2), do)  # dV += P^T dO
            ds = torch.bmm(do, v[:, :kend].transpose(1, 2))  # (B*Hkv, Tb*G, kend): dP / l
            ds.sub_(delta[i] / l).mul_(e)  # dS = P * (dP - delta)
            torch.bmm(ds, k[:, :kend], out=grad_q[i]).mul_(ctx.scale)
            gk = grad_k[:, :kend]
            gk.baddbmm_(ds.transpose(1, 2), qs[i])  # dK += dS^T q_scaled
        return grad_q, grad_k, grad_v, None, None


def causal_attention(q: Tensor, k: Tensor, v: Tensor, q_offset: int = 0) -> Tensor:
    """Causal grouped-query attention.

    q: (B, T, H, D); k, v: (B, S, Hkv, D) with H a multiple of Hkv; query t sits at absolute position
    q_offset + t and keys at 0..S-1 (S = q_offset + T for a KV cache, S = T without one).
    Returns (B, T, H, D). GQA is done by reshaping q to (.., Hkv, T*G, D), never by repeating k/v;
    with QUERY_BLOCK set (off by default), queries are processed in blocks that skip future keys.
    """
    b, t, h, d = q.shape
    hkv = k.shape[2]
    if h % hkv:
        raise ValueError(f"causal_attention: {h} query heads is not a multiple of {hkv} kv heads")
    if k.shape[1] < q_offset + t:
        raise ValueError(f"causal_attention: {k.shape[1]} keys cannot cover queries at {q_offset}..{q_offset + t - 1}")
    group = h // hkv
    tb = QUERY_BLOCK if QUERY_BLOCK and t % QUERY_BLOCK == 0 and t >= 2 * QUERY_BLOCK else t
    nb = t // tb
    s = k.shape[1]
    qg = q.reshape(b, nb, tb, hkv, group, d).permute(1, 0, 3, 2, 4, 5).reshape(nb, b * hkv, tb * group, d)
    # qg: (nb, B*Hkv, Tb*G, D), rows t*G + g inside each query block
    kg = k.transpose(1, 2).reshape(b * hkv, s, d)  # (B*Hkv, S, D) contiguous: key-block slices feed bmm directly
    vg = v.transpose(1, 2).reshape(b * hkv, s, d)  # (B*Hkv, S, D)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        out = _CausalAttentionFunction.apply(qg, kg, vg, group, q_offset)
    else:
        out = _attention_forward(qg * (1.0 / math.sqrt(d)), kg, vg, group, q_offset)[0]
    out = out.view(nb, b, hkv, tb, group, d).permute(1, 0, 3, 2, 4, 5)  # (B, nb, Tb, Hkv, G, D)
    return out.reshape(b, t, h, d)  # (B, T, H, D)


@dataclass(frozen=True)
class AttentionSpec:
    """How one layer's attention scores are made: q.k * scale, then cap * tanh(s / cap) when `softcap` is set, then
    the causal mask, narrowed to the last `window` keys (the query's own included) when `window` is set; `sinks`
    (H,): one more logit per query head in each softmax denominator, with no value (gpt-oss; the layer's parameter,
    set per call by `Attention`). Every attention backend takes it with the layer's q, k, v:
    `attn(layer_idx, q, k, v, spec)`."""

    scale: float
    softcap: float | None = None
    window: int | None = None
    sinks: Tensor | None = field(default=None, compare=False)

    def is_plain(self, head_dim: int) -> bool:
        """Whether this is plain causal softmax(q.k / sqrt(D)) attention."""
        return (self.softcap is None and self.window is None and self.sinks is None
                and self.scale == 1.0 / math.sqrt(head_dim))


def sink_softmax(scores: Tensor, sinks: Tensor | None) -> Tensor:
    """Softmax over the last dim of `scores`; with `sinks` (broadcastable to scores[..., :1]: one logit per row) that
    logit joins each row's denominator and is dropped from the result (HF gpt-oss's eager attention)."""
    if sinks is None:
        return scores.softmax(dim=-1)
    column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
    return torch.cat((scores, column), dim=-1).softmax(dim=-1)[..., :-1]


# attn(layer_idx, q (B, T, H, D), k (B, T, Hkv, D), v (B, T, Hkv, D), spec) -> (B, T, H, D); q/k already rotated.
# A backend that serves multi-head latent attention also has `mla(layer_idx, q_nope, q_rope, latent, k_rope, module,
# spec)` (model/mla.py): it caches the latent and the RoPE key instead of K/V.
AttentionBackend = Callable[[int, Tensor, Tensor, Tensor, AttentionSpec], Tensor]


def spec_attention(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, q_offset: int = 0) -> Tensor:
    """Causal GQA attention under `spec` (any scale, soft-cap, window, sinks): q (B, T, H, D), k/v (B, S, Hkv, D),
    query t at position q_offset + t -> (B, T, H, D). Plain specs take `causal_attention` (its fused backward); the
    rest is written with torch ops, scores in float32. v may be narrower or wider than q/k (MLA: v_head_dim): the output
    is (B, T, H, Dv)."""
    d, dv = q.shape[-1], v.shape[-1]
    if spec.is_plain(d) and dv == d:
        return causal_attention(q, k, v, q_offset)
    b, t, h, _ = q.shape
    s, hkv = k.shape[1], k.shape[2]
    qg = q.reshape(b, t, hkv, h // hkv, d).permute(0, 2, 3, 1, 4).float()  # (B, Hkv, G, T, D)
    kg = k.transpose(1, 2)[:, :, None].float()  # (B, Hkv, 1, S, D)
    vg = v.transpose(1, 2)[:, :, None].float()  # (B, Hkv, 1, S, D)
    scores = (qg @ kg.transpose(-1, -2)) * spec.scale  # (B, Hkv, G, T, S)
    if spec.softcap is not None:
        scores = torch.tanh(scores / spec.softcap) * spec.softcap
    qpos = torch.arange(q_offset, q_offset + t, device=q.device)[:, None]
    kpos = torch.arange(s, device=q.device)[None, :]
    masked = kpos > qpos  # (T, S)
    if spec.window is not None:
        masked = masked | (kpos <= qpos - spec.window)
    sinks = None if spec.sinks is None else spec.sinks.view(hkv, h // hkv, 1, 1)  # (Hkv, G, 1, 1)
    probs = sink_softmax(scores.masked_fill(masked, float("-inf")), sinks)
    out = probs @ vg  # (B, Hkv, G, T, D)
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, h, dv).to(q.dtype)  # (B, T, H, Dv)


class Attention(nn.Module):
    """Causal multi-head self-attention with grouped-query heads, RoPE and the attention features of
    `model.config.AttentionFeatures`: q/k/v and o biases, q/k-norm (per head or full width), and the scale /
    soft-cap / window of its `AttentionSpec`; `sinks`: a learned logit per query head (`sinks` (H,)) that each
    call's spec carries to the backend.

    `Attention(d_model, num_heads)` is CS336's multi-head self-attention (n_kv_heads = num_heads, head_dim =
    d_model // num_heads); its `output_proj` is `o_proj` here (see `scratchlm.model.loading.cs336`).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None,
                 qkv_bias: bool = False, device=None, dtype=None, *, o_bias: bool = False, qk_norm: str = "none",
                 norm_eps: float = 1e-6, spec: AttentionSpec | None = None, sinks: bool = False):
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"Attention: d_model={d_model} is not divisible by n_heads={n_heads}; give head_dim")
            head_dim = d_model // n_heads
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.spec = spec if spec is not None else AttentionSpec(1.0 / math.sqrt(head_dim))
        self.fuse_qkv = True  # training: q, k, v from one GEMM on the concatenated weights
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
        self.o_bias = nn.Parameter(torch.zeros(d_model, device=device, dtype=dtype)) if o_bias else None
        self.sinks = nn.Parameter(torch.zeros(n_heads, device=device, dtype=dtype)) if sinks else None  # (H,)
        self.qk_norm = qk_norm
        if qk_norm == "none":
            self.q_norm = self.k_norm = None
        else:
            qd, kd = (head_dim, head_dim) if qk_norm == "head" else (n_heads * head_dim, n_kv_heads * head_dim)
            self.q_norm = RMSNorm(qd, norm_eps, device=device, dtype=dtype)
            self.k_norm = RMSNorm(kd, norm_eps, device=device, dtype=dtype)
        # How tensor parallelism splits each parameter (read by scratchlm.parallel only; no effect here): "column"
        # splits the output rows (q by query head, k/v by KV head), "row" the input columns (o_proj: its partial
        # sums are all-reduced, then o_bias is added once), "replicated" keeps it whole. A full-width q/k-norm
        # splits with its heads (its mean of squares then spans the ranks); a per-head one is replicated.
        norm_split = "column" if qk_norm == "full" else "replicated"
        self.tp_plan = {"q_proj.weight": "column", "k_proj.weight": "column", "v_proj.weight": "column",
                        "q_bias": "column", "k_bias": "column", "v_bias": "column", "o_proj.weight": "row",
                        "o_bias": "replicated", "q_norm.weight": norm_split, "k_norm.weight": norm_split,
                        "sinks": "column"}

    def _project(self, x: Tensor, proj: Linear, bias: Tensor | None, heads: int) -> Tensor:
        y = proj(x) if bias is None else torch.addmm(bias, x.flatten(0, -2), proj.weight.t())  # (..., heads * D)
        return y.view(*x.shape[:-1], heads, self.head_dim)  # (B, T, heads, D); also for T = 0

    def _project_fused(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, T, H, D), k, v (B, T, Hkv, D) from one GEMM on the concatenated weights."""
        w = torch.cat((self.q_proj.weight, self.k_proj.weight, self.v_proj.weight))  # ((H + 2 Hkv) D, d_model)
        if self.q_bias is None:
            qkv = x @ w.t()
        else:
            bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
            qkv = torch.addmm(bias, x.flatten(0, -2), w.t()).view(*x.shape[:-1], -1)
        nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q, k, v = qkv.split((nq, nkv, nkv), dim=-1)
        shape = x.shape[:-1]
        return (q.view(*shape, self.n_heads, self.head_dim), k.view(*shape, self.n_kv_heads, self.head_dim),
                v.view(*shape, self.n_kv_heads, self.head_dim))

    def _norm_qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """q/k-norm: per head on (..., heads, D), or over each token's whole projection."""
        if self.q_norm is None:
            return q, k
        if self.qk_norm == "head":
            return self.q_norm(q), self.k_norm(k)
        return self.q_norm(q.flatten(-2)).view(q.shape), self.k_norm(k.flatten(-2)).view(k.shape)

    def forward(self, x: Tensor, rope: RotaryEmbedding | None = None, cos: Tensor | None = None,
                sin: Tensor | None = None, attn: AttentionBackend | None = None, layer_idx: int = 0, *,
                token_positions: Tensor | None = None) -> Tensor:
        """x (B, T, d_model) -> (B, T, d_model).

        cos/sin from `rope.cos_sin(positions)`; with a rope but no tables they are made here from
        `token_positions` (default 0..T-1). `rope=None` runs without position embedding (CS336's plain
        multi-head self-attention, and NoPE layers).
        """
        if x.dim() != 3:
            raise ValueError(f"Attention expects x of shape (batch, seq, d_model), got {tuple(x.shape)}")
        b, t, _ = x.shape
        if rope is not None and (cos is None or sin is None):
            positions = torch.arange(t, device=x.device) if token_positions is None else token_positions
            cos, sin = rope.cos_sin(positions, x.dtype)
        if self.fuse_qkv and torch.is_grad_enabled() and (x.requires_grad or self.q_proj.weight.requires_grad):
            q, k, v = self._project_fused(x)  # training: one GEMM for q, k and v
        else:
            q = self._project(x, self.q_proj, self.q_bias, self.n_heads)  # (B, T, H, D)
            k = self._project(x, self.k_proj, self.k_bias, self.n_kv_heads)  # (B, T, Hkv, D)
            v = self._project(x, self.v_proj, self.v_bias, self.n_kv_heads)  # (B, T, Hkv, D)
        q, k = self._norm_qk(q, k)
        if rope is not None:
            q, k = rope.rotate(q, cos, sin), rope.rotate(k, cos, sin)
        spec = self.spec if self.sinks is None else replace(self.spec, sinks=self.sinks)
        if attn is not None:
            out = attn(layer_idx, q, k, v, spec)  # (B, T, H, D)
        else:
            out = spec_attention(q, k, v, spec)
        y = self.o_proj(out.reshape(b, t, self.n_heads * self.head_dim))
        return y if self.o_bias is None else y + self.o_bias
