"""AdamW, the cosine learning-rate schedule and global-norm gradient clipping, hand-written."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch


class AdamW(torch.optim.Optimizer):
    """Adam with decoupled weight decay (Loshchilov & Hutter), with bias correction.

    Per parameter p with gradient g, at step t (1-based)::

        p <- p - lr * weight_decay * p                   # decoupled: not part of the gradient
        m <- beta1 * m + (1 - beta1) * g
        v <- beta2 * v + (1 - beta2) * g^2
        p <- p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

    This is the update of `torch.optim.AdamW` (the tests use it as the oracle). Use
    :func:`weight_decay_groups` to leave tensors of rank < 2 (norm gains, biases) undecayed.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
    ):
        if lr < 0:
            raise ValueError(f"AdamW: learning rate must be >= 0, got {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW: betas must be in [0, 1), got {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"AdamW: eps and weight_decay must be >= 0, got eps={eps}, weight_decay={weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = state["step"].item()
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if wd != 0:
                    p.mul_(1 - lr * wd)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bias1 = 1 - beta1**t
                bias2_sqrt = math.sqrt(1 - beta2**t)
                denom = (v.sqrt() / bias2_sqrt).add_(eps)
                p.addcdiv_(m, denom, value=-lr / bias1)
        return loss


def weight_decay_groups(named_params: Iterable[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict]:
    """Two parameter groups: rank >= 2 tensors (matrices, embeddings) decayed, the rest (gains, biases) not."""
    decay, no_decay = [], []
    for _, p in named_params:
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def get_lr_cosine_schedule(it: int, max_lr: float, min_lr: float, warmup_iters: int, cosine_cycle_iters: int) -> float:
    """Linear warm-up to `max_lr` over `warmup_iters`, cosine decay to `min_lr` at `cosine_cycle_iters`,
    then `min_lr` (CS336 `get_lr_cosine_schedule`)."""
    if it < warmup_iters:
        return max_lr * it / warmup_iters
    if it <= cosine_cycle_iters:
        span = max(cosine_cycle_iters - warmup_iters, 1)
        progress = (it - warmup_iters) / span
        return min_lr + 0.5 * (1 + math.cos(math.pi * progress)) * (max_lr - min_lr)
    return min_lr


@torch.no_grad()
def gradient_clipping(parameters: Iterable[torch.nn.Parameter], max_l2_norm: float, eps: float = 1e-6) -> torch.Tensor:
    """Scale all gradients in place so that their global L2 norm is at most `max_l2_norm`
    (CS336 `gradient_clipping`). Returns the norm before clipping (float32 scalar)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total = torch.sqrt(sum(g.detach().float().pow(2).sum() for g in grads))
    if total > max_l2_norm:
        scale = max_l2_norm / (total + eps)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return total
