"""CPU-time variant of `benchmarks.common.compare`, shared by the autodiff benchmarks.

On the 2 shared cores here, wall-clock medians swing several-fold with other people's load. With torch pinned
to one thread all work runs on the calling thread, so that thread's CPU time (`time.thread_time`) measures
the work itself and is far less sensitive to contention. Reported next to the wall-clock tables, not instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from benchmarks.common import Comparison, Timing


def compare_cpu(contenders: dict[str, Callable[[], object]], warmup: int = 1, repeats: int = 5) -> Comparison:
    """Interleaved A B A B ... timings in thread CPU seconds, after `warmup` calls each."""
    for fn in contenders.values():
        for _ in range(warmup):
            fn()
    timings = {name: Timing(name) for name in contenders}
    for _ in range(repeats):
        for name, fn in contenders.items():
            t0 = time.thread_time()
            fn()
            timings[name].times.append(time.thread_time() - t0)
    return Comparison(list(timings.values()))


def main() -> int:
    print("helper module for benchmarks.autodiff_lm_step and benchmarks.autodiff_fused; run those")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
