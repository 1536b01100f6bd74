"""The Pairformer trunk of AlphaFold3 / Boltz-2, written from tensor operations.

A block updates the pair representation z (B, N, N, c_z) and the single representation s (B, N, c_s):

    z += TriMulOutgoing(z)      z[i,j] <- sum_k a[i,k] * b[j,k]     (rows i: local under DAP)
    z += TriMulIncoming(z)      z[i,j] <- sum_k a[k,i] * b[k,j]     (columns: a transpose under DAP)
    z += TriAttStarting(z)      row i attends over its j, bias from z[j,k]
    z += TriAttEnding(z)        column j attends over its i, bias from z[k,i]
    z += Transition(z)          LayerNorm + SwiGLU (c_z -> 4 c_z -> c_z)
    s += AttentionPairBias(LN(s), z)   single attention, pair bias LN(z) W_b, gated
    s += Transition(s)

The math follows Boltz-2's `PairformerLayer(v2=True)` exactly in eval mode (dropout off): the same
LayerNorms (eps 1e-5), sigmoid gates, masks (pair mask multiplies the triangle-update inputs, and
-1e9 / -1e6 key-mask biases in the attentions), and fp32 softmax. `load_boltz_state_dict` takes Boltz's
state dict; `load_boltz_checkpoint` reads one from a file (weights-only: no code in a file runs).
Projections that read the same input are fused into one GEMM (p_in|g_in, q|k|v|g,
fc1|fc2 stay in the project's `SwiGLU`), which is where the single-rank speed over Boltz comes from.

Every pair op is split into a *local* part that only needs its own rows and the piece it needs from
the other rows (the triangle update's contracted operand, the triangle attention's bias), so the
Dynamic Axial Parallel block (`scratchlm.fold.dap`) runs the same code on row shards.

Chunking (`chunk_rows`): the triangle attentions, the triangle updates' projections and the
transitions run over row chunks, so the transient activations (attention logits: rows x H x N x N)
are bounded; `chunk_size_for_budget` picks the chunk from a byte budget. Chunked and unchunked give
the same numbers (the chunks are independent rows).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from scratchlm.model.layers import Linear, SwiGLU

# Boltz's key-mask biases: the triangle attention adds 1e9 * (mask - 1), the single attention (1 - mask) * -1e6.
TRI_INF = 1e9
SINGLE_INF = 1e6


@dataclass(frozen=True)
class PairformerConfig:
    """Shapes of a Pairformer stack (defaults: Boltz-2's trunk widths)."""

    c_s: int = field(default=384, metadata={"help": "single representation channels (token_s)"})
    c_z: int = field(default=128, metadata={"help": "pair representation channels (token_z)"})
    num_heads: int = field(default=16, metadata={"help": "heads of the single attention with pair bias"})
    pair_heads: int = field(default=4, metadata={"help": "heads of each triangle attention"})
    pair_head_dim: int = field(default=32, metadata={"help": "channels per triangle-attention head"})
    n_blocks: int = field(default=4, metadata={"help": "Pairformer blocks in the stack"})
    transition_mult: int = field(default=4, metadata={"help": "transition hidden size = mult x channels"})

    def __post_init__(self) -> None:
        for name in ("c_s", "c_z", "num_heads", "pair_heads", "pair_head_dim", "n_blocks", "transition_mult"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"PairformerConfig.{name}={v!r} must be a positive int")
        if self.c_s % self.num_heads:
            raise ValueError(f"PairformerConfig: c_s={self.c_s} is not a multiple of num_heads={self.num_heads}")


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with gain and bias (torch's kernel; the project's layers only have RMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)


def _row_chunks(n: int, chunk: int | None):
    """(start, stop) row ranges of at most `chunk` rows (one range when chunk is None)."""
    step = n if not chunk or chunk >= n else chunk
    for i in range(0, n, step):
        yield i, min(n, i + step)


class Transition(nn.Module):
    """LayerNorm then SwiGLU: fc3(silu(fc1 x) * fc2 x), Boltz's `Transition` (fc1 = w1, fc2 = w3, fc3 = w2)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = LayerNorm(dim)
        self.mlp = SwiGLU(dim, hidden)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., dim) -> the update (..., dim)."""
        return self.mlp(self.norm(x))

    def update_(self, z: Tensor, chunk_rows: int | None = None) -> None:
        """z (B, R, N, dim) += Transition(z), in place, over row chunks (bounded hidden activation)."""
        for i0, i1 in _row_chunks(z.shape[1], chunk_rows):
            z[:, i0:i1] += self.mlp(self.norm(z[:, i0:i1]))


class TriangleMultiplication(nn.Module):
    """Triangle multiplicative update, outgoing (z[i,j] = sum_k a[i,k] b[j,k]) or incoming (sum_k a[k,i] b[k,j]).

    Split for row shards: `project` gives the masked operands a, b of some rows as channel-chunk lists,
    `contract` the outgoing contraction of those rows of a against b, freeing each channel chunk of a and b
    as its product appears (so a + b + x never exceed two pair tensors), `finish_` the output norm,
    projection and gate (recomputed from LN(z)), added to z in place. The incoming update is the outgoing
    one on z transposed with a and b swapped: x^T[p,q] = x[q,p] = sum_k a[k,q] b[k,p] = sum_k b^T[p,k] a^T[q,k].
    """

    def __init__(self, dim: int, outgoing: bool):
        super().__init__()
        self.dim, self.outgoing = dim, outgoing
        self.norm_in = LayerNorm(dim)
        self.proj_in = Linear(dim, 4 * dim)  # rows: p_in (2 dim) then g_in (2 dim)
        self.norm_out = LayerNorm(dim)
        self.p_out = Linear(dim, dim)
        self.g_out = Linear(dim, dim)

    def project(self, z: Tensor, mask: Tensor, chunk_rows: int | None = None,
                channel_chunks: int = 8) -> tuple[list[Tensor], list[Tensor]]:
        """z (B, R, N, c), mask (B, R, N) -> a, b as lists of channel chunks (B, c/k, R, N), contiguous."""
        bsz, r, n, c = z.shape
        bounds = [(c * i // channel_chunks, c * (i + 1) // channel_chunks) for i in range(channel_chunks)]
        bounds = [(c0, c1) for c0, c1 in bounds if c1 > c0]
        a = [z.new_empty(bsz, c1 - c0, r, n) for c0, c1 in bounds]
        b = [z.new_empty(bsz, c1 - c0, r, n) for c0, c1 in bounds]
        w_p, w_g = self.proj_in.weight[: 2 * c], self.proj_in.weight[2 * c:]  # (2c, c) each, contiguous
        for i0, i1 in _row_chunks(r, chunk_rows):
            x = self.norm_in(z[:, i0:i1])  # (B, r, N, c)
            for bi in range(bsz):
                xt = x[bi].reshape(-1, c).t()  # (c, r N)
                # channel-first straight out of the GEMMs: W x^T is (2c, r N), so a and b need no transpose,
                # and the sigmoid runs in place on a contiguous tensor (strided sigmoid is 3x slower)
                ab = torch.mm(w_p, xt).mul_(torch.mm(w_g, xt).sigmoid_())  # (2c, r N): a then b
                ab = ab.view(2 * c, i1 - i0, n).mul_(mask[bi, i0:i1])
                for (c0, c1), ta, tb in zip(bounds, a, b):
                    ta[bi, :, i0:i1] = ab[c0:c1]
                    tb[bi, :, i0:i1] = ab[c + c0:c + c1]
            del x
        return a, b

    @staticmethod
    def contract(a: list[Tensor], b: list[Tensor]) -> list[Tensor]:
        """Channel chunks a (B, cc, R, K), b (B, cc, J, K) -> x (B, cc, R, J) = sum_k a[.., i, k] b[.., j, k].

        Empties the lists as it goes (a and b are freed chunk by chunk)."""
        x = []
        while a:
            x.append(torch.matmul(a.pop(0), b.pop(0).transpose(-1, -2)))
        return x

    def finish_(self, z: Tensor, x: list[Tensor], chunk_rows: int | None = None) -> None:
        """z (B, R, N, c) += p_out(LN(x)) * sigmoid(g_out(LN_in(z))), in place, row chunk by row chunk."""
        for i0, i1 in _row_chunks(z.shape[1], chunk_rows):
            gate = self.g_out(self.norm_in(z[:, i0:i1])).sigmoid_()  # from z's rows before their update
            xc = torch.cat([t[:, :, i0:i1] for t in x], dim=1).permute(0, 2, 3, 1)  # (B, r, N, c)
            z[:, i0:i1] += self.p_out(self.norm_out(xc)).mul_(gate)

    def update_(self, z: Tensor, pair_mask: Tensor, chunk_rows: int | None = None) -> None:
        """z (B, N, N, c) += the update, in place; pair_mask (B, N, N)."""
        if not self.outgoing:
            z, pair_mask = z.transpose(1, 2), pair_mask.transpose(1, 2)  # rows of z^T are columns of z
        a, b = self.project(z, pair_mask, chunk_rows)
        x = self.contract(a, b) if self.outgoing else self.contract(b, a)
        self.finish_(z, x, chunk_rows)

    def forward(self, z: Tensor, pair_mask: Tensor, chunk_rows: int | None = None) -> Tensor:
        """The update (B, N, N, c) alone (z is not modified)."""
        out = z.clone()
        self.update_(out, pair_mask, chunk_rows)
        return out.sub_(z)


class TriangleAttention(nn.Module):
    """Gated triangle self-attention around the starting node (rows) or the ending node (columns).

    Starting node: row i attends over j with logits q[i,j] k[i,k] / sqrt(d) + bias[h, j, k] + 1e9 (mask[i,k] - 1),
    bias = LN(z) W_b over the whole pair (B, H, N, N). The ending node is the same on z transposed.
    """

    def __init__(self, dim: int, heads: int, head_dim: int, starting: bool):
        super().__init__()
        self.dim, self.heads, self.head_dim, self.starting = dim, heads, head_dim, starting
        self.layer_norm = LayerNorm(dim)
        self.linear = Linear(dim, heads)  # triangle bias
        self.qkvg = Linear(dim, 4 * heads * head_dim)  # rows: q, k, v, g
        self.linear_o = Linear(heads * head_dim, dim)

    def bias(self, x: Tensor) -> Tensor:
        """LayerNormed rows x (B, R, N, c) -> their bias rows (B, H, R, N)."""
        return self.linear(x).permute(0, 3, 1, 2)

    def attend_(self, z: Tensor, x: Tensor, bias: Tensor | Callable[[], Tensor], mask: Tensor,
                chunk_rows: int | None = None) -> None:
        """z rows (B, R, N, c) += attention of the LayerNormed rows x, in place, one row chunk at a time.

        bias (B, H, N, N) covers the whole pair; it may be a callable returning it (an async all-gather's
        wait), called after the first chunk's q k^T. mask (B, R, N) masks the keys of each row."""
        bsz, r, n, _ = x.shape
        h, d = self.heads, self.head_dim
        scale = 1.0 / math.sqrt(d)
        bias5 = None
        for i0, i1 in _row_chunks(r, chunk_rows):
            rr = i1 - i0
            xr = x[:, i0:i1]
            w = self.qkvg.weight  # rows q, k, v, g: the gate's GEMM apart, so its sigmoid is contiguous
            qkv = (xr @ w[: 3 * h * d].t()).view(bsz, rr, n, 3, h, d)  # (B, r, N, 3, H, D)
            gate = (xr @ w[3 * h * d:].t()).sigmoid_()  # (B, r, N, H D)
            q = qkv[..., 0, :, :].transpose(2, 3) * scale  # (B, r, H, N, D)
            k = qkv[..., 1, :, :].transpose(2, 3)
            v = qkv[..., 2, :, :].transpose(2, 3)
            logits = torch.matmul(q, k.transpose(-1, -2))  # (B, r, H, N, N)
            del q, k
            if bias5 is None:
                bias5 = (bias() if callable(bias) else bias).unsqueeze(1)  # (B, 1, H, N, N)
            logits += bias5
            logits += (mask[:, i0:i1, None, None, :] - 1.0) * TRI_INF
            attn = torch.softmax(logits, dim=-1)
            del logits
            o = torch.matmul(attn, v).transpose(2, 3).reshape(bsz, rr, n, h * d)  # (B, r, N, H D)
            del attn, v, qkv
            z[:, i0:i1] += self.linear_o(o.mul_(gate))

    def update_(self, z: Tensor, pair_mask: Tensor, chunk_rows: int | None = None) -> None:
        """z (B, N, N, c) += the update, in place; pair_mask (B, N, N)."""
        if not self.starting:
            z, pair_mask = z.transpose(1, 2), pair_mask.transpose(1, 2)
        x = self.layer_norm(z)
        self.attend_(z, x, self.bias(x), pair_mask, chunk_rows)

    def forward(self, z: Tensor, pair_mask: Tensor, chunk_rows: int | None = None) -> Tensor:
        """The update (B, N, N, c) alone (z is not modified)."""
        out = z.clone()
        self.update_(out, pair_mask, chunk_rows)
        return out.sub_(z)


class AttentionPairBias(nn.Module):
    """Boltz-2's gated single attention with pair bias (v2: keys/values from the same normed s)."""

    def __init__(self, c_s: int, c_z: int, heads: int):
        super().__init__()
        self.c_s, self.heads, self.head_dim = c_s, heads, c_s // heads
        self.qkvg = Linear(c_s, 4 * c_s)  # rows: q, k, v, g
        self.q_bias = nn.Parameter(torch.zeros(c_s))
        self.norm_z = LayerNorm(c_z)
        self.proj_z = Linear(c_z, heads)

        self.proj_o = Linear(c_s, c_s)

    def pair_bias(self, z: Tensor, chunk_rows: int | None = None) -> Tensor:
        """z rows (B, R, N, c_z) -> bias rows (B, H, R, N) (LayerNorm over row chunks: no full-size copy)."""
        bsz, r, n, _ = z.shape
        out = z.new_empty(bsz, r, n, self.heads)
        for i0, i1 in _row_chunks(r, chunk_rows):
            out[:, i0:i1] = self.proj_z(self.norm_z(z[:, i0:i1]))
        return out.permute(0, 3, 1, 2)

    def forward(self, s: Tensor, bias: Tensor, mask: Tensor, rows: tuple[int, int] | None = None) -> Tensor:
        """s (B, N, c_s) normed, bias (B, H, R, N) for query rows `rows` (all when None), mask (B, N) keys.

        Returns the update for the query rows (B, R, c_s)."""
        bsz, n, c = s.shape
        h, d = self.heads, self.head_dim
        i0, i1 = rows if rows is not None else (0, n)
        w = self.qkvg.weight  # (4 c_s, c_s)
        q = (s[:, i0:i1] @ w[:c].t() + self.q_bias).view(bsz, i1 - i0, h, d).transpose(1, 2)  # (B, H, R, D)
        g = torch.sigmoid(s[:, i0:i1] @ w[3 * c:].t())  # (B, R, c_s)
        kv = (s @ w[c: 3 * c].t()).view(bsz, n, 2, h, d)  # (B, N, 2, H, D)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (B, H, N, D)
        logits = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d)  # (B, H, R, N)
        logits = logits + bias + (1.0 - mask[:, None, None, :]) * -SINGLE_INF
        o = torch.matmul(torch.softmax(logits, dim=-1), v)  # (B, H, R, D)
        o = o.transpose(1, 2).reshape(bsz, i1 - i0, c)
        return self.proj_o(g * o)


class PairformerBlock(nn.Module):
    """One Pairformer block; `forward(s, z, mask, pair_mask)` -> (s, z), as Boltz's `PairformerLayer`."""

    def __init__(self, cfg: PairformerConfig):
        super().__init__()
        self.cfg = cfg
        cz, cs = cfg.c_z, cfg.c_s
        self.tri_mul_out = TriangleMultiplication(cz, outgoing=True)
        self.tri_mul_in = TriangleMultiplication(cz, outgoing=False)
        self.tri_att_start = TriangleAttention(cz, cfg.pair_heads, cfg.pair_head_dim, starting=True)
        self.tri_att_end = TriangleAttention(cz, cfg.pair_heads, cfg.pair_head_dim, starting=False)
        self.transition_z = Transition(cz, cfg.transition_mult * cz)
        self.pre_norm_s = LayerNorm(cs)
        self.attention = AttentionPairBias(cs, cz, cfg.num_heads)
        self.transition_s = Transition(cs, cfg.transition_mult * cs)

    def forward(self, s: Tensor, z: Tensor, mask: Tensor, pair_mask: Tensor, chunk_rows: int | None = None,
                inplace: bool = False) -> tuple[Tensor, Tensor]:
        """s (B, N, c_s), z (B, N, N, c_z), mask (B, N), pair_mask (B, N, N) (floats in {0, 1}).

        Every pair update is added to z in place (one pair tensor plus the op's own); `inplace=False`
        (the default) first copies z so the caller's tensor is left alone."""
        if not inplace:
            z = z.clone()
        self.tri_mul_out.update_(z, pair_mask, chunk_rows)
        self.tri_mul_in.update_(z, pair_mask, chunk_rows)
        self.tri_att_start.update_(z, pair_mask, chunk_rows)
        self.tri_att_end.update_(z, pair_mask, chunk_rows)
        self.transition_z.update_(z, chunk_rows)
        s_normed = self.pre_norm_s(s)
        s = s + self.attention(s_normed, self.attention.pair_bias(z, chunk_rows), mask)
        s = s + self.transition_s(s)
        return s, z


class Pairformer(nn.Module):
    """A stack of `cfg.n_blocks` Pairformer blocks."""

    def __init__(self, cfg: PairformerConfig):
        super().__init__()
        self.cfg = cfg
        self.blocks = nn.ModuleList(PairformerBlock(cfg) for _ in range(cfg.n_blocks))

    def forward(self, s: Tensor, z: Tensor, mask: Tensor, pair_mask: Tensor,
                chunk_rows: int | None = None) -> tuple[Tensor, Tensor]:
        for i, block in enumerate(self.blocks):
            s, z = block(s, z, mask, pair_mask, chunk_rows, inplace=i > 0)  # only the first copies the input
        return s, z


# --- chunk size from a memory budget ------------------------------------------------------------


def chunk_transient_bytes(cfg: PairformerConfig, n: int, rows: int, batch: int = 1, elem: int = 4) -> int:
    """Transient bytes of the largest chunked op on `rows` rows of an N-wide pair (fp32 by default).

    Triangle attention per chunk: q|k|v|g, o and the gated o (rows N 6HD) with the logits and their softmax
    (2 x rows H N^2); the transition: hidden (3 x rows N 4c, gate/up/product); the triangle update's
    projection: LN(z), p_in|g_in and the gated pair (rows N 7c)."""
    h, hd, c = cfg.pair_heads, cfg.pair_heads * cfg.pair_head_dim, cfg.c_z
    att = rows * n * 6 * hd + 2 * rows * h * n * n
    trans = 3 * rows * n * cfg.transition_mult * c
    tri = 7 * rows * n * c
    return batch * elem * max(att, trans, tri)


def chunk_size_for_budget(cfg: PairformerConfig, n: int, budget_bytes: int, batch: int = 1, elem: int = 4) -> int:
    """The largest row chunk whose transient activations (`chunk_transient_bytes`) fit `budget_bytes` (>= 1)."""
    if budget_bytes <= 0:
        raise ValueError(f"chunk budget must be positive bytes, got {budget_bytes}")
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunk_transient_bytes(cfg, n, mid, batch, elem) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --- Boltz state dicts ----------------------------------------------------------------------------


def _boltz_block_map(sd: dict[str, Tensor], p: str) -> dict[str, Tensor]:
    """One Boltz `PairformerLayer(v2=True)` state dict (keys under prefix `p`) -> a `PairformerBlock` one."""
    def g(k: str) -> Tensor:
        key = p + k
        if key not in sd:
            raise KeyError(f"Boltz state dict: missing {key!r} (expected a PairformerLayer(v2=True) state dict)")
        return sd[key]

    out: dict[str, Tensor] = {}
    for name in ("tri_mul_out", "tri_mul_in"):
        for ln in ("norm_in", "norm_out"):
            out[f"{name}.{ln}.weight"] = g(f"{name}.{ln}.weight")
            out[f"{name}.{ln}.bias"] = g(f"{name}.{ln}.bias")
        out[f"{name}.proj_in.weight"] = torch.cat((g(f"{name}.p_in.weight"), g(f"{name}.g_in.weight")))
        out[f"{name}.p_out.weight"] = g(f"{name}.p_out.weight")
        out[f"{name}.g_out.weight"] = g(f"{name}.g_out.weight")
    for name in ("tri_att_start", "tri_att_end"):
        out[f"{name}.layer_norm.weight"] = g(f"{name}.layer_norm.weight")
        out[f"{name}.layer_norm.bias"] = g(f"{name}.layer_norm.bias")
        out[f"{name}.linear.weight"] = g(f"{name}.linear.weight")
        out[f"{name}.qkvg.weight"] = torch.cat([g(f"{name}.mha.linear_{x}.weight") for x in "qkvg"])
        out[f"{name}.linear_o.weight"] = g(f"{name}.mha.linear_o.weight")
    for name in ("transition_z", "transition_s"):
        out[f"{name}.norm.weight"] = g(f"{name}.norm.weight")
        out[f"{name}.norm.bias"] = g(f"{name}.norm.bias")
        out[f"{name}.mlp.w1.weight"] = g(f"{name}.fc1.weight")
        out[f"{name}.mlp.w3.weight"] = g(f"{name}.fc2.weight")
        out[f"{name}.mlp.w2.weight"] = g(f"{name}.fc3.weight")
    out["pre_norm_s.weight"] = g("pre_norm_s.weight")
    out["pre_norm_s.bias"] = g("pre_norm_s.bias")
    out["attention.qkvg.weight"] = torch.cat([g(f"attention.proj_{x}.weight") for x in "qkvg"])
    out["attention.q_bias"] = g("attention.proj_q.bias")
    out["attention.norm_z.weight"] = g("attention.proj_z.0.weight")
    out["attention.norm_z.bias"] = g("attention.proj_z.0.bias")
    out["attention.proj_z.weight"] = g("attention.proj_z.1.weight")
    out["attention.proj_o.weight"] = g("attention.proj_o.weight")
    return out


def load_boltz_state_dict(module: PairformerBlock | Pairformer, sd: dict[str, Tensor]) -> None:
    """Load a Boltz `PairformerLayer` (into a block) or `PairformerModule` (`layers.{i}.`, into a stack) state dict.

    Raises KeyError naming a missing Boltz key, and ValueError on a block-count or shape mismatch."""
    if isinstance(module, PairformerBlock):
        mapped = _boltz_block_map(sd, "")
    else:
        n = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
        if n != len(module.blocks):
            raise ValueError(f"Boltz state dict has {n} layers, the stack has {len(module.blocks)} blocks")
        mapped = {}
        for i in range(n):
            mapped.update({f"blocks.{i}.{k}": v for k, v in _boltz_block_map(sd, f"layers.{i}.").items()})
    own = module.state_dict()
    for k, v in mapped.items():
        if own[k].shape != v.shape:
            raise ValueError(f"Boltz state dict: {k} has shape {tuple(v.shape)}, expected {tuple(own[k].shape)} "
                             "(do the widths match the PairformerConfig?)")
    module.load_state_dict(mapped, strict=True)


def load_boltz_checkpoint(module: PairformerBlock | Pairformer, path: str | Path, prefix: str | None = None) -> None:
    """Load Pairformer weights from a Boltz checkpoint file into `module` (a stack, or one block).

    `path`: a ``.safetensors`` file, or a torch file (``.ckpt`` / ``.pt``) read **weights-only**: a Lightning
    checkpoint's ``state_dict`` entry or a plain state dict. A torch file that needs Python objects beyond tensors
    and plain data (a pickled class, possibly code) is refused with a `CheckpointError` naming the file; nothing in
    it runs. `prefix`: where the stack's keys start (``"pairformer_module."`` in a Boltz-2 model, ``""`` in a
    `PairformerModule`'s own state dict); by default the one that holds the weights (the trunk's when a model has
    several), else a `ValueError` lists the candidates."""
    from scratchlm.model.loading.checkpoint import load_torch_file

    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        sd = load_file(str(path))
    else:
        obj = load_torch_file(path, "Boltz checkpoint")
        sd = obj.get("state_dict", obj) if isinstance(obj, dict) else None
        if not isinstance(sd, dict):
            raise ValueError(f"{path}: expected a state dict or a Lightning checkpoint with 'state_dict', "
                             f"found {type(obj).__name__}")
    marker = "tri_mul_out.p_in.weight" if isinstance(module, PairformerBlock) else "layers.0.tri_mul_out.p_in.weight"
    if prefix is None:
        found = sorted({k[: -len(marker)] for k in sd if k.endswith(marker)})
        prefix = ("" if "" in found else "pairformer_module." if "pairformer_module." in found
                  else found[0] if len(found) == 1 else None)
        if prefix is None:
            raise ValueError(f"{path}: cannot tell which Pairformer to load: weights found under {found[:8] or 'none'}"
                             " (pass prefix=...)")
    sub = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    load_boltz_state_dict(module, sub)
