"""Tensor parallelism (Megatron-style, for inference) on the model's own modules.

There is no parallel copy of the decoder block. A rank builds the very `TransformerLM` of the config on the meta
device and shards it in place, following the `tp_plan` that `Attention` and `MLP` declare for their parameters:

- "column": the output rows are split. q/k/v (weights and biases) by head: a rank keeps a contiguous range of KV
  heads and the query heads of their groups (GQA), so its paged KV cache holds only its KV heads; the MLP's w1/w3
  (b1/b3) by hidden unit. No communication.
- "row": the input columns are split: `o_proj` (by query head) and the MLP's `w2` (by hidden unit). The `Linear`
  is wrapped in `RowParallel`, which all-reduces the partial sums, so a block costs **one all-reduce after
  attention and one after the MLP**, and the o/b2 biases, which the model adds after the projection, are added
  once to the reduced sum.
- "replicated": kept whole (o/b2 biases, per-head q/k-norms; the block's norms are replicated too).
- Multi-head latent attention (`MLAttention.tp_plan`) splits by query head: q and each head's k_b / v_b column,
  o_proj row; the latent and RoPE key (kv_a_proj, kv_a_norm, and q_a_proj / q_a_norm) are replicated, so every
  rank caches the whole latent (MLA caches no heads) and runs the absorbed decode over its heads.
- A full-width q/k-norm (OLMo-2) is split with its heads and becomes `ShardedRMSNorm`: the sum of squares is
  all-reduced, so each rank normalises by the RMS over the whole projection.
- Vocab-parallel embedding: each rank holds a range of vocabulary rows, looks up the ids that fall in it (zeros
  elsewhere) and the rows are summed with an all-reduce. The LM head is column-parallel over the same vocabulary
  ranges; the logits are all-gathered (only sampled rows are computed). Learned positions are replicated.

Everything else (RoPE and its scalings, partial rotary dims, the attention spec's scale / soft-cap / window, norm
placement, residual and embedding multipliers, logit scale and soft-cap) runs in the unmodified model code, so it is
the same under TP by construction. A parameter of the block that no plan names is an error at start-up
(`shard_plan`), never a silently replicated or mis-split tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import MLP, Attention, AttentionBackend, LayerNorm, Linear, RMSNorm
from scratchlm.model.mla import MLAttention
from scratchlm.model.moe import MoE
from scratchlm.model.transformer import TransformerBlock, TransformerLM
from scratchlm.parallel.comm import Comm
from scratchlm.parallel.layout import RankLayout, is_foreign_expert

# How a rank holds a tensor: (dim, start, stop) of its slice, or WHOLE.
Shard = tuple[int | None, int, int]
WHOLE: Shard = (None, 0, 0)


def _meta_model(config: ModelConfig) -> TransformerLM:
    with torch.device("meta"):
        return TransformerLM(config)


def _attention_units(name: str, config: ModelConfig, layout: RankLayout) -> tuple[int, int]:
    """Rows (column split) or columns (row split) of `Attention` parameter `name` this rank holds: q/o by query
    head, k/v by KV head; the attention sinks (one per query head) by query head."""
    if name == "sinks":
        return layout.q_heads
    d = config.head_dim
    heads = {"q": layout.q_heads, "o": layout.q_heads, "k": layout.kv_heads, "v": layout.kv_heads}.get(name[0])
    if heads is None:
        raise ValueError(f"tensor parallelism: no head range for attention parameter {name!r}")
    return heads[0] * d, heads[1] * d


def _mla_units(name: str, module: MLAttention, layout: RankLayout) -> tuple[int, int]:
    """Rows (column split) or columns (row split) of `MLAttention` parameter `name` this rank holds: its query
    heads' slice of q (nope + rope per head), of k_b (nope), of v_b and o_proj's input (v per head)."""
    width = {"q_proj": module.head_dim, "q_b_proj": module.head_dim, "k_b_proj": module.nope,
             "v_b_proj": module.v_dim, "o_proj": module.v_dim}.get(name.partition(".")[0])
    if width is None:
        raise ValueError(f"tensor parallelism: no head range for MLA parameter {name!r}")
    return layout.q_heads[0] * width, layout.q_heads[1] * width


def module_shards(prefix: str, module: nn.Module, config: ModelConfig, layout: RankLayout,
                  units: tuple[int, int] | None = None) -> dict[str, Shard]:
    """{parameter name: Shard} of one block's child module, from its `tp_plan`. `units`: an MLP's hidden units
    this rank holds (default: the dense MLP's, `layout.ff`; MoE experts: `layout.expert_ff`)."""
    if isinstance(module, MoE):
        from scratchlm.parallel.expert import moe_shards

        return moe_shards(prefix, module, config, layout)
    out: dict[str, Shard] = {}
    plan = getattr(module, "tp_plan", None)
    for pname, p in module.named_parameters():
        name = prefix + pname
        if plan is None:
            if isinstance(module, (RMSNorm, LayerNorm)):
                out[name] = WHOLE  # the block's norms act on the replicated residual stream
                continue
            raise ValueError(f"tensor parallelism: {name} belongs to a {type(module).__name__}, which declares no "
                             f"tp_plan (how its parameters split over ranks); add one before sharding this model")
        split = plan.get(pname)
        if split not in ("column", "row", "replicated"):
            raise ValueError(f"tensor parallelism: {type(module).__name__}.tp_plan has no valid entry for {pname!r} "
                             f"(got {split!r}; expected 'column', 'row' or 'replicated')")
        if split == "replicated":
            out[name] = WHOLE
            continue
        if isinstance(module, Attention):
            units = _attention_units(pname, config, layout)
        elif isinstance(module, MLAttention):
            units = _mla_units(pname, module, layout)
        elif isinstance(module, MLP):
            units = units or layout.ff
        else:
            raise ValueError(f"tensor parallelism: no unit range known for {type(module).__name__}.{pname}")
        if split == "row" and p.dim() != 2:
            raise ValueError(f"tensor parallelism: {name} is planned 'row' but is not a matrix")
        out[name] = (1 if split == "row" else 0, *units)
    return out


def shard_plan(config: ModelConfig, layout: RankLayout) -> dict[str, Shard]:
    """{state-dict name: Shard} of every tensor `layout`'s rank holds (another stage's layers are absent)."""
    model = _meta_model(config)
    out: dict[str, Shard] = {}
    if layout.is_first_stage or (layout.is_last_stage and config.tie_embeddings):
        out["tok_embeddings.weight"] = (0, *layout.vocab)
    if layout.is_first_stage and model.pos_embeddings is not None:
        out["pos_embeddings.weight"] = WHOLE
    if layout.is_last_stage:
        out.update({f"norm.{n}": WHOLE for n, _ in model.norm.named_parameters()})
        if model.lm_head is not None:
            out["lm_head.weight"] = (0, *layout.vocab)
    for i in range(*layout.layers):
        block = model.layers[i]
        for child, module in block.named_children():
            out.update(module_shards(f"layers.{i}.{child}.", module, config, layout))
        named = {n for n, _ in block.named_parameters() if not is_foreign_expert(n, layout)}
        planned = {n.removeprefix(f"layers.{i}.") for n in out if n.startswith(f"layers.{i}.")}
        if named != planned:  # a parameter directly on the block, outside every child module
            raise ValueError(f"tensor parallelism: block parameters {sorted(named - planned)} have no tp_plan")
    return out


def shard_spec(name: str, config: ModelConfig, layout: RankLayout) -> Shard | None:
    """How `layout`'s rank holds tensor `name` (a Shard), or None when it does not hold it."""
    return shard_plan(config, layout).get(name)


def take_shard(t: Tensor, shard: Shard) -> Tensor:
    """The rank's slice of a whole tensor."""
    dim, start, stop = shard
    return t if dim is None else t.narrow(dim, start, stop - start)


def check_shardable(config: ModelConfig, tp: int, ep: int = 1) -> None:
    """Raise ValueError now (before any process starts) if the model has a parameter no `tp_plan` covers."""
    from scratchlm.parallel.layout import plan_layout

    shard_plan(config, plan_layout(config, tp, 1, 0, ep=ep))


# --- the collectives, as modules swapped into the model ---------------------------------------------------

class RowParallel(nn.Module):
    """A row-parallel `Linear`: the rank's input columns times its weight columns, all-reduced over the TP ranks.
    `weight` is the wrapped linear's (d_out, local d_in)."""

    def __init__(self, linear: Linear, comm: Comm):
        super().__init__()
        self.linear = linear
        self.comm = comm

    @property
    def weight(self) -> Tensor:
        return self.linear.weight

    def forward(self, x: Tensor) -> Tensor:
        return self.comm.all_reduce(self.linear(x))  # (..., d_out): the sum over ranks


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over a width split across the TP ranks (OLMo-2's full-width q/k-norm): the rank's slice of the
    gain, the sum of squares all-reduced, mean over `full_dim`. Computed in float32 as `RMSNorm`."""

    def __init__(self, norm: RMSNorm, full_dim: int, comm: Comm):
        super().__init__()
        self.weight, self.eps, self.full_dim, self.comm = norm.weight, norm.eps, full_dim, comm

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        ss = self.comm.all_reduce(xf.square().sum(dim=-1, keepdim=True))  # (..., 1): over the whole width
        r = torch.rsqrt(ss / self.full_dim + self.eps)
        return (xf * r * self.weight.float()).to(x.dtype)


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


def _frozen(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t, requires_grad=False)


def _shard_block(block: TransformerBlock, i: int, state: dict[str, Tensor], layout: RankLayout, comm: Comm) -> None:
    """Put layer `i`'s shards into `block` (built on meta) and swap in the collectives (an MoE feed-forward becomes
    the rank's `ExpertParallelMoE`: its experts only)."""
    prefix = f"layers.{i}."
    moe = isinstance(block.ffn, MoE)
    if moe:
        from scratchlm.parallel.expert import ExpertParallelMoE, check_expert_tp, tp_output_bias

        check_expert_tp(block.ffn, layout.tp)
        block.ffn = ExpertParallelMoE(block.ffn, layout, comm)
    for name, _ in list(block.named_parameters()):
        owner, _, attr = name.rpartition(".")
        module = block.get_submodule(owner)
        t = state[prefix + name]
        if moe and name.startswith("ffn."):
            t = tp_output_bias(name, t, layout.tp_rank)
        setattr(module, attr, _frozen(t))
        if isinstance(module, Linear):
            module.d_out, module.d_in = t.shape
    attn, ffn = block.attn, block.ffn
    if layout.tp == 1:  # nothing split (EP or PP alone): the modules stay as built
        return
    if isinstance(attn, MLAttention):  # split by query head; the latent (kv_a_proj, kv_a_norm) stays whole
        q_width = k_width = 0  # no norm over a split width
    else:
        q_width, k_width = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim  # unsharded
        attn.n_kv_heads = layout.kv_heads[1] - layout.kv_heads[0]
    attn.n_heads = layout.q_heads[1] - layout.q_heads[0]
    for module in (attn, ffn):
        for pname, split in getattr(module, "tp_plan", {}).items():  # ExpertParallelMoE reduces by itself
            owner = pname.rpartition(".")[0]
            child = getattr(module, owner, None) if owner else None
            if split == "row" and isinstance(child, Linear):
                setattr(module, owner, RowParallel(child, comm))
            elif split == "column" and isinstance(child, RMSNorm):  # a norm over a split width: its RMS spans ranks
                setattr(module, owner, ShardedRMSNorm(child, q_width if owner.startswith("q") else k_width, comm))
            elif split == "column" and isinstance(child, LayerNorm):
                raise ValueError(f"tensor parallelism: a LayerNorm split across ranks ({pname}) is not implemented")


class ShardedLM(nn.Module):
    """One rank's part of the model: its pipeline stage's blocks, tensor-sharded, from the model's own modules;
    embedding on the first stage, final norm and head on the last. The runners call `embed_tokens`,
    `forward_layers` and `logits`."""

    def __init__(self, config: ModelConfig, layout: RankLayout, state: dict[str, Tensor], comm: Comm):
        super().__init__()
        self.config, self.layout, self.comm = config, layout, comm
        plan = shard_plan(config, layout)
        missing = sorted(set(plan) - set(state))
        if missing:
            raise ValueError(f"rank {layout.rank}: shard tensors missing: {missing[:8]}")
        lm = _meta_model(config)
        self.first_layer = layout.layers[0]
        blocks = [lm.layers[i] for i in range(*layout.layers)]
        for i, block in zip(range(*layout.layers), blocks):
            _shard_block(block, i, state, layout, comm)
        lm.layers = nn.ModuleList(blocks)  # this stage's blocks; `attn` indexes them locally (0 = the first)
        shard = layout.vocab_shard
        embed = None
        if "tok_embeddings.weight" in state:
            embed = VocabParallelEmbedding(_pad_rows(state["tok_embeddings.weight"], shard), layout.vocab[0], comm)
        lm.tok_embeddings = embed if layout.is_first_stage else None
        if lm.pos_embeddings is not None and layout.is_first_stage:  # learned positions: replicated
            lm.pos_embeddings.weight = _frozen(state["pos_embeddings.weight"])
        elif lm.pos_embeddings is not None:
            lm.pos_embeddings = None
        self.head = None
        if layout.is_last_stage:
            for n, _ in list(lm.norm.named_parameters()):
                setattr(lm.norm, n, _frozen(state[f"norm.{n}"]))
            if config.tie_embeddings:
                self.head = embed.weight
            else:
                self.head = _frozen(_pad_rows(state["lm_head.weight"], shard))
        else:
            lm.norm = None
        lm.lm_head = None
        self.lm = lm
        meta = [n for n, p in self.named_parameters() if p.is_meta]
        if meta:
            raise ValueError(f"rank {layout.rank}: parameters left without weights after sharding: {meta[:8]}")

    def embed_tokens(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens (B, T) at positions (T,) -> (B, T, d_model) (first stage only): the model's own `embed`
        (embedding scale, learned positions) over the vocab-parallel lookup."""
        return self.lm.embed(tokens, positions)

    def forward_layers(self, x: Tensor, positions: Tensor, attn: AttentionBackend | None,
                       rope_lengths: Tensor | None = None) -> Tensor:
        """Run this stage's blocks on x (B, T, d_model); `attn` indexes layers locally (0 = first of the stage).
        `rope_lengths`: each row's sequence length, for length-dependent RoPE scalings (None: one sequence)."""
        lm = self.lm
        tables = lm.rope_tables(positions, x.dtype, rope_lengths)
        for j, block in enumerate(lm.layers):
            rope = lm.layer_rope(self.first_layer + j)
            cos, sin = tables[id(rope)] if rope is not None else (None, None)
            x = block(x, rope, cos, sin, attn, j)
        return x

    def logits(self, rows: Tensor) -> Tensor:
        """rows (n, d_model) of the residual stream -> logits (n, vocab) (last stage; gathered over TP): final norm,
        the rank's vocabulary rows, all-gather, then the model's logit scale and soft-cap."""
        local = self.lm.norm(rows) @ self.head.t()  # (n, vocab_shard)
        full = self.comm.all_gather_cols(local)[:, : self.config.vocab_size]  # (n, vocab)
        return self.lm.finish_logits(full)

