"""Hugging Face directories: config.json + model.safetensors (or a sharded *.safetensors.index.json).

Supported: Llama (incl. SmolLM2), Mistral and Qwen2 configs. HF stores q/k in the rotate-half RoPE
layout, so the model uses rope_layout="half".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from scratchlm.model.config import ModelConfig
from scratchlm.model.loading.common import CheckpointError, LoadedModel, build_model, log, optional_tokenizer

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")

# scratchlm name (with {i} for the layer) <- HF name
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.q_proj.weight": "self_attn.q_proj.weight",
    "attn.k_proj.weight": "self_attn.k_proj.weight",
    "attn.v_proj.weight": "self_attn.v_proj.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn.q_bias": "self_attn.q_proj.bias",
    "attn.k_bias": "self_attn.k_proj.bias",
    "attn.v_bias": "self_attn.v_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "lm_head.weight": "lm_head.weight"}


def hf_name_map(config: ModelConfig) -> dict[str, str]:
    """{scratchlm state-dict name: HF name} for every tensor of `TransformerLM(config)`."""
    names = {k: v for k, v in _TOP_NAMES.items() if k != "lm_head.weight" or not config.tie_embeddings}
    for i in range(config.n_layers):
        for ours, theirs in _LAYER_NAMES.items():
            if ours.endswith("_bias") and not config.qkv_bias:
                continue
            names[f"layers.{i}.{ours}"] = f"model.layers.{i}.{theirs}"
    return names


def _rope_theta(cfg: dict[str, Any], source: str) -> float:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling")
    for spec in (params, scaling or {}):
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind not in ("default", None):
            raise CheckpointError(f"{source}: RoPE scaling {kind!r} is not supported (only plain RoPE)")
    theta = cfg.get("rope_theta", params.get("rope_theta", 10_000.0))
    return float(theta)


def config_from_hf(cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Translate an HF config.json dict into a ModelConfig, rejecting what the model cannot express."""
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_TYPES:
        raise CheckpointError(
            f"{source}: model_type {model_type!r} is not supported; expected one of {list(SUPPORTED_TYPES)}"
        )
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (SwiGLU needs silu)")
    if cfg.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias=true is not supported")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        raise CheckpointError(f"{source}: attention_bias=true (bias on o_proj too) is not supported")
    if model_type == "qwen2" and cfg.get("use_sliding_window"):
        raise CheckpointError(f"{source}: use_sliding_window=true is not supported")
    window = cfg.get("sliding_window")
    max_pos = int(cfg.get("max_position_embeddings", 2048))
    if model_type == "mistral" and window is not None and window < max_pos:
        log.warning("%s: sliding_window=%d ignored: attention is full, which is exact for contexts up to %d tokens",
                    source, window, window)
    try:
        n_heads = int(cfg["num_attention_heads"])
        d_model = int(cfg["hidden_size"])
        return ModelConfig(
            vocab_size=int(cfg["vocab_size"]),
            d_model=d_model,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            d_ff=int(cfg["intermediate_size"]),
            max_seq_len=max_pos,
            rope_theta=_rope_theta(cfg, source),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_layout="half",
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",
            head_dim=int(cfg.get("head_dim") or d_model // n_heads),
        )
    except KeyError as e:
        raise CheckpointError(f"{source}: required field {e.args[0]!r} is missing") from None


def _weight_files(directory: Path) -> dict[str, Path]:
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
        return dict.fromkeys(_safetensors_names(single), single)
    others = sorted(p.name for p in directory.glob("*.safetensors"))
    if len(others) == 1:
        return dict.fromkeys(_safetensors_names(directory / others[0]), directory / others[0])
    bins = sorted(p.name for p in directory.glob("*.bin"))
    hint = f" (found {bins}: PyTorch .bin weights are not supported, convert them to safetensors)" if bins else ""
    raise CheckpointError(f"{directory}: no model.safetensors or model.safetensors.index.json{hint}")


def _safetensors_names(path: Path) -> list[str]:
    try:
        with safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


def _read_tensors(files: dict[str, Path], names: dict[str, str], source: Path) -> Iterator[tuple[str, Tensor]]:
    """Yield (scratchlm name, tensor), opening each shard once (safetensors reads through mmap)."""
    missing = [hf for hf in names.values() if hf not in files]
    if missing:
        raise CheckpointError(f"{source}: tensors missing from the checkpoint: {missing[:8]}")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, theirs in names.items():
        by_file.setdefault(files[theirs], []).append((ours, theirs))
    for path, pairs in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                for ours, theirs in pairs:
                    yield ours, f.get_tensor(theirs)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{path}: could not read tensors ({e})") from None


def load_hf_dir(path: str | Path, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> LoadedModel:
    """Load an HF model directory (config.json + safetensors) and its tokenizer.json if present."""
    directory = Path(path)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{directory}: no config.json; an HF model directory needs config.json + safetensors")
    try:
        hf_config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{config_path}: not valid JSON ({e})") from None
    config = config_from_hf(hf_config, str(config_path))
    files = _weight_files(directory)
    log.info("loading %s model from %s: %d layers, d_model %d, vocab %d", hf_config["model_type"], directory,
             config.n_layers, config.d_model, config.vocab_size)
    model = build_model(config, _read_tensors(files, hf_name_map(config), directory), str(directory), dtype, device)
    tokenizer = None
    if (directory / "tokenizer.json").is_file():
        tokenizer = optional_tokenizer("formats.load_hf_dir", directory)
    else:
        log.info("%s has no tokenizer.json: tokenizer=None", directory)
    return LoadedModel(model, tokenizer, config)
