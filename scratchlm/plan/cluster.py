"""`ClusterSpec`: the machine a deployment is planned for, read from a small TOML file.

A *device* is whatever runs one rank: a GPU, or one CPU core (one thread per rank). Figures are
per device and are the *achievable* ones (`scratchlm plan --calibrate` measures them here), not
datasheet peaks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ClusterSpec:
    """Nodes of identical devices; intra-node and inter-node links described by latency and bandwidth."""

    name: str = field(default="cluster", metadata={"help": "a label for reports"})
    nodes: int = field(default=1, metadata={"help": "number of nodes"})
    devices_per_node: int = field(default=1, metadata={"help": "ranks per node: GPUs, or CPU cores (one thread each)"})
    flops: float = field(default=5e10, metadata={"help": "achievable dense GEMM FLOP/s of one device"})
    mem_bw: float = field(default=1e10, metadata={"help": "achievable memory bandwidth of one device (bytes/s, GEMV)"})
    mem_capacity: float = field(default=8e9, metadata={"help": "memory one device (rank) may use, bytes"})
    softmax_rate: float = field(
        default=0.0,
        metadata={"help": "attention score elements per second (scale, mask, max, exp, sum, one device); "
                          "0 = mem_bw / 16 bytes"},
    )
    softmax_rate_cached: float = field(
        default=0.0, metadata={"help": "softmax_rate when one attention op's score matrix fits in cache_bytes; "
                                       "0 = softmax_rate"})
    cache_bytes: float = field(default=0.0, metadata={"help": "last-level cache per device (bytes); 0 = none"})
    intra_bw: float = field(default=5e9, metadata={"help": "bandwidth between two ranks of one node (bytes/s)"})
    intra_latency: float = field(default=2e-5, metadata={"help": "latency of one message inside a node (s)"})
    inter_bw: float = field(default=3.125e9, metadata={"help": "bandwidth between two nodes (bytes/s, per rank)"})
    inter_latency: float = field(default=5e-5, metadata={"help": "latency of one message between nodes (s)"})
    layer_overhead: float = field(
        default=0.0,
        metadata={"help": "fixed seconds per transformer layer per forward step (op dispatch / kernel launches)"},
    )
    linear_rows: list[int] = field(
        default_factory=list,
        metadata={"help": "row counts M at which linear_rate was measured (empty: roofline of flops and mem_bw)"})
    linear_rate: list[float] = field(
        default_factory=list,
        metadata={"help": "weight elements per second of a linear layer multiplied by linear_rows[i] rows"})
    expert_linear_rate: list[float] = field(
        default_factory=list,
        metadata={"help": "weight elements per second of one routed expert's forward on linear_rows[i] rows "
                          "(empty: linear_rate)"})
    elementwise_rate: float = field(
        default=0.0, metadata={"help": "elements/s of the blocks' elementwise ops (norms, RoPE, SiLU, adds); "
                                       "0 = mem_bw / 12 bytes (three passes of 4 B)"})
    ring_step_overhead: float = field(
        default=0.0, metadata={"help": "fixed seconds per layer per extra ring-attention step (block + merge ops)"})
    comm_cpu: float = field(
        default=0.0, metadata={"help": "CPU seconds a rank spends per collective call (counted in its CPU time, "
                                       "not in the step time, whose latency term covers it)"})
    step_overhead: float = field(default=0.0, metadata={"help": "fixed seconds per engine step (scheduler, sampler)"})
    expert_overhead: float = field(
        default=0.0, metadata={"help": "fixed seconds per routed expert a MoE block runs (gather its tokens, "
                                       "launch, scatter its output); 0 = grouped kernels"})
    prefill_seq_overhead: float = field(
        default=0.0, metadata={"help": "fixed seconds per prompt per layer of a batched prefill (the engine's "
                                       "per-sequence attention and bookkeeping)"})
    ep_layer_overhead: float = field(
        default=0.0, metadata={"help": "fixed seconds per MoE block per step that expert parallelism adds on a rank "
                                       "beyond its collective calls (regrouping rows, the other replicas' K/V)"})
    fused_moe: bool = field(
        default=False, metadata={"help": "one rank runs the MoE blocks in a fused step (the measured engine "
                                         "overheads hold their fixed costs; expert_linear_rate, expert_overhead and "
                                         "moe_overhead then apply to expert parallelism's Python step only)"})
    moe_overhead: float = field(
        default=0.0, metadata={"help": "fixed seconds per MoE block beyond a dense MLP's (routing: scores, top-k, "
                                       "grouping the tokens by expert)"})
    seq_overhead: float = field(default=0.0, metadata={"help": "seconds per running sequence per engine step"})
    token_bytes: float = field(
        default=0.0, metadata={"help": "activation bytes per prompt token live at a prefill's peak, besides the "
                                       "KV cache; 0 = the buffer count of docs/planning.md"})
    score_bytes: float = field(
        default=0.0, metadata={"help": "bytes live per attention-score element at a prefill's peak; "
                                       "0 = 6 (a float32 matrix and half another)"})
    dtype_bytes: int = field(default=4, metadata={"help": "bytes per weight / activation element (4 fp32, 2 bf16)"})
    weight_dtype_bytes: float = field(default=0.0, metadata={"help": "bytes per weight when the weights are stored "
                                                                     "narrower (1 fp8); 0 = dtype_bytes"})
    kv_dtype_bytes: int = field(default=0, metadata={"help": "bytes per KV-cache element; 0 = dtype_bytes"})

    def __post_init__(self) -> None:
        problems = []
        for name in ("nodes", "devices_per_node", "dtype_bytes"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                problems.append(f"{name}={v!r} must be a positive int")
        for name in ("flops", "mem_bw", "mem_capacity", "intra_bw", "inter_bw"):
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)!r} must be > 0")
        for name in ("intra_latency", "inter_latency", "softmax_rate", "layer_overhead", "softmax_rate_cached",
                     "cache_bytes", "elementwise_rate",
                     "ring_step_overhead", "comm_cpu", "step_overhead", "seq_overhead", "token_bytes", "score_bytes",
                     "expert_overhead", "moe_overhead", "weight_dtype_bytes", "ep_layer_overhead",
                     "prefill_seq_overhead"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)!r} must be >= 0")
        if len(self.linear_rows) != len(self.linear_rate):
            problems.append(f"linear_rows ({len(self.linear_rows)}) and linear_rate ({len(self.linear_rate)}) "
                            "must have the same length")
        if self.expert_linear_rate and len(self.expert_linear_rate) != len(self.linear_rows):
            problems.append(f"expert_linear_rate ({len(self.expert_linear_rate)}) must have linear_rows' length "
                            f"({len(self.linear_rows)})")
        if any(m <= 0 for m in self.linear_rows) or any(r <= 0 for r in self.linear_rate + self.expert_linear_rate):
            problems.append("linear_rows and linear_rate must be positive")
        if list(self.linear_rows) != sorted(self.linear_rows):
            problems.append(f"linear_rows={self.linear_rows} must be increasing")
        if problems:
            raise ValueError(f"invalid cluster {self.name!r}: " + "; ".join(problems))
        if self.softmax_rate == 0:
            self.softmax_rate = self.mem_bw / 16
        if self.kv_dtype_bytes == 0:
            self.kv_dtype_bytes = self.dtype_bytes
        if self.softmax_rate_cached == 0:
            self.softmax_rate_cached = self.softmax_rate
        if self.elementwise_rate == 0:
            self.elementwise_rate = self.mem_bw / 12
        if self.score_bytes == 0:
            self.score_bytes = 6.0
        if self.weight_dtype_bytes == 0:
            self.weight_dtype_bytes = self.dtype_bytes

    def softmax_for(self, matrix_elements: float) -> float:
        """The softmax rate for attention ops whose score matrix has `matrix_elements` float32 elements."""
        fits = self.cache_bytes and matrix_elements * 4 <= self.cache_bytes
        return self.softmax_rate_cached if fits else self.softmax_rate

    def linear_time(self, weights: float, rows: float, expert: bool = False) -> float:
        """Seconds to multiply `weights` weight elements by `rows` rows: the measured curve (`expert`: routed
        experts', when measured) interpolated in log(rows) (beyond its last point compute-bound: time grows with
        rows), or without a curve the roofline max(weight bytes / mem_bw, 2 rows weights / flops)."""
        if rows <= 0 or weights <= 0:
            return 0.0
        if not self.linear_rows:
            return max(weights * self.weight_dtype_bytes / self.mem_bw, 2 * rows * weights / self.flops)
        ms = self.linear_rows
        rs = self.expert_linear_rate if expert and self.expert_linear_rate else self.linear_rate
        if rows <= ms[0]:
            return weights / rs[0]
        if rows >= ms[-1]:
            return weights / rs[-1] * rows / ms[-1]
        i = next(j for j in range(1, len(ms)) if ms[j] >= rows)
        f = (math.log(rows) - math.log(ms[i - 1])) / (math.log(ms[i]) - math.log(ms[i - 1]))
        time_per_weight = (1 - f) / rs[i - 1] + f / rs[i]  # interpolate the time, which is smooth in rows
        return weights * time_per_weight

    @property
    def devices(self) -> int:
        """Total devices (ranks) in the cluster."""
        return self.nodes * self.devices_per_node

    def link(self, span_nodes: bool) -> tuple[float, float]:
        """(latency s, bandwidth bytes/s) of a link inside a node or between nodes."""
        return (self.inter_latency, self.inter_bw) if span_nodes else (self.intra_latency, self.intra_bw)


def load_cluster(path: str | Path) -> ClusterSpec:
    """Read a cluster TOML (the fields of `ClusterSpec`; unknown keys are an error)."""
    from scratchlm.config import load_config

    return load_config(ClusterSpec, path)


def cluster_to_toml(spec: ClusterSpec, comment: str = "") -> str:
    """A TOML file that `load_cluster` reads back."""
    from dataclasses import fields

    lines = [f"# {line}" for line in comment.splitlines()] if comment else []
    for f in fields(spec):
        v = getattr(spec, f.name)
        help_text = f.metadata.get("help", "")
        if isinstance(v, list):
            lines.append(f"{f.name} = [{', '.join(f'{x:.4g}' if isinstance(x, float) else str(x) for x in v)}]"
                         f"  # {help_text}")
            continue
        if isinstance(v, bool):
            lines.append(f"{f.name} = {'true' if v else 'false'}  # {help_text}")
            continue
        value = f'"{v}"' if isinstance(v, str) else (f"{v:.4g}" if isinstance(v, float) else str(v))
        if isinstance(v, float) and "e" not in value and "." not in value:
            value += ".0"
        lines.append(f"{f.name} = {value}  # {help_text}")
    return "\n".join(lines) + "\n"
