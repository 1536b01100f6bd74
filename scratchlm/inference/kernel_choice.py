"""Which kernel multiplies the fp32 linears, chosen on this machine by a short measurement at first use.

As oneDNN and llama.cpp choose their kernels per ISA, the engine's fp32 linears choose per *shape class* among:

- ``panel``: csrc/panel_gemm.h over the panels (the engine's only copy of the weights; AVX-512, AVX2 or scalar);
- ``skinny``: csrc/skinny_gemm.h's tiles over the plain (N, K) weight (decode batches, up to 64 rows);
- ``mkl``: ATen's mm (MKL) over the plain weight;
- ``onednn``: oneDNN's matmul over a copy prepacked in its blocked layout (what vLLM-CPU runs).

Policy:

- A shape class is (row bucket of M: 1, 2-4, 5-8, 9-16, 17-32, 33-64, 65-128, 129-256, 257+; K; ceil(log2 N));
  csrc/panel_gemm.h defines the buckets and holds the table that both the fused C++ step and `PanelLinear` read.
- First use of a class (the C++ table calls back here, the GIL taken): each candidate multiplies random weights of
  the class's K and N by the bucket's largest M rows (512 for the last): decode-sized rows over copies of the weight
  read in turn (`shape_of_measurement`: ~13 MiB per candidate with a 32 MiB L3, so that the weights come from
  memory for milliseconds, as over a real step's layers, where one cold call's ramp-up misleads), larger rows over
  one weight of N capped so that a call is ~2e8 FLOP; one warm-up, then the best of ``REPEATS`` rounds, the
  candidates' order rotated each round (the others' weights evict a candidate's before it runs again), timed in
  thread CPU time with one torch thread (wall time with more). Tens of milliseconds per class. Weights under
  ``MIN_WEIGHT`` elements are not measured (the panel kernel; nothing there is worth a measurement).
- A kernel other than ``panel`` needs a second copy of the weights (plain or prepacked, made the first time a class
  of that weight chooses it): it is chosen only when it is ``MARGIN`` (10 %) faster than the panel kernel, in two
  measurement rounds (new weights; the second of ``CONFIRM_REPEATS``) both (a short measurement of decode sizes
  swings by several per cent; at 5 % the skinny tiles were chosen at 4 rows under the AVX2 cap where
  benchmarks/fp32_gemm.py then measured them 7 % slower). ``SCRATCHLM_FP32_KERNEL=panel`` keeps the one copy whatever
  the measurement says.
- The choices are cached in a small JSON file per (CPU model, ISA cap of scratchlm and of torch's oneDNN / MKL /
  ATen, the kernels' build, torch version, threads, the policy's constants) under the kernel build directory,
  written atomically (a temporary file renamed over it, under a lock, merged with what another process wrote
  meanwhile). A file that cannot be read or does not have the expected shape is ignored with a warning (and
  replaced at the next write).
- Each choice is logged once per process (INFO): when it is measured, and for a cached table one line on load.
- ``$SCRATCHLM_FP32_KERNEL`` = panel | skinny | mkl | onednn forces one kernel for every class (benchmarks, tests;
  ``auto`` or unset: the measured choice); `force()` does the same at run time.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

KERNELS = ("panel", "skinny", "mkl", "onednn")  # ids as csrc/panel_gemm.h's Fp32Kernel
FORCE_ENV = "SCRATCHLM_FP32_KERNEL"
MARGIN = 1.10  # a kernel that needs a second copy of the weights must be this much faster than the panel kernel
REPEATS = 4  # timed calls per candidate (best of)
CONFIRM_REPEATS = 12  # the second round, when a kernel other than the panel kernel won the first
FLOP_BUDGET = 2e8  # per measured call: N (and copies) capped so that 2 * M * K * N stays under it (~2 ms)
STREAM_BYTES = 8 << 20  # decode-sized rows: weight copies until at least this many bytes stream per call
DECODE_COLUMNS = 8192  # decode-sized rows: at most this many columns per copy
MIN_WEIGHT = 1 << 16  # K * N below this: no measurement, the panel kernel
SKINNY_MAX_ROWS = 64  # the skinny tiles are a decode kernel
CACHE_VERSION = 1
ISA_ENVS = ("SCRATCHLM_ISA", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY")


@dataclass
class Choice:
    """The measured kernel of one shape class and every candidate's GFLOP/s there."""

    kernel: str
    rows: int  # the M measured (the bucket's largest)
    n: int  # the N measured (the class's N, capped by FLOP_BUDGET)
    gflops: dict[str, float]


def cpu_model() -> str:
    """The CPU's model name with its family / model / stepping (what /proc/cpuinfo says; platform's elsewhere)."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "stepping") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:
                break
    if not fields:
        return platform.processor() or platform.machine()
    name, family = fields.get("model name", "?"), fields.get("cpu family", "?")
    return f"{name} (family {family} model {fields.get('model', '?')} stepping {fields.get('stepping', '?')})"


def last_level_cache_bytes() -> int:
    """The largest data/unified cache of CPU 0 (sysfs), 32 MiB if unknown."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        with contextlib.suppress(OSError, ValueError):
            if (index / "type").read_text().strip() == "Instruction":
                continue
            size = (index / "size").read_text().strip()
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
            best = max(best, int(size.rstrip("KMG")) * scale)
    return best or 32 << 20


def cache_identity(ext) -> dict[str, Any]:
    """What the choices depend on: CPU model, ISA caps, the kernels' build, torch, threads, this module's policy."""
    from scratchlm.inference.cpp_extensions import ENGINE_KERNELS

    return {"cpu": cpu_model(), "isa": ext.isa_name(), "caps": {e: os.environ.get(e, "") for e in ISA_ENVS},
            "build": ENGINE_KERNELS.content_hash(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "policy": {"version": CACHE_VERSION, "margin": MARGIN, "repeats": [REPEATS, CONFIRM_REPEATS]}}


def cache_path(ext, root: Path | None = None) -> Path:
    """The cache file of this machine's identity (under the kernel build directory unless `root` is given)."""
    from scratchlm.inference.cpp_extensions import build_dir

    ident = json.dumps(cache_identity(ext), sort_keys=True)
    digest = hashlib.sha1(ident.encode()).hexdigest()[:16]
    return (root or build_dir() / "fp32_choice") / f"fp32-choice-{digest}.json"


def class_key(bucket: int, k: int, n_class: int) -> str:
    return f"b{bucket}/k{k}/n{n_class}"


def _parse_key(key: str) -> tuple[int, int, int]:
    b, k, n = key.split("/")
    if not (b.startswith("b") and k.startswith("k") and n.startswith("n")):
        raise ValueError(f"bad class key {key!r}")
    return int(b[1:]), int(k[1:]), int(n[1:])


def read_cache(path: Path) -> dict[str, Choice]:
    """The choices stored in `path`; {} (with a warning naming the file and the problem) if it is unreadable or
    malformed, {} silently if it does not exist."""
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if data.get("version") != CACHE_VERSION:
            raise ValueError(f"version {data.get('version')!r}, expected {CACHE_VERSION}")
        out = {}
        for key, c in data["classes"].items():
            _parse_key(key)
            if c["kernel"] not in KERNELS:
                raise ValueError(f"unknown kernel {c['kernel']!r}")
            out[key] = Choice(c["kernel"], int(c["rows"]), int(c["n"]),
                              {str(k): float(v) for k, v in c["gflops"].items()})
        return out
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        log.warning("fp32 kernel choice: ignoring the cache file %s (%s: %s); the classes are measured again",
                    path, type(e).__name__, e)
        return {}


def write_cache(path: Path, ident: dict[str, Any], choices: dict[str, Choice]) -> None:
    """Merge `choices` into `path` atomically: under an flock, re-read (another process may have added classes),
    write a temporary file beside it and rename it over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        merged = read_cache(path) if path.exists() else {}
        merged.update(choices)
        data = {"version": CACHE_VERSION, "identity": ident,
                "classes": {k: {"kernel": c.kernel, "rows": c.rows, "n": c.n,
                                "gflops": {n: round(g, 2) for n, g in c.gflops.items()}}
                            for k, c in sorted(merged.items())}}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def decide(gflops: dict[str, float]) -> str:
    """The kernel of measured rates: the fastest, unless it is not the panel kernel and not MARGIN faster than it."""
    best = max(gflops, key=gflops.__getitem__)
    if best != "panel" and "panel" in gflops and gflops[best] < MARGIN * gflops["panel"]:
        return "panel"
    return best


def candidates(ext, x: torch.Tensor, ws: list[torch.Tensor]) -> dict[str, Callable[[], Any]]:
    """Each kernel multiplying x (M, K) by every w (N, K)^T of `ws` in turn, the weights in the layout it reads, in
    memory of its own (no candidate finds another's weights in cache)."""
    n = ws[0].shape[0]
    panels = ext.panel_pack_groups([[w] for w in ws])  # one huge-page buffer, as the engine packs its linears
    out: dict[str, Callable[[], Any]] = {"panel": lambda: [ext.panel_linear(x, p, [n], True, 0) for p in panels]}
    if x.shape[0] <= SKINNY_MAX_ROWS:
        out["skinny"] = lambda: [ext.skinny_linear(x, w) for w in ws]
    own = [w.clone() for w in ws]  # MKL's own copies: after the skinny tiles it would find their weights in cache
    out["mkl"] = lambda: [torch.mm(x, w.t()) for w in own]
    if ext.fp32_onednn_available():
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in ws]
        out["onednn"] = lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "") for p in packed]
    return out


def flush_buffer(nbytes: int | None = None) -> torch.Tensor:
    """A buffer whose read evicts the caches (1.25x the last-level cache unless `nbytes`), written so it is real."""
    return torch.ones((nbytes or last_level_cache_bytes() * 5 // 4) // 4)


def clock() -> Callable[[], float]:
    """The timer of a measurement: this thread's CPU time with one torch thread (a neighbour's time slices are not
    counted: the machines this runs on are often shared), wall time with several."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def time_candidates(fns: dict[str, Callable[[], Any]], repeats: int,
                    flush: torch.Tensor | None = None) -> dict[str, float]:
    """Best seconds of each candidate: one warm-up each, then `repeats` rounds of one call each, the order rotated
    every round (a candidate runs again only after all the others: their weights evict its own when together they
    exceed the last-level cache, `shape_of_measurement`); a read of `flush` before each call if given."""
    best = dict.fromkeys(fns, float("inf"))
    names = list(fns)
    now = clock()
    with torch.inference_mode():
        for fn in fns.values():
            fn()  # warm-up: first-call set-up (oneDNN's primitive cache), page faults
        for r in range(repeats):
            for name in names[r % len(names):] + names[: r % len(names)]:
                if flush is not None:
                    flush.sum()
                t0 = now()
                fns[name]()
                best[name] = min(best[name], now() - t0)
    return best


def measure(ext, rows: int, k: int, n: int, repeats: int = REPEATS, copies: int = 1,
            flush: torch.Tensor | None = None, seed: int = 0) -> dict[str, float]:
    """GFLOP/s of every candidate for `rows` x `k` against `copies` different (n, k) weights in turn
    (`time_candidates`)."""
    g = torch.Generator().manual_seed(seed)
    base = torch.empty(n, k).uniform_(-(3 / k) ** 0.5, (3 / k) ** 0.5, generator=g)  # unit-variance products
    ws = [base] + [base.clone() for _ in range(copies - 1)]  # distinct memory, the same values
    x = torch.empty(rows, k).uniform_(-1.0, 1.0, generator=g)
    best = time_candidates(candidates(ext, x, ws), repeats, flush)
    return {name: 2.0 * rows * k * n * copies / t / 1e9 for name, t in best.items()}


def shape_of_measurement(rows: int, k: int, n: int) -> tuple[int, int]:
    """(N measured, copies of the weight) for a class. Decode-sized rows (<= SKINNY_MAX_ROWS): copies of a weight of
    at most DECODE_COLUMNS columns, read in turn, enough that each candidate streams a third of 1.25x the
    last-level cache (at least STREAM_BYTES): the weights stream from memory for milliseconds, as over a real
    step's layers (one cold call's ramp-up misleads), and the other candidates' calls between two of one
    candidate evict its weights; at most FLOP_BUDGET per call. Larger rows: one weight of N capped to FLOP_BUDGET
    (compute-bound: the columns' rate is the same, and the weights are reused across the rows from cache anyway)."""
    if rows <= SKINNY_MAX_ROWS:
        n_meas = min(n, DECODE_COLUMNS)
        per_candidate = max(STREAM_BYTES, last_level_cache_bytes() * 5 // 12)
        copies = -(-per_candidate // (4 * k * n_meas))
        copies = max(1, min(copies, int(FLOP_BUDGET // (2 * rows * k * n_meas))))
        return n_meas, copies
    return min(n, max(256, int(FLOP_BUDGET / (2 * rows * k)) // 16 * 16)), 1


class Chooser:
    """The measured table of this process: measures a class at first use (the C++ table calls `_measure_class`),
    caches the choices in `path`, and logs each once."""

    def __init__(self, ext, path: Path | None = None):
        self.ext = ext
        self.path = path or cache_path(ext)
        self.ident = cache_identity(ext)
        self.tops = list(ext.fp32_row_buckets())
        self.choices = read_cache(self.path)
        self._lock = threading.Lock()
        for key, c in self.choices.items():
            b, k, ncls = _parse_key(key)
            if b < len(self.tops):
                ext.fp32_set_choice(b, k, ncls, KERNELS.index(c.kernel))
        if self.choices:
            others = {key: c.kernel for key, c in self.choices.items() if c.kernel != "panel"}
            log.info("fp32 linears: %d shape classes' kernels from %s (not the panel kernel: %s)", len(self.choices),
                     self.path, others or "none")

    def rows_of(self, bucket: int) -> int:
        """The M a bucket is measured at: its largest (512 for the open last one)."""
        top = self.tops[bucket]
        return 512 if top < 0 else top

    def measure_class(self, bucket: int, k: int, n: int) -> Choice:
        """Measure the candidates for the class of `bucket`, K = k and N = n (`shape_of_measurement`)."""
        rows = self.rows_of(bucket)
        n_meas, copies = shape_of_measurement(rows, k, n)
        rates = measure(self.ext, rows, k, n_meas, copies=copies)
        kernel = decide(rates)
        if kernel != "panel":  # a second copy of the weights is at stake: a longer second round must agree
            again = measure(self.ext, rows, k, n_meas, repeats=CONFIRM_REPEATS, copies=copies, seed=1)
            if decide(again) != kernel:
                kernel = "panel"
            rates = {name: max(r, again[name]) for name, r in rates.items()}
        return Choice(kernel, rows, n_meas, rates)

    def _measure_class(self, bucket: int, k: int, n: int) -> int:
        """The C++ table's callback: the kernel id of a class met for the first time (measured and cached)."""
        _, ncls = self.ext.fp32_shape_class(self.rows_of(bucket), n)
        key = class_key(bucket, k, ncls)
        with self._lock:
            if key not in self.choices:
                if k * n < MIN_WEIGHT:
                    return KERNELS.index("panel")
                c = self.measure_class(bucket, k, n)
                self.choices[key] = c
                rates = ", ".join(f"{name} {g:.1f}" for name, g in sorted(c.gflops.items(), key=lambda i: -i[1]))
                log.info("fp32 linears: %s for %d rows x K %d x N %d (class %s; GFLOP/s %s)", c.kernel, c.rows, k, n,
                         key, rates)
                try:
                    write_cache(self.path, self.ident, {key: c})
                except OSError as e:
                    log.warning("fp32 kernel choice: could not write %s (%s); the choice holds for this process",
                                self.path, e)
            return KERNELS.index(self.choices[key].kernel)


_CHOOSERS: dict[int, Chooser] = {}
_CHOOSER_LOCK = threading.Lock()


def chooser(ext) -> Chooser:
    """This process's Chooser for the kernel module `ext`, made (cache read, C++ callback set) on first call."""
    with _CHOOSER_LOCK:
        c = _CHOOSERS.get(id(ext))
        if c is None:
            c = _CHOOSERS[id(ext)] = Chooser(ext)
            ext.fp32_set_measurer(c._measure_class)
        return c


def kernel_for(ext, rows: int, k: int, n: int) -> str:
    """The kernel `rows` x `k` against `n` columns run (the forced one, the table's, or measured now)."""
    if id(ext) not in _CHOOSERS:
        chooser(ext)
    return KERNELS[ext.fp32_kernel_for(rows, k, n)]


def force(ext, kernel: str | None) -> str | None:
    """Run `kernel` for every class (None: the measured choice); returns the previous setting."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"fp32 kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    old = ext.fp32_force_kernel(-1 if kernel is None else KERNELS.index(kernel))
    return None if old < 0 else KERNELS[old]
