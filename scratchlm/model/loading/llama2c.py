"""llama2.c legacy `.bin` checkpoints (Karpathy's run.c format) and their `tok*.bin` tokenizer.

Header: 7 little-endian int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len);
a negative vocab_size means the classifier is stored separately (untied). Then fp32 weights:
token embedding, attention norms, wq, wk, wv, wo, ffn norms, w1, w2, w3, final norm, two unused
RoPE tables, [classifier]. RoPE rotates adjacent pairs, so the model uses rope_layout="adjacent".
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from scratchlm.model.config import ModelConfig
from scratchlm.model.loading.common import (
    CheckpointError,
    LoadedModel,
    build_model,
    log,
    optional_tokenizer,
    require_file,
)

HEADER = struct.Struct("<7i")


def read_header(path: Path) -> tuple[ModelConfig, bool]:
    """(config, shared_classifier) from the 7-int header, checked against the file size."""
    size = path.stat().st_size
    if size < HEADER.size:
        raise CheckpointError(f"{path}: {size} bytes is too short for a llama2.c header ({HEADER.size} bytes)")
    with open(path, "rb") as f:
        dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = HEADER.unpack(f.read(HEADER.size))
    shared = vocab > 0
    vocab = abs(vocab)
    values = dict(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                  vocab_size=vocab, seq_len=seq_len)
    if min(values.values()) <= 0 or max(values.values()) > 1 << 20 or dim % n_heads or n_heads % n_kv_heads:
        raise CheckpointError(f"{path}: not a llama2.c checkpoint (implausible header {values}); a .bin model is a "
                              "llama2.c checkpoint (token files from `scratchlm tokenizer encode` are training "
                              "data, for `scratchlm train --train-data`; a llama2.c tokenizer tok*.bin goes to "
                              "--tokenizer)")
    config = ModelConfig(vocab_size=vocab, d_model=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads,
                         d_ff=hidden, max_seq_len=seq_len, rope_theta=10_000.0, norm_eps=1e-5,
                         rope_layout="adjacent", tie_embeddings=shared, qkv_bias=False)
    expected = HEADER.size + 4 * _num_floats(config, shared)
    if size != expected:
        raise CheckpointError(
            f"{path}: file is {size} bytes but the header {values} implies {expected} bytes (truncated or corrupt)"
        )
    return config, shared


def _layout(c: ModelConfig, shared: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each stored array in file order; per-layer arrays have a leading n_layers dim."""
    kv_dim = c.n_kv_heads * c.head_dim
    L, d, h = c.n_layers, c.d_model, c.d_ff
    layout = [
        ("tok_embeddings.weight", (c.vocab_size, d)),
        ("attn_norm.weight", (L, d)),
        ("attn.q_proj.weight", (L, d, d)),
        ("attn.k_proj.weight", (L, kv_dim, d)),
        ("attn.v_proj.weight", (L, kv_dim, d)),
        ("attn.o_proj.weight", (L, d, d)),
        ("ffn_norm.weight", (L, d)),
        ("ffn.w1.weight", (L, h, d)),
        ("ffn.w2.weight", (L, d, h)),
        ("ffn.w3.weight", (L, h, d)),
        ("norm.weight", (d,)),
        ("(rope cos table)", (c.max_seq_len * c.head_dim // 2,)),
        ("(rope sin table)", (c.max_seq_len * c.head_dim // 2,)),
    ]
    if not shared:
        layout.append(("lm_head.weight", (c.vocab_size, d)))
    return layout


def _num_floats(c: ModelConfig, shared: bool) -> int:
    return sum(int(np.prod(shape)) for _, shape in _layout(c, shared))


def _tensors(path: Path, config: ModelConfig, shared: bool) -> Iterator[tuple[str, Tensor]]:
    data = np.memmap(path, dtype="<f4", mode="r", offset=HEADER.size)
    offset = 0
    top = {"tok_embeddings.weight", "norm.weight", "lm_head.weight"}
    for name, shape in _layout(config, shared):
        n = int(np.prod(shape))
        arr = data[offset:offset + n].reshape(shape)
        offset += n
        if name.startswith("("):
            continue
        if name in top:
            yield name, torch.from_numpy(np.array(arr))
        else:
            for i in range(config.n_layers):
                yield f"layers.{i}.{name}", torch.from_numpy(np.array(arr[i]))


def find_tokenizer(path: Path, vocab_size: int) -> Path | None:
    """`tok{vocab}.bin` or `tokenizer.bin` next to the checkpoint."""
    for name in (f"tok{vocab_size}.bin", "tokenizer.bin"):
        candidate = path.parent / name
        if candidate.is_file():
            return candidate
    return None


def load_llama2c(path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 tokenizer_path: str | Path | None = None) -> LoadedModel:
    """Load a llama2.c `.bin` model; the tokenizer is `tok{vocab}.bin`/`tokenizer.bin` next to it."""
    path = require_file(Path(path), "llama2.c checkpoint")
    config, shared = read_header(path)
    log.info("loading llama2.c %s: %d layers, dim %d, vocab %d, %s classifier", path.name, config.n_layers,
             config.d_model, config.vocab_size, "shared" if shared else "separate")
    model = build_model(config, _tensors(path, config, shared), str(path), dtype, device)
    tok_path = Path(tokenizer_path) if tokenizer_path is not None else find_tokenizer(path, config.vocab_size)
    if tok_path is None:
        log.warning("no tok%d.bin or tokenizer.bin next to %s: tokenizer=None", config.vocab_size, path)
        tokenizer = None
    else:
        tokenizer = optional_tokenizer("llama2c.Llama2cTokenizer:from_file", require_file(tok_path, "tokenizer"))
    return LoadedModel(model, tokenizer, config)
