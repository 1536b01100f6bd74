"""A lean GGUF reader: key-value metadata plus tensor descriptors over one read-only memmap.

`gguf.GGUFReader` builds numpy views for every metadata element and takes 17-50 s on SmolLM2's
49K-token vocabulary here; this sequential parse takes about a second. The header (magic, counts,
metadata) is read by `scratchlm.tokenizer.gguf_meta.read_header`, shared with the tokenizer; this module
reads the tensor descriptors that follow. Type sizes come from the `gguf` package (`GGML_QUANT_SIZES`).
Layout (v2/v3, little endian): magic "GGUF", u32 version,
u64 tensor count, u64 kv count, kv pairs, tensor infos (name, u32 n_dims, u64 dims fastest-first,
u32 type, u64 offset), padding to `general.alignment`, then tensor data.

Metadata floats are mostly FLOAT32 in the file: llama.cpp's converter had a decimal (1e-6, 0.4) that float32
cannot hold exactly. A scalar float that is exact in float32 is read back as the shortest decimal that rounds to
the same float32 (9.999999974752427e-07 -> 1e-06), so a config read from the GGUF equals the one from config.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from scratchlm.tokenizer.gguf_meta import read_header


@dataclass
class GGUFTensor:
    """One tensor: `shape` in logical (rows, cols) order; `data` raw bytes (quantized) or floats."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


def shortest_float32(value: float) -> float:
    """`value` as the shortest decimal that rounds to the same float32, when it is exact in float32; else itself."""
    single = np.float32(value)
    return float(str(single)) if float(single) == value and np.isfinite(single) else value


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """(metadata, {name: tensor}) of a GGUF file; tensor data are views of one read-only memmap.

    Raises ValueError with the reason for a file that is not GGUF, truncated or inconsistent.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb", buffering=1 << 20) as f:
        n_tensors, meta, r = read_header(f, path)
        meta = {k: shortest_float32(v) if isinstance(v, float) else v for k, v in meta.items()}
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            dims = [r.unpack("<Q") for _ in range(n_dims)]
            infos.append((name, dims, r.unpack("<I"), r.unpack("<Q")))
        align = int(meta.get("general.alignment", 32))
        data_start = -(-f.tell() // align) * align
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, dims, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"tensor {name}: unknown ggml type id {type_id}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        shape = tuple(int(d) for d in reversed(dims))  # (rows, cols)
        n_elems = int(np.prod(shape))
        nbytes = n_elems // block * type_size
        start = data_start + offset
        if start + nbytes > size:
            raise ValueError(f"tensor {name} ends at byte {start + nbytes} beyond the file size {size} (truncated?)")
        raw = mm[start:start + nbytes]
        if qtype.name == "F32":
            data = raw.view(np.float32).reshape(shape)
        elif qtype.name == "F16":
            data = raw.view(np.float16).reshape(shape)
        else:
            data = raw.reshape(shape[:-1] + (-1,)) if shape[-1] % block == 0 else raw
        tensors[name] = GGUFTensor(name, qtype.name, shape, data)
    return meta, tensors
