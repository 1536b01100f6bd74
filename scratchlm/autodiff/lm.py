"""The project's `TransformerLM` (scratchlm.model) written as an autodiff graph.

`build_lm_graph(config)` builds forward + mean cross-entropy from Variables named exactly like the module's
parameters (`model.named_parameters()`), so the same weights feed both. Shapes are dynamic: one graph serves
any batch size and sequence length.

    graph = build_lm_graph(model.config)
    loss, grads = graph.loss_and_grads(params, tokens, targets)      # grads: {param name: tensor}
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from . import nn_ops as nn
from . import ops
from .evaluator import Evaluator, gradients
from .graph import Node, Variable


def lm_parameter_names(config: Any) -> list[str]:
    """The names of TransformerLM's parameters for `config`, in `named_parameters()` order."""
    names = ["tok_embeddings.weight"]
    for i in range(config.n_layers):
        p = f"layers.{i}."
        names.append(p + "attn_norm.weight")
        if config.qkv_bias:
            names += [p + f"attn.{n}_bias" for n in ("q", "k", "v")]
        names += [p + f"attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
        names.append(p + "ffn_norm.weight")
        names += [p + f"ffn.{n}.weight" for n in ("w1", "w2", "w3")]
    names.append("norm.weight")
    if not config.tie_embeddings:
        names.append("lm_head.weight")
    return names


@dataclass
class LMGraph:
    """The LM as a graph: inputs (`tokens`, `targets`, `cos`, `sin`), `params`, `logits`, `loss`, and the
    gradient nodes `grads` (one per parameter, same order as `params`)."""

    config: Any
    tokens: Node
    targets: Node
    cos: Node
    sin: Node
    params: dict[str, Node]
    logits: Node
    loss: Node
    grads: dict[str, Node]
    _evaluator: Evaluator | None = field(default=None, repr=False)

    def feed(self, params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor | None = None,
             positions: torch.Tensor | None = None) -> dict[Node, torch.Tensor]:
        """The Evaluator input dict for parameter tensors `params` (by name) and a (B, T) batch."""
        missing = [n for n in self.params if n not in params]
        if missing:
            raise KeyError(f"parameter tensors missing for {missing}")
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq) ids, got shape {tuple(tokens.shape)}")
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        dtype = params["tok_embeddings.weight"].dtype
        cos, sin = nn.rotary_tables(positions, self.config.head_dim, self.config.rope_theta,
                                    self.config.rope_layout, dtype=dtype)
        values = {self.params[n]: params[n] for n in self.params}
        values.update({self.tokens: tokens, self.cos: cos, self.sin: sin})
        if targets is not None:
            if targets.shape != tokens.shape:
                raise ValueError(f"targets {tuple(targets.shape)} must have the shape of tokens {tuple(tokens.shape)}")
            values[self.targets] = targets
        return values

    def loss_and_grads(self, params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor,
                       positions: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(mean cross-entropy, {parameter name: gradient}) for one batch."""
        if self._evaluator is None:
            self._evaluator = Evaluator([self.loss, *self.grads.values()])
        loss, *grads = self._evaluator.run(self.feed(params, tokens, targets, positions))
        return loss, dict(zip(self.grads, grads))

    def logits_value(self, params: dict[str, torch.Tensor], tokens: torch.Tensor,
                     positions: torch.Tensor | None = None) -> torch.Tensor:
        """Forward only: logits (B, T, vocab)."""
        return Evaluator([self.logits]).run(self.feed(params, tokens, positions=positions))[0]


def build_lm_graph(config: Any, with_grads: bool = True) -> LMGraph:
    """The forward pass and loss of `scratchlm.model.TransformerLM(config)` as an ad graph.

    Pre-norm Llama blocks: x + attn(rmsnorm(x)), then h + swiglu(rmsnorm(h)); GQA with RoPE in the config's
    layout; tied or separate output head; loss = mean cross-entropy over all B*T positions.
    """
    c = config
    params = {name: Variable(name) for name in lm_parameter_names(c)}
    tokens, targets = Variable("tokens"), Variable("targets")
    cos, sin = Variable("rope_cos"), Variable("rope_sin")
    n_rep = c.n_heads // c.n_kv_heads
    scale = 1.0 / math.sqrt(c.head_dim)

    x = nn.embedding(params["tok_embeddings.weight"], tokens)  # (B, T, d)
    for i in range(c.n_layers):
        p = f"layers.{i}."
        h = nn.rmsnorm(x, params[p + "attn_norm.weight"], c.norm_eps)

        def project(name: str, heads: int, h: Node = h, p: str = p) -> Node:
            bias = params.get(p + f"attn.{name}_bias")
            return nn.split_heads(nn.linear(h, params[p + f"attn.{name}_proj.weight"], bias), heads)  # (B, T, h, D)

        q = nn.rotary(project("q", c.n_heads), cos, sin, c.rope_layout)  # (B, T, H, D)
        k = nn.rotary(project("k", c.n_kv_heads), cos, sin, c.rope_layout)  # (B, T, Hkv, D)
        v = project("v", c.n_kv_heads)  # (B, T, Hkv, D)
        q = ops.transpose(q, 1, 2)  # (B, H, T, D)
        k = ops.transpose(nn.repeat_kv(k, n_rep), 1, 2)  # (B, H, T, D)
        v = ops.transpose(nn.repeat_kv(v, n_rep), 1, 2)  # (B, H, T, D)
        scores = ops.mul_by_const(ops.matmul(q, ops.transpose(k, -1, -2)), scale)  # (B, H, T, T)
        probs = ops.softmax(nn.causal_mask(scores), -1)
        out = nn.merge_heads(ops.transpose(ops.matmul(probs, v), 1, 2))  # (B, T, H*D)
        x = ops.add(x, nn.linear(out, params[p + "attn.o_proj.weight"]))
        h = nn.rmsnorm(x, params[p + "ffn_norm.weight"], c.norm_eps)
        gate = nn.silu(nn.linear(h, params[p + "ffn.w1.weight"]))
        up = nn.linear(h, params[p + "ffn.w3.weight"])
        x = ops.add(x, nn.linear(ops.mul(gate, up), params[p + "ffn.w2.weight"]))
    head = params["tok_embeddings.weight"] if c.tie_embeddings else params["lm_head.weight"]
    logits = nn.linear(nn.rmsnorm(x, params["norm.weight"], c.norm_eps), head)  # (B, T, V)
    loss = nn.cross_entropy(logits, targets)
    grads = dict(zip(params, gradients(loss, list(params.values())))) if with_grads else {}
    return LMGraph(c, tokens, targets, cos, sin, params, logits, loss, grads)


def model_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters as plain tensors (detached: the engine never touches autograd)."""
    return {name: p.detach() for name, p in model.named_parameters()}
