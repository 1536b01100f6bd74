"""What a run reports: JSONL metrics, the loss-curve PNG, the measured matmul peak and MFU."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch

from scratchlm import atomic


class MetricsLog:
    """Append-only JSONL log (one JSON object per line, flushed at once)."""

    def __init__(self, path: str | Path, enabled: bool = True):
        self.path = Path(path)
        self.enabled = enabled
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict[str, Any]]:
        """The records; a line cut short by a crash mid-write (not valid JSON) is skipped."""
        return self._parse()[0]

    def _parse(self) -> tuple[list[dict[str, Any]], int]:
        if not self.path.is_file():
            return [], 0
        records, bad = [], 0
        for line in self.path.read_text(encoding="utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
        return records, bad

    def truncate_after(self, step: int) -> int:
        """Drop the records of steps after `step` (and torn lines) by rewriting the file atomically; returns
        how many records were dropped. A run resumed from a checkpoint of `step` calls this, so that the steps
        between that checkpoint and a crash are not logged twice."""
        if not self.enabled or not self.path.is_file():
            return 0
        records, bad = self._parse()
        kept = [r for r in records if not isinstance(r.get("step"), int) or r["step"] <= step]
        dropped = len(records) - len(kept) + bad
        if dropped:
            atomic.write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        return dropped


def plot_loss_curve(records: list[dict[str, Any]], path: str | Path, title: str = "training loss") -> Path | None:
    """Train loss (and validation loss) against step, as a PNG written atomically; None if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r and not r.get("final")]
    final = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r and r.get("final")]
    if not train and not val and not final:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", linewidth=1.0)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss (periodic)", linewidth=1.5, markersize=3)
    if final:
        ax.plot(*zip(*final), "*", label="validation loss (whole file, final)", markersize=10)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp)
    plt.close(fig)
    atomic.replace(tmp, path)
    return path


def measure_matmul_peak(device: torch.device, dtype: torch.dtype = torch.float32, size: int | None = None,
                        repeats: int = 10) -> float:
    """Best achieved FLOP/s of a square matmul on `device` with the current thread setting (the MFU
    denominator), measured now: best of `repeats`, so that a busy machine still shows its peak."""
    n = size or (4096 if device.type == "cuda" else 1024)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b  # warm-up
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
