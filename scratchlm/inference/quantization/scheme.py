"""Quantization schemes: what a name like ``int4-g32-asym`` means, and per-layer formats.

A *scheme* says how to quantize a float model (which bits, group size, symmetry, whether the
output head / token embedding are quantized too). A `LayerFormat` says how one weight matrix is
stored; a quantized model records one per quantized module, so checkpoints (and GGUF files whose
tensors mix Q4_1 and Q8_0) reload without guessing.

Weight formats (K = d_in, N = d_out, g = group size, G = ceil(K / g) groups per row):

- ``int8``: qweight int8 (N, K), scales float32 (N, G); w = scale * q, q in [-127, 127].
  Per output channel is g = K (one scale per row); GGUF Q8_0 is g = 32.
- ``int4``: qweight uint8 (N, K / 2) of packed nibbles, scales float16 (N, G), and for the
  asymmetric variant mins float16 (N, G). Symmetric: w = d * (q - 8) (llama.cpp Q4_0);
  asymmetric: w = d * q + m (Q4_1); q in [0, 15]. Nibbles are laid out per 32-weight chunk as in
  GGUF: byte i (0..15) of a chunk holds weight i in its low 4 bits and weight i + 16 in its high 4
  bits, so K must be a multiple of 32 and g a multiple of 32. When g does not divide K the last
  group of a row is shorter (576 = 4 x 128 + 64 for SmolLM2's g = 128).
- GGUF kept raw (``gguf_type`` set, `GGUF_RAW_TYPES`: Q5_0, Q5_1, IQ4_NL, Q2_K .. Q6_K, IQ4_XS): qweight uint8
  (N, row_bytes), each row the file's blocks byte for byte (K a multiple of the type's block, 32 or 256 weights);
  the kernels of csrc/gguf_gemm.h read them in place. ``bits`` is 0 (the type says it all). GGUF Q4_0 / Q4_1 /
  Q8_0 are not raw: they are the int4 / int8 formats above (`gguf_packed.py` splits their blocks into planes).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Literal

CHUNK = 32  # int4 nibble packing unit (GGUF block size)
SEARCHES = ("auto", "mse", "rtn", "gptq")

# GGUF block types kept raw: name -> (ggml type id, weights per block, bytes per block) (ggml's type traits).
GGUF_RAW_TYPES: dict[str, tuple[int, int, int]] = {
    "Q5_0": (6, 32, 22), "Q5_1": (7, 32, 24), "IQ4_NL": (20, 32, 18),
    "Q2_K": (10, 256, 84), "Q3_K": (11, 256, 110), "Q4_K": (12, 256, 144), "Q5_K": (13, 256, 176),
    "Q6_K": (14, 256, 210), "IQ4_XS": (23, 256, 136),
}


@dataclass(frozen=True)
class LayerFormat:
    """How one weight matrix is stored. `group_size` None means one group per row (per channel).

    gguf_type: a GGUF block type kept raw (`GGUF_RAW_TYPES`; then bits is 0 and group_size / symmetric unused):
    make it with `LayerFormat.gguf(type_name)`."""

    bits: Literal[8, 4, 0]
    group_size: int | None = None
    symmetric: bool = True
    gguf_type: str | None = None

    @classmethod
    def gguf(cls, type_name: str) -> LayerFormat:
        """The format of a GGUF weight kept in its file blocks (`GGUF_RAW_TYPES`)."""
        if type_name not in GGUF_RAW_TYPES:
            raise ValueError(f"GGUF type {type_name!r} is not kept raw; raw types: {', '.join(GGUF_RAW_TYPES)}")
        return cls(bits=0, group_size=None, symmetric=False, gguf_type=type_name)

    @property
    def raw(self) -> bool:
        """Whether this is a GGUF block type kept raw."""
        return self.gguf_type is not None

    def row_bytes(self, d_in: int) -> int:
        """Bytes of one stored row of `d_in` weights (raw GGUF formats)."""
        _, weights, nbytes = GGUF_RAW_TYPES[self.gguf_type]
        return d_in // weights * nbytes

    def groups(self, d_in: int) -> int:
        """Number of scale groups per row for a row of `d_in` weights."""
        g = self.group_size or d_in
        return -(-d_in // g)

    def check(self, d_in: int, where: str) -> None:
        """Raise ValueError naming `where` if a (d_out, d_in) matrix cannot be stored in this format."""
        if self.gguf_type is not None:
            if self.gguf_type not in GGUF_RAW_TYPES:
                raise ValueError(f"{where}: GGUF type {self.gguf_type!r} is not kept raw (raw types: "
                                 f"{', '.join(GGUF_RAW_TYPES)})")
            weights = GGUF_RAW_TYPES[self.gguf_type][1]
            if d_in % weights:
                raise ValueError(f"{where}: GGUF {self.gguf_type} needs d_in to be a multiple of {weights}, got "
                                 f"d_in={d_in}")
            return
        if self.bits not in (8, 4):
            raise ValueError(f"{where}: bits={self.bits!r} must be 8 or 4")
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, int) or g <= 0):
            raise ValueError(f"{where}: group_size={g!r} must be a positive int or None (per channel)")
        if self.bits == 4:
            if g is None or g % CHUNK:
                raise ValueError(f"{where}: int4 group_size={g!r} must be a positive multiple of {CHUNK} "
                                 f"(nibbles are packed in blocks of {CHUNK})")
            if d_in % CHUNK:
                raise ValueError(f"{where}: int4 needs d_in to be a multiple of {CHUNK}, got d_in={d_in}; "
                                 f"use int8 for this model")
        elif g is not None and d_in % g:
            raise ValueError(f"{where}: int8 group_size={g} does not divide d_in={d_in}; use a divisor of {d_in} "
                             f"or None (per channel)")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        """A short name: ``int4-g32-asym``, ``int8-g32-sym``, or the GGUF type (``Q4_K``)."""
        if self.gguf_type is not None:
            return self.gguf_type
        return f"int{self.bits}-g{self.group_size}-{'sym' if self.symmetric else 'asym'}"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayerFormat:
        try:
            if data.get("gguf_type") is not None:
                return cls.gguf(str(data["gguf_type"]))
            return cls(bits=int(data["bits"]), group_size=data.get("group_size"),
                       symmetric=bool(data.get("symmetric", True)))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"invalid layer format {data!r}: {e}") from None

    def bits_per_weight(self, d_in: int) -> float:
        """Stored bits per weight, scales included (e.g. 4.5 for sym int4 g32, 4.5 for GGUF Q4_K)."""
        if self.gguf_type is not None:
            _, weights, nbytes = GGUF_RAW_TYPES[self.gguf_type]
            return 8 * nbytes / weights
        g = self.group_size or d_in
        if self.bits == 8:
            return 8 + 32 / g
        return 4 + (16 if self.symmetric else 32) / g


@dataclass(frozen=True)
class QuantScheme:
    """A named way to quantize every linear layer of a float model.

    quantize_head: also quantize the output head (for tied models a quantized copy of the
    embedding is made for the head; the lookup table stays float unless quantize_embedding).
    head: the head's format when it differs from `linear`. int4 schemes keep the head at
    per-channel int8 by default (as llama.cpp keeps output.weight at 6-8 bits: 4-bit logits cost
    SmolLM2 +2.5 % perplexity for 11 MiB; docs/quantization.md "int4 quality"); ``+head4`` stores it
    in the linears' int4 format. search: how int4 codes / scales / mins are chosen (`calibrate.py`,
    `gptq.py`): ``auto`` (the default) = sequential GPTQ when calibration tokens are given, else the
    weight-only error-minimizing search; ``mse`` = that search (activation-weighted when calibrated);
    ``rtn`` = plain round-to-nearest on the group's min/max (Q4_1) or absmax (Q4_0); ``gptq`` = GPTQ
    (needs calibration tokens). The stored format is the same for all.
    """

    name: str
    linear: LayerFormat
    quantize_head: bool = True
    quantize_embedding: bool = False
    head: LayerFormat | None = None  # the head's format when it differs from `linear` (+head8)
    search: Literal["auto", "mse", "rtn", "gptq"] = "auto"  # how int4 codes / scales / mins are chosen

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "linear": self.linear.to_dict(), "quantize_head": self.quantize_head,
                "quantize_embedding": self.quantize_embedding, "head": self.head.to_dict() if self.head else None,
                "search": self.search}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantScheme:
        try:
            return cls(name=str(data["name"]), linear=LayerFormat.from_dict(data["linear"]),
                       quantize_head=bool(data.get("quantize_head", True)),
                       quantize_embedding=bool(data.get("quantize_embedding", False)),
                       head=LayerFormat.from_dict(data["head"]) if data.get("head") else None,
                       search=str(data.get("search", "rtn")))
        except (KeyError, TypeError) as e:
            raise ValueError(f"invalid quantization scheme {data!r}: {e}") from None

    def __post_init__(self) -> None:
        if self.search not in SEARCHES:
            raise ValueError(f"quantization search {self.search!r} must be one of {', '.join(SEARCHES)}")

    def resolved_search(self, calibrated: bool) -> str:
        """The search actually run: ``auto`` -> ``gptq`` with calibration tokens, else ``mse``."""
        if self.search == "auto":
            return "gptq" if calibrated else "mse"
        return self.search


SCHEME_HELP = ("int8 (per output channel) | int4[-gN][-sym|-asym] (default g32, asym), e.g. int4-g128-sym; "
               "int4 keeps the output head at per-channel int8 (as llama.cpp keeps it at 6-8 bits; +head4 stores "
               "it in int4 too, +nohead keeps it float); append +emb to quantize the token embedding too; int4 "
               "parameters come from sequential GPTQ with calibration text, else from an error-minimizing "
               "weight-only search; +mse forces that search (activation-weighted with calibration text), +rtn "
               "plain round-to-nearest min/max, +gptq GPTQ (needs calibration text)")
_FLAGS = ("emb", "nohead", "head8", "head4", "rtn", "mse", "gptq")
_PATTERN = re.compile(r"^(int8|int4)(?:-g(\d+))?(?:-(sym|asym))?((?:\+(?:" + "|".join(_FLAGS) + r"))*)$")


def parse_scheme(name: str) -> QuantScheme:
    """`QuantScheme` from a name such as ``int8``, ``int4``, ``int4-g128-sym``, ``int8+emb``.

    Raises ValueError naming what was wrong and the accepted forms.
    """
    if not isinstance(name, str):
        raise ValueError(f"quantization scheme must be a string, got {type(name).__name__}")
    m = _PATTERN.match(name.strip().lower())
    if m is None:
        raise ValueError(f"unknown quantization scheme {name!r}; expected {SCHEME_HELP}")
    kind, group, sym, flags = m.groups()
    if kind == "int8":
        if sym == "asym":
            raise ValueError(f"{name!r}: int8 is symmetric only (per output channel, or -gN groups)")
        fmt = LayerFormat(bits=8, group_size=int(group) if group else None, symmetric=True)
    else:
        g = int(group) if group else 32
        if g <= 0 or g % CHUNK:
            raise ValueError(f"{name!r}: int4 group size {g} must be a positive multiple of {CHUNK}")
        fmt = LayerFormat(bits=4, group_size=g, symmetric=(sym == "sym"))
    canonical = kind if kind == "int8" and not group else (
        f"int8-g{group}" if kind == "int8" else f"int4-g{fmt.group_size}-{'sym' if fmt.symmetric else 'asym'}")
    heads = [f for f in ("+head8", "+head4", "+nohead") if f in flags]
    if len(heads) > 1:
        raise ValueError(f"{name!r}: {' and '.join(heads)} exclude each other")
    for flag in ("+rtn", "+mse", "+gptq", "+head4"):
        if flag in flags and kind == "int8":
            raise ValueError(f"{name!r}: {flag} applies to int4 only (int8 rounds to nearest on the absmax scale)")
    searches = [f for f in ("+rtn", "+mse", "+gptq") if f in flags]
    if len(searches) > 1:
        raise ValueError(f"{name!r}: {' and '.join(searches)} exclude each other")
    head = None if kind == "int8" or "+head4" in flags or "+nohead" in flags else LayerFormat(bits=8)
    return QuantScheme(name=canonical + flags, linear=fmt, quantize_head="+nohead" not in flags,
                       quantize_embedding="+emb" in flags, head=head,
                       search="rtn" if kind == "int8" else searches[0][1:] if searches else "auto")


SCHEMES = ("int8", "int4-g32-sym", "int4-g32-asym", "int4-g128-sym", "int4-g128-asym")
