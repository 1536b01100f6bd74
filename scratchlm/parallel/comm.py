"""Process groups and timed collectives on torch.distributed (gloo on CPU, NCCL on CUDA).

`init_groups` makes three kinds of group, created in the same order on every rank:

- the default group (rendezvous and group creation; 2 min on rank 0) and a start-up group for the
  handshake after every rank loaded its shard (10 min on rank 0);
- a command group over all ranks for rank 0's step commands: the short timeout on rank 0 and
  unlimited on the workers (a server may sit idle for hours between requests);
- a *step* group over all ranks with the short collective timeout (60 s by default) for the
  point-to-point activations of the pipeline;
- one tensor-parallel group per pipeline stage (same short timeout) for the all-reduces/gathers;
- under expert parallelism, one EP group per tp rank (the ranks with that tp rank, one per EP replica; same
  short timeout) for the all-to-alls of the MoE layers and of the new K/V rows.

So a dead or hung peer turns any step collective into an error within the timeout, never a hang.
Every collective is timed (wall clock, seconds and call counts per kind) for the benchmarks, and counts the
bytes this rank *sends* for it (``Comm.bytes``, per kind): an all-reduce of n bytes over P ranks sends
2 (P-1)/P x n (the ring algorithm's volume, the bandwidth-optimal one), an all-gather of a part of n bytes
(P-1) x n, an all-to-all the rows it sends to the *other* ranks (its own stay local), a send its tensor; a
receive (``recv_wait``) records the bytes it received, which its peer counted as sent. Pickled commands
(``broadcast``) are counted only while ``count_object_bytes`` is set (a pickle more per step). The step traces
get the same spans and bytes (``Comm.trace``: (kind, start, end, bytes) per call).
"""

from __future__ import annotations

import time
from collections import defaultdict
from datetime import timedelta

import torch
import torch.distributed as dist

from scratchlm.parallel.layout import RankLayout

IDLE_TIMEOUT = timedelta(days=30)  # waiting for the next step: the server may be idle
STARTUP_TIMEOUT = timedelta(minutes=10)  # rank 0 waiting for the workers to load their shards
RENDEZVOUS_TIMEOUT = timedelta(minutes=2)  # rank 0 waiting for the workers to join (a crashed one never does)


def backend_for(device: str | torch.device) -> str:
    """'nccl' for CUDA devices, 'gloo' otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init_default_group(backend: str, rank: int, world_size: int, init_method: str | None = None,
                       timeout_s: float = 60.0, store: dist.Store | None = None) -> None:
    """Join the default process group through `store` (the spawned ranks: rank 0's TCPStore), else
    `init_method` (env:// from torchrun when None).

    The default group only rendezvouses and creates the other groups: rank 0 waits `RENDEZVOUS_TIMEOUT`
    for the workers to join (a worker that crashed at start never does), workers `IDLE_TIMEOUT`."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(f"torch.distributed is already initialised as rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, expected rank {rank} of {world_size}")
        return
    timeout = max(RENDEZVOUS_TIMEOUT, timedelta(seconds=timeout_s)) if rank == 0 else IDLE_TIMEOUT
    if store is not None:
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    else:
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size,
                                timeout=timeout)


class Comm:
    """One rank's groups and timed collectives; see the module docstring."""

    def __init__(self, layout: RankLayout, timeout_s: float, backend: str, device: torch.device):
        self.layout = layout
        self.device = device
        self.backend = backend
        self.timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        world = list(range(layout.world_size))
        # Step commands: rank 0 waits `timeout_s` for the workers to take one, workers wait without limit.
        # The start-up handshake (after every rank loaded its shard: slow on a busy machine).
        self.startup_group = dist.new_group(world, timeout=STARTUP_TIMEOUT if layout.rank == 0 else IDLE_TIMEOUT,
                                            backend=backend)
        self.cmd_group = dist.new_group(world, timeout=timeout if layout.rank == 0 else IDLE_TIMEOUT, backend=backend)
        self.step_group = dist.new_group(world, timeout=timeout, backend=backend)
        self.tp_group = None
        for c in range(layout.replicas):  # every rank creates every group, in the same order
            for stage in range(layout.pp):  # one TP group per (CP or EP replica, stage)
                g = dist.new_group(layout.stage_ranks(stage, c), timeout=timeout, backend=backend)
                if (c, stage) == (layout.replica, layout.stage):
                    self.tp_group = g
        self.ep_group = None
        if layout.ep > 1:
            for t in range(layout.tp):  # one EP group per tp rank
                g = dist.new_group(layout.ep_ranks(t), timeout=timeout, backend=backend)
                if t == layout.tp_rank:
                    self.ep_group = g
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)  # bytes this rank sent (received, for recv_wait) per kind
        self.count_object_bytes = False  # also count the pickled size of broadcast commands (benchmarks)
        # (kind, start, end, bytes) of every call while tracing
        self.trace: list[tuple[str, float, float, int]] | None = None

    def _timed(self, kind: str, start: float, nbytes: int = 0) -> None:
        end = time.perf_counter()
        self.seconds[kind] += end - start
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        if self.trace is not None:  # step traces (scratchlm/inference/trace.py)
            self.trace.append((kind, start, end, nbytes))

    def reset_stats(self) -> None:
        self.seconds.clear()
        self.calls.clear()
        self.bytes.clear()

    def ring_all_reduce_bytes(self, x: torch.Tensor, world: int) -> int:
        """Bytes one rank sends in a ring all-reduce of `x` over `world` ranks: 2 (world-1)/world x size."""
        return 2 * (world - 1) * x.numel() * x.element_size() // world

    # --- commands (default group, long timeout) -------------------------------------------------
    def broadcast_command(self, obj: object, startup: bool = False) -> object:
        """Rank 0 sends `obj` (picklable) to every rank; the others receive and return it.
        `startup`: over the start-up group (long timeout: the workers may still be loading)."""
        t = time.perf_counter()
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.startup_group if startup else self.cmd_group,
                                   device=self.device if self.backend == "nccl" else None)
        sent = 0
        if self.count_object_bytes and self.layout.rank == 0:  # rank 0 sends it to each other rank
            import pickle

            sent = len(pickle.dumps(obj)) * (self.layout.world_size - 1)
        self._timed("broadcast", t, sent)
        return box[0]

    # --- tensor parallel (stage group) ----------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the stage's tensor-parallel ranks, in place (no-op at TP=1, and for no rows: an EP replica
        with no tokens in the step; its TP ranks all have none)."""
        if self.layout.tp == 1 or x.numel() == 0:
            return x
        t = time.perf_counter()
        dist.all_reduce(x, group=self.tp_group)
        self._timed("all_reduce", t, self.ring_all_reduce_bytes(x, self.layout.tp))
        return x

    def all_gather_cols(self, x: torch.Tensor) -> torch.Tensor:
        """(n, c) on each TP rank -> (n, tp * c), rank order (no-op at TP=1)."""
        if self.layout.tp == 1:
            return x
        t = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.layout.tp)]
        dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        self._timed("all_gather", t, (self.layout.tp - 1) * x.numel() * x.element_size())
        return torch.cat(parts, dim=1)

    # --- expert parallel (EP group) ---------------------------------------------------------------
    def all_to_all(self, x: torch.Tensor, send_rows: list[int], recv_rows: list[int], kind: str) -> torch.Tensor:
        """Rows x (n, ...) split into `send_rows` consecutive parts, part j to EP rank j; returns the parts the EP
        ranks sent this one, concatenated in EP-rank order: (sum(recv_rows), ...). Timed and counted as `kind`
        (the bytes this rank sends to the *other* ranks)."""
        t = time.perf_counter()
        out = x.new_empty((sum(recv_rows), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_rows, send_rows, group=self.ep_group)
        row = x.shape[1:].numel() * x.element_size()
        self._timed(kind, t, (sum(send_rows) - send_rows[self.layout.ep_rank]) * row)
        return out

    def ep_all_gather(self, x: torch.Tensor, kind: str) -> torch.Tensor:
        """x (same shape on every EP rank) -> (ep, *x.shape), EP-rank order; timed and counted as `kind`."""
        t = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.layout.ep)]
        dist.all_gather(parts, x.contiguous(), group=self.ep_group)
        self._timed(kind, t, (self.layout.ep - 1) * x.numel() * x.element_size())
        return torch.stack(parts)

    # --- pipeline (step group, point to point) --------------------------------------------------
    def isend(self, x: torch.Tensor, dst: int, tag: int) -> dist.Work:
        t = time.perf_counter()
        work = dist.isend(x.contiguous(), dst=dst, group=self.step_group, tag=tag)
        self._timed("send", t, x.numel() * x.element_size())
        return work

    def irecv(self, x: torch.Tensor, src: int, tag: int) -> dist.Work:
        return dist.irecv(x, src=src, group=self.step_group, tag=tag)

    def wait(self, work: dist.Work, kind: str = "recv_wait", nbytes: int = 0) -> None:
        """Wait for a p2p op; a dead peer raises within the step timeout. `nbytes`: what it received (recorded
        under `kind`; a send's bytes are counted when it is posted)."""
        t = time.perf_counter()
        work.wait(timedelta(seconds=self.timeout_s)) if self.backend == "gloo" else work.wait()
        self._timed(kind, t, nbytes)
