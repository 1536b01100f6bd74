"""How many CPU threads torch uses: one policy for `serve`, `chat`, `generate`, `train` and `LLM(...)`.

Policy (first match wins):

1. an explicit count (``--threads N``, ``LLM(..., threads=N)``, ``threads = N`` in a train config);
2. ``$OMP_NUM_THREADS``, when set (torch reads it too; we only report it);
3. otherwise **free cores per rank**: the physical cores this process may run on, minus the machine's
   1-minute load average (rounded), divided by the ranks this command starts on this machine (under
   torchrun: ``$LOCAL_WORLD_SIZE``), and at least 1.

Why not torch's own default (one thread per physical core)? On a busy machine a gang of OpenMP threads
that outnumbers the free cores waits at every barrier for a thread the OS has descheduled: on a shared
2-core machine `scratchlm generate` ran 2.5 tok/s with torch's 2 threads and 27 tok/s with one. On an
idle machine the load is ~0 and the policy gives torch's default. The measurement behind the choice is
``benchmarks/threads.py`` (results in docs/foundation.md); a start-up probe (time a GEMV at each count,
keep the fastest) is measured there too and is available as :func:`probe_threads`, but it is not the
default: it costs start-up time and reads the same noise the load average smooths out.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("scratchlm.threads")


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count chosen and why (the why goes in the start-up log)."""

    threads: int
    reason: str

    def __str__(self) -> str:
        return f"{self.threads} torch thread{'s' if self.threads != 1 else ''} ({self.reason})"


def usable_cpus() -> set[int]:
    """Logical CPUs this process may run on (its affinity mask; cgroup-pinned containers included)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int] | None = None, cpuinfo: str | None = None) -> int:
    """Physical cores among `cpus` (default: the usable ones): distinct (physical id, core id) pairs in
    /proc/cpuinfo, so SMT siblings count once. Falls back to the number of logical CPUs."""
    cpus = usable_cpus() if cpus is None else cpus
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return max(1, len(cpus))
    cores: set[tuple[str, str]] = set()
    for block in cpuinfo.strip().split("\n\n"):
        fields = {}
        for line in block.splitlines():
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
        try:
            cpu = int(fields["processor"])
        except (KeyError, ValueError):
            continue
        if cpu in cpus:
            cores.add((fields.get("physical id", "0"), fields.get("core id", str(cpu))))
    return max(1, len(cores)) if cores else max(1, len(cpus))


def load_average() -> float:
    """The 1-minute load average (0.0 where the OS has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def choose_threads(requested: int | None = None, *, world_size: int = 1, cores: int | None = None,
                   load: float | None = None, env: dict[str, str] | None = None) -> ThreadChoice:
    """The thread count for one rank of a command that starts `world_size` ranks on this machine.

    `cores` (physical cores usable), `load` (1-minute load average) and `env` are read from the machine
    when None; tests inject them. Raises ValueError on a non-positive request or a bad $OMP_NUM_THREADS.
    """
    if requested is not None:
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"threads={requested!r} (expected a positive integer)")
        return ThreadChoice(requested, "--threads")
    env = os.environ if env is None else env
    omp = env.get("OMP_NUM_THREADS")
    if omp:
        try:
            n = int(omp)
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"OMP_NUM_THREADS={omp!r} (expected a positive integer)")
        return ThreadChoice(n, "OMP_NUM_THREADS")
    local = env.get("LOCAL_WORLD_SIZE")  # torchrun: the processes on this machine, whatever the world is
    if local:
        try:
            world_size = max(1, int(local))
        except ValueError:
            raise ValueError(f"LOCAL_WORLD_SIZE={local!r} (expected a positive integer)") from None
    if world_size < 1:
        raise ValueError(f"world_size={world_size} (expected a positive integer)")
    cores = physical_cores() if cores is None else cores
    load = load_average() if load is None else load
    busy = min(cores, int(load + 0.5))  # round half up: a core 60 % busy is not free
    free = max(1, cores - busy)
    threads = max(1, free // world_size)
    per = f" over {world_size} ranks" if world_size > 1 else ""
    return ThreadChoice(threads, f"{cores} physical core{'s' if cores != 1 else ''}, load {load:.2f}, "
                                 f"{free} free{per}")


def apply_threads(requested: int | None = None, *, world_size: int = 1, logger: logging.Logger | None = None,
                  keep_caller_setting: bool = False, **machine) -> ThreadChoice:
    """Choose with :func:`choose_threads`, set ``torch.set_num_threads`` and log the choice.

    With `keep_caller_setting` (the library entry points, e.g. ``LLM(...)``), a thread count the calling
    program already set with ``torch.set_num_threads`` (one that differs from torch's start-up default,
    one per physical core) is kept unless `requested` is given: a library does not override its host."""
    import torch

    env = os.environ if machine.get("env") is None else machine["env"]
    if keep_caller_setting and requested is None and not env.get("OMP_NUM_THREADS"):
        current = torch.get_num_threads()
        if current != physical_cores():
            choice = ThreadChoice(current, "set by the caller with torch.set_num_threads")
            (logger or log).info("using %s", choice)
            return choice
    choice = choose_threads(requested, world_size=world_size, **machine)
    torch.set_num_threads(choice.threads)
    (logger or log).info("using %s", choice)
    return choice


def probe_threads(candidates: list[int] | None = None, size: int = 1024, repeats: int = 5) -> int:
    """The fastest thread count among `candidates` for a `size` x `size` float32 GEMV (decode's shape),
    timed interleaved after a warm-up; restores the thread count it found. About 10-50 ms."""
    import torch

    before = torch.get_num_threads()
    candidates = candidates or sorted({1, physical_cores()})
    w = torch.randn(size, size)
    x = torch.randn(size, 8)
    best: dict[int, float] = {n: float("inf") for n in candidates}
    try:
        for n in candidates:
            torch.set_num_threads(n)
            w @ x
        for _ in range(repeats):
            for n in candidates:
                torch.set_num_threads(n)
                t0 = time.perf_counter()
                for _ in range(8):
                    w @ x
                best[n] = min(best[n], time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return min(candidates, key=lambda n: best[n])


def add_threads_argument(parser, what: str = "") -> None:
    """The ``--threads`` flag every command shares."""
    parser.add_argument("--threads", type=int, default=None, metavar="N",
                        help="torch CPU threads" + (f" {what}" if what else "") + "; default: the physical cores "
                             "not busy by the 1-minute load average, split over the ranks (at least 1), or "
                             "$OMP_NUM_THREADS when set; the choice is logged at start-up (docs/foundation.md)")
