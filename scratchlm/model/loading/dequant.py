"""Vectorised torch dequantizers for the common llama.cpp block formats.

`gguf.quants.dequantize` (numpy) covers every type but takes ~40 s for a 135M Q4_1 model on this
machine; these take about a second. Other types fall back to `gguf.quants`. Blocks of 32 weights:

- Q8_0 (34 bytes): fp16 scale d, 32 x int8 q          -> d * q
- Q4_0 (18 bytes): fp16 d, 16 bytes of nibbles          -> d * (q - 8)
- Q4_1 (20 bytes): fp16 d, fp16 min m, 16 bytes nibbles -> d * q + m
Nibbles: the low 4 bits of byte j are weight j, the high 4 bits weight j + 16.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

BLOCK = 32


def _fp16(blocks: Tensor, start: int) -> Tensor:
    """The fp16 at byte `start` of each block, as float32 (N, 1)."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: Tensor) -> Tensor:
    """(N, 16) packed bytes -> (N, 32) values 0..15 in weight order."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=1).float()


def dequantize_q8_0(raw: Tensor) -> Tensor:
    blocks = raw.reshape(-1, 34)
    return (blocks[:, 2:].contiguous().view(torch.int8).float() * _fp16(blocks, 0)).reshape(-1)


def dequantize_q4_0(raw: Tensor) -> Tensor:
    blocks = raw.reshape(-1, 18)
    return ((_nibbles(blocks[:, 2:]) - 8.0) * _fp16(blocks, 0)).reshape(-1)


def dequantize_q4_1(raw: Tensor) -> Tensor:
    blocks = raw.reshape(-1, 20)
    return (_nibbles(blocks[:, 4:]) * _fp16(blocks, 0) + _fp16(blocks, 2)).reshape(-1)


_TORCH_DEQUANT = {"Q8_0": dequantize_q8_0, "Q4_0": dequantize_q4_0, "Q4_1": dequantize_q4_1}


def dequantize(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> Tensor:
    """A GGUF tensor's raw data -> float32 (or its float dtype for F32/F16) torch tensor of `shape`."""
    if type_name in ("F32", "F16"):
        return torch.from_numpy(np.array(data)).reshape(shape)
    if type_name in _TORCH_DEQUANT:
        raw = torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(-1)
        return _TORCH_DEQUANT[type_name](raw).reshape(shape)
    from gguf import GGMLQuantizationType, quants

    try:
        arr = quants.dequantize(data, GGMLQuantizationType[type_name])
    except (NotImplementedError, KeyError):
        raise ValueError(f"quantization type {type_name} is not supported by the dequantizer") from None
    return torch.from_numpy(np.array(arr, dtype=np.float32)).reshape(shape)
