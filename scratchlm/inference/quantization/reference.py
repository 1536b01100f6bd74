"""Pure-torch quantize / dequantize / matmul: the reference every kernel is tested against.

Device-agnostic (CPU or CUDA: nothing here names a device). Formats are described in `scheme.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from scratchlm.inference.quantization.scheme import CHUNK, GGUF_RAW_TYPES, LayerFormat
from scratchlm.model.loading.dequant import dequantize_rows


def _grouped(w: Tensor, g: int) -> tuple[Tensor, int]:
    """(N, K) -> (N, G, g) float32, zero-padded when g does not divide K; returns the padding."""
    n, k = w.shape
    pad = (-k) % g
    wf = w.float()
    if pad:
        wf = torch.nn.functional.pad(wf, (0, pad))
    return wf.view(n, -1, g), pad  # (N, G, g)


def quantize_int8(w: Tensor, group_size: int | None = None) -> tuple[Tensor, Tensor]:
    """Symmetric int8: q int8 (N, K), scales float32 (N, G), w ~ scale * q, |error| <= scale / 2."""
    n, k = w.shape
    g = group_size or k
    wg, _ = _grouped(w, g)  # (N, G, g)
    scales = wg.abs().amax(dim=-1) / 127.0  # (N, G)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(wg / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.view(n, -1)[:, :k].contiguous(), scales.contiguous()


def pack_nibbles(q: Tensor) -> Tensor:
    """(N, K) values 0..15 -> (N, K/2) uint8 in the GGUF chunk layout (byte i = q[i] | q[i+16] << 4)."""
    n, k = q.shape
    c = q.to(torch.uint8).view(n, k // CHUNK, 2, CHUNK // 2)  # (N, chunks, 2, 16)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 values 0..15 (inverse of `pack_nibbles`)."""
    n, half = packed.shape
    c = packed.view(n, half // (CHUNK // 2), CHUNK // 2)  # (N, chunks, 16)
    return torch.stack((c & 0x0F, c >> 4), dim=2).reshape(n, half * 2)  # (N, chunks, 2, 16) -> (N, K)


def quantize_int4(w: Tensor, group_size: int = 32, symmetric: bool = False
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """Group-wise int4 -> (packed uint8 (N, K/2), d float16 (N, G), m float16 (N, G) or None).

    Symmetric (llama.cpp Q4_0): d = v / -8 with v the group's value of largest magnitude,
    q = clamp(round(w / d) + 8, 0, 15), w ~ d (q - 8); |error| <= |d| = amax / 8.
    Asymmetric (Q4_1): d = (max - min) / 15, m = min, q = clamp(round((w - m) / d), 0, 15),
    w ~ d q + m; |error| <= d / 2 (+ float16 rounding of d and m).
    """
    n, k = w.shape
    LayerFormat(bits=4, group_size=group_size, symmetric=symmetric).check(k, "quantize_int4")
    wg, pad = _grouped(w, group_size)  # (N, G, g)
    if pad:  # padding must not widen the range: repeat each row's last real value
        last = w.float()[:, -1:]  # (N, 1)
        wg = wg.view(n, -1)
        wg[:, k:] = last
        wg = wg.view(n, -1, group_size)
    if symmetric:
        idx = wg.abs().argmax(dim=-1, keepdim=True)
        d = (torch.gather(wg, -1, idx).squeeze(-1) / -8.0).half()  # (N, G)
        df = d.float()
        inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))
        q = torch.round(wg * inv[..., None] + 8.0).clamp_(0, 15)
        m = None
    else:
        lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
        d = ((hi - lo) / 15.0).half()
        m = lo.half()
        df, mf = d.float(), m.float()
        inv = torch.where(df != 0, 1.0 / df, torch.zeros_like(df))
        q = torch.round((wg - mf[..., None]) * inv[..., None]).clamp_(0, 15)
    q = q.view(n, -1)[:, :k]
    return pack_nibbles(q), d.contiguous(), None if m is None else m.contiguous()


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    """int8 (N, K) with scales (N, G) -> float32 (N, K)."""
    n, k = q.shape
    g = -(-k // scales.shape[1])
    s = scales.float().repeat_interleave(g, dim=1)[:, :k]  # (N, K)
    return q.float() * s


def dequantize_int4(packed: Tensor, d: Tensor, m: Tensor | None, group_size: int) -> Tensor:
    """Packed int4 (N, K/2), d (N, G) [, m (N, G)] -> float32 (N, K)."""
    q = unpack_nibbles(packed).float()  # (N, K)
    k = q.shape[1]
    df = d.float().repeat_interleave(group_size, dim=1)[:, :k]  # (N, K)
    if m is None:
        return (q - 8.0) * df
    return q * df + m.float().repeat_interleave(group_size, dim=1)[:, :k]


def dequantize_gguf(raw: Tensor, type_name: str, k: int) -> Tensor:
    """A GGUF weight kept raw, uint8 (N, row_bytes) of `type_name` blocks, -> float32 (N, k) on raw's device:
    gguf.quants' values (llama.cpp's reference dequantizer), by the float loader's torch dequantizers."""
    if type_name not in GGUF_RAW_TYPES:
        raise ValueError(f"GGUF type {type_name!r} is not kept raw (raw types: {', '.join(GGUF_RAW_TYPES)})")
    return dequantize_rows(raw, type_name, k)  # vectorised torch, on raw's device (model/loading/dequant.py)


def reference_linear(x: Tensor, w_deq: Tensor) -> Tensor:
    """y = x W^T with the dequantized weight, computed in float32 and returned in x's dtype."""
    return (x.float() @ w_deq.t()).to(x.dtype)
