"""State dicts named as in Stanford CS336 assignment 1, loaded into (and exported from) `TransformerLM`.

CS336's `TransformerLM` is the same architecture as scratchlm's with `ModelConfig.cs336(...)` (adjacent RoPE
pairs, untied head, SwiGLU w1/w2/w3, pre-norm RMSNorm); only the parameter names differ:

| CS336 name                         | scratchlm name                     |
|------------------------------------|------------------------------------|
| `token_embeddings.weight`          | `tok_embeddings.weight`            |
| `layers.{i}.ln1.weight`            | `layers.{i}.attn_norm.weight`      |
| `layers.{i}.attn.q_proj.weight`    | `layers.{i}.attn.q_proj.weight`    |
| `layers.{i}.attn.k_proj.weight`    | `layers.{i}.attn.k_proj.weight`    |
| `layers.{i}.attn.v_proj.weight`    | `layers.{i}.attn.v_proj.weight`    |
| `layers.{i}.attn.output_proj.weight` | `layers.{i}.attn.o_proj.weight`  |
| `layers.{i}.ln2.weight`            | `layers.{i}.ffn_norm.weight`       |
| `layers.{i}.ffn.w1.weight` (gate)  | `layers.{i}.ffn.w1.weight`         |
| `layers.{i}.ffn.w2.weight` (down)  | `layers.{i}.ffn.w2.weight`         |
| `layers.{i}.ffn.w3.weight` (up)    | `layers.{i}.ffn.w3.weight`         |
| `ln_final.weight`                  | `norm.weight`                      |
| `lm_head.weight`                   | `lm_head.weight` (absent when tied)|

Tensors are the same layout on both sides (Linear weights are (out, in); q/k/v rows are heads in order), so
the map is names only. A single block's names (without `layers.{i}.`, as CS336's `run_transformer_block`
passes them) map the same way. A `torch.compile` / DDP prefix (`_orig_mod.`, `module.`) is stripped on the way in.

    from scratchlm.model.loading.cs336 import load_cs336
    model = load_cs336(torch.load("cs336_ckpt.pt")["model"], num_heads=16, rope_theta=10_000.0)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from scratchlm.model.config import ModelConfig
from scratchlm.model.loading.checkpoint import _strip  # torch.compile / DDP prefixes, as scratchlm checkpoints
from scratchlm.model.loading.common import CheckpointError, build_model
from scratchlm.model.transformer import TransformerLM

# (CS336 name, scratchlm name); "{i}" is a layer index.
CS336_KEY_MAP: tuple[tuple[str, str], ...] = (
    ("token_embeddings.weight", "tok_embeddings.weight"),
    ("layers.{i}.ln1.weight", "layers.{i}.attn_norm.weight"),
    ("layers.{i}.attn.q_proj.weight", "layers.{i}.attn.q_proj.weight"),
    ("layers.{i}.attn.k_proj.weight", "layers.{i}.attn.k_proj.weight"),
    ("layers.{i}.attn.v_proj.weight", "layers.{i}.attn.v_proj.weight"),
    ("layers.{i}.attn.output_proj.weight", "layers.{i}.attn.o_proj.weight"),
    ("layers.{i}.ln2.weight", "layers.{i}.ffn_norm.weight"),
    ("layers.{i}.ffn.w1.weight", "layers.{i}.ffn.w1.weight"),
    ("layers.{i}.ffn.w2.weight", "layers.{i}.ffn.w2.weight"),
    ("layers.{i}.ffn.w3.weight", "layers.{i}.ffn.w3.weight"),
    ("ln_final.weight", "norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
)



def _compile(pattern: str) -> re.Pattern[str]:
    return re.compile(re.escape(pattern).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_BLOCK = "layers.{i}."
# A block's own state dict (CS336's `run_transformer_block` weights, `TransformerBlock.state_dict()`) has the
# per-layer names without the `layers.{i}.` prefix.
_BLOCK_MAP = [(c[len(_BLOCK):], s[len(_BLOCK):]) for c, s in CS336_KEY_MAP if c.startswith(_BLOCK)]
_FROM_CS336 = [(_compile(c), s) for c, s in [*CS336_KEY_MAP, *_BLOCK_MAP]]
_TO_CS336 = [(_compile(s), c) for c, s in [*CS336_KEY_MAP, *_BLOCK_MAP]]


def _rename(name: str, table: list[tuple[re.Pattern[str], str]], known: list[str], what: str) -> str:
    for pattern, target in table:
        m = pattern.match(name)
        if m:
            return target.replace("{i}", m.group("i")) if "i" in m.groupdict() else target
    raise CheckpointError(f"{name!r} is not a {what} parameter name (expected one of: {', '.join(known)})")


def cs336_key_to_scratchlm(name: str) -> str:
    """`layers.3.attn.output_proj.weight` -> `layers.3.attn.o_proj.weight`, `ln1.weight` -> `attn_norm.weight`
    (prefixes such as `_orig_mod.` dropped)."""
    return _rename(_strip(name), _FROM_CS336, [c for c, _ in CS336_KEY_MAP], "CS336 TransformerLM")


def scratchlm_key_to_cs336(name: str) -> str:
    """`layers.3.attn.o_proj.weight` -> `layers.3.attn.output_proj.weight`. q/k/v biases have no CS336 name."""
    return _rename(_strip(name), _TO_CS336, [s for _, s in CS336_KEY_MAP], "CS336-compatible scratchlm")


def from_cs336_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A CS336-named state dict renamed to scratchlm's names (the tensors are shared, not copied)."""
    out: dict[str, Tensor] = {}
    for name, t in state.items():
        ours = cs336_key_to_scratchlm(name)
        if ours in out:
            raise CheckpointError(f"two CS336 tensors map to {ours!r} (one of them is {name!r})")
        out[ours] = t
    return out


def to_cs336_state_dict(model_or_state: TransformerLM | Mapping[str, Tensor]) -> dict[str, Tensor]:
    """scratchlm names -> CS336 names. A tied model gets `lm_head.weight` = the embedding (CS336 always has a
    separate head), so the result loads into CS336's own `TransformerLM`."""
    state = model_or_state.state_dict() if isinstance(model_or_state, torch.nn.Module) else model_or_state
    out = {scratchlm_key_to_cs336(n): t for n, t in state.items()}
    if "lm_head.weight" not in out and "token_embeddings.weight" in out:
        out["lm_head.weight"] = out["token_embeddings.weight"]
    return out


def cs336_config(state: Mapping[str, Tensor], num_heads: int, context_length: int = 256,
                 rope_theta: float = 10_000.0, **overrides: Any) -> ModelConfig:
    """`ModelConfig.cs336(...)` with vocab_size, d_model, num_layers and d_ff read from the tensor shapes of a
    CS336-named state dict; the head count, context length and RoPE base are not in the tensors."""
    ours = from_cs336_state_dict(state)
    for need in ("tok_embeddings.weight", "layers.0.ffn.w1.weight"):
        if need not in ours:
            raise CheckpointError(f"CS336 state dict has no {scratchlm_key_to_cs336(need)!r}: cannot infer the shape")
    vocab_size, d_model = ours["tok_embeddings.weight"].shape
    d_ff = ours["layers.0.ffn.w1.weight"].shape[0]
    layers = {int(m.group(1)) for n in ours if (m := re.match(r"layers\.(\d+)\.", n))}
    return ModelConfig.cs336(vocab_size=int(vocab_size), context_length=context_length, d_model=int(d_model),
                             num_layers=max(layers) + 1, num_heads=num_heads, d_ff=int(d_ff),
                             rope_theta=rope_theta, **overrides)


def load_cs336_state_dict(model: TransformerLM, state: Mapping[str, Tensor], strict: bool = True,
                          assign: bool = False):
    """`model.load_state_dict` for a CS336-named state dict; returns what `load_state_dict` returns.

    Into a tied model (`tie_embeddings=True`) the CS336 `lm_head.weight` is accepted only if it equals the
    token embedding; otherwise the error says to build the model with `ModelConfig.cs336(...)` (untied).
    """
    ours = from_cs336_state_dict(state)
    if model.lm_head is None:
        _drop_tied_head(ours)
    return model.load_state_dict(ours, strict=strict, assign=assign)


def _drop_tied_head(ours: dict[str, Tensor]) -> None:
    """Remove `lm_head.weight` for a tied model, which is only right when it equals the embedding."""
    head = ours.pop("lm_head.weight", None)
    emb = ours.get("tok_embeddings.weight")
    if head is not None and (emb is None or head.shape != emb.shape or not torch.equal(head.to(emb.device), emb)):
        raise CheckpointError("CS336 state dict has its own lm_head.weight but the model ties the head to the "
                              "embedding; build it with ModelConfig.cs336(...) (tie_embeddings=False)")


def load_cs336(state: Mapping[str, Tensor], num_heads: int, context_length: int = 256, rope_theta: float = 10_000.0,
               dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               **overrides: Any) -> TransformerLM:
    """A `TransformerLM` built from a CS336-named state dict (config from `cs336_config`), on the meta device
    and filled in place; shape mismatches raise CheckpointError naming the tensor."""
    config = cs336_config(state, num_heads, context_length, rope_theta, **overrides)
    ours = from_cs336_state_dict(state)
    if config.tie_embeddings:
        _drop_tied_head(ours)
    return build_model(config, ours.items(), "CS336 state dict", dtype=dtype, device=device)


__all__ = ["CS336_KEY_MAP", "cs336_config", "cs336_key_to_scratchlm", "from_cs336_state_dict", "load_cs336",
           "load_cs336_state_dict", "scratchlm_key_to_cs336", "to_cs336_state_dict"]
