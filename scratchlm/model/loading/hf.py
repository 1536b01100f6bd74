"""Hugging Face directories: config.json + model.safetensors (or a sharded *.safetensors.index.json).

Every family of `model/families/` (Llama, Mistral, Qwen2/3, Gemma 1-3, Phi-3, OLMo-2, Granite, GPT-2, Mixtral,
Qwen2/3-MoE): its config translation and tensor rules (renames, fused-tensor splits, transposes, norm offsets,
stacked experts) do the work; this module only reads files. A family whose files come in more than one layout
(MoE experts per expert, or transformers 5's fused 3D tensors) picks its rules from the file's tensor names
(`Family.hf_rules_for`). HF stores q/k in the rotate-half RoPE layout, so the model uses rope_layout="half".
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import Tensor

from scratchlm.model import families
from scratchlm.model.config import ModelConfig
from scratchlm.model.families import Family, FamilyError, Rule
from scratchlm.model.loading.common import CheckpointError, LoadedModel, build_model, log, optional_tokenizer
from scratchlm.model.loading.guard import (
    check_finite,
    check_layer_count,
    check_path,
    check_shapes,
    hf_field_names,
    safetensors_shapes,
)


def family_of(cfg: dict[str, Any], source: str = "config.json") -> Family:
    """The family (`model/families/`) of an HF config.json dict; unsupported ones are a CheckpointError."""
    try:
        return families.for_hf_config(cfg, source)
    except FamilyError as e:
        raise CheckpointError(str(e)) from None


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate an HF config.json dict into a ModelConfig through its family, rejecting what the model cannot
    express (errors name the field)."""
    try:
        return family_of(cfg, source).config_from_hf(cfg, source)
    except FamilyError as e:
        raise CheckpointError(str(e)) from None


def hf_rules(cfg: dict[str, Any], config: ModelConfig, source: str = "config.json",
             names: Collection[str] | None = None) -> list[Rule]:
    """The tensor rules (file name <-> state-dict names, with transforms) of the HF checkpoint `cfg` describes;
    `names`: the checkpoint's tensors, for a family whose files come in more than one layout (MoE experts)."""
    return family_of(cfg, source).hf_rules_for(config, names)


def hf_name_map(config: ModelConfig, cfg: dict[str, Any] | None = None) -> dict[str, str]:
    """{scratchlm state-dict name: HF name} for the tensors that map one to one (the exporter's family when `cfg`
    is None); fused tensors map each of their parts to the fused name."""
    family = families.for_export(config) if cfg is None else family_of(cfg)
    return {ours: rule.theirs for rule in family.hf_rules(config) for ours in rule.ours}


def weight_files(directory: Path) -> dict[str, Path]:
    """{HF tensor name: safetensors file} from model.safetensors or the sharded index."""
    index = directory / "model.safetensors.index.json"
    single = directory / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = {name: directory / file for name, file in weight_map.items()}
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index}: shard {f.name} is missing")
        return files
    if single.is_file():
        return dict.fromkeys(safetensors_shapes(single), single)
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    if len(others) == 1:
        return dict.fromkeys(safetensors_shapes(directory / others[0]), directory / others[0])
    bins = sorted(p.name for p in directory.glob("*.bin"))
    hint = f" (found {bins}: PyTorch .bin weights are not supported, convert them to safetensors)" if bins else ""
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json{hint}")


def file_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} from the safetensors headers of `files` (no tensor data is read)."""
    headers = {path: safetensors_shapes(path) for path in set(files.values())}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, path in files.items():
        if name not in headers[path]:
            raise CheckpointError(f"{path}: the index lists tensor {name} in this shard, which does not hold it")
        shapes[name] = headers[path][name]
    return shapes


def _weights_label(files: dict[str, Path]) -> str:
    """'model.safetensors', or '3 safetensors shards' for a sharded checkpoint."""
    distinct = set(files.values())
    return next(iter(distinct)).name if len(distinct) == 1 else f"its {len(distinct)} safetensors shards"


def _read_tensors(files: dict[str, Path], rules: list[Rule]) -> Iterator[tuple[str, Tensor]]:
    """Yield (scratchlm name, tensor) through the rules' transforms, opening each shard once (safetensors reads
    through mmap); each file tensor is checked for NaN/Inf first (`guard.check_finite`)."""
    by_file: dict[Path, list[Rule]] = {}
    for rule in rules:
        by_file.setdefault(files[rule.theirs], []).append(rule)
    for path, group in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                for rule in group:
                    t = f.get_tensor(rule.theirs)
                    check_finite(t, rule.theirs, path)
                    yield from rule.to_ours(t)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: could not read tensors ({e})") from None


def checked_rules(directory: Path, cfg: dict[str, Any], config: ModelConfig, source: str = "config.json",
                  files: dict[str, Path] | None = None) -> tuple[list[Rule], dict[str, Path]]:
    """The family's tensor rules for the checkpoint in `directory` and {HF tensor name: safetensors file}, after
    checking, from the safetensors headers alone, that the config's layer count and sizes fit the tensors
    (`guard`: the error names the config.json field), that every rule's tensor is there and that every tensor
    of the checkpoint is read by a rule (a feature the family file does not know would hide in one that is
    not). The whole-model loader and the sharded loader of tensor-parallel ranks both start here."""
    files = weight_files(directory) if files is None else files
    shapes = file_shapes(files)
    fields = hf_field_names(cfg)
    check_layer_count(config.n_layers, fields.get("n_layers", "n_layers"), shapes, source, _weights_label(files))
    rules = hf_rules(cfg, config, source, files)
    present = [r for r in rules if r.theirs in files]
    # sizes first (a wrong expert count also shows as missing tensors: the router's rows name the field)
    check_shapes(config, present, shapes, lambda name: files[name].name, fields, source)
    missing = [r.theirs for r in rules if r.theirs not in files]
    if missing:
        raise CheckpointError(f"{directory}: tensors missing from the checkpoint: {missing[:8]}")
    used = {r.theirs for r in rules}
    ignorable = ("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias")  # buffers old exports carry
    family = family_of(cfg)
    unused = family.hf_unused(cfg) if family.hf_unused is not None else {}
    for prefix, why in unused.items():
        skipped = [n for n in files if n.startswith(prefix) and n not in used]
        if skipped:
            log.info("%s: skipping %d tensors %s* (%s)", directory, len(skipped), prefix, why)
            used.update(skipped)
    extra = sorted(n for n in files if n not in used and not n.endswith(ignorable)
                   and not (config.tie_embeddings and n == "lm_head.weight"))
    if extra:
        raise CheckpointError(f"{directory}: tensors the {family_of(cfg).name} family does not use: {extra[:8]}"
                              f"{' ...' if len(extra) > 8 else ''} (a feature scratchlm does not implement?)")
    return rules, files


class CheckedHF(NamedTuple):
    """An HF directory's config.json, its ModelConfig, the family's tensor rules and {HF tensor name: file}, all
    checked against the safetensors headers (`checked_config`)."""

    hf_config: dict[str, Any]
    config: ModelConfig
    rules: list[Rule]
    files: dict[str, Path]


def checked_config(path: str | Path) -> CheckedHF:
    """Read an HF directory's config.json and check every size it declares against the safetensors headers
    (`guard`): the layer count before the translation (which may build per-layer lists), then every tensor's
    shape. No tensor data is read; what fails names the config.json field and the file. The whole-model loader
    and the tensor-parallel launcher's `read_model_config` both start here."""
    directory = check_path(Path(path))
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json; an HF model directory needs config.json + safetensors")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise CheckpointError(f"{config_path}: expected a JSON object, got {type(hf_config).__name__}")
    files = weight_files(directory)
    layers_key = hf_field_names(hf_config).get("n_layers")
    if layers_key is not None:
        check_layer_count(hf_config[layers_key], layers_key, file_shapes(files), str(config_path),
                          _weights_label(files))
    config = config_from_hf(hf_config, str(config_path))
    rules, files = checked_rules(directory, hf_config, config, str(config_path), files)
    return CheckedHF(hf_config, config, rules, files)


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> LoadedModel:
    """Load an HF model directory (config.json + safetensors) and its tokenizer.json if present.

    The config's sizes are checked against the safetensors headers before anything is built (`checked_config`)."""
    directory = Path(path)
    hf_config, config, rules, files = checked_config(directory)
    features = config.features()
    log.info("loading %s model from %s: %d layers, d_model %d, vocab %d%s", hf_config.get("model_type"), directory,
             config.n_layers, config.d_model, config.vocab_size,
             f"; features: {', '.join(features)}" if features else "")
    model = build_model(config, _read_tensors(files, rules), str(directory), dtype, device, check_finite=False)
    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        tokenizer = optional_tokenizer("formats.load_hf_dir", directory)
    else:
        log.info("%s has no tokenizer.json: tokenizer=None", directory)
    return LoadedModel(model, tokenizer, config)
