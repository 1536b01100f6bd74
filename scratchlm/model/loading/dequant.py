"""Vectorised torch dequantizers for every GGUF tensor type scratchlm reads; an unknown type is a ValueError.

Each type has one function that turns (n, block_bytes) uint8 blocks into (n, block_weights) float32, built from
torch ops only, so it runs on any device (CPU, CUDA) the raw bytes are on. The values are bit-equal to
`gguf.quants.dequantize` (the numpy oracle of the tests): every float is produced by the same float32 ops in
the same order as ggml's `dequantize_row_*` (an fp16 scale widened to float32, multiplied by a small integer
held exactly in float32, then by the code, minus the min term). Nothing falls back to numpy: a type outside
`SUPPORTED_TYPES` (Q8_K and Q8_1, ggml's activation formats; Q1_0; the integer and F64 types) raises ValueError
naming it; the GGUF loaders check every tensor's type before they read any (`gguf_file.check_types`).

Block layouts (bytes; fp16 = little-endian IEEE half; "nibbles" of 16 bytes: the low 4 bits of byte j are
weight j, the high 4 bits weight j + 16 of the 32):

- 32-weight blocks: Q4_0 (18: fp16 d, nibbles: d (q - 8)), Q4_1 (20: d, fp16 m, nibbles: d q + m),
  Q5_0 (22: d, u32 high bits, nibbles: d (q - 16)), Q5_1 (24: d, m, u32 high bits, nibbles: d q + m),
  Q8_0 (34: d, 32 int8: d q), IQ4_NL (18: d, nibbles: d kvalues[q]), MXFP4 (17: e8m0 e, nibbles:
  2^(e-128) kvalues_mxfp4[q]); NVFP4 (36 bytes, 64 weights: 4 ue4m3 scales of 16 weights, 32 bytes of codes).
- 256-weight super-blocks (K-quants): Q2_K (84: 16 bytes of 4-bit scale|min, 64 bytes of 2-bit codes, d,
  dmin: d sc q - dmin m), Q3_K (110: 32-byte high-bit mask, 64 bytes of 2-bit codes, 12 bytes of 6-bit
  scales, d: d (sc - 32) (q - 4 [high bit clear])), Q4_K (144: d, dmin, 12 bytes of 6-bit scales and mins,
  128 bytes of nibbles: d sc q - dmin m per 32), Q5_K (176: as Q4_K plus a 32-byte high-bit plane),
  Q6_K (210: 128 bytes low nibbles, 64 bytes high 2 bits, 16 int8 scales, d: d sc (q - 32) per 16),
  IQ4_XS (136: d, u16 high scale bits, 4 bytes low scale nibbles, nibbles: d (ls - 32) kvalues[q] per 32),
  TQ1_0 (54: base-3 packed ternary codes, d) and TQ2_0 (66: 2-bit ternary codes, d).
- i-quants on lookup grids (256 weights; `iq_grids.py` holds llama.cpp's grids): IQ2_XXS (66), IQ2_XS (74),
  IQ2_S (82): 8-weight grid entries of {8, 25, 43}, sign bytes (IQ2_XXS/XS: 7-bit indices into ksigns, the 8th
  sign is the parity), d (0.5 + s) / 4 per 32 or 16 weights; IQ3_XXS (98), IQ3_S (110): 4-weight entries,
  d (0.5 + s) / 2 or d (1 + 2 s); IQ1_S (50), IQ1_M (56): entries of {-1, 0, 1} shifted by +-1/8,
  d (2 s + 1) (IQ1_M's fp16 d is spread over the top nibbles of its scale words).
- F32, F16 and BF16 are one weight per element.

Speed (CPU): a big tensor is done in chunks of `CHUNK_WEIGHTS` so the intermediates stay in cache (eager torch
pays a few microseconds per op, so chunks are not smaller), and the output lives in numpy-allocated memory, which
Linux backs with huge pages (first-touch page faults otherwise cost more than the work). About 0.7-2 ns per weight
on one Zen 4 core, 2-3x `gguf.quants` (`benchmarks/dequant_speed.py`). `dequantize_rows` is the entry point for
code that dequantizes some rows of a packed matrix (an embedding lookup: ~30 small ops per call).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor

from scratchlm.model.loading import iq_grids

CHUNK_WEIGHTS = 1 << 18  # weights per chunk on CPU: float32 intermediates of 1 MiB (an L2); measured best

KVALUES_IQ4NL = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
KVALUES_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 values, doubled

# Every block function is `fn(blocks (n, block_bytes) uint8, out (n, block_weights) float32) -> None`. The bit
# work runs on contiguous byte fields, on 32-bit little-endian words where a field spans bytes (four weights per
# integer op), and the last op writes `out`; integer codes are exact in float32, so the only rounding is in the
# multiplies and the subtraction, which happen in the oracle's order.


# --- field helpers -------------------------------------------------------------------------------------------

def _field(b: Tensor, start: int, stop: int) -> Tensor:
    """Bytes [start, stop) of each block, a fresh contiguous (n, stop - start) uint8 tensor (offset 0: viewable
    as int32 words even when the slice alone would already be contiguous, as with one block)."""
    return b[:, start:stop].clone(memory_format=torch.contiguous_format)


def _f16(b: Tensor, start: int) -> Tensor:
    """The fp16 at byte `start` of each block, as float32 (n, 1)."""
    return _field(b, start, start + 2).view(torch.float16).float()


def _byte_luts(kvalues: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Two 256-entry int8 tables: kvalues of a byte's low nibble, and of its high nibble."""
    return (torch.tensor([kvalues[v & 0xF] for v in range(256)], dtype=torch.int8),
            torch.tensor([kvalues[v >> 4] for v in range(256)], dtype=torch.int8))


# read-only constants, built once on CPU (a per-call torch.tensor costs more than a small chunk's work)
_SHIFTS = {w: torch.arange(0, 8, w, dtype=torch.int32).view(-1, 1) for w in (1, 2, 4)}  # (8 / w, 1)
_NIBBLE_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # (8,)
_PAIR_SHIFTS = torch.tensor([0, 2, 4, 6], dtype=torch.uint8)
_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8).view(-1, 1)  # (5, 1)
_LUTS = {"IQ4_NL": _byte_luts(KVALUES_IQ4NL), "MXFP4": _byte_luts(KVALUES_MXFP4)}
_BIT_SHIFTS = torch.arange(8, dtype=torch.uint8)  # (8,)
_SIGN_SHIFTS = torch.tensor([0, 7, 14, 21], dtype=torch.int32)  # four 7-bit sign indices in a u32
_TRIPLE_SHIFTS = torch.tensor([0, 3, 6, 9], dtype=torch.int32)  # four 3-bit fields in a u16
# ggml's ksigns_iq2xs: a 7-bit index plus its parity as bit 7 (an even number of sign bits per 8 weights)
_KSIGNS = torch.tensor([i | ((bin(i).count("1") & 1) << 7) for i in range(128)], dtype=torch.uint8)
_GRIDS = {name: iq_grids.grid(name).float() for name in iq_grids.GRIDS}  # float32 (entries, 8 or 4)


def _const(t: Tensor, like: Tensor) -> Tensor:
    """A constant on `like`'s device (no copy on CPU)."""
    return t if t.device == like.device else t.to(like.device)


def _nibbles(qs: Tensor) -> Tensor:
    """Contiguous (..., m) bytes -> (..., 2m) codes 0..15: the m low nibbles, then the m high nibbles (uint8)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _fields(qs: Tensor, width: int, left: int = 0) -> Tensor:
    """Contiguous (..., m) bytes, m % 4 == 0 -> (..., 8 // width, m) uint8: [s, j] = field s of byte j (its bits
    [s * width, (s + 1) * width)), shifted left by `left`. Done on int32 words (the arithmetic shift's sign bits
    never reach a kept bit: the masks keep the low `width` bits of each byte after shifts of at most 8 - width)."""
    words = qs.view(torch.int32).unsqueeze(-2)  # (..., 1, m / 4)
    f = (words >> _const(_SHIFTS[width], qs)) & (0x01010101 * ((1 << width) - 1))
    if left:
        f <<= left
    return f.view(torch.uint8)


def _spread(qh: Tensor) -> Tensor:
    """(n, 4) bytes of a little-endian u32 -> (n, 32) uint8: byte j = bit j. Each nibble x of the word becomes
    four bytes through x * 0x204081 (terms x, x << 7, x << 14, x << 21 do not overlap: bit i lands in byte i)."""
    nib = (qh.view(torch.int32) >> _const(_NIBBLE_SHIFTS, qh)) & 0xF  # (n, 8)
    return ((nib * 0x204081) & 0x01010101).view(torch.uint8)


def _lut(table: str, qs: Tensor) -> Tensor:
    """Contiguous (..., m) bytes of two 4-bit indices -> (..., 2m) int8 kvalues[index] of `table`, in nibble
    order, through the two byte tables of `_LUTS` (one index_select per byte rather than per nibble)."""
    idx = qs.reshape(-1).int()
    lo, hi = (_const(t, qs).index_select(0, idx) for t in _LUTS[table])
    return torch.cat((lo.view(qs.shape), hi.view(qs.shape)), dim=-1)


def _scale(out: Tensor, q: Tensor, d: Tensor) -> None:
    """out = d * q (q integer codes, exact in float32: one rounding, the multiply)."""
    out.copy_(q)
    out.mul_(d)


# --- 32-weight blocks ----------------------------------------------------------------------------------------

def _q4_0(b: Tensor, out: Tensor) -> None:
    _scale(out, _nibbles(_field(b, 2, 18)).view(torch.int8) - 8, _f16(b, 0))


def _q4_1(b: Tensor, out: Tensor) -> None:
    _scale(out, _nibbles(_field(b, 4, 20)), _f16(b, 0))
    out.add_(_f16(b, 2))


def _q5_codes(b: Tensor, qh: int, qs: int) -> Tensor:
    """Q5_0/Q5_1: 4 nibble bytes | the u32 of high bits at byte `qh` -> (n, 32) codes 0..31 (uint8)."""
    return _nibbles(_field(b, qs, qs + 16)) | (_spread(_field(b, qh, qh + 4)) << 4)


def _q5_0(b: Tensor, out: Tensor) -> None:
    _scale(out, _q5_codes(b, 2, 6).view(torch.int8) - 16, _f16(b, 0))


def _q5_1(b: Tensor, out: Tensor) -> None:
    _scale(out, _q5_codes(b, 4, 8), _f16(b, 0))
    out.add_(_f16(b, 2))


def _q8_0(b: Tensor, out: Tensor) -> None:
    _scale(out, _field(b, 2, 34).view(torch.int8), _f16(b, 0))


def _iq4_nl(b: Tensor, out: Tensor) -> None:
    _scale(out, _lut("IQ4_NL", _field(b, 2, 18)), _f16(b, 0))


def _e8m0_half(e: Tensor) -> Tensor:
    """ggml's GGML_E8M0_TO_FP32_HALF: (n, 1) uint8 exponents -> float32 2^(e - 128), built from its bits."""
    e = e.int()
    bits = torch.where(e < 2, 0x00200000 * (e + 1), (e - 1) << 23)  # e < 2: the subnormals 2^-128, 2^-127
    return bits.view(torch.float32)


def _mxfp4(b: Tensor, out: Tensor) -> None:
    _scale(out, _lut("MXFP4", _field(b, 1, 17)), _e8m0_half(b[:, 0:1]))


def _ue4m3_half(x: Tensor) -> Tensor:
    """Unsigned e4m3 scale bytes -> float32 value / 2 (gguf's NVFP4.ue4m3_to_fp32); 0 and 0x7F give 0."""
    exp = (x >> 3) & 0xF
    man = (x & 0x7).float()
    pow2 = ((exp.int() + 120) << 23).view(torch.float32)  # 2^(exp - 7), exactly
    raw = torch.where(exp == 0, man * 2.0 ** -9, (1.0 + man / 8.0) * pow2)
    return torch.where((x == 0) | (x == 0x7F), 0.0, raw * 0.5)


def _nvfp4(b: Tensor, out: Tensor) -> None:
    d = _ue4m3_half(_field(b, 0, 4)).unsqueeze(-1)  # (n, 4, 1): one scale per 16 weights
    _scale(out.view(-1, 4, 16), _lut("MXFP4", _field(b, 4, 36).view(-1, 4, 8)), d)


# --- 256-weight super-blocks ---------------------------------------------------------------------------------

def _sub_scaled(out: Tensor, q: Tensor, dl: Tensor, ml: Tensor) -> None:
    """K-quants: out = dl * q - ml per sub-block (out, q (n, S, L); dl, ml (n, S, 1))."""
    _scale(out, q, dl)
    out.sub_(ml)


def _q2_k(b: Tensor, out: Tensor) -> None:
    scales = _field(b, 0, 16)
    dl = (_f16(b, 80) * (scales & 0xF)).unsqueeze(-1)  # (n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4)).unsqueeze(-1)
    q = _fields(_field(b, 16, 80).view(-1, 2, 32), 2)  # (n, 2 halves, 4 shifts, 32): weight 128h + 32s + j
    _sub_scaled(out.view(-1, 16, 16), q.view(-1, 16, 16), dl, ml)


def _q3_k(b: Tensor, out: Tensor) -> None:
    sc = _field(b, 96, 108)
    low = _nibbles(sc[:, 0:8])  # (n, 16): low 4 bits of scales 0..7 then 8..15
    high = _fields(_field(b, 104, 108), 2).reshape(-1, 16)  # 2 high bits: scale 4s + j from byte j, shift 2s
    scales = (low | (high << 4)).view(torch.int8) - 32  # (n, 16) -32..31
    dl = (_f16(b, 108) * scales).unsqueeze(-1)  # (n, 16, 1)
    ql = _fields(_field(b, 32, 96).view(-1, 2, 32), 2)  # (n, 2, 4, 32) 0..3
    hm = _fields(_field(b, 0, 32), 1, left=2)  # (n, 8, 32): 4 where bit s of mask byte j (weight 32s + j) is set
    q = (ql.view(-1, 8, 32) | hm).view(torch.int8) - 4  # the code, minus 4 where the high bit is clear
    _scale(out.view(-1, 16, 16), q.view(-1, 16, 16), dl)


def _k_scale_min(sc: Tensor) -> tuple[Tensor, Tensor]:
    """Q4_K/Q5_K's 12 bytes -> (scales, mins), each (n, 8) 6-bit values (uint8), as ggml's get_scale_min_k4."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scales = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return scales, mins


def _k_apply(b: Tensor, q: Tensor, out: Tensor) -> None:
    """Q4_K/Q5_K: (n, 8, 32) codes -> d sc q - dmin m per 32-weight sub-block."""
    scales, mins = _k_scale_min(_field(b, 4, 16))
    dl = (_f16(b, 0) * scales).unsqueeze(-1)  # (n, 8, 1)
    ml = (_f16(b, 2) * mins).unsqueeze(-1)
    _sub_scaled(out.view(-1, 8, 32), q, dl, ml)


def _q4_k(b: Tensor, out: Tensor) -> None:
    q = _nibbles(_field(b, 16, 144).view(-1, 4, 32))  # (n, 4, 64): 64 weights per 32 bytes
    _k_apply(b, q.view(-1, 8, 32), out)


def _q5_k(b: Tensor, out: Tensor) -> None:
    ql = _nibbles(_field(b, 48, 176).view(-1, 4, 32)).view(-1, 8, 32)
    qh = _fields(_field(b, 16, 48), 1, left=4)  # (n, 8, 32): bit s of byte j is the high bit of weight 32s + j
    _k_apply(b, ql | qh, out)


def _q6_k(b: Tensor, out: Tensor) -> None:
    dl = (_f16(b, 208) * _field(b, 192, 208).view(torch.int8)).unsqueeze(-1)  # (n, 16, 1)
    ql = _nibbles(_field(b, 0, 128).view(-1, 2, 64))  # (n, 2, 128): per half, low nibbles of 64 bytes, then high
    qh = _fields(_field(b, 128, 192).view(-1, 2, 32), 2, left=4)  # (n, 2, 4, 32): bits 4-5 of weight 128h + 32s + j
    q = (ql.view(-1, 2, 4, 32) | qh).view(torch.int8) - 32  # -32..31
    _scale(out.view(-1, 16, 16), q.view(-1, 16, 16), dl)


def _iq4_xs(b: Tensor, out: Tensor) -> None:
    sl, sh = _field(b, 4, 8), _field(b, 2, 4)
    low = torch.stack((sl & 0xF, sl >> 4), dim=-1).view(-1, 8)  # sub-block 2k + s: nibble s of byte k
    high = ((sh.unsqueeze(-1) >> _const(_PAIR_SHIFTS, sh)) & 3).view(-1, 8)  # 4k + s: bits 2s of byte k
    scales = (low | (high << 4)).view(torch.int8) - 32
    dl = (_f16(b, 0) * scales).unsqueeze(-1)  # (n, 8, 1)
    _scale(out.view(-1, 8, 32), _lut("IQ4_NL", _field(b, 8, 136).view(-1, 8, 16)), dl)


def _tq1_0(b: Tensor, out: Tensor) -> None:
    pow3 = _const(_POW3, b)
    q0 = (_field(b, 0, 32).unsqueeze(-2) * pow3).view(-1, 160)  # uint8 products wrap mod 256, as ggml's
    q1 = (_field(b, 32, 48).unsqueeze(-2) * pow3).view(-1, 80)
    q2 = (_field(b, 48, 52).unsqueeze(-2) * pow3[:4]).view(-1, 16)
    q = torch.cat((q0, q1, q2), dim=-1).short()  # (n, 256)
    _scale(out, ((q * 3) >> 8) - 1, _f16(b, 52))


def _tq2_0(b: Tensor, out: Tensor) -> None:
    q = _fields(_field(b, 0, 64).view(-1, 2, 32), 2).view(-1, 256).view(torch.int8) - 1
    _scale(out, q, _f16(b, 64))


# --- i-quants on lookup grids (256-weight super-blocks) ----------------------------------------------------------

def _u16(b: Tensor, start: int, stop: int) -> Tensor:
    """Little-endian u16 fields in bytes [start, stop) -> (n, (stop - start) / 2) int32 0..65535."""
    return _field(b, start, stop).view(torch.int16).int() & 0xFFFF


def _sign_bits(sb: Tensor) -> Tensor:
    """Sign bytes (...) -> (..., 8) float32: -1 where bit j is set, else 1."""
    return 1.0 - 2.0 * ((sb.unsqueeze(-1) >> _const(_BIT_SHIFTS, sb)) & 1)


def _ksigns(words: Tensor) -> Tensor:
    """(...) int32 words holding four 7-bit sign indices at bits 0, 7, 14, 21 -> (..., 4, 8) float32 signs."""
    idx = (words.unsqueeze(-1) >> _const(_SIGN_SHIFTS, words)) & 127  # (..., 4)
    return _sign_bits(_const(_KSIGNS, words).index_select(0, idx.reshape(-1)).view(idx.shape))


def _grid(name: str, idx: Tensor) -> Tensor:
    """Grid entries of `idx` (any shape, integer) -> (*idx.shape, 8 or 4) float32."""
    g = _const(_GRIDS[name], idx)
    return g.index_select(0, idx.reshape(-1).int()).view(*idx.shape, g.shape[1])


def _half_nibbles(sc: Tensor) -> Tensor:
    """(n, m) scale bytes -> (n, 2m): low nibble, high nibble of byte 0, then of byte 1, ..."""
    return torch.stack((sc & 0xF, sc >> 4), dim=-1).view(sc.shape[0], -1)


def _grid_signed(out: Tensor, db: Tensor, grid: Tensor, signs: Tensor) -> None:
    """out = db * grid * signs, in that order (db (..., 1, 1) per group of weights)."""
    torch.mul(db, grid, out=out)
    out.mul_(signs)


def _iq2_xxs(b: Tensor, out: Tensor) -> None:
    aux = _field(b, 2, 66).view(torch.int32).view(-1, 8, 2)  # per 32 weights: 4 grid bytes, scale|4 x 7 sign bits
    db = _f16(b, 0) * (((aux[..., 1] >> 28) & 0xF).float() + 0.5) * 0.25  # (n, 8)
    idx = aux[..., 0].contiguous().view(torch.uint8).view(-1, 8, 4)  # (n, 8, 4)
    _grid_signed(out.view(-1, 8, 4, 8), db.view(-1, 8, 1, 1), _grid("iq2xxs_grid", idx), _ksigns(aux[..., 1]))


def _iq2_xs(b: Tensor, out: Tensor) -> None:
    qs = _u16(b, 2, 66)  # (n, 32): 9-bit grid index | 7-bit sign index
    db = _f16(b, 0) * (_half_nibbles(_field(b, 66, 74)).float() + 0.5) * 0.25  # (n, 16): one per 16 weights
    signs = _sign_bits(_const(_KSIGNS, qs).index_select(0, (qs >> 9).reshape(-1)).view(-1, 32))
    _grid_signed(out.view(-1, 16, 2, 8), db.view(-1, 16, 1, 1), _grid("iq2xs_grid", qs & 511).view(-1, 16, 2, 8),
                 signs.view(-1, 16, 2, 8))


def _iq2_s(b: Tensor, out: Tensor) -> None:
    qh = ((_field(b, 66, 74).unsqueeze(-1) >> _const(_PAIR_SHIFTS, b)) & 3).view(-1, 32)  # (n, 32) index bits 8-9
    idx = _field(b, 2, 34).int() | (qh.int() << 8)
    db = _f16(b, 0) * (_half_nibbles(_field(b, 74, 82)).float() + 0.5) * 0.25  # (n, 16)
    _grid_signed(out.view(-1, 16, 2, 8), db.view(-1, 16, 1, 1), _grid("iq2s_grid", idx).view(-1, 16, 2, 8),
                 _sign_bits(_field(b, 34, 66)).view(-1, 16, 2, 8))


def _iq3_xxs(b: Tensor, out: Tensor) -> None:
    aux = _field(b, 66, 98).view(torch.int32)  # (n, 8): scale | 4 x 7 sign bits per 32 weights
    db = _f16(b, 0) * (((aux >> 28) & 0xF).float() + 0.5) * 0.5  # (n, 8)
    grid = _grid("iq3xxs_grid", _field(b, 2, 66)).view(-1, 8, 4, 8)  # 64 entries of 4 weights
    _grid_signed(out.view(-1, 8, 4, 8), db.view(-1, 8, 1, 1), grid, _ksigns(aux))


def _iq3_s(b: Tensor, out: Tensor) -> None:
    qh = ((_field(b, 66, 74).unsqueeze(-1) >> _const(_BIT_SHIFTS, b)) & 1).view(-1, 64)  # index bit 8
    idx = _field(b, 2, 66).int() | (qh.int() << 8)
    db = _f16(b, 0) * (_half_nibbles(_field(b, 106, 110)) * 2 + 1)  # (n, 8): d (1 + 2 s)
    _grid_signed(out.view(-1, 8, 4, 8), db.view(-1, 8, 1, 1), _grid("iq3s_grid", idx).view(-1, 8, 4, 8),
                 _sign_bits(_field(b, 74, 106)).view(-1, 8, 4, 8))


def _iq1_apply(out: Tensor, dl: Tensor, grid: Tensor, delta: Tensor) -> None:
    """out = dl * (grid + delta)."""
    torch.add(grid, delta, out=out)
    out.mul_(dl)


def _iq1_s(b: Tensor, out: Tensor) -> None:
    qh = _u16(b, 34, 50)  # (n, 8): 3 index bits per 8 weights x 4 | 3-bit scale | delta sign
    dl = _f16(b, 0) * (((qh >> 12) & 7) * 2 + 1)  # (n, 8)
    delta = torch.where((qh & 0x8000) == 0, 0.125, -0.125)
    high = ((qh.unsqueeze(-1) >> _const(_TRIPLE_SHIFTS, qh)) & 7).view(-1, 32)
    grid = _grid("iq1s_grid", _field(b, 2, 34).int() | (high << 8)).view(-1, 8, 4, 8)
    _iq1_apply(out.view(-1, 8, 4, 8), dl.view(-1, 8, 1, 1), grid, delta.view(-1, 8, 1, 1))


def _iq1_m(b: Tensor, out: Tensor) -> None:
    sc = _u16(b, 48, 56)  # (n, 4): 4 x 3-bit scales, and 4 bits of the fp16 d at the top of each
    top = sc & 0xF000
    dbits = (top[:, 0:1] >> 12) | (top[:, 1:2] >> 8) | (top[:, 2:3] >> 4) | top[:, 3:4]
    d = dbits.to(torch.int16).view(torch.float16).float()  # (n, 1)
    scales = ((sc.unsqueeze(-1) >> _const(_TRIPLE_SHIFTS, sc)) & 7).view(-1, 16)  # one per 16 weights
    dl = d * (scales * 2 + 1)  # (n, 16)
    qh = _field(b, 32, 48)
    qh = torch.stack((qh & 0xF, qh >> 4), dim=-1).view(-1, 32)  # per 8 weights: 3 index bits | delta sign
    grid = _grid("iq1s_grid", _field(b, 0, 32).int() | ((qh & 7).int() << 8)).view(-1, 8, 2, 2, 8)
    delta = torch.where((qh & 8) == 0, 0.125, -0.125).view(-1, 8, 2, 2, 1)
    _iq1_apply(out.view(-1, 8, 2, 2, 8), dl.view(-1, 8, 2, 1, 1), grid, delta)


# name -> (weights per block, bytes per block, block function or None for the float types)
_TYPES: dict[str, tuple[int, int, Callable[[Tensor, Tensor], None] | None]] = {
    "F32": (1, 4, None), "F16": (1, 2, None), "BF16": (1, 2, None),
    "Q4_0": (32, 18, _q4_0), "Q4_1": (32, 20, _q4_1), "Q5_0": (32, 22, _q5_0), "Q5_1": (32, 24, _q5_1),
    "Q8_0": (32, 34, _q8_0), "IQ4_NL": (32, 18, _iq4_nl), "MXFP4": (32, 17, _mxfp4), "NVFP4": (64, 36, _nvfp4),
    "Q2_K": (256, 84, _q2_k), "Q3_K": (256, 110, _q3_k), "Q4_K": (256, 144, _q4_k), "Q5_K": (256, 176, _q5_k),
    "Q6_K": (256, 210, _q6_k), "IQ4_XS": (256, 136, _iq4_xs), "TQ1_0": (256, 54, _tq1_0),
    "TQ2_0": (256, 66, _tq2_0), "IQ2_XXS": (256, 66, _iq2_xxs), "IQ2_XS": (256, 74, _iq2_xs),
    "IQ2_S": (256, 82, _iq2_s), "IQ3_XXS": (256, 98, _iq3_xxs), "IQ3_S": (256, 110, _iq3_s),
    "IQ1_S": (256, 50, _iq1_s), "IQ1_M": (256, 56, _iq1_m),
}

TYPE_INFO: dict[str, tuple[int, int]] = {name: (bw, bb) for name, (bw, bb, _) in _TYPES.items()}
"""GGUF type name -> (weights per block, bytes per block), as ggml's type traits (GGML_QUANT_SIZES)."""

SUPPORTED_TYPES: tuple[str, ...] = tuple(_TYPES)
"""The GGUF tensor types scratchlm dequantizes; any other type is a ValueError naming it."""


def _unsupported(type_name: str) -> ValueError:
    return ValueError(f"GGUF tensor type {type_name} is not supported (supported: {', '.join(SUPPORTED_TYPES)})")


def _float_rows(raw: Tensor, type_name: str) -> Tensor:
    """F32 / F16 / BF16 bytes (n, 2 or 4) -> float32 (n, 1); F32 shares the input's memory when it is contiguous.

    BF16 widens exactly (its bits are the high half of a float32), as F16 does."""
    raw = raw.contiguous()
    if type_name == "F32":
        return raw.view(torch.float32)
    half = raw.view(torch.float16 if type_name == "F16" else torch.bfloat16)
    return (_cpu_empty(*half.shape) if raw.device.type == "cpu" else torch.empty_like(half, dtype=torch.float32)
            ).copy_(half)


def _cpu_empty(*shape: int) -> Tensor:
    """An uninitialised float32 CPU tensor in memory numpy allocated: numpy asks Linux for transparent huge pages
    on large arrays (madvise), torch's allocator does not (unless THP_MEM_ALLOC_ENABLE is set), and the first
    write to 4 KiB pages costs more than the dequantization itself (55 vs 7 ms for 30M floats, measured)."""
    return torch.from_numpy(np.empty(shape, dtype=np.float32))


def dequantize_blocks(blocks: Tensor, type_name: str) -> Tensor:
    """(n, block_bytes) uint8 blocks of `type_name` -> (n, block_weights) float32 on the same device.

    On CPU, large inputs are done in chunks of `CHUNK_WEIGHTS` weights (the intermediates stay in cache)."""
    if type_name not in _TYPES:
        raise _unsupported(type_name)
    bw, bb, fn = _TYPES[type_name]
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != bb:
        raise ValueError(f"{type_name} blocks must be (n, {bb}) uint8, got {tuple(blocks.shape)} {blocks.dtype}")
    if fn is None:
        return _float_rows(blocks, type_name)
    n = blocks.shape[0]
    if blocks.device.type == "cpu":
        out, step = _cpu_empty(n, bw), max(1, CHUNK_WEIGHTS // bw)
    else:
        out, step = torch.empty(n, bw, dtype=torch.float32, device=blocks.device), max(n, 1)
    for i in range(0, n, step):
        fn(blocks[i:i + step], out[i:i + step])
    return out


def dequantize_rows(raw: Tensor, type_name: str, K: int) -> Tensor:
    """Rows of a GGUF matrix as the file stores them: raw (R, row_bytes) uint8 -> (R, K) float32, same device.

    `row_bytes` must be K / block_weights * block_bytes (K a multiple of the block); the packed embedding
    lookup calls this on the rows its ids select."""
    if type_name not in _TYPES:
        raise _unsupported(type_name)
    bw, bb = TYPE_INFO[type_name]
    if K % bw:
        raise ValueError(f"{type_name} rows of {K} weights: not a multiple of the {bw}-weight block")
    if raw.dim() != 2 or raw.shape[1] != K // bw * bb:
        raise ValueError(f"{type_name} rows of {K} weights take {K // bw * bb} bytes, got {tuple(raw.shape)}")
    R = raw.shape[0]
    return dequantize_blocks(raw.reshape(R * (K // bw), bb), type_name).view(R, K)


def as_uint8_tensor(data: np.ndarray | Tensor) -> Tensor:
    """A tensor's raw bytes (numpy, possibly a read-only memmap, or torch) as a flat uint8 torch tensor."""
    if isinstance(data, Tensor):
        data = data.contiguous()
        return data.view(torch.uint8).reshape(-1) if data.dtype != torch.uint8 else data.reshape(-1)
    return torch.from_numpy(np.array(data, copy=True).reshape(-1).view(np.uint8))  # copy: memmaps are read-only


def dequantize(data: np.ndarray | Tensor, type_name: str, shape: tuple[int, ...]) -> Tensor:
    """A GGUF tensor's data (raw bytes, or the float view the reader makes for F32/F16) -> float32 `shape`.

    `data` may be numpy (the reader's memmap views) or a torch tensor on any device; the result is on that
    device (CPU for numpy). Raises ValueError naming the type for one outside `SUPPORTED_TYPES`, or when the
    byte count does not match `shape`."""
    if type_name not in _TYPES:
        raise _unsupported(type_name)
    bw, bb = TYPE_INFO[type_name]
    n = int(np.prod(shape, dtype=np.int64))
    raw = as_uint8_tensor(data)
    if n % bw or raw.numel() != n // bw * bb:
        raise ValueError(f"{type_name} tensor of shape {tuple(shape)} needs {n // bw * bb} bytes "
                         f"({n} weights in {bw}-weight blocks of {bb} bytes), got {raw.numel()}")
    return dequantize_blocks(raw.view(n // bw, bb), type_name).view(shape)
