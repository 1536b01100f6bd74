"""Load a GGUF file keeping its quantized weights packed as the file stores them (no float copy of any weight).

The raw blocks are read with the lean reader (`model/loading/gguf_reader.py`, the float loader's). Each weight
keeps its own type, so a file that mixes types per tensor (a Q4_K_M mixes Q4_K, Q6_K, Q5_0 and Q8_0; embeddings
and output may be any type) loads as it is:

- Q4_0 / Q4_1 / Q8_0 are split into planes without touching the 4-/8-bit codes (`scheme.py` int4 / int8
  formats), the layout of quant_gemm.h's kernels:
  Q4_0 block (18 bytes: fp16 d, 16 bytes of nibbles)  -> int4 symmetric g32:  w = d (q - 8)
  Q4_1 block (20 bytes: fp16 d, fp16 m, 16 bytes)     -> int4 asymmetric g32: w = d q + m
  Q8_0 block (34 bytes: fp16 d, 32 x int8)            -> int8 g32 (d widened to float32 exactly)
- Q5_0, Q5_1, IQ4_NL, Q2_K .. Q6_K and IQ4_XS stay raw: uint8 (N, row_bytes), the file's bytes
  (`LayerFormat.gguf`), read in place by csrc/gguf_gemm.h's kernels.
- F32 / F16 / BF16 tensors (norms, and any float weight) are float tensors as in the float loader.

The family's tensor rules (`model/families/`) move or split rows (q/k unpermutes, fused q/k/v splits): whole rows
move, so they apply to the planes and to the raw rows alike. llama.cpp's stacked MoE experts (E, F, D) are read
as one (E * F, D) matrix whose E row ranges become E per-expert linears (`base.stacked`), each a view of the
one stacked buffer: no expert is dequantized or copied. A quantized tensor under another transform (a
transposed or offset tensor) is dequantized first (logged). Everything is checked before any weight is read: a
tensor of a type that cannot be kept packed (e.g. IQ2_XXS), a raw type whose row length is not a multiple of its
block, or a raw type the CPU kernels of this build do not take is a `CheckpointError` naming the tensors and types.
A tied output head computes with the packed embedding (the same tensors).
"""

from __future__ import annotations

import logging
import math
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from scratchlm.inference.quantization import kernels
from scratchlm.inference.quantization.modules import EMBEDDING, HEAD, QuantizedTransformerLM
from scratchlm.inference.quantization.scheme import GGUF_RAW_TYPES, LayerFormat
from scratchlm.model.families import Rule
from scratchlm.model.loading.common import CheckpointError, LoadedModel, optional_tokenizer, require_file
from scratchlm.model.loading.dequant import dequantize
from scratchlm.model.loading.gguf_file import check_types, config_from_gguf, gguf_rules
from scratchlm.model.loading.gguf_reader import GGUFTensor, read_gguf
from scratchlm.model.loading.guard import check_gguf_finite, check_memory

log = logging.getLogger(__name__)

PACKED_TYPES = {"Q4_0": (18, LayerFormat(4, 32, True)), "Q4_1": (20, LayerFormat(4, 32, False)),
                "Q8_0": (34, LayerFormat(8, 32, True))}
FLOAT_TYPES = ("F32", "F16", "BF16")


def _owned_bytes(raw: np.ndarray) -> np.ndarray:
    """raw as a flat writable uint8 array: raw itself when it is one (no copy), else a copy (read-only memmaps)."""
    if isinstance(raw, np.ndarray) and raw.dtype == np.uint8 and raw.flags.writeable and raw.flags.c_contiguous:
        return raw.reshape(-1)
    return np.array(raw, dtype=np.uint8, copy=True).reshape(-1)


def read_tensor_bytes(t: GGUFTensor, f: BinaryIO) -> np.ndarray:
    """A tensor's raw bytes read from the open file `f` into a new uint8 array, without touching the reader's
    memmap (whose pages, once read, would stay resident beside the copy until the map is closed: llama.cpp keeps
    only the map; we keep only the copy). Falls back to copying `t.data` when it is not a view of a file memmap."""
    root = t.data
    while isinstance(root.base, np.ndarray):
        root = root.base
    if not isinstance(root, np.memmap) or root.offset != 0:
        return _owned_bytes(t.data)
    offset = t.data.ctypes.data - root.ctypes.data  # where the tensor starts in the file (the map starts at 0)
    out = np.empty(t.data.nbytes, dtype=np.uint8)
    f.seek(offset)
    if f.readinto(memoryview(out)) != out.nbytes:
        raise ValueError(f"tensor {t.name}: the file ends before its {out.nbytes} bytes")
    return out


def unpack_gguf_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> dict[str, Tensor]:
    """Raw GGUF blocks of a (rows, cols) matrix -> {qweight, scales[, mins]} in our planes (codes untouched)."""
    block_bytes, _ = PACKED_TYPES[type_name]
    if cols % 32:
        raise ValueError(f"{type_name} tensor with {cols} columns: not a multiple of the 32-weight block")
    data = torch.from_numpy(_owned_bytes(raw))
    expected = rows * (cols // 32) * block_bytes
    if data.numel() != expected:
        raise ValueError(f"{type_name} tensor ({rows}, {cols}) has {data.numel()} bytes, expected {expected}")
    blocks = data.view(rows, cols // 32, block_bytes)  # (N, G, bytes)
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(rows, -1)  # (N, G)
    if type_name == "Q8_0":
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(rows, cols)  # (N, K)
        return {"qweight": q, "scales": d.float()}
    out = {"qweight": blocks[..., -16:].reshape(rows, cols // 2).contiguous(), "scales": d}  # (N, K/2)
    if type_name == "Q4_1":
        out["mins"] = blocks[..., 2:4].contiguous().view(torch.float16).view(rows, -1)
    return out


def raw_gguf_rows(raw: np.ndarray, type_name: str, rows: int, cols: int) -> Tensor:
    """Raw GGUF blocks of a (rows, cols) matrix of a raw type -> uint8 (rows, row_bytes), the bytes unchanged (a
    view of `raw` when it is a writable uint8 array, else a copy)."""
    fmt = LayerFormat.gguf(type_name)
    fmt.check(cols, f"{type_name} tensor")
    data = _owned_bytes(raw)
    expected = rows * fmt.row_bytes(cols)
    if data.size != expected:
        raise ValueError(f"{type_name} tensor ({rows}, {cols}) has {data.size} bytes, expected {expected}")
    return torch.from_numpy(data).view(rows, -1)  # (N, row_bytes)


def _is_weight_matrix(rule: Rule, t: GGUFTensor) -> bool:
    """Whether the rule's outputs are linear / embedding weights (not norms, biases or positions) of a 2-D tensor
    or a stack of them (llama.cpp's (E, F, D) experts: rows of the flattened (E * F, D) matrix)."""
    return len(t.shape) >= 2 and all(o.endswith(".weight") and o != "pos_embeddings.weight" and "norm" not in o
                                     for o in rule.ours)


def plan_tensors(rules: list[Rule], tensors: dict[str, GGUFTensor], source: str, device: str) -> dict[str, str]:
    """How each file tensor is loaded: "planes" (Q4_0/Q4_1/Q8_0), "raw" (`GGUF_RAW_TYPES`) or "float" (float
    types; quantized tensors under a transform that is not a row move). Raises CheckpointError naming every tensor
    that cannot be loaded so (type with no packed form, a row length the type's blocks do not divide, a raw type
    without a CPU kernel in this build) before any weight is read."""
    plan, problems, raw_types = {}, [], {}
    for rule in rules:
        t = tensors[rule.theirs]
        name = t.type_name
        matrix = _is_weight_matrix(rule, t)
        if name in FLOAT_TYPES:
            plan[rule.theirs] = "float"
        elif name not in PACKED_TYPES and name not in GGUF_RAW_TYPES:
            problems.append(f"{rule.theirs} ({name}: no packed form; kept packed: "
                            f"{', '.join([*PACKED_TYPES, *GGUF_RAW_TYPES])})")
        elif not (matrix and rule.rows):
            plan[rule.theirs] = "float"  # a quantized norm, or a transform beyond moving rows: dequantized
            log.info("%s: tensor %s (%s) is dequantized: %s", source, rule.theirs, name,
                     "not a weight matrix" if not matrix else "its transform is not a row move")
        elif name in PACKED_TYPES:
            plan[rule.theirs] = "planes"
        else:
            try:
                LayerFormat.gguf(name).check(t.shape[-1], rule.theirs)
            except ValueError as e:
                problems.append(str(e))
                continue
            plan[rule.theirs] = "raw"
            raw_types[rule.theirs] = name
    if problems:
        raise CheckpointError(f"{source}: cannot keep these tensors packed: " + "; ".join(problems[:8]) +
                              (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))
    try:
        kernels.check_gguf_kernels(raw_types, device)
    except ValueError as e:
        raise CheckpointError(f"{source}: {e}") from None
    return plan


def _module(ours: str) -> str:
    module = ours.removesuffix(".weight")
    return HEAD if module == "lm_head" else module


def _load_tensor(rule: Rule, t: GGUFTensor, kind: str, f: BinaryIO, state: dict[str, Tensor],
                 layout: dict[str, LayerFormat], dtype: torch.dtype) -> None:
    """One file tensor into `state` (and its modules' formats into `layout`) as `plan_tensors` decided."""
    if kind == "float":
        for ours, v in rule.to_ours(dequantize(t.data, t.type_name, t.shape)):
            state[ours] = v.to(dtype)
        return
    raw = read_tensor_bytes(t, f)
    rows, cols = math.prod(t.shape[:-1]), t.shape[-1]  # a stacked (E, F, D) tensor as its (E * F, D) rows
    if kind == "planes":
        planes, fmt = unpack_gguf_blocks(raw, t.type_name, rows, cols), PACKED_TYPES[t.type_name][1]
    else:
        planes, fmt = {"qweight": raw_gguf_rows(raw, t.type_name, rows, cols)}, LayerFormat.gguf(t.type_name)
    del raw
    parts = {k: rule.to_ours(v) for k, v in planes.items()}  # rows move or split, codes and blocks do not change
    for i, ours in enumerate(rule.ours):
        module = _module(ours)
        layout[module] = fmt
        for key, pieces in parts.items():
            state[f"{module}.{key}"] = pieces[i][1].contiguous()


def load_gguf_packed(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
                     ) -> LoadedModel:
    """A GGUF of any supported family as a `QuantizedTransformerLM` whose quantized weights stay packed, each in
    its own type (see the module docstring); float tensors (norms) in `dtype`."""
    path = require_file(Path(path), "GGUF file")
    try:
        meta, tensors = read_gguf(path)
    except (ValueError, OSError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    check_types(tensors, path)  # every type readable at all (the float loader's check), before any work
    config, _ = config_from_gguf(meta, tensors, str(path))
    rules = gguf_rules(meta, config, tensors, str(path))
    check_gguf_finite(tensors, path)  # NaN/Inf floats and quantized blocks' scales, before any work
    check_memory(sum(t.data.nbytes for t in tensors.values()), str(path), dtype, device)  # packed: ~ the file
    plan = plan_tensors(rules, tensors, str(path), torch.device(device).type)
    state: dict[str, Tensor] = {}
    layout: dict[str, LayerFormat] = {}
    with open(path, "rb", buffering=0) as f:
        for rule in tqdm(rules, desc="reading GGUF (packed)", unit="tensor", leave=False, disable=None):
            t = tensors[rule.theirs]
            try:
                _load_tensor(rule, t, plan[rule.theirs], f, state, layout, dtype)
            except ValueError as e:
                raise CheckpointError(f"{path}: tensor {rule.theirs}: {e}") from None
    del tensors  # the reader's memmap
    if EMBEDDING in layout and config.tie_embeddings:  # the tied head computes with the packed embedding
        layout[HEAD] = layout[EMBEDDING]
        for key in ("qweight", "scales", "mins"):
            if f"{EMBEDDING}.{key}" in state:
                state[f"{HEAD}.{key}"] = state[f"{EMBEDDING}.{key}"]
    kinds = sorted({f.describe() for f in layout.values()})
    with torch.device("meta"):
        model = QuantizedTransformerLM(config, layout, scheme_name="gguf:" + ",".join(kinds), dtype=dtype)
    try:
        model.load_state_dict(state, strict=True, assign=True)
        model.requires_grad_(False)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit the model config ({e})") from None
    log.info("loaded GGUF %s packed: %d packed modules (%s), %.1f MiB", path.name, len(layout), ", ".join(kinds),
             model.weight_bytes() / 2**20)
    has_tokens = "tokenizer.ggml.tokens" in meta
    tokenizer = optional_tokenizer("formats.from_gguf", path, meta) if has_tokens else None
    return LoadedModel(model.to(device=device, dtype=dtype).eval(), tokenizer, config)
