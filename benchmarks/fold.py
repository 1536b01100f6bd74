"""Pairformer trunk + diffusion head: memory per rank, largest N, time and communication, speed vs Boltz-2.

    python -m benchmarks.fold                       # everything (about 30 min on 2 shared cores)
    python -m benchmarks.fold --sections speed --ns 64,128
    python -m benchmarks.fold --sections memory,largest --budget-mib 256

Sections (each a table in the dated report benchmarks/results/<date>-fold.md, raw figures in a .json
next to it, curves in PNGs):

- speed: one block at P = 1 against Boltz's `PairformerLayer(v2=True)` loaded with the same weights, same
  inputs, same thread count (1), interleaved, median of repeats; ratio = Boltz time / scratchlm time.
- memory: peak extra resident bytes per rank of one block (`PeakMemory`: VmHWM reset; a fresh process per
  run) against N for P = 1, 2, 4, unchunked and chunked (row chunk from a budget of 1/4 of the rank's pair
  shard), next to the formula `pair_block_peak_bytes`; the per-rank ratio to one rank's at the largest N.
- largest: the largest N whose predicted peak fits a per-rank budget (chunk chosen from what is left),
  then measured at that N.
- comm: time per block by kind and the bytes against `block_comm_bytes`; overlap on/off interleaved.
- hybrid: trunk (DAP) then K diffusion samples data-parallel: memory per rank and time per sample.
- plan: `scratchlm plan`'s Pairformer predictions (memory per rank, time per block) against every run
  measured today (this invocation's and today's fold result JSONs), target +-30 %.

P = 4 on this machine is 4 processes on 2 shared cores: times at P = 4 are oversubscribed (every rank
waits for a core), memory figures are not affected.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from dataclasses import replace

import torch

from benchmarks.common import RESULTS_DIR, Report, compare, set_threads
from scratchlm.fold.dap import block_comm_bytes, pad_to
from scratchlm.fold.measure import RunSpec, measure
from scratchlm.fold.memory import pair_block_peak_bytes
from scratchlm.fold.pairformer import PairformerBlock, PairformerConfig, load_boltz_state_dict

MIB = 2**20
CFG = PairformerConfig(n_blocks=1)  # Boltz-2's trunk widths: c_s 384, c_z 128, 16 heads, 4 x 32 pair heads


def chunk_for(cfg: PairformerConfig, n: int, world: int) -> int:
    """The benchmark's chunk policy: the largest row chunk whose transient fits 1/4 of the rank's pair shard."""
    from scratchlm.fold.pairformer import chunk_size_for_budget

    n_pad = pad_to(n, world)
    shard = n_pad // world * n_pad * cfg.c_z * 4
    return min(n_pad // world, chunk_size_for_budget(cfg, n_pad, shard // 4))


def run(spec: RunSpec) -> dict:
    """One measured run, reduced over ranks: max peak, max block time, rank 0's comm."""
    res = measure(spec)
    r0 = res[0]
    out = {"n": spec.n, "world": spec.world, "chunk_rows": spec.chunk_rows, "overlap": spec.overlap,
           "peak_bytes": max(r["peak_bytes"] for r in res), "block_s": max(r["block_s"] for r in res),
           "block_cpu_s": max(r["block_cpu_s"] for r in res),
           "shard_bytes": r0["shard_bytes"], "comm_s": r0["comm_s"], "comm_bytes": r0["comm_bytes"],
           "method": r0["method"]}
    if spec.head_samples:
        out.update(head_s=max(r["head_s"] for r in res), head_peak_bytes=max(r["head_peak_bytes"] for r in res),
                   head_cond_s=max(r["head_cond_s"] for r in res), head_samples=spec.head_samples)
    print(f"  N={spec.n} P={spec.world} chunk={spec.chunk_rows} overlap={spec.overlap}: "
          f"peak {out['peak_bytes'] / MIB:.1f} MiB, block {out['block_s']:.2f} s "
          f"(CPU {out['block_cpu_s']:.2f} s)", file=sys.stderr, flush=True)
    return out


# --- sections ------------------------------------------------------------------------------------


def section_speed(report: Report, ns: list[int], repeats: int, raw: dict, clock: str = "thread_cpu") -> None:
    from boltz.model.layers.pairformer import PairformerLayer

    set_threads(1)
    rows = []
    for n in ns:
        torch.manual_seed(0)
        ref = PairformerLayer(CFG.c_s, CFG.c_z, CFG.num_heads, pairwise_head_width=CFG.pair_head_dim,
                              pairwise_num_heads=CFG.pair_heads, v2=True).eval()
        ours = PairformerBlock(CFG).eval()
        load_boltz_state_dict(ours, ref.state_dict())
        s, z = torch.randn(1, n, CFG.c_s), torch.randn(1, n, n, CFG.c_z)
        mask, pm = torch.ones(1, n), torch.ones(1, n, n)
        def call(model, s=s, z=z, mask=mask, pm=pm):
            return model(s, z, mask, pm)

        with torch.no_grad():
            diff = max((a - b).abs().max().item() for a, b in zip(call(ref), call(ours)))
            res = compare({"boltz": lambda m=ref: call(m), "scratchlm": lambda m=ours: call(m)},
                          warmup=1, repeats=repeats, clock=clock)
        ratio = res.ratio("boltz", "scratchlm")
        raw.setdefault("speed", []).append({"n": n, "clock": clock, "boltz_s": res["boltz"].times,
                                            "ours_s": res["scratchlm"].times})
        rows.append([n, f"{res['boltz'].median * 1e3:.0f}", f"{res['scratchlm'].median * 1e3:.0f}",
                     f"{ratio:.2f}x", f"{diff:.1e}"])
    report.table(["N", "Boltz ms (median)", "scratchlm ms (median)", "speed-up (Boltz / scratchlm)",
                  "max abs diff"], rows,
                 caption=f"One Pairformer block, P = 1, 1 thread, {repeats} interleaved repeats, clock {clock} "
                 "(target >= 1.0x)")


def section_memory(report: Report, ns: list[int], raw: dict) -> list[dict]:
    runs = []
    for n in ns:
        for world in (1, 2, 4):
            for chunked in (False, True):
                chunk = chunk_for(CFG, n, world) if chunked else None
                runs.append(run(RunSpec(cfg=CFG, n=n, world=world, chunk_rows=chunk)))
    raw["memory"] = runs
    rows = []
    for r in runs:
        pred = pair_block_peak_bytes(CFG, r["n"], r["world"], r["chunk_rows"])
        rows.append([r["n"], r["world"], r["chunk_rows"] or "none", f"{r['shard_bytes'] / MIB:.1f}",
                     f"{r['peak_bytes'] / MIB:.1f}", f"{pred / MIB:.1f}", f"{r['peak_bytes'] / pred:.2f}",
                     f"{r['block_s']:.2f}", f"{r['block_cpu_s']:.2f}"])
    report.table(["N", "P", "chunk rows", "z shard MiB", "peak MiB/rank (measured)", "predicted MiB",
                  "measured/predicted", "block s (wall)", "block CPU s (busiest rank)"], rows,
                 caption="Peak extra resident memory per rank of one block (VmHWM, fresh processes)")
    top = max(ns)
    rows = []
    for chunked in (False, True):
        one = next(r for r in runs if r["n"] == top and r["world"] == 1 and bool(r["chunk_rows"]) == chunked)
        for world in (2, 4):
            r = next(x for x in runs if x["n"] == top and x["world"] == world and bool(x["chunk_rows"]) == chunked)
            ratio = r["peak_bytes"] / (one["peak_bytes"] / world)
            rows.append([top, "yes" if chunked else "no", world, f"{r['peak_bytes'] / MIB:.1f}",
                         f"{one['peak_bytes'] / world / MIB:.1f}", f"{ratio:.3f}",
                         "met" if ratio <= 1.15 else "MISSED"])
    report.table(["N", "chunked", "P", "peak MiB/rank", "one rank's / P", "ratio", "target <= 1.15"], rows,
                 caption=f"Pair-activation memory per rank against 1/P of one rank's, at the largest N = {top}")
    _plot_memory(runs, ns)
    return runs


def largest_n(cfg: PairformerConfig, world: int, budget: int) -> tuple[int, int]:
    """(N, chunk): the largest N (step 8) whose predicted peak fits `budget` with some row chunk >= 1."""
    def best_chunk(n: int) -> int | None:
        rows = pad_to(n, world) // world
        lo, hi = 0, rows
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if pair_block_peak_bytes(cfg, n, world, mid) <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo or None

    n = 8
    while best_chunk(n + 8):
        n += 8
    return n, best_chunk(n)


def section_largest(report: Report, budget_mib: int, raw: dict) -> None:
    budget = budget_mib * MIB
    rows, found = [], {}
    for world in (1, 2, 4):
        n, chunk = largest_n(CFG, world, budget)
        r = run(RunSpec(cfg=CFG, n=n, world=world, chunk_rows=chunk))
        found[world] = n
        rows.append([world, n, chunk, f"{pair_block_peak_bytes(CFG, n, world, chunk) / MIB:.0f}",
                     f"{r['peak_bytes'] / MIB:.0f}", "yes" if r["peak_bytes"] <= budget else "NO",
                     f"{n / found[1]:.2f}x", f"{r['block_s']:.1f}"])
        raw.setdefault("largest", []).append({**r, "budget_bytes": budget})
    ratio = found[4] / found[1]
    report.table(["P", "largest N", "chunk rows", "predicted peak MiB", "measured peak MiB", "fits",
                  "N / N(P=1)", "block s"], rows,
                 caption=f"Largest N under {budget_mib} MiB per rank, chunked (target N(P=4) >= 1.9 x N(P=1): "
                 f"{ratio:.2f}x, {'met' if ratio >= 1.9 else 'MISSED'})")
    _plot_largest(found, budget_mib)


def section_comm(report: Report, n: int, repeats: int, memory_runs: list[dict], raw: dict) -> None:
    rows = []
    for world in (2, 4):
        chunk = chunk_for(CFG, n, world)
        times = {True: [], False: []}
        last = {}
        for _ in range(repeats):
            for ov in (True, False):  # interleaved on/off
                r = run(RunSpec(cfg=CFG, n=n, world=world, chunk_rows=chunk, overlap=ov))
                times[ov].append(r["block_s"])
                last[ov] = r
        raw.setdefault("comm", []).append({"world": world, "n": n, "times": {str(k): v for k, v in times.items()},
                                           "runs": {str(k): v for k, v in last.items()}})
        for ov in (True, False):
            r = last[ov]
            formula = block_comm_bytes(CFG, n, world, ov)
            sent = sum(v for v in r["comm_bytes"].values())
            a2a = r["comm_s"].get("all_to_all", 0) + r["comm_s"].get("all_to_all_wait", 0)
            comm_s = sum(r["comm_s"].values())
            med = statistics.median(times[ov])
            rows.append([world, "on" if ov else "off", f"{med:.2f}",
                         f"{statistics.median(times[False]) / med:.2f}x" if ov else "1.00x",
                         f"{sent / MIB:.1f}", f"{sum(formula.values()) / MIB:.1f}",
                         f"{comm_s:.2f} ({comm_s / r['block_s']:.0%})", f"{a2a / r['block_s']:.0%}",
                         ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["comm_s"].items()) if v > 0.005)])
    report.table(["P", "overlap", "block s (median)", "speed-up of overlap", "MiB sent/rank (measured)",
                  "MiB (formula)", "comm s (share)", "all-to-all share", "seconds by kind (rank 0)"], rows,
                 caption=f"Time per block and communication at N = {n}, chunked, {repeats} interleaved repeats "
                 "of overlap on/off (P = 4: 4 processes on 2 shared cores)")


def section_hybrid(report: Report, n: int, k: int, raw: dict) -> None:
    rows = []
    base = None
    for world in (1, 2, 4):
        r = run(RunSpec(cfg=CFG, n=n, world=world, chunk_rows=chunk_for(CFG, n, world), head_samples=k))
        raw.setdefault("hybrid", []).append(r)
        per_sample = (r["head_s"] - r["head_cond_s"]) / k
        base = base or per_sample
        rows.append([world, f"{r['peak_bytes'] / MIB:.1f}", f"{r['block_s']:.2f}", f"{r['head_peak_bytes'] / MIB:.1f}",
                     f"{per_sample:.2f}", f"{base / per_sample:.2f}x", -(-k // world)])
    report.table(["P", "trunk peak MiB/rank", "trunk block s", "head peak MiB/rank", "head s per sample (wall)",
                  "head speed-up", "samples on the busiest rank"], rows,
                 caption=f"The hybrid at N = {n}: one DAP trunk block, then K = {k} diffusion samples "
                 "data-parallel over the same ranks")


def section_plan(report: Report, raw: dict) -> None:
    """`scratchlm plan`'s Pairformer predictions against every run measured so far today (this invocation's
    and the fold result JSONs of today), with rates timed now on this machine."""
    import datetime as dt

    from scratchlm.plan.pairformer import calibrate_pairformer, predict_block

    runs = [r for key in ("memory", "largest") for r in raw.get(key, [])]
    runs += [v for c in raw.get("comm", []) for v in c["runs"].values()]
    for path in sorted(RESULTS_DIR.glob(f"{dt.date.today().isoformat()}-fold*.json")):
        old = json.loads(path.read_text())
        runs += [r for key in ("memory", "largest") for r in old.get(key, [])]
        runs += [v for c in old.get("comm", []) for v in c["runs"].values()]
    runs = [r for r in runs if "block_cpu_s" in r]  # runs before CPU time was recorded cannot be compared
    seen, unique = set(), []
    for r in reversed(runs):  # the latest measurement of each configuration
        key = (r["n"], r["world"], r["chunk_rows"], r["overlap"])
        if key not in seen:
            seen.add(key)
            unique.append(r)
    rates = calibrate_pairformer(CFG)
    raw["plan_rates"] = vars(rates)
    # One-point calibration: the block efficiency from the smallest single-rank unchunked run measured, so the
    # conditions (the machine's load slows even CPU time: shared cores, caches) are those of the runs; every
    # other row (other N, P, chunk) is then a prediction.
    anchor = min((r for r in unique if r["world"] == 1 and not r["chunk_rows"]), key=lambda r: r["n"])
    rates = replace(rates, efficiency=1.0)
    rates = replace(rates, efficiency=anchor["block_cpu_s"] / predict_block(CFG, anchor["n"], 1, rates).compute_s)
    rows, mem_ok, time_ok, wall_ok, dap_ok, dap_n = [], 0, 0, 0, 0, 0
    for r in sorted(unique, key=lambda r: (r["n"], r["world"], r["chunk_rows"] or 0)):
        p = predict_block(CFG, r["n"], r["world"], rates, r["chunk_rows"], r["overlap"])
        m_ratio, c_ratio = r["peak_bytes"] / p.activation_bytes, r["block_cpu_s"] / p.compute_s
        w_ratio = r["block_s"] / p.block_s
        mem_ok += abs(m_ratio - 1) <= 0.3
        time_ok += abs(c_ratio - 1) <= 0.3
        wall_ok += abs(w_ratio - 1) <= 0.3
        dap_n += r["world"] > 1
        dap_ok += r["world"] > 1 and abs(c_ratio - 1) <= 0.3
        rows.append([r["n"], r["world"], r["chunk_rows"] or "none", "on" if r["overlap"] else "off",
                     f"{p.activation_bytes / MIB:.1f}", f"{r['peak_bytes'] / MIB:.1f}", f"{m_ratio:.2f}",
                     f"{p.compute_s:.2f}", f"{r['block_cpu_s']:.2f}", f"{c_ratio:.2f}",
                     f"{p.block_s:.2f}", f"{r['block_s']:.2f}", f"{w_ratio:.2f}"])
    report.add(f"Planner rates timed now (1 thread): GEMM {rates.gemm_flops / 1e9:.1f} GFLOP/s, bmm "
               f"{rates.bmm_flops / 1e9:.1f} GFLOP/s, softmax {rates.softmax_rate / 1e6:.0f} M/s, element passes "
               f"{rates.elementwise_rate / 1e6:.0f} M/s, gloo link {rates.latency * 1e6:.0f} us + "
               f"{rates.bandwidth / 1e9:.2f} GB/s, {rates.cores} cores; block efficiency {rates.efficiency:.2f}, "
               f"from the measured CPU time of the N = {anchor['n']}, P = 1 unchunked run (the anchor: every other "
               "row is a prediction). DAP CPU rates (`measure_dap_cpu`, gloo between 2 processes, process CPU time): "
               f"{rates.message_cpu * 1e3:.2f} ms per call per peer, {rates.byte_cpu * 1e9:.2f} ns per byte sent, "
               f"{rates.alloc_cpu * 1e9:.2f} ns per freshly allocated byte, pack/unpack copies "
               f"{rates.copy_rate / 1e9:.1f} GB/s.")
    report.table(["N", "P", "chunk", "overlap", "predicted act MiB", "measured MiB", "ratio",
                  "predicted compute s", "measured CPU s", "ratio", "predicted wall s", "measured wall s", "ratio"],
                 rows, caption=f"`scratchlm plan --pairformer-tokens` against measurement (target +-30 %): memory "
                 f"within on {mem_ok}/{len(rows)} runs, compute time (CPU) on {time_ok}/{len(rows)} (DAP ranks, P > 1: "
                 f"{dap_ok}/{dap_n}), wall time on "
                 f"{wall_ok}/{len(rows)} (wall time on this shared machine includes waiting for a core: load "
                 f"average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores now)")


# --- plots ---------------------------------------------------------------------------------------


def _png(name: str) -> str:
    import datetime as dt

    return str(RESULTS_DIR / f"{dt.date.today().isoformat()}-{name}.png")


def _plot_memory(runs: list[dict], ns: list[int]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for world, color in ((1, "C0"), (2, "C1"), (4, "C2")):
        for chunked, style in ((False, "--"), (True, "-")):
            pts = sorted((r["n"], r["peak_bytes"] / MIB) for r in runs
                         if r["world"] == world and bool(r["chunk_rows"]) == chunked)
            ax.plot(*zip(*pts), style, marker="o", color=color,
                    label=f"P={world} {'chunked' if chunked else 'unchunked'}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("tokens N")
    ax.set_ylabel("peak MiB per rank (one block)")
    ax.set_title("Pairformer block: peak memory per rank")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(_png("fold_memory"), dpi=110)


def _plot_largest(found: dict[int, int], budget_mib: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.bar([str(p) for p in found], list(found.values()), color=["C0", "C1", "C2"])
    ax.plot([str(p) for p in found], [found[1] * p**0.5 for p in found], "k--", label="N(P=1) sqrt(P)")
    ax.set_xlabel("DAP ranks P")
    ax.set_ylabel("largest N")
    ax.set_title(f"Largest N under {budget_mib} MiB per rank (chunked)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(_png("fold_largest_n"), dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", default="speed,memory,largest,comm,hybrid,plan")
    ap.add_argument("--ns", default="96,192,288,384", help="N values of the memory section")
    ap.add_argument("--speed-ns", default="64,128,192", help="N values of the speed section")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--clock", choices=["thread_cpu", "wall"], default="thread_cpu",
                    help="clock of the speed section: the thread's CPU time (1 torch thread: the work itself, "
                    "far less sensitive to the other processes on a shared machine) or wall")
    ap.add_argument("--budget-mib", type=int, default=256, help="per-rank budget of the largest-N section")
    ap.add_argument("--comm-n", type=int, default=256)
    ap.add_argument("--hybrid-n", type=int, default=192)
    ap.add_argument("--samples", type=int, default=5, help="diffusion samples K (AlphaFold3 draws 5)")
    args = ap.parse_args(argv)
    sections = set(args.sections.split(","))
    known = {"speed", "memory", "largest", "comm", "hybrid", "plan"}
    if sections - known:
        raise SystemExit(f"unknown sections {sorted(sections - known)}; expected some of {sorted(known)}")
    set_threads(1)
    name = "fold" if len(sections) == len(known) else "fold-" + "-".join(sorted(sections))
    report = Report(name, "Pairformer + DAP + diffusion head (issue 19)", argv if argv is not None else sys.argv[1:])
    report.add(f"Model: one Pairformer block at Boltz-2's widths ({CFG}); fp32; random weights and inputs. "
               "Memory: `PeakMemory` (VmHWM after clear_refs=5, MALLOC_MMAP_THRESHOLD_=65536, a fresh process "
               "per run). P ranks are local gloo processes with one thread each.")
    raw: dict = {"cfg": vars(CFG) if hasattr(CFG, "__dict__") else str(CFG)}
    mem_runs: list[dict] = []
    if "speed" in sections:
        section_speed(report, [int(x) for x in args.speed_ns.split(",")], args.repeats, raw, args.clock)
    if "memory" in sections:
        mem_runs = section_memory(report, [int(x) for x in args.ns.split(",")], raw)
    if "largest" in sections:
        section_largest(report, args.budget_mib, raw)
    if "comm" in sections:
        section_comm(report, args.comm_n, max(1, args.repeats - 1), mem_runs, raw)
    if "hybrid" in sections:
        section_hybrid(report, args.hybrid_n, args.samples, raw)
    if "plan" in sections:
        section_plan(report, raw)
    path = report.write()
    path.with_suffix(".json").write_text(json.dumps(raw, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

