"""The paged KV cache tensors, sized from a memory budget, in float32, bfloat16, float16 or int8.

Layout: k is (n_layers, num_blocks, block_size, n_kv_heads, head_dim), v the same with its own width (v_head_dim,
= head_dim but for MLA); slot s = block * block_size + offset.

Multi-head latent attention (DeepSeek; `LayerKV.latent`): per token and layer the k plane holds the compressed latent
(n_kv_heads 1, head_dim kv_lora_rank) and the v plane the RoPE key shared by the heads (qk_rope_head_dim), e.g.
512 + 64 numbers instead of 2 x 128 heads x 128 + 64 for DeepSeek-V3; int8 scales are per plane, so the latent and
the key each get their own. The attention backend's `mla` call reads them (attention.py).

Storage dtype policy (`EngineConfig.kv_cache_dtype`; "auto" = the model's dtype):

- float32 / bfloat16 / float16: K and V are stored rounded to that dtype (round to nearest even) when
  written; readers convert back to the compute dtype (the C++ kernel in registers).
- int8: symmetric int8 with one float32 scale per (token, KV head): each head's D values of one token are
  one quantization block, scale = max|x| / 127, q = round(x / scale) (half to even), x ~ q * scale. The
  scales live in k_scale / v_scale, (n_layers, num_blocks, block_size, n_kv_heads), laid out like the
  cache, so every operation on whole cache blocks (prefix-cache reuse, copy-on-write of a forked block)
  carries them along. Why per token rather than one scale per block of block_size tokens: a decode step
  appends one token to a partly filled block, and a block-wide scale would have to grow (re-rounding the
  block's earlier tokens) whenever the new token is larger; and the first token of a sequence (the
  "attention sink") often has K/V many times larger than the rest, which would crush the resolution of
  its whole block. The cost is 4 bytes of scale per head_dim bytes: 68 of fp32's 256 bytes per head
  and token at head_dim 64 (26.6 %).

Shape from the model (`ModelConfig.kv_spec()`: per layer `LayerKV(n_kv_heads, head_dim, window)`): the cache is
one tensor, so every layer must store the same heads and head_dim (`kv_shape` raises a clear error otherwise: per
layer pools are not implemented). Windows do not change the layout; they change which blocks a sequence must keep
(`kv_window`, block_manager.py).

Writes quantize (`write`); the torch-ops readers dequantize whole gathered blocks (`gather`); the C++
paged-attention kernel (csrc/paged_attention.h) and the fused decode step (csrc/decoder.h) read the stored
dtype directly and apply the same rounding when they write, so both paths store identical bytes.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass
from typing import Any

import torch

from scratchlm.inference import huge_pages

KV_STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
INT8_SCALE_DTYPE = torch.float32


def bytes_per_token_head(head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one K (or V) vector of one head and token, scales included."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    scale = torch.empty((), dtype=INT8_SCALE_DTYPE).element_size() if dtype == torch.int8 else 0
    return head_dim * itemsize + scale


def bytes_per_block(n_layers: int, n_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                    v_head_dim: int | None = None) -> int:
    """Bytes of K and V (and int8 scales) for one block in every layer (V of `v_head_dim`, default head_dim)."""
    v = head_dim if v_head_dim is None else v_head_dim
    per_head = bytes_per_token_head(head_dim, dtype) + bytes_per_token_head(v, dtype)
    return n_layers * block_size * n_kv_heads * per_head


def kv_shape(spec: SequenceABC[Any]) -> tuple[int, int, int]:
    """(n_layers, n_kv_heads, head_dim) of the one cache tensor that stores `spec` (per layer `LayerKV`); a clear
    error when the layers differ in heads or head_dim (a per-layer pool is not implemented)."""
    if not spec:
        raise ValueError("kv spec is empty: the model has no layer that stores K/V")
    shapes = {(s.n_kv_heads, s.head_dim, s.value_dim) for s in spec}
    if len(shapes) > 1:
        per_layer = ", ".join(f"{i}: {s.n_kv_heads}x{s.head_dim}" for i, s in enumerate(spec))
        raise ValueError(f"the KV cache is one tensor for all layers, but the layers store different KV heads x "
                         f"head_dim ({per_layer}): per-layer KV shapes are not supported yet")
    ((heads, dim, _),) = shapes
    return len(spec), heads, dim


def kv_v_dim(spec: SequenceABC[Any]) -> int:
    """Width of the v plane of the cache that stores `spec` (head_dim, or an MLA layer's RoPE key width)."""
    kv_shape(spec)  # one shape for every layer
    return spec[0].value_dim


def kv_window(spec: SequenceABC[Any]) -> int | None:
    """The window after which a sequence's old KV blocks can be freed: the largest window when EVERY layer is
    windowed (Mistral), else None. With one block table shared by all layers, a full-attention layer (Gemma 2/3
    alternate them) still reads every block, so mixed models keep all of them."""
    windows = [s.window for s in spec]
    if not windows or any(w is None for w in windows):
        return None
    return max(windows)


def bytes_per_block_spec(spec: SequenceABC[Any], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V (and int8 scales) for one block in every layer of `spec`."""
    n_layers, heads, dim = kv_shape(spec)
    return bytes_per_block(n_layers, heads, dim, block_size, dtype, kv_v_dim(spec))


def num_blocks_for_budget(memory_bytes: int, n_layers: int, n_kv_heads: int, head_dim: int, block_size: int,
                          dtype: torch.dtype, v_head_dim: int | None = None) -> int:
    """How many blocks fit in `memory_bytes`; a clear error when not even one does."""
    per_block = bytes_per_block(n_layers, n_kv_heads, head_dim, block_size, dtype, v_head_dim)
    n = memory_bytes // per_block
    if n < 1:
        dims = f"{head_dim} dims x K,V" if v_head_dim in (None, head_dim) else f"{head_dim} + {v_head_dim} dims"
        raise ValueError(
            f"kv_cache_memory={memory_bytes} bytes holds no KV block: one block of {block_size} tokens "
            f"needs {per_block} bytes ({n_layers} layers x {n_kv_heads} kv heads x {dims}, "
            f"{dtype})"
        )
    return int(n)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> int8 q (..., D) and float32 scales (...,): scale = max|x| / 127, q = round(x / scale)."""
    x = x.float()
    scale = x.abs().amax(dim=-1) / 127.0  # (...,)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(x / safe[..., None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


@dataclass
class KVCache:
    """k: (n_layers, num_blocks, block_size, n_kv_heads, head_dim), v: likewise with v's width (MLA: the latent
    and the RoPE key). Slot s = block * block_size + offset. k_scale, v_scale: (n_layers, num_blocks, block_size,
    n_kv_heads) float32 for an int8 cache, else None."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @classmethod
    def allocate(cls, n_layers: int, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, v_head_dim: int | None = None) -> KVCache:
        """A zeroed cache storing `dtype` (float32, bfloat16, float16, or int8 with per-token-head scales); v of
        `v_head_dim` (default head_dim)."""
        if dtype not in KV_STORAGE_DTYPES:
            raise ValueError(f"KV cache dtype {dtype} is not one of {[str(d) for d in KV_STORAGE_DTYPES]}")
        shape = (n_layers, num_blocks, block_size, n_kv_heads, head_dim)
        v_shape = shape[:-1] + (head_dim if v_head_dim is None else v_head_dim,)
        k, v = huge_pages.zeros(shape, dtype, device), huge_pages.zeros(v_shape, dtype, device)  # 2 MiB pages on CPU
        if dtype != torch.int8:
            return cls(k, v)
        scales = [torch.zeros(shape[:-1], dtype=INT8_SCALE_DTYPE, device=device) for _ in range(2)]
        return cls(k, v, *scales)

    @classmethod
    def for_spec(cls, spec: SequenceABC[Any], num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str) -> KVCache:
        """A zeroed cache for the layers of `spec` (`ModelConfig.kv_spec()`; equal heads and head_dim required)."""
        n_layers, heads, dim = kv_shape(spec)
        return cls.allocate(n_layers, num_blocks, block_size, heads, dim, dtype, device, kv_v_dim(spec))

    @property
    def num_blocks(self) -> int:
        return self.k.shape[1]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        """The storage dtype of K and V."""
        return self.k.dtype

    @property
    def quantized(self) -> bool:
        """Whether K/V are int8 with scales."""
        return self.k_scale is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool: K, V and their scales."""
        ts = [self.k, self.v] + ([self.k_scale, self.v_scale] if self.quantized else [])
        return sum(t.numel() * t.element_size() for t in ts)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v (N, Hkv, D) of N tokens at cache slots (N,) of `layer`, rounded or quantized (MLA: the
        latent (N, 1, c) and the RoPE key (N, 1, r))."""
        hkv = self.k.shape[-2]
        kc = self.k[layer].view(-1, hkv, self.k.shape[-1])  # (slots, Hkv, D): a view, writes land in the cache
        vc = self.v[layer].view(-1, hkv, self.v.shape[-1])  # (slots, Hkv, Dv)
        if not self.quantized:
            kc.index_copy_(0, slots, k.to(kc.dtype))
            vc.index_copy_(0, slots, v.to(vc.dtype))
            return
        for cache, scales, x in ((kc, self.k_scale, k), (vc, self.v_scale, v)):
            q, s = quantize_int8(x)  # (N, Hkv, D), (N, Hkv)
            cache.index_copy_(0, slots, q)
            scales[layer].view(-1, hkv).index_copy_(0, slots, s)

    def gather(self, layer: int, table: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks `table` (any shape S of block ids) of `layer`, in `dtype`:
        (*S, block_size, Hkv, D) each, dequantized for an int8 cache."""
        k, v = self.k[layer][table], self.v[layer][table]  # (*S, bs, Hkv, D)
        if not self.quantized:
            return k.to(dtype), v.to(dtype)
        ks, vs = self.k_scale[layer][table], self.v_scale[layer][table]  # (*S, bs, Hkv)
        return (k.to(dtype) * ks.to(dtype)[..., None]), (v.to(dtype) * vs.to(dtype)[..., None])

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer (copy-on-write of a forked partial block), scales too."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.k.device)
        dst = torch.tensor([d for _, d in copies], device=self.k.device)
        for t in (self.k, self.v) + ((self.k_scale, self.v_scale) if self.quantized else ()):
            t[:, dst] = t[:, src]
