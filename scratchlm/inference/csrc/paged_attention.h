// Paged attention on the CPU (scratchlm.inference.attention): each row's query token attends to its context in the
// block-table KV cache, read in place (no gather copy). A row is a decode token or one token of a prefill chunk
// (its context: the tokens up to its own, the causal mask); consecutive rows that share a block table are
// computed as one tile (row_tiles, tile_avx2), so a chunk's K/V blocks come from memory once per tile of query
// rows instead of once per row, with the same floats as row by row.
//
//   q            (B, H, D)  float32, B rows
//   k/v_cache    (num_blocks, block_size, Hkv, D)  float32, bfloat16, float16 or int8; slot s = block * block_size
//                + offset
//   k/v_scale    (num_blocks, block_size, Hkv) float32, int8 caches only: x = q * scale per (token, KV head)
//   block_tables (B, max_blocks) int64;  context_lens (B,) int64
//   out          (B, H, D)  float32
//
// A layer's AttentionSpec comes along (Args): any scale, a logit soft-cap (scores -> cap * tanh(score / cap),
// applied to a row's scores before its softmax: softcap_avx2 / softcap_scalar, one formula for every kernel) and
// a sliding window (a row of context n sees keys [n - window, n): every kernel starts at the block of that first
// key, so the blocks before a window are never read, and masks the keys before it in that block; first_key).
// With neither, the instructions are those of plain attention.
//
// Work item = (tile of rows, kv head h): the rows' G = H / Hkv query heads read the same K/V rows (grouped-query
// attention without repeating K/V: each block's rows come from memory once and serve the G heads from L1). Per query
// head: scores s[t] = q_g . k_t * scale, a softmax, out_g = sum_t p[t] v_t. A decode row (a tile of one) is one
// work item over all its KV heads instead (decode_row_avx2: each block's K / V rows of every head, one contiguous
// run of the cache, read front to back and prefetched into L2 two blocks ahead, in slices between the loads; the
// same floats). Items are split across threads with at::parallel_for.
// Compact caches are converted to float32 in registers as they are read (bf16: shift into the high half;
// fp16: F16C vcvtph2ps; int8: sign-extend, convert, times the row's scale), one block of one head at a time into
// an L1 buffer that the G query heads then read, so attention reads 2 or ~3.8 times fewer bytes from memory.
// `store_rows` is the matching writer (the fused decode step's), rounding as torch does (bf16/fp16: to nearest
// even; int8: scale = max|x| / 127, q = round-half-even(x / scale)), so the C++ and torch paths store identical
// bytes (kv_cache.py).
// AVX-512 (16-lane FMAs for the scores and outputs) and AVX2+FMA(+F16C) paths (function target attributes, chosen
// at run time; `avx512=false` forces AVX2) and a portable scalar path (no tiling: row by row). With AVX-512, a tile
// of several rows (a prefill chunk) computes its scores with keys in lanes: each K block is transposed once per
// chunk (KtCache) and one FMA gives a feature's term for 16 keys (scores_t512), summed in the order of the lanes-
// over-D dot products (block_scores512) that a lone row (a decode row) runs, so both give the same bits.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include "simd_common.h"

namespace scratchlm_attn {

using scratchlm_simd::cpu_has_avx2;

// The element type of a KV cache.
enum class KV : int { F32 = 0, BF16 = 1, F16 = 2, I8 = 3 };

inline int64_t kv_itemsize(KV t) { return t == KV::F32 ? 4 : t == KV::I8 ? 1 : 2; }

// k, v point at element 0 of one layer's cache, of type `kv`; k_scale / v_scale at its scales (int8 only).
struct Args {
  const float* q; const void* k; const void* v;
  const int64_t* tables; const int64_t* lens;
  float* out;
  int64_t B, H, Hkv, D, bs, max_blocks;
  float scale;
  KV kv = KV::F32;
  const float* k_scale = nullptr;
  const float* v_scale = nullptr;
  uint64_t call = 0;  // paged_decode's call number: per-thread caches of one call (KtCache) are valid only within it
  float softcap = 0.f;  // > 0: scores become softcap * tanh(score / softcap) (Gemma 2); 0: off
  int64_t window = 0;   // > 0: a row of context length n sees keys [n - window, n) (a sliding window); 0: all
};

// The first key a row of context length n sees: n - window under a sliding window (a query at position p sees the
// keys (p - window, p]), else 0. The kernels start at its block: the blocks before it are never read.
inline int64_t first_key(const Args& a, int64_t n) { return a.window > 0 && n > a.window ? n - a.window : 0; }

// tanh(x) as Cephes' tanhf: x + x^3 P(x^2) for |x| < 0.625, else 1 - 2 / (exp(2|x|) + 1) with x's sign. The
// scalar twin of tanh256 (the same formula; std::exp instead of exp256, so the last bit may differ).
inline float tanh_scalar(float x) {
  const float ax = std::fabs(x);
  if (ax >= 0.625f) {
    const float r = 1.f - 2.f / (std::exp(ax + ax) + 1.f);
    return x < 0.f ? -r : r;
  }
  const float z = x * x;
  const float p = (((-5.70498872745e-3f * z + 2.06390887954e-2f) * z - 5.37397155531e-2f) * z + 1.33314422036e-1f) * z -
                  3.33332819422e-1f;
  return x + x * z * p;
}

// s[i] = cap * tanh(s[i] / cap) over [0, n): the attention logit soft-cap, portable path.
inline void softcap_scalar(float* s, int64_t n, float cap) {
  const float inv = 1.f / cap;
  for (int64_t i = 0; i < n; ++i) s[i] = cap * tanh_scalar(s[i] * inv);
}

// A tile: rows b0 .. b0 + R - 1 (one block table, non-decreasing lengths), KV head h, a work buffer.
using TileFn = void (*)(const Args&, int64_t, int64_t, int64_t, float*);

// Element i of a cache of type T as float.
template <KV T> inline float elem(const void* p, int64_t i) {
  if constexpr (T == KV::F32) return static_cast<const float*>(p)[i];
  if constexpr (T == KV::BF16) return static_cast<float>(static_cast<const c10::BFloat16*>(p)[i]);
  if constexpr (T == KV::F16) return static_cast<float>(static_cast<const c10::Half*>(p)[i]);
  if constexpr (T == KV::I8) return static_cast<float>(static_cast<const int8_t*>(p)[i]);
}

// Index of (token t, head h) of a sequence with block table `table`: its row of D elements starts at index * D,
// its int8 scale is scale[index].
inline int64_t row_index(const Args& a, const int64_t* table, int64_t t, int64_t h) {
  return (table[t / a.bs] * a.bs + t % a.bs) * a.Hkv + h;
}

// Writes the rows src (n, D) float32 as cache rows `index` .. index + n - 1 (n = Hkv: one token's heads), rounded
// or quantized as torch does (see the header).
inline void store_rows(KV kv, void* cache, float* scales, int64_t index, const float* src, int64_t n, int64_t D) {
  const int64_t base = index * D;
  switch (kv) {
    case KV::F32: std::copy(src, src + n * D, static_cast<float*>(cache) + base); break;
    case KV::BF16: {
      auto* dst = static_cast<c10::BFloat16*>(cache) + base;
      for (int64_t i = 0; i < n * D; ++i) dst[i] = c10::BFloat16(src[i]);
      break;
    }
    case KV::F16: {
      auto* dst = static_cast<c10::Half*>(cache) + base;
      for (int64_t i = 0; i < n * D; ++i) dst[i] = c10::Half(src[i]);
      break;
    }
    case KV::I8: {
      auto* dst = static_cast<int8_t*>(cache) + base;
      for (int64_t r = 0; r < n; ++r) {
        const float* x = src + r * D;
        float amax = 0.f;
        for (int64_t i = 0; i < D; ++i) amax = std::max(amax, std::fabs(x[i]));
        const float s = amax / 127.f;
        const float div = s > 0.f ? s : 1.f;
        for (int64_t i = 0; i < D; ++i) {
          const float qv = std::nearbyint(x[i] / div);  // round half to even, as torch.round
          dst[r * D + i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, qv)));
        }
        scales[index + r] = s;
      }
      break;
    }
  }
}

// Softmax over t of scores[t * G + g] for each g, in place.
inline void softmax_columns(float* scores, int64_t T, int64_t G) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = -INFINITY;
    for (int64_t t = 0; t < T; ++t) mx = std::max(mx, scores[t * G + g]);
    float sum = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      const float e = std::exp(scores[t * G + g] - mx);
      scores[t * G + g] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < T; ++t) scores[t * G + g] *= inv;
  }
}

template <KV T>
void item_scalar(const Args& a, int64_t b, int64_t h, float* scores) {
  const int64_t G = a.H / a.Hkv, D = a.D, T_len = a.lens[b], t0 = first_key(a, T_len);
  const int64_t* table = a.tables + b * a.max_blocks;
  const float* q = a.q + (b * a.H + h * G) * D;  // (G, D)
  for (int64_t t = t0; t < T_len; ++t) {  // scores[(t - t0) * G + g]: the keys of the row's window
    const int64_t r = row_index(a, table, t, h);
    const float ks = T == KV::I8 ? a.k_scale[r] : 1.f;
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * elem<T>(a.k, r * D + d);
      scores[(t - t0) * G + g] = acc * ks * a.scale;
    }
  }
  if (a.softcap > 0.f) softcap_scalar(scores, (T_len - t0) * G, a.softcap);
  softmax_columns(scores, T_len - t0, G);
  float* o = a.out + (b * a.H + h * G) * D;  // (G, D)
  std::fill(o, o + G * D, 0.f);
  for (int64_t t = t0; t < T_len; ++t) {
    const int64_t r = row_index(a, table, t, h);
    const float vs = T == KV::I8 ? a.v_scale[r] : 1.f;
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[(t - t0) * G + g] * vs;
      for (int64_t d = 0; d < D; ++d) o[g * D + d] += p * elem<T>(a.v, r * D + d);
    }
  }
}

// The portable path has no tiling: each row of a tile on its own.
template <KV T>
void tile_scalar(const Args& a, int64_t b0, int64_t R, int64_t h, float* scores) {
  for (int64_t r = 0; r < R; ++r) item_scalar<T>(a, b0 + r, h, scores);
}

inline TileFn scalar_item_for(KV kv) {
  switch (kv) {
    case KV::BF16: return tile_scalar<KV::BF16>;
    case KV::F16: return tile_scalar<KV::F16>;
    case KV::I8: return tile_scalar<KV::I8>;
    default: return tile_scalar<KV::F32>;
  }
}

#ifdef SCRATCHLM_X86
using scratchlm_simd::exp256;
using scratchlm_simd::hmax256;
using scratchlm_simd::hsum256;

#define KV_FN __attribute__((target("avx2,fma,f16c")))

// 8 consecutive cache elements of type T from element index i, as float32 (int8: unscaled).
template <KV T>
KV_FN inline __m256 load8(const void* p, int64_t i) {
  if constexpr (T == KV::F32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else if constexpr (T == KV::BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (T == KV::F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i)));
  } else {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(p) + i));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
}

// Rows [0, n) of one block and KV head as float32 rows of D: the cache itself for float32 (row stride Hkv * D),
// else converted into buf (stride D), an int8 row times its scale (the values torch's dequantization gives).
template <int NC, KV T>
KV_FN inline const float* block_rows(const void* cache, const float* scales, int64_t r0, int64_t Hkv, int64_t n,
                                     float* buf, int64_t& row_stride) {
  constexpr int64_t D = 8 * NC;
  if constexpr (T == KV::F32) {
    row_stride = Hkv * D;
    return static_cast<const float*>(cache) + r0 * D;
  } else {
    row_stride = D;
    for (int64_t i = 0; i < n; ++i) {
      const int64_t src = (r0 + i * Hkv) * D;
      if constexpr (T == KV::I8) {
        const __m256 sc = _mm256_set1_ps(scales[r0 + i * Hkv]);
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) _mm256_storeu_ps(buf + i * D + 8 * c, _mm256_mul_ps(load8<T>(cache, src + 8 * c), sc));
      } else {
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) _mm256_storeu_ps(buf + i * D + 8 * c, load8<T>(cache, src + 8 * c));
      }
    }
    return buf;
  }
}

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 4  // blocks of prefetch distance
#endif
// Prefetches rows [0, n) of a block and head (row index r0, element size `item`) into L1 ahead of their use:
// the blocks of a sequence are scattered, so the hardware prefetcher cannot run ahead across blocks.
KV_FN inline void prefetch_rows(const void* cache, int64_t r0, int64_t Hkv, int64_t n, int64_t row_bytes) {
  const char* base = static_cast<const char*>(cache);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t off = 0; off < row_bytes; off += 64) _mm_prefetch(base + (r0 + i * Hkv) * row_bytes + off, _MM_HINT_T0);
}

// Scores of GT query heads (q * scale at qs, stride D) against rows [0, n) of one block (base, row stride), into
// sg[j * T + i]: four rows at a time, each K load serving the GT heads (4 * GT accumulators), the four dot
// products of a head reduced together by horizontal adds.
template <int NC, int GT>
KV_FN inline void block_scores(const float* qs, const float* base, int64_t stride, int64_t n, float* sg, int64_t T) {
  constexpr int64_t D = 8 * NC;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float* k0 = base + i * stride;
    __m256 acc[GT][4];
#pragma GCC unroll 4
    for (int j = 0; j < GT; ++j)
      for (int r = 0; r < 4; ++r) acc[j][r] = _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      __m256 q[GT];
#pragma GCC unroll 4
      for (int j = 0; j < GT; ++j) q[j] = _mm256_loadu_ps(qs + j * D + 8 * c);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m256 k = _mm256_loadu_ps(k0 + r * stride + 8 * c);
#pragma GCC unroll 4
        for (int j = 0; j < GT; ++j) acc[j][r] = _mm256_fmadd_ps(q[j], k, acc[j][r]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < GT; ++j) {  // hadd(hadd(a0, a1), hadd(a2, a3)) = [4 partial sums of lanes 0-3 | of 4-7]
      const __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(acc[j][0], acc[j][1]), _mm256_hadd_ps(acc[j][2], acc[j][3]));
      _mm_storeu_ps(sg + j * T + i, _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
    }
  }
  for (; i < n; ++i) {  // reduced in the 4-row path's order, so a score's bits do not depend on where it falls
    const float* kr = base + i * stride;
    for (int j = 0; j < GT; ++j) {
      __m256 s0 = _mm256_setzero_ps();
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qs + j * D + 8 * c), _mm256_loadu_ps(kr + 8 * c), s0);
      const __m256 h1 = _mm256_hadd_ps(s0, s0);
      const __m256 hh = _mm256_hadd_ps(h1, h1);
      sg[j * T + i] = _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
    }
  }
}

// og[j] (GT heads' outputs, stride D) += sum_i p_j[i] v_i over rows [0, n) of one block: D in chunks of CH
// registers, each V load serving the GT heads (CH * GT accumulators).
template <int NC, int GT>
KV_FN inline void block_values(const float* sg, int64_t T, const float* base, int64_t stride, int64_t n, float* og) {
  constexpr int64_t D = 8 * NC;
  constexpr int CH = NC % 4 == 0 ? 4 : 2;
  for (int c0 = 0; c0 < NC; c0 += CH) {
    __m256 o[GT][CH];
#pragma GCC unroll 4
    for (int j = 0; j < GT; ++j)
      for (int c = 0; c < CH; ++c) o[j][c] = _mm256_loadu_ps(og + j * D + 8 * (c0 + c));
    for (int64_t i = 0; i < n; ++i) {
      const float* vr = base + i * stride + 8 * c0;
      __m256 p[GT];
#pragma GCC unroll 4
      for (int j = 0; j < GT; ++j) p[j] = _mm256_broadcast_ss(sg + j * T + i);
#pragma GCC unroll 4
      for (int c = 0; c < CH; ++c) {
        const __m256 v = _mm256_loadu_ps(vr + 8 * c);
#pragma GCC unroll 4
        for (int j = 0; j < GT; ++j) o[j][c] = _mm256_fmadd_ps(p[j], v, o[j][c]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < GT; ++j)
      for (int c = 0; c < CH; ++c) _mm256_storeu_ps(og + j * D + 8 * (c0 + c), o[j][c]);
  }
}

// tanh of 8 floats, tanh_scalar's formula lane by lane (exp256 for the exponential).
KV_FN inline __m256 tanh256(__m256 x) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256 ax = _mm256_andnot_ps(sign, x);
  const __m256 e = exp256(_mm256_add_ps(ax, ax));
  __m256 big = _mm256_sub_ps(_mm256_set1_ps(1.f), _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(e, _mm256_set1_ps(1.f))));
  big = _mm256_or_ps(big, _mm256_and_ps(x, sign));
  const __m256 z = _mm256_mul_ps(x, x);
  __m256 p = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(-5.70498872745e-3f), z), _mm256_set1_ps(2.06390887954e-2f));
  p = _mm256_sub_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(5.37397155531e-2f));
  p = _mm256_add_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(1.33314422036e-1f));
  p = _mm256_sub_ps(_mm256_mul_ps(p, z), _mm256_set1_ps(3.33332819422e-1f));
  const __m256 small = _mm256_add_ps(x, _mm256_mul_ps(_mm256_mul_ps(x, z), p));
  return _mm256_blendv_ps(small, big, _mm256_cmp_ps(ax, _mm256_set1_ps(0.625f), _CMP_GE_OQ));
}

// s[i] = cap * tanh(s[i] / cap) over [0, n), 8 lanes at a time (a last partial group through a padded copy), so
// every score goes through the same instructions wherever it sits: the decode row and the tiles agree bit for bit.
KV_FN inline void softcap_avx2(float* s, int64_t n, float cap) {
  const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.f / cap);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(s + i, _mm256_mul_ps(c, tanh256(_mm256_mul_ps(_mm256_loadu_ps(s + i), inv))));
  if (i < n) {
    float tmp[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    std::copy(s + i, s + n, tmp);
    _mm256_storeu_ps(tmp, _mm256_mul_ps(c, tanh256(_mm256_mul_ps(_mm256_loadu_ps(tmp), inv))));
    std::copy(tmp, tmp + (n - i), s + i);
  }
}

#define KV512_FN __attribute__((target("avx512f,avx2,fma,f16c")))

using scratchlm_simd::cpu_has_avx512;  // honours $SCRATCHLM_ISA

// The 4 sums of a0 .. a3's 16 lanes, [sum a0, sum a1, sum a2, sum a3], each in the same order of additions (so
// a key's score has the same bits wherever it sits in a group of 4, or alone: reduce4(a, a, a, a)[0]).
KV512_FN inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44), _mm512_shuffle_ps(s01, s23, 0xEE));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s),
                                 _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s), 1)));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// block_scores with 16-lane registers (D = 16 * N16): four keys at a time, each K load serving GT vectors.
template <int N16, int GT>
KV512_FN void block_scores512(const float* qs, const float* base, int64_t stride, int64_t n, float* sg, int64_t T) {
  constexpr int64_t D = 16 * N16;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const float* k0 = base + i * stride;
    __m512 acc[GT][4];
#pragma GCC unroll 4
    for (int j = 0; j < GT; ++j)
      for (int r = 0; r < 4; ++r) acc[j][r] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < N16; ++c) {
      __m512 q[GT];
#pragma GCC unroll 4
      for (int j = 0; j < GT; ++j) q[j] = _mm512_loadu_ps(qs + j * D + 16 * c);
#pragma GCC unroll 4
      for (int r = 0; r < 4; ++r) {
        const __m512 k = _mm512_loadu_ps(k0 + r * stride + 16 * c);
#pragma GCC unroll 4
        for (int j = 0; j < GT; ++j) acc[j][r] = _mm512_fmadd_ps(q[j], k, acc[j][r]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < GT; ++j) _mm_storeu_ps(sg + j * T + i, reduce4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]));
  }
  for (; i < n; ++i) {
    const float* kr = base + i * stride;
    for (int j = 0; j < GT; ++j) {
      __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
      for (int c = 0; c < N16; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(qs + j * D + 16 * c), _mm512_loadu_ps(kr + 16 * c), a);
      sg[j * T + i] = _mm_cvtss_f32(reduce4(a, a, a, a));
    }
  }
}

// block_values with 16-lane registers: D in chunks of CH registers, each V load serving GT vectors.
template <int N16, int GT>
KV512_FN void block_values512(const float* sg, int64_t T, const float* base, int64_t stride, int64_t n, float* og) {
  constexpr int64_t D = 16 * N16;
  constexpr int CH = N16 <= 5 ? N16 : N16 == 6 ? 3 : 4;
  for (int c0 = 0; c0 < N16; c0 += CH) {
    __m512 o[GT][CH];
#pragma GCC unroll 4
    for (int j = 0; j < GT; ++j)
      for (int c = 0; c < CH; ++c) o[j][c] = _mm512_loadu_ps(og + j * D + 16 * (c0 + c));
    for (int64_t i = 0; i < n; ++i) {
      const float* vr = base + i * stride + 16 * c0;
      __m512 p[GT];
#pragma GCC unroll 4
      for (int j = 0; j < GT; ++j) p[j] = _mm512_set1_ps(sg[j * T + i]);
#pragma GCC unroll 5
      for (int c = 0; c < CH; ++c) {
        const __m512 v = _mm512_loadu_ps(vr + 16 * c);
#pragma GCC unroll 4
        for (int j = 0; j < GT; ++j) o[j][c] = _mm512_fmadd_ps(p[j], v, o[j][c]);
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < GT; ++j)
      for (int c = 0; c < CH; ++c) _mm512_storeu_ps(og + j * D + 16 * (c0 + c), o[j][c]);
  }
}

// One group of gt (1 .. 4) vectors against a block: its scores (pass 0) or its outputs (pass 1), AVX-512.
template <int N16>
KV512_FN void group512(int pass, int64_t gt, const float* qs, const float* base, int64_t stride, int64_t n, float* sg,
                       int64_t T, float* og) {
  if (pass == 0) {
    if (gt == 4) block_scores512<N16, 4>(qs, base, stride, n, sg, T);
    else if (gt == 3) block_scores512<N16, 3>(qs, base, stride, n, sg, T);
    else if (gt == 2) block_scores512<N16, 2>(qs, base, stride, n, sg, T);
    else block_scores512<N16, 1>(qs, base, stride, n, sg, T);
  } else {
    if (gt == 4) block_values512<N16, 4>(sg, T, base, stride, n, og);
    else if (gt == 3) block_values512<N16, 3>(sg, T, base, stride, n, og);
    else if (gt == 2) block_values512<N16, 2>(sg, T, base, stride, n, og);
    else block_values512<N16, 1>(sg, T, base, stride, n, og);
  }
}

// Keys in lanes, for tiles of several rows (AVX-512): a block's K rows transposed to kt[kg][d][16] (key group kg of
// 16 keys, zero past the block's n), so one FMA computes one feature of 16 keys' scores for a query vector (its
// element broadcast) with no reduction across lanes. The sum over d keeps the order of block_scores512's: lane
// partial x_l = sum over c of q[16c + l] k[16c + l] (an FMA chain from 0), then reduce4's tree over l = 4 quarter
// + i, ((Q0 + Q2) + (Q1 + Q3)) with Qq = (x_4q + x_4q+2) + (x_4q+1 + x_4q+3), here with vertical adds; so a score
// has the same bits here as in a tile of one row (the decode path), and the tiling changes nothing.
// 16 consecutive cache elements of type T from element index i as float32 (int8: times sc), AVX-512.
template <KV T>
KV512_FN inline __m512 load16(const void* p, int64_t i, float sc) {
  if constexpr (T == KV::F32) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else if constexpr (T == KV::BF16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (T == KV::F16) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i)));
  } else {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(p) + i));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(sc));
  }
}

// r[i] = 16 features of key i -> r[j] = feature j of the 16 keys (an in-register 16 x 16 transpose).
KV512_FN inline void transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: [a0 b0 a1 b1], [a2 b2 a3 b3]
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // [a0 b0 c0 d0], [a1 ..], [a2 ..], [a3 ..] per lane, keys 4i/4 .. + 3
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4k + j] (keys 4k .. 4k + 3): lane L holds feature 4L + j
  for (int j = 0; j < 4; ++j) {  // lanes [L0 L2 | L0 L2] and [L1 L3 | L1 L3] of keys 0-3 | 4-7, then of 8-11 | 12-15
    t[j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88);
    t[4 + j] = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
    t[8 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
    t[12 + j] = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
  }
  for (int j = 0; j < 4; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);        // feature j
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xdd);    // feature 8 + j
    r[4 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0x88);   // feature 4 + j
    r[12 + j] = _mm512_shuffle_f32x4(t[4 + j], t[12 + j], 0xdd);  // feature 12 + j
  }
}

// Keys [i0, i0 + nk) (nk <= 16) of a block (row index r0) as kt[d][16] (float32; lanes past nk are 0).
template <int N16, KV T>
KV512_FN inline void transpose_keys(const void* cache, const float* scales, int64_t r0, int64_t Hkv, int64_t i0,
                                    int64_t nk, float* kt) {
  constexpr int64_t D = 16 * N16;
  for (int c = 0; c < N16; ++c) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) {
      const int64_t row = r0 + (i0 + i) * Hkv;
      r[i] = i < nk ? load16<T>(cache, row * D + 16 * c, T == KV::I8 ? scales[row] : 1.f) : _mm512_setzero_ps();
    }
    transpose16(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_ps(kt + (16 * c + j) * 16, r[j]);
  }
}

// A thread's transposed K blocks of one KV head (transpose_keys' layout, ceil(bs / 16) key groups per block),
// kept across the tiles of one paged_decode call: the tiles of a prefill chunk share its blocks, so each block
// is transposed once per chunk instead of once per tile. Valid only within the call (`call`): between calls a
// block's rows change (appended tokens, a freed block reused).
struct KtCache {
  uint64_t call = 0;
  const void* k = nullptr;
  std::vector<int64_t> block;  // per context block: the cache block whose keys are transposed there (-1: none)
  std::vector<int64_t> keys;   // per context block: how many of its keys are
  std::vector<float> kt;       // (context blocks * groups per block, D, 16)
};

inline KtCache& kt_cache(int64_t h) {
  thread_local std::vector<KtCache> caches;
  if (static_cast<int64_t>(caches.size()) <= h) caches.resize(h + 1);
  return caches[h];
}

// The transposed keys [0, n) of context block blk (cache row index r0), from the cache or transposed now.
template <int N16, KV T>
KV512_FN inline const float* cached_keys(KtCache& c, const void* cache, const float* scales, int64_t r0, int64_t Hkv,
                                         int64_t blk, int64_t cache_block, int64_t n, int64_t groups) {
  constexpr int64_t D = 16 * N16;
  float* kt = c.kt.data() + blk * groups * 16 * D;
  if (c.block[blk] != cache_block) c.block[blk] = cache_block, c.keys[blk] = 0;
  for (int64_t g = c.keys[blk] / 16; g * 16 < n; ++g)  // the groups not (fully) transposed yet
    transpose_keys<N16, T>(cache, scales, r0, Hkv, g * 16, std::min<int64_t>(16, n - g * 16), kt + g * 16 * D);
  c.keys[blk] = std::max(c.keys[blk], n);
  return kt;
}

// x_l + x_{l+2} (lane partials l and l + 2 of the tree) for VB vectors (q at qs, stride D) against 16 transposed keys.
template <int N16, int VB>
KV512_FN __attribute__((always_inline)) inline void pair_t512(const float* qs, const float* kt, int l, __m512* out) {
  constexpr int64_t D = 16 * N16;
  __m512 x[2][VB];
#pragma GCC unroll 4
  for (int v = 0; v < VB; ++v) x[0][v] = x[1][v] = _mm512_setzero_ps();
#pragma GCC unroll 8
  for (int c = 0; c < N16; ++c) {
#pragma GCC unroll 2
    for (int i = 0; i < 2; ++i) {
      const int64_t d = 16 * c + l + 2 * i;
      const __m512 k = _mm512_loadu_ps(kt + d * 16);
#pragma GCC unroll 4
      for (int v = 0; v < VB; ++v) x[i][v] = _mm512_fmadd_ps(_mm512_set1_ps(qs[v * D + d]), k, x[i][v]);
    }
  }
#pragma GCC unroll 4
  for (int v = 0; v < VB; ++v) {
    out[v] = _mm512_add_ps(x[0][v], x[1][v]);
    asm volatile("" : "+v"(out[v]));  // computed here: GCC would otherwise sink the tree's adds to the end
  }
}

// Quarter q of the tree: (x_4q + x_4q+2) + (x_4q+1 + x_4q+3).
template <int N16, int VB>
KV512_FN __attribute__((always_inline)) inline void quarter_t512(const float* qs, const float* kt, int q, __m512* out) {
  __m512 a[VB], b[VB];
  pair_t512<N16, VB>(qs, kt, 4 * q, a);
  pair_t512<N16, VB>(qs, kt, 4 * q + 1, b);
#pragma GCC unroll 4
  for (int v = 0; v < VB; ++v) out[v] = _mm512_add_ps(a[v], b[v]);
}

// Scores of VB vectors against 16 transposed keys (kt: [D][16]) -> s[v], each lane one key.
template <int N16, int VB>
KV512_FN __attribute__((always_inline)) inline void scores_t512(const float* qs, const float* kt, __m512* s) {
  __m512 a[VB], b[VB];
  quarter_t512<N16, VB>(qs, kt, 0, a);
  quarter_t512<N16, VB>(qs, kt, 2, b);
#pragma GCC unroll 4
  for (int v = 0; v < VB; ++v) a[v] = _mm512_add_ps(a[v], b[v]);  // Q0 + Q2
  quarter_t512<N16, VB>(qs, kt, 1, s);
  quarter_t512<N16, VB>(qs, kt, 3, b);
#pragma GCC unroll 4
  for (int v = 0; v < VB; ++v) s[v] = _mm512_add_ps(a[v], _mm512_add_ps(s[v], b[v]));  // (Q0 + Q2) + (Q1 + Q3)
}

// Vectors [v0, v0 + VB) of a tile (vector v of row v / G, length lens[v / G]) against one key group of a block
// (keys t0 .. t0 + nk - 1, transposed at kt): scores into sg rows (stride T), the running maxima mx[v] over keys
// inside each vector's context.
template <int N16, int VB>
KV512_FN void group_t512(const float* qs, const float* kt, int64_t nk, float* sg, int64_t T, int64_t t0,
                         const int64_t* lens, int64_t G, int64_t v0, float* mx) {
  __m512 s[VB];
  scores_t512<N16, VB>(qs, kt, s);
  const __mmask16 keys = static_cast<__mmask16>((1u << nk) - 1);
#pragma GCC unroll 4
  for (int v = 0; v < VB; ++v) {
    _mm512_mask_storeu_ps(sg + v * T, keys, s[v]);
    const int64_t inside = std::min<int64_t>(nk, lens[(v0 + v) / G] - t0);  // keys of this row's context
    if (inside > 0) {
      const __mmask16 m = static_cast<__mmask16>((1u << inside) - 1);
      mx[v0 + v] = std::max(mx[v0 + v], _mm512_mask_reduce_max_ps(m, s[v]));
    }
  }
}

template <int N16>
KV512_FN void groups_t512(int64_t gt, const float* qs, const float* kt, int64_t nk, float* sg, int64_t T, int64_t t0,
                          const int64_t* lens, int64_t G, int64_t v0, float* mx) {
  if (gt == 4) group_t512<N16, 4>(qs, kt, nk, sg, T, t0, lens, G, v0, mx);
  else if (gt == 3) group_t512<N16, 3>(qs, kt, nk, sg, T, t0, lens, G, v0, mx);
  else if (gt == 2) group_t512<N16, 2>(qs, kt, nk, sg, T, t0, lens, G, v0, mx);
  else group_t512<N16, 1>(qs, kt, nk, sg, T, t0, lens, G, v0, mx);
}

// exp256 (simd_common.h) on 16 lanes, op for op: each lane's bits equal exp256's.
KV512_FN inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3365478515625f));
  const __m512 n = _mm512_roundscale_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
                                        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// sg[t] = exp(sg[t] - mx) for t < T_len, returning their sum: the floats of tile_avx2's 8-lane loop (the same
// exp per lane, the sum accumulated 8 lanes at a time in the same order, the same scalar tail), 16 lanes at a time.
KV512_FN inline float exp_sum512(float* sg, int64_t T_len, float mx) {
  const __m512 m16 = _mm512_set1_ps(mx);
  __m256 sv = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= T_len; t += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(sg + t), m16));
    _mm512_storeu_ps(sg + t, e);
    sv = _mm256_add_ps(sv, _mm512_castps512_ps256(e));
    sv = _mm256_add_ps(sv, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
  }
  if (t + 8 <= T_len) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), _mm256_set1_ps(mx)));
    _mm256_storeu_ps(sg + t, e);
    sv = _mm256_add_ps(sv, e);
    t += 8;
  }
  float sum = hsum256(sv);
  for (; t < T_len; ++t) {
    sg[t] = std::exp(sg[t] - mx);
    sum += sg[t];
  }
  return sum;
}

// Whether AVX-512 tiles of several rows compute their scores with keys in lanes (transpose_keys, scores_t512,
// the maxima fused into the score pass, the transposed blocks shared by a chunk's tiles through KtCache), the
// exp 16 lanes at a time and prefetch the next item's queries; off: the tiles of before (lanes over D, group512),
// kept for benchmarks/prefill_attention.py's side-by-side. Both give the same floats.
inline std::atomic<bool>& keys_in_lanes_flag() {
  static std::atomic<bool> on{true};
  return on;
}

// The transposed K of a context up to this many bytes (all KV heads) is kept for the tiles after the first (KtCache);
// longer contexts transpose each block per tile instead, so the kept blocks stay in L2.
#ifndef KT_CACHE_BYTES
#define KT_CACHE_BYTES (384 << 10)
#endif

// Head dim D = 8 * NC, cache element type T; one tile: rows b0 .. b0 + R - 1 that share a block table (prefix) and
// have non-decreasing context lengths T_r (a prefill chunk's rows: T_r = T_0 + r, the causal mask), one KV head h.
// Its V = R * G query vectors (row r, head g: vector r * G + g) walk the block table block by block; each block's
// K (then V) rows of head h come from memory once per tile (prefetched ahead), are converted to float32 once per
// tile (compact caches: into an L1 buffer), and serve every vector whose row reaches the block. Scores: with
// AVX-512 and R > 1, keys in lanes (scores_t512: one FMA per feature for 16 keys, K transposed once per chunk),
// else lanes over D in groups of up to 4 (3: AVX2) vectors that share every K load (block_scores512 /
// block_scores); outputs: each V row's load serves up to 4 (3) vectors (block_values512 / block_values). Both score
// forms sum in the same order, so a tile of one (a decode row) gives the same bits as the row inside a tile.
// Two passes (all scores, then the outputs) rather than an online softmax: each vector's floats are then exactly
// those of its row alone (scores of keys past T_r are computed but not used, their probabilities are 0 and add
// 0 * v = +0 to the output), so the result does not depend on how rows are tiled: chunked prefill, the fused and
// the unfused step agree bit for bit. Softmax: max (exact, so its order is free), exp (exp256 per 8 lanes or
// exp512 per 16, the same bits) and sum per vector over its T_r; the 1/sum is applied to the output at the end.
// `buf` holds V * Tmax scores (Tmax = T_{R-1}), then V * D outputs, V * D scaled queries, V sums (first the
// maxima) and block_size * D converted rows.
template <int NC, KV T, bool W512>
KV_FN inline void tile_avx2(const Args& a, int64_t b0, int64_t R, int64_t h, float* buf) {
  constexpr int64_t D = 8 * NC;
  const int64_t G = a.H / a.Hkv, Hkv = a.Hkv, V = R * G;
  const int64_t* lens = a.lens + b0;
  const int64_t T_max = lens[R - 1];
  const int64_t row_bytes = D * kv_itemsize(T);
  const int64_t* table = a.tables + b0 * a.max_blocks;
  const int64_t n_blocks = (T_max + a.bs - 1) / a.bs;
  float* scores = buf;               // (V, T_max)
  float* obuf = scores + V * T_max;  // (V, D) unnormalised outputs
  float* qbuf = obuf + V * D;        // (V, D) q * scale
  float* sums = qbuf + V * D;        // (V,)
  float* rows = sums + V;            // (block_size, D) converted K or V rows; (16 * ceil(block_size / 16), D) K^T
  const bool v2 = W512 && keys_in_lanes_flag().load(std::memory_order_relaxed);
  const bool lanes_keys = v2 && R > 1;  // scores with keys in lanes, the maxima fused into the score pass
  // A soft-cap changes the scores after that pass and a window narrows the keys a maximum runs over: then the
  // maxima are taken after the soft-cap, over each vector's window, as the decode row does.
  const bool fused_max = lanes_keys && a.softcap == 0.f && a.window == 0;
  const int64_t blk_begin = first_key(a, lens[0]) / a.bs;  // blocks before every row's window are never read
  const int64_t groups = (a.bs + 15) / 16;  // key groups of 16 per block
  KtCache* kc = nullptr;
  bool keep = false;  // whether the transposed blocks are kept for the next tiles (else one block's room, reused)
  if (lanes_keys) {
    std::fill(sums, sums + V, -INFINITY);
    kc = &kt_cache(h);
    keep = a.call != 0 && n_blocks * groups * 16 * D * 4 * Hkv <= KT_CACHE_BYTES;
    if (!keep || kc->call != a.call || kc->k != a.k) {  // another call or layer: nothing to reuse
      kc->call = a.call, kc->k = a.k;
      kc->block.assign(kc->block.size(), -1);
    }
    const int64_t slots = keep ? n_blocks : 1;
    if (static_cast<int64_t>(kc->block.size()) < slots) kc->block.resize(slots, -1), kc->keys.resize(slots, 0);
    if (static_cast<int64_t>(kc->kt.size()) < slots * groups * 16 * D) kc->kt.resize(slots * groups * 16 * D);
  }
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = a.q + ((b0 + r) * a.H + h * G + g) * D;
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c)
        _mm256_storeu_ps(qbuf + (r * G + g) * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(qg + 8 * c), scale));
    }
  // A tile's query rows and outputs are in L2 or memory: the value pass prefetches the next item's queries (the
  // next head, or the next tile) and this item's output lines (for writing), a few lines per block.
  const bool last_head = h + 1 == Hkv;
  const int64_t next_b0 = last_head ? b0 + R : b0, next_h = last_head ? 0 : h + 1;
  const int64_t next_rows = lanes_keys ? std::max<int64_t>(0, std::min(R, a.B - next_b0)) : 0;
  const int64_t row_lines = G * D / 16;  // 64-byte lines of one row's G query vectors
  const int64_t ahead_lines = (next_rows + (lanes_keys ? R : 0)) * row_lines;
  const int64_t lines_per_block = (ahead_lines + n_blocks - 1) / std::max<int64_t>(1, n_blocks);
  int64_t line = 0, pf_row = 0, pf_off = 0;  // the next line: row pf_row (queries, then outputs), float pf_off
  auto prefetch_ahead = [&](int64_t count) {
    for (const int64_t end = std::min(ahead_lines, line + count); line < end; ++line) {
      if (pf_row < next_rows) _mm_prefetch(a.q + ((next_b0 + pf_row) * a.H + next_h * G) * D + pf_off, _MM_HINT_T0);
      else asm volatile("prefetchw %0" ::"m"(a.out[((b0 + pf_row - next_rows) * a.H + h * G) * D + pf_off]));
      if ((pf_off += 16) == row_lines * 16) pf_off = 0, ++pf_row;
    }
  };
  for (int pass = 0; pass < 2; ++pass) {  // 0: K -> scores; 1: V -> outputs
    const void* cache = pass == 0 ? a.k : a.v;
    const float* cscale = pass == 0 ? a.k_scale : a.v_scale;
    if (pass == 1) std::fill(obuf, obuf + V * D, 0.f);
    for (int64_t blk = blk_begin; blk < std::min<int64_t>(blk_begin + PREFETCH_BLOCKS, n_blocks); ++blk)
      prefetch_rows(cache, table[blk] * a.bs * Hkv + h, Hkv, std::min(a.bs, T_max - blk * a.bs), row_bytes);
    int64_t r_first = 0;  // the first row whose context reaches the block (rows are sorted by length)
    int64_t r_end = 0;    // past the last row whose window starts at or before the block (all rows without one)
    for (int64_t blk = blk_begin; blk < n_blocks; ++blk) {
      const int64_t t0 = blk * a.bs;
      const int64_t r0 = table[blk] * a.bs * Hkv + h;  // row index of the block's first token
      const int64_t n = std::min(a.bs, T_max - t0);
      while (lens[r_first] <= t0) ++r_first;
      while (r_end < R && first_key(a, lens[r_end]) / a.bs <= blk) ++r_end;
      if (const int64_t ahead = blk + PREFETCH_BLOCKS; ahead < n_blocks)
        prefetch_rows(cache, table[ahead] * a.bs * Hkv + h, Hkv, std::min(a.bs, T_max - ahead * a.bs), row_bytes);
      if (r_first >= r_end) continue;  // no row of the tile sees this block (windows of rows far apart)
      const int64_t V_end = r_end * G;
      if constexpr (W512) {
        if (lanes_keys && pass == 0) {
          if (!keep) kc->block[0] = -1;
          const float* kt = cached_keys<NC / 2, T>(*kc, cache, cscale, r0, Hkv, keep ? blk : 0, table[blk], n, groups);
          for (int64_t kg = 0; kg * 16 < n; ++kg) {
            const int64_t nk = std::min<int64_t>(16, n - kg * 16);
            for (int64_t v = r_first * G; v < V_end; v += 4)
              groups_t512<NC / 2>(std::min<int64_t>(V_end - v, 4), qbuf + v * D, kt + kg * 16 * D, nk,
                                  scores + v * T_max + t0 + kg * 16, T_max, t0 + kg * 16, lens, G, v, sums);
          }
          continue;
        }
      }
      if (pass == 1) prefetch_ahead(lines_per_block);
      int64_t stride;
      const float* base = block_rows<NC, T>(cache, cscale, r0, Hkv, n, rows, stride);
      for (int64_t v = r_first * G; v < V_end;) {
        const int64_t gt = std::min<int64_t>(V_end - v, W512 ? 4 : 3);
        float* sg = scores + v * T_max + t0;
        if constexpr (W512) {
          group512<NC / 2>(pass, gt, qbuf + v * D, base, stride, n, sg, T_max, obuf + v * D);
        } else if (pass == 0) {
          const float* qs = qbuf + v * D;
          if (gt == 3) block_scores<NC, 3>(qs, base, stride, n, sg, T_max);
          else if (gt == 2) block_scores<NC, 2>(qs, base, stride, n, sg, T_max);
          else block_scores<NC, 1>(qs, base, stride, n, sg, T_max);
        } else {
          float* og = obuf + v * D;
          if (gt == 3) block_values<NC, 3>(sg, T_max, base, stride, n, og);
          else if (gt == 2) block_values<NC, 2>(sg, T_max, base, stride, n, og);
          else block_values<NC, 1>(sg, T_max, base, stride, n, og);
        }
        v += gt;
      }
    }
    if (pass == 1) break;
    for (int64_t v = 0; v < V; ++v) {  // softmax numerator in place; the normaliser is applied to the output
      const int64_t T_len_all = lens[v / G], t_first = first_key(a, T_len_all);
      float* row_scores = scores + v * T_max;
      float* sg = row_scores + t_first;  // the vector's window [t_first, T_len_all), from here on [0, T_len)
      const int64_t T_len = T_len_all - t_first;
      if (a.softcap > 0.f) softcap_avx2(sg, T_len, a.softcap);
      int64_t t = 0;
      float mx = sums[v];  // fused into the score pass (fused_max): the same value, a max is exact
      if (!fused_max) {
        __m256 mv = _mm256_set1_ps(-INFINITY);
        for (; t + 8 <= T_len; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + t));
        mx = hmax256(mv);
        for (; t < T_len; ++t) mx = std::max(mx, sg[t]);
      }
      float sum;
      if (v2) {
        sum = exp_sum512(sg, T_len, mx);
      } else {
        __m256 mv = _mm256_set1_ps(mx);
        __m256 sv = _mm256_setzero_ps();
        for (t = 0; t + 8 <= T_len; t += 8) {
          const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
          _mm256_storeu_ps(sg + t, e);
          sv = _mm256_add_ps(sv, e);
        }
        sum = hsum256(sv);
        for (; t < T_len; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
      }
      std::fill(row_scores + T_len_all, row_scores + T_max, 0.f);  // the causal mask: keys past the row's context
      std::fill(row_scores + t_first / a.bs * a.bs, sg, 0.f);      // keys before the window in its first block
      sums[v] = sum;
    }
  }
  for (int64_t v = 0; v < V; ++v) {
    const __m256 inv = _mm256_set1_ps(1.f / sums[v]);
    float* out = a.out + ((b0 + v / G) * a.H + h * G + v % G) * D;
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(obuf + v * D + 8 * c), inv));
  }
}

// A decode row (a tile of one row, rows of other block tables beside it): the row's H = Hkv * G query vectors
// against its whole context, every KV head in one pass over each block, so a block's K (then V) rows of all heads,
// one contiguous bs * Hkv * D run of the cache, are prefetched and read once, front to back, instead of one
// strided head slice per work item. The arithmetic is tile_avx2's for R = 1 op for op (the same block_scores /
// block_values per head and group, the same softmax and normaliser): the floats equal the tile kernel's bit for
// bit, so a decode row agrees with the same row inside a prefill tile. `buf`: H * T scores, H * D outputs,
// H * D scaled queries, H sums, then bs * D converted rows per KV head (compact caches).
#ifndef DECODE_PREFETCH_BLOCKS
#define DECODE_PREFETCH_BLOCKS 2  // whole blocks (all KV heads: 12 KiB for SmolLM2's fp32) of prefetch distance
#endif
// Prefetches part `part` of `parts` of cache rows [first_row, first_row + n_rows) (element size `row_bytes` each)
// into L2 (T1: prefetching a whole block into L1 fills its miss buffers and stalls the loads; in a plain read of
// 12 KiB blocks in random order on this Zen 4, T0 bursts ran at about half the speed of T1 bursts).
KV_FN inline void prefetch_part(const void* cache, int64_t first_row, int64_t n_rows, int64_t row_bytes, int64_t part,
                                int64_t parts, int64_t part_end = -1) {
  const char* p = static_cast<const char*>(cache) + first_row * row_bytes;
  const int64_t lines = (n_rows * row_bytes + 63) / 64;
  const int64_t end = part_end < 0 ? part + 1 : part_end;  // parts [part, end)
  for (int64_t i = lines * part / parts, e = lines * end / parts; i < e; ++i) _mm_prefetch(p + 64 * i, _MM_HINT_T1);
}

constexpr int64_t kDecodeSub = 4;  // keys per sub-block of a decode row: one prefetch slice each

template <int NC, KV T, bool W512>
KV_FN inline void decode_row_avx2(const Args& a, int64_t b, int64_t next, bool first, float* buf) {
  constexpr int64_t D = 8 * NC;
  const int64_t G = a.H / a.Hkv, Hkv = a.Hkv, H = a.H;
  const int64_t T_len = a.lens[b];
  const int64_t row_bytes = D * kv_itemsize(T);
  const int64_t* table = a.tables + b * a.max_blocks;
  const int64_t n_blocks = (T_len + a.bs - 1) / a.bs;
  const int64_t t_first = first_key(a, T_len), blk0 = t_first / a.bs;  // a window's first key and its block
  float* scores = buf;               // (H, T_len)
  float* obuf = scores + H * T_len;  // (H, D) unnormalised outputs
  float* qbuf = obuf + H * D;        // (H, D) q * scale
  float* sums = qbuf + H * D;        // (H,)
  float* rows = sums + H;            // (Hkv, bs, D) converted K or V rows
  const __m256 scale = _mm256_set1_ps(a.scale);
  const float* qrow = a.q + b * H * D;
  for (int64_t v = 0; v < H; ++v)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_ps(qbuf + v * D + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(qrow + v * D + 8 * c), scale));
  if (first)  // the first row of a thread's run; the others' first K blocks came with the previous row's V pass
    for (int64_t blk = blk0; blk < std::min<int64_t>(blk0 + DECODE_PREFETCH_BLOCKS, n_blocks); ++blk)
      prefetch_part(a.k, table[blk] * a.bs * Hkv, std::min(a.bs, T_len - blk * a.bs) * Hkv, row_bytes, 0, 1);
  for (int pass = 0; pass < 2; ++pass) {  // 0: K -> scores; 1: V -> outputs
    const void* cache = pass == 0 ? a.k : a.v;
    const float* cscale = pass == 0 ? a.k_scale : a.v_scale;
    if (pass == 1) std::fill(obuf, obuf + H * D, 0.f);
    for (int64_t blk = blk0; blk < n_blocks; ++blk) {
      const int64_t t0 = blk * a.bs;
      const int64_t n = std::min(a.bs, T_len - t0);
      // The block DECODE_PREFETCH_BLOCKS ahead in the stream this thread reads: this pass's blocks, then V's
      // (after K), then the next row's K blocks (after V), each from its window's first block.
      const int64_t ahead = blk + DECODE_PREFETCH_BLOCKS;
      const void* pf_cache = cache;
      const int64_t* pf_table = table;
      int64_t pf_blk = ahead, pf_len = T_len;
      if (ahead >= n_blocks) {
        pf_blk = ahead - n_blocks + blk0;
        if (pass == 0) {
          pf_cache = a.v;
        } else if (next >= 0) {
          pf_cache = a.k, pf_table = a.tables + next * a.max_blocks, pf_len = a.lens[next];
          pf_blk = ahead - n_blocks + first_key(a, pf_len) / a.bs;
        } else {
          pf_cache = nullptr;
        }
      }
      const int64_t pf_rows = pf_cache && pf_blk * a.bs < pf_len ? std::min(a.bs, pf_len - pf_blk * a.bs) * Hkv : 0;
      const int64_t pf_first = pf_rows ? pf_table[pf_blk] * a.bs * Hkv : 0;
      const int64_t subs = (a.bs + kDecodeSub - 1) / kDecodeSub;
      for (int64_t h = 0; h < Hkv; ++h) {
        int64_t stride;
        const float* base = block_rows<NC, T>(cache, cscale, table[blk] * a.bs * Hkv + h, Hkv, n,
                                              rows + h * a.bs * D, stride);
        // kDecodeSub keys at a time, a slice of the block ahead prefetched before each, so the memory keeps busy
        // between the loads (one burst per head or block leaves it idle for most of the block). The same floats
        // as one call over the block: keys are scored in the same groups of 4, outputs accumulate in key order.
        for (int64_t i0 = 0; i0 < n; i0 += kDecodeSub) {
          const int64_t m = std::min(kDecodeSub, n - i0), part = h * subs + i0 / kDecodeSub;
          if (pf_rows)  // the last sub-block of a short block takes the head's remaining slices
            prefetch_part(pf_cache, pf_first, pf_rows, row_bytes, part, Hkv * subs,
                          i0 + kDecodeSub >= n ? (h + 1) * subs : part + 1);
          const float* kv_rows = base + i0 * stride;
          for (int64_t g0 = 0; g0 < G;) {  // tile_avx2's groups of the head's vectors
            const int64_t gt = std::min<int64_t>(G - g0, W512 ? 4 : 3);
            const int64_t v = h * G + g0;
            float* sg = scores + v * T_len + t0 + i0;
            float* og = obuf + v * D;
            if constexpr (W512) {
              group512<NC / 2>(pass, gt, qbuf + v * D, kv_rows, stride, m, sg, T_len, og);
            } else if (pass == 0) {
              const float* qs = qbuf + v * D;
              if (gt == 3) block_scores<NC, 3>(qs, kv_rows, stride, m, sg, T_len);
              else if (gt == 2) block_scores<NC, 2>(qs, kv_rows, stride, m, sg, T_len);
              else block_scores<NC, 1>(qs, kv_rows, stride, m, sg, T_len);
            } else {
              if (gt == 3) block_values<NC, 3>(sg, T_len, kv_rows, stride, m, og);
              else if (gt == 2) block_values<NC, 2>(sg, T_len, kv_rows, stride, m, og);
              else block_values<NC, 1>(sg, T_len, kv_rows, stride, m, og);
            }
            g0 += gt;
          }
        }
      }
    }
    if (pass == 1) break;
    const int64_t n_keys = T_len - t_first;  // the window's keys: scores [t_first, T_len) of each vector
    for (int64_t v = 0; v < H; ++v) {  // tile_avx2's softmax numerator and sum
      float* sg = scores + v * T_len + t_first;
      if (a.softcap > 0.f) softcap_avx2(sg, n_keys, a.softcap);
      __m256 mv = _mm256_set1_ps(-INFINITY);
      int64_t t = 0;
      for (; t + 8 <= n_keys; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + t));
      float mx = hmax256(mv);
      for (; t < n_keys; ++t) mx = std::max(mx, sg[t]);
      mv = _mm256_set1_ps(mx);
      __m256 sv = _mm256_setzero_ps();
      for (t = 0; t + 8 <= n_keys; t += 8) {
        const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
        _mm256_storeu_ps(sg + t, e);
        sv = _mm256_add_ps(sv, e);
      }
      float sum = hsum256(sv);
      for (; t < n_keys; ++t) {
        sg[t] = std::exp(sg[t] - mx);
        sum += sg[t];
      }
      sums[v] = sum;
      std::fill(scores + v * T_len + blk0 * a.bs, sg, 0.f);  // keys before the window in its first block
    }
  }
  for (int64_t v = 0; v < H; ++v) {
    const __m256 inv = _mm256_set1_ps(1.f / sums[v]);
    float* out = a.out + (b * H + v) * D;
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(out + 8 * c, _mm256_mul_ps(_mm256_loadu_ps(obuf + v * D + 8 * c), inv));
  }
}

template <KV T, bool W512>
inline TileFn avx2_item_for_type(int64_t D) {
  switch (D) {
    case 32: return tile_avx2<4, T, W512>;
    case 64: return tile_avx2<8, T, W512>;
    case 80: return tile_avx2<10, T, W512>;
    case 96: return tile_avx2<12, T, W512>;
    case 128: return tile_avx2<16, T, W512>;
    default: return nullptr;
  }
}

// The tile kernel for head dim D and cache type kv: with 16-lane FMAs (AVX-512) or 8-lane (AVX2).
template <bool W512>
inline TileFn avx2_item_for(int64_t D, KV kv) {
  switch (kv) {
    case KV::BF16: return avx2_item_for_type<KV::BF16, W512>(D);
    case KV::F16: return avx2_item_for_type<KV::F16, W512>(D);
    case KV::I8: return avx2_item_for_type<KV::I8, W512>(D);
    default: return avx2_item_for_type<KV::F32, W512>(D);
  }
}

// (args, row, the next row of this thread or -1, whether the previous item was not a decode row, buffer)
using RowFn = void (*)(const Args&, int64_t, int64_t, bool, float*);

template <KV T, bool W512>
inline RowFn decode_row_for_type(int64_t D) {
  switch (D) {
    case 32: return decode_row_avx2<4, T, W512>;
    case 64: return decode_row_avx2<8, T, W512>;
    case 80: return decode_row_avx2<10, T, W512>;
    case 96: return decode_row_avx2<12, T, W512>;
    case 128: return decode_row_avx2<16, T, W512>;
    default: return nullptr;
  }
}

// The decode-row kernel for head dim D and cache type kv (the twin of avx2_item_for).
template <bool W512>
inline RowFn decode_row_for(int64_t D, KV kv) {
  switch (kv) {
    case KV::BF16: return decode_row_for_type<KV::BF16, W512>(D);
    case KV::F16: return decode_row_for_type<KV::F16, W512>(D);
    case KV::I8: return decode_row_for_type<KV::I8, W512>(D);
    default: return decode_row_for_type<KV::F32, W512>(D);
  }
}

inline bool cpu_has_f16c() { return scratchlm_simd::cpu_has_avx2(); }  // AVX2 implies F16C here

#endif

#ifndef PREFILL_TILE_ROWS
#define PREFILL_TILE_ROWS 8  // query rows per tile (each with its G query heads)
#endif

// The tiles of a step's rows: runs of up to `max_rows` consecutive rows whose block tables agree on every block
// the run's longest context uses and whose context lengths do not decrease (a prefill chunk's rows; rows of
// sequences that share a cached prefix too), as (first row, rows) pairs.
inline std::vector<std::pair<int64_t, int64_t>> row_tiles(const Args& a, int64_t max_rows) {
  std::vector<std::pair<int64_t, int64_t>> tiles;
  for (int64_t b = 0; b < a.B;) {
    const int64_t* t0 = a.tables + b * a.max_blocks;
    int64_t e = b + 1;
    while (e < a.B && e - b < max_rows && a.lens[e] >= a.lens[e - 1]) {
      const int64_t used = (a.lens[e] + a.bs - 1) / a.bs;
      if (!std::equal(t0, t0 + used, a.tables + e * a.max_blocks)) break;
      ++e;
    }
    tiles.emplace_back(b, e - b);
    b = e;
  }
  return tiles;
}

// Whether rows that form a tile alone (decode rows) run decode_row_avx2 (all KV heads per item) rather than
// tile_avx2 per KV head: the same floats, so only speed differs (benchmarks/decode_step.py interleaves the two).
inline std::atomic<bool>& decode_rows_flag() {
  static std::atomic<bool> on{true};
  return on;
}

// out = attention of every row of `a` (one query per row over its own context), in tiles of rows that share a
// block table (row_tiles; `tile_rows` <= 1: every row alone); work items (a tile and one KV head, or a one-row
// tile and all its KV heads) split across threads. A row's result does not depend on the tiling.
inline void paged_decode(const Args& args, bool use_simd, int64_t tile_rows = PREFILL_TILE_ROWS, bool avx512 = true) {
  static std::atomic<uint64_t> calls{0};
  Args a = args;
  a.call = ++calls;  // the tiles' KtCache entries of this call
  int64_t max_len = 0;
  for (int64_t b = 0; b < a.B; ++b) max_len = std::max(max_len, a.lens[b]);
  const int64_t G = a.H / a.Hkv;
  TileFn item = scalar_item_for(a.kv);
  RowFn row = nullptr;
#ifdef SCRATCHLM_X86
  static const bool simd_ok = cpu_has_avx2() && cpu_has_f16c();
  if (use_simd && simd_ok && avx2_item_for<false>(a.D, a.kv) != nullptr) {
    const bool w512 = avx512 && cpu_has_avx512();
    item = w512 ? avx2_item_for<true>(a.D, a.kv) : avx2_item_for<false>(a.D, a.kv);
    if (decode_rows_flag().load(std::memory_order_relaxed))
      row = w512 ? decode_row_for<true>(a.D, a.kv) : decode_row_for<false>(a.D, a.kv);
  }
#else
  (void)use_simd, (void)avx512;
#endif
  const auto tiles = row_tiles(a, std::max<int64_t>(1, tile_rows));
  int64_t max_rows = 1;
  for (const auto& t : tiles) max_rows = std::max(max_rows, t.second);
  std::vector<std::pair<int64_t, int64_t>> items;  // (tile, KV head; -1: every head, decode_row_avx2)
  items.reserve(tiles.size() * a.Hkv);
  for (int64_t i = 0; i < static_cast<int64_t>(tiles.size()); ++i) {
    if (row != nullptr && tiles[i].second == 1) items.emplace_back(i, -1);
    else for (int64_t h = 0; h < a.Hkv; ++h) items.emplace_back(i, h);
  }
  // Grain: enough items per thread that small batches stay on one thread.
  const int64_t grain = std::max<int64_t>(
      1, (1 << 15) / std::max<int64_t>(1, max_len * a.D * std::max(max_rows, row != nullptr ? a.Hkv : 1)));
  const int64_t V = max_rows * G;  // tile_avx2's layout (the scalar: G * T)
  const int64_t buf_size = std::max(V * max_len + 2 * V * a.D + V + (a.bs + 15) / 16 * 16 * a.D,
                                    row != nullptr ? a.H * (max_len + 2 * a.D + 1) + a.Hkv * a.bs * a.D : 0);
  at::parallel_for(0, static_cast<int64_t>(items.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(buf_size);
    for (int64_t i = begin; i < end; ++i) {
      const auto& t = tiles[items[i].first];
      if (items[i].second < 0) {
        const bool next_row = i + 1 < end && items[i + 1].second < 0;
        const bool first = i == begin || items[i - 1].second >= 0;
        row(a, t.first, next_row ? tiles[items[i + 1].first].first : -1, first, buf.data());
      } else {
        item(a, t.first, t.second, items[i].second, buf.data());
      }
    }
  });
}

}  // namespace scratchlm_attn

