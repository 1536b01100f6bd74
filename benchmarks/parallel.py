"""Tensor and pipeline parallel inference on this machine: TP=2 and PP=2 (one thread per rank) against
TP=1 with one and with two threads. Batch-1 latency and 32-request throughput, plus the communication
time per step measured on rank 0.

    python -m benchmarks.parallel                                  # SmolLM2-135M (default model)
    python -m benchmarks.parallel --model ../shared/data/models/stories260K/stories260K.bin --repeats 5

Each layout lives in its own client process (a process holds one torch.distributed group), holding
its engine warm; the driver runs the contenders interleaved (A B C D A B C D ...) and takes medians.
Communication is timed around every collective on rank 0 (`ParallelRunner.comm_stats`): all-reduce
(two per layer + the embedding), all-gather of the logits, the step broadcast, pipeline sends, and
the wait for a pipeline stage's activations or logits (which includes that stage's compute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from benchmarks.common import Report, interleaved_clients, set_threads

LAYOUTS = {  # name: (tp, pp, threads per rank)
    "TP=1 1 thread": (1, 1, 1),
    "TP=1 2 threads": (1, 1, 2),
    "TP=2 (1 thread/rank)": (2, 1, 1),
    "PP=2 (1 thread/rank)": (1, 2, 1),
}


def _client(conn, model: str | None, tp: int, pp: int, threads: int, prompt_len: int, gen: int) -> None:
    import time

    import torch

    from scratchlm.inference import EngineConfig, LLMEngine, SamplingParams

    torch.set_num_threads(threads)
    engine = LLMEngine.from_pretrained(model, EngineConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                                           max_num_seqs=32, max_num_batched_tokens=1024))
    vocab = engine.model_config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (prompt_len,), generator=g).tolist() for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)
    conn.send("ready")
    n = 0
    while (cmd := conn.recv()) is not None:
        runner = engine.runner
        if hasattr(runner, "comm"):
            runner.comm.reset_stats()
        steps = 0
        t0 = time.perf_counter()
        for p in prompts[: 1 if cmd == "batch1" else 32]:
            n += 1
            engine.add_request(f"q{n}", p, params)
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        wall = time.perf_counter() - t0
        comm = runner.comm_stats() if hasattr(runner, "comm_stats") else {}
        conn.send({"wall": wall, "steps": steps, "tokens": gen * (1 if cmd == "batch1" else 32), "comm": comm})
    if hasattr(engine.runner, "shutdown"):
        engine.runner.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: SmolLM2-135M-Instruct GGUF)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--gen", type=int, default=32, help="tokens generated per request")
    args = ap.parse_args(argv)
    set_threads(1)
    results = interleaved_clients(_client, {name: (args.model, tp, pp, threads, args.prompt_len, args.gen)
                                            for name, (tp, pp, threads) in LAYOUTS.items()},
                                  ("batch1", "batch32"), args.repeats, join_timeout=30)
    load = os.getloadavg()
    rep = Report("parallel", "Tensor / pipeline parallel inference vs one process (CPU, gloo)", argv or sys.argv[1:])
    rep.add(f"Model: `{args.model or 'SmolLM2-135M-Instruct (default GGUF, dequantized to fp32)'}`; prompts of "
            f"{args.prompt_len} random tokens, {args.gen} greedy tokens each; median of {args.repeats} interleaved "
            f"rounds after a warm-up round. Load average at the end: {load[0]:.2f} / {load[1]:.2f} "
            f"(other work shares these 2 cores). Each layout runs in its own warm client process.")
    base1 = statistics.median(x["wall"] for x in results["TP=1 1 thread"]["batch1"])
    base32 = statistics.median(x["wall"] for x in results["TP=1 1 thread"]["batch32"])
    rows = []
    for name in LAYOUTS:
        b1 = statistics.median(x["wall"] for x in results[name]["batch1"])
        b32 = statistics.median(x["wall"] for x in results[name]["batch32"])
        tok1 = results[name]["batch1"][0]["tokens"]
        tok32 = results[name]["batch32"][0]["tokens"]
        rows.append([name, f"{b1 / tok1 * 1e3:.1f} ms", f"{base1 / b1:.2f}x", f"{tok32 / b32:.1f} tok/s",
                     f"{base32 / b32:.2f}x"])
    rep.table(["layout", "batch-1 time / token", "batch-1 speed-up", "32 requests: throughput", "speed-up"], rows,
              "Latency and throughput (speed-up vs TP=1 with 1 thread)")
    crow = []
    for name in LAYOUTS:
        for kind in ("batch1", "batch32"):
            runs = results[name][kind]
            if not runs[0]["comm"]:
                continue
            steps = statistics.median(x["steps"] for x in runs)
            wall = statistics.median(x["wall"] for x in runs)
            kinds = sorted({k for x in runs for k in x["comm"]})
            per = {k: statistics.median(x["comm"].get(k, (0.0, 0))[0] / x["steps"] for x in runs) for k in kinds}
            calls = {k: runs[0]["comm"].get(k, (0.0, 0))[1] / runs[0]["steps"] for k in kinds}
            total = sum(per.values())
            detail = ", ".join(f"{k} {per[k] * 1e3:.2f} ms ({calls[k]:.0f} calls)" for k in kinds)
            crow.append([name, kind, f"{wall / steps * 1e3:.1f} ms", f"{total * 1e3:.1f} ms",
                         f"{total / (wall / steps):.0%}", detail])
    rep.table(["layout", "workload", "step time", "comm / step (rank 0)", "share", "per kind (per step)"], crow,
              "Communication per engine step, measured on rank 0")
    if args.model is not None:  # results/DATE-parallel-MODEL.md next to the default model's
        rep.name = f"parallel-{Path(args.model).stem}"
    rep.write()


if __name__ == "__main__":
    main()
