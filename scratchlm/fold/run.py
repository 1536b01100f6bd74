"""Run the hybrid (DAP trunk, then diffusion samples data-parallel) under torchrun, on one host or several.

    torchrun --nproc-per-node 2 -m scratchlm.fold.run --tokens 128 --blocks 2 --samples 5
    torchrun --nnodes 2 --node-rank R --master-addr HOST --nproc-per-node 2 -m scratchlm.fold.run ...

Every rank builds the same random weights (seeded), its own rows of a random pair representation
(`rank_rows`: seeded by rank, so the full z is their concatenation), runs
the trunk sharded by rows and its share of the K samples, and rank 0 prints memory per rank, time per
block and per sample, and the bytes each kind of collective sent. The backend is NCCL when `--device
cuda` (each rank on cuda:LOCAL_RANK), gloo otherwise; every collective has `--timeout` seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from scratchlm.fold.dap import DapComm, DapPairformer, pad_to
from scratchlm.fold.diffusion_head import (
    DiffusionHead,
    DiffusionHeadConfig,
    condition_from_shards,
    sample_data_parallel,
)
from scratchlm.fold.memory import PeakMemory
from scratchlm.fold.pairformer import Pairformer, PairformerConfig, chunk_size_for_budget
from scratchlm.parallel.comm import backend_for, init_default_group
from scratchlm.threads import add_threads_argument, apply_threads


def rank_rows(cfg: PairformerConfig, rank: int, rows: int, n_pad: int) -> torch.Tensor:
    """Rank `rank`'s rows of the run's random pair representation (1, rows, N', c_z)."""
    return torch.randn(1, rows, n_pad, cfg.c_z, generator=torch.Generator().manual_seed(100 + rank))


def parser() -> argparse.ArgumentParser:
    """The flags of `python -m scratchlm.fold.run`."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=128, help="tokens N of the complex")
    ap.add_argument("--blocks", type=int, default=2, help="Pairformer blocks of the trunk")
    ap.add_argument("--samples", type=int, default=5, help="diffusion samples K")
    ap.add_argument("--steps", type=int, default=10, help="sampler steps")
    ap.add_argument("--chunk-mib", type=float, default=None, help="row-chunk budget (MiB of transients per op)")
    ap.add_argument("--no-overlap", action="store_true", help="blocking collectives (no Duality-Async overlap)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds any collective may wait")
    add_threads_argument(ap, "per rank")
    return ap


def main(argv: list[str] | None = None) -> int:
    report = run_hybrid(argv)
    if report is not None:
        print(json.dumps(report, indent=1))
    return 0


def run_hybrid(argv: list[str] | None = None) -> dict | None:
    """Run the hybrid on this torchrun rank; rank 0 gets the report (the others None)."""
    ap = parser()
    args = ap.parse_args(argv)
    if args.tokens <= 0 or args.blocks <= 0 or args.samples <= 0:
        ap.error("--tokens, --blocks and --samples must be positive")
    if "RANK" not in os.environ:
        ap.error("run me under torchrun (RANK/WORLD_SIZE/MASTER_ADDR are not set)")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        apply_threads(args.threads, world_size=world)  # torchrun: split over LOCAL_WORLD_SIZE, this machine's ranks
    except ValueError as e:
        ap.error(str(e))
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    init_default_group(backend_for(device), rank, world, timeout_s=args.timeout)
    try:
        comm = DapComm(device, timeout_s=args.timeout)
        cfg = PairformerConfig(n_blocks=args.blocks)
        torch.manual_seed(0)
        model = Pairformer(cfg).eval().to(device)
        head = DiffusionHead(DiffusionHeadConfig(steps=args.steps), cfg.c_s, cfg.c_z).eval().to(device)
        n = args.tokens
        n_pad = pad_to(n, world)
        rows = n_pad // world
        chunk = (chunk_size_for_budget(cfg, n_pad, int(args.chunk_mib * 2**20)) if args.chunk_mib else None)
        g = torch.Generator().manual_seed(1)
        s = torch.randn(1, n_pad, cfg.c_s, generator=g).to(device)
        z = rank_rows(cfg, rank, rows, n_pad).to(device)
        mask = torch.ones(1, n_pad, device=device)
        mask[:, n:] = 0
        pm = mask[:, rank * rows:(rank + 1) * rows, None] * mask[:, None, :]
        dap = DapPairformer(model, comm, overlap=not args.no_overlap, chunk_rows=chunk)
        with torch.no_grad():
            t = time.perf_counter()
            with PeakMemory(device) as pk:
                s_out, z_out = dap.forward_sharded(s, z, mask, pm, pm.clone())
            trunk_s = time.perf_counter() - t
            trunk_comm = {k: v for k, v in comm.bytes_sent.items() if v}
            t = time.perf_counter()
            with PeakMemory(device) as pk_head:
                x = sample_data_parallel(head, condition_from_shards(head, comm, s_out, z_out, mask, n, chunk),
                                         args.samples, comm)
            head_s = time.perf_counter() - t
        mine = {"rank": rank, "trunk_peak_mib": pk.peak_bytes / 2**20, "trunk_s": trunk_s,
                "head_peak_mib": pk_head.peak_bytes / 2**20, "head_s": head_s, "comm_bytes": trunk_comm,
                "host": os.uname().nodename}
        every = [None] * world
        dist.all_gather_object(every, mine, group=comm.group)
        report = None
        if rank == 0:
            report = {"tokens": n, "world": world, "blocks": args.blocks, "samples": list(x.shape),
                      "chunk_rows": chunk, "per_block_s": max(e["trunk_s"] for e in every) / args.blocks,
                      "per_sample_s": max(e["head_s"] for e in every) / args.samples, "ranks": every,
                      "checksum": {"s": float(s_out[:, :n].double().abs().sum()),
                                   "samples": float(x.double().abs().sum())}}
    finally:
        dist.destroy_process_group()
    return report


if __name__ == "__main__":
    sys.exit(main())
