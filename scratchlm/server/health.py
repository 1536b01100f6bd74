"""What `/health` means, how a hung engine is detected, and the exit codes a supervisor acts on.

`/health` answers 200 only when **a step can run now**: the model is loaded (the server listens only
after that) and every part a step needs shows a recent sign of life:

- the **engine loop** (the thread of `EngineLoop`, or the main loop of the engine process) beats on every
  iteration, also while it waits for work (every `idle_poll_s`, 50 ms); while it is inside a step it does
  not beat, and the step's own clock applies instead (below);
- the **engine process** (`--engine-process`) has a heartbeat thread that sends a beat to the HTTP process
  every `interval_s`, during steps too, so a stopped (SIGSTOP) or frozen process goes stale even mid-step;
- every **tensor/pipeline rank** spawned by `scratchlm.parallel.launch` beats from a thread (a counter in
  rank 0's store, every 0.5 s), and rank 0 records when each counter last moved.

A part is **stale** when its last sign of life is older than `heartbeat_timeout_s` (default 5 s, at least
ten beats): `/health` answers 503 with a JSON body naming each stale part and for how long
(``{"status": "unhealthy", "stale": [{"part": "engine process", "seconds": 6.1}], ...}``).

The engine is **hung** when a part has been silent for `step_timeout_s` (default 120 s), or a step has run
longer than `step_timeout_s` (the first step, which may build kernels or warm caches, gets
`first_step_timeout_s`, default 600 s). Then the requests in flight fail with `engine_loop.EngineHungError` (a
503 JSON body, or an error event on a stream), `/health` says ``"status": "hung"``, and the server exits
with `EXIT_ENGINE_HUNG` so that a supervisor restarts it. An engine process or rank that *dies* (or a
step collective that fails) ends the server with `EXIT_ENGINE_FAILED`.

Exit codes of `scratchlm serve` (docs/cluster.md says what a supervisor should do with each):

====  ======================  ==========================================================================
code  name                    meaning
====  ======================  ==========================================================================
0     EXIT_OK                 stopped on request (SIGTERM, Ctrl-C): children stopped, nothing to restart
1     (Python's)              an unexpected error in the server itself (a bug: see the log)
2     EXIT_USAGE              bad flags, model not found or not loadable, port taken: restarting will not help
3     EXIT_ENGINE_FAILED      the engine process or a TP/PP rank died, or a step collective failed
4     EXIT_ENGINE_HUNG        no heartbeat or no step progress within --step-timeout-s
====  ======================  ==========================================================================
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_ENGINE_FAILED = 3
EXIT_ENGINE_HUNG = 4

FailureCallback = Callable[[str, int], None]  # (message, exit code): the server stops and exits with the code


@dataclass(frozen=True)
class HealthConfig:
    """The bounds of the health check (each one a `scratchlm serve` flag, through `ServerConfig`)."""

    heartbeat_timeout_s: float = 5.0
    step_timeout_s: float = 120.0
    first_step_timeout_s: float = 600.0

    @property
    def interval_s(self) -> float:
        """How often heartbeats are sent and the watchdog looks: at least ten times per `heartbeat_timeout_s`."""
        return min(0.5, self.heartbeat_timeout_s / 10)

    @classmethod
    def from_server(cls, config: Any) -> HealthConfig:
        """The bounds of a `ServerConfig` (its defaults for a config object without them)."""
        names = ("heartbeat_timeout_s", "step_timeout_s", "first_step_timeout_s")
        return cls(**{n: getattr(config, n) for n in names if hasattr(config, n)})


@dataclass
class HealthReport:
    """One look at the engine: what `/health` answers."""

    status: str  # "ok", "unhealthy" (stale part: 503, may recover), "hung" / "failed" (503, the server is exiting)
    ages: dict[str, float] = field(default_factory=dict)  # part -> seconds since its last sign of life
    stale: list[tuple[str, float]] = field(default_factory=list)  # (part, seconds) older than the timeout
    step_running_s: float | None = None  # how long the current step has run (None between steps)
    steps: int = 0
    reason: str = ""  # why it is not ok (one line)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def body(self, config: HealthConfig) -> dict:
        """The JSON body of `/health`."""
        out: dict[str, Any] = {"status": self.status, "steps": self.steps,
                               "heartbeat_age_s": {k: round(v, 3) for k, v in self.ages.items()},
                               "step_running_s": None if self.step_running_s is None else round(self.step_running_s, 3),
                               "limits_s": {"heartbeat_timeout": config.heartbeat_timeout_s,
                                            "step_timeout": config.step_timeout_s,
                                            "first_step_timeout": config.first_step_timeout_s}}
        if not self.ok:
            out["stale"] = [{"part": part, "seconds": round(age, 3)} for part, age in self.stale]
            out["reason"] = self.reason
            out["error"] = {"message": f"the engine is not healthy: {self.reason}", "type": "service_unavailable",
                            "param": None, "code": "engine_" + self.status}
        return out


def assess(config: HealthConfig, ages: dict[str, float], step_running_s: float | None, steps: int,
           failure: str | None = None, failure_status: str = "failed") -> tuple[HealthReport, str | None]:
    """Judge one look: `ages` of the parts that must be fresh now, the current step's running time. Returns the
    report and, when the engine is newly found hung, the message to fail the requests with (else None). An engine
    already given up (`failure`) is reported as `failure_status` ("hung" or "failed")."""
    if failure is not None:
        return HealthReport(failure_status, ages, [], step_running_s, steps, failure), None
    stale = sorted(((p, a) for p, a in ages.items() if a > config.heartbeat_timeout_s), key=lambda x: -x[1])
    first = steps == 0
    step_limit = config.first_step_timeout_s if first else config.step_timeout_s
    hung = None
    if step_running_s is not None and step_running_s > step_limit:
        hung = (f"the {'first ' if first else ''}engine step has run for {step_running_s:.1f} s, past "
                f"--{'first-' if first else ''}step-timeout-s {step_limit:g}")
    silent = [(p, a) for p, a in stale if a > config.step_timeout_s]
    if hung is None and silent:
        hung = "; ".join(f"{p} sent no heartbeat for {a:.1f} s" for p, a in silent) + \
            f" (past --step-timeout-s {config.step_timeout_s:g})"
    if hung is not None:
        return HealthReport("hung", ages, stale, step_running_s, steps, hung), \
            f"the engine is hung: {hung}; the server exits so that a supervisor restarts it"
    if stale:
        reason = "; ".join(f"no heartbeat from {p} for {a:.1f} s" for p, a in stale) + \
            f" (stale after --heartbeat-timeout-s {config.heartbeat_timeout_s:g})"
        return HealthReport("unhealthy", ages, stale, step_running_s, steps, reason), None
    return HealthReport("ok", ages, [], step_running_s, steps), None


def monotonic() -> float:
    """The clock every heartbeat uses (system-wide on Linux, so a child's and its parent's readings compare)."""
    return time.monotonic()


def watch(stop: threading.Event, interval_s: float, look: Callable[[], tuple[HealthReport, str | None]],
          on_hung: Callable[[str], None]) -> None:
    """The watchdog (run in its own thread): `look()` every `interval_s` until `stop` is set; the first time it
    finds the engine hung, call `on_hung(message)` and return."""
    while not stop.wait(interval_s):
        report, hung = look()
        if report.status in ("failed", "hung") and hung is None:  # given up already (a dead process or rank)
            return
        if hung is not None:
            on_hung(hung)
            return
