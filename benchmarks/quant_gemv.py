"""The quantized matmul kernels against each other on SmolLM2-135M's 30 layers of shapes, one core, interleaved.

    python -m benchmarks.quant_gemv [--rounds 7] [--rows 1 2 3 8 32]

For each weight format (int4 g32 asymmetric = GGUF Q4_1, per-channel int8, int8 g32 = GGUF Q8_0) 210 distinct
random matrices of the decoder's shapes (q/o 576x576, k/v 192x576, gate/up 1536x576, down 576x1536; ~63-114 MiB, so
nothing stays in cache) are multiplied by M rows of x with every code path of `quant_linear` (csrc/quant_gemm.h)
and the older dequantize-in-registers kernel (quantization/csrc/quant_kernels.cpp):

- int-vnni / int-avx2: x quantized to int8 per 32-block, integer dot products (AVX512-VNNI vpdpbusd / AVX2
  maddubs), as llama.cpp;
- fma-reg: codes turned into floats in registers + FMA, 4 weight rows per x load;
- fma-tile: a 4-row tile dequantized into L1, then the skinny GEMM's 4x2 / 4x3 FMA register tiles;
- old-fma: quant_kernels.cpp (one row at a time, codes to floats in registers).

Times are thread CPU seconds (the machine is shared; CPU time is what the kernel costs), the minimum over
`--rounds` interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks.common import Report, set_threads

SHAPES = [(576, 576, 2), (192, 576, 2), (1536, 576, 2), (576, 1536, 1)]  # (N, K, per layer)
PATHS = {"int-t8": 6, "int-t8-avx2": 7, "int-vnni": 2, "int-avx2": 1, "fma-reg": 4, "fma-tile": 3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 8, 32])
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--bind-core", type=int, default=0)
    args = ap.parse_args(argv)
    set_threads(1)
    if args.bind_core >= 0:
        os.sched_setaffinity(0, {args.bind_core})
    import torch

    from scratchlm.inference.cpp_extensions import load_engine_kernels
    from scratchlm.inference.quantization import kernels
    from scratchlm.inference.quantization import reference as ref

    eng, old = load_engine_kernels(), kernels.load_extension()
    if eng is None or old is None:
        print("the C++ kernels could not be built", file=sys.stderr)
        return 1
    torch.manual_seed(0)

    def mats(fmt: str, gs: int | None):
        out = []
        for n, k, c in SHAPES:
            for _ in range(c * args.layers):
                w = torch.randn(n, k) * 0.02
                if fmt == "int8":
                    q, s = ref.quantize_int8(w, gs)
                    out.append(([q, s], k, gs or k))
                else:
                    q, d, m = ref.quantize_int4(w, gs, False)
                    out.append(([q, d, m], k, gs))
        return out

    def fn_for(name: str, fmt: str):
        if name == "old-fma":
            if fmt == "int8":
                return lambda x, t, g: old.int8_linear(x, t[0], t[1], g, True)
            return lambda x, t, g: old.int4_linear(x, t[0], t[1], t[2], g, True)
        p = PATHS[name]
        return lambda x, t, g: eng.quant_linear(x, t, g, p)

    rows = []
    names = [*PATHS, "old-fma"]
    for label, fmt, gs in [("int4 g32 asym (Q4_1)", "int4", 32), ("int8 per channel", "int8", None),
                           ("int8 g32 (Q8_0)", "int8", 32)]:
        ms = mats(fmt, gs)
        mib = sum(t.numel() * t.element_size() for ts, _, _ in ms for t in ts) / 2**20
        for m_rows in args.rows:
            xs = {576: torch.randn(m_rows, 576), 1536: torch.randn(m_rows, 1536)}
            best = {n: float("inf") for n in names}
            for _ in range(args.rounds):
                for n in names:
                    fn = fn_for(n, fmt)
                    t0 = time.thread_time()
                    for ts, k, g in ms:
                        fn(xs[k], ts, g)
                    best[n] = min(best[n], time.thread_time() - t0)
            fastest = min(best.values())
            rows.append([label, f"{mib:.0f}", str(m_rows)] + [f"{1e3 * best[n]:.1f}" + (" **" if best[n] == fastest
                                                                                        else "") for n in names])
            print(rows[-1], file=sys.stderr)
    report = Report("quant_gemv", "Quantized matmul kernels on SmolLM2-135M's layer shapes", argv or sys.argv[1:])
    report.add(f"{args.layers} layers x 7 matrices, distinct random weights; thread CPU ms per pass over all of "
               f"them (minimum of {args.rounds} interleaved rounds), one core. ** = fastest. Load average at the end: "
               f"{os.getloadavg()[0]:.1f}.")
    report.table(["format", "MiB", "rows M", *[f"{n} ms" for n in names]], rows)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
