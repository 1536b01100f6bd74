"""Which torch thread count should a command pick by default? Decode speed at each count, side by side.

    python -m benchmarks.threads [--tokens 32] [--repeats 3] [--spinners 1]

One in-process engine on the default model (SmolLM2-135M-Instruct, float32, batch 1, greedy) decodes
`--tokens` tokens from a fixed prompt; each repeat runs every thread count from 1 to the physical cores,
interleaved (1 2 1 2 ...), switching with ``torch.set_num_threads`` on the same loaded engine. Two
conditions, in the same run:

- *as found*: the machine with whatever else runs on it (on a shared machine, other users' load);
- *+S spinners*: S extra busy-loop processes started by the benchmark (an added, known load).

Under each condition it records what every candidate policy would have chosen at that moment —
torch's default (physical cores), physical cores, cores minus the load average (the policy in
``scratchlm/threads.py``), one per rank, and a start-up GEMV probe (``probe_threads``) — and the
decode speed that choice gets, as a ratio to the best thread count measured under that condition.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

from benchmarks.common import Report

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def _spin(stop) -> None:  # a busy loop standing in for another user's job
    while not stop.is_set():
        sum(i * i for i in range(10_000))


def decode_tok_s(engine, threads: int, tokens: int) -> float:
    import torch

    from scratchlm.inference import SamplingParams

    torch.set_num_threads(threads)
    engine.add_request("bench", PROMPT, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = len(out.outputs[0].token_ids)
    return n / (time.perf_counter() - t0)


def measure(engine, counts: list[int], tokens: int, repeats: int) -> dict[int, list[float]]:
    speeds: dict[int, list[float]] = {n: [] for n in counts}
    for n in counts:  # warm-up at each count
        decode_tok_s(engine, n, 4)
    for r in range(repeats):
        for n in counts:
            speeds[n].append(decode_tok_s(engine, n, tokens))
        print(f"  repeat {r + 1}/{repeats}: " + ", ".join(f"{n} thr {s[-1]:.1f} tok/s" for n, s in speeds.items()),
              flush=True)
    return speeds


def policies(counts: list[int]) -> dict[str, int]:
    """What each candidate default would pick right now on this machine."""
    from scratchlm.threads import choose_threads, load_average, physical_cores, probe_threads

    cores = physical_cores()
    return {
        "torch default (= physical cores)": cores,
        "physical cores": cores,
        f"cores minus load (load {load_average():.2f}) [chosen]": choose_threads(env={}).threads,
        "1 per rank": 1,
        "start-up GEMV probe": probe_threads(counts),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--spinners", type=int, default=1, help="busy-loop processes in the second condition")
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    args = parser.parse_args(argv)
    os.environ.pop("OMP_NUM_THREADS", None)

    from scratchlm.inference import EngineConfig, LLMEngine
    from scratchlm.threads import physical_cores

    report = Report("threads", "Default torch thread count: decode speed at each count, with the machine's load",
                    argv)
    cores = physical_cores()
    counts = list(range(1, cores + 1))
    engine = LLMEngine.from_pretrained(args.model, EngineConfig(max_num_seqs=1, kv_cache_memory=64 << 20))
    rows, choice_rows = [], []
    conditions = [("as found", 0), (f"+{args.spinners} spinner(s)", args.spinners)]
    for name, spinners in conditions:
        ctx = mp.get_context("fork")
        stop = ctx.Event()
        procs = [ctx.Process(target=_spin, args=(stop,), daemon=True) for _ in range(spinners)]
        for p in procs:
            p.start()
        try:
            if spinners:
                time.sleep(20)  # let the 1-minute load average see the spinners (it is an EWMA)
            load_before = os.getloadavg()[0]
            picks = policies(counts)
            print(f"{name}: load {load_before:.2f}, picks {picks}", flush=True)
            speeds = measure(engine, counts, args.tokens, args.repeats)
            load_after = os.getloadavg()[0]
        finally:
            stop.set()
            for p in procs:
                p.join(5)
        med = {n: statistics.median(s) for n, s in speeds.items()}
        best = max(med.values())
        for n in counts:
            rows.append([name, f"{load_before:.2f} / {load_after:.2f}", n, f"{med[n]:.1f}", f"{max(speeds[n]):.1f}",
                         f"{med[n] / best:.2f}"])
        for policy, n in picks.items():
            choice_rows.append([name, policy, n, f"{med[n]:.1f}", f"{med[n] / best:.2f}"])
    report.add(f"Physical cores: {cores}. {args.tokens} decode tokens per run, {args.repeats} interleaved repeats per "
               "thread count, one engine (SmolLM2-135M-Instruct GGUF dequantized to float32, batch 1, greedy).")
    report.table(["condition", "load avg before / after", "threads", "tok/s (median)", "tok/s (best)",
                  "median / best count"], rows, caption="Decode speed by thread count")
    report.table(["condition", "policy", "threads chosen", "tok/s (median)", "ratio to the best count"],
                 choice_rows, caption="What each default policy would pick, and what it gets")
    report.write()


if __name__ == "__main__":
    main()
