"""Step traces: the engine's steps as Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing).

``EngineConfig(trace=FILE)`` (so ``LLM(model, trace=FILE)``, ``scratchlm serve --trace FILE``, ``scratchlm
generate --trace FILE``) starts a :class:`StepTracer` on the engine. It is an ordinary listener of the engine's
event stream (events.py), so the step runs as without it except for the timers, and it adds:

- process ``rank 0`` (the engine's process), one thread track per stage: ``step`` (the whole step, with
  the batch composition as arguments), ``schedule``, ``forward`` (each runner call; nested inside it, one span
  per *layer group*: ``layers a-b`` on the Python path, or ``embed`` / ``layers 0-L (fused C++ step)`` /
  ``norm + head`` when the fused C++ step runs all layers in one call), ``sample``, ``detokenize``;
- a ``kv blocks`` counter track (used / cached-free blocks) and a ``batch`` counter (tokens, sequences);
- under tensor / pipeline / context parallelism, process ``rank r`` for every rank with a ``comm`` track:
  each collective and point-to-point wait that :class:`scratchlm.parallel.comm.Comm` times, as a span named by
  its kind (all_reduce, all_gather, send, recv_wait, ...). Rank 0's come from its own Comm; the other ranks
  record theirs in their processes and send them to rank 0 when the tracer closes (``Comm.trace`` and the
  ``trace`` worker command), so the ranks share one file and one clock (``time.perf_counter``, which is the
  system-wide monotonic clock on Linux).

Times are microseconds since the tracer started. The file is written as it goes, in the JSON Array Format
(``[`` + one event per line + ``]``), and it is strict JSON after every write: each step's events are written
over the closing ``]`` of the step before, which is then written again and the file flushed. So the file can be
read with ``json.load`` at any time between steps, after ``LLM.generate`` returns, after ``del llm``, and after
a process that ends without closing anything (interpreter exit, an exception, SIGTERM or SIGKILL between two
steps; only a kill in the middle of a write can leave it cut). :meth:`StepTracer.close` (``LLM.close()``, leaving
``with LLM(...)``, the engine's collection, interpreter exit, the end of a multiprocessing child) adds the other
ranks' communication spans and closes the file; it is idempotent.
"""

from __future__ import annotations

import atexit
import json
import logging
import multiprocessing.util
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from scratchlm.inference.events import StepEvent

log = logging.getLogger(__name__)

STAGE_TRACKS = {"step": 1, "schedule": 2, "forward": 3, "sample": 4, "detokenize": 5}
COMM_TRACK = 10
DEFAULT_LAYER_GROUPS = 4
_CLOSING = b"\n]\n"


def layer_groups(n_layers: int, groups: int) -> list[tuple[int, int]]:
    """Split layers 0..n_layers-1 into at most `groups` contiguous (first, last) groups of near-equal size."""
    groups = max(1, min(groups, n_layers))
    bounds = [round(i * n_layers / groups) for i in range(groups + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(groups) if bounds[i + 1] > bounds[i]]


class StepTracer:
    """Writes the steps of `engine` to `path` as Chrome trace events; see the module docstring."""

    def __init__(self, engine: Any, path: str | Path, groups: int = DEFAULT_LAYER_GROUPS):
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise ValueError(f"trace file {self.path}: folder {self.path.parent} does not exist")
        self._engine_ref = weakref.ref(engine)
        self._lock = threading.Lock()
        self._file = self.path.open("wb")
        self._file.write(b"[\n")
        self._end = self._file.tell()  # where the next events go: the closing bracket after it is overwritten
        self._first = True
        self._closed = False
        self.t0 = time.perf_counter()
        self.num_steps = 0
        self._marks: list[tuple[str, float, float]] = []  # layer-group spans of the current step
        self._hooks: list[Any] = []
        self._comm = getattr(getattr(engine, "runner", None), "comm", None)
        self.ranks = 1 if self._comm is None else int(self._comm.layout.world_size)
        self._metadata()
        self._install_layer_hooks(engine, groups)
        if self._comm is not None:
            self._comm.trace = []
            self._start_worker_tracing(engine)
        engine.events.subscribe(self._on_step)
        self._finalizer = weakref.finalize(engine, StepTracer._finalize, weakref.ref(self))
        atexit.register(self.close)
        # a multiprocessing child (the server's engine process) leaves by os._exit after its own exit functions,
        # which skip atexit: close there too
        multiprocessing.util.Finalize(None, self.close, exitpriority=10)
        log.info("tracing engine steps to %s", self.path)

    @staticmethod
    def _finalize(ref: weakref.ref) -> None:
        tracer = ref()
        if tracer is not None:
            tracer.close()

    # --- writing ---------------------------------------------------------------------------------
    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 3)

    def _emit(self, events: list[dict]) -> None:
        """Append `events` and rewrite the closing bracket after them, so the file is strict JSON again."""
        with self._lock:
            if self._closed:
                return
            parts = []
            for ev in events:
                parts.append(("" if self._first else ",\n") + json.dumps(ev, separators=(",", ":")))
                self._first = False
            self._file.seek(self._end)
            self._file.write("".join(parts).encode())
            self._end = self._file.tell()
            self._file.write(_CLOSING)
            self._file.truncate()
            self._file.flush()

    def _metadata(self) -> None:
        meta = []
        for rank in range(self.ranks):
            meta.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
            meta.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
            if self.ranks > 1:
                meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": COMM_TRACK,
                             "args": {"name": "comm"}})
        for name, tid in STAGE_TRACKS.items():
            meta.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": tid, "args": {"name": name}})
            meta.append({"ph": "M", "name": "thread_sort_index", "pid": 0, "tid": tid, "args": {"sort_index": tid}})
        self._emit(meta)

    def _span(self, name: str, tid: int, start: float, end: float, pid: int = 0, args: dict | None = None) -> dict:
        ev = {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": self._us(start),
              "dur": round(max(0.0, end - start) * 1e6, 3)}
        if args:
            ev["args"] = args
        return ev

    def _comm_span(self, call: tuple, rank: int) -> dict:
        """One `Comm.trace` call (kind, start, end, bytes) as a span on the rank's comm track, with the bytes
        the rank sent (received, for a wait) as `Comm.bytes` counts them."""
        kind, a, b, *rest = call
        return self._span(kind, COMM_TRACK, a, b, pid=rank, args={"bytes": int(rest[0]) if rest else 0})

    # --- layer groups ----------------------------------------------------------------------------
    def _install_layer_hooks(self, engine: Any, groups: int) -> None:
        model = getattr(getattr(engine, "runner", None), "model", None)
        layers = getattr(model, "layers", None)
        if model is None or layers is None or not len(layers):
            return
        n = len(layers)
        for first, last in layer_groups(n, groups):
            name = f"layers {first}-{last}"
            self._hooks.append(layers[first].register_forward_pre_hook(self._starter(name)))
            self._hooks.append(layers[last].register_forward_hook(self._ender(name)))
        self._fused_name = f"layers 0-{n - 1} (fused C++ step)"
        for attr, name in (("tok_embeddings", "embed"), ("norm", "norm + head")):
            module = getattr(model, attr, None)
            if module is not None:
                self._hooks.append(module.register_forward_pre_hook(self._starter(name)))
                self._hooks.append(module.register_forward_hook(self._ender(name)))

    def _starter(self, name: str):
        def hook(module: Any, args: Any) -> None:
            self._marks.append((name, time.perf_counter(), -1.0))
        return hook

    def _ender(self, name: str):
        def hook(module: Any, args: Any, out: Any) -> None:
            for i in range(len(self._marks) - 1, -1, -1):
                n, a, b = self._marks[i]
                if n == name and b < 0:
                    self._marks[i] = (n, a, time.perf_counter())
                    break
        return hook

    def _forward_children(self, start: float, end: float) -> list[tuple[str, float, float]]:
        """The layer-group spans inside one forward [start, end]; on the fused path, the span between the
        embedding and the final norm is the fused C++ call, and `norm + head` runs to the forward's end."""
        marks = [(n, a, b) for n, a, b in self._marks if b >= 0 and start <= a and b <= end]
        out = [m for m in marks if m[0] not in ("embed", "norm + head")]
        embed = [m for m in marks if m[0] == "embed"]
        norm = [m for m in marks if m[0] == "norm + head"]
        if embed:
            out.insert(0, embed[0])
        if embed and norm and not out[1:]:  # no Python layer ran: the fused step did them all
            out.append((self._fused_name, embed[0][2], norm[-1][1]))
        if norm:
            out.append(("norm + head", norm[-1][1], end))
        return out

    # --- the listener ----------------------------------------------------------------------------
    def _on_step(self, ev: StepEvent) -> None:
        self.num_steps += 1
        args = {
            "step": ev.step, "decodes": len(ev.decodes),
            "prefills": [(w.request_id, w.num_tokens) for w in ev.prefills],
            "tokens": ev.num_batched_tokens, "budget": ev.token_budget, "generated": ev.generated_tokens,
            "preempted": ev.preempted, "aborted": ev.aborted, "prefix_cache_hits": ev.prefix_cache_hits,
        }
        if ev.spec_proposed is not None:
            args.update(spec_proposed=ev.spec_proposed, spec_accepted=ev.spec_accepted)
        out = [self._span(f"step {ev.step}", STAGE_TRACKS["step"], ev.t_start, ev.t_end, args=args)]
        for name, a, b in ev.spans:
            out.append(self._span(name, STAGE_TRACKS[name], a, b))
            if name == "forward":
                for child, ca, cb in self._forward_children(a, b):
                    out.append(self._span(child, STAGE_TRACKS["forward"], ca, cb))
        self._marks.clear()
        ts = self._us(ev.t_end)
        out.append({"name": "kv blocks", "ph": "C", "pid": 0, "tid": 0, "ts": ts,
                    "args": {"used": ev.pool.used, "free": ev.pool.free}})
        out.append({"name": "batch", "ph": "C", "pid": 0, "tid": 0, "ts": ts,
                    "args": {"tokens": ev.num_batched_tokens, "seqs": len(ev.decodes) + len(ev.prefills)}})
        if self._comm is not None and self._comm.trace:
            calls, self._comm.trace = self._comm.trace, []
            out.extend(self._comm_span(call, 0) for call in calls)
        self._emit(out)

    # --- other ranks -----------------------------------------------------------------------------
    def _start_worker_tracing(self, engine: Any) -> None:
        runner = engine.runner
        if self.ranks > 1 and hasattr(runner, "trace_command"):
            runner.trace_command(True)

    def _collect_workers(self) -> None:
        engine = self._engine_ref()
        runner = getattr(engine, "runner", None)
        if self.ranks <= 1 or not hasattr(runner, "trace_command"):
            return
        try:
            per_rank = runner.trace_command(False)  # {rank: [(kind, start, end, bytes)]}
        except Exception as e:  # a dead rank: the trace keeps what rank 0 saw
            log.warning("could not collect the other ranks' communication traces: %s", e)
            return
        out = [self._comm_span(call, rank) for rank, calls in sorted(per_rank.items()) for call in calls]
        self._emit(out)

    def close(self) -> None:
        """Collect the other ranks' spans, finish the JSON and close the file (idempotent)."""
        if self._closed:
            return
        self._collect_workers()
        engine = self._engine_ref()
        if engine is not None:
            engine.events.unsubscribe(self._on_step)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        if self._comm is not None:
            self._comm.trace = None
        with self._lock:
            self._closed = True
            self._file.close()  # the closing bracket is already there (_emit)
        atexit.unregister(self.close)
        log.info("trace of %d steps written to %s", self.num_steps, self.path)

    def flush(self) -> None:
        """Write everything so far to the OS (done after every step already: a no-op kept for callers)."""
        with self._lock:
            if not self._closed:
                self._file.flush()
