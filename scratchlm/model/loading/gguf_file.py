"""GGUF files (llama.cpp) through the `gguf` package: llama and qwen2 architectures.

The file is parsed by `gguf_reader` (a lean reader; `gguf.GGUFReader` is ~20x slower on big
vocabularies). Quantized tensors (Q4_0/Q4_1/Q5_x/Q8_0/K-quants) are dequantized to the compute dtype with
`gguf.quants.dequantize`. llama.cpp's converter permutes the q/k rows of llama models into the
adjacent-pair RoPE layout; we undo that so the weights match HF's rotate-half layout exactly.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from tqdm import tqdm

from scratchlm.model.config import ModelConfig
from scratchlm.model.loading.common import (
    CheckpointError,
    LoadedModel,
    build_model,
    log,
    optional_tokenizer,
    require_file,
)
from scratchlm.model.loading.dequant import dequantize
from scratchlm.model.loading.gguf_reader import GGUFTensor, read_gguf

SUPPORTED_ARCHS = ("llama", "qwen2")

_LAYER_NAMES = {  # GGUF blk.{i}.<name> -> scratchlm layers.{i}.<name>
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.q_proj.weight",
    "attn_k.weight": "attn.k_proj.weight",
    "attn_v.weight": "attn.v_proj.weight",
    "attn_output.weight": "attn.o_proj.weight",
    "attn_q.bias": "attn.q_bias",
    "attn_k.bias": "attn.k_bias",
    "attn_v.bias": "attn.v_bias",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "ffn.w1.weight",
    "ffn_down.weight": "ffn.w2.weight",
    "ffn_up.weight": "ffn.w3.weight",
}
_TOP_NAMES = {"token_embd.weight": "tok_embeddings.weight", "output_norm.weight": "norm.weight",
              "output.weight": "lm_head.weight"}


def unpermute_qk(w: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's q/k row permutation: per head, rows (0,1),(2,3).. back to halves (0..D/2, D/2..D).

    Works for weights (n_heads*D, d_in) and biases (n_heads*D,).
    """
    rest = w.shape[1:]
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(w.shape)  # (H, 2, D/2, ...)


def _dequantize(t: GGUFTensor, source: str) -> Tensor:
    """A GGUF tensor as a float tensor of its logical (rows, cols) shape."""
    try:
        return dequantize(t.data, t.type_name, t.shape)
    except ValueError as e:
        raise CheckpointError(f"{source}: tensor {t.name}: {e}") from None


def config_from_gguf(meta: dict[str, Any], names: dict[str, GGUFTensor], source: str) -> tuple[ModelConfig, str]:
    """ModelConfig from GGUF metadata (`<arch>.embedding_length`, ...) and the tensor list."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(f"{source}: architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHS}")
    if "token_embd.weight" not in names:
        raise CheckpointError(f"{source}: no token_embd.weight tensor")

    def need(key: str) -> Any:
        value = meta.get(f"{arch}.{key}")
        if value is None:
            raise CheckpointError(f"{source}: metadata {arch}.{key} is missing")
        return value

    d_model = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    vocab = int(names["token_embd.weight"].shape[0])
    head_dim = int(meta.get(f"{arch}.attention.key_length", 0) or meta.get(f"{arch}.rope.dimension_count",
                                                                             0) or d_model // n_heads)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{source}: RoPE scaling {scaling!r} is not supported")
    config = ModelConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_layers=int(need("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        d_ff=int(need("feed_forward_length")),
        max_seq_len=int(meta.get(f"{arch}.context_length", 2048)),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base", 10_000.0)),
        norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_layout="half",
        tie_embeddings="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names,
        head_dim=head_dim,
    )
    return config, arch


def _tensors(tensors: dict[str, GGUFTensor], config: ModelConfig, arch: str,
             source: str) -> Iterator[tuple[str, Tensor]]:
    for t in tqdm(tensors.values(), desc="dequantizing GGUF", unit="tensor", leave=False, disable=None):
        name, local = t.name, ""
        if name in _TOP_NAMES:
            ours = _TOP_NAMES[name]
        elif name.startswith("blk."):
            _, idx, local = name.split(".", 2)
            if local not in _LAYER_NAMES:
                raise CheckpointError(f"{source}: unexpected tensor {name!r} (not a llama/qwen2 weight)")
            ours = f"layers.{idx}.{_LAYER_NAMES[local]}"
        else:
            raise CheckpointError(f"{source}: unexpected tensor {name!r} (not a llama/qwen2 weight)")
        w = _dequantize(t, source)
        if arch == "llama" and local.startswith(("attn_q.", "attn_k.")):
            w = unpermute_qk(w, config.n_heads if local.startswith("attn_q.") else config.n_kv_heads)
        yield ours, w


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> LoadedModel:
    """Load a llama/qwen2 GGUF file, dequantizing to `dtype`, with the tokenizer from its metadata."""
    path = require_file(Path(path), "GGUF file")
    try:
        meta, tensors = read_gguf(path)
    except (ValueError, OSError, struct.error) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})") from None
    config, arch = config_from_gguf(meta, tensors, str(path))
    log.info("loading GGUF %s (%s): %d layers, d_model %d, vocab %d", path.name, arch, config.n_layers,
             config.d_model, config.vocab_size)
    model = build_model(config, _tensors(tensors, config, arch, str(path)), str(path), dtype, device)
    if "tokenizer.ggml.tokens" in meta:
        tokenizer = optional_tokenizer("formats.from_gguf", path, meta)
    else:
        log.info("%s carries no tokenizer metadata: tokenizer=None", path)
        tokenizer = None
    return LoadedModel(model, tokenizer, config)
