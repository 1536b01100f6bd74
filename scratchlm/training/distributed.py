"""Data parallelism with torch.distributed, launched with `torchrun` (gloo on CPU, NCCL on CUDA).

Each process holds a full replica. All ranks draw the same global batch of windows (one seeded
sampler) and each computes gradients on its own slice; the gradients are averaged with one
all-reduce over a flat buffer before clipping and the optimizer step, so a run on N processes
follows the single-process run at the same global batch (up to float summation order).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistContext:
    """Where this process sits: rank, world size, local rank (for the CUDA device)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str) -> DistContext:
    """Join the process group that `torchrun` describes in the environment (WORLD_SIZE, RANK, ...);
    a plain single-process context when WORLD_SIZE is absent or 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend)
    return DistContext(rank=rank, world_size=world, local_rank=local_rank)


def shutdown_distributed(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


@torch.no_grad()
def all_reduce_gradients(params: list[torch.nn.Parameter], ctx: DistContext) -> None:
    """Average `.grad` over all ranks with one all-reduce of a flat buffer."""
    if not ctx.enabled:
        return
    grads = [p.grad for p in params if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])  # (sum of numels,)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat.div_(ctx.world_size)
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def all_reduce_sum(t: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum of `t` over ranks (a new tensor on `t`'s device; `t` itself on one process). NCCL only
    reduces CUDA tensors, so a CPU tensor (a loss sum, evaluation counters) travels through the GPU."""
    if not ctx.enabled:
        return t
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    out = t.to(device, copy=True)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out.to(t.device)


def broadcast_parameters(model: torch.nn.Module, ctx: DistContext) -> None:
    """Make every rank start from rank 0's weights."""
    if not ctx.enabled:
        return
    with torch.no_grad():
        for t in list(model.parameters()) + list(model.buffers()):
            dist.broadcast(t.data, src=0)
