"""`ParallelRunner`: the engine's runner across TP x PP ranks.

Rank 0 keeps the whole engine (scheduler, block manager, sampler). Each step it broadcasts the
runner's `ModelInput` (plain Python data) to every rank; all ranks run their shard of the forward
(TP all-reduces inside a stage, PP sends between stages, micro-batches in flight), and rank 0
receives the logits of the sampled rows. The other ranks loop in `serve_forever`.

Failures: step collectives time out after `EngineConfig.parallel_timeout_s`; a dead worker makes
its peers' collectives fail at once. Rank 0 then raises `ParallelWorkerError` naming the dead ranks
and exit codes, and the runner refuses further steps (the engine must be restarted).

Liveness (spawned ranks): every worker adds 1 to its counter `BEAT_KEY + rank` in rank 0's store every
`HEARTBEAT_S` from a thread (`beat_forever`); rank 0's watcher thread (`watch_ranks`) reads the counters
as often and notes when each last moved, so `liveness()` gives each rank's seconds since its last beat
(the server's /health judges them: server/health.py). The watcher also notices a worker that exited
while the engine is idle and fails the runner at once (`failure_callbacks`), not at the next step.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from scratchlm.inference.attention import AttentionMetadata, PagedAttention, PrefillChunk
from scratchlm.inference.kv_cache import KVCache, kv_shape, kv_v_dim
from scratchlm.inference.runner import ModelInput
from scratchlm.parallel.comm import Comm
from scratchlm.parallel.pipeline import split_model_input
from scratchlm.parallel.tensor import ShardedLM

log = logging.getLogger(__name__)

_LOGITS_TAG = 1 << 20  # p2p tags: micro-batch m's activations use tag m, its logits _LOGITS_TAG + m
BEAT_KEY = "scratchlm/beat/"  # + rank: that worker's heartbeat counter in rank 0's store
HEARTBEAT_S = 0.5


class ParallelWorkerError(RuntimeError):
    """A tensor/pipeline-parallel rank died, hung past the timeout, or failed: the engine cannot continue."""


def beat_forever(host: str, port: int, rank: int) -> None:
    """A worker's heartbeat thread: add 1 to its counter in rank 0's store every `HEARTBEAT_S` (its own
    connection), until the store is gone (rank 0 exited; this process dies with it)."""
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        while True:
            store.add(BEAT_KEY + str(rank), 1)
            time.sleep(HEARTBEAT_S)
    except Exception:  # rank 0 is gone
        return


def _shutdown(comm_ok: list[bool], procs: list, cmd_group, closing: threading.Event | None = None,
              timeout: float = 10.0) -> None:
    """Stop the workers: a stop command if the group still works, then join/terminate/kill. `comm_ok`: [the group
    works, the runner was abandoned (hung: a step may still sit in a collective, so the workers are killed at once
    and the process group is left to the process's end: destroying it under a blocked collective aborts)]."""
    if closing is not None:
        closing.set()  # the rank watcher: workers that exit from now on were stopped
    if comm_ok[1]:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(5.0)
        return
    if comm_ok[0] and dist.is_initialized():
        with contextlib.suppress(Exception):  # a dead peer: fall through to terminate
            dist.broadcast_object_list([("stop", None)], src=0, group=cmd_group)
    deadline = time.monotonic() + (timeout if comm_ok[0] else 0.0)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(2.0)
        if p.is_alive():
            p.kill()
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class ParallelRunner:
    """One rank's runner; on rank 0 `execute(ModelInput)` -> logits (len(logits_indices), vocab)."""

    def __init__(self, model: ShardedLM, comm: Comm, block_size: int, dtype: torch.dtype, device: torch.device,
                 num_microbatches: int, procs: Sequence = ()):
        self.model = model
        self.comm = comm
        self.layout = model.layout
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_microbatches = max(1, num_microbatches)
        self.cache: KVCache | None = None
        self.procs = list(procs)
        self._error: str | None = None
        self._comm_ok = [True, False]  # [the step group works, abandoned] (see _shutdown)
        self.steps = 0
        self.failure_callbacks: list = []  # called once with the error message when a step fails (the server exits)
        self._finalizer = None
        self._closing = threading.Event()
        self._seen: dict[int, float] = {}  # rank -> when its heartbeat counter last moved (watch_ranks)
        if self.layout.rank == 0:
            self._finalizer = weakref.finalize(self, _shutdown, self._comm_ok, self.procs, comm.cmd_group,
                                               self._closing)

    # --- set-up ----------------------------------------------------------------------------------
    def _allocate(self, num_blocks: int) -> None:
        c, lay = self.model.config, self.layout
        spec = c.kv_spec()[lay.layers[0]:lay.layers[1]]  # this stage's layers' KV
        n_layers, heads, head_dim = kv_shape(spec)  # heads: 1 for MLA's latent
        if lay.tp > 1 and not c.mla.kv_lora_rank:
            heads = lay.kv_heads[1] - lay.kv_heads[0]  # this rank's KV heads (MLA: every rank caches the whole latent)
        self.cache = KVCache.allocate(n_layers, num_blocks, self.block_size, heads, head_dim, self.dtype, self.device,
                                      kv_v_dim(spec))

    def start(self, num_blocks: int) -> ParallelRunner:
        """Rank 0: tell every rank the KV pool size the engine chose, allocate this rank's cache shard."""
        self._guard(lambda: self.comm.broadcast_command(("init", num_blocks), startup=True))
        self._allocate(num_blocks)
        return self

    def serve_forever(self) -> None:
        """Ranks > 0: allocate the cache, then execute rank 0's steps until it says stop."""
        kind, payload = self.comm.broadcast_command(None, startup=True)
        if kind != "init":
            return
        self._allocate(payload)
        handlers = self._command_handlers()
        while True:
            kind, payload = self.comm.broadcast_command(None)
            if kind not in handlers:  # "stop", or rank 0 is gone
                return
            handlers[kind](payload)

    def _command_handlers(self) -> dict:
        """What ranks > 0 do with each command rank 0 broadcasts (anything else ends `serve_forever`)."""
        return {"step": self._step, "trace": self._trace}

    def trace_command(self, on: bool) -> dict[int, list[tuple[str, float, float, int]]] | None:
        """Rank 0: every rank starts (`on`) or stops recording its communication calls (`Comm.trace`); stopping
        returns {rank: [(kind, start, end, bytes)]} of the ranks > 0 (step traces, scratchlm/inference/trace.py)."""
        return self._guard(lambda: (self.comm.broadcast_command(("trace", on)), self._trace(on))[1])

    def _trace(self, on: bool) -> dict[int, list[tuple[str, float, float, int]]] | None:
        calls, self.comm.trace = self.comm.trace, ([] if on else None)
        if on:
            return None
        everyone: list = [None] * self.layout.world_size
        dist.all_gather_object(everyone, calls if self.layout.rank else [], group=self.comm.cmd_group)
        return {r: everyone[r] or [] for r in range(1, self.layout.world_size)}

    def shutdown(self) -> None:
        """Rank 0: stop the workers and leave the process group (also run at exit)."""
        if self._finalizer is not None:
            self._finalizer()

    # --- liveness ----------------------------------------------------------------------------------
    def watch_ranks(self, host: str, port: int) -> None:
        """Rank 0: follow the workers' heartbeat counters in the store at host:port (see the module docstring)."""
        now = time.monotonic()
        self._seen = {r: now for r in range(1, self.layout.world_size)}
        threading.Thread(target=self._watch, args=(host, port), name="scratchlm-rank-watch", daemon=True).start()

    def _watch(self, host: str, port: int) -> None:
        counts: dict[int, int] = {}
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
            while not self._closing.wait(HEARTBEAT_S):
                for rank in self._seen:
                    count = store.add(BEAT_KEY + str(rank), 0)
                    if count != counts.get(rank):
                        counts[rank], self._seen[rank] = count, time.monotonic()
                if self._dead_workers() and self._error is None and not self._closing.is_set():
                    self._fail_idle()
        except Exception:  # the store is gone: the runner is shutting down
            return

    def _fail_idle(self) -> None:
        """A worker exited between steps: fail the runner now (the next step would fail anyway)."""
        with contextlib.suppress(ParallelWorkerError):
            self._guard(lambda: None)

    def liveness(self) -> dict[str, float]:
        """Rank 0: {"rank N": seconds since rank N's last heartbeat} (empty when the ranks are not watched)."""
        now = time.monotonic()
        return {f"rank {rank}": now - seen for rank, seen in self._seen.items()}

    def abandon(self, reason: str) -> None:
        """Rank 0: the engine is given up (hung): refuse further steps, and stop the workers without talking to
        them (a stopped rank would never answer the stop command)."""
        self._error = self._error or reason
        self._comm_ok[0], self._comm_ok[1] = False, True

    # --- a step ----------------------------------------------------------------------------------
    def execute(self, inp: ModelInput) -> torch.Tensor:
        """Rank 0: broadcast `inp`, run this rank's share, return the gathered logits."""
        return self._guard(lambda: (self.comm.broadcast_command(("step", inp)), self._step(inp))[1])

    def _guard(self, fn):
        if self._error is not None:
            raise ParallelWorkerError(self._error)
        dead = self._dead_workers()
        try:
            if dead:
                raise RuntimeError("worker process exited before the step")
            return fn()
        except Exception as e:
            self._comm_ok[0] = False
            dead = self._dead_workers() or dead
            if not dead and self.procs:
                time.sleep(0.5)  # a killed peer: give its exit code a moment to appear
                dead = self._dead_workers()
            who = ", ".join(self._describe(r, pid, code) for r, pid, code in dead)
            self._error = (
                f"tensor/pipeline-parallel step failed (tp={self.layout.tp}, pp={self.layout.pp}"
                + (f", ep={self.layout.ep}" if self.layout.ep > 1 else "") + "): "
                + (who if who else f"a peer rank failed or did not answer within {self.comm.timeout_s:g} s")
                + f"; the engine cannot continue and must be restarted. Cause: {type(e).__name__}: {e}"
            )
            log.error(self._error)
            for callback in self.failure_callbacks:
                with contextlib.suppress(Exception):
                    callback(self._error)
            raise ParallelWorkerError(self._error) from e

    def _describe(self, rank: int, pid: int, code: int) -> str:
        proc = self.procs[rank - 1]
        if hasattr(proc, "describe_exit"):  # a spawned WorkerProcess: with the end of its output (its traceback)
            return proc.describe_exit()
        return f"rank {rank} (pid {pid}) exited with code {code}"

    def _dead_workers(self) -> list[tuple[int, int, int]]:
        return [(i + 1, p.pid, p.exitcode) for i, p in enumerate(self.procs) if p.exitcode is not None]

    def _rope_lengths(self, inp: ModelInput) -> torch.Tensor | None:
        """Each row's sequence length (a decode row: its context; a prefill chunk's rows: the chunk's context) when
        the RoPE scaling depends on it (dynamic NTK, LongRoPE), as the single-process runner passes it; else None."""
        if not getattr(self.model.lm.rope, "length_dependent", False):
            return None
        lengths = list(inp.decode_context_lens)
        for _, ql, cl, _ in inp.prefills:
            lengths += [cl] * ql
        return self._tensor(lengths)

    def _tensor(self, values: Sequence[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _metadata(self, inp: ModelInput) -> AttentionMetadata:
        nd = inp.num_decode_tokens
        return AttentionMetadata(
            slot_mapping=self._tensor(inp.slot_mapping),
            num_decode_tokens=nd,
            decode_block_tables=self._tensor(inp.decode_block_tables) if nd else None,
            decode_context_lens=self._tensor(inp.decode_context_lens) if nd else None,
            prefills=[PrefillChunk(qs, ql, cl, self._tensor(bt)) for qs, ql, cl, bt in inp.prefills],
        )

    @torch.inference_mode()
    def _step(self, inp: ModelInput) -> torch.Tensor | None:
        self.steps += 1
        self.cache.copy_blocks(inp.block_copies)
        lay, comm, model = self.layout, self.comm, self.model
        vocab, d = model.config.vocab_size, model.config.d_model
        if not inp.token_ids:
            return torch.empty(0, 0, device=self.device)
        mbs = split_model_input(inp, self.num_microbatches) if lay.pp > 1 else \
            [(inp, list(range(len(inp.logits_indices))))]
        last_rank0 = (lay.pp - 1) * lay.tp  # tp rank 0 of the last stage: sends the logits to rank 0
        recvs: dict[int, tuple[torch.Tensor, dist.Work]] = {}
        logit_recvs: dict[int, tuple[torch.Tensor, dist.Work]] = {}
        for m, (sub, _) in enumerate(mbs):  # post every receive up front: senders never wait on us
            if not lay.is_first_stage:
                buf = torch.empty(1, len(sub.token_ids), d, dtype=self.dtype, device=self.device)
                recvs[m] = (buf, comm.irecv(buf, lay.rank - lay.tp, m))
            if lay.rank == 0 and lay.pp > 1 and sub.logits_indices:
                buf = torch.empty(len(sub.logits_indices), vocab, dtype=self.dtype, device=self.device)
                logit_recvs[m] = (buf, comm.irecv(buf, last_rank0, _LOGITS_TAG + m))
        sends = []
        results: dict[int, torch.Tensor] = {}
        for m, (sub, _) in enumerate(mbs):
            attn = PagedAttention(self.cache, self._metadata(sub))
            positions = self._tensor(sub.positions)  # (N,)
            if lay.is_first_stage:
                x = model.embed_tokens(self._tensor(sub.token_ids)[None, :], positions)  # (1, N, d)
            else:
                x, work = recvs[m]
                comm.wait(work, nbytes=x.numel() * x.element_size())
            x = model.forward_layers(x, positions, attn, self._rope_lengths(sub))  # (1, N, d)
            if not lay.is_last_stage:
                sends.append(comm.isend(x, lay.rank + lay.tp, m))
            elif sub.logits_indices:
                logits = model.logits(x[0].index_select(0, self._tensor(sub.logits_indices)))  # (n, vocab)
                if lay.rank == 0:
                    results[m] = logits
                elif lay.rank == last_rank0:
                    sends.append(comm.isend(logits, 0, _LOGITS_TAG + m))
        for work in sends:
            comm.wait(work, "send_wait")
        if lay.rank != 0:
            return None
        for m, (buf, work) in logit_recvs.items():
            comm.wait(work, nbytes=buf.numel() * buf.element_size())
            results[m] = buf
        if len(mbs) == 1:
            return results.get(0, torch.empty(0, vocab, dtype=self.dtype, device=self.device))
        out = torch.empty(len(inp.logits_indices), vocab, dtype=self.dtype, device=self.device)
        for m, (_, positions) in enumerate(mbs):
            if positions:
                out[self._tensor(positions)] = results[m]
        return out

    def comm_stats(self) -> dict[str, tuple[float, int]]:
        """{kind: (seconds, calls)} of this rank's communication since the last reset."""
        return {k: (self.comm.seconds[k], self.comm.calls[k]) for k in self.comm.seconds}

    def comm_bytes(self) -> dict[str, int]:
        """{kind: bytes this rank sent (received, for the waits)} since the last reset (`Comm.bytes`)."""
        return dict(self.comm.bytes)
