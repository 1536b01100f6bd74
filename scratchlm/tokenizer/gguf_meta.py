"""A fast reader of a GGUF file's key-value metadata (the header only, no tensors).

`read_header` is shared with the model loader (`scratchlm.model.loading.gguf_reader`), which goes on to
read the tensor descriptors from the same stream.

``gguf.GGUFReader`` maps every field to numpy views and takes ~20 s on the 49K-token SmolLM2 vocabulary;
this sequential ``struct`` parse of the same header takes a fraction of a second. The tests check it
against ``gguf.GGUFReader`` field by field.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"
# GGUF value types -> struct format (scalars); 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFStream:
    """Sequential little-endian reads of GGUF values, with clear errors on truncation."""

    def __init__(self, f: BinaryIO, path: Path):
        self.f, self.path = f, path

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if len(data) != n:
            raise ValueError(f"{self.path}: truncated GGUF header (wanted {n} bytes at offset {self.f.tell()})")
        return data

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 30:
            raise ValueError(f"{self.path}: implausible string length {n} at offset {self.f.tell()}")
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
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self.read(size * count)))
            return [self.value(itype) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown GGUF value type {vtype}")


def read_header(f: BinaryIO, path: Path) -> tuple[int, dict[str, Any], GGUFStream]:
    """Parse magic, version, counts and all key-value metadata from the start of `f`.

    Returns (tensor count, metadata, the stream positioned at the first tensor descriptor).
    """
    s = GGUFStream(f, path)
    magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    version = s.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (expected 2 or 3)")
    n_tensors, n_kv = s.unpack("<Q"), s.unpack("<Q")
    if n_tensors > 1 << 20 or n_kv > 1 << 20:
        raise ValueError(f"{path}: implausible counts: {n_tensors} tensors, {n_kv} metadata entries")
    meta: dict[str, Any] = {}
    for _ in range(n_kv):
        key = s.string()
        meta[key] = s.value(s.unpack("<I"))
    return n_tensors, meta, s


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All key-value metadata of a GGUF file (v2/v3) as plain Python values (arrays as lists)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    with open(path, "rb", buffering=1 << 20) as f:
        return read_header(f, path)[1]
