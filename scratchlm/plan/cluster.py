"""`ClusterSpec`: the machine a deployment is planned for, read from a small TOML file.

A *device* is whatever runs one rank: a GPU, or one CPU core (one thread per rank). Figures are
per device and are the *achievable* ones (`scratchlm plan --calibrate` measures them here), not
datasheet peaks.
"""

from __future__ import annotations

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
    intra_bw: float = field(default=5e9, metadata={"help": "bandwidth between two ranks of one node (bytes/s)"})
    intra_latency: float = field(default=2e-5, metadata={"help": "latency of one message inside a node (s)"})
    inter_bw: float = field(default=3.125e9, metadata={"help": "bandwidth between two nodes (bytes/s, per rank)"})
    inter_latency: float = field(default=5e-5, metadata={"help": "latency of one message between nodes (s)"})
    layer_overhead: float = field(
        default=0.0,
        metadata={"help": "fixed seconds per transformer layer per forward step (op dispatch / kernel launches)"},
    )
    dtype_bytes: int = field(default=4, metadata={"help": "bytes per weight / activation element (4 fp32, 2 bf16)"})
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
        for name in ("intra_latency", "inter_latency", "softmax_rate", "layer_overhead"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)!r} must be >= 0")
        if problems:
            raise ValueError(f"invalid cluster {self.name!r}: " + "; ".join(problems))
        if self.softmax_rate == 0:
            self.softmax_rate = self.mem_bw / 16
        if self.kv_dtype_bytes == 0:
            self.kv_dtype_bytes = self.dtype_bytes

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
        value = f'"{v}"' if isinstance(v, str) else (f"{v:.4g}" if isinstance(v, float) else str(v))
        if isinstance(v, float) and "e" not in value and "." not in value:
            value += ".0"
        lines.append(f"{f.name} = {value}  # {help_text}")
    return "\n".join(lines) + "\n"
