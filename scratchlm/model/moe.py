"""The mixture-of-experts feed-forward: a router picks `top_k` of `n_experts` gated MLPs per token, whose outputs
are summed with the router's weights, plus shared experts every token uses (`config.MoEFeatures`).

Routing (`route`), in float32 whatever the model's dtype, as the HF models do:

    logits = x Wg^T (+ router bias: gpt-oss)                           (N, E)
    scores = softmax(logits) | sigmoid(logits)                         (N, E)
             (gpt-oss's topk_softmax: ids = topk(logits, top_k), weights = softmax of those k logits; nothing
             below but norm_topk and routed_scale applies)
    choice = scores (+ score_bias: DeepSeek-V3's correction, for the choice only)
    groups (n_groups > 1): a group's score is its best choice (V2) or the sum of its best two (V3); only the experts
             of the `topk_groups` best groups stay eligible (the others' choice is -inf; V2, as HF, zeroes their
             scores instead, which only differs when a kept softmax score underflows to 0)
    ids = topk(choice, top_k)            torch.topk, as HF: ties resolve as its CPU loop does (not always to the
                                         lower id; the fused C++ step calls the same ATen loop)
    weights = scores[ids], / their sum when norm_topk, x routed_scale

The experts run grouped: each expert that any token chose runs once, on all of its tokens (one GEMM per linear
instead of one per token), and its weighted output is added back with `index_add_`, experts in id order (the order
HF sums them in, so the float sums match). A shared expert (DeepSeek; Qwen2-MoE's behind a sigmoid gate) runs on
every token. The experts are `MLP` modules, so every backend that knows an MLP (quantized linears, the engine's
panels) knows an expert; the fused C++ step and expert parallelism read `experts`, `gate` and `route` directly.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from scratchlm.model.config import ModelConfig, MoEFeatures
from scratchlm.model.layers import MLP, Linear


def route(logits: Tensor, f: MoEFeatures, score_bias: Tensor | None = None,
          router_bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Router logits x Wg^T (N, E) -> (weights (N, top_k) float32, expert ids (N, top_k) int64); `router_bias` (E,)
    is added to the logits first; see the module docstring."""
    if router_bias is not None:
        logits = logits + router_bias
    logits = logits.float()
    if f.scoring == "topk_softmax":  # gpt-oss: the chosen k logits' own softmax
        top, ids = logits.topk(f.top_k, dim=-1)
        weights = top.softmax(dim=-1)
        if f.norm_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * f.routed_scale if f.routed_scale != 1.0 else weights), ids
    scores = logits.softmax(dim=-1) if f.scoring == "softmax" else logits.sigmoid()
    choice = scores if score_bias is None else scores + score_bias.float()
    if f.n_groups > 1:
        n = choice.shape[0]
        grouped = choice.view(n, f.n_groups, f.n_experts // f.n_groups)  # (N, G, E / G); N may be 0
        group_scores = grouped.max(dim=-1).values if f.group_score == "max" else grouped.topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(f.topk_groups, dim=-1)[1], 1.0)
        mask = keep.bool()[:, :, None].expand_as(grouped).reshape(n, f.n_experts)  # (N, E)
        if f.group_score == "max" and score_bias is None:
            # DeepSeek-V2's group_limited_greedy zeroes the other groups' scores, weights included: an expert whose
            # softmax score underflowed to 0 then ties with them, and topk picks among the same ties as HF's
            scores = choice = scores.masked_fill(~mask, 0.0)
        else:
            choice = choice.masked_fill(~mask, float("-inf"))
    ids = choice.topk(f.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if f.norm_topk:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if f.scoring == "sigmoid" else 0.0))
    if f.routed_scale != 1.0:
        weights = weights * f.routed_scale
    return weights, ids


class MoE(nn.Module):
    """Routed experts plus optional shared expert: x (..., d_model) -> (..., d_model). Parameters: `gate.weight`
    (E, d_model), `router_bias` (E,) and `score_bias` (E,) when the features have them, `experts.{e}` (MLP of width
    d_expert, with the `mlp` features' activation, biases and clamped SwiGLU), `shared` (MLP of width d_shared) and
    `shared_gate.weight` (1, d_model) when the features have them."""

    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        c, f = config, config.moe
        self.features, self.act = f, c.mlp.act
        self.gate = Linear(c.d_model, f.n_experts, device=device, dtype=dtype)
        self.score_bias = (nn.Parameter(torch.zeros(f.n_experts, device=device, dtype=torch.float32),
                                        requires_grad=False) if f.score_bias else None)
        self.router_bias = (nn.Parameter(torch.zeros(f.n_experts, device=device, dtype=dtype))
                            if f.router_bias else None)
        m = c.mlp  # the experts' activation, biases and gpt-oss's clamped SwiGLU
        kw = dict(device=device, dtype=dtype, act=m.act, bias=m.bias, swiglu_alpha=m.swiglu_alpha,
                  swiglu_limit=m.swiglu_limit)
        self.experts = nn.ModuleList(MLP(c.d_model, c.d_expert, **kw) for _ in range(f.n_experts))
        self.shared = MLP(c.d_model, f.d_shared, **kw) if f.d_shared else None
        self.shared_gate = Linear(c.d_model, 1, device=device, dtype=dtype) if f.shared_gate else None

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x (N, d_model) -> (weights (N, top_k) float32, ids (N, top_k))."""
        return route(self.gate(x), self.features, self.score_bias, self.router_bias)

    def routed(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor:
        """The routed experts' weighted sum for x (N, d_model) and its routing: (N, d_model)."""
        out = torch.zeros_like(x)
        flat = ids.flatten()  # (N * top_k,): token n's j-th choice at n * top_k + j
        order = flat.argsort(stable=True)  # token slots grouped by expert, tokens in order within each
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        w = weights.flatten()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            slots = order[start:start + n]
            start += n
            tokens = slots // ids.shape[1]
            y = self.experts[e](x.index_select(0, tokens))  # (n, d_model)
            out.index_add_(0, tokens, y * w.index_select(0, slots)[:, None].to(y.dtype))
        return out

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # (N, d_model)
        weights, ids = self.route(x)
        out = self.routed(x, weights, ids)
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = torch.sigmoid(self.shared_gate(x)) * s
            out = out + s
        return out.view(shape)

    def extra_repr(self) -> str:
        f = self.features
        return f"experts={f.n_experts}, top_k={f.top_k}, scoring={f.scoring}"
