"""The engine's event stream: one :class:`StepEvent` per step, built only while someone listens.

Policy:

- ``engine.events`` is an :class:`EventStream`. ``subscribe(fn)`` adds a listener, ``unsubscribe(fn)``
  removes it. While there is none, ``LLMEngine.step`` reads one attribute (``events.active``) and takes
  its plain path: no event is built, nothing is timed, nothing is wrapped (zero cost).
- While there is a listener, the stream wraps the step's stages *on the engine instance* (the scheduler's
  ``schedule``, the runner's ``execute``, the sampler, the detokenizer) with timers, lets the step run
  unchanged, and then builds a :class:`StepEvent` from the plan, the block pool and the engine's counters.
  The wrappers are installed by the first observed step and removed by the first step after the last
  listener left, always from the engine's own thread (the engine is not thread-safe; ``subscribe`` is).
- Listeners run synchronously in the engine's thread, in subscription order, after the step. They must be
  quick and must not call the engine: the server's listener puts the event in a bounded buffer and drops
  events for slow consumers. A listener that raises is logged and unsubscribed; the step is not affected.
- The parts of an event that cost O(blocks) to build (the pool map, every block table, the shared-block
  census, the cached-free count) are *details*, taken at most every ``detail_interval_s`` seconds
  (0 = every step), and on the step after which the engine is idle; ``StepEvent.pool.map`` is None on the
  steps in between. Everything else is per step.
- An event is plain data (ints, floats, strings, lists, dicts): picklable across processes and
  JSON-able with :meth:`StepEvent.to_dict`.

Counters in an event (``totals``) are the same counters as ``engine.stats()`` (what ``/metrics`` shows), read
after the step, so a consumer can check one against the other.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Block states in `BlockPool.map`, one character per block.
FREE = "."  # free, no cached content
CACHED = "c"  # free but still holds a registered prefix (a later prompt can hit it)
USED = "u"  # held by one sequence
SHARED_PREFIX = "p"  # held by sequences of different requests (a prefix-cache hit)
SHARED_FORK = "f"  # held by several samples of one request only (`n` forks)


@dataclass
class SeqWork:
    """One scheduled sequence of a step."""

    request_id: str
    seq_id: int
    index: int  # which of the request's n samples
    start: int  # first position fed this step (= num_computed_tokens before it)
    num_tokens: int  # tokens fed this step (1 for a decode, the chunk for a prefill, 1 + k drafts for a verify)
    prompt_len: int
    samples: bool  # whether this step reached its last token (a token was sampled)
    kind: str  # "decode", "verify" (a decode with k drafts), "prefill", or "recompute" (after a preemption)


@dataclass
class BlockPool:
    """The KV block pool after the step. Counts are per step; `map`, `tables`, `shared_*` and `cached_free`
    are details (None / empty on steps between two details)."""

    num_blocks: int
    block_size: int
    free: int  # blocks with ref count 0 (including cached ones)
    used: int  # blocks held by at least one sequence
    cached_free: int | None = None  # free blocks that still hold a registered prefix
    shared_prefix: int | None = None  # blocks held by sequences of more than one request
    shared_fork: int | None = None  # blocks held by several samples of one request only
    map: str | None = None  # one character per block: . free, c cached-free, u used, p shared prefix, f shared fork
    tables: dict[str, list[int]] = field(default_factory=dict)  # "request_id/index" -> block table (running seqs)


@dataclass
class EngineTotals:
    """The engine's cumulative counters after the step (those of `engine.stats()`)."""

    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int  # full blocks looked up
    prefix_cache_hits: int  # of which found
    preemptions: int
    spec_drafted: int | None = None
    spec_accepted: int | None = None


@dataclass
class StepEvent:
    """What one engine step did. Times are seconds; `t_start` / `t_end` are `time.perf_counter()` values (for
    traces), `wall_time` is `time.time()` at the end of the step."""

    step: int
    wall_time: float
    t_start: float
    t_end: float
    step_s: float
    schedule_s: float
    forward_s: float
    sample_s: float
    detokenize_s: float
    other_s: float  # the rest: drafting, building the model input, stop checks, outputs
    decodes: list[SeqWork]
    prefills: list[SeqWork]
    num_batched_tokens: int  # tokens fed this step
    token_budget: int  # the scheduler's max_num_batched_tokens
    max_num_seqs: int
    num_running: int
    num_waiting: int
    pool: BlockPool
    prefix_cache_queries: int  # this step
    prefix_cache_hits: int  # this step
    preempted: list[str]  # "request_id/index" of sequences preempted this step
    aborted: list[str]  # request ids aborted since the previous step
    finished: dict[str, str]  # request id -> finish reason, for requests that finished this step
    prompt_tokens: int  # prompt tokens computed this step (prefill chunk tokens)
    generated_tokens: int  # tokens appended to outputs this step
    tokens_per_s: float  # generated_tokens / step_s
    spec_proposed: int | None  # draft tokens verified this step (None: no speculative decoding)
    spec_accepted: int | None
    totals: EngineTotals
    spans: list[tuple[str, float, float]] = field(default_factory=list)  # (stage, start, end), perf_counter

    def to_dict(self, spans: bool = False) -> dict[str, Any]:
        """JSON-able dict; `spans` (every timed call of the step) only when asked. The event's lists are its own
        (built for this step), so they are shared with the dict, not copied (dataclasses.asdict deep-copies every
        block id: 10x slower)."""
        d = dict(vars(self))
        d["decodes"] = [dict(vars(w)) for w in self.decodes]
        d["prefills"] = [dict(vars(w)) for w in self.prefills]
        d["pool"] = dict(vars(self.pool))
        d["totals"] = dict(vars(self.totals))
        if spans:
            d["spans"] = [list(x) for x in self.spans]
        else:
            del d["spans"]
        return d


Listener = Callable[[StepEvent], None]


class _TimedSampler:
    """Stands in for the engine's sampler while observed: same call, timed."""

    def __init__(self, inner: Any, stream: EventStream):
        self.inner = inner
        self._stream = stream

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return self.inner(*args, **kwargs)
        finally:
            self._stream._span("sample", t)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class EventStream:
    """The listeners of one engine, and the machinery that observes its steps (see the module docstring)."""

    def __init__(self, detail_interval_s: float = 0.05):
        self.detail_interval_s = detail_interval_s
        self._listeners: tuple[Listener, ...] = ()
        self._lock = threading.Lock()
        self._installed: Any = None  # the engine whose stages are wrapped
        self._spans: list[tuple[str, float, float]] = []
        self._work: list[SeqWork] = []
        self._entries: list[Any] = []
        self._plan: Any = None
        self._last_detail = -float("inf")
        self.steps = 0
        self.dropped_listeners = 0

    @property
    def active(self) -> bool:
        """Whether anyone listens (or the wrappers still need removing)."""
        return bool(self._listeners) or self._installed is not None

    def subscribe(self, fn: Listener) -> None:
        """Call `fn(event)` after every step, in the engine's thread. Thread-safe."""
        with self._lock:
            self._listeners = (*self._listeners, fn)

    def unsubscribe(self, fn: Listener) -> None:
        """Stop calling `fn` (no-op when it is not subscribed). Thread-safe."""
        with self._lock:
            self._listeners = tuple(f for f in self._listeners if f != fn)

    @property
    def num_listeners(self) -> int:
        return len(self._listeners)

    # --- observing a step (engine thread) ---------------------------------------------------------
    def _span(self, name: str, start: float) -> None:
        self._spans.append((name, start, time.perf_counter()))

    def _install(self, engine: Any) -> None:
        stream = self
        sched, runner = engine.scheduler, engine.runner
        schedule, execute, detok = sched.schedule, runner.execute, engine._detokenize

        def timed_schedule() -> Any:
            t = time.perf_counter()
            plan = schedule()
            stream._span("schedule", t)
            stream._capture(plan)
            return plan

        def timed_execute(inp: Any) -> Any:
            stream._fed()
            t = time.perf_counter()
            try:
                return execute(inp)
            finally:
                stream._span("forward", t)

        def timed_detokenize(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return detok(*args, **kwargs)
            finally:
                stream._span("detokenize", t)

        sched.schedule = timed_schedule  # instance attributes shadow the methods; _uninstall deletes them
        runner.execute = timed_execute
        engine._detokenize = timed_detokenize
        engine.sampler = _TimedSampler(engine.sampler, self)
        self._installed = engine

    def _uninstall(self) -> None:
        engine, self._installed = self._installed, None
        for obj, name in ((engine.scheduler, "schedule"), (engine.runner, "execute"), (engine, "_detokenize")):
            obj.__dict__.pop(name, None)
        if isinstance(engine.sampler, _TimedSampler):
            engine.sampler = engine.sampler.inner

    def _capture(self, plan: Any) -> None:
        """Right after schedule(): who runs and from where (commit moves num_computed_tokens on)."""
        self._plan = plan
        self._entries = list(plan.scheduled)
        self._work = []
        for s in plan.scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            decode = s.num_new_tokens == 1 and start >= seq.num_prompt_tokens
            kind = "decode" if decode else "recompute" if seq.output_ids else "prefill"
            self._work.append(SeqWork(seq.request_id, seq.seq_id, seq.index, start, s.num_new_tokens,
                                      seq.num_prompt_tokens, s.samples, kind))

    def _fed(self) -> None:
        """Right before the forward: what is fed (a speculative verify feeds 1 + k tokens)."""
        for w, entry in zip(self._work, self._entries):
            if entry.num_new_tokens != w.num_tokens and w.kind == "decode":
                w.kind = "verify"
            w.num_tokens = entry.num_new_tokens
            w.samples = entry.samples

    def observe(self, engine: Any, step: Callable[[], list[Any]]) -> list[Any]:
        """Run `step()` (the engine's plain step) timed, then build the event and call the listeners."""
        listeners = self._listeners
        if not listeners:
            self._uninstall()
            return step()
        if self._installed is not engine:
            if self._installed is not None:
                self._uninstall()
            self._install(engine)
        self._spans, self._work, self._entries, self._plan = [], [], [], None
        before = self._counters(engine)
        aborted = [r.request_id for r in engine._aborted]
        t0 = time.perf_counter()
        outputs = step()
        t1 = time.perf_counter()
        try:
            event = self._build(engine, outputs, before, aborted, t0, t1)
        except Exception:  # an event is informational: never fail the step for it
            log.exception("building the step event failed")
            return outputs
        for fn in listeners:
            try:
                fn(event)
            except Exception:
                log.exception("engine event listener %r failed; unsubscribing it", fn)
                self.unsubscribe(fn)
                self.dropped_listeners += 1
        return outputs

    @staticmethod
    def _counters(engine: Any) -> tuple[int, ...]:
        bm, spec = engine.block_manager, engine.speculator
        return (bm.prefix_cache_queries, bm.prefix_cache_hits, engine._generation_tokens_total,
                spec.stats.drafted if spec is not None else 0, spec.stats.accepted if spec is not None else 0)

    def _build(self, engine: Any, outputs: list[Any], before: tuple[int, ...], aborted: list[str], t0: float,
               t1: float) -> StepEvent:
        self.steps += 1
        after = self._counters(engine)
        work = self._work
        decodes = [w for w in work if w.kind in ("decode", "verify")]
        prefills = [w for w in work if w.kind not in ("decode", "verify")]
        totals_s: dict[str, float] = {"schedule": 0.0, "forward": 0.0, "sample": 0.0, "detokenize": 0.0}
        for name, a, b in self._spans:
            totals_s[name] = totals_s.get(name, 0.0) + (b - a)
        step_s = t1 - t0
        other = step_s - sum(totals_s.values())
        sched, spec = engine.scheduler, engine.speculator
        now = time.perf_counter()
        # details at most every detail_interval_s, and always when the engine goes idle (the final picture is exact)
        detail = now - self._last_detail >= self.detail_interval_s or not engine.has_unfinished_requests()
        if detail:
            self._last_detail = now
        generated = after[2] - before[2]
        stats = engine.stats()
        plan = self._plan
        return StepEvent(
            step=self.steps, wall_time=time.time(), t_start=t0, t_end=t1, step_s=step_s,
            schedule_s=totals_s["schedule"], forward_s=totals_s["forward"], sample_s=totals_s["sample"],
            detokenize_s=totals_s["detokenize"], other_s=max(0.0, other),
            decodes=decodes, prefills=prefills, num_batched_tokens=sum(w.num_tokens for w in work),
            token_budget=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
            num_running=len(sched.running), num_waiting=len(sched.waiting),
            pool=pool_state(engine, detail),
            prefix_cache_queries=after[0] - before[0], prefix_cache_hits=after[1] - before[1],
            preempted=[f"{s.request_id}/{s.index}" for s in (plan.preempted if plan is not None else [])],
            aborted=aborted,
            finished={o.request_id: _reason(o) for o in outputs if o.finished},
            prompt_tokens=sum(max(0, min(w.num_tokens, w.prompt_len - w.start)) for w in prefills),
            generated_tokens=generated, tokens_per_s=generated / step_s if step_s > 0 else 0.0,
            spec_proposed=after[3] - before[3] if spec is not None else None,
            spec_accepted=after[4] - before[4] if spec is not None else None,
            totals=EngineTotals(stats.prompt_tokens_total, stats.generation_tokens_total, stats.prefix_cache_queries,
                                stats.prefix_cache_hits, stats.num_preemptions,
                                spec.stats.drafted if spec is not None else None,
                                spec.stats.accepted if spec is not None else None),
            spans=self._spans,
        )


def _reason(out: Any) -> str:
    reasons = sorted({c.finish_reason or "?" for c in out.outputs})
    return ",".join(reasons)


def pool_state(engine: Any, detail: bool = True) -> BlockPool:
    """The block pool of `engine` now; with `detail`, the map, the block tables and the shared-block census."""
    bm = engine.block_manager
    free = bm.num_free_blocks
    pool = BlockPool(bm.num_blocks, bm.block_size, free, bm.num_blocks - free)
    if not detail:
        return pool
    holders: dict[int, set[str]] = {}
    seqs = [s for s in engine.scheduler.running if s.block_table]
    for s in seqs:
        pool.tables[f"{s.request_id}/{s.index}"] = list(s.block_table)
        for b in s.block_table:
            holders.setdefault(b, set()).add(s.request_id)
    ref, hashes = bm.ref_count, bm.hash_of
    # one pass over the pool in a comprehension; the loop below touches only the running sequences' blocks
    cells = [USED if r else FREE if h is None else CACHED for r, h in zip(ref, hashes)]
    prefix = fork = 0
    for b, owners in holders.items():
        if ref[b] > 1:
            if len(owners) > 1:
                cells[b], prefix = SHARED_PREFIX, prefix + 1
            else:  # several references, all from one request's samples
                cells[b], fork = SHARED_FORK, fork + 1
    pool.map = "".join(cells)
    pool.cached_free, pool.shared_prefix, pool.shared_fork = pool.map.count(CACHED), prefix, fork
    return pool
