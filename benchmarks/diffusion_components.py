"""Component pipelining of a Stable Diffusion pipeline over a 16-request queue, against the serial run.

    python -m benchmarks.diffusion_components                     # 16 requests, 10 steps, 16x16 latent, 2 rounds
    python -m benchmarks.diffusion_components --requests 4 --steps 4 --rounds 1 --tag smoke

The model: `benchmarks.sd_pipeline.make_folder`'s SD-1.5-shaped pipeline at reduced width (the one-image benchmark's
folder; random weights, written by diffusers). The queue: `--requests` requests of `--batch` prompt(s) each, distinct
prompts and seeds, CFG with guidance 7.5, `--steps` DDIM steps, all queued at t = 0 (a closed queue: throughput =
requests / makespan; latency = queued -> decoded, so it includes the wait in the queue).

Every spawned process gets OMP_WAIT_POLICY (`--omp-wait-policy`, default PASSIVE): with libgomp's default, threads
spin at every barrier, and a 2-thread process on 2 cores that other processes also use runs 20-30x slower (its two
threads wait for each other while descheduled); above the core count libgomp throttles the spinning by itself.

Configurations (`--configs`), each a fresh set of spawned processes, run interleaved round by round (the order
rotates every round) after one warm-up run of each that is not counted:

- serial-2t: one process running text encoder -> UNet -> VAE decoder request after request, 2 torch threads (the
  machine's cores).
- serial-3t: the same with 3 threads: the same total threads as the 3-rank layouts.
- pipe-3: 3 ranks, text | UNet | VAE (the survey's layout), 1 thread each.
- dp-3: 3 ranks, text+VAE | UNet | UNet (two UNet ranks data-parallel over requests, round robin), 1 thread each.

Reported: per configuration the medians over rounds of the makespan, throughput, latency p50 / p95, and the
throughput ratio against each serial run; the CPU seconds per request (every process's CPU time, all threads: on a
machine whose cores other jobs share, the wall clock also measures how much of the cores the scheduler gave each
configuration — a process's runnable threads, not its idle ones, compete — while CPU seconds measure the work); per
stage its busy time, utilisation (busy / makespan), fill, bubbles and drain; the images of every run against the
first serial run's (max abs difference); the load average around each run. A serial run at 1 thread (`serial-1t`,
once, on the queue's first `--ideal-requests`) gives each stage's time alone, from which the ideal speed-ups on
dedicated cores (one machine per rank) follow: sum / max of the stage times for pipe-3, sum / max(UNet / 2, text +
VAE) for dp-3. """

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import Report
from scratchlm.diffusion import components as cp

CONFIGS = {  # name -> (layout, threads per rank)
    "serial-1t": ("serial", 1),
    "serial-2t": ("serial", 2),
    "serial-3t": ("serial", 3),
    "pipe-3": ("text|denoise|vae", [1, 1, 1]),
    "dp-3": ("text+vae|denoise|denoise", [1, 1, 1]),
}
SUBJECTS = ("a photo of a cat", "a red fox in the snow", "an astronaut riding a horse", "a bowl of fruit",
            "the city at night", "a dog on the moon", "a blue painting", "a horse")


def make_queue(n: int, batch: int, steps: int, size: int, guidance: float) -> list[cp.ImageRequest]:
    return [cp.ImageRequest(id=f"req-{k:02d}", prompts=tuple(SUBJECTS[(k + j) % len(SUBJECTS)] for j in range(batch)),
                            seed=1000 + k, steps=steps, guidance=guidance, size=(size, size)) for k in range(n)]


def run_config(path: str, name: str, reqs: list[cp.ImageRequest]) -> dict:
    layout, threads = CONFIGS[name]
    load0 = os.getloadavg()[0]
    out = cp.run_service(path, reqs, layout, threads=threads, timeout_s=600)
    out["load"] = (load0, os.getloadavg()[0])
    return out


def _fmt_s(x: float) -> str:
    return f"{x:.2f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="SD folder (default: build the SD-1.5-shaped one in a temp dir)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1, help="prompts (images) per request")
    ap.add_argument("--steps", type=int, default=10, help="denoising steps per request (10: the whole comparison "
                                                          "fits ~30 min on 2 shared cores)")
    ap.add_argument("--size", type=int, default=16, help="latent side (x8 = image side)")
    ap.add_argument("--guidance", type=float, default=7.5)
    ap.add_argument("--rounds", type=int, default=2, help="counted rounds (after one warm-up run per config)")
    ap.add_argument("--configs", default="serial-2t,serial-3t,pipe-3,dp-3", help=f"subset of {list(CONFIGS)}")
    ap.add_argument("--ideal-requests", type=int, default=4,
                    help="requests of the serial-1t run that times each stage alone (0: skip it)")
    ap.add_argument("--no-warmup", action="store_true")
    ap.add_argument("--omp-wait-policy", default="PASSIVE", choices=("PASSIVE", "ACTIVE", "default"),
                    help="OMP_WAIT_POLICY of every spawned process. PASSIVE: on a shared machine libgomp's default "
                         "spinning at barriers makes a 2-thread process on 2 busy cores 20-30x slower (see the doc)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.omp_wait_policy != "default":  # inherited by the spawned ranks (libgomp reads it at start-up)
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy
    names = [c for c in args.configs.split(",") if c]
    bad = set(names) - set(CONFIGS)
    if bad:
        ap.error(f"unknown configs {sorted(bad)}; expected some of {list(CONFIGS)}")
    argv = argv if argv is not None else sys.argv[1:]
    report = Report("diffusion_components" + (f"_{args.tag}" if args.tag else ""),
                    "Component pipelining (text encoder / UNet / VAE decoder ranks) over a request queue", argv)
    # the one-image benchmark's SD-1.5-shaped folder (benchmarks/sd_pipeline.py, landed with the sdperf work)
    from benchmarks.sd_pipeline import _describe, make_folder

    path = args.model or str(make_folder(Path(tempfile.mkdtemp()) / "sd15"))
    reqs = make_queue(args.requests, args.batch, args.steps, args.size, args.guidance)
    t_all = time.perf_counter()

    if not args.no_warmup:  # page cache, the kernel build, allocator: not counted
        for name in names:
            t = time.perf_counter()
            run_config(path, name, reqs[:2])
            print(f"warm-up {name}: {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            t = time.perf_counter()
            runs[name].append(run_config(path, name, reqs))
            res = runs[name][-1]
            print(f"round {r} {name}: makespan {res['makespan_s']:.1f} s, {res['throughput_rps'] * 60:.2f} req/min, "
                  f"load {res['load'][0]:.1f}->{res['load'][1]:.1f} ({time.perf_counter() - t:.0f} s with start-up)",
                  file=sys.stderr, flush=True)
    alone = run_config(path, "serial-1t", reqs[:args.ideal_requests]) if args.ideal_requests else None

    # the images: every run against the first serial one (or the first run)
    ref_name = next((n for n in names if n.startswith("serial")), names[0])
    ref = runs[ref_name][0]["results"]
    worst = max((a["images"] - b["images"]).abs().max().item()
                for rs in runs.values() for run in rs for a, b in zip(run["results"], ref))
    ids_ok = all([x["id"] for x in run["results"]] == [q.id for q in reqs] for rs in runs.values() for run in rs)

    med = {n: {"makespan": statistics.median(x["makespan_s"] for x in rs),
               "rps": statistics.median(x["throughput_rps"] for x in rs),
               "p50": statistics.median(x["latency_s"]["p50"] for x in rs),
               "p95": statistics.median(x["latency_s"]["p95"] for x in rs),
               "cpu": statistics.median(x["cpu_s"] for x in rs) / args.requests,
               "load": statistics.mean(sum(x["load"]) / 2 for x in rs)} for n, rs in runs.items()}
    serials = [n for n in names if n.startswith("serial")]
    rows = []
    for n in names:
        layout, threads = CONFIGS[n]
        m = med[n]
        rows.append([n, layout, threads if isinstance(threads, int) else "+".join(map(str, threads)),
                     _fmt_s(m["makespan"]), f"{m['rps'] * 60:.2f}",
                     *[f"{m['rps'] / med[s]['rps']:.2f}x" for s in serials],
                     _fmt_s(m["p50"]), _fmt_s(m["p95"]), f"{m['cpu']:.2f} s",
                     *[f"{med[s]['cpu'] / m['cpu']:.2f}x" for s in serials], f"{m['load']:.1f}"])
    side = args.size
    report.add(f"Model: {_describe()}. Queue: {args.requests} requests x {args.batch} image(s), {side}x{side} "
               f"latent ({args.size * 8}x{args.size * 8} px), {args.steps} DDIM steps, CFG {args.guidance}, all queued "
               f"at t = 0. {args.rounds} counted round(s), configurations interleaved (order rotated each round), "
               f"medians. OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} in every process.")
    report.table(["config", "layout", "threads", "makespan", "throughput (req/min)",
                  *[f"vs {s}" for s in serials], "latency p50", "latency p95", "CPU s per request",
                  *[f"CPU efficiency vs {s}" for s in serials], "load avg"], rows,
                 caption="Throughput of the queue (wall clock) and its CPU cost (all processes' CPU seconds / "
                         "requests; efficiency = the serial run's CPU s per request / this one's)")
    report.add(f"Images: every run's against {ref_name}'s first run, max abs difference {worst:.1e} (images in "
               f"[-1, 1]); request ids in queue order in every run: {'yes' if ids_ok else 'NO'}.")

    # per stage, the last round's run of each configuration
    srows = []
    for n in names:
        s = runs[n][-1]
        for stage, st in s["stages"].items():
            srows.append([n, stage, st["rank"], st["requests"], _fmt_s(st["mean_s"]), _fmt_s(st["busy_s"]),
                          f"{st['utilisation'] * 100:.0f} %", _fmt_s(st["fill_s"]), _fmt_s(st["bubbles_s"]),
                          _fmt_s(st["drain_s"])])
    report.table(["config", "stage", "rank", "requests", "mean per request", "busy", "utilisation (busy / makespan)",
                  "fill", "bubbles", "drain"], srows, caption="Per stage (the last round's run of each configuration)")

    if alone is not None:
        t = {k: alone["stages"][k]["mean_s"] for k in ("text", "denoise", "vae")}
        total = sum(t.values())
        report.table(["stage", "seconds per request (1 thread, alone)", "share"],
                     [[k, f"{v:.3f}", f"{v / total * 100:.1f} %"] for k, v in t.items()],
                     caption=f"Stage times alone (serial-1t: one process, one thread, the queue's first "
                             f"{args.ideal_requests} requests)")
        ideal_pipe = total / max(t.values())
        ideal_dp = total / max(t["denoise"] / 2, t["text"] + t["vae"])
        report.add(f"**Ideal on dedicated cores** (one core or machine per rank, no contention, communication free): "
                   f"pipe-3 = sum / max stage = {ideal_pipe:.2f}x a serial 1-thread process; "
                   f"dp-3 = sum / max(UNet / 2, text + VAE) = {ideal_dp:.2f}x (the serial-1t rate here: "
                   f"{alone['throughput_rps'] * 60:.2f} req/min).")
    report.add(f"_(whole benchmark: {time.perf_counter() - t_all:.0f} s)_")
    report.write()
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
