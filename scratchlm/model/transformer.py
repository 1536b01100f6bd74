"""`TransformerLM`: a pre-norm Llama-style decoder (RMSNorm, RoPE, GQA attention, SwiGLU)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import Attention, AttentionBackend, Embedding, Linear, RMSNorm, RotaryEmbedding, SwiGLU


class TransformerBlock(nn.Module):
    """x + attn(attn_norm(x)), then h + ffn(ffn_norm(h))."""

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        c = config
        self.attn_norm = RMSNorm(c.d_model, c.norm_eps, device=device, dtype=dtype)
        self.attn = Attention(c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.qkv_bias, device=device, dtype=dtype)
        self.ffn_norm = RMSNorm(c.d_model, c.norm_eps, device=device, dtype=dtype)
        self.ffn = SwiGLU(c.d_model, c.d_ff, device=device, dtype=dtype)

    def forward(self, x: Tensor, rope: RotaryEmbedding, cos: Tensor, sin: Tensor,
                attn: AttentionBackend | None = None, layer_idx: int = 0) -> Tensor:
        h = x + self.attn(self.attn_norm(x), rope, cos, sin, attn, layer_idx)
        return h + self.ffn(self.ffn_norm(h))


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
        self.layers = nn.ModuleList(TransformerBlock(c, device=device, dtype=dtype) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.d_model, c.norm_eps, device=device, dtype=dtype)
        self.lm_head = None if c.tie_embeddings else Linear(c.d_model, c.vocab_size, device=device, dtype=dtype)
        self.rope = RotaryEmbedding(c.head_dim, c.rope_theta, c.rope_layout)

    @property
    def output_weight(self) -> Tensor:
        """(vocab, d_model): the head's weight (the embedding when tied)."""
        return self.tok_embeddings.weight if self.lm_head is None else self.lm_head.weight

    def hidden_states(self, tokens: Tensor, positions: Tensor | None = None,
                      attn: AttentionBackend | None = None) -> Tensor:
        """Residual stream after the last block, before the final norm: (B, T, d_model)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq) token ids, got shape {tuple(tokens.shape)}")
        _, t = tokens.shape
        if positions is None:
            positions = torch.arange(t, device=tokens.device)
        elif positions.shape[-1] != t:
            raise ValueError(f"positions {tuple(positions.shape)} do not match tokens {tuple(tokens.shape)}")
        x = self.tok_embeddings(tokens)  # (B, T, d)
        cos, sin = self.rope.cos_sin(positions, x.dtype)  # (T, 1, D/2) or (B, T, 1, D/2)
        for i, layer in enumerate(self.layers):
            x = layer(x, self.rope, cos, sin, attn, i)
        return x

    def forward(self, tokens: Tensor, positions: Tensor | None = None, attn: AttentionBackend | None = None,
                logits_index: Tensor | None = None) -> Tensor:
        """Logits (B, T, vocab), or (len(logits_index), vocab) for flat positions in B*T."""
        x = self.hidden_states(tokens, positions, attn)
        if logits_index is not None:
            x = x.reshape(-1, x.shape[-1]).index_select(0, logits_index.to(x.device))  # (N, d)
        return self.norm(x) @ self.output_weight.t()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
