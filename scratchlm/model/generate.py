"""A simple reference sampler over a contiguous KV cache (plugged in through the `attn` hook).

The inference engine (paged KV, batching) is the fast path; this one is for training samples,
tests and reading.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scratchlm.model.functional import softmax
from scratchlm.model.layers import AttentionSpec, spec_attention
from scratchlm.model.mla import expanded_attention
from scratchlm.model.transformer import TransformerLM


class ContiguousKVCache:
    """An `attn` backend that appends each call's k/v to per-layer buffers (B, max_len, Hkv, D).

    Call the model with positions `cache.length + arange(T)`, then `cache.advance(T)`.
    """

    def __init__(self, model: TransformerLM, batch_size: int, max_len: int):
        c = model.config
        p = next(model.parameters())
        spec = c.kv_spec()  # per layer: heads and widths (MLA: the latent and the RoPE key)
        self.k = [torch.empty(batch_size, max_len, s.n_kv_heads, s.head_dim, dtype=p.dtype, device=p.device)
                  for s in spec]
        self.v = [torch.empty(batch_size, max_len, s.n_kv_heads, s.value_dim, dtype=p.dtype, device=p.device)
                  for s in spec]
        self.length = 0
        self.max_len = max_len

    def _span(self, t: int) -> tuple[int, int]:
        start, end = self.length, self.length + t
        if end > self.max_len:
            raise ValueError(f"KV cache full: {end} tokens > max_len {self.max_len}")
        return start, end

    def __call__(self, layer_idx: int, q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec) -> Tensor:
        start, end = self._span(q.shape[1])
        self.k[layer_idx][:, start:end] = k
        self.v[layer_idx][:, start:end] = v
        return spec_attention(q, self.k[layer_idx][:, :end], self.v[layer_idx][:, :end], spec, q_offset=start)

    def mla(self, layer_idx: int, q_nope: Tensor, q_rope: Tensor, latent: Tensor, k_rope: Tensor, module,
            spec: AttentionSpec) -> Tensor:
        """Multi-head latent attention (`model/mla.py`): caches the latent (B, T, c) and RoPE key (B, T, r), expands
        the cached latents through the layer's k_b / v_b -> (B, T, H, v)."""
        start, end = self._span(q_nope.shape[1])
        self.k[layer_idx][:, start:end, 0] = latent
        self.v[layer_idx][:, start:end, 0] = k_rope
        k_nope, value = module.expand(self.k[layer_idx][:, :end, 0])  # (B, S, H, n), (B, S, H, v)
        return expanded_attention(q_nope, q_rope, k_nope, self.v[layer_idx][:, :end, 0], value, spec, start)

    def advance(self, n: int) -> None:
        self.length += n


def sample_next(logits: Tensor, temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """Next token ids (B,) from logits (B, vocab): greedy at temperature 0, else top-k/top-p sampling."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = softmax(logits, dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(dim=-1) - sorted_p  # mass strictly before each token
        sorted_p = sorted_p.masked_fill(before >= top_p, 0.0)  # keep the smallest prefix reaching top_p
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: TransformerLM, ids: list[int] | Tensor, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             eos_id: int | None = None) -> list[int] | Tensor:
    """Continue `ids` by up to `max_new_tokens` tokens; returns only the new tokens.

    ids: a list of ints (returns list[int]) or a LongTensor (B, T) (returns (B, n_new)). Greedy when
    temperature is 0. Stops early when every row has produced `eos_id` (which is included).
    """
    single = not isinstance(ids, Tensor)
    device = next(model.parameters()).device
    tokens = torch.tensor([list(ids)], dtype=torch.long) if single else ids.long()
    tokens = tokens.to(device)
    if tokens.dim() != 2 or tokens.shape[1] == 0:
        raise ValueError(f"generate needs a non-empty prompt (list of ids or (B, T) tensor), got {tuple(tokens.shape)}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    b, t = tokens.shape
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    cache = ContiguousKVCache(model, b, t + max_new_tokens)
    was_training = model.training
    model.eval()
    out: list[Tensor] = []
    done = torch.zeros(b, dtype=torch.bool, device=device)
    step_input = tokens
    for _ in range(max_new_tokens):
        n = step_input.shape[1]
        positions = torch.arange(cache.length, cache.length + n, device=device)
        last = torch.arange(b, device=device) * n + (n - 1)  # flat index of each row's last token
        logits = model(step_input, positions=positions, attn=cache, logits_index=last)  # (B, vocab)
        cache.advance(n)
        nxt = sample_next(logits, temperature, top_k, top_p, generator)  # (B,)
        if eos_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_id), nxt)
            done |= nxt == eos_id
        out.append(nxt)
        step_input = nxt[:, None]
        if eos_id is not None and bool(done.all()):
            break
    model.train(was_training)
    new = torch.stack(out, dim=1) if out else torch.empty(b, 0, dtype=torch.long, device=device)
    return new[0].tolist() if single else new
