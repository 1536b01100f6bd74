// y = x @ W^T for float32 W stored in PANELS, on the CPU, for any number of rows of x (decode and prefill).
//
// Layout: W (N, K) becomes P = ceil(N / 16) panels of (K, 16): panel p holds output columns 16p .. 16p+15, k-major,
// so one k step of a panel is one 64-byte cache line (one 16-float vector) and the whole panel is one contiguous
// block (K * 64 bytes) that the kernel streams front to back; columns past N are zero. Several matrices that read
// the same x (q/k/v, gate/up) are packed one after the other into one panel tensor (each padded to 16 columns on
// its own) and multiplied in one call, each writing its own output (PanelOut). The engine keeps only this copy of
// its fp32 linear weights (fast_linear.py packs them at set-up; state_dict unpacks).
//
// Kernel (AVX-512): an MR x NV tile of accumulators, MR rows of x by NV panels (16 lanes each); per k step NV panel
// vectors are loaded and every x element is broadcast (folded into the FMA as a {1to16} memory operand), so a k step
// is MR * NV FMAs for NV loads + MR broadcasts: FMA-bound, with no horizontal sums (the old skinny tiles reduced 16
// lanes per output and re-read W's rows from L1 for every 4 rows of x). Measured (benchmarks/fp32_gemm.py, Zen 4,
// one core, the 30 layers of SmolLM2-135M): 6 x 4 tiles (24 accumulators, 4 panels = 64 columns, each panel one
// sequential stream) are as fast as or faster than 16 x 1 and 14 x 2 at every M from 1 to 512, so every M runs them
// but 7-8 rows, which run one 8 x 3 tile per 3 panels (two 4 x 4 tiles read each group twice: 1.1-1.25x, Zen 5);
// W's 4-panel group (K * 256 bytes) stays in L2 while the 6-row blocks of x pass by, and is read once from memory.
// Leftover panels (P % 4) take 14 x 2 / 16 x 1 tiles; tiles of 20+ rows x 1 panel ran at half speed (spills).
// Decode batches (7-32 rows: 2-6 row tiles per group) are bound by memory and FMAs about equally, so the two must
// overlap: while a group's row tiles run, the kernel prefetches the NEXT group into L2 (prefetcht1, spread evenly
// over the k steps of the tiles), so the first tile of every group finds its panels in L2 instead of waiting on
// memory while the other tiles leave memory idle; one tile (<= 6 rows) is left to the hardware prefetchers (there
// the extra stream cost 3-20 %). The panels lie in 2 MiB huge pages (alloc_panels): in 4 KiB pages the prefetches
// gained nothing (the hardware streams stop at every page). The head's logits (larger than L2, behind 113 MB of
// weights) go out with non-temporal stores (streaming()). Measured (benchmarks/fp32_gemm.py --decode, one core,
// ~30 GB/s streaming read): a decode step's GEMMs 1.09-1.39x the kernel without these at 1-32 rows (1.13x at 17),
// ~100 GFLOP/s (86 % of peak) from 16 rows on, 77-89 % of the streaming read at 1-8 rows. Tried and dropped:
// prefetching 2-3 groups ahead, capping the prefetch, and the next call's first group (o -> gate/up -> down ->
// q/k/v in the fused step): no gain.
// Paths: AVX-512 (function target attributes, chosen at run time), AVX2+FMA (6 x 16-column tiles), portable scalar.
// Threads split the panels.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <unistd.h>

#include "simd_common.h"
#include "skinny_gemm.h"

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace scratchlm_panel {

constexpr int64_t kLanes = 16;  // columns per panel

// One output of a panel GEMM: panels [p0, p1) of the packed weight hold its n columns; row m goes to y + m * ld.
struct PanelOut {
  float* y;
  int64_t ld, p0, p1, n;
};

// A float32 tensor of `numel` floats for packed panels: at least 2 MiB go into 2 MiB-aligned memory advised as
// transparent huge pages (MADV_HUGEPAGE; the kernel decides), so the kernel's 4-panel streams do not cross a 4 KiB
// page (and a TLB miss) every 64 lines and the hardware prefetchers run across whole panels. Smaller, or with
// $SCRATCHLM_HUGE_PAGES=0 (the switch inference/huge_pages.py reads for the KV cache): at::empty.
inline at::Tensor alloc_panels(int64_t numel) {
#if defined(__linux__)
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = static_cast<size_t>(numel) * sizeof(float);
  const char* env = std::getenv("SCRATCHLM_HUGE_PAGES");
  if (bytes >= kHuge && !(env != nullptr && std::string(env) == "0")) {
    const size_t len = (bytes + kHuge - 1) / kHuge * kHuge;
    void* p = nullptr;
    if (posix_memalign(&p, kHuge, len) == 0) {
      madvise(p, len, MADV_HUGEPAGE);  // advice only: without THP the memory stays in 4 KiB pages
      return at::from_blob(p, {numel}, [](void* q) { std::free(q); }, at::TensorOptions().dtype(at::kFloat));
    }
  }
#endif
  return at::empty({numel}, at::TensorOptions().dtype(at::kFloat));
}

// w (N, K) row-major -> out (ceil(N/16), K, 16).
inline void pack(const float* w, int64_t N, int64_t K, float* out) {
  const int64_t P = (N + kLanes - 1) / kLanes;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kLanes; ++j) {
        const int64_t n = p * kLanes + j;
        float* o = out + p * K * kLanes + j;
        if (n < N) {
          const float* r = w + n * K;
          for (int64_t k = 0; k < K; ++k) o[k * kLanes] = r[k];
        } else {
          for (int64_t k = 0; k < K; ++k) o[k * kLanes] = 0.f;
        }
      }
  });
}

// Where column block (panel) p of the output goes: its row-0 pointer, row stride and valid lanes (0..16).
struct Dest {
  float* y;
  int64_t ld, valid;
  bool stream = false;  // non-temporal stores where a row of 16 columns is one aligned 64-byte line
};

inline Dest dest_of(const PanelOut* outs, int nouts, int64_t p) {
  for (int i = 0; i < nouts; ++i) {
    const PanelOut& o = outs[i];
    if (p >= o.p0 && p < o.p1) {
      const int64_t c = (p - o.p0) * kLanes;
      return {o.y + c, o.ld, std::min<int64_t>(kLanes, o.n - c)};
    }
  }
  return {nullptr, 0, 0};
}

inline void tile_scalar(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, const Dest& d) {
  for (int64_t m = 0; m < M; ++m) {
    float acc[kLanes] = {0};
    const float* xr = x + m * ldx;
    for (int64_t k = 0; k < K; ++k)
      for (int64_t j = 0; j < kLanes; ++j) acc[j] += xr[k] * w[k * kLanes + j];
    for (int64_t j = 0; j < d.valid; ++j) d.y[m * d.ld + j] = acc[j];
  }
}

#ifdef SCRATCHLM_X86
#define PANEL512_FN __attribute__((target("avx512f,avx512vl,fma")))

constexpr int64_t kPrefetchLines = 24;  // how far ahead (64-byte lines = k steps) a panel is prefetched

// The kernel's memory hints for decode batches (on unless $SCRATCHLM_PANEL_STREAMING is "0"; settable so that a
// benchmark can interleave with and without): a 4-panel group prefetches the next group into L2 while its row
// tiles run, and a call whose output is larger than L2 while its weights are larger than L3 (the tied head: 113 MB
// of panels, 3.3 MB of logits at 17 rows) writes whole 16-column vectors with non-temporal stores: the weight
// stream would evict those lines before anyone reads them, and a normal store first reads each line from memory.
constexpr int64_t kStreamOutBytes = int64_t{2} << 20, kStreamWeightBytes = int64_t{32} << 20;

inline std::atomic<bool>& streaming() {
  static std::atomic<bool> on{!scratchlm_gemm::env_off("SCRATCHLM_PANEL_STREAMING")};
  return on;
}

// Software prefetch (into L2) of `n` 64-byte lines per k step from `pf` on: spreads the next group over the tiles.
struct Prefetch {
  const char* pf;
  int64_t n;
};

// Rows m .. m+MR-1 of x against panels p .. p+NV-1 (w points at panel p; panels are K * 16 floats apart).
template <int MR, int NV>
PANEL512_FN void tile512(const float* x, int64_t ldx, int64_t K, const float* w, const Dest* d, int64_t m,
                         Prefetch pre) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const float* xr = x + m * ldx;
  const char* pf = pre.pf;
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t i = 0; i < pre.n; ++i) _mm_prefetch(pf + i * 64, _MM_HINT_T1);
    pf += pre.n * 64;
    __m512 b[NV];
    for (int v = 0; v < NV; ++v) {
      const float* wv = w + v * K * kLanes + k * kLanes;
      if (NV == 1) _mm_prefetch(reinterpret_cast<const char*>(wv + kPrefetchLines * kLanes), _MM_HINT_T0);
      b[v] = _mm512_loadu_ps(wv);
    }
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(xr[r * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(a, b[v], acc[r][v]);
    }
  }
  for (int v = 0; v < NV; ++v) {
    const __mmask16 mask = static_cast<__mmask16>((1u << d[v].valid) - 1u);
    if (mask == 0) continue;
    const bool stream = d[v].stream && mask == 0xFFFF && reinterpret_cast<uintptr_t>(d[v].y) % 64 == 0 &&
                        d[v].ld % 16 == 0;
    for (int r = 0; r < MR; ++r) {
      if (stream) _mm512_stream_ps(d[v].y + (m + r) * d[v].ld, acc[r][v]);
      else _mm512_mask_storeu_ps(d[v].y + (m + r) * d[v].ld, mask, acc[r][v]);
    }
  }
}

using Tile512 = void (*)(const float*, int64_t, int64_t, const float*, const Dest*, int64_t, Prefetch);

template <int NV, size_t... I>
constexpr std::array<Tile512, sizeof...(I)> tiles512(std::index_sequence<I...>) {
  return {&tile512<static_cast<int>(I) + 1, NV>...};
}

constexpr int kSkinnyRows = 16;  // NV = 1 tiles: up to 16 accumulators (measured: 20+ rows run at half speed)
constexpr int kWideRows = 14;    // NV = 2 tiles: 28 accumulators
constexpr int kQuadRows = 6;     // NV = 4 tiles: 24 accumulators
constexpr int kTriRows = 8;      // NV = 3 tiles: 24 accumulators, for 7-8 rows (one tile instead of two 4 x 4)

// The rows of one NV-panel column block: M split into tiles of at most `rows` (as even as possible).
// `next`, `next_lines`: the next group's panels (prefetched over the first tiles; nullptr: none).
template <int NV>
PANEL512_FN void block512(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, const Dest* d,
                          int rows, const float* next = nullptr, int64_t next_lines = 0) {
  static constexpr auto tab1 = tiles512<1>(std::make_index_sequence<kSkinnyRows>{});
  static constexpr auto tab2 = tiles512<2>(std::make_index_sequence<kWideRows>{});
  static constexpr auto tab3 = tiles512<3>(std::make_index_sequence<kTriRows>{});
  static constexpr auto tab4 = tiles512<4>(std::make_index_sequence<kQuadRows>{});
  const int64_t nt = (M + rows - 1) / rows;
  const int64_t base = M / nt, extra = M % nt;  // the first `extra` tiles get one more row
  // One tile (M <= 6) is memory-bound by itself: prefetching the next group there only competes with its own
  // stream (measured 0.8-0.97x); from 2 tiles on, the tiles after the first would leave memory idle without it.
  const bool pre = next != nullptr && nt > 1;
  const int64_t per_k = pre ? (next_lines + nt * K - 1) / (nt * K) : 0;  // lines per k step, spread over the tiles
  int64_t m = 0;
  for (int64_t t = 0; t < nt; ++t) {
    const int64_t r = base + (t < extra ? 1 : 0);
    const int64_t done = t * K * per_k;
    const Prefetch ahead{reinterpret_cast<const char*>(next) + done * 64, done < next_lines ? per_k : 0};
    (NV == 1 ? tab1[r - 1] : NV == 2 ? tab2[r - 1] : NV == 3 ? tab3[r - 1] : tab4[r - 1])(x, ldx, K, w, d, m, ahead);
    m += r;
  }
}

// ---- AVX2 + FMA (16 ymm registers): packed x, 6 x 16 micro-tiles, k-chunks that stay in L1 ----
//
// A 6-row x 16-column tile keeps 12 accumulators, the 2 vectors of a panel's k step and one broadcast x element in
// the 16 registers (per k step 12 FMAs for 2 loads + 6 broadcasts: FMA-bound). x is packed per call into tiles of
// <= 6 rows, k-major (the 6 elements of a k step side by side), so the broadcasts read one sequential stream from
// L1/L2 instead of 6 rows 4*K bytes apart. Each panel is cut into k-chunks whose 64-byte lines (kc * 64 bytes, sized
// to about half of L1d) stay in L1 while every row tile of the block passes over them, the partial sums going to
// y (load-add-store per chunk). The packed rows of a block are sized to about 3/8 of L2, so larger M (or K) runs
// in row blocks, each streaming the weights again (from L3 for SmolLM2's matrices). Loop order: row block > panel
// > k-chunk > row tile: a panel is read front to back, once per row block. With 2+ row tiles, the first tiles of
// each chunk prefetch the next chunk (of this panel or the next) into L1, spread over their k steps, so the
// weights' memory latency overlaps the FMAs of the other tiles (decode batches of 7-64 rows); one tile (<= 6 rows)
// leaves it to the hardware prefetchers. The tile before this (6 x 16 over unpacked x, whole-K panels, stores of
// the accumulators on every k step from an aliased array) ran at 45 % of the core's AVX2 peak at 512 rows, oneDNN
// at 86 %; measured in benchmarks/fp32_gemm.py.

struct Avx2Blocking {
  int64_t kc_max, a_floats;  // the longest k-chunk (k steps), floats of packed x per row block
};

// From the data caches: a chunk of kc * 64 bytes plus a 6-row tile of packed x (24 * kc bytes) in 70 % of L1d,
// packed x in 3/8 of L2 (Zen 3: 32 KiB / 512 KiB -> kc 256, 48 Ki floats; Zen 5: 48 KiB / 1 MiB -> 384, 96 Ki).
inline const Avx2Blocking& avx2_blocking() {
  static const Avx2Blocking b = [] {
    long l1 = 0, l2 = 0;
#if defined(_SC_LEVEL1_DCACHE_SIZE) && defined(_SC_LEVEL2_CACHE_SIZE)
    l1 = sysconf(_SC_LEVEL1_DCACHE_SIZE), l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
    if (l1 <= 0) l1 = 32 << 10;
    if (l2 <= 0) l2 = 512 << 10;
    const int64_t kc = std::clamp<int64_t>(l1 * 7 / 10 / (64 + 24) / 32 * 32, 128, 512);
    const int64_t a = std::clamp<int64_t>(l2 * 3 / 8 / 4, 16 << 10, 256 << 10);
    return Avx2Blocking{kc, a};
  }();
  return b;
}

constexpr int kAvx2Rows = 6;

// One 16-column chunk of y rows c .. c+MR-1 (row stride ldc) += / = packed x tile a (kc, MR) @ panel chunk b (kc, 16);
// `valid` columns are written (16: whole vectors; `stream`: non-temporal stores, 32-byte aligned rows).
// Prefetches pf_lines 64-byte lines from pf on the way, one every kc / pf_lines k steps.
template <int MR>
AVX2_FN void micro256(const float* a, const float* b, int64_t kc, float* c, int64_t ldc, bool add, int valid,
                      bool stream, const char* pf, int64_t pf_lines) {
  __m256 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  int64_t k = 0;
  if (pf_lines > 0) {  // the k steps with a prefetch: `every` steps apart
    const int64_t every = std::max<int64_t>(1, kc / pf_lines);
    for (int64_t l = 0; l < pf_lines && k < kc; ++l) {
      _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
      for (const int64_t end = std::min(kc, k + every); k < end; ++k, a += MR, b += kLanes) {
        const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          const __m256 x = _mm256_broadcast_ss(a + r);
          acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
        }
      }
    }
  }
  for (; k < kc; ++k, a += MR, b += kLanes) {
    const __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  if (valid == kLanes) {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      float* cr = c + r * ldc;
      __m256 lo = acc[r][0], hi = acc[r][1];
      if (add) lo = _mm256_add_ps(lo, _mm256_loadu_ps(cr)), hi = _mm256_add_ps(hi, _mm256_loadu_ps(cr + 8));
      if (stream) _mm256_stream_ps(cr, lo), _mm256_stream_ps(cr + 8, hi);
      else _mm256_storeu_ps(cr, lo), _mm256_storeu_ps(cr + 8, hi);
    }
  } else {
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      alignas(32) float out[kLanes];
      _mm256_store_ps(out, acc[r][0]);
      _mm256_store_ps(out + 8, acc[r][1]);
      float* cr = c + r * ldc;
      for (int j = 0; j < valid; ++j) cr[j] = add ? cr[j] + out[j] : out[j];
    }
  }
}

using Micro256 = void (*)(const float*, const float*, int64_t, float*, int64_t, bool, int, bool, const char*, int64_t);

// M rows split into tiles of at most 6, as even as possible (the first `extra` tiles one row more).
struct RowTiles {
  int64_t n, base, extra;
  explicit RowTiles(int64_t m) : n((m + kAvx2Rows - 1) / kAvx2Rows), base(m / n), extra(m % n) {}
  int rows(int64_t t) const { return static_cast<int>(base + (t < extra ? 1 : 0)); }
};

// x rows (mc of them, row stride ldx, all K) -> the tiles of RowTiles(mc), one after another: a tile of r rows
// starting at row m lies at a + m * K, element (k, i) at [k * r + i].
inline void pack_rows(const float* x, int64_t ldx, int64_t mc, int64_t K, float* a) {
  const RowTiles T(mc);
  for (int64_t t = 0, m = 0; t < T.n; m += T.rows(t), ++t) {
    const int r = T.rows(t);
    float* at = a + m * K;
    for (int i = 0; i < r; ++i) {
      const float* xr = x + (m + i) * ldx;
      for (int64_t k = 0; k < K; ++k) at[k * r + i] = xr[k];
    }
  }
}

// Panels [p0, p1) of y = x @ W^T for all M rows (one thread's share), by the loop order above.
AVX2_FN inline void panels256(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, int64_t P,
                              int64_t p0, int64_t p1, const PanelOut* outs, int nouts, bool stream) {
  static constexpr Micro256 tab[kAvx2Rows + 1] = {nullptr, micro256<1>, micro256<2>, micro256<3>, micro256<4>,
                                                  micro256<5>, micro256<6>};
  const Avx2Blocking& blk = avx2_blocking();
  const int64_t mc_max = std::max<int64_t>(kAvx2Rows, blk.a_floats / K / kAvx2Rows * kAvx2Rows);
  const int64_t blocks = (M + mc_max - 1) / mc_max;
  const int64_t mc_step = ((M + blocks - 1) / blocks + kAvx2Rows - 1) / kAvx2Rows * kAvx2Rows;
  static thread_local std::vector<float> packed;
  if (packed.size() < static_cast<size_t>(mc_step * K)) packed.resize(mc_step * K);
  float* a = packed.data();
  for (int64_t m0 = 0; m0 < M; m0 += mc_step) {
    const int64_t mc = std::min(mc_step, M - m0);
    pack_rows(x + m0 * ldx, ldx, mc, K, a);
    const RowTiles T(mc);
    const int64_t chunks = T.n == 1 ? 1 : (K + blk.kc_max - 1) / blk.kc_max;
    const int64_t kc_step = (K + chunks - 1) / chunks;
    for (int64_t p = p0; p < p1; ++p) {
      const Dest d = dest_of(outs, nouts, p);
      if (d.valid <= 0) continue;
      const float* wp = w + p * K * kLanes;
      float* yp = d.y + m0 * d.ld;
      const bool nt = stream && d.valid == kLanes && reinterpret_cast<uintptr_t>(d.y) % 32 == 0 && d.ld % 8 == 0;
      for (int64_t k0 = 0; k0 < K; k0 += kc_step) {
        const int64_t kc = std::min(kc_step, K - k0);
        const bool last = k0 + kc >= K;
        // the chunk after this one (the next of this panel, or the first of the next panel in this thread's share)
        const float* next = last ? (p + 1 < p1 ? wp + K * kLanes : nullptr) : wp + (k0 + kc) * kLanes;
        const int64_t lines = next != nullptr && T.n > 1 ? std::min(kc_step, last ? K : K - k0 - kc) : 0;
        const int64_t share = (lines + T.n - 1) / std::max<int64_t>(1, T.n);
        int64_t done = 0;
        for (int64_t t = 0, m = 0; t < T.n; m += T.rows(t), ++t) {
          const int r = T.rows(t);
          const int64_t n = std::min(share, lines - done);
          tab[r](a + m * K + k0 * r, wp + k0 * kLanes, kc, yp + m * d.ld, d.ld, k0 > 0, static_cast<int>(d.valid),
                 nt && last, reinterpret_cast<const char*>(next) + done * 64, n);
          done += n;
        }
      }
    }
  }
}
#endif

// The core's fp32 FMA peak, measured: `iters` rounds of 24 independent FMA chains on 16-lane (AVX-512) or 8-lane
// (AVX2) registers, all in registers; returns the number of float FMAs done (the caller times it). 0: no SIMD here.
#ifdef SCRATCHLM_X86
PANEL512_FN inline double peak512(int64_t iters, float* sink) {
  __m512 a[24];
  const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
  for (int i = 0; i < 24; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 24
    for (int i = 0; i < 24; ++i) a[i] = _mm512_fmadd_ps(a[i], b, c);
  }
  __m512 s = a[0];
  for (int i = 1; i < 24; ++i) s = _mm512_add_ps(s, a[i]);
  *sink = _mm512_reduce_add_ps(s);
  return 24.0 * 16.0 * static_cast<double>(iters);
}
AVX2_FN inline double peak256(int64_t iters, float* sink) {
  __m256 a[12];
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
  for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(static_cast<float>(i));
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], b, c);
  }
  __m256 s = a[0];
  for (int i = 1; i < 12; ++i) s = _mm256_add_ps(s, a[i]);
  *sink = scratchlm_simd::hsum256(s);
  return 12.0 * 8.0 * static_cast<double>(iters);
}
#endif

inline double peak_fma(int64_t iters, bool avx512) {
  float sink = 0.f;
#ifdef SCRATCHLM_X86
  if (avx512 && scratchlm_gemm::cpu_has_avx512()) return peak512(iters, &sink) + 0.0 * sink;
  if (scratchlm_simd::cpu_has_avx2()) return peak256(iters, &sink) + 0.0 * sink;
#endif
  (void)iters, (void)avx512, (void)sink;
  return 0.0;
}

// Which path panel_gemm takes: 2 AVX-512, 1 AVX2, 0 scalar (use_simd false, or the CPU has neither).
inline int panel_path(bool use_simd) {
#ifdef SCRATCHLM_X86
  if (!use_simd || !scratchlm_simd::cpu_has_avx2()) return 0;
  return scratchlm_gemm::skinny_avx512() ? 2 : 1;
#else
  (void)use_simd;
  return 0;
#endif
}

// y_i = x (M, K; row stride ldx) @ W_i^T for the outputs `outs` of the P-panel weight `w` (P, K, 16).
inline void panel_gemm(const float* x, int64_t ldx, int64_t M, int64_t K, const float* w, int64_t P,
                       const PanelOut* outs, int nouts, bool use_simd) {
  if (M <= 0 || P <= 0) return;
  const int path = panel_path(use_simd);
#ifdef SCRATCHLM_X86
  if (path == 2) {
    // measured (benchmarks/fp32_gemm.py): 6 x 4 tiles at least as fast as 16 x 1 / 14 x 2 at any M, except 7-8 rows:
    // there one 8 x 3 tile per 3 panels (each group read once) beat two 4 x 4 tiles (the group read twice) by 1.1-1.25x
    // on the K = 576 shapes (Zen 5, 30 cold layers), where the skinny tiles had been 1.2x faster than the panels.
    const int nv = M >= 7 && M <= kTriRows ? 3 : 4;
    const int64_t groups = (P + nv - 1) / nv;
    const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, M * K * kLanes * nv));
    const bool hints = streaming().load(std::memory_order_relaxed);
    const bool stream = hints && M * P * kLanes * 4 >= kStreamOutBytes && P * K * kLanes * 4 >= kStreamWeightBytes;
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t p = g * nv;
        Dest d[4];
        const float* wp = w + p * K * kLanes;
        const int64_t have = std::min<int64_t>(nv, P - p);
        for (int64_t v = 0; v < have; ++v) d[v] = dest_of(outs, nouts, p + v);
        for (int64_t v = 0; v < have; ++v) d[v].stream = stream;
        if (have == 3 && nv == 3) {
          block512<3>(x, ldx, M, K, wp, d, kTriRows);
        } else if (have == 4) {
          const int64_t next = std::min<int64_t>(nv, P - p - nv);  // panels of the next group, if this thread runs it
          const bool ahead = hints && g + 1 < g1;
          block512<4>(x, ldx, M, K, wp, d, kQuadRows, ahead ? wp + nv * K * kLanes : nullptr, ahead ? next * K : 0);
        } else if (have >= 2) {
          block512<2>(x, ldx, M, K, wp, d, kWideRows);
          if (have == 3) block512<1>(x, ldx, M, K, wp + 2 * K * kLanes, d + 2, kSkinnyRows);
        } else {
          block512<1>(x, ldx, M, K, wp, d, kSkinnyRows);
        }
      }
      if (stream) _mm_sfence();  // the non-temporal stores visible before the call returns
    });
    return;
  }
  if (path == 1) {
    const bool stream = streaming().load(std::memory_order_relaxed) && M * P * kLanes * 4 >= kStreamOutBytes &&
                        P * K * kLanes * 4 >= kStreamWeightBytes;
    const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, M * K * kLanes));
    at::parallel_for(0, P, grain, [&](int64_t p0, int64_t p1) {
      panels256(x, ldx, M, K, w, P, p0, p1, outs, nouts, stream);
      if (stream) _mm_sfence();
    });
    return;
  }
#endif
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) tile_scalar(x, ldx, M, K, w + p * K * kLanes, dest_of(outs, nouts, p));
  });
}

// ---- Which kernel multiplies an fp32 linear: chosen per shape class by measurement (inference/kernel_choice.py) ----
//
// Candidates: the panel kernel above (over the panels, the engine's only copy of the weights); skinny_gemm.h's tiles
// (plain (N, K) weight; decode batches); MKL (ATen's mm over the plain weight); oneDNN's matmul over a copy of the
// weight prepacked in its own blocked layout (mkldnn::_reorder_linear_weight, as vLLM-CPU runs its fp32 linears).
// A shape class is (row bucket of M, K, ceil(log2 N)); kernel_choice.py measures the candidates at first use of a
// class and fills this table (from its cache file when the class was measured before on this CPU, ISA cap and
// build), and it may be forced for all classes ($SCRATCHLM_FP32_KERNEL, or set_forced). A class with no entry runs
// the panel kernel. The plain and prepacked copies are made the first time a class of that weight chose them.
enum Fp32Kernel : int { kPanel = 0, kSkinny = 1, kMkl = 2, kOneDnn = 3 };
constexpr int kFp32Kernels = 4;
constexpr const char* kFp32KernelNames[kFp32Kernels] = {"panel", "skinny", "mkl", "onednn"};

// Row buckets: 1, 2-4, 5-8, 9-16, 17-32, 33-64, 65-128, 129-256, 257+ (upper bounds here; the last open).
constexpr int kRowBuckets = 9;
constexpr int64_t kBucketTop[kRowBuckets] = {1, 4, 8, 16, 32, 64, 128, 256, INT64_MAX};

inline int row_bucket(int64_t M) {
  int b = 0;
  while (b + 1 < kRowBuckets && M > kBucketTop[b]) ++b;
  return b;
}

inline int n_class(int64_t N) {  // ceil(log2(N)): 576 and 960 -> 10, 3072 -> 12, 49152 -> 16
  int c = 0;
  while ((int64_t{1} << c) < N) ++c;
  return c;
}

inline int parse_fp32_kernel(const std::string& v, const char* what) {
  if (v.empty() || v == "auto") return -1;
  for (int k = 0; k < kFp32Kernels; ++k)
    if (v == kFp32KernelNames[k]) return k;
  throw std::runtime_error(std::string(what) + "=" + v + " is not one of auto, panel, skinny, mkl, onednn");
}

// A measurement for a class not in the table: (row bucket, K, N) -> kernel (kernel_choice.py registers one).
using Measurer = std::function<int(int, int64_t, int64_t)>;

struct ChoiceTable {
  std::mutex mu;
  std::map<std::tuple<int, int64_t, int>, int> chosen;  // (row bucket, K, n class) -> kernel
  std::atomic<int> forced{-1};                          // >= 0: every class runs this kernel
  Measurer measure;                                     // empty: a class not in the table runs the panel kernel
};

inline ChoiceTable& choice_table() {
  static ChoiceTable* t = [] {  // never destroyed: `measure` may hold a Python callable
    auto* c = new ChoiceTable;
    const char* e = std::getenv("SCRATCHLM_FP32_KERNEL");
    c->forced.store(parse_fp32_kernel(e ? e : "", "SCRATCHLM_FP32_KERNEL"));
    return c;
  }();
  return *t;
}

// The kernel for M rows of x against a K x N weight: the forced one, else the table's, else (first use of the
// class) what the measurer says, kept in the table; the panel kernel where there is no measurer or it fails.
inline int kernel_for(int64_t M, int64_t K, int64_t N) {
  ChoiceTable& t = choice_table();
  const int f = t.forced.load(std::memory_order_relaxed);
  if (f >= 0) return f;
  const auto key = std::make_tuple(row_bucket(M), K, n_class(N));
  Measurer measure;
  {
    std::lock_guard<std::mutex> lock(t.mu);
    const auto it = t.chosen.find(key);
    if (it != t.chosen.end()) return it->second;
    measure = t.measure;
  }
  static thread_local bool measuring = false;  // the measurement's own calls name their kernel; this is a guard
  int k = kPanel;
  if (measure && !measuring) {
    measuring = true;
    try {
      k = measure(std::get<0>(key), K, N);
    } catch (const std::exception& e) {
      TORCH_WARN("fp32 linears: the kernel measurement for ", M, " rows, K ", K, ", N ", N, " failed (", e.what(),
                 "); the panel kernel runs that class");
      k = kPanel;
    }
    measuring = false;
    if (k < 0 || k >= kFp32Kernels) k = kPanel;
  }
  std::lock_guard<std::mutex> lock(t.mu);
  return t.chosen.emplace(key, k).first->second;  // a choice the measurer stored itself stands
}

inline const c10::OperatorHandle* mkldnn_op(const char* name) {
  const auto h = c10::Dispatcher::singleton().findSchema({name, ""});
  return h.has_value() ? new c10::OperatorHandle(*h) : nullptr;  // lives as long as the process, as the op does
}

// Whether this torch has the oneDNN matmul ops (a build without mkldnn does not).
inline bool onednn_available() {
  static const bool ok = mkldnn_op("mkldnn::_linear_pointwise") != nullptr &&
                         mkldnn_op("mkldnn::_reorder_linear_weight") != nullptr;
  return ok;
}

// w (N, K) float32 -> oneDNN's prepacked copy (an opaque mkldnn tensor; `batch` rows hint its layout, 0: none).
inline at::Tensor onednn_prepack(const at::Tensor& w, int64_t batch) {
  static const c10::OperatorHandle* op = mkldnn_op("mkldnn::_reorder_linear_weight");
  TORCH_CHECK(op != nullptr, "this torch has no oneDNN (mkldnn::_reorder_linear_weight)");
  std::vector<c10::IValue> stack{w, batch > 0 ? c10::IValue(batch) : c10::IValue()};
  op->callBoxed(&stack);
  return stack[0].toTensor();
}

// x (M, K) @ W^T over oneDNN's prepacked W (N, K) -> a new (M, N) tensor.
inline at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle* op = mkldnn_op("mkldnn::_linear_pointwise");
  TORCH_CHECK(op != nullptr, "this torch has no oneDNN (mkldnn::_linear_pointwise)");
  std::vector<c10::IValue> stack{x, packed, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<c10::Scalar>>(), c10::IValue()};
  op->callBoxed(&stack);
  return stack[0].toTensor();
}

// The copies of a packed weight that the other kernels read, made when first needed (then kept).
struct Alternates {
  std::mutex mu;
  at::Tensor plain, onednn;  // (sum ns, K) float32; oneDNN's prepacked copy of it
};

// panels (P, K, 16) holding matrices of ns[i] columns each (each padded to whole panels) -> (sum ns, K).
inline at::Tensor unpack(const at::Tensor& panels, const std::vector<int64_t>& ns) {
  const int64_t K = panels.size(1);
  int64_t total = 0;
  for (int64_t n : ns) total += n;
  auto out = at::empty({total, K}, panels.options());
  const float* w = panels.data_ptr<float>();
  float* o = out.data_ptr<float>();
  int64_t p = 0, row = 0;
  for (int64_t n : ns) {
    for (int64_t j = 0; j < n; ++j) {
      const float* src = w + (p + j / kLanes) * K * kLanes + j % kLanes;
      float* dst = o + (row + j) * K;
      for (int64_t k = 0; k < K; ++k) dst[k] = src[k * kLanes];
    }
    p += (n + kLanes - 1) / kLanes, row += n;
  }
  return out;
}

// Panels of packed (P, K, 16) float32 weights and the outputs they hold: [n_0, n_1, ...] columns, each padded to
// whole panels, in order.
struct PanelWeight {
  at::Tensor w;  // (P, K, 16)
  std::vector<int64_t> ns;
  int64_t K = 0, P = 0;
  std::vector<at::Tensor> keep;  // the tensors `w` views when it was made over them (from_blob)
  std::shared_ptr<Alternates> alt = std::make_shared<Alternates>();

  static PanelWeight from(const at::Tensor& w, std::vector<int64_t> ns, const std::string& what) {
    TORCH_CHECK(w.defined() && w.device().is_cpu() && w.scalar_type() == at::kFloat && w.is_contiguous() &&
                w.dim() == 3 && w.size(2) == kLanes, what, ": a packed weight must be a contiguous float32 CPU "
                "tensor (panels, K, 16), got ", w.sizes());
    int64_t panels = 0;
    for (int64_t n : ns) {
      TORCH_CHECK(n > 0, what, ": output widths must be positive");
      panels += (n + kLanes - 1) / kLanes;
    }
    TORCH_CHECK(panels == w.size(0), what, ": ", w.size(0), " panels, but the widths ", c10::IntArrayRef(ns),
                " need ", panels);
    PanelWeight pw;
    pw.w = w, pw.ns = std::move(ns), pw.K = w.size(1), pw.P = w.size(0);
    return pw;
  }

  int64_t columns() const {
    int64_t n = 0;
    for (int64_t v : ns) n += v;
    return n;
  }

  // ys[i] (M, ns[i]) = x (M, K) @ W_i^T; each y row-contiguous with its own row stride. `kernel` -1: the kernel
  // chosen for this shape class (kernel_for), else an Fp32Kernel; use_simd false: the portable panel path.
  void forward(const at::Tensor& x, const std::vector<at::Tensor*>& ys, bool use_simd, int kernel = -1) const {
    TORCH_CHECK(ys.size() == ns.size(), "one output per packed matrix");
    if (kernel < 0) kernel = use_simd ? kernel_for(x.size(0), K, columns()) : kPanel;
    TORCH_CHECK(kernel >= 0 && kernel < kFp32Kernels, "fp32 kernel ", kernel, " is not 0..", kFp32Kernels - 1);
    if (kernel == kOneDnn && !onednn_available()) {
      TORCH_WARN_ONCE("fp32 linears: oneDNN was chosen but this torch has no mkldnn matmul ops; the panel kernel "
                      "runs instead");
      kernel = kPanel;
    }
    if (kernel != kPanel && x.size(0) > 0) return forward_other(x, ys, kernel);
    std::vector<PanelOut> outs;
    int64_t p = 0;
    for (size_t i = 0; i < ns.size(); ++i) {
      const int64_t np = (ns[i] + kLanes - 1) / kLanes;
      outs.push_back({ys[i]->data_ptr<float>(), ys[i]->stride(0), p, p + np, ns[i]});
      p += np;
    }
    panel_gemm(x.data_ptr<float>(), x.stride(0), x.size(0), K, w.data_ptr<float>(), P, outs.data(),
               static_cast<int>(outs.size()), use_simd);
  }

 private:
  // The skinny tiles, MKL or oneDNN over the plain / prepacked copy (made on first use), into ys.
  void forward_other(const at::Tensor& x, const std::vector<at::Tensor*>& ys, int kernel) const {
    at::Tensor plain, packed;
    {
      std::lock_guard<std::mutex> lock(alt->mu);
      if (!alt->plain.defined()) alt->plain = unpack(w, ns);
      if (kernel == kOneDnn && !alt->onednn.defined()) alt->onednn = onednn_prepack(alt->plain, 0);
      plain = alt->plain, packed = alt->onednn;
    }
    const auto xc = x.contiguous();
    const int64_t M = xc.size(0), N = plain.size(0);
    at::Tensor* y0 = ys[0];
    const bool direct = ys.size() == 1 && y0->stride(0) == N && y0->stride(1) == 1;  // write into ys[0] itself
    at::Tensor y;
    if (kernel == kOneDnn) {
      y = onednn_linear(xc, packed);
    } else {
      y = direct ? *y0 : at::empty({M, N}, xc.options());
      if (kernel == kMkl) at::mm_out(y, xc, plain.t());
      else scratchlm_gemm::skinny_gemm(xc.data_ptr<float>(), plain.data_ptr<float>(), y.data_ptr<float>(), M, K, N,
                                       true);
    }
    if (direct && y.data_ptr() == y0->data_ptr()) return;
    int64_t off = 0;
    for (size_t i = 0; i < ns.size(); ++i) {
      ys[i]->copy_(y.narrow(1, off, ns[i]));
      off += ns[i];
    }
  }
};

}  // namespace scratchlm_panel
