"""The Pairformer workload of `scratchlm plan`: memory per rank and time per block of a DAP layout.

For one block of `scratchlm.fold` at N tokens over P DAP ranks (R = ceil(N/P) rows, N' = P R):

- memory per rank = weights + the z shard (B R N' c) + s + the block's peak activations
  (`scratchlm.fold.memory.pair_block_peak_bytes`, itself checked against `PeakMemory` by benchmarks/fold.py);
- time per block = GEMM FLOPs / gemm rate (the projections: 2 x 6c^2 per pair element for each triangle
  update, 2 (5HD + H) c for each triangle attention, 2 x 12c^2 for the transition)
  + contraction/attention FLOPs / bmm rate (2 N' c per pair element per update, 4 N' HD per attention)
  + softmax elements (2 R H N'^2) / softmax rate + element passes (`ELEMENT_PASSES` c per pair element)
  / elementwise rate + communication: alpha-beta per message, 4 all-to-alls of (P-1)/P of the shard,
  the ring of 2 (P-1) shard-sized blocks (hidden behind the contraction when overlapped, so it costs
  max(ring, contraction)), the bias gathers; plus a fixed cost per tensor op times the ops per row chunk
  (chunking runs many small ops); times the oversubscription factor max(1, P / cores).

A DAP rank's CPU time (`compute_s`) adds to its share of the kernels what DAP itself costs the CPU
(`dap_cpu_terms`, priced by `measure_dap_cpu`, not scaled by the block efficiency): the gloo calls (per call
per peer: the caller's and gloo's threads), the bytes through gloo (socket copies), the permute + contiguous
packing copies before and after each all-to-all chunk, and the fresh buffers each transpose, ring step and
gather allocates (page faults); all at the padded N' = P ceil(N/P).

The rates come from `calibrate_pairformer` (timed here at the workload's own shapes and gloo processes, then one
real block at N = 64 sets `efficiency`, the ratio of a block's time to the kernel model's) or from a cluster TOML's
`flops`, `softmax_rate`, `elementwise_rate` and link figures (efficiency 1).
"""

from __future__ import annotations

import math
import mmap
import os
import statistics
import time
from dataclasses import dataclass, replace

import torch

from scratchlm.fold.memory import pair_block_peak_bytes
from scratchlm.fold.pairformer import PairformerConfig


@dataclass(frozen=True)
class PairformerRates:
    """Per-rank rates the time model needs (one thread per rank)."""

    gemm_flops: float  # FLOP/s of the projections (rows x c) @ (c x 4c)
    bmm_flops: float  # FLOP/s of the batched contraction / attention matmuls
    softmax_rate: float  # logits elements/s (bias add, mask add, softmax)
    elementwise_rate: float  # element passes/s of LayerNorm / sigmoid / mul / add (one pass = one op per element)
    op_overhead: float  # seconds of fixed cost per tensor op (dispatch, allocation): many small ops when chunked
    latency: float  # seconds per message between two ranks
    bandwidth: float  # bytes/s between two ranks
    cores: int  # devices that run ranks at full speed (more ranks share them)
    efficiency: float = 1.0  # measured / kernel-model time of a whole block at a small N (1: trust the kernels)
    # DAP's CPU cost besides the kernels (what a DAP rank's CPU time adds to one rank's share), from
    # `measure_dap_cpu`; the defaults are its figures on the 2-core dev machine (2026-12-01, gloo, 2 processes)
    message_cpu: float = 2.5e-4  # CPU s per gloo call per peer (process time: the caller and gloo's threads)
    byte_cpu: float = 6.7e-10  # CPU s per byte a rank sends (and receives) through gloo (socket copies)
    alloc_cpu: float = 3.8e-10  # CPU s per byte of a freshly allocated buffer (page faults and zeroing)
    copy_rate: float = 8e9  # bytes/s (read + write) of the strided pack/unpack copies around an all-to-all


@dataclass
class PairformerPrediction:
    """Predicted figures for one block at N tokens over P ranks."""

    n: int
    world: int
    chunk_rows: int | None
    memory_bytes: float  # per rank: weights + z shard + s + peak activations
    activation_bytes: float  # the block's peak above its inputs (what PeakMemory measures)
    gemm_s: float
    bmm_s: float
    softmax_s: float
    elementwise_s: float
    comm_s: float
    overhead_s: float
    dap_cpu_s: float  # DAP's CPU cost besides the kernels: gloo calls, bytes through gloo, packing, fresh buffers
    oversubscription: float
    efficiency: float
    fits: bool | None = None  # within the per-rank budget (None: no budget given)

    @property
    def compute_s(self) -> float:
        """One rank's busy time (what its CPU time measures): the kernels and the per-op overhead, scaled by
        the rates' block efficiency."""
        kernels = self.gemm_s + self.bmm_s + self.softmax_s + self.elementwise_s + self.overhead_s
        return kernels * self.efficiency + self.dap_cpu_s

    @property
    def block_s(self) -> float:
        """Wall time: compute plus the communication not hidden, times the oversubscription of the cores."""
        return (self.compute_s + self.comm_s) * self.oversubscription


# Element passes per pair element per block, in units of c (counted op by op in scratchlm.fold.pairformer):
# each triangle update 22 (LN_in twice, gates, mask, the a/b copies, cat, LN_out, adds), each triangle attention
# 11 (LN, q scale, q/k/v/o transposes, gate, add), the transition 16 (LN, SiLU, two muls, add), the copy of z 1.
ELEMENT_PASSES = 2 * 22 + 2 * 11 + 16 + 1


def dap_cpu_terms(cfg: PairformerConfig, n: int, world: int, overlap: bool = True, channel_chunks: int = 16,
                  elem: int = 4) -> dict[str, float]:
    """What one DAP block adds to a rank's CPU work besides the kernels, in the units the rates price:

    - messages: gloo peer messages: 4 transposes x k all-to-alls of (P-1) peers, the 2 triangle updates' k
      ring steps x (P-1) (or k all-gathers of (P-1) peers without overlap), 2 bias gathers and the s gather;
    - sent_bytes: what the rank sends (and as much it receives), `block_comm_bytes`;
    - packing_bytes: the permute + contiguous before and the strided copy after each all-to-all chunk, each
      reading and writing the chunk: 4 transposes x 2 copies x 2 (read + write) x the shard;
    - fresh_bytes: buffers allocated per block that one rank does not need (page-faulted and zeroed by the
      kernel): per transpose the send, receive and output shards, per ring step the next block, per gather
      the parts and the concatenation. Zero for P = 1."""
    from scratchlm.fold.dap import block_comm_bytes

    if world == 1:
        return {"messages": 0.0, "sent_bytes": 0.0, "packing_bytes": 0.0, "fresh_bytes": 0.0}
    rows = -(-n // world)
    n_pad = rows * world
    shard = rows * n_pad * cfg.c_z * elem
    k = channel_chunks
    messages = (world - 1) * (4 * k + 2 * k + 3)
    sent = float(sum(block_comm_bytes(cfg, n, world, overlap, elem=elem).values()))
    bias = cfg.pair_heads * rows * n_pad * elem
    fresh = 4 * 3 * shard + 2 * (world - 1) * shard + 2 * 2 * world * bias
    if not overlap:
        fresh += 2 * 2 * world * shard  # the gathered operand's parts and their concatenation
    return {"messages": float(messages), "sent_bytes": sent, "packing_bytes": 4.0 * 2 * 2 * shard,
            "fresh_bytes": float(fresh)}


# Tensor ops per row chunk of one block (attention 2 x 15, triangle updates 2 x (8 + 2k) project and
# 2 x (8 + k) finish with k channel chunks, transition 6), and per block besides the chunks.
def ops_per_chunk(channel_chunks: int) -> int:
    return 2 * 15 + 2 * (8 + 2 * channel_chunks) + 2 * (8 + channel_chunks) + 6


def _time(fn, repeats: int = 5) -> float:
    """Median thread CPU time of `fn` (1 torch thread: the work itself, not the waits for a shared core)."""
    fn()
    ts = []
    for _ in range(repeats):
        t = time.thread_time()
        fn()
        ts.append(time.thread_time() - t)
    return sorted(ts)[len(ts) // 2]


def _gloo_cpu_worker(rank: int, world: int, sizes: list[int], calls: int) -> dict[int, float]:
    """Process CPU seconds per `all_to_all_single` (async + wait, as DAP runs it) of each total size in bytes,
    with a little work between calls so the ranks arrive apart as in a block (the work's own CPU subtracted)."""
    import torch.distributed as dist

    out = {}
    a, m = torch.randn(64, 128), torch.randn(128, 512)

    def work() -> None:
        for _ in range(4):
            a @ m
    for size in sizes:
        send = torch.randn(world * max(1, size // (4 * world)))
        recv = torch.empty_like(send)
        for _ in range(3):
            dist.all_to_all_single(recv, send)
        dist.barrier()
        c0 = time.process_time()
        for _ in range(calls):
            work()
        base = time.process_time() - c0
        dist.barrier()
        c0 = time.process_time()
        for _ in range(calls):
            work()
            dist.all_to_all_single(recv, send, async_op=True).wait()
        out[size] = (time.process_time() - c0 - base) / calls
    return out


def measure_dap_cpu(cfg: PairformerConfig, n: int = 192, world: int = 2, network: bool = True) -> dict[str, float]:
    """The rates of `dap_cpu_terms` on this machine (1 thread): `message_cpu` and `byte_cpu` from gloo
    all-to-alls of 64 B and 4 MiB between `world` processes (process CPU time, so gloo's threads count as
    they do in a DAP rank's CPU time); `alloc_cpu` from filling fresh 2.5 MB buffers against a reused one
    (page faults under the benchmark's MALLOC_MMAP_THRESHOLD_, which makes every large buffer fresh);
    `copy_rate` from one transpose's pack and unpack copies at N = `n`, P = `world`, 16 channel chunks."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        nbytes = 2_500_000
        buf = torch.empty(nbytes // 4)

        def fresh() -> None:  # an anonymous mapping per buffer, as glibc gives a large allocation
            for _ in range(10):
                with mmap.mmap(-1, nbytes) as mm:
                    t = torch.frombuffer(mm, dtype=torch.float32)
                    t.fill_(1.0)
                    del t

        def reuse() -> None:
            for _ in range(10):
                buf.fill_(1.0)
        clock = time.process_time
        t0 = clock()
        fresh()
        t1 = clock()
        reuse()
        t2 = clock()
        alloc = max(0.0, ((t1 - t0) - (t2 - t1)) / (10 * nbytes))
        r, c, k = n // world, cfg.c_z, 16
        x = torch.randn(1, r, r * world, c)
        out = torch.empty_like(x)

        def pack_unpack() -> None:
            for i in range(k):
                cs = slice(c * i // k, c * (i + 1) // k)
                send = x[..., cs].reshape(1, r, world, r, -1).permute(2, 0, 1, 3, 4).contiguous()  # (P, B, Ri, Rj, cc)
                out[..., cs].view(1, r, world, r, -1).copy_(send.permute(1, 3, 0, 2, 4))
        copy_rate = 4 * x.numel() * x.element_size() / _time(pack_unpack)
    finally:
        torch.set_num_threads(threads)
    message, per_byte = PairformerRates.message_cpu, PairformerRates.byte_cpu
    if network:
        from scratchlm.parallel.sequence import spawn_gloo

        small, large = 64, 4 * 2**20
        res = spawn_gloo(_gloo_cpu_worker, world, [small, large], 30)
        cpu_small = statistics.median(r[small] for r in res)
        cpu_large = statistics.median(r[large] for r in res)
        message = cpu_small / (world - 1)
        per_byte = max(0.0, cpu_large - cpu_small) / (large * (world - 1) / world)
    return {"message_cpu": message, "byte_cpu": per_byte, "alloc_cpu": alloc, "copy_rate": copy_rate}


def calibrate_pairformer(cfg: PairformerConfig, n: int = 96, network: bool = True) -> PairformerRates:
    """Time this machine's kernels at a Pairformer's shapes (1 thread), and the gloo link between 2 processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        c, h, d = cfg.c_z, cfg.pair_heads, cfg.pair_head_dim
        x = torch.randn(n * n, c)
        w = torch.randn(4 * c, c)
        gemm = 2 * n * n * c * 4 * c / _time(lambda: x @ w.t())
        a = torch.randn(c // 4, n, n)
        bmm = 2 * (c // 4) * n**3 / _time(lambda: torch.matmul(a, a.transpose(-1, -2)))
        logits = torch.randn(8, h, n, n)
        bias = torch.randn(h, n, n)
        sm = logits.numel() / _time(lambda: torch.softmax(logits + bias, dim=-1))
        y = torch.randn(n * n, c)
        # element passes: LayerNorm ~3 (mean, variance, normalise), sigmoid 1, mul 1
        ew = 5 * y.numel() / _time(lambda: torch.nn.functional.layer_norm(y, (c,)).sigmoid_().mul_(y))
        small = torch.randn(4, 8)
        op = _time(lambda: [small.add(1.0) for _ in range(1000)]) / 1000
        _ = d
    finally:
        torch.set_num_threads(threads)
    lat, bw = 5e-5, 2e9
    if network:
        from scratchlm.plan.calibrate import measure_allreduce

        lat, bw = measure_allreduce()[:2]
    rates = PairformerRates(gemm, bmm, sm, ew, op, lat, bw, len(os.sched_getaffinity(0)),
                            **measure_dap_cpu(cfg, network=network))
    return replace(rates, efficiency=block_efficiency(cfg, rates))


def block_efficiency(cfg: PairformerConfig, rates: PairformerRates, n: int = 64) -> float:
    """Thread CPU time of one real single-rank block at `n` tokens over the kernel model's prediction: what the
    isolated kernels' rates miss inside a block (cache misses on the larger working set, strided copies). The
    kernel terms still carry the scaling in N and P; measured 1.7-1.9 on this machine for N = 96-288."""
    from scratchlm.fold.pairformer import PairformerBlock

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        blk = PairformerBlock(cfg).eval()
        s, z = torch.randn(1, n, cfg.c_s), torch.randn(1, n, n, cfg.c_z)
        mask, pm = torch.ones(1, n), torch.ones(1, n, n)
        with torch.no_grad():
            measured = _time(lambda: blk(s, z, mask, pm), repeats=3)
    finally:
        torch.set_num_threads(threads)
    return measured / predict_block(cfg, n, 1, rates).compute_s


def rates_from_cluster(cluster) -> PairformerRates:
    """Rates from a `ClusterSpec` (flops for both GEMM kinds, its softmax/elementwise rates, the intra-node link,
    its `comm_cpu` per call as the per-message CPU cost; the other DAP CPU rates keep their measured defaults)."""
    return PairformerRates(cluster.flops, cluster.flops, cluster.softmax_rate, cluster.elementwise_rate,
                           cluster.layer_overhead / 20 if cluster.layer_overhead else 1e-5,  # ~20 ops per layer
                           cluster.intra_latency, cluster.intra_bw, cluster.devices_per_node,
                           message_cpu=cluster.comm_cpu or PairformerRates.message_cpu)


def weights_bytes(cfg: PairformerConfig, elem: int = 4) -> int:
    """Parameters of one block, in bytes."""
    from scratchlm.fold.pairformer import PairformerBlock

    with torch.device("meta"):
        blk = PairformerBlock(cfg)
    return sum(p.numel() for p in blk.parameters()) * elem


def predict_block(cfg: PairformerConfig, n: int, world: int, rates: PairformerRates, chunk_rows: int | None = None,
                  overlap: bool = True, channel_chunks: int | None = None, elem: int = 4) -> PairformerPrediction:
    """Memory per rank and time of one block at `n` tokens over `world` DAP ranks (see the module docstring)."""
    if n <= 0 or world <= 0:
        raise ValueError(f"predict_block: need n > 0 and world > 0, got n={n}, world={world}")
    rows = -(-n // world)
    n_pad = rows * world
    c, h, hd = cfg.c_z, cfg.pair_heads, cfg.pair_heads * cfg.pair_head_dim
    pairs = rows * n_pad  # pair elements on this rank
    shard = pairs * c * elem
    gemm = pairs * 2 * (2 * 6 * c * c + 2 * (5 * hd + h) * c + 3 * cfg.transition_mult * c * c)
    gemm += rows * 2 * 8 * cfg.c_s * cfg.c_s  # the single track (its share of rows; small)
    contraction = 2 * pairs * n_pad * 2 * c  # two triangle updates
    attention = 2 * pairs * n_pad * 4 * hd  # two triangle attentions: q k^T and attn v
    softmax = 2 * pairs * h * n_pad
    elementwise = pairs * ELEMENT_PASSES * c
    terms = dap_cpu_terms(cfg, n, world, overlap, channel_chunks or 16, elem)
    dap_cpu = (terms["messages"] * rates.message_cpu + terms["sent_bytes"] * rates.byte_cpu
               + terms["packing_bytes"] / rates.copy_rate + terms["fresh_bytes"] * rates.alloc_cpu)
    comm = 0.0
    if world > 1:
        k = channel_chunks or 16
        lat, bw = rates.latency, rates.bandwidth
        a2a = 4 * (k * (world - 1) * lat + shard * (world - 1) / world / bw)
        ring = 2 * k * (world - 1) * (lat + shard / k / bw)
        gathers = 2 * (world - 1) * (lat + h * pairs * elem / bw) + (world - 1) * (lat + rows * cfg.c_s * elem / bw)
        contraction_s = contraction / rates.bmm_flops
        ring_cost = max(0.0, ring - contraction_s) if overlap else ring
        comm = a2a + ring_cost + gathers
    k = channel_chunks or (8 if world == 1 else 16)
    chunks = -(-rows // min(rows, chunk_rows or rows))
    overhead = chunks * ops_per_chunk(k) * rates.op_overhead
    act = pair_block_peak_bytes(cfg, n, world, chunk_rows, overlap, channel_chunks=channel_chunks)
    memory = weights_bytes(cfg, elem) + shard + n_pad * cfg.c_s * elem + act
    return PairformerPrediction(
        n=n, world=world, chunk_rows=chunk_rows, memory_bytes=memory, activation_bytes=act,
        gemm_s=gemm / rates.gemm_flops, bmm_s=(contraction + attention) / rates.bmm_flops,
        softmax_s=softmax / rates.softmax_rate, elementwise_s=elementwise / rates.elementwise_rate,
        comm_s=comm, overhead_s=overhead, dap_cpu_s=dap_cpu, efficiency=rates.efficiency,
        oversubscription=max(1.0, world / max(1, rates.cores)))


def format_predictions(preds: list[PairformerPrediction]) -> str:
    """A plain-text table for `scratchlm plan --pairformer-tokens`."""
    head = (f"{'P':>3}{'N':>7}{'chunk':>7}{'GiB/rank':>10}{'act GiB':>9}{'block s':>9}{'gemm':>7}{'bmm':>7}"
            f"{'softmax':>9}{'elem':>7}{'comm':>7}  fits")
    rows = [head, "-" * len(head)]
    g = 2**30
    for p in preds:
        rows.append(f"{p.world:>3}{p.n:>7}{str(p.chunk_rows or '-'):>7}{p.memory_bytes / g:>10.3f}"
                    f"{p.activation_bytes / g:>9.3f}{p.block_s:>9.2f}{p.gemm_s:>7.2f}{p.bmm_s:>7.2f}"
                    f"{p.softmax_s:>9.2f}{p.elementwise_s:>7.2f}{p.comm_s:>7.2f}  "
                    f"{'-' if p.fits is None else ('yes' if p.fits else 'no')}")
    return "\n".join(rows)


def plan_pairformer(cfg: PairformerConfig, n: int, worlds: list[int], rates: PairformerRates,
                    budget_bytes: float | None = None) -> list[PairformerPrediction]:
    """One prediction per world size; with a per-rank budget, the row chunk is the largest that fits it."""
    out = []
    for world in worlds:
        chunk = None
        if budget_bytes is not None:
            rows = -(-n // world)
            fits = [r for r in (2**i for i in range(int(math.log2(rows)) + 1)) if
                    predict_block(cfg, n, world, rates, r).memory_bytes <= budget_bytes]
            chunk = max(fits) if fits else 1
        pred = predict_block(cfg, n, world, rates, chunk)
        if budget_bytes is not None:
            pred.fits = pred.memory_bytes <= budget_bytes
        out.append(pred)
    return out


def run_cli(args) -> int:
    """`scratchlm plan --pairformer-tokens N [--pairformer-world 1,2,4] [--budget-gib G] [--cluster TOML]`."""
    import sys

    try:
        if args.pairformer_tokens <= 0:
            raise ValueError(f"--pairformer-tokens {args.pairformer_tokens}: expected a positive token count")
        try:
            worlds = [int(x) for x in str(args.pairformer_world).split(",")]
        except ValueError as e:
            raise ValueError(f"--pairformer-world {args.pairformer_world!r}: expected comma-separated ints") from e
        if any(w <= 0 for w in worlds):
            raise ValueError(f"--pairformer-world {args.pairformer_world!r}: world sizes must be positive")
        cfg = PairformerConfig(n_blocks=1)
        if args.cluster:
            from scratchlm.plan.cluster import load_cluster

            rates = rates_from_cluster(load_cluster(args.cluster))
        else:
            print("no --cluster given: timing this machine's kernels at the Pairformer's shapes", file=sys.stderr)
            rates = calibrate_pairformer(cfg)
        budget = args.budget_gib * 2**30 if args.budget_gib else None
        preds = plan_pairformer(cfg, args.pairformer_tokens, worlds, rates, budget)
    except (ValueError, FileNotFoundError) as e:
        print(f"scratchlm plan: error: {e}", file=sys.stderr)
        return 2
    print(f"Pairformer block (c_s {cfg.c_s}, c_z {cfg.c_z}, {cfg.pair_heads} x {cfg.pair_head_dim} pair heads) at "
          f"N = {args.pairformer_tokens}; rates: GEMM {rates.gemm_flops / 1e9:.1f} GFLOP/s, bmm "
          f"{rates.bmm_flops / 1e9:.1f} GFLOP/s, block efficiency {rates.efficiency:.2f}, link "
          f"{rates.bandwidth / 1e9:.2f} GB/s, {rates.cores} core(s)")
    print(format_predictions(preds))
    return 0
