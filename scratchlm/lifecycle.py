"""Child processes die with their parent.

Every process scratchlm starts (the engine process of `serve --engine-process`, tensor/pipeline ranks, DP
replicas) calls `die_with_parent(parent_pid)` first thing, or is started with `preexec_fn=die_with_parent`.
On Linux this asks the kernel to send SIGTERM when the parent thread exits (``PR_SET_PDEATHSIG``), then closes
the race where the parent died before the request: if the parent is already gone, the child exits at once.
Elsewhere it logs, once, that orphans are possible (the watched-pipe fallback is the caller's business).

The signal goes to the child when the *thread* that forked it exits; scratchlm forks from the main thread or
from long-lived threads that live as long as the process.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None, sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to this process when its parent exits; exit now if it already has.

    `parent_pid` is the pid the caller expects as parent (default: the current parent). Returns True when the
    request was registered, False where the platform has no such request (logged)."""
    expected = os.getppid() if parent_pid is None else parent_pid
    if not sys.platform.startswith("linux"):
        log.warning("%s has no PR_SET_PDEATHSIG: this process will outlive its parent if the parent is killed",
                    sys.platform)
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        log.warning("prctl(PR_SET_PDEATHSIG) failed: %s", os.strerror(err))
        return False
    if os.getppid() != expected:  # the parent died before the request: the kernel will never send the signal
        os._exit(1)
    return True
