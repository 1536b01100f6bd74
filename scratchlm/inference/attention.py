"""Paged attention over the block-table KV cache, written with torch ops, for the model's `attn` hook.

A step's tokens are one flattened, unpadded batch (B = 1, T = N tokens): first the decode
queries (one token each), then the prefill chunks. The backend

1. writes this step's K/V into the cache at `slot_mapping` (slot = block * block_size + offset);
2. decode queries: gathers each sequence's blocks by its block table into (B, L, Hkv, D), masks
   keys at >= context length, and computes grouped-query attention in one batched matmul;
3. prefill chunks: one sequence at a time, keys = the sequence's cached prefix (gathered by block
   table) + the chunk, causal with an offset. A chunk with no cached prefix uses its own K/V.

All metadata travels in `AttentionMetadata`; nothing global.

Multi-head latent attention (`model/mla.py`) calls `mla(layer, q_nope, q_rope, latent, k_rope, module, spec)`
instead: the cache keeps each token's latent and RoPE key (kv_cache.py), decode queries attend in latent space with
k_b / v_b absorbed (`mla.absorbed_attention`: the gathered latents are read once, never expanded to per-head K/V), and
a prefill chunk expands the latents of its context through k_b / v_b (`module.expand`) and attends as usual. Written
with torch ops only (the C++ decode kernel and the fused step take K/V heads, not latents).

The cache may store float32, bfloat16, float16 or int8 with per-token-head scales (`kv_cache.py`): writes
round/quantize through `KVCache.write`, the torch-ops reads dequantize the gathered blocks (`KVCache.gather`)
to the query's dtype, so prefill over a cached prefix and decode read the same stored values.

Decode on a CPU cache (any of those dtypes) with float32 queries runs the C++ kernel
`csrc/paged_attention.h`, which reads K/V rows in place through the block table instead of gathering them
(the gather copied every context once per layer and step: about a third of a 32-sequence decode step) and
converts bf16/fp16/int8 to float32 in registers; the layer's scale, soft-cap and sliding window go with it (the
kernel skips the blocks before a window). `PagedAttention(..., use_kernel=False)` and any other device/dtype (CUDA
included) take the torch-ops path above, which the tests compare the kernel against. Attention sinks (gpt-oss: a
per-head logit in each softmax denominator) are not in the kernel: a layer with sinks takes the torch-ops path.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from scratchlm.inference.cpp_extensions import load_engine_kernels
from scratchlm.inference.kv_cache import KVCache
from scratchlm.model.layers import AttentionSpec, sink_softmax, spec_attention
from scratchlm.model.mla import absorbed_attention, expanded_attention


def load_kernels(verbose: bool = False):
    """The compiled kernel module (`paged_decode_attention`), or None (torch-ops path) when it cannot be built."""
    return load_engine_kernels(verbose)


@dataclass
class PrefillChunk:
    """One sequence's chunk: rows [query_start, query_start + query_len) of the flat batch."""

    query_start: int
    query_len: int
    context_len: int  # tokens in the cache after this step (cached prefix + this chunk)
    block_table: torch.Tensor  # (num_blocks_of_seq,) long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (N,) long: cache slot of every token of the step
    num_decode_tokens: int  # the first rows are decode queries, one per sequence
    decode_block_tables: torch.Tensor | None  # (B_dec, max_blocks) long, padded with block 0
    decode_context_lens: torch.Tensor | None  # (B_dec,) long, including the new token
    prefills: list[PrefillChunk] = field(default_factory=list)


class PagedAttention:
    """The `attn(layer_idx, q, k, v)` backend of one step: metadata + the cache it reads and writes."""

    def __init__(self, cache: KVCache, meta: AttentionMetadata, use_kernel: bool = True):
        self.cache = cache
        self.meta = meta
        self._kernel = load_kernels() if use_kernel and cache.k.device.type == "cpu" else None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 spec: AttentionSpec | None = None) -> torch.Tensor:
        if q.shape[0] != 1:
            raise ValueError(f"paged attention expects one flattened batch (B=1), got q of shape {tuple(q.shape)}")
        q, k, v = q[0], k[0], v[0]  # (N, H, D), (N, Hkv, D), (N, Hkv, D)
        meta = self.meta
        self.cache.write(layer, meta.slot_mapping, k, v)

        spec = spec if spec is not None else AttentionSpec(1.0 / math.sqrt(q.shape[-1]))
        nd = meta.num_decode_tokens
        if nd == q.shape[0] and not meta.prefills:
            return self._decode(layer, q, spec).unsqueeze(0)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(layer, q[:nd], spec)
        for p in meta.prefills:
            rows = slice(p.query_start, p.query_start + p.query_len)
            out[rows] = self._prefill(layer, q[rows], k[rows], v[rows], p, spec)
        return out.unsqueeze(0)  # (1, N, H, D)

    def mla(self, layer: int, q_nope: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
            module, spec: AttentionSpec) -> torch.Tensor:
        """Multi-head latent attention over the paged cache: q_nope (1, N, H, n), q_rope (1, N, H, r), this step's
        latent (1, N, c) and RoPE key (1, N, r) (written to the cache first), `module` the layer's `MLAttention`
        (its k_b / v_b) -> (1, N, H, v)."""
        if q_nope.shape[0] != 1:
            raise ValueError(f"paged attention expects one flattened batch (B=1), got q of shape {tuple(q_nope.shape)}")
        q_nope, q_rope, latent, k_rope = q_nope[0], q_rope[0], latent[0], k_rope[0]
        meta, cache = self.meta, self.cache
        cache.write(layer, meta.slot_mapping, latent[:, None], k_rope[:, None])  # (N, 1, c), (N, 1, r)
        out = q_nope.new_empty(*q_nope.shape[:2], module.v_dim)  # (N, H, v)
        nd = meta.num_decode_tokens
        if nd:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            lat, rope = cache.gather(layer, tables, q_nope.dtype)  # (B, blocks, bs, 1, c), (B, blocks, bs, 1, r)
            lat, rope = lat.flatten(1, 3), rope.flatten(1, 3)  # (B, L, c), (B, L, r)
            masked = torch.arange(lat.shape[1], device=lat.device)[None, :] >= lens[:, None]  # (B, L)
            w_uk, w_uv = module.absorbed_weights()
            out[:nd] = absorbed_attention(q_nope[:nd], q_rope[:nd], lat, rope, w_uk, w_uv, spec.scale, masked)
        for p in meta.prefills:
            rows = slice(p.query_start, p.query_start + p.query_len)
            offset = p.context_len - p.query_len
            if offset == 0:
                lat, rope = latent[rows], k_rope[rows]  # (T, c), (T, r): the chunk's own, as computed
            else:
                n_blocks = -(-p.context_len // cache.block_size)
                lat, rope = cache.gather(layer, p.block_table[:n_blocks], q_nope.dtype)  # (blocks, bs, 1, c|r)
                lat, rope = lat.flatten(0, 2)[: p.context_len], rope.flatten(0, 2)[: p.context_len]  # (S, c|r)
            k_nope, value = module.expand(lat)  # (S, H, n), (S, H, v)
            out[rows] = expanded_attention(q_nope[None, rows], q_rope[None, rows], k_nope[None], rope[None],
                                           value[None], spec, offset)[0]
        return out.unsqueeze(0)  # (1, N, H, v)

    def _decode(self, layer: int, q: torch.Tensor, spec: AttentionSpec | None = None) -> torch.Tensor:
        """q (B, H, D), one query per sequence at the end of its context -> (B, H, D)."""
        meta, cache = self.meta, self.cache
        spec = spec if spec is not None else AttentionSpec(1.0 / math.sqrt(q.shape[-1]))
        if self._kernel is not None and q.dtype == torch.float32 and spec.sinks is None:
            scales = (cache.k_scale[layer], cache.v_scale[layer]) if cache.quantized else (None, None)
            return self._kernel.paged_decode_attention(q, cache.k[layer], cache.v[layer], meta.decode_block_tables,
                                                       meta.decode_context_lens, spec.scale, True, *scales,
                                                       softcap=spec.softcap or 0.0, window=spec.window or 0)
        b, h, d = q.shape
        bs, hkv = cache.k.shape[2], cache.k.shape[3]
        tables = meta.decode_block_tables
        length = tables.shape[1] * bs
        keys, values = cache.gather(layer, tables, q.dtype)  # (B, blocks, bs, Hkv, D) each
        keys = keys.view(b, length, hkv, d).transpose(1, 2)  # (B, Hkv, L, D)
        values = values.view(b, length, hkv, d).transpose(1, 2)  # (B, Hkv, L, D)
        qg = q.view(b, hkv, h // hkv, d).to(keys.dtype)  # (B, Hkv, G, D)
        scores = torch.matmul(qg, keys.transpose(-1, -2)).mul_(spec.scale)  # (B, Hkv, G, L)
        if spec.softcap is not None:
            scores = torch.tanh(scores / spec.softcap).mul_(spec.softcap)
        pos = torch.arange(length, device=q.device)
        lens = meta.decode_context_lens[:, None]
        mask = pos[None, :] >= lens  # (B, L)
        if spec.window is not None:
            mask = mask | (pos[None, :] < lens - spec.window)  # the query sits at lens - 1
        scores.masked_fill_(mask[:, None, None, :], float("-inf"))
        sinks = None if spec.sinks is None else spec.sinks.view(hkv, h // hkv, 1)  # (Hkv, G, 1)
        probs = sink_softmax(scores, sinks)
        return torch.matmul(probs, values).reshape(b, h, d).to(q.dtype)  # (B, H, D)

    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: PrefillChunk,
                 spec: AttentionSpec | None = None) -> torch.Tensor:
        """q (T, H, D), this chunk's k/v (T, Hkv, D); keys = cached prefix + chunk -> (T, H, D).
        A chunk without a cached prefix attends to its own K/V as computed; one with a prefix reads the prefix
        and itself back from the cache (dequantized), as decode will."""
        t, h, d = q.shape
        hkv = k.shape[1]
        offset = p.context_len - t  # tokens before the chunk
        if offset == 0:
            keys, values = k, v  # (T, Hkv, D)
        else:
            n_blocks = -(-p.context_len // self.cache.block_size)
            keys, values = self.cache.gather(layer, p.block_table[:n_blocks], q.dtype)  # (n_blocks, bs, Hkv, D)
            keys = keys.reshape(-1, hkv, d)[: p.context_len]  # (S, Hkv, D)
            values = values.reshape(-1, hkv, d)[: p.context_len]  # (S, Hkv, D)
        spec = spec if spec is not None else AttentionSpec(1.0 / math.sqrt(d))
        if not spec.is_plain(d):  # soft-cap, window or another scale: the model's reference attention
            return spec_attention(q[None], keys[None].to(q.dtype), values[None].to(q.dtype), spec, offset)[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # (1, H, T, D)
        kh = keys.transpose(0, 1).unsqueeze(0).to(q.dtype)  # (1, Hkv, S, D)
        vh = values.transpose(0, 1).unsqueeze(0).to(q.dtype)  # (1, Hkv, S, D)
        if offset == 0:
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, enable_gqa=h != hkv)
        else:
            q_pos = torch.arange(offset, p.context_len, device=q.device)[:, None]
            allowed = torch.arange(p.context_len, device=q.device)[None, :] <= q_pos  # (T, S)
            out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=allowed, enable_gqa=h != hkv)
        return out[0].transpose(0, 1)  # (T, H, D)
