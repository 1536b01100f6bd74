"""`TransformerLM`: one decoder block that implements every feature of `ModelConfig`.

A block is attention then MLP, each a residual branch; the norms sit where `config.norm.placement` puts them:

    pre       h = x + m * attn(attn_norm(x));            out = h + m * mlp(ffn_norm(h))         (Llama, ...)
    post      h = x + m * attn_post_norm(attn(x));       out = h + m * ffn_post_norm(mlp(h))    (OLMo-2)
    sandwich  h = x + m * attn_post_norm(attn(attn_norm(x)));  likewise for the MLP              (Gemma 2 / 3)

with m the residual multiplier (1 but for Granite). The MLP is a mixture of experts (`model/moe.py`) in the layers
`config.is_moe_layer` names; the attention is multi-head latent attention (`model/mla.py`) when `config.mla` is
set. The model adds embedding scale, learned positions, the final norm, logit scale and soft-cap. Per layer, the
config decides the RoPE (theta, scaling, none for NoPE layers) and the attention spec (scale, soft-cap, window).
Families (`model/families/`) only translate names and configs.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import (
    MLP,
    Attention,
    AttentionBackend,
    AttentionSpec,
    Embedding,
    LayerNorm,
    Linear,
    RMSNorm,
    RotaryEmbedding,
)
from scratchlm.model.mla import MLAttention
from scratchlm.model.moe import MoE


def make_norm(config: ModelConfig, dim: int | None = None, device=None, dtype=None) -> nn.Module:
    """The config's norm (RMSNorm or LayerNorm) over `dim` (default d_model)."""
    dim = config.d_model if dim is None else dim
    if config.norm.kind == "layer":
        return LayerNorm(dim, config.norm_eps, config.norm.bias, device=device, dtype=dtype)
    return RMSNorm(dim, config.norm_eps, device=device, dtype=dtype)


def attention_spec(config: ModelConfig, layer: int) -> AttentionSpec:
    """The scores of `layer`'s attention: scale, soft-cap and window."""
    return AttentionSpec(config.query_scale(), config.attn.logit_softcap, config.window(layer))


class TransformerBlock(nn.Module):
    """Attention and MLP residual branches with the config's norm placement (see the module docstring)."""

    def __init__(self, config: ModelConfig, device=None, dtype=None, layer: int = 0):
        super().__init__()
        c = config
        self.placement, self.residual_multiplier = c.norm.placement, c.residual_multiplier
        pre, post = c.norm.placement in ("pre", "sandwich"), c.norm.placement in ("post", "sandwich")
        self.attn_norm = make_norm(c, device=device, dtype=dtype) if pre else None
        self.attn = (MLAttention(c, device=device, dtype=dtype, spec=attention_spec(c, layer)) if c.mla.kv_lora_rank
                     else Attention(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.qkv_bias, device=device,
                                    dtype=dtype, o_bias=c.attn.o_bias, qk_norm=c.attn.qk_norm, norm_eps=c.norm_eps,
                                    spec=attention_spec(c, layer), sinks=c.attn.sinks))
        self.attn_post_norm = make_norm(c, device=device, dtype=dtype) if post else None
        self.ffn_norm = make_norm(c, device=device, dtype=dtype) if pre else None
        self.ffn = (MoE(c, device=device, dtype=dtype) if c.is_moe_layer(layer) else
                    MLP(c.d_model, c.d_ff, device=device, dtype=dtype, act=c.mlp.act, gated=c.mlp.gated,
                        bias=c.mlp.bias, swiglu_alpha=c.mlp.swiglu_alpha, swiglu_limit=c.mlp.swiglu_limit))
        self.ffn_post_norm = make_norm(c, device=device, dtype=dtype) if post else None

    def _residual(self, x: Tensor, y: Tensor) -> Tensor:
        return x + y if self.residual_multiplier == 1.0 else x + y * self.residual_multiplier

    def forward(self, x: Tensor, rope: RotaryEmbedding | None, cos: Tensor | None, sin: Tensor | None,
                attn: AttentionBackend | None = None, layer_idx: int = 0) -> Tensor:
        a = self.attn(x if self.attn_norm is None else self.attn_norm(x), rope, cos, sin, attn, layer_idx)
        h = self._residual(x, a if self.attn_post_norm is None else self.attn_post_norm(a))
        f = self.ffn(h if self.ffn_norm is None else self.ffn_norm(h))
        return self._residual(h, f if self.ffn_post_norm is None else self.ffn_post_norm(f))


class TransformerLM(nn.Module):
    """Decoder-only language model; see docs/contracts.md for the attribute names loaders rely on.

    Build it on the meta device and load weights in place with
    ``model.load_state_dict(state, assign=True)`` (see `scratchlm.model.loading`).
    """

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        c = config
        # A tied embedding doubles as the output head, so it gets the head's scale, not N(0, 1).
        emb_std = math.sqrt(2.0 / (c.vocab_size + c.d_model)) if c.tie_embeddings else 1.0
        self.tok_embeddings = Embedding(c.vocab_size, c.d_model, std=emb_std, device=device, dtype=dtype)
        self.pos_embeddings = (Embedding(c.max_seq_len, c.d_model, std=0.01, device=device, dtype=dtype)
                               if c.learned_positions else None)
        self.layers = nn.ModuleList(TransformerBlock(c, device=device, dtype=dtype, layer=i)
                                    for i in range(c.n_layers))
        self.norm = make_norm(c, device=device, dtype=dtype)
        self.lm_head = None if c.tie_embeddings else Linear(c.d_model, c.vocab_size, device=device, dtype=dtype)
        scaling = None if c.rope.scaling == "none" else c.rope
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_layout, rotary_dim=c.rotary_dim, scaling=scaling)
        # Layers whose RoPE differs from `rope` (Gemma 3's sliding layers: their own theta, no scaling).
        self.local_rope = None
        if any(c.layer_theta(i) != c.rope_theta or (c.layer_rope_scaled(i) != (scaling is not None))
               for i in range(c.n_layers)):
            self.local_rope = RotaryEmbedding(c.head_dim, c.rope.local_theta or c.rope_theta, c.rope_layout,
                                              rotary_dim=c.rotary_dim, scaling=scaling if c.rope.local_scaling
                                              else None)

    @property
    def output_weight(self) -> Tensor:
        """(vocab, d_model): the head's weight (the embedding when tied)."""
        return self.tok_embeddings.weight if self.lm_head is None else self.lm_head.weight

    def layer_rope(self, i: int) -> RotaryEmbedding | None:
        """The RoPE of layer `i`: the model's, the local one (sliding layers with their own), or None (NoPE)."""
        c = self.config
        if i in c.rope.nope_layers:
            return None
        if self.local_rope is not None and c.window(i) is not None:
            return self.local_rope
        return self.rope

    def embed(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """Token (and learned position) embeddings times the embedding scale: (..., d_model)."""
        x = self.tok_embeddings(tokens)
        if self.config.embedding_scale != 1.0:
            x = x * torch.tensor(self.config.embedding_scale, dtype=x.dtype)  # HF casts the scale to x's dtype
        if self.pos_embeddings is not None:
            if positions.numel() and int(positions.max()) >= self.config.max_seq_len:
                raise ValueError(f"position {int(positions.max())} >= max_seq_len={self.config.max_seq_len} "
                                 "(learned position embeddings end there)")
            x = x + self.pos_embeddings(positions)
        return x

    def rope_tables(self, positions: Tensor, dtype: torch.dtype,
                    lengths: Tensor | None = None) -> dict[int, tuple[Tensor, Tensor]]:
        """{id(rope): (cos, sin)} for every distinct RoPE of the layers."""
        tables = {}
        for rope in (self.rope, self.local_rope):
            if rope is not None and id(rope) not in tables:
                tables[id(rope)] = rope.cos_sin(positions, dtype, lengths)  # (T, 1, R/2) or (B, T, 1, R/2)
        return tables

    def hidden_states(self, tokens: Tensor, positions: Tensor | None = None, attn: AttentionBackend | None = None,
                      rope_lengths: Tensor | None = None) -> Tensor:
        """Residual stream after the last block, before the final norm: (B, T, d_model). `rope_lengths` (like
        positions): each row's sequence length, for length-dependent RoPE scalings in a batch of several
        sequences (the engine's flat batch); None: the batch is one sequence per row of `tokens`."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq) token ids, got shape {tuple(tokens.shape)}")
        _, t = tokens.shape
        if positions is None:
            positions = torch.arange(t, device=tokens.device)
        elif positions.shape[-1] != t:
            raise ValueError(f"positions {tuple(positions.shape)} do not match tokens {tuple(tokens.shape)}")
        x = self.embed(tokens, positions)  # (B, T, d)
        tables = self.rope_tables(positions, x.dtype, rope_lengths)
        for i, layer in enumerate(self.layers):
            rope = self.layer_rope(i)
            cos, sin = tables[id(rope)] if rope is not None else (None, None)
            x = layer(x, rope, cos, sin, attn, i)
        return x

    def logits(self, h: Tensor) -> Tensor:
        """Final norm, head, logit scale and soft-cap: (..., d_model) hidden states -> (..., vocab)."""
        y = self.norm(h) @ self.output_weight.t()
        return self.finish_logits(y)

    def finish_logits(self, y: Tensor) -> Tensor:
        """The logit scale and final soft-cap on the head's output."""
        c = self.config
        if c.logit_scale != 1.0:
            y = y * c.logit_scale
        if c.final_logit_softcap is not None:
            y = torch.tanh(y / c.final_logit_softcap) * c.final_logit_softcap
        return y

    def forward(self, tokens: Tensor, positions: Tensor | None = None, attn: AttentionBackend | None = None,
                logits_index: Tensor | None = None, rope_lengths: Tensor | None = None) -> Tensor:
        """Logits (B, T, vocab), or (len(logits_index), vocab) for flat positions in B*T."""
        x = self.hidden_states(tokens, positions, attn, rope_lengths)
        if logits_index is not None:
            x = x.reshape(-1, x.shape[-1]).index_select(0, logits_index.to(x.device))  # (N, d)
        return self.logits(x)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
