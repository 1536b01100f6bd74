"""One measured run of the trunk (one block) and optionally the diffusion head, on P local processes.

`measure(spec)` spawns `spec.world` fresh gloo processes (one thread each; a fresh process per run so
the resident high-water mark belongs to this run alone). Each rank builds its own z shard (never the
full pair), runs one Pairformer block (the plain block at P = 1, `DapPairformer` above), and reports
`PeakMemory`'s figure, the block's wall time and CPU time (the process's, all threads: on a
loaded machine wall time includes waiting for a core, CPU time does not), and the communication by
kind; with `head_samples` it then samples K structures data-parallel and reports their time and peak
memory. Used by benchmarks/fold.py
and the planner's validation.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field

import torch

from scratchlm.fold.pairformer import PairformerConfig


@dataclass(frozen=True)
class RunSpec:
    """What to run: the widths, N, the ranks, the chunking and whether to sample."""

    cfg: PairformerConfig = field(default_factory=lambda: PairformerConfig(n_blocks=1))
    n: int = 128
    world: int = 1
    chunk_rows: int | None = None
    overlap: bool = True
    head_samples: int = 0
    head_steps: int = 10
    seed: int = 0


def _worker(rank: int, world: int, spec: RunSpec) -> dict:
    from scratchlm.fold.dap import DapComm, DapPairformer, pad_to
    from scratchlm.fold.diffusion_head import (
        DiffusionHead,
        DiffusionHeadConfig,
        condition_from_shards,
        sample_data_parallel,
    )
    from scratchlm.fold.memory import PeakMemory
    from scratchlm.fold.pairformer import PairformerBlock

    cfg, n = spec.cfg, spec.n
    torch.manual_seed(spec.seed)
    blk = PairformerBlock(cfg).eval()
    comm = DapComm("cpu", timeout_s=600)
    n_pad = pad_to(n, world)
    rows = n_pad // world
    g = torch.Generator().manual_seed(spec.seed + 1)
    s = torch.randn(1, n_pad, cfg.c_s, generator=g)
    gz = torch.Generator().manual_seed(spec.seed + 100 + rank)
    z = torch.randn(1, rows, n_pad, cfg.c_z, generator=gz)  # this rank's rows only
    mask = torch.ones(1, n_pad)
    mask[:, n:] = 0
    pm_rows = mask[:, rank * rows:(rank + 1) * rows, None] * mask[:, None, :]
    pm_cols = pm_rows.clone()  # the pair mask is symmetric here (an outer product)
    out: dict = {"rank": rank, "shard_bytes": z.numel() * z.element_size()}
    dap = DapPairformer(blk, comm, overlap=spec.overlap, chunk_rows=spec.chunk_rows)
    with torch.no_grad():
        # warm-up on a tiny pair through the same path: pages in the kernels' code, initialises the
        # allocator's and gloo's buffers, so the measured peak is the block's activations
        w = 4 * world
        wz, wm = torch.randn(1, 4, w, cfg.c_z), torch.ones(1, w)
        if world == 1:
            blk(torch.randn(1, w, cfg.c_s), wz, wm, torch.ones(1, 4, w), 2)
        else:
            dap.forward_sharded(torch.randn(1, w, cfg.c_s), wz, wm, torch.ones(1, 4, w), torch.ones(1, 4, w))
        del wz, wm
        comm.reset_stats()
        t, cpu = time.perf_counter(), time.process_time()
        with PeakMemory() as pk:
            if world == 1:
                s_out, z_out = blk(s, z, mask, pm_rows, spec.chunk_rows)
            else:
                s_out, z_out = dap.forward_sharded(s, z, mask, pm_rows, pm_cols)
        out.update(block_s=time.perf_counter() - t, block_cpu_s=time.process_time() - cpu,
                   peak_bytes=pk.peak_bytes, method=pk.method,
                   comm_s=dict(comm.seconds), comm_bytes=dict(comm.bytes_sent))
        del z
        if spec.head_samples:
            torch.manual_seed(spec.seed + 7)
            head = DiffusionHead(DiffusionHeadConfig(steps=spec.head_steps), cfg.c_s, cfg.c_z).eval()
            comm.reset_stats()
            t = time.perf_counter()
            with PeakMemory() as pk:
                cond = condition_from_shards(head, comm, s_out, z_out, mask, n, spec.chunk_rows)
                t_cond = time.perf_counter() - t
                x = sample_data_parallel(head, cond, spec.head_samples, comm, spec.seed)
            out.update(head_s=time.perf_counter() - t, head_cond_s=t_cond, head_peak_bytes=pk.peak_bytes,
                       head_comm_bytes=dict(comm.bytes_sent), samples_shape=tuple(x.shape))
    return out


def measure(spec: RunSpec, timeout: float = 3600.0) -> list[dict]:
    """Run `spec` on `spec.world` fresh local processes; one result dict per rank (see the module docstring).

    Sets MALLOC_MMAP_THRESHOLD_=65536 for the children unless already set: glibc's dynamic threshold
    otherwise keeps freed multi-MB tensors in the heap, and the resident figure then includes that slack."""
    from scratchlm.parallel.sequence import spawn_gloo

    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    return spawn_gloo(_worker, spec.world, spec, timeout=timeout)


def spec_dict(spec: RunSpec) -> dict:
    """A JSON-able view of a spec (for result files)."""
    return asdict(spec)
