"""Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): the attention of a block whose `config.mla.kv_lora_rank`
is set (`config.MLAFeatures`).

Per token x (d_model), with H heads, n = qk_nope_head_dim, r = qk_rope_head_dim, c = kv_lora_rank, v = v_head_dim:

    q        = q_proj(x), or q_b_proj(q_a_norm(q_a_proj(x))) (q_lora_rank)   (H, n + r): q_nope (H, n), q_rope (H, r)
    latent   = kv_a_norm(kv_a_proj(x)[:c])                                  (c,)  shared by all heads
    k_rope   = kv_a_proj(x)[c:]                                             (r,)  one RoPE key for all heads
    q_rope, k_rope rotated by RoPE (r dims; the pair layout is `config.rope_layout`)
    k_nope, value = k_b_proj(latent), v_b_proj(latent) per head               (H, n), (H, v)
    score_h  = scale * (q_nope_h . k_nope_h + q_rope_h . k_rope),  out_h = softmax(score_h) @ value_h,  o_proj(out)

with scale = (n + r)^-0.5 times DeepSeek's YaRN mscale^2 (`ModelConfig.query_scale`). What a token leaves in the
KV cache is therefore `latent` and `k_rope` (c + r numbers per layer, `ModelConfig.kv_spec`), not H keys and values.

Two equal ways to attend over cached tokens, with W_uk = k_b_proj's weight as (H, n, c) and W_uv = v_b_proj's as
(H, v, c) (HF's one `kv_b_proj`, (H, n + v, c), is split at load; llama.cpp's files hold them split,
`attn_k_b` / `attn_v_b`):

- expanded (`expanded_attention`; prefill, and the model without a backend): k_nope, value of every context token
  from its latent, then ordinary attention over (H, n + r) keys and (H, v) values;
- absorbed (`absorbed_attention`; the engine's decode): q_nope_h W_uk[h] is a query in latent space (c), scored
  against the cached latents directly, and the softmax-weighted latent goes through W_uv[h] once per head: no
  per-token expansion, reads c + r numbers per context token instead of H (n + r + v).

They differ only in the order of float sums. The DeepSeek checkpoints' RoPE pairs are interleaved (HF's
`rope_interleave`, DeepSeek-V2's complex rotation): such a model uses rope_layout "adjacent", the same rotation
with no weight permutation. `q_a_norm` and `kv_a_norm` use eps 1e-6 whatever `norm_eps` is, as DeepSeek's reference
code and HF build them.

An attention backend (the engine's paged cache, `generate.ContiguousKVCache`) implements
`backend.mla(layer_idx, q_nope, q_rope, latent, k_rope, module, spec)` and calls back into `module`'s
`expand` / `absorbed_weights` with what it cached; one without `mla` is a clear error.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from scratchlm.model.config import ModelConfig
from scratchlm.model.layers import AttentionSpec, Linear, RMSNorm, RotaryEmbedding, spec_attention

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: DeepSeek's and HF's default, not rms_norm_eps


def expanded_attention(q_nope: Tensor, q_rope: Tensor, k_nope: Tensor, k_rope: Tensor, value: Tensor,
                       spec: AttentionSpec, q_offset: int = 0) -> Tensor:
    """Causal attention with expanded keys: q_nope (B, T, H, n), q_rope (B, T, H, r), k_nope (B, S, H, n), k_rope
    (B, S, r) (shared by the heads), value (B, S, H, v); query t at position q_offset + t -> (B, T, H, v)."""
    h = q_nope.shape[2]
    q = torch.cat((q_nope, q_rope), dim=-1)  # (B, T, H, n + r)
    k = torch.cat((k_nope, k_rope[:, :, None].expand(-1, -1, h, -1)), dim=-1)  # (B, S, H, n + r)
    return spec_attention(q, k, value, spec, q_offset)


def absorbed_attention(q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, w_uk: Tensor, w_uv: Tensor,
                       scale: float, masked: Tensor | None = None) -> Tensor:
    """One query per row over its cached latents, k_b / v_b absorbed: q_nope (N, H, n), q_rope (N, H, r), latent
    (N, S, c), k_rope (N, S, r), w_uk (H, n, c), w_uv (H, v, c), `masked` (N, S) True where a key is not attended
    -> (N, H, v). Scores and the softmax in float32."""
    dtype = q_nope.dtype
    q_lat = torch.einsum("nhd,hdc->nhc", q_nope.float(), w_uk.float())  # (N, H, c): the query in latent space
    lat = latent.float()
    scores = q_lat @ lat.transpose(1, 2) + q_rope.float() @ k_rope.float().transpose(1, 2)  # (N, H, S)
    scores = scores * scale
    if masked is not None:
        scores = scores.masked_fill(masked[:, None, :], float("-inf"))
    o_lat = scores.softmax(dim=-1) @ lat  # (N, H, c)
    return torch.einsum("nhc,hvc->nhv", o_lat, w_uv.float()).to(dtype)  # (N, H, v)


class MLAttention(nn.Module):
    """Multi-head latent attention (see the module docstring): x (B, T, d_model) -> (B, T, d_model). Parameters:
    `q_proj` or `q_a_proj` / `q_a_norm` / `q_b_proj`, `kv_a_proj` (d_model -> c + r), `kv_a_norm`, `k_b_proj`
    (c -> H n), `v_b_proj` (c -> H v), `o_proj` (H v -> d_model)."""

    def __init__(self, config: ModelConfig, device=None, dtype=None, *, spec: AttentionSpec):
        super().__init__()
        m, d, h = config.mla, config.d_model, config.n_heads
        self.n_heads, self.nope, self.rope_dim, self.v_dim, self.rank = (h, m.qk_nope_head_dim, m.qk_rope_head_dim,
                                                                         m.v_head_dim, m.kv_lora_rank)
        self.head_dim = self.nope + self.rope_dim  # q/k width of a head (config.head_dim is the RoPE part's)
        self.spec = spec
        kw = dict(device=device, dtype=dtype)
        if m.q_lora_rank:
            self.q_proj = None
            self.q_a_proj = Linear(d, m.q_lora_rank, **kw)
            self.q_a_norm = RMSNorm(m.q_lora_rank, MLA_NORM_EPS, **kw)
            self.q_b_proj = Linear(m.q_lora_rank, h * self.head_dim, **kw)
        else:
            self.q_proj = Linear(d, h * self.head_dim, **kw)
            self.q_a_proj = self.q_a_norm = self.q_b_proj = None
        self.kv_a_proj = Linear(d, self.rank + self.rope_dim, **kw)
        self.kv_a_norm = RMSNorm(self.rank, MLA_NORM_EPS, **kw)
        self.k_b_proj = Linear(self.rank, h * self.nope, **kw)
        self.v_b_proj = Linear(self.rank, h * self.v_dim, **kw)
        self.o_proj = Linear(h * self.v_dim, d, **kw)
        self._unpacked: dict[str, tuple[nn.Module, Tensor]] = {}  # k_b / v_b weights of linears that pack theirs
        # How tensor parallelism splits each parameter (read by scratchlm.parallel only; see `Attention.tp_plan`): by
        # query head. q (q_proj, or q_b_proj after the replicated q_a_proj / q_a_norm) and each head's k_b / v_b are
        # "column"; the latent and the RoPE key (kv_a_proj, kv_a_norm) are shared by every head, so they are
        # "replicated" and every rank caches the whole latent; o_proj is "row" (its partial sums all-reduced).
        self.tp_plan = {"q_proj.weight": "column", "q_a_proj.weight": "replicated", "q_a_norm.weight": "replicated",
                        "q_b_proj.weight": "column", "kv_a_proj.weight": "replicated",
                        "kv_a_norm.weight": "replicated", "k_b_proj.weight": "column", "v_b_proj.weight": "column",
                        "o_proj.weight": "row"}

    def expand(self, latent: Tensor) -> tuple[Tensor, Tensor]:
        """latent (..., S, c) -> each head's k_nope (..., S, H, n) and value (..., S, H, v)."""
        shape = (*latent.shape[:-1], self.n_heads, -1)
        return self.k_b_proj(latent).view(shape), self.v_b_proj(latent).view(shape)  # (..., S, H, n), (..., S, H, v)

    def _plain_weight(self, name: str) -> Tensor:
        """The (d_out, d_in) weight of linear `name`: its parameter, or (an engine linear that packs its weight) an
        unpacked copy made once and kept."""
        lin = getattr(self, name)
        w = lin._parameters.get("weight")
        if w is not None:
            return w.detach()
        if name not in self._unpacked or self._unpacked[name][0] is not lin:
            self._unpacked[name] = (lin, lin.weight.detach())
        return self._unpacked[name][1]

    def absorbed_weights(self) -> tuple[Tensor, Tensor]:
        """(W_uk (H, n, c), W_uv (H, v, c)): k_b_proj's and v_b_proj's weights per head."""
        h, c = self.n_heads, self.rank
        return (self._plain_weight("k_b_proj").view(h, self.nope, c),
                self._plain_weight("v_b_proj").view(h, self.v_dim, c))

    def forward(self, x: Tensor, rope: RotaryEmbedding | None = None, cos: Tensor | None = None,
                sin: Tensor | None = None, attn=None, layer_idx: int = 0) -> Tensor:
        if x.dim() != 3:
            raise ValueError(f"MLAttention expects x of shape (batch, seq, d_model), got {tuple(x.shape)}")
        b, t, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rope = q.view(b, t, self.n_heads, self.head_dim).split((self.nope, self.rope_dim), dim=-1)
        latent, k_rope = self.kv_a_proj(x).split((self.rank, self.rope_dim), dim=-1)  # (B, T, c), (B, T, r)
        latent = self.kv_a_norm(latent)
        k_rope = k_rope.reshape(b, t, 1, self.rope_dim)  # one "head"
        if rope is not None:
            if cos is None or sin is None:
                cos, sin = rope.cos_sin(torch.arange(t, device=x.device), x.dtype)
            q_rope, k_rope = rope.rotate(q_rope, cos, sin), rope.rotate(k_rope, cos, sin)
        k_rope = k_rope.reshape(b, t, self.rope_dim)  # (B, T, r)
        if attn is None:
            k_nope, value = self.expand(latent)
            out = expanded_attention(q_nope, q_rope, k_nope, k_rope, value, self.spec)
        else:
            mla = getattr(attn, "mla", None)
            if mla is None:
                raise ValueError(f"the attention backend {type(attn).__name__} has no `mla` method: multi-head "
                                 "latent attention caches the latent and the RoPE key, not K/V")
            out = mla(layer_idx, q_nope, q_rope, latent, k_rope, self, self.spec)  # (B, T, H, v)
        return self.o_proj(out.reshape(b, t, self.n_heads * self.v_dim))

    def extra_repr(self) -> str:
        return (f"heads={self.n_heads}, kv_lora_rank={self.rank}, nope={self.nope}, rope={self.rope_dim}, "
                f"v={self.v_dim}")
