"""Which static batch size is best for HF `generate` on the engine workload (the baseline's batch size).

The engine benchmark (`benchmarks/engine_throughput.py`) compares scratchlm with HF `generate` run as static,
left-padded batches of similar-length requests, at the batch size that is best for HF. This script measures
that: the same workload (32 requests, prompts U[16, 256], outputs U[16, 128], greedy, ignore_eos) at several
batch sizes, interleaved over repeats, one thread, pinned to one core.

    python -m benchmarks.hf_batch_sweep                          # batch sizes 4 8 16 32, 2 repeats
    python -m benchmarks.hf_batch_sweep --batch-sizes 8 16 --repeats 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

from benchmarks.common import Report, set_threads
from benchmarks.engine_throughput import export_for_vllm, log, make_workload, run_hf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 8, 16, 32])
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bind-core", type=int, default=0, help="with --threads 1, pin to this core; -1: no pinning")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if any(b < 1 for b in args.batch_sizes) or args.repeats < 1:
        ap.error("batch sizes and --repeats must be >= 1")
    threads = set_threads(args.threads)
    if args.threads == 1 and args.bind_core >= 0 and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {args.bind_core})
    import torch
    from transformers import AutoModelForCausalLM

    from scratchlm.defaults import default_model_path

    hf = AutoModelForCausalLM.from_pretrained(export_for_vllm(default_model_path()),
                                              torch_dtype=torch.float32).eval()
    prompts, outputs = make_workload(args.num_requests, hf.config.vocab_size, args.seed)
    n_out = sum(outputs)
    report = Report("hf_batch_sweep", "HF generate: static batch size on the engine workload",
                    argv=sys.argv[1:] if argv is None else argv)
    run_hf(hf, prompts[:8], outputs[:8], 8)  # warm-up
    times: dict[int, list[float]] = {b: [] for b in args.batch_sizes}
    for r in range(args.repeats):
        for b in args.batch_sizes:
            times[b].append(run_hf(hf, prompts, outputs, b))
            log(f"repeat {r + 1}: batch {b}: {times[b][-1]:.1f} s = {n_out / times[b][-1]:.1f} output tok/s")
    best = max(args.batch_sizes, key=lambda b: n_out / statistics.median(times[b]))
    report.table(["batch size", "output tok/s (median)", "output tok/s (best)", "wall (median)"],
                 [[b, f"{n_out / statistics.median(ts):.1f}", f"{n_out / min(ts):.1f}",
                   f"{statistics.median(ts):.1f} s"] for b, ts in times.items()],
                 caption=f"{args.num_requests} requests, {n_out} output tokens, {threads} thread(s), "
                         f"{args.repeats} interleaved repeats")
    report.add(f"- best for HF here: batch size {best} (requests sorted by prompt length, so a batch holds "
               "similar lengths; every batch decodes as long as its longest request)")
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
