"""GGUF files (llama.cpp) through the `gguf` package: every architecture a family of `model/families/` answers to.

The file is parsed by `gguf_reader` (a lean reader; `gguf.GGUFReader` is ~20x slower on big
vocabularies). Every tensor's type is checked before any is read (`check_types`: a type outside
`dequant.SUPPORTED_TYPES` is a CheckpointError naming the tensor and the type), then quantized tensors
(Q4_0/Q4_1/Q5_x/Q8_0, K-quants, IQ4_NL/IQ4_XS, ...) are dequantized by the torch dequantizers of `dequant.py`
(bit-equal to `gguf.quants`) and cast to the compute dtype. llama.cpp's converter permutes the q/k rows of llama
models into the adjacent-pair RoPE layout; the family's rules undo that so the weights match HF's rotate-half
layout exactly.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from scratchlm.model import families
from scratchlm.model.config import ModelConfig
from scratchlm.model.families import Family, FamilyError, Rule
from scratchlm.model.families.base import GGUF_CONFIG_TENSORS
from scratchlm.model.loading.common import (
    CheckpointError,
    LoadedModel,
    build_model,
    log,
    optional_tokenizer,
    require_file,
)
from scratchlm.model.loading.dequant import SUPPORTED_TYPES, dequantize
from scratchlm.model.loading.gguf_reader import GGUFTensor, read_gguf
from scratchlm.model.loading.guard import check_gguf_finite, check_layer_count, check_shapes, gguf_field_names


def _dequantize(t: GGUFTensor, source: str) -> Tensor:
    """A GGUF tensor as a float tensor of its logical (rows, cols) shape."""
    try:
        return dequantize(t.data, t.type_name, t.shape)
    except ValueError as e:
        raise CheckpointError(f"{source}: tensor {t.name}: {e}") from None


def check_types(tensors: dict[str, GGUFTensor], source: str | Path) -> None:
    """Raise CheckpointError before any work when a tensor has a type scratchlm cannot dequantize.

    The message names the first such tensor and its type, how many others there are, and the supported types.
    Every GGUF loader calls it right after `read_gguf` (the packed loader too: its packed types are a subset)."""
    bad = [(name, t.type_name) for name, t in tensors.items() if t.type_name not in SUPPORTED_TYPES]
    if not bad:
        return
    name, type_name = bad[0]
    more = ""
    if len(bad) > 1:
        others = sorted({t for _, t in bad[1:]})
        more = f" (and {len(bad) - 1} more tensor{'s' * (len(bad) > 2)} of type {', '.join(others)})"
    raise CheckpointError(f"{source}: tensor {name} has type {type_name}, which scratchlm cannot read{more}; "
                          f"supported: {', '.join(SUPPORTED_TYPES)}")


def gguf_family(meta: dict[str, Any], source: str) -> Family:
    """The family of a GGUF file's `general.architecture`; unsupported ones are a CheckpointError."""
    try:
        family = families.for_gguf_arch(meta.get("general.architecture"), source)
    except FamilyError as e:
        raise CheckpointError(str(e)) from None
    if family.config_from_gguf is None or family.gguf_rules is None:
        raise CheckpointError(f"{source}: GGUF files of the {family.name} family are not supported yet")
    return family


def config_from_gguf(meta: dict[str, Any], names: dict[str, GGUFTensor], source: str) -> tuple[ModelConfig, str]:
    """ModelConfig from GGUF metadata (`<arch>.embedding_length`, ...) and the tensor list, and the arch.

    `<arch>.block_count` is checked against the layers the tensor list holds first (`guard.check_layer_count`),
    before the translation builds anything per layer."""
    family = gguf_family(meta, source)
    key = f"{meta.get('general.architecture')}.block_count"
    check_layer_count(meta.get(key), key, names, source, "it")
    try:
        return family.config_from_gguf(meta, names, source), meta["general.architecture"]
    except FamilyError as e:
        raise CheckpointError(str(e)) from None


def gguf_rules(meta: dict[str, Any], config: ModelConfig, tensors: dict[str, GGUFTensor], source: str) -> list[Rule]:
    """The family's tensor rules for this file; tensors the rules do not read, and tensors whose shapes do not fit
    the metadata's sizes (`guard.check_shapes`, naming the metadata key), are errors naming them."""
    rules = gguf_family(meta, source).gguf_rules(config)
    used = {r.theirs for r in rules}
    missing = sorted(used - set(tensors))
    if missing:
        raise CheckpointError(f"{source}: tensors missing from the file: {missing[:8]}")
    tied = {"output.weight"} if config.tie_embeddings else set()
    extra = sorted(set(tensors) - used - set(GGUF_CONFIG_TENSORS) - tied)  # RoPE factors: read into the config
    if extra:
        arch = meta.get("general.architecture")
        raise CheckpointError(f"{source}: unexpected tensors {extra[:8]} (not a weight of this {arch} model)")
    check_shapes(config, rules, {n: t.shape for n, t in tensors.items()}, lambda _: "the file",
                 gguf_field_names(meta), source)
    return rules


def _tensors(tensors: dict[str, GGUFTensor], rules: list[Rule], source: str) -> Iterator[tuple[str, Tensor]]:
    for rule in tqdm(rules, desc="dequantizing GGUF", unit="tensor", leave=False, disable=None):
        yield from rule.to_ours(_dequantize(tensors[rule.theirs], source))


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a GGUF file of any family, dequantizing to `dtype`, with the tokenizer from its metadata."""
    path = require_file(Path(path), "GGUF file")
    try:
        meta, tensors = read_gguf(path)
    except (ValueError, OSError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    check_types(tensors, path)
    config, arch = config_from_gguf(meta, tensors, str(path))
    rules = gguf_rules(meta, config, tensors, str(path))
    check_gguf_finite(tensors, path)
    log.info("loading GGUF %s (%s): %d layers, d_model %d, vocab %d", path.name, arch, config.n_layers,
             config.d_model, config.vocab_size)
    model = build_model(config, _tensors(tensors, rules, str(path)), str(path), dtype, device, check_finite=False)
    if "tokenizer.ggml.tokens" in meta:
        tokenizer = optional_tokenizer("formats.from_gguf", path, meta)
    else:
        log.info("%s carries no tokenizer metadata: tokenizer=None", path)
        tokenizer = None
    return LoadedModel(model, tokenizer, config)
