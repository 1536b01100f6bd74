"""DistriFusion on the SD UNet: one rank vs exact and displaced patch parallelism at P=2, side by side.

    python -m benchmarks.distrifusion_unet                       # 32x32 latent, 10 DDIM steps, 3 repeats
    python -m benchmarks.distrifusion_unet --size 48 --warmup 2 --tag s48

An SD-1.5-shaped UNet (4 levels: 3 CrossAttnDownBlock2D + DownBlock2D, 2 ResNets per level, 8 heads, text width
768, 32 GroupNorm groups) at reduced width (`--channels`, default 64,128,256,256 instead of 320,640,1280,1280),
random weights, CFG on (a UNet call is a batch of 2), 77 text tokens. Contenders, each a fresh set of rank
processes per repeat, interleaved round by round (A B C D A B C D ...):

- one rank, 1 thread (`unet_parallel.unet_denoise`): the baseline of the ratios;
- one rank, 2 threads: what the same two cores give without any parallelism of ours (for honesty);
- exact patch parallel, P=2, 1 thread per rank: halos, GroupNorm statistics and K/V on the critical path;
- displaced patch parallel (DistriFusion), P=2, 1 thread per rank, `--warmup` synchronous steps, the exchanges
  batched in `--chunks` groups per step; and the same with one exchange per hooked layer (distrifuser's
  batching undone), to show what the batching buys.

Times are the denoising loop's wall time (after a barrier; model loading excluded), the slower rank's. The time
split per rank: communication on the critical path (synchronous exchanges, and waits for asynchronous ones;
launching an asynchronous one counted too) vs the rest (compute). The machine is shared: the load average is
recorded around every run; a loaded machine favours the 2-process contenders (they get more of the CPU), so read
the ratios with the load column. CPU seconds (the process's, gloo's threads included) are reported beside the
wall times: the work each rank does, which the load does not change much.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks.common import Report
from scratchlm.diffusion import parallel as pp
from scratchlm.diffusion import unet_parallel as up
from scratchlm.diffusion.schedulers import ScheduleConfig
from scratchlm.diffusion.unet import UNet2DConditionModel, UNetConfig

SD15_SCHEDULE = ScheduleConfig(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                               timestep_spacing="leading")


def _comm_seconds(res: dict) -> float:
    return sum(res["comm_seconds"].values()) if "comm_seconds" in res else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--channels", default="64,128,256,256", help="block_out_channels (SD 1.5: 320,640,1280,1280)")
    ap.add_argument("--size", type=int, default=32, help="latent side (a multiple of 8 per band: 16 at P=2)")
    ap.add_argument("--steps", type=int, default=10, help="DDIM steps")
    ap.add_argument("--warmup", type=int, default=2, help="displaced: synchronous warm-up steps")
    ap.add_argument("--chunks", type=int, default=4, help="displaced: batched exchanges per step")
    ap.add_argument("--guidance", type=float, default=7.5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--two-thread-repeats", type=int, default=1,
                    help="repeats of the one-rank 2-thread reference (first rounds only: on a loaded 2-core machine "
                         "its OpenMP threads can take minutes)")
    ap.add_argument("--tag", default="", help="suffix of the results file name")
    args = ap.parse_args(argv)

    channels = tuple(int(c) for c in args.channels.split(","))
    cfg = UNetConfig(block_out_channels=channels, cross_attention_dim=768, attention_head_dim=8, norm_num_groups=32,
                     layers_per_block=2, sample_size=args.size)
    torch.manual_seed(0)
    path = Path(tempfile.mkdtemp()) / "unet"
    UNet2DConditionModel(cfg).save_pretrained(path)
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(1, 4, args.size, args.size, generator=g)
    text, uncond = torch.randn(1, 77, 768, generator=g), torch.randn(1, 77, 768, generator=g)
    sched = asdict(SD15_SCHEDULE)
    common = (str(path), sched, lat, text, uncond, args.steps, args.guidance, "ddim")
    contenders = {
        "one rank, 1 thread": lambda: pp.launch(up.run_unet_reference, 1, *common, 0, threads=1, timeout_s=600),
        "one rank, 2 threads": lambda: pp.launch(up.run_unet_reference, 1, *common, 0, threads=2, timeout_s=600),
        "exact P=2": lambda: pp.launch(up.run_unet_patch, 2, *common, "exact", 0, 0, threads=1, timeout_s=600),
        f"displaced P=2 (warm-up {args.warmup})": lambda: pp.launch(
            up.run_unet_patch, 2, *common, "displaced", args.warmup, 0, None, args.chunks, threads=1, timeout_s=600),
        "displaced P=2, per-layer exchanges": lambda: pp.launch(
            up.run_unet_patch, 2, *common, "displaced", args.warmup, 0, None, 10**6, threads=1, timeout_s=600),
    }
    times: dict[str, list[float]] = {k: [] for k in contenders}
    cpus: dict[str, list[float]] = {k: [] for k in contenders}
    loads: dict[str, list[float]] = {k: [] for k in contenders}
    last: dict[str, list[dict]] = {}
    t_start = time.perf_counter()
    for r in range(args.repeats):
        for name, fn in contenders.items():
            if name == "one rank, 2 threads" and r >= args.two_thread_repeats:
                continue
            res = fn()
            times[name].append(max(x["seconds"] for x in res))
            cpus[name].append(max(x["cpu_seconds"] for x in res))
            loads[name].append(os.getloadavg()[0])
            last[name] = res
            print(f"  repeat {r + 1}/{args.repeats}: {name} {times[name][-1]:.2f} s "
                  f"(load {loads[name][-1]:.1f})", file=sys.stderr)

    report = Report("distrifusion_unet" + (f"_{args.tag}" if args.tag else ""),
                    "DistriFusion on the SD UNet: displaced patch parallelism vs one rank",
                    argv if argv is not None else sys.argv[1:])
    base = statistics.median(times["one rank, 1 thread"])
    base_cpu = statistics.median(cpus["one rank, 1 thread"])
    ref = last["one rank, 1 thread"][0]["latents"]
    rows = []
    for name in [n for n in contenders if times[n]]:  # (the 2-thread reference may not have run)
        med, res = statistics.median(times[name]), last[name]
        comm = max(_comm_seconds(x) for x in res)
        wall = max(x["seconds"] for x in res)
        nbytes = sum(res[0].get("bytes_received", {}).values())
        diff = (res[0]["latents"] - ref).abs()
        rows.append([name, f"{med / args.steps * 1e3:.0f} ms", f"{med:.2f} s", f"{min(times[name]):.2f} s",
                     f"{base / med:.2f}x", f"{statistics.median(cpus[name]):.2f} s",
                     f"{base_cpu / statistics.median(cpus[name]):.2f}x", f"{wall - comm:.2f} s / {comm:.2f} s",
                     f"{nbytes / 2**20:.1f} MiB",
                     f"{diff.max().item():.1e} / {diff.mean().item():.1e}",
                     " ".join(f"{x:.1f}" for x in loads[name])])
    n_params = sum(p.numel() for p in UNet2DConditionModel(cfg).parameters())
    report.table(["contender", "per step", "median (denoise)", "best", "speed-up vs one rank, 1 thread",
                  "CPU s, busier rank (median)", "one rank's CPU s / this",
                  "last run, slower rank: compute / communication", "received by rank 0",
                  "abs(latent - one rank): max / mean", "load average after each run"], rows,
                 caption=f"SD-1.5-shaped UNet, block_out_channels {channels} ({n_params / 1e6:.1f} M parameters), "
                         f"{args.size}x{args.size} latent, CFG batch 2, {args.steps} DDIM steps, "
                         f"{args.repeats} interleaved repeats (medians), {args.chunks} batched exchanges per "
                         f"displaced step; latent scale: mean abs "
                         f"{ref.abs().mean().item():.2f}")
    splits = []
    for name in last:
        for rank, x in enumerate(last[name]):
            if "comm_seconds" in x:
                kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(x["comm_seconds"].items()) if v >= 0.005)
                splits.append([name, rank, f"{x['seconds']:.2f} s", kinds or "-"])
    report.table(["contender", "rank", "denoise wall", "communication seconds by kind (last run)"], splits,
                 caption="Where the communication time goes (`*_wait`: waiting for an asynchronous exchange "
                         "launched a step earlier; `*_launch`: starting one; the others synchronous)")
    report.add(f"_(total {time.perf_counter() - t_start:.0f} s)_")
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
