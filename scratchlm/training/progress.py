"""The training progress bar: progress and ETA against the budget that will actually end the run.

A run stops at `max_steps` (or `stop_at_step`) or when `max_time_s` of wall clock is spent, whichever
comes first. The bar therefore shows ``max(step / last_step, elapsed / max_time_s)`` and the smaller of
the two ETAs (steps left at this process's measured step rate, or seconds left in the budget), and says
which budget it is counting against; a time-budgeted run ends at 100 %, not at 2 % of max_steps.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """Where a run stands: `fraction` in [0, 1], `eta_s` (None before a rate is known), `limit` "steps"|"time"."""

    fraction: float
    eta_s: float | None
    limit: str


def run_progress(step: int, last_step: int, elapsed_s: float, max_time_s: float | None,
                 steps_per_s: float | None) -> Progress:
    """Progress of a run at `step` of `last_step` after `elapsed_s` (including resumed time)."""
    by_steps = min(1.0, step / last_step) if last_step > 0 else 1.0
    eta_steps = (last_step - step) / steps_per_s if steps_per_s else None
    if max_time_s is None:
        return Progress(by_steps, eta_steps, "steps")
    by_time = min(1.0, elapsed_s / max_time_s) if max_time_s > 0 else 1.0
    eta_time = max(0.0, max_time_s - elapsed_s)
    if eta_steps is not None and eta_steps < eta_time:
        return Progress(max(by_steps, by_time), eta_steps, "steps")
    return Progress(max(by_steps, by_time), eta_time, "time")


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


class ProgressBar:
    """A tqdm bar in per-mille of the run, with the step, the ETA and the binding budget in its text."""

    RESOLUTION = 1000

    def __init__(self, last_step: int, max_time_s: float | None, start_step: int, disable: bool):
        from tqdm.auto import tqdm

        self.last_step = last_step
        self.max_time_s = max_time_s
        self.start_step = start_step
        self.bar = tqdm(total=self.RESOLUTION, disable=disable, desc="train", dynamic_ncols=True,
                        bar_format="{desc}: {percentage:3.0f}%|{bar}| {postfix}")
        self.val_loss: float | None = None  # the latest validation loss, kept in the bar's text

    def write(self, line: str) -> None:
        """Print `line` to stdout above the bar (the bar is redrawn below it, not overwritten by it)."""
        if self.bar.disable:
            print(line, flush=True)
        else:
            self.bar.write(line, file=sys.stdout)

    def update(self, step: int, elapsed_s: float, run_s: float, **stats: str) -> Progress:
        """`elapsed_s` counts resumed time (the budget's clock); `run_s` is this process's time (the rate's)."""
        done_here = step - self.start_step
        rate = done_here / run_s if run_s > 0 and done_here > 0 else None
        p = run_progress(step, self.last_step, elapsed_s, self.max_time_s, rate)
        self.bar.n = round(p.fraction * self.RESOLUTION)
        budget = f"time budget {self.max_time_s:.0f} s" if p.limit == "time" else f"{self.last_step} steps"
        text = f"step {step}, {format_eta(p.eta_s)} left ({budget})"
        if self.val_loss is not None:
            stats = {**stats, "val_loss": f"{self.val_loss:.4f}"}
        if stats:
            text += ", " + ", ".join(f"{k}={v}" for k, v in stats.items())
        self.bar.set_postfix_str(text, refresh=False)
        self.bar.refresh()
        return p

    def close(self) -> None:
        self.bar.close()
