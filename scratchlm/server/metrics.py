"""Prometheus metrics in vLLM's style (``scratchlm:num_requests_running``, ``..._time_to_first_token_seconds``).

Written by hand in the Prometheus text exposition format (version 0.0.4): gauges and counters come
from the engine's ``EngineStats`` snapshot, latency histograms are observed by the server as outputs
reach the event loop. All methods are called from the asyncio thread only.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

PREFIX = "scratchlm:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


@dataclass
class Histogram:
    """A cumulative Prometheus histogram with fixed upper bounds."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)  # last = +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self, name: str, help_text: str, labels: str) -> list[str]:
        lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip((*self.buckets, math.inf), self.counts):
            cumulative += n
            le = "+Inf" if bound == math.inf else repr(float(bound))
            lines.append(f'{name}_bucket{{{labels},le="{le}"}} {cumulative}')
        lines.append(f"{name}_sum{{{labels}}} {self.total!r}")
        lines.append(f"{name}_count{{{labels}}} {self.count}")
        return lines


@dataclass
class ServerMetrics:
    """What the HTTP side observes: latencies, finished requests by reason, rejections."""

    model_name: str
    time_to_first_token: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    inter_token_latency: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e_request_latency: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    request_success: Counter = field(default_factory=Counter)  # finish_reason -> count
    requests_rejected_queue_full: int = 0
    requests_aborted_by_client: int = 0

    def render(self, stats: Any | None, num_active: int) -> str:
        """The /metrics body. `stats` is the latest EngineStats (or None before the first snapshot)."""
        labels = f'model_name="{_escape(self.model_name)}"'
        out: list[str] = []

        def scalar(kind: str, name: str, help_text: str, value: float) -> None:
            full = PREFIX + name
            out.extend([f"# HELP {full} {help_text}", f"# TYPE {full} {kind}", f"{full}{{{labels}}} {value}"])

        if stats is not None:
            scalar("gauge", "num_requests_running", "Number of requests in the model's running batch.",
                   stats.num_running)
            scalar("gauge", "num_requests_waiting", "Number of requests waiting to be scheduled.", stats.num_waiting)
            scalar("gauge", "kv_cache_usage_perc", "KV-cache usage: 1 means all blocks are in use.",
                   float(stats.kv_cache_usage))
            scalar("gauge", "num_kv_blocks_total", "Number of KV-cache blocks in the pool.", stats.num_total_blocks)
            scalar("gauge", "num_kv_blocks_free", "Number of free KV-cache blocks.", stats.num_free_blocks)
            scalar("counter", "prompt_tokens_total", "Number of prefill tokens processed.", stats.prompt_tokens_total)
            scalar("counter", "generation_tokens_total", "Number of generation tokens processed.",
                   stats.generation_tokens_total)
            scalar("counter", "prefix_cache_queries_total", "Prefix-cache lookups of full KV blocks.",
                   stats.prefix_cache_queries)
            scalar("counter", "prefix_cache_hits_total", "Prefix-cache lookups that found the block (reused).",
                   stats.prefix_cache_hits)
            scalar("counter", "num_preemptions_total", "Cumulative number of preemptions by the scheduler.",
                   stats.num_preemptions)
            out.extend(_expert_load_lines(getattr(stats, "expert_load", None), labels))
        scalar("gauge", "num_requests_active", "Requests admitted by the server and not yet finished.", num_active)
        scalar("counter", "request_rejected_queue_full_total", "Requests answered 429 because the queue was full.",
               self.requests_rejected_queue_full)
        scalar("counter", "request_aborted_by_client_total", "Requests aborted because the client disconnected.",
               self.requests_aborted_by_client)
        name = PREFIX + "request_success_total"
        out += [f"# HELP {name} Count of finished requests by finish reason.", f"# TYPE {name} counter"]
        for reason in ("stop", "length", "abort"):
            out.append(f'{name}{{{labels},finished_reason="{reason}"}} {self.request_success[reason]}')
        out += self.time_to_first_token.render(
            PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.", labels)
        out += self.inter_token_latency.render(
            PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", labels)
        out += self.e2e_request_latency.render(
            PREFIX + "e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.", labels)
        return "\n".join(out) + "\n"


def expert_imbalance(counts: list[int]) -> float:
    """max / mean of one layer's per-expert routed rows (1 = perfectly balanced; 0 before any token)."""
    total = sum(counts)
    return max(counts) * len(counts) / total if total else 0.0


def _expert_load_lines(load: dict[int, list[int]] | None, labels: str) -> list[str]:
    """Per-expert routed rows (counter, labels layer and expert) and each layer's imbalance max/mean (gauge), for a
    mixture-of-experts model under expert parallelism (`EngineStats.expert_load`)."""
    if not load:
        return []
    rows, imb = PREFIX + "moe_expert_tokens_total", PREFIX + "moe_expert_imbalance"
    out = [f"# HELP {rows} Token rows routed to each expert of each MoE layer (a token counts once per chosen "
           f"expert).", f"# TYPE {rows} counter"]
    for layer, counts in sorted(load.items()):
        out += [f'{rows}{{{labels},layer="{layer}",expert="{e}"}} {n}' for e, n in enumerate(counts)]
    out += [f"# HELP {imb} Expert load imbalance of each MoE layer: the busiest expert's rows over the mean.",
            f"# TYPE {imb} gauge"]
    out += [f'{imb}{{{labels},layer="{layer}"}} {expert_imbalance(counts)!r}' for layer, counts in sorted(load.items())]
    return out


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def parse_prometheus(text: str) -> dict[str, float]:
    """Samples of a Prometheus text body as {'name{labels}': value} (for tests and the benchmark)."""
    samples: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        samples[key] = float(value)
    return samples
