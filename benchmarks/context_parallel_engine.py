"""Context parallelism in the engine: prefill time and per-rank KV / peak memory of one long prompt,
CP=1 (the single-process engine) against CP=2 (`EngineConfig(context_parallel_size=2)`), side by side.

    python -m benchmarks.context_parallel_engine                       # SmolLM2-135M, a 2048-token prompt
    python -m benchmarks.context_parallel_engine --tokens 4096 --repeats 3 --cp 2 --tp 2   # CP=2 x TP=2 vs CP=1

Both engines live for the whole run (CP=2's rank 1 is a spawned process, idle in a blocking receive
while CP=1 runs) and are timed interleaved A B A B. One timing = `LLMEngine.step()` calls from adding a
fresh random prompt of T tokens (prefix caching off) with max_tokens=1 until it finishes: one prefill of
the whole prompt in one chunk (max_num_batched_tokens = T, so CP=2 runs it as ring attention with the
GEMMs split per rank) and the first token. Per rank it records:
- wall time, and the thread CPU time of the rank's steps (the work itself, less sensitive to load);
- the KV bytes the prompt holds (blocks of its table x the rank's bytes per block) and the K/V rows
  actually written on the rank (layer 0 rows that are non-zero; the pools start zeroed);
- the peak RSS growth of the prefill (VmHWM after it minus VmRSS before, with the peak reset through
  /proc/self/clear_refs; glibc's mmap threshold fixed at 64 KiB so freed tensors leave the RSS;
  rank 0 of CP=2 shares the benchmark's process with CP=1, which is measured at other times);
- the KV pool allocated (the same `kv_cache_memory` in total: at CP=C each rank allocates 1/C of it).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.common import Report, set_threads


def _status_kib(name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return int(line.split()[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # must be set before the process starts
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.execv(sys.executable, [sys.executable, "-m", "benchmarks.context_parallel_engine",
                                  *(sys.argv[1:] if argv is None else argv)])
    import torch

    from scratchlm.defaults import default_model_path
    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M GGUF)")
    ap.add_argument("--tokens", type=int, default=2048, help="prompt length T")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cp", type=int, default=2, help="context-parallel size of the contender")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of the contender (one distributed "
                                                      "engine per process, so one contender per run)")
    args = ap.parse_args(argv)
    set_threads(1)
    path = Path(args.model) if args.model else default_model_path()
    t = args.tokens
    if args.cp < 2:
        raise SystemExit(f"--cp {args.cp}: the contender needs a context-parallel size >= 2")
    layouts = [(1, 1), (args.cp, args.tp)]
    names = {lay: f"CP={lay[0]}" + (f" x TP={lay[1]}" if lay[1] > 1 else "") for lay in layouts}
    engines = {}
    for cp, tp in layouts:
        print(f"[cp bench] starting {names[(cp, tp)]}", file=sys.stderr)
        config = EngineConfig(max_num_seqs=4, max_num_batched_tokens=t, max_model_len=t + 16,
                              block_size=args.block_size, enable_prefix_caching=False, kv_cache_memory=1 << 28,
                              context_parallel_size=cp, context_parallel_threshold=min(512, t),
                              tensor_parallel_size=tp)
        engines[(cp, tp)] = LLMEngine.from_pretrained(path, config)
    cfg = next(iter(engines.values())).model_config
    vocab = cfg.vocab_size
    gen = torch.Generator().manual_seed(0)

    def prefill(engine: LLMEngine, n: int) -> float:
        ids = torch.randint(3, vocab, (n,), generator=gen).tolist()
        engine.add_request(f"p{time.monotonic_ns()}", ids, SamplingParams(temperature=0, max_tokens=1))
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t0

    def rank_figures(engine: LLMEngine, lay: tuple[int, int], reset: bool) -> list[dict]:
        if lay == (1, 1):
            k = engine.cache.k
            out = {"rank": 0, "VmRSS": _status_kib("VmRSS"), "VmHWM": _status_kib("VmHWM"),
                   "step_cpu_s": time.thread_time(),
                   "kv_pool_bytes": 2 * k.numel() * k.element_size(),
                   "kv_slots_written": int((k[0].abs().sum(dim=(-1, -2)) != 0).sum()),
                   "kv_bytes_per_slot": 2 * k[:, 0, 0].numel() * k.element_size()}
            if reset:
                Path("/proc/self/clear_refs").write_text("5")
            return [out]
        return engine.runner.rank_stats(reset_peak=reset)

    for lay, engine in engines.items():  # warm-up: first-call costs (kernels, page faults) out of the timing
        prefill(engine, min(t, 256 * lay[0]))
    times = {lay: [] for lay in layouts}
    peaks = {lay: [] for lay in layouts}
    cpus = {lay: [] for lay in layouts}  # the slowest rank's thread CPU seconds in the prefill
    written = {}
    for r in range(args.repeats):
        for lay, engine in engines.items():
            before = rank_figures(engine, lay, reset=True)
            # Pools start zeroed and the K rows of a fresh random prompt are never all zero: count new rows.
            base_written = [b["kv_slots_written"] for b in before]
            times[lay].append(prefill(engine, t))
            after = rank_figures(engine, lay, reset=False)
            peaks[lay].append([(a["VmHWM"] - b["VmRSS"]) / 1024 for a, b in zip(after, before)])
            cpus[lay].append(max(a["step_cpu_s"] - b["step_cpu_s"] for a, b in zip(after, before)))
            if r == 0:
                written[lay] = ([a["kv_slots_written"] - w for a, w in zip(after, base_written)], after)
        now = ", ".join(f"{names[lay]} {times[lay][-1]:.2f}s" for lay in layouts)
        print(f"  repeat {r + 1}/{args.repeats}: {now} (load {os.getloadavg()[0]:.1f})", file=sys.stderr)
    for lay, engine in engines.items():
        if lay != (1, 1):
            engine.runner.shutdown()

    name = "context_parallel_engine" + ("" if t == 2048 and layouts[1] == (2, 1) else f"-T{t}-cp{args.cp}-tp{args.tp}")
    report = Report(name, "Context parallelism in the engine: one long prefill, CP=1 vs CP=C",
                    argv if argv is not None else sys.argv[1:])
    report.command = "python -m benchmarks.context_parallel_engine " + " ".join(argv if argv is not None else
                                                                                 sys.argv[1:])
    report.add(f"Model: `{path.name}` ({cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} heads, "
               f"{cfg.n_kv_heads} KV heads), float32, one torch thread per rank, gloo over loopback; prompt of "
               f"{t} random tokens prefilled in one chunk (ring attention at CP>1), then one token sampled; "
               f"block_size {args.block_size}, kv_cache_memory 256 MiB in total. {args.repeats} interleaved "
               f"repeats, median. The machine has {os.cpu_count()} cores shared with other work "
               f"(load average {os.getloadavg()[0]:.1f} at the end): wall-time ratios are noisy.")
    base = statistics.median(times[(1, 1)])
    base_cpu = statistics.median(cpus[(1, 1)])
    rows = []
    for lay in layouts:
        cp, tp = lay
        med = statistics.median(times[lay])
        slots, after = written[lay]
        per_slot = after[0]["kv_bytes_per_slot"]
        blocks = -(-t // (args.block_size * cp))
        seq_kv = blocks * args.block_size * per_slot  # the prompt's blocks on one rank
        base_kv = -(-t // args.block_size) * args.block_size * written[(1, 1)][1][0]["kv_bytes_per_slot"]
        peak = max(max(p) for p in peaks[lay])
        base_peak = max(max(p) for p in peaks[(1, 1)])
        cpu = statistics.median(cpus[lay])
        rows.append([names[lay], cp * tp, f"{med:.2f}", f"{min(times[lay]):.2f}", f"{base / med:.2f}x",
                     f"{cpu:.2f}", f"{base_cpu / cpu:.2f}x",
                     f"{seq_kv / 2**20:.2f}", f"{seq_kv / base_kv:.3f}",
                     " / ".join(str(s) for s in slots), f"{peak:.0f}", f"{peak / base_peak:.2f}",
                     f"{after[0]['kv_pool_bytes'] / 2**20:.0f}"])
    report.table(["layout", "ranks", "prefill wall s (median)", "best", "wall speed-up vs CP=1",
                  "rank CPU s (max, median)", "CPU-time speed-up", "KV MiB of the prompt / rank",
                  "KV vs CP=1", "K/V rows written per rank", "peak RSS growth MiB / rank (max)",
                  "peak vs CP=1", "KV pool MiB / rank"], rows, f"One prefill of {t} tokens")
    report.add("Rank CPU s: the slowest rank's thread CPU time in the prefill's steps (the work itself; "
               "waiting for the cores or for a peer is not counted): on a shared machine read speed-ups from it. "
               "KV per rank is the prompt's blocks on one rank (CP=C: ceil(T / (C x block_size)) blocks of "
               "block_size rows; TP shards the KV heads). 'K/V rows written' counts layer-0 rows that became "
               "non-zero on each rank during the first timed prefill: the token-interleaved ownership (p % C).")
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
