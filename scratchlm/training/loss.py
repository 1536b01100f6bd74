"""Numerically stable cross-entropy, hand-written with a fused backward.

The forward subtracts the row maximum before exponentiating (log-sum-exp trick), so huge logits
never overflow; the backward is the closed form ``(softmax(logits) - onehot(target)) / N``, using
the softmax that the forward already computed (one exp over (N, V) instead of two: the loss is a
visible part of a CPU step at small model widths).
"""

from __future__ import annotations

import torch


class _CrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # logits (N, V) in any float dtype; the reduction runs in float32 for accuracy.
        x = logits.float()
        row_max = x.amax(dim=-1, keepdim=True)  # (N, 1)
        probs = torch.exp(x - row_max)  # (N, V), unnormalised; every entry <= 1, so no overflow
        total = probs.sum(dim=-1, keepdim=True)  # (N, 1), >= 1
        lse = row_max.squeeze(-1) + torch.log(total.squeeze(-1))  # (N,)
        picked = x.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N,)
        probs.div_(total)  # softmax, kept for the backward
        ctx.save_for_backward(probs, targets)
        ctx.logits_dtype = logits.dtype
        return (lse - picked).mean()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        probs, targets = ctx.saved_tensors
        n = probs.shape[0]
        grad = probs.clone()  # (N, V); the saved softmax stays intact (backward may run twice)
        grad.scatter_add_(-1, targets.unsqueeze(-1), torch.full((n, 1), -1.0, dtype=grad.dtype, device=grad.device))
        grad.mul_(grad_out / n)
        return grad.to(ctx.logits_dtype), None


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of `targets` under `logits` (CS336 `cross_entropy`).

    logits: (..., V) unnormalised scores; targets: (...) integer class ids in [0, V).
    Returns a scalar float32 tensor. Stable for any logit magnitude.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"cross_entropy: logits shape {tuple(logits.shape)} needs targets of shape "
            f"{tuple(logits.shape[:-1])}, got {tuple(targets.shape)}"
        )
    vocab = logits.shape[-1]
    flat_logits = logits.reshape(-1, vocab)  # (N, V)
    flat_targets = targets.reshape(-1).long()  # (N,)
    return _CrossEntropy.apply(flat_logits, flat_targets)


def sum_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Total (not mean) negative log-likelihood in nats, for evaluation; no graph needed."""
    return cross_entropy(logits, targets) * targets.numel()
