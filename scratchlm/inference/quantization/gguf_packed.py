"""Load a GGUF file keeping its Q8_0 / Q4_0 / Q4_1 weights packed (no dequantization at load).

The raw blocks are read with the lean reader (`model/loading/gguf_reader.py`, the float loader's) and split into
planes without touching the 4-/8-bit codes (`scheme.py` formats):

- Q4_0 block (18 bytes: fp16 d, 16 bytes of nibbles)  -> int4 symmetric g32:  w = d (q - 8)
- Q4_1 block (20 bytes: fp16 d, fp16 m, 16 bytes)     -> int4 asymmetric g32: w = d q + m
- Q8_0 block (34 bytes: fp16 d, 32 x int8)            -> int8 g32 (d widened to float32 exactly)

The nibble order inside a block is GGUF's, which is the layout our kernels read, so the codes are
copied byte for byte. Tensors of any other type (F32 norms, K-quants) are dequantized as usual.
SmolLM2-135M ships Q4_1 linears and a Q8_0 token embedding that is also its (tied) output head:
both the lookup and the head then use the same packed Q8_0 tensors.
"""

from __future__ import annotations

import logging
import struct
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from scratchlm.inference.quantization.modules import EMBEDDING, HEAD, QuantizedTransformerLM
from scratchlm.inference.quantization.scheme import LayerFormat
from scratchlm.model.loading.common import CheckpointError, LoadedModel, optional_tokenizer, require_file
from scratchlm.model.loading.dequant import dequantize
from scratchlm.model.loading.gguf_file import config_from_gguf, gguf_rules
from scratchlm.model.loading.gguf_reader import read_gguf

log = logging.getLogger(__name__)

PACKED_TYPES = {"Q4_0": (18, LayerFormat(4, 32, True)), "Q4_1": (20, LayerFormat(4, 32, False)),
                "Q8_0": (34, LayerFormat(8, 32, True))}


def unpack_gguf_blocks(raw: np.ndarray, type_name: str, rows: int, cols: int) -> dict[str, Tensor]:
    """Raw GGUF blocks of a (rows, cols) matrix -> {qweight, scales[, mins]} in our planes (codes untouched)."""
    block_bytes, _ = PACKED_TYPES[type_name]
    if cols % 32:
        raise ValueError(f"{type_name} tensor with {cols} columns: not a multiple of the 32-weight block")
    data = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True).reshape(-1))
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


def load_gguf_packed(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
                     ) -> LoadedModel:
    """A GGUF of any supported family as a `QuantizedTransformerLM` whose Q8_0/Q4_0/Q4_1 linears stay packed.

    The family's tensor rules (`model/families/`) name and transform the tensors; a rule that only moves or
    splits rows (q/k unpermutes, fused q/k/v splits) applies to the packed planes as they are, any other
    transform (a transposed or offset tensor) gets the tensor dequantized first."""
    path = require_file(Path(path), "GGUF file")
    try:
        meta, tensors = read_gguf(path)
    except (ValueError, OSError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    config, _ = config_from_gguf(meta, tensors, str(path))
    rules = gguf_rules(meta, config, tensors, str(path))
    state: dict[str, Tensor] = {}
    layout: dict[str, LayerFormat] = {}
    for rule in tqdm(rules, desc="reading GGUF (packed)", unit="tensor", leave=False, disable=None):
        t = tensors[rule.theirs]
        shape, type_name = t.shape, t.type_name  # shape: (rows, cols)
        linear = all(o.endswith(".weight") and o not in ("norm.weight", "pos_embeddings.weight")
                     and "norm" not in o for o in rule.ours)
        if type_name in PACKED_TYPES and len(shape) == 2 and linear and rule.rows:
            try:
                planes = unpack_gguf_blocks(t.data, type_name, *shape)
            except ValueError as e:
                raise CheckpointError(f"{path}: tensor {rule.theirs}: {e}") from None
            parts = {k: rule.to_ours(v) for k, v in planes.items()}  # rows move or split, codes do not change
            for i, ours in enumerate(rule.ours):
                module = ours.removesuffix(".weight")
                module = HEAD if module == "lm_head" else module
                layout[module] = PACKED_TYPES[type_name][1]
                for key, pieces in parts.items():
                    state[f"{module}.{key}"] = pieces[i][1].contiguous()
            continue
        try:
            w = dequantize(t.data, type_name, shape)
        except ValueError as e:
            raise CheckpointError(f"{path}: tensor {rule.theirs}: {e}") from None
        for ours, v in rule.to_ours(w):
            state[ours] = v.to(dtype)
    if EMBEDDING in layout and config.tie_embeddings:  # the tied head computes with the packed embedding
        layout[HEAD] = layout[EMBEDDING]
        for key in ("qweight", "scales", "mins"):
            if f"{EMBEDDING}.{key}" in state:
                state[f"{HEAD}.{key}"] = state[f"{EMBEDDING}.{key}"]
    kinds = sorted({f"int{f.bits}-g{f.group_size}-{'sym' if f.symmetric else 'asym'}" for f in layout.values()})
    with torch.device("meta"):
        model = QuantizedTransformerLM(config, layout, scheme_name="gguf:" + ",".join(kinds), dtype=dtype)
    try:
        model.load_state_dict(state, strict=True, assign=True)
        model.requires_grad_(False)
    except RuntimeError as e:
        raise CheckpointError(f"{path}: weights do not fit the model config ({e})") from None
    log.info("loaded GGUF %s packed: %d packed modules (%s)", path.name, len(layout), ", ".join(kinds))
    has_tokens = "tokenizer.ggml.tokens" in meta
    tokenizer = optional_tokenizer("formats.from_gguf", path, meta) if has_tokens else None
    return LoadedModel(model.to(device=device, dtype=dtype).eval(), tokenizer, config)
