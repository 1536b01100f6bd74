// y (M, N) = x (M, K) @ W^T for W (N, K) float32 row-major and few rows M (decode batches), on the CPU.
//
// BLAS GEMMs are tuned for large M; with M = 1..64 they reach a fraction of the core's FMA rate (measured:
// MKL sgemm at M = 32, K = 576: ~30 GFLOP/s on one AVX2 core). This kernel reads W exactly once, in tiles of
// 4 rows that stay in L1 while every x row passes by: per 8-wide k step a 4 x 3 register tile does 12 FMAs
// for 7 loads (4 from W, 3 from x), so the loop is bound by FMAs, not loads, and by memory only when M is
// small. Each (n, m) output is a dot product; the 8 lanes are summed once at the end.
// Decode weights do not fit in any cache (a step reads ~0.5 GB), and the hardware prefetcher does not run far
// enough ahead on its own: the FMAs of one tile and the DRAM reads of the next did not overlap (measured: time
// = memory time + compute time). So while a tile computes, its micro calls prefetch the W rows two tiles
// ahead, a share each (measured on the 30 layers of SmolLM2-135M, one core: 1.3-1.5x at M = 8..32).
// An AVX-512 path (4 x 4 tiles of 16-float vectors), an AVX2+FMA path (function target attributes, chosen at
// run time) and a portable scalar path. More than 64 rows (prefill): large_gemm, oneDNN's matmul.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>

#include "simd_common.h"

namespace scratchlm_gemm {

using scratchlm_simd::cpu_has_avx2;

// Which fp32 kernels run, settable at run time so a benchmark can interleave them (kernel_choice()):
// the AVX-512 skinny tiles (where the CPU has AVX-512F; env SCRATCHLM_SKINNY_AVX512=0: off) and oneDNN for many
// rows (env SCRATCHLM_ONEDNN=0: ATen's mm).
struct KernelChoice {
  std::atomic<bool> avx512, onednn;
};

inline bool env_off(const char* name) {
  const char* env = std::getenv(name);
  return env && env[0] == '0';
}

inline KernelChoice& kernel_choice() {
  static KernelChoice c{{!env_off("SCRATCHLM_SKINNY_AVX512")}, {!env_off("SCRATCHLM_ONEDNN")}};
  return c;
}

inline void tile_scalar(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    for (int64_t m = 0; m < M; ++m) {
      const float* xr = x + m * K;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += xr[k] * wr[k];
      y[m * N + n] = acc;
    }
  }
}

#ifdef SCRATCHLM_X86
using scratchlm_simd::hsum256;

#define AVX512_FN __attribute__((target("avx512f,avx512vl,fma")))

using scratchlm_simd::cpu_has_avx512;  // honours $SCRATCHLM_ISA

inline bool skinny_avx512() { return kernel_choice().avx512.load(std::memory_order_relaxed) && cpu_has_avx512(); }

constexpr int64_t kPrefetchTiles = 2;  // how many tiles ahead W is prefetched (measured: 1-2 best, 4+ worse)

// Rows n .. n+R-1 of W against rows m .. m+C-1 of x; K % 8 == 0. Prefetches pf_bytes from pf on the way.
template <int R, int C>
AVX2_FN inline void micro(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n, int64_t m,
                          const char* pf, int64_t pf_bytes) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const float* wr[R];
  const float* xr[C];
  for (int r = 0; r < R; ++r) wr[r] = w + (n + r) * K;
  for (int c = 0; c < C; ++c) xr[c] = x + (m + c) * K;
  const int64_t per_step = (pf_bytes / 64 + K / 8 - 1) / (K / 8);  // cache lines to prefetch per k step
  for (int64_t k = 0; k < K; k += 8) {
    for (int64_t i = 0; i < per_step && pf_bytes > 0; ++i, pf += 64, pf_bytes -= 64) _mm_prefetch(pf, _MM_HINT_T0);
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(wr[r] + k);
    for (int c = 0; c < C; ++c) {
      const __m256 xv = _mm256_loadu_ps(xr[c] + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) y[(m + c) * N + n + r] = hsum256(acc[r][c]);
}

// Rows n .. n+R-1 of W against all M rows of x; n_end bounds this thread's rows (the prefetch stays inside).
template <int R>
AVX2_FN inline void rows_avx2(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n,
                              int64_t n_end) {
  const int64_t ahead = n + kPrefetchTiles * R;
  const char* pf = reinterpret_cast<const char*>(w + ahead * K);
  const int64_t total = ahead + R <= n_end ? R * K * 4 : 0;  // bytes of the tile to prefetch
  const int64_t calls = M > 16 ? (M + 2) / 3 : (M + 1) / 2;
  const int64_t share = ((total + calls - 1) / calls + 63) / 64 * 64;  // per micro call, whole cache lines
  int64_t done = 0;
  auto run = [&](auto tile, int64_t m) {
    const int64_t bytes = std::min(share, total - done);
    tile(x, w, y, K, N, n, m, pf + done, bytes);
    done += bytes;
  };
  int64_t m = 0;
  if (M > 16) {  // measured: 4 x 3 tiles win for larger M, 4 x 2 (fewer registers live) for smaller
    for (; m + 3 <= M; m += 3) run(micro<R, 3>, m);
  } else {
    for (; m + 2 <= M; m += 2) run(micro<R, 2>, m);
  }
  if (M - m == 2) run(micro<R, 2>, m);
  else if (M - m == 1) run(micro<R, 1>, m);
}

// The AVX-512 twin of micro/rows_avx2: 16 floats per k step and 32 vector registers, so 4 x 4 tiles (16
// accumulators) for every M; K % 16 == 0. On AMD Zen 4 (512-bit ops issue as two 256-bit halves) the FMA rate is
// AVX2's, but a k step needs half the instructions (measured, one core, cache-resident W: see
// benchmarks/engine_phases.py); on cores with two 512-bit FMA units it doubles the peak.
template <int R, int C>
AVX512_FN inline void micro512(const float* x, const float* w, float* y, int64_t K, int64_t N, int64_t n, int64_t m,
                               const char* pf, int64_t pf_bytes) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* wr[R];
  const float* xr[C];
  for (int r = 0; r < R; ++r) wr[r] = w + (n + r) * K;
  for (int c = 0; c < C; ++c) xr[c] = x + (m + c) * K;
  const int64_t per_step = (pf_bytes / 64 + K / 16 - 1) / (K / 16);
  for (int64_t k = 0; k < K; k += 16) {
    for (int64_t i = 0; i < per_step && pf_bytes > 0; ++i, pf += 64, pf_bytes -= 64) _mm_prefetch(pf, _MM_HINT_T0);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(wr[r] + k);
    for (int c = 0; c < C; ++c) {
      const __m512 xv = _mm512_loadu_ps(xr[c] + k);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm512_fmadd_ps(wv[r], xv, acc[r][c]);
    }
  }
  if constexpr (R == 4) {  // the 4 sums of one x row side by side: halve each, then a horizontal-add tree
    for (int c = 0; c < C; ++c) {
      __m256 h[4];
      for (int r = 0; r < 4; ++r)
        h[r] = _mm256_add_ps(_mm512_castps512_ps256(acc[r][c]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[r][c]), 1)));
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
      _mm_storeu_ps(y + (m + c) * N + n, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
  } else {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) y[(m + c) * N + n + r] = _mm512_reduce_add_ps(acc[r][c]);
  }
}

template <int R>
AVX512_FN inline void rows_avx512(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                                  int64_t n, int64_t n_end) {
  const int64_t ahead = n + kPrefetchTiles * R;
  const char* pf = reinterpret_cast<const char*>(w + ahead * K);
  const int64_t total = ahead + R <= n_end ? R * K * 4 : 0;
  const int64_t calls = (M + 3) / 4;
  const int64_t share = ((total + calls - 1) / calls + 63) / 64 * 64;
  int64_t done = 0;
  auto run = [&](auto tile, int64_t m) {
    const int64_t bytes = std::min(share, total - done);
    tile(x, w, y, K, N, n, m, pf + done, bytes);
    done += bytes;
  };
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) run(micro512<R, 4>, m);
  if (M - m == 3) run(micro512<R, 3>, m);
  else if (M - m == 2) run(micro512<R, 2>, m);
  else if (M - m == 1) run(micro512<R, 1>, m);
}

AVX512_FN inline void tile_avx512(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N,
                                  int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) rows_avx512<4>(x, w, y, M, K, N, n, n1);
  for (; n < n1; ++n) rows_avx512<1>(x, w, y, M, K, N, n, n1);
}

AVX2_FN inline void tile_avx2(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) rows_avx2<4>(x, w, y, M, K, N, n, n1);
  for (; n < n1; ++n) rows_avx2<1>(x, w, y, M, K, N, n, n1);
}

#endif

// y (M, N) = x (M, K) @ w (N, K)^T, all contiguous row-major float32. Threads split W's rows in multiples of 4;
// each thread reads its own slice of W once.
inline void skinny_gemm(const float* xp, const float* wp, float* yp, int64_t M, int64_t K, int64_t N, bool use_simd) {
#ifdef SCRATCHLM_X86
  const bool simd = use_simd && K % 8 == 0 && cpu_has_avx2();
  const bool wide = simd && K % 16 == 0 && skinny_avx512();
#else
  const bool simd = false;
  (void)use_simd;
#endif
  const int64_t grain = std::max<int64_t>(4, ((1 << 16) / std::max<int64_t>(1, K * M) + 3) / 4 * 4);
  at::parallel_for(0, (N + 3) / 4, grain / 4, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * 4, n1 = std::min(N, b1 * 4);
#ifdef SCRATCHLM_X86
    if (wide) { tile_avx512(xp, wp, yp, M, K, N, n0, n1); return; }
    if (simd) { tile_avx2(xp, wp, yp, M, K, N, n0, n1); return; }
#endif
    tile_scalar(xp, wp, yp, M, K, N, n0, n1);
  });
}

// y (M, N) = x (M, K) @ w (N, K)^T for many rows (prefill chunks), float32 CPU. oneDNN's matmul (ATen's
// mkldnn::_linear_pointwise, the op torch.compile's CPU fusions call) for 65..kOneDnnMaxRows rows where this torch
// has it, else ATen's mm (MKL). oneDNN repacks the weight on every call (no second copy is kept) and its result is
// copied into y. Measured on one AVX-512 core (Zen 4), thread CPU, the 7 linears of SmolLM2 layers: with the
// weights in cache 1.05x MKL at 128 rows, 1.05-1.10x at 300-512; with all 30 layers' weights (cold) 1.11-1.15x at
// 96-256 rows, 1.09x at 384, 1.13x at 490, but 0.91-1.01x at exactly 512 (three runs; 1.12-1.18x when called
// directly from Python, so the copy or this call path costs there), so full 512-token steps keep MKL.
// SCRATCHLM_ONEDNN=0 (or set_fp32_kernels) keeps ATen's mm for every size.
constexpr int64_t kOneDnnMaxRows = 511;

inline void large_gemm(const at::Tensor& x, const at::Tensor& w, at::Tensor& y) {
  static const c10::OperatorHandle* op = []() -> const c10::OperatorHandle* {
    static auto h = c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
    return h.has_value() ? &*h : nullptr;
  }();
  const bool onednn = kernel_choice().onednn.load(std::memory_order_relaxed);
  if (op != nullptr && onednn && x.size(0) <= kOneDnnMaxRows && x.scalar_type() == at::kFloat &&
      w.scalar_type() == at::kFloat && x.device().is_cpu() &&
      x.is_contiguous() && w.is_contiguous()) {
    std::vector<c10::IValue> stack{x, w, c10::IValue(), std::string("none"),
                                   c10::List<std::optional<c10::Scalar>>(), c10::IValue()};
    op->callBoxed(&stack);
    y.copy_(stack[0].toTensor());
    return;
  }
  at::mm_out(y, x, w.t());
}

}  // namespace scratchlm_gemm
