"""A lean GGUF reader: key-value metadata plus tensor descriptors over one read-only memmap.

`gguf.GGUFReader` builds numpy views for every metadata element and takes 17-50 s on SmolLM2's
49K-token vocabulary here; this sequential parse takes about a second. Type sizes come from the
`gguf` package (`GGML_QUANT_SIZES`). Layout (v2/v3, little endian): magic "GGUF", u32 version,
u64 tensor count, u64 kv count, kv pairs, tensor infos (name, u32 n_dims, u64 dims fastest-first,
u32 type, u64 offset), padding to `general.alignment`, then tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    """One tensor: `shape` in logical (rows, cols) order; `data` raw bytes (quantized) or floats."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: np.ndarray


class _Reader:
    def __init__(self, f: BinaryIO, path: Path):
        self.f, self.path = f, path

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError(f"truncated GGUF header (wanted {n} bytes at offset {self.f.tell()})")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 30:
            raise ValueError(f"implausible string length {n} at offset {self.f.tell()}")
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.unpack("<I"), self.unpack("<Q")
            if itype in _SCALARS:
                fmt = _SCALARS[itype]
                return list(struct.unpack(f"<{count}{fmt[1]}", self.read(struct.calcsize(fmt) * count)))
            return [self.value(itype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def read_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
    """(metadata, {name: tensor}) of a GGUF file; tensor data are views of one read-only memmap.

    Raises ValueError with the reason for a file that is not GGUF, truncated or inconsistent.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb", buffering=1 << 20) as f:
        r = _Reader(f, path)
        magic = f.read(4)
        if magic != b"GGUF":
            raise ValueError(f"bad magic {magic!r} (expected b'GGUF')")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (expected 2 or 3)")
        n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            raise ValueError(f"implausible counts: {n_tensors} tensors, {n_kv} metadata entries")
        meta = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.unpack("<I"))
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
