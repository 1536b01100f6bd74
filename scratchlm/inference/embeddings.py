"""Embeddings: one vector per token sequence, pooled from a causal LM's final hidden states.

Policy: the vector of a sequence is taken from the model's final hidden states *after* the final norm
(``model.norm(model.hidden_states(tokens))``: what the LM head reads), pooled over the sequence:

- ``"last"``: the last token's state (in a causal model the only one that has seen the whole input),
- ``"mean"``: the mean over every token's state,

then L2-normalised unless ``normalize=False``. Pooling and normalisation are done in float32 whatever the
model's dtype. Sequences are run padding-free: sequences of equal length are stacked into one forward, each
distinct length is its own forward (no padding, so no attention mask and no pad token can change a vector).
The KV cache is not used: this is a plain forward, outside the engine's scheduler.
"""

from __future__ import annotations

from typing import Any

import torch

POOLINGS = ("last", "mean")
DEFAULT_POOLING = "last"


def check_pooling(pooling: str) -> str:
    """`pooling` when it is one of :data:`POOLINGS`, else a ValueError naming the choices."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}; got {pooling!r}")
    return pooling


@torch.inference_mode()
def embed_tokens(model: Any, token_lists: list[list[int]], pooling: str = DEFAULT_POOLING,
                 normalize: bool = True) -> list[list[float]]:
    """The pooled embedding (a list of floats of the model's width) of each token list, in order.

    `model` is a scratchlm Transformer (``hidden_states`` and ``norm``); each list must be non-empty (the
    caller checks lengths and ids against the model's limits)."""
    check_pooling(pooling)
    if any(len(ids) == 0 for ids in token_lists):
        raise ValueError("an embedding input is empty")
    device = next(model.parameters()).device
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(token_lists):
        by_length.setdefault(len(ids), []).append(i)
    out: list[list[float] | None] = [None] * len(token_lists)
    for _, rows in sorted(by_length.items()):
        tokens = torch.tensor([token_lists[i] for i in rows], dtype=torch.long, device=device)
        h = model.norm(model.hidden_states(tokens)).float()  # (B, T, d)
        pooled = h[:, -1] if pooling == "last" else h.mean(dim=1)
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2.0, dim=-1)
        for i, vec in zip(rows, pooled.cpu().tolist()):
            out[i] = vec
    return out  # type: ignore[return-value]
