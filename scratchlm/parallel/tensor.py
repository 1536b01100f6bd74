"""Tensor-parallel layers and one rank's shard of the transformer (Megatron-style, for inference).

- Column-parallel linear: the weight's output rows are split; each rank computes its slice of the
  outputs, no communication. Used for the fused QKV projection (the rank's query heads, then its
  KV heads: shard-correct under GQA because the query heads of a KV-head group stay together) and
  the fused gate/up projection of the MLP.
- Row-parallel linear: the weight's input columns are split; each rank multiplies its slice of the
  inputs and the partial sums are all-reduced. Used for `o_proj` and the MLP's down projection:
  so a block costs **one all-reduce after attention and one after the MLP**.
- Vocab-parallel embedding: each rank holds a range of vocabulary rows, looks up the ids that fall
  in it (zeros elsewhere) and the rows are summed with an all-reduce. The LM head is column-parallel
  over the same vocabulary ranges; the logits are all-gathered (only sampled rows are computed).

Each rank keeps only its slices (`shard_state`); the paged KV cache of a rank holds only its KV
heads (and only the layers of its pipeline stage).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import AttentionBackend, RMSNorm, RotaryEmbedding
from scratchlm.parallel.comm import Comm
from scratchlm.parallel.layout import RankLayout

# reader(scratchlm name, dim or None for the whole tensor, start, stop) -> tensor
SliceReader = Callable[[str, int | None, int, int], Tensor]


def shard_spec(name: str, config: ModelConfig, layout: RankLayout) -> tuple[int | None, int, int] | None:
    """How `layout`'s rank holds tensor `name`: (dim, start, stop) of its slice, (None, 0, 0) for the
    whole tensor, or None when the rank does not hold it (another pipeline stage's layer)."""
    d = config.head_dim
    if name == "tok_embeddings.weight":
        holds = layout.is_first_stage or (layout.is_last_stage and config.tie_embeddings)
        return (0, *layout.vocab) if holds else None
    if name == "lm_head.weight":
        return (0, *layout.vocab) if layout.is_last_stage else None
    if name == "norm.weight":
        return (None, 0, 0) if layout.is_last_stage else None
    parts = name.split(".")
    layer = int(parts[1])
    if not layout.layers[0] <= layer < layout.layers[1]:
        return None
    local = ".".join(parts[2:])
    q0, q1 = layout.q_heads
    k0, k1 = layout.kv_heads
    specs = {
        "attn.q_proj.weight": (0, q0 * d, q1 * d), "attn.q_bias": (0, q0 * d, q1 * d),
        "attn.k_proj.weight": (0, k0 * d, k1 * d), "attn.k_bias": (0, k0 * d, k1 * d),
        "attn.v_proj.weight": (0, k0 * d, k1 * d), "attn.v_bias": (0, k0 * d, k1 * d),
        "attn.o_proj.weight": (1, q0 * d, q1 * d),
        "ffn.w1.weight": (0, *layout.ff), "ffn.w3.weight": (0, *layout.ff), "ffn.w2.weight": (1, *layout.ff),
    }
    return specs.get(local, (None, 0, 0))


def shard_state(names: list[str], config: ModelConfig, layout: RankLayout, read: SliceReader,
                dtype: torch.dtype, device: torch.device | str) -> dict[str, Tensor]:
    """This rank's tensors: only the slices it holds are read (`read` may read slices from disk)."""
    out = {}
    for name in names:
        spec = shard_spec(name, config, layout)
        if spec is None:
            continue
        t = read(name, *spec)
        out[name] = t.to(device=device, dtype=dtype).contiguous()
    return out


def full_tensor_reader(state: dict[str, Tensor]) -> SliceReader:
    """A reader slicing tensors already in memory (formats whose loader dequantizes/permutes whole tensors)."""

    def read(name: str, dim: int | None, start: int, stop: int) -> Tensor:
        t = state[name]
        return t if dim is None else t.narrow(dim, start, stop - start)

    return read


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding (padded to `shard` rows); lookups summed over TP ranks."""

    def __init__(self, weight: Tensor, start: int, comm: Comm):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # (shard, d)
        self.start, self.stop = start, start + weight.shape[0]
        self.comm = comm

    def forward(self, ids: Tensor) -> Tensor:
        if self.comm.layout.tp == 1:
            return self.weight[ids]  # (..., d)
        inside = (ids >= self.start) & (ids < self.stop)
        local = torch.where(inside, ids - self.start, torch.zeros_like(ids))
        x = self.weight[local] * inside.unsqueeze(-1).to(self.weight.dtype)  # (..., d), zero outside the shard
        return self.comm.all_reduce(x)


def _pad_rows(t: Tensor, rows: int) -> Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:])))


class ShardedBlock(nn.Module):
    """One transformer block's slice: fused column-parallel QKV and gate/up, row-parallel o/down."""

    def __init__(self, config: ModelConfig, layout: RankLayout, state: dict[str, Tensor], prefix: str, comm: Comm):
        super().__init__()
        c = config
        self.comm = comm
        self.head_dim = c.head_dim
        self.n_q = layout.q_heads[1] - layout.q_heads[0]
        self.n_kv = layout.kv_heads[1] - layout.kv_heads[0]
        self.n_ff = layout.ff[1] - layout.ff[0]

        def norm(name: str) -> RMSNorm:
            m = RMSNorm(c.d_model, c.norm_eps, device="meta")
            m.weight = nn.Parameter(state[prefix + name], requires_grad=False)
            return m

        def param(t: Tensor) -> nn.Parameter:
            return nn.Parameter(t.contiguous(), requires_grad=False)

        self.attn_norm, self.ffn_norm = norm("attn_norm.weight"), norm("ffn_norm.weight")
        qkv = [state[prefix + f"attn.{p}_proj.weight"] for p in "qkv"]
        self.w_qkv = param(torch.cat(qkv))  # ((n_q + 2 n_kv) D, d_model): column-parallel, fused
        self.b_qkv = param(torch.cat([state[prefix + f"attn.{p}_bias"] for p in "qkv"])) if c.qkv_bias else None
        self.w_o = param(state[prefix + "attn.o_proj.weight"])  # (d_model, n_q D): row-parallel
        self.w_gate_up = param(torch.cat((state[prefix + "ffn.w1.weight"], state[prefix + "ffn.w3.weight"])))
        self.w_down = param(state[prefix + "ffn.w2.weight"])  # (d_model, n_ff): row-parallel

    def forward(self, x: Tensor, rope: RotaryEmbedding, cos: Tensor, sin: Tensor, attn: AttentionBackend,
                layer: int) -> Tensor:
        """x (B, T, d_model) replicated on the TP ranks -> (B, T, d_model) replicated."""
        b, t, _ = x.shape
        h = self.attn_norm(x)
        qkv = h @ self.w_qkv.t() if self.b_qkv is None else torch.addmm(
            self.b_qkv, h.flatten(0, 1), self.w_qkv.t()).view(b, t, -1)  # (B, T, (n_q + 2 n_kv) D)
        d = self.head_dim
        q, k, v = qkv.split((self.n_q * d, self.n_kv * d, self.n_kv * d), dim=-1)
        q = rope.rotate(q.view(b, t, self.n_q, d), cos, sin)  # (B, T, n_q, D)
        k = rope.rotate(k.view(b, t, self.n_kv, d), cos, sin)  # (B, T, n_kv, D)
        v = v.view(b, t, self.n_kv, d)  # (B, T, n_kv, D)
        o = attn(layer, q, k, v).reshape(b, t, self.n_q * d)  # (B, T, n_q D)
        x = x + self.comm.all_reduce(o @ self.w_o.t())  # all-reduce 1: after attention
        h = self.ffn_norm(x)
        gate, up = (h @ self.w_gate_up.t()).split(self.n_ff, dim=-1)  # (B, T, n_ff) each
        y = torch.sigmoid(gate).mul_(gate).mul_(up) @ self.w_down.t()  # (B, T, d_model), partial sum
        return x + self.comm.all_reduce(y)  # all-reduce 2: after the MLP


class ShardedLM(nn.Module):
    """The layers of one pipeline stage, tensor-sharded: embedding on the first stage, norm + head on the last."""

    def __init__(self, config: ModelConfig, layout: RankLayout, state: dict[str, Tensor], comm: Comm):
        super().__init__()
        self.config, self.layout, self.comm = config, layout, comm
        shard = layout.vocab_shard
        self.embed = None
        if "tok_embeddings.weight" in state:
            self.embed = VocabParallelEmbedding(_pad_rows(state["tok_embeddings.weight"], shard), layout.vocab[0], comm)
        self.blocks = nn.ModuleList(
            ShardedBlock(config, layout, state, f"layers.{i}.", comm) for i in range(*layout.layers))
        self.rope = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_layout)
        self.norm = self.head = None
        if layout.is_last_stage:
            self.norm = RMSNorm(config.d_model, config.norm_eps, device="meta")
            self.norm.weight = nn.Parameter(state["norm.weight"], requires_grad=False)
            head = self.embed.weight if config.tie_embeddings else _pad_rows(state["lm_head.weight"], shard)
            self.head = head if isinstance(head, nn.Parameter) else nn.Parameter(head, requires_grad=False)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        """tokens (B, T) -> (B, T, d_model) (first stage only)."""
        return self.embed(tokens)

    def forward_layers(self, x: Tensor, positions: Tensor, attn: AttentionBackend) -> Tensor:
        """Run this stage's blocks on x (B, T, d_model); `attn` indexes layers locally (0 = first of the stage)."""
        cos, sin = self.rope.cos_sin(positions, x.dtype)  # (T, 1, D/2)
        for i, block in enumerate(self.blocks):
            x = block(x, self.rope, cos, sin, attn, i)
        return x

    def logits(self, rows: Tensor) -> Tensor:
        """rows (n, d_model) of the residual stream -> logits (n, vocab) (last stage; gathered over TP)."""
        local = self.norm(rows) @ self.head.t()  # (n, vocab_shard)
        return self.comm.all_gather_cols(local)[:, : self.config.vocab_size]  # (n, vocab)
