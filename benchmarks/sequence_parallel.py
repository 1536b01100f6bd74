"""Sequence parallelism: prefill time, peak memory per rank and communication volume against context
length, for P = 1, 2, 4 local gloo ranks (one thread each).

    python -m benchmarks.sequence_parallel                                  # SmolLM2-135M, ring, 1K/2K/4K
    python -m benchmarks.sequence_parallel --backend ulysses --model ../shared/data/models/stories260K/stories260K.bin

Every (P, T) point runs in fresh processes. Per rank it records:
- prefill wall time and the rank's thread CPU time (the work itself, less sensitive to other load);
- peak memory of the prefill: VmHWM after the prefill minus VmRSS before it, with the peak reset by
  writing 5 to /proc/self/clear_refs just before (so model loading does not count), and glibc's mmap
  threshold fixed at 64 KiB in the ranks so that freed tensors leave the RSS;
- the bytes of KV cache it holds, and the bytes it sent (counted at every isend / all-to-all /
  all-gather) next to the formula of docs/sequence_parallel.md.
Figures also go to results/DATE-sequence_parallel[-BACKEND].json for benchmarks/plan_validation.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, Report, set_threads


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _worker(rank: int, world: int, model_path: str, seq_len: int, backend: str) -> dict:
    import torch

    from scratchlm.model import load
    from scratchlm.parallel.sequence import ContextParallelLM

    model = load(model_path).model.eval()
    ids = torch.randint(3, model.config.vocab_size, (seq_len,), generator=torch.Generator().manual_seed(0)).tolist()
    ContextParallelLM(model, backend).prefill(ids[: 8 * world])  # warm-up: first-call costs out of the timing
    cp = ContextParallelLM(model, backend)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    rss0 = _status_kib("VmRSS")
    t0, c0 = time.perf_counter(), time.thread_time()
    cp.prefill(ids)
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    peak = _status_kib("VmHWM") - rss0
    return {"wall_s": wall, "cpu_s": cpu, "peak_mib": peak / 1024, "peak_reset": reset,
            "kv_mib": cp.kv_cache_bytes() / 2**20, "sent_bytes": cp.stats.total,
            "p2p": cp.stats.p2p_bytes, "a2a": cp.stats.all_to_all_bytes, "gather": cp.stats.all_gather_bytes}


def comm_formula(backend: str, world: int, seq_len: int, n_layers: int, n_heads: int, n_kv_heads: int,
                 head_dim: int, d_model: int, elem: int = 4) -> int:
    """Bytes one rank sends in a prefill of `seq_len` tokens (prompt divisible by 2P), see
    docs/sequence_parallel.md: ring: L (P-1) (2 T/P Hkv D + T/P) (K, V and positions, float32);
    Ulysses: L (P-1)/P T/P (2 H + 2 Hkv) D (q, k, v in, out back); both + (P-1) T/P d for the final gather."""
    if world == 1:
        return 0
    tl = seq_len // world
    gather = (world - 1) * tl * d_model * elem
    if backend == "ring":
        return n_layers * (world - 1) * (2 * tl * n_kv_heads * head_dim + tl) * elem + gather
    return n_layers * (world - 1) * tl * (2 * n_heads + 2 * n_kv_heads) * head_dim * elem // world + gather


def main(argv: list[str] | None = None) -> int:
    from scratchlm.defaults import default_model_path
    from scratchlm.model import load
    from scratchlm.parallel.sequence import spawn_gloo

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M GGUF)")
    ap.add_argument("--lengths", default="1024,2048,4096", help="comma-separated prompt lengths")
    ap.add_argument("--worlds", default="1,2,4", help="comma-separated numbers of ranks")
    ap.add_argument("--backend", default="ring", choices=["ring", "ulysses"])
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for one point's ranks")
    args = ap.parse_args(argv)
    set_threads(1)
    # A fixed mmap threshold: every allocation of 64 KiB or more gets its own mapping and is unmapped when
    # freed, so the ranks' RSS follows their live tensors (glibc's default threshold grows up to 32 MiB and
    # then serves tensors from heap memory that earlier frees left resident, hiding them from VmHWM).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    model_path = str(args.model or default_model_path())
    cfg = load(model_path).config
    lengths = [int(x) for x in args.lengths.split(",")]
    worlds = [int(x) for x in args.worlds.split(",")]
    name = "sequence_parallel" + ("" if args.backend == "ring" else f"-{args.backend}")
    report = Report(name, f"Sequence parallelism ({args.backend}): prefill time, peak memory per rank, "
                    "communication", argv if argv is not None else sys.argv[1:])
    report.add(f"Model: `{Path(model_path).name}` ({cfg.n_layers} layers, d_model {cfg.d_model}, "
               f"{cfg.n_heads} heads, {cfg.n_kv_heads} KV heads, head_dim {cfg.head_dim}), float32, "
               f"one thread per rank, gloo over loopback, "
               f"{os.cpu_count()} cores on the machine (P=4 oversubscribes them: wall time then includes waiting).")
    rows, points = [], []
    out = RESULTS_DIR / f"{time.strftime('%Y-%m-%d')}-{name}.json"
    for seq_len in lengths:
        for world in worlds:
            print(f"[seq bench] T={seq_len} P={world} load {os.getloadavg()[0]:.1f}", file=sys.stderr)
            res = spawn_gloo(_worker, world, model_path, seq_len, args.backend, timeout=args.timeout)
            wall = max(r["wall_s"] for r in res)
            cpu = max(r["cpu_s"] for r in res)
            peak = max(r["peak_mib"] for r in res)
            kv = max(r["kv_mib"] for r in res)
            sent = res[0]["sent_bytes"]
            formula = comm_formula(args.backend, world, seq_len, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads,
                                   cfg.head_dim, cfg.d_model)
            points.append({"backend": args.backend, "world": world, "seq_len": seq_len, "wall_s": wall,
                           "cpu_s": cpu, "peak_mib": peak, "kv_mib": kv, "sent_bytes": sent,
                           "formula_bytes": formula, "per_rank": res})
            out.write_text(json.dumps({"model": Path(model_path).name, "config": cfg.to_dict(), "points": points},
                                      indent=1))  # after every point: a later failure keeps the earlier ones
            rows.append([seq_len, world, f"{wall:.2f}", f"{cpu:.2f}", f"{peak:.0f}", f"{kv:.1f}",
                         f"{sent / 2**20:.2f}", f"{formula / 2**20:.2f}",
                         f"{sent / formula:.3f}" if formula else "-"])
    report.table(["T", "P", "prefill wall s (slowest rank)", "rank CPU s (max)", "peak MiB / rank", "KV MiB / rank",
                  "sent MiB / rank (measured)", "sent MiB (formula)", "measured / formula"], rows,
                 "Prefill of one prompt of T tokens on P ranks")
    by = {(p["seq_len"], p["world"]): p for p in points}
    scale = []
    for seq_len in lengths:
        base = by.get((seq_len, 1))
        if base is None:
            continue
        for world in worlds:
            if world == 1:
                continue
            p = by[(seq_len, world)]
            scale.append([seq_len, world, f"{p['peak_mib'] / base['peak_mib']:.3f}", f"{1 / world:.3f}",
                          f"{p['kv_mib'] / base['kv_mib']:.3f}", f"{base['cpu_s'] / p['cpu_s']:.2f}",
                          f"{base['wall_s'] / p['wall_s']:.2f}"])
    if scale:
        report.table(["T", "P", "peak memory vs P=1", "1/P", "KV vs P=1", "CPU-time speed-up", "wall speed-up"],
                     scale, "Scaling against one rank")
    report.write()
    print(f"[figures in {out}]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
