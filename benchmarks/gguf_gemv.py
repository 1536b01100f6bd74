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
  (torch.sum over 256 MiB). Paths: 6 the in-register kernel on AVX512-VNNI (16 weight rows per tile, 512-bit), 7
  the AVX2 one (8 rows, maddubs), 8 / 9 the panels (tiles unpacked once per call: 16 / 8 rows), 100 gguf_gemm.h's
  dequantize-to-float32 + fp32 GEMM. Quant_gemm.h's Q4_1 paths: 6 / 7 its 8-row kernels, 8 / 9 its panels.
  `llama.cpp` = llama.cpp's own mul_mat of the same blocks and x (a one-node ggml graph on one thread through the
  column's libggml-cpu, .peers/llama-server-build or llama-avx2-build: x converted to Q8_0, then llamafile's
  tinyBLAS for Q5_0 / IQ4_NL, vec_dot for Q5_1, as llama.cpp runs them); last column: its time / this path's.
- kquants (csrc/gguf_kquants.h): Q4_K, Q6_K, Q5_K, Q3_K, Q2_K, IQ4_XS on two model shapes whose rows are multiples of
  256 weights (llama.cpp stores other rows in other types): `135m` = SmolLM2-135M's ffn_down (576 x 1536), one random
  matrix per layer (`--layers`; 30: 10-19 MiB, L3-sized here); `1b` = a TinyLlama-1.1B-like feed-forward (gate / up
  5632 x 2048, down 2048 x 5632), 4 layers (12 matrices, 78-114 MiB: from DRAM, as a 1B model's decode step reads
  them; 3 matrices at 32 rows and more). Random valid blocks (random bytes, finite fp16 scales: the kernels' speed
  does not depend on the values). Contenders: `default` (gguf_linear path -1: what the engine runs), paths 1 / 2 / 3
  (AVX2 maddubs, AVX-VNNI, AVX512-VNNI kernels, x rounded to int8 per 32-block; at every M, the prefill sizes
  included) and 100 (dequantize + fp32 GEMM, from 8 rows) forced; llama.cpp's own kernels through a small C shim
  linked against the column's llama.cpp build (.peers/llama-server-build: native; .peers/llama-avx2-build: the AVX2
  column): `llama.cpp` = its vec_dot for the type per (weight row, x row) after its from_float (Q8_K) of x, what it
  runs for a type it does not repack; `llama.cpp repack` (Q4_K, 1 row) = the 8-row interleaved copy llama.cpp makes of
  Q4_K at load on AVX2 CPUs (N % 8 == 0; the shim repacks as its make_block_q4_Kx8 does, untimed) and its
  ggml_gemv_q4_K_8x8_q8_K; `stream` = a streaming read of the same bytes (AVX2 loads; torch.sum above reads ~2x slower
  than the memory system here). The table's last column: llama.cpp's best time / this contender's (above 1: faster
  than llama.cpp).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.common import REPO_ROOT, Report, isa_cap_text, isa_env, set_threads

ROW_MARK = "GGUF_GEMV_ROW "
TABLE_MARK = "GGUF_GEMV_TABLE "  # rows of a section with its own table: [section, row]
HEADERS = ["ISA", "weights", "shape N x K", "rows M", "path", "ms / pass", "GB/s", "% of streaming read",
           "GB/s vs Q4_1's best path", "GFLOP/s", "llama.cpp time / this"]


@dataclass
class Context:
    """What a section gets: the parsed arguments, the engine extension, this column's ISA and its streaming read."""

    args: argparse.Namespace
    eng: object
    isa: str
    stream_gbps: float = 0.0
    rows: list[list[str]] = field(default_factory=list)
    tables: dict[str, list[list[str]]] = field(default_factory=dict)  # sections with their own columns

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


GG_SHIM = r"""
#include <stdint.h>
#include <stdlib.h>
#include "ggml.h"
#include "ggml-cpu.h"
/* llama.cpp's own mul_mat of W (N, K) of ggml type `type` by x (M, K): a one-node ggml graph on 1 thread, what
   llama.cpp runs for the matrix (x converted to its vec_dot type, then llamafile's tinyBLAS or vec_dot) */
struct job { struct ggml_context* ctx; struct ggml_cgraph* g; struct ggml_tensor* y; };
void* gg_make(int type, int64_t N, int64_t K, int64_t M, void* w, void* x) {
  ggml_cpu_init();
  struct ggml_init_params ip = {1 << 20, NULL, true};
  struct job* j = (struct job*)calloc(1, sizeof(struct job));
  j->ctx = ggml_init(ip);
  struct ggml_tensor* tw = ggml_new_tensor_2d(j->ctx, (enum ggml_type)type, K, N);
  struct ggml_tensor* tx = ggml_new_tensor_2d(j->ctx, GGML_TYPE_F32, K, M);
  tw->data = w, tx->data = x;
  j->y = ggml_mul_mat(j->ctx, tw, tx);
  j->y->data = malloc(sizeof(float) * N * M);
  j->g = ggml_new_graph(j->ctx);
  ggml_build_forward_expand(j->g, j->y);
  return j;
}
static uint8_t* work;
static size_t work_size;
float* gg_run(void* p) {
  struct job* j = (struct job*)p;
  struct ggml_cplan plan = ggml_graph_plan(j->g, 1, NULL);
  if (plan.work_size > work_size) free(work), work = (uint8_t*)malloc(plan.work_size), work_size = plan.work_size;
  plan.work_data = work;
  ggml_graph_compute(j->g, &plan);
  return (float*)j->y->data;
}
"""
GGML_INCLUDE = REPO_ROOT / ".peers" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "ggml" / "include"


def _gg_shim(isa: str):
    """llama.cpp's mul_mat through its ggml library of this column's build (None where that build is absent)."""
    libdir, cc = LLAMA_LIBS[isa], shutil.which("cc") or shutil.which("gcc")
    if cc is None or not (libdir / "libggml-cpu.so").exists() or not GGML_INCLUDE.is_dir():
        return None
    out = Path(tempfile.mkdtemp(prefix="gguf_gemv_gg_")) / "gg.so"
    out.with_suffix(".c").write_text(GG_SHIM)
    subprocess.run([cc, "-O2", "-shared", "-fPIC", str(out.with_suffix(".c")), f"-I{GGML_INCLUDE}", "-o", str(out),
                    f"-L{libdir}", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{libdir}"], check=True)
    lib = ctypes.CDLL(str(out))
    lib.gg_make.restype, lib.gg_run.restype = ctypes.c_void_p, ctypes.c_void_p
    lib.gg_make.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                            ctypes.c_void_p]
    lib.gg_run.argtypes = [ctypes.c_void_p]
    return lib


def _gg_pass(lib, jobs: list) -> Callable[[], object]:
    """One pass of llama.cpp's mul_mat over prepared graphs."""
    return lambda: [lib.gg_run(j) for j in jobs]


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
    gg = _gg_shim(ctx.isa)
    if gg is None:
        print(f"[{ctx.isa}] no llama.cpp build at {LLAMA_LIBS[ctx.isa]}: blocks32 without the llama.cpp column",
              file=sys.stderr)
    keep = []  # arrays the llama.cpp graphs point into
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
                if gg is not None:
                    xn = x.numpy().copy()
                    keep.append(xn)
                    jobs = [gg.gg_make(tid, n, k, m, r.numpy().ctypes.data, xn.ctypes.data) for r in raws]
                    contenders[f"{name}|llama.cpp"] = _gg_pass(gg, jobs)
            best = ctx.measure(contenders)
            q41_best = min(best[f"Q4_1|{p}"] for p in q41_paths)
            for key, t in best.items():
                name, p = key.split("|")
                gbps = nbytes[name] / t / 1e9
                peer = best.get(f"{name}|llama.cpp")
                ctx.rows.append([ctx.isa, name, f"{n} x {k}", str(m), p, f"{1e3 * t:.2f}", f"{gbps:.1f}",
                                 f"{100 * gbps / ctx.stream_gbps:.0f} %",
                                 f"{(nbytes[name] / t) / (nbytes['Q4_1'] / q41_best):.2f}x",
                                 f"{2 * m * n * k * count / t / 1e9:.1f}",
                                 f"{peer / t:.2f}x" if peer and p != "llama.cpp" else "-"])
            print(f"[{ctx.isa}] {n}x{k} M={m} done", file=sys.stderr)



# ------------------------------------------------------------------------------------------------ kquants
KQ_TYPES = {"Q4_K": (12, 144, (0, 2)), "Q6_K": (14, 210, (208,)), "Q5_K": (13, 176, (0, 2)), "Q3_K": (11, 110, (108,)),
            "Q2_K": (10, 84, (80, 82)), "IQ4_XS": (23, 136, (0,))}  # type id, bytes per 256 weights, fp16 offsets
KQ_HEADERS = ["ISA", "weights", "shape", "rows M", "contender", "ms / pass", "GB/s", "% of streaming read",
              "vs llama.cpp (best of its kernels)"]
LLAMA_LIBS = {"native": REPO_ROOT / ".peers" / "llama-server-build" / "bin",
              "avx2": REPO_ROOT / ".peers" / "llama-avx2-build" / "bin"}

SHIM = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>
typedef void (*from_float_t)(const float*, void*, int64_t);
typedef void (*vec_dot_t)(int, float*, size_t, const void*, size_t, const void*, size_t, int);
struct traits { from_float_t from_float; vec_dot_t vec_dot; int vec_dot_type; int64_t nrows; };
#ifdef WITH_GGML
extern const struct traits* ggml_get_type_traits_cpu(int type);
extern void ggml_cpu_init(void);
extern void ggml_gemv_q4_K_8x8_q8_K(int n, float* s, size_t bs, const void* vx, const void* vy, int nr, int nc);
void shim_init(void) { ggml_cpu_init(); }
/* y (M, N) = x (M, K) W^T by llama.cpp's vec_dot per (row, x row), x through its from_float (xq: scratch) */
void shim_gemm(int type, const float* x, int64_t M, const uint8_t* w, int64_t N, int64_t K, int64_t row_bytes,
               uint8_t* xq, int64_t xq_row_bytes, float* y) {
  const struct traits* t = ggml_get_type_traits_cpu(type);
  const struct traits* tx = ggml_get_type_traits_cpu(t->vec_dot_type);
  for (int64_t m = 0; m < M; ++m) tx->from_float(x + m * K, xq + m * xq_row_bytes, K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      t->vec_dot((int)K, y + m * N + n, 0, w + n * row_bytes, 0, xq + m * xq_row_bytes, 0, 1);
}
/* llama.cpp's load-time repack of Q4_K for AVX2 CPUs (ggml-cpu/repack.cpp, make_block_q4_Kx8, interleave 8) */
typedef struct { uint16_t d[8]; uint16_t dmin[8]; uint8_t scales[96]; uint8_t qs[1024]; } q4kx8;
void shim_repack_q4_K(const uint8_t* w, int64_t N, int64_t K, uint8_t* out_bytes) {
  const int64_t nb = K / 256, rb = nb * 144;
  q4kx8* out = (q4kx8*)out_bytes;
  for (int64_t x = 0; x < N / 8; ++x)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* in[8];
      for (int i = 0; i < 8; ++i) in[i] = w + (x * 8 + i) * rb + b * 144;
      q4kx8* o = out + x * nb + b;
      for (int i = 0; i < 8; ++i) { memcpy(&o->d[i], in[i], 2); memcpy(&o->dmin[i], in[i] + 2, 2); }
      for (int i = 0; i < 128; ++i) memcpy(o->qs + i * 8, in[i % 8] + 16 + (i / 8) * 8, 8);
      uint8_t s[8], m[8];
      for (int h = 0; h < 2; ++h)
        for (int i = 0; i < 4; ++i) {
          for (int j = 0; j < 8; ++j) {
            const uint8_t* sc = in[j] + 4;
            if (h == 0) { s[j] = sc[i] & 63; m[j] = sc[i + 4] & 63; }
            else {
              s[j] = ((sc[i] & 192) >> 2) | (sc[i + 8] & 15);
              m[j] = ((sc[i + 4] & 192) >> 2) | ((sc[i + 8] & 240) >> 4);
            }
          }
          uint8_t* d = o->scales + h * 48 + i * 12;
          for (int j = 0; j < 4; ++j) {
            d[j] = (s[j] & 63) + ((s[j + 4] & 48) << 2); d[4 + j] = (m[j] & 63) + ((m[j + 4] & 48) << 2);
            d[8 + j] = (s[j + 4] & 15) + ((m[j + 4] & 15) << 4);
          }
        }
    }
}
void shim_gemv_q4_K_repacked(const float* x, const uint8_t* wr, int64_t N, int64_t K, uint8_t* xq, float* y) {
  ggml_get_type_traits_cpu(15)->from_float(x, xq, K);  /* Q8_K */
  ggml_gemv_q4_K_8x8_q8_K((int)K, y, 0, wr, xq, 1, (int)N);
}
#endif
/* a streaming read: the sum of the bytes as 32-bit words, 4 accumulators of AVX2 loads */
__attribute__((target("avx2"))) int64_t shim_stream(const uint8_t* p, int64_t n) {
  __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
  int64_t i = 0;
  for (; i + 128 <= n; i += 128) {
    a = _mm256_add_epi32(a, _mm256_loadu_si256((const __m256i*)(p + i)));
    b = _mm256_add_epi32(b, _mm256_loadu_si256((const __m256i*)(p + i + 32)));
    c = _mm256_add_epi32(c, _mm256_loadu_si256((const __m256i*)(p + i + 64)));
    d = _mm256_add_epi32(d, _mm256_loadu_si256((const __m256i*)(p + i + 96)));
  }
  __m256i s = _mm256_add_epi32(_mm256_add_epi32(a, b), _mm256_add_epi32(c, d));
  int32_t v[8];
  _mm256_storeu_si256((__m256i*)v, s);
  int64_t t = 0;
  for (int k = 0; k < 8; ++k) t += v[k];
  for (; i < n; ++i) t += p[i];
  return t;
}
"""



def _kq_shim(isa: str):
    """The C shim (llama.cpp's kernels where this column's build is there, the streaming read): (lib, note)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("no C compiler: the kquants section's shim cannot be built")
    out = Path(tempfile.mkdtemp(prefix="gguf_gemv_")) / "shim.so"
    src = out.with_suffix(".c")
    src.write_text(SHIM)
    libdir = LLAMA_LIBS[isa]
    with_ggml = (libdir / "libggml-cpu.so").exists()
    cmd = [cc, "-O2", "-shared", "-fPIC", str(src), "-o", str(out)]
    if with_ggml:
        cmd += ["-DWITH_GGML", f"-L{libdir}", "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{libdir}"]
    subprocess.run(cmd, check=True)
    lib = ctypes.CDLL(str(out))
    if with_ggml:
        lib.shim_init()
    lib.shim_stream.restype = ctypes.c_int64
    return lib, (f"{libdir}/libggml-cpu.so" if with_ggml else f"no llama.cpp build at {libdir}")


def _kq_blocks(type_name: str, n: int, k: int, rng):
    """(n, k / 256 * block bytes) uint8 random blocks with finite fp16 scales (|d| in 4e-4 .. 2e-3)."""
    import numpy as np

    _, bb, offs = KQ_TYPES[type_name]
    nsb = k // 256
    raw = rng.integers(0, 256, size=(n, nsb, bb), dtype=np.uint8)
    for off in offs:
        half = (rng.uniform(0.2, 1.0, size=(n, nsb)) * rng.choice([-1, 1], size=(n, nsb)) * 2e-3).astype(np.float16)
        raw[:, :, off:off + 2] = half.view(np.uint8).reshape(n, nsb, 2)
    return raw.reshape(n, nsb * bb)


def _kq_llama(lib, tid: int, mats, shapes, xs, ys, xq, m: int, repacked=None) -> Callable[[], object]:
    """One pass of llama.cpp's vec_dot (or, with `repacked`, its Q4_K repacked gemv) over the matrices."""
    P, i64 = ctypes.c_void_p, ctypes.c_int64

    def run():
        for i, w in enumerate(mats):
            n, k = shapes[i]
            x = xs[k].numpy()
            if repacked is None:
                lib.shim_gemm(tid, x.ctypes.data_as(P), i64(m), w.ctypes.data_as(P), i64(n), i64(k), i64(w.shape[1]),
                              xq.ctypes.data_as(P), i64(k // 256 * 292), ys[i].ctypes.data_as(P))
            else:
                lib.shim_gemv_q4_K_repacked(x.ctypes.data_as(P), repacked[i].ctypes.data_as(P), i64(n), i64(k),
                                            xq.ctypes.data_as(P), ys[i].ctypes.data_as(P))
    return run


def _kq_ours(eng, xs, wt, shp, tid: int, path: int) -> Callable[[], object]:
    """One pass of gguf_linear over the raw matrices `wt` (shapes `shp`) with x rows xs[K]."""
    return lambda: [eng.gguf_linear(xs[k], w, tid, k, path) for w, (_, k) in zip(wt, shp)]


def _kq_stream(lib, mats) -> Callable[[], object]:
    """A streaming read of the matrices' bytes."""
    return lambda: [lib.shim_stream(ctypes.c_void_p(w.ctypes.data), ctypes.c_int64(w.nbytes)) for w in mats]


def section_kquants(ctx: Context) -> None:
    import numpy as np
    import torch

    eng, args = ctx.eng, ctx.args
    lib, note = _kq_shim(ctx.isa)
    has_llama = hasattr(lib, "shim_gemm")
    P, i64 = ctypes.c_void_p, ctypes.c_int64
    probe = torch.zeros(8, 144, dtype=torch.uint8)
    paths = sorted({eng.gguf_resolve_path(probe, 12, 256, 1, p) for p in (1, 2, 3)})
    dequant = eng.gguf_dequant_path()
    shapes_of = {"135m": [(576, 1536)] * args.layers, "1b": [(5632, 2048), (5632, 2048), (2048, 5632)] * 4}
    table = ctx.tables.setdefault("kquants", [])
    table.append([ctx.isa, f"llama.cpp: {note}", "-", "-", "-", "-", "-", "-", "-"])
    rng = np.random.default_rng(0)
    for tname in args.kq_types:
        tid = KQ_TYPES[tname][0]
        for shape in args.kq_shapes:
            full = shapes_of[shape]
            mats_np = [_kq_blocks(tname, n, k, rng) for n, k in full]
            for m in args.rows:
                sel = list(range(len(full))) if m < 32 or shape == "135m" else list(range(3))
                shp = [full[i] for i in sel]
                wn = [mats_np[i] for i in sel]
                wt = [torch.from_numpy(w) for w in wn]
                nbytes = sum(w.nbytes for w in wn)
                xs = {k: torch.randn(m, k, generator=torch.Generator().manual_seed(k)) for _, k in shp}
                ys = [np.zeros((m, n), np.float32) for n, _ in shp]
                xq = np.zeros(m * (max(k for _, k in shp) // 256 * 292 + 64), np.uint8)  # x as Q8_K rows

                cont = {"default": _kq_ours(eng, xs, wt, shp, tid, -1)}
                cont.update({f"path {p}": _kq_ours(eng, xs, wt, shp, tid, p) for p in paths})  # at M > 64 too
                if m >= 8:
                    cont[f"path {dequant}"] = _kq_ours(eng, xs, wt, shp, tid, dequant)
                if has_llama:
                    cont["llama.cpp"] = _kq_llama(lib, tid, wn, shp, xs, ys, xq, m)
                    if tname == "Q4_K" and m == 1 and all(n % 8 == 0 for n, _ in shp):
                        packed = []
                        for w, (n, k) in zip(wn, shp):
                            packed.append(np.zeros(w.nbytes, np.uint8))
                            lib.shim_repack_q4_K(w.ctypes.data_as(P), i64(n), i64(k), packed[-1].ctypes.data_as(P))
                        cont["llama.cpp repack"] = _kq_llama(lib, tid, wn, shp, xs, ys, xq, m, packed)
                cont["stream"] = _kq_stream(lib, wn)
                best = ctx.measure(cont)
                lla = min((t for k, t in best.items() if k.startswith("llama.cpp")), default=None)
                for key, t in best.items():
                    table.append([ctx.isa, tname, f"{shape} ({len(sel)} x {shp[0][0]} x {shp[0][1]}..)", str(m), key,
                                  f"{1e3 * t:.2f}", f"{nbytes / t / 1e9:.1f}", f"{100 * best['stream'] / t:.0f} %",
                                  f"{lla / t:.2f}x" if lla and not key.startswith(("llama", "stream")) else "-"])
                print(f"[{ctx.isa}] {tname} {shape} M={m}: " + ", ".join(
                    f"{k} {nbytes / t / 1e9:.1f}" for k, t in best.items()) + " GB/s", file=sys.stderr, flush=True)

SECTIONS: dict[str, Callable[[Context], None]] = {"blocks32": section_blocks32, "kquants": section_kquants}


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
                     "100 %", "-", "-", "-"])
    for name in args.sections:
        SECTIONS[name](ctx)
    for row in ctx.rows:
        print(ROW_MARK + json.dumps(row), flush=True)
    for name, rows in ctx.tables.items():
        for row in rows:
            print(TABLE_MARK + json.dumps([name, row]), flush=True)
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
    ap.add_argument("--kq-types", nargs="+", default=list(KQ_TYPES), choices=list(KQ_TYPES), help="kquants section")
    ap.add_argument("--kq-shapes", nargs="+", default=["135m", "1b"], choices=["135m", "1b"], help="kquants section")
    ap.add_argument("--worker", choices=["native", "avx2"], help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    rows, caps, tables = [], [], {}
    passthrough = list(argv if argv is not None else sys.argv[1:])
    for isa in args.isa:
        cmd = [sys.executable, "-m", "benchmarks.gguf_gemv", *passthrough, "--worker", isa]
        out = subprocess.run(cmd, env=isa_env(isa), capture_output=True, text=True)
        sys.stderr.write(out.stderr[-4000:])
        if out.returncode != 0:
            print(f"the {isa} worker failed (exit {out.returncode})", file=sys.stderr)
            return 1
        for line in out.stdout.splitlines():
            if line.startswith(TABLE_MARK):
                name, row = json.loads(line[len(TABLE_MARK):])
                tables.setdefault(name, []).append(row)
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
    if len(rows) > len(args.isa):  # more than the streaming-read rows
        report.table(HEADERS, rows)
    if "kquants" in tables:
        report.table(KQ_HEADERS, tables["kquants"], caption="kquants: csrc/gguf_kquants.h against llama.cpp")
    report.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
