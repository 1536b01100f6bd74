"""`scratchlm plan --calibrate`: measure this machine's figures for the cost model (one thread per rank).

- GEMM FLOP/s: a float32 (m x k) @ (k x n) matmul, best of a few;
- GEMV bandwidth: a (rows x cols) float32 matrix times a vector, bytes of the matrix / time;
- softmax rate: `attention_with_lse` on one block, its time less its GEMM FLOPs at the measured FLOP/s,
  per score element;
- gloo all-reduce over loopback between 2 local processes: latency from an 8-byte all-reduce, bandwidth
  from a large one (ring all-reduce on 2 ranks: t = 2 latency + n / bandwidth).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from scratchlm.plan.cluster import ClusterSpec

CLOCKS = {"wall": time.perf_counter, "thread_cpu": time.thread_time}


def _best(fn, repeats: int = 5, clock: str = "wall") -> float:
    """Best of `repeats` calls after one warm-up, on `clock` ("wall", or "thread_cpu": this thread's CPU time,
    which leaves out the time other processes take on a shared machine)."""
    now = CLOCKS[clock]
    fn()
    times = []
    for _ in range(repeats):
        t0 = now()
        fn()
        times.append(now() - t0)
    return min(times)


def measure_gemm(n: int = 1024, clock: str = "wall") -> float:
    """FLOP/s of an n x n x n float32 matmul on the current thread count."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    return 2 * n**3 / _best(lambda: torch.mm(a, b, out=out), clock=clock)


def measure_gemv(rows: int = 1536, cols: int = 576, total_bytes: float = 1.6e8, clock: str = "wall") -> float:
    """Bytes/s streamed by decode-like GEMVs: `x @ W.t()` over many distinct float32 (rows x cols) and
    (cols x rows) weights (together larger than the caches, as a model's layers are), one after another."""
    n = max(4, int(total_bytes / (rows * cols * 4)))
    ws = [torch.randn(rows, cols) if i % 2 == 0 else torch.randn(cols, rows) for i in range(n)]
    xs = {cols: torch.randn(1, cols), rows: torch.randn(1, rows)}

    def run() -> None:
        for w in ws:
            xs[w.shape[1]] @ w.t()

    return sum(w.numel() for w in ws) * 4 / _best(run, repeats=3, clock=clock)


def measure_layer_overhead(layers: int = 8, clock: str = "wall") -> float:
    """Seconds per transformer layer of a one-token forward through a tiny model (d_model 64), where the
    arithmetic is negligible: what dispatching a layer's ops costs."""
    from scratchlm.model.config import ModelConfig
    from scratchlm.model.transformer import TransformerLM

    model = TransformerLM(ModelConfig(vocab_size=256, d_model=64, n_layers=layers, n_heads=8, n_kv_heads=4,
                                      max_seq_len=64)).eval()
    x = torch.tensor([[1]])
    with torch.no_grad():
        return _best(lambda: model(x), repeats=10, clock=clock) / layers


def measure_softmax_rate(flops: float, t: int = 512, heads: int = 8, kv_heads: int = 4, d: int = 64,
                         clock: str = "wall") -> float:
    """Attention score elements per second, the GEMM part of the block taken out at `flops`."""
    from scratchlm.parallel.sequence import attention_with_lse

    q, k, v = torch.randn(1, t, heads, d), torch.randn(1, t, kv_heads, d), torch.randn(1, t, kv_heads, d)
    pos = torch.arange(t)
    sec = _best(lambda: attention_with_lse(q, k, v, pos, pos), repeats=3, clock=clock)
    elements = heads * t * t
    rest = max(sec - 4 * elements * d / flops, sec * 0.2)
    return elements / rest


def _allreduce_worker(rank: int, world: int, sizes: list[int], repeats: int) -> dict[int, float]:
    import torch.distributed as dist

    out = {}
    for n in sizes:
        x = torch.zeros(max(1, n // 4))
        dist.all_reduce(x)
        dist.barrier()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - t0)
        out[n] = sorted(times)[len(times) // 2]
    return out


def measure_allreduce(small: int = 8, large: int = 16 * 2**20, repeats: int = 20) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of gloo all-reduce between 2 local processes."""
    from scratchlm.parallel.sequence import spawn_gloo

    res = spawn_gloo(_allreduce_worker, 2, [small, large], repeats)
    t_small = max(r[small] for r in res)
    t_large = max(r[large] for r in res)
    latency = t_small / 2  # ring all-reduce on 2 ranks: 2 (latency + n / (2 bw))
    bandwidth = large / max(t_large - 2 * latency, 1e-9)
    return latency, bandwidth


def calibrate(threads: int = 1, network: bool = True, clock: str = "wall") -> ClusterSpec:
    """Measure this machine: one node, one device per usable core, `threads` torch threads per rank.
    clock="thread_cpu" times the compute figures in thread CPU time (the work, without other processes' share)."""
    if clock not in CLOCKS:
        raise ValueError(f"calibrate: clock={clock!r}, expected one of {sorted(CLOCKS)}")
    torch.set_num_threads(threads)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    flops = measure_gemm(clock=clock)
    bw = measure_gemv(clock=clock)
    smax = measure_softmax_rate(flops, clock=clock)
    overhead = measure_layer_overhead(clock=clock)
    lat, net_bw = measure_allreduce() if network else (2e-5, 5e9)
    try:
        mem_total = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        mem_total = 8 * 2**30
    return ClusterSpec(name="local (calibrated)", nodes=1, devices_per_node=max(1, cores // threads), flops=flops,
                       mem_bw=bw, mem_capacity=mem_total / max(1, cores // threads), softmax_rate=smax,
                       layer_overhead=overhead, intra_bw=net_bw, intra_latency=lat, inter_bw=net_bw,
                       inter_latency=lat, dtype_bytes=4)
