"""`scratchlm bench kernels`: this machine's kernels against its own limits.

Prints the ISA the kernels run (csrc/simd_common.h's isa_name, after $SCRATCHLM_ISA), the core's fp32 FMA peak
(panel_gemm.h's register-only loop, GFLOP/s) and its streaming read (GB/s: `torch.sum` over a buffer of 8x the
last-level cache), then:

- fp32: for SmolLM2-135M's linears (fused q/k/v, o, fused gate/up, down, the tied head) at each row count, every
  candidate of kernel_choice.py (GFLOP/s; GB/s of weights at 8 rows or fewer, where they are bound by memory), the
  kernel the choice runs there (measured at first use, or from the cache file) and its fraction of the peak (of the
  streaming read at 8 rows or fewer);
- quantized: for each GGUF type in ``QUANT_TYPES`` the engine's binding takes (`gguf_linear`), the GB/s of its
  blocks at 1 and 8 rows and the kernel path it runs (`gguf_resolve_path`). A new type is one more row there.

Timing is kernel_choice.time_candidates' (best of --repeats rotated rounds, each call after a cache-evicting read);
decode-sized calls run over enough copies of the weights (up to 64 MiB) that the hardware prefetchers reach their
streaming rate, as over a real step's layers. Threads: --threads (default 1). Nothing is written to disk besides the
choice cache.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import numpy as np
import torch

from scratchlm.inference import kernel_choice

SMOLLM2_SHAPES = (("q/k/v", 576, 960), ("o", 576, 576), ("gate/up", 576, 3072), ("down", 1536, 576),
                  ("head", 576, 49152))  # (name, K, N): the fused step's calls
DEFAULT_ROWS = (1, 8, 64, 512)
MEMORY_ROWS = 8  # at or below: GB/s against the streaming read
COPY_BYTES = 64 << 20  # decode-sized calls cycle through this many bytes of weight copies
COMPUTE_FLOPS = 4e9  # larger calls: N capped so that one candidate's call stays near this


@dataclass(frozen=True)
class QuantType:
    """One row of the quantized table: a GGUF block type as the file stores it."""

    name: str
    type_id: int  # ggml's id
    block_weights: int
    block_bytes: int
    f16_offsets: tuple[int, ...]  # the block's float16 scale fields (set to a normal value in random blocks)


QUANT_TYPES = (
    QuantType("Q4_0", 2, 32, 18, (0,)), QuantType("Q4_1", 3, 32, 20, (0, 2)), QuantType("Q5_0", 6, 32, 22, (0,)),
    QuantType("Q5_1", 7, 32, 24, (0, 2)), QuantType("Q8_0", 8, 32, 34, (0,)), QuantType("Q2_K", 10, 256, 84, (80, 82)),
    QuantType("Q3_K", 11, 256, 110, (108,)), QuantType("Q4_K", 12, 256, 144, (0, 2)),
    QuantType("Q5_K", 13, 256, 176, (0, 2)), QuantType("Q6_K", 14, 256, 210, (208,)),
    QuantType("IQ4_NL", 20, 32, 18, (0,)), QuantType("IQ4_XS", 23, 256, 136, (0,)),
)
QUANT_SHAPE = ("down", 1536, 576)  # K divisible by every block size (576 is not a multiple of 256)


def quant_blocks(t: QuantType, n: int, k: int, g: torch.Generator) -> torch.Tensor:
    """Random (n, row_bytes) uint8 blocks of type t with every float16 scale field set to 0.01 (speed only: the
    values are meaningless but finite)."""
    blocks = torch.randint(0, 256, (n * k // t.block_weights, t.block_bytes), dtype=torch.uint8, generator=g)
    scale = torch.from_numpy(np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8).copy())
    for off in t.f16_offsets:
        blocks[:, off : off + 2] = scale
    return blocks.view(n, -1)


def stream_gbs(flush: torch.Tensor, repeats: int = 5) -> float:
    """GB/s of `torch.sum` over a buffer of 8x the last-level cache, best of `repeats`."""
    buf = torch.ones(kernel_choice.last_level_cache_bytes() * 8 // 4)
    best, now = float("inf"), kernel_choice.clock()
    for _ in range(repeats):
        flush.sum()
        t0 = now()
        buf.sum()
        best = min(best, now() - t0)
    return buf.numel() * 4 / best / 1e9


def peak_gflops(ext, iters: int = 20_000_000) -> float:
    """Best of 5 of the register-only FMA loop (AVX-512 where the cap allows, else AVX2), GFLOP/s."""
    best, fmas = float("inf"), 0.0
    for _ in range(5):
        t0 = time.thread_time()  # one thread runs it
        fmas = ext.fp32_peak_fmas(iters, True)
        best = min(best, time.thread_time() - t0)
    return 2 * fmas / best / 1e9


def fp32_rows(ext, shapes, rows: list[int], repeats: int, flush: torch.Tensor, peak: float,
              stream: float) -> list[list[str]]:
    """One table row per (shape, M): each candidate's rate, the chosen kernel, its share of peak / stream."""
    out = []
    for name, k, n in shapes:
        for m in rows:
            memory = m <= MEMORY_ROWS
            n_meas = n if memory else min(n, max(256, int(COMPUTE_FLOPS / (2 * m * k)) // 16 * 16))
            copies = max(1, min(32, COPY_BYTES // (4 * n_meas * k))) if memory else 1
            rates = kernel_choice.measure(ext, m, k, n_meas, repeats, copies, flush)  # GFLOP/s
            if memory:
                rates = {c: r / (2 * m) * 4 for c, r in rates.items()}  # GB/s of fp32 weights
            chosen = kernel_choice.kernel_for(ext, m, k, n)
            frac = rates[chosen] / (stream if memory else peak)
            cells = [f"{rates[c]:.1f}" if c in rates else "-" for c in kernel_choice.KERNELS]
            out.append([name, f"{k}x{n}" + ("" if n_meas == n else f" ({n_meas} timed)"), str(m),
                        "GB/s" if memory else "GFLOP/s", *cells, chosen, f"{frac:.0%}"])
            print("  " + " | ".join(out[-1]), flush=True)
    return out


def quant_rows(ext, repeats: int, flush: torch.Tensor, stream: float) -> list[list[str]]:
    """One table row per GGUF type the binding takes: GB/s of its blocks at 1 and 8 rows, and its paths."""
    if not hasattr(ext, "gguf_linear"):
        return []
    handled = set(ext.gguf_types()) if hasattr(ext, "gguf_types") else {t.type_id for t in QUANT_TYPES}
    _, k, n = QUANT_SHAPE
    g = torch.Generator().manual_seed(0)
    out = []
    for t in QUANT_TYPES:
        if t.type_id not in handled or k % t.block_weights:
            continue
        one = quant_blocks(t, n, k, g)
        copies = max(1, min(64, COPY_BYTES // one.numel()))
        raws = [one] + [quant_blocks(t, n, k, g) for _ in range(copies - 1)]
        cells, paths = [], []
        for m in (1, MEMORY_ROWS):
            x = torch.randn(m, k, generator=g)
            fn = {"q": lambda x=x, raws=raws, tid=t.type_id: [ext.gguf_linear(x, r, tid, k, -1) for r in raws]}
            best = kernel_choice.time_candidates(fn, repeats, flush)["q"]
            gbs = one.numel() * copies / best / 1e9
            cells += [f"{gbs:.1f}", f"{gbs / stream:.0%}"]
            paths.append(str(ext.gguf_resolve_path(one, t.type_id, k, m, -1)))
        bpw = t.block_bytes * 8 / t.block_weights
        out.append([t.name, f"{bpw:.2f}", *cells, "/".join(paths)])
        print("  " + " | ".join(out[-1]), flush=True)
    return out


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="scratchlm bench kernels", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(map(str, DEFAULT_ROWS)), help="row counts M (comma-separated)")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per candidate (best of)")
    ap.add_argument("--threads", type=int, default=1, help="torch / OpenMP threads")
    ap.add_argument("--shapes", default=",".join(s[0] for s in SMOLLM2_SHAPES),
                    help="which of SmolLM2's linears (comma-separated)")
    ap.add_argument("--no-quant", action="store_true", help="skip the quantized kernels' table")
    args = ap.parse_args(argv)
    shapes = [s for s in SMOLLM2_SHAPES if s[0] in args.shapes.split(",")]
    if not shapes:
        ap.error(f"--shapes {args.shapes!r}: none of {', '.join(s[0] for s in SMOLLM2_SHAPES)}")
    torch.set_num_threads(args.threads)
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    ext = load_engine_kernels()
    if ext is None:
        print("the engine's C++ kernels could not be built here: the pure-torch paths run, nothing to report")
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    flush = kernel_choice.flush_buffer()
    peak, stream = peak_gflops(ext), stream_gbs(flush)
    chooser = kernel_choice.chooser(ext)
    caps = ", ".join(f"{e}={v}" for e, v in chooser.ident["caps"].items() if v) or "none"
    forced = ext.fp32_forced_kernel()
    print(f"# scratchlm kernels on {kernel_choice.cpu_model()}\n\n"
          f"- ISA: **{ext.isa_name()}** (caps: {caps}); threads: {args.threads}; torch {torch.__version__}\n"
          f"- fp32 FMA peak: **{peak:.1f} GFLOP/s**; streaming read: **{stream:.1f} GB/s** "
          f"(last-level cache {kernel_choice.last_level_cache_bytes() >> 20} MiB)\n"
          f"- fp32 kernel choice: {'forced: ' + kernel_choice.KERNELS[forced] if forced >= 0 else 'measured'}, "
          f"cache {chooser.path}\n", flush=True)
    print("fp32 linears (SmolLM2-135M's shapes) ...", flush=True)
    fp32 = fp32_rows(ext, shapes, rows, args.repeats, flush, peak, stream)
    print("\n" + table(["linear", "K x N", "M", "unit", *kernel_choice.KERNELS, "chosen", "chosen / peak (GB/s: "
                        "/ stream)"], fp32))
    if not args.no_quant:
        print("\nquantized linears (GGUF blocks, SmolLM2's down projection shape "
              f"{QUANT_SHAPE[2]}x{QUANT_SHAPE[1]}) ...", flush=True)
        quant = quant_rows(ext, args.repeats, flush, stream)
        if quant:
            print("\n" + table(["type", "bits/weight", "GB/s M=1", "/ stream", f"GB/s M={MEMORY_ROWS}", "/ stream",
                                "path M=1/8"], quant))
        else:
            print("(no gguf_linear binding in this build)")
    print(f"\nload average: {tuple(round(v, 2) for v in os.getloadavg())}; pin with taskset for steadier figures")
    return 0
