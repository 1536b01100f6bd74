"""GGUF weights kept in their file blocks: the kernels' achieved GB/s on SmolLM2-135M's shapes, one core, interleaved.

    python -m benchmarks.gguf_gemv [--sections blocks32] [--rows 1 8 32 512] [--isa native avx2] [--rounds 5]

Structure: one function per kernel family in SECTIONS (name -> section(ctx) -> rows of the report's table). Each
section makes its own weights and contenders and times them with `ctx.measure` (every contender of a group once
per round, interleaved, `--rounds` rounds, the minimum thread CPU time: the machine is shared). Each ISA column runs
in a child process (`--worker ISA`, with `benchmarks.common.isa_env`: SCRATCHLM_ISA=avx2 plus oneDNN / MKL capped to
AVX2, so an AVX-512 machine runs exactly the AVX2 code), which prints its rows as JSON; the parent writes one report.

Sections:
- blocks32 (csrc/gguf_blocks32.h): Q5_0, Q5_1 and IQ4_NL (what llama.cpp's quantizer writes for the K = 576 linears
  of a K-quant file) on the shapes 576->576 (q/o) and 576->1536 (gate/up), `--layers` x 2 distinct random matrices
  of each (60 at 30 layers: 14-41 MiB per shape, so the weights stream from memory as in decode; 4 matrices at
  more than 64 rows, where the work is compute-bound), against GGUF Q4_1 through quant_linear's 8-row kernels /
  panels (quant_gemm.h paths 6-9, the fastest 4-bit format before) on the same shapes, and a streaming read
  (torch.sum over 256 MiB). Paths: 6 / 7 the 8-row in-register kernels (AVX512-VNNI / AVX2), 8 / 9 the panels,
  100 gguf_gemm.h's dequantize-to-float32 + fp32 GEMM (its prefill default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from benchmarks.common import Report, isa_cap_text, isa_env, set_threads

ROW_MARK = "GGUF_GEMV_ROW "
HEADERS = ["ISA", "weights", "shape N x K", "rows M", "path", "ms / pass", "GB/s", "% of streaming read",
           "GB/s vs Q4_1's best path", "GFLOP/s"]


@dataclass
class Context:
    """What a section gets: the parsed arguments, the engine extension, this column's ISA and its streaming read."""

    args: argparse.Namespace
    eng: object
    isa: str
    stream_gbps: float = 0.0
    rows: list[list[str]] = field(default_factory=list)

    def measure(self, contenders: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Minimum thread CPU seconds of each contender over interleaved rounds (one warm-up call each first)."""
        for fn in contenders.values():
            fn()
        best = {name: float("inf") for name in contenders}
        for _ in range(self.args.rounds):
            for name, fn in contenders.items():
                t0 = time.thread_time()
                fn()
                best[name] = min(best[name], time.thread_time() - t0)
        return best


def streaming_read_gbps(rounds: int) -> float:
    """The best GB/s of torch.sum over 256 MiB of float32 (far larger than the caches): the weights' ceiling."""
    import torch

    big = torch.randn(64 * 2**20)
    best = float("inf")
    for _ in range(max(3, rounds)):
        t0 = time.thread_time()
        big.sum()
        best = min(best, time.thread_time() - t0)
    return big.numel() * 4 / best / 1e9


# ------------------------------------------------------------------------------------------------ blocks32
B32_TYPES = ("Q5_0", "Q5_1", "IQ4_NL")
B32_SHAPES = [(576, 576), (1536, 576)]  # (N, K): q / o, gate / up


def _b32_raw(qtype_name: str, n: int, k: int, seed: int):
    """(n, row_bytes) uint8 blocks: gguf.quants.quantize of Gaussian weights (Q5_0, Q5_1), random valid blocks for
    IQ4_NL (gguf.quants has no IQ4_NL quantizer; the kernels' speed does not depend on the values)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as QT
    from gguf import quants

    rng = np.random.default_rng(seed)
    if qtype_name != "IQ4_NL":
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        return torch.from_numpy(quants.quantize(w, QT[qtype_name]))
    blocks = rng.integers(0, 256, size=(n, k // 32, 18), dtype=np.uint8)
    blocks[:, :, :2] = (rng.uniform(0.2, 2.0, size=(n, k // 32)) * 1e-3).astype(np.float16).view(np.uint8).reshape(
        n, k // 32, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def _quant_pass(eng, x, mats: list, path: int) -> Callable[[], object]:
    """One pass of quant_linear (Q4_1 planes, group 32) over `mats` with x."""
    return lambda: [eng.quant_linear(x, t, 32, path) for t in mats]


def _gguf_pass(eng, x, raws: list, type_id: int, path: int) -> Callable[[], object]:
    """One pass of gguf_linear over the raw matrices `raws` of one type with x."""
    return lambda: [eng.gguf_linear(x, r, type_id, x.shape[1], path) for r in raws]


def section_blocks32(ctx: Context) -> None:
    import torch
    from gguf import GGMLQuantizationType as QT

    from scratchlm.inference.quantization import reference as ref

    eng, args = ctx.eng, ctx.args
    vnni = eng.quant_best_path() == 2
    dequant = eng.gguf_dequant_path()
    for n, k in B32_SHAPES:
        for m in args.rows:
            count = 2 * args.layers if m <= 64 else min(4, 2 * args.layers)
            gen = torch.Generator().manual_seed(n + m)
            q41 = []
            for _ in range(count):
                q, d, mins = ref.quantize_int4(torch.randn(n, k, generator=gen) * 0.02, 32, False)
                q41.append([q, d, mins])
            x = torch.randn(m, k, generator=gen)
            # Q4_1 through quant_gemm.h: 6 / 7 (8-row kernels) up to 64 rows, 8 / 9 (panels) above
            q41_paths = ([6] if vnni else []) + [7] if m <= 64 else ([8] if vnni else []) + [9]
            contenders, nbytes = {}, {}
            for p in q41_paths:
                contenders[f"Q4_1|{p}"] = _quant_pass(eng, x, q41, p)
            nbytes["Q4_1"] = sum(t.numel() * t.element_size() for t in q41[0]) * count
            for name in B32_TYPES:
                tid = int(QT[name])
                raws = [_b32_raw(name, n, k, seed=1000 * i + m) for i in range(count)]
                nbytes[name] = raws[0].numel() * count
                mine = (([6, 8] if vnni else []) + [7, 9]) if m <= 64 else ([8] if vnni else []) + [9, dequant]
                for p in mine:
                    contenders[f"{name}|{p}"] = _gguf_pass(eng, x, raws, tid, p)
            best = ctx.measure(contenders)
            q41_best = min(best[f"Q4_1|{p}"] for p in q41_paths)
            for key, t in best.items():
                name, p = key.split("|")
                gbps = nbytes[name] / t / 1e9
                ctx.rows.append([ctx.isa, name, f"{n} x {k}", str(m), p, f"{1e3 * t:.2f}", f"{gbps:.1f}",
                                 f"{100 * gbps / ctx.stream_gbps:.0f} %",
                                 f"{(nbytes[name] / t) / (nbytes['Q4_1'] / q41_best):.2f}x",
                                 f"{2 * m * n * k * count / t / 1e9:.1f}"])
            print(f"[{ctx.isa}] {n}x{k} M={m} done", file=sys.stderr)


SECTIONS: dict[str, Callable[[Context], None]] = {"blocks32": section_blocks32}


def worker(args: argparse.Namespace) -> int:
    """One ISA column (this process already has the cap in its environment): print the rows as JSON lines."""
    set_threads(1)
    if args.bind_core >= 0:
        os.sched_setaffinity(0, {args.bind_core})
    from scratchlm.inference.cpp_extensions import load_engine_kernels

    eng = load_engine_kernels()
    if eng is None:
        print("the engine's C++ kernels could not be built", file=sys.stderr)
        return 1
    ctx = Context(args, eng, args.worker)
    ctx.stream_gbps = streaming_read_gbps(args.rounds)
    ctx.rows.append([ctx.isa, "streaming read (torch.sum, 256 MiB)", "-", "-", "-", "-", f"{ctx.stream_gbps:.1f}",
                     "100 %", "-", "-"])
    for name in args.sections:
        SECTIONS[name](ctx)
    for row in ctx.rows:
        print(ROW_MARK + json.dumps(row), flush=True)
    print(ROW_MARK + json.dumps(["#cap", isa_cap_text(), {2: "avx512-vnni", 1: "avx2"}.get(eng.quant_best_path(),
                                                                                            "scalar")]), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 512])
    ap.add_argument("--isa", nargs="+", default=["native", "avx2"], choices=["native", "avx2"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--bind-core", type=int, default=0)
    ap.add_argument("--worker", choices=["native", "avx2"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows, caps = [], []
    passthrough = list(argv if argv is not None else sys.argv[1:])
    for isa in args.isa:
        cmd = [sys.executable, "-m", "benchmarks.gguf_gemv", *passthrough, "--worker", isa]
        out = subprocess.run(cmd, env=isa_env(isa), capture_output=True, text=True)
        sys.stderr.write(out.stderr[-4000:])
        if out.returncode != 0:
            print(f"the {isa} worker failed (exit {out.returncode})", file=sys.stderr)
            return 1
        for line in out.stdout.splitlines():
            if line.startswith(ROW_MARK):
                row = json.loads(line[len(ROW_MARK):])
                (caps if row[0] == "#cap" else rows).append(row)
    # a run of some sections only gets its own results file (a partial run never overwrites the full one)
    name = "gguf_gemv" if set(args.sections) == set(SECTIONS) else "gguf_gemv_" + "_".join(args.sections)
    report = Report(name, "GGUF block kernels on SmolLM2-135M's shapes", argv or sys.argv[1:])
    report.add("One core (pinned), torch threads 1; thread CPU time per pass over the matrices, minimum of "
               f"{args.rounds} interleaved rounds; GB/s = weight bytes / time. Columns (child processes): " +
               "; ".join(f"{c[1]} -> kernels run {c[2]}" for c in caps) + f". Load average at the end: "
               f"{os.getloadavg()[0]:.1f}.")
    report.add(__doc__.split("Sections:", 1)[1].strip())
    report.table(HEADERS, rows)
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
