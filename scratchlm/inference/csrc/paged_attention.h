// Paged decode attention on the CPU (scratchlm.inference.attention): one query token per sequence
// attends to its context in the block-table KV cache, read in place (no gather copy).
//
//   q            (B, H, D)  float32
//   k/v_cache    (num_blocks, block_size, Hkv, D)  float32, slot s = block * block_size + offset
//   block_tables (B, max_blocks) int64;  context_lens (B,) int64
//   out          (B, H, D)  float32
//
// Work item = (sequence b, kv head h): its G = H / Hkv query heads read the same K/V rows (grouped-query
// attention without repeating K/V; K and V come from memory once and from L2 for the other heads). Per query
// head: scores s[t] = q_g . k_t * scale, a softmax, out_g = sum_t p[t] v_t. Items are split across threads
// with at::parallel_for.
// An AVX2+FMA path (function target attributes, chosen at run time) and a portable scalar path.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd_common.h"

namespace scratchlm_attn {

using scratchlm_simd::cpu_has_avx2;

struct Args {
  const float* q; const float* k; const float* v;
  const int64_t* tables; const int64_t* lens;
  float* out;
  int64_t B, H, Hkv, D, bs, max_blocks;
  float scale;
};

using ItemFn = void (*)(const Args&, int64_t, int64_t, float*);

inline const float* row(const float* cache, const Args& a, const int64_t* table, int64_t t, int64_t h) {
  const int64_t block = table[t / a.bs];
  return cache + ((block * a.bs + t % a.bs) * a.Hkv + h) * a.D;
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

inline void item_scalar(const Args& a, int64_t b, int64_t h, float* scores) {
  const int64_t G = a.H / a.Hkv, D = a.D, T = a.lens[b];
  const int64_t* table = a.tables + b * a.max_blocks;
  const float* q = a.q + (b * a.H + h * G) * D;  // (G, D)
  for (int64_t t = 0; t < T; ++t) {
    const float* kr = row(a.k, a, table, t, h);
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * kr[d];
      scores[t * G + g] = acc * a.scale;
    }
  }
  softmax_columns(scores, T, G);
  float* o = a.out + (b * a.H + h * G) * D;  // (G, D)
  std::fill(o, o + G * D, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    const float* vr = row(a.v, a, table, t, h);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[t * G + g];
      for (int64_t d = 0; d < D; ++d) o[g * D + d] += p * vr[d];
    }
  }
}

#ifdef SCRATCHLM_X86
using scratchlm_simd::exp256;
using scratchlm_simd::hmax256;
using scratchlm_simd::hsum256;

// Head dim D = 8 * NC. Walks the block table block by block (no division per token), one query head g at a
// time (K and V of one sequence and KV head stay in L2 across the G passes):
//   scores: q_g * scale held in registers (D <= 64), four K rows at a time, the four dot products reduced
//     together by horizontal adds (no per-score horizontal sum); stored contiguously per head;
//   softmax: vectorised max, exp (exp256) and sum; the 1/sum is applied to the output at the end;
//   values: the head's D outputs held in NC registers while V streams by.
template <int NC>
AVX2_FN inline void item_avx2(const Args& a, int64_t b, int64_t h, float* scores) {
  constexpr int64_t D = 8 * NC;
  constexpr bool q_in_registers = NC <= 8;
  const int64_t G = a.H / a.Hkv, T = a.lens[b], stride = a.Hkv * D;
  const int64_t* table = a.tables + b * a.max_blocks;
  const __m256 scale = _mm256_set1_ps(a.scale);
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = a.q + (b * a.H + h * G + g) * D;
    alignas(32) float qs[D];  // q_g * scale
    __m256 qv[q_in_registers ? NC : 1];
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(qg + 8 * c), scale);
      _mm256_store_ps(qs + 8 * c, v);
      if constexpr (q_in_registers) qv[c] = v;
    }
    float* sg = scores + g * T;  // (T,) this head's scores, then its unnormalised probabilities
    for (int64_t t0 = 0, blk = 0; t0 < T; t0 += a.bs, ++blk) {
      const float* base = a.k + (table[blk] * a.bs * a.Hkv + h) * D;
      const int64_t n = std::min(a.bs, T - t0);
      int64_t i = 0;
      for (; i + 4 <= n; i += 4) {
        const float* k0 = base + i * stride;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          __m256 qc;
          if constexpr (q_in_registers) qc = qv[c]; else qc = _mm256_load_ps(qs + 8 * c);
          s0 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + 8 * c), s0);
          s1 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + stride + 8 * c), s1);
          s2 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + 2 * stride + 8 * c), s2);
          s3 = _mm256_fmadd_ps(qc, _mm256_loadu_ps(k0 + 3 * stride + 8 * c), s3);
        }
        // hadd(hadd(s0, s1), hadd(s2, s3)) = [s0 s1 s2 s3 partial sums of lanes 0-3 | of lanes 4-7]
        const __m256 hh = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
        _mm_storeu_ps(sg + t0 + i, _mm_add_ps(_mm256_castps256_ps128(hh), _mm256_extractf128_ps(hh, 1)));
      }
      for (; i < n; ++i) {
        const float* kr = base + i * stride;
        __m256 s0 = _mm256_setzero_ps();
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) s0 = _mm256_fmadd_ps(_mm256_load_ps(qs + 8 * c), _mm256_loadu_ps(kr + 8 * c), s0);
        sg[t0 + i] = hsum256(s0);
      }
    }
    // softmax numerator in place; the normaliser is applied to the output
    __m256 mv = _mm256_set1_ps(-INFINITY);
    int64_t t = 0;
    for (; t + 8 <= T; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(sg + t));
    float mx = hmax256(mv);
    for (; t < T; ++t) mx = std::max(mx, sg[t]);
    mv = _mm256_set1_ps(mx);
    __m256 sv = _mm256_setzero_ps();
    for (t = 0; t + 8 <= T; t += 8) {
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(sg + t), mv));
      _mm256_storeu_ps(sg + t, e);
      sv = _mm256_add_ps(sv, e);
    }
    float sum = hsum256(sv);
    for (; t < T; ++t) {
      sg[t] = std::exp(sg[t] - mx);
      sum += sg[t];
    }
    __m256 o[NC];
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) o[c] = _mm256_setzero_ps();
    for (int64_t t0 = 0, blk = 0; t0 < T; t0 += a.bs, ++blk) {
      const float* base = a.v + (table[blk] * a.bs * a.Hkv + h) * D;
      const int64_t n = std::min(a.bs, T - t0);
      for (int64_t i = 0; i < n; ++i) {
        const float* vr = base + i * stride;
        const __m256 p = _mm256_set1_ps(sg[t0 + i]);
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) o[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), o[c]);
      }
    }
    const __m256 inv = _mm256_set1_ps(1.f / sum);
    float* og = a.out + (b * a.H + h * G + g) * D;
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(og + 8 * c, _mm256_mul_ps(o[c], inv));
  }
}

inline ItemFn avx2_item_for(int64_t D) {
  switch (D) {
    case 32: return item_avx2<4>;
    case 64: return item_avx2<8>;
    case 80: return item_avx2<10>;
    case 96: return item_avx2<12>;
    case 128: return item_avx2<16>;
    default: return nullptr;
  }
}

#endif

// out = attention of every (sequence, kv head) item of `a`; items split across threads.
inline void paged_decode(const Args& a, bool use_simd) {
  int64_t max_len = 0;
  for (int64_t b = 0; b < a.B; ++b) max_len = std::max(max_len, a.lens[b]);
  const int64_t G = a.H / a.Hkv;
  ItemFn item = item_scalar;
#ifdef SCRATCHLM_X86
  if (use_simd && cpu_has_avx2() && avx2_item_for(a.D) != nullptr) item = avx2_item_for(a.D);
#else
  (void)use_simd;
#endif
  // Grain: enough items per thread that small batches stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, max_len * a.D));
  at::parallel_for(0, a.B * a.Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(max_len * G);
    for (int64_t i = begin; i < end; ++i) item(a, i / a.Hkv, i % a.Hkv, scores.data());
  });
}

}  // namespace scratchlm_attn

