// y (M, N) = x (M, K) @ W^T for W stored quantized, on the CPU: the matmuls of a quantized decode step.
//
// Weight formats (scratchlm.inference.quantization.scheme; GGUF's blocks are the same bytes):
//   int8: q int8 (N, K), float32 scales (N, G), w = s q             (per channel: G = 1; GGUF Q8_0: groups of 32)
//   int4: q uint8 (N, K/2), nibbles per 32-block as GGUF (byte i: weight i low, weight i + 16 high), fp16 d (N, G)
//         and fp16 m (N, G) or none: w = d q + m (Q4_1) or w = d (q - 8) (Q4_0)
//
// Method (as llama.cpp on AVX2): the activations are quantized to int8 per 32-block, x ~ dx xq with
// dx = max|x| / 127, and each block of a dot product is an integer dot product of 32 bytes,
//   sum_k w_k x_k ~ sum_b dx_b [ d_g sum_{k in b} q_k xq_k + m_g sum_{k in b} xq_k ]      (int4, m = -8 d sym)
//                 ~ sum_b dx_b s_g sum_{k in b} q_k xq_k                                    (int8)
// on u8 x s8 pairs: AVX512-VNNI's vpdpbusd (32 multiply-adds into 8 int32 lanes in one instruction) where the
// CPU has it, else AVX2's maddubs + madd; int8 weights use the sign trick (|w| x sign(x, w)) so that one operand
// is unsigned and the maddubs pairs cannot saturate (127 * 127 * 2 < 2^15). Measured against dequantizing the
// codes to float in registers and FMAs (the older quantization/csrc/quant_kernels.cpp) in
// benchmarks/quant_gemv.py: see docs/quantization.md. The rounding of x is the only difference from the float
// reference: its error is below 1/254 of each block's largest |x|, and the tests bound the result against
// float64 dequantize-then-matmul.
// For few rows of x (decode, M <= kMaxRows) a tile of 4 (or 8) weight rows is unpacked once per tile (for M > 1)
// and meets every x row while it is in L1; larger M (prefill chunks) runs the panel kernels (paths 8 / 9 below: a
// 16-row panel unpacked once per call, reused by every x row), or, with float activations, the weight is
// dequantized to float32 once per call (exactly d q + m, as gguf.quants) for ATen's GEMM (qlinear.h does that).
// Output rows are split over threads with at::parallel_for in tiles of 4, 8 or 16.

#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "simd_common.h"
#include "skinny_gemm.h"

namespace scratchlm_qgemm {

constexpr int64_t kBlock = 32;
constexpr int64_t kMaxRows = 64;  // above this many rows of x: the prefill paths (panels, or dequantize + GEMM)
constexpr int64_t kTile = 4;      // weight rows per tile

enum class Kind : int { kF32 = 0, kInt8 = 1, kInt4 = 2 };

// One weight matrix (pointers into tensors the caller keeps alive).
struct QMat {
  Kind kind = Kind::kF32;
  int64_t N = 0, K = 0, gs = 0, G = 0;
  const float* w = nullptr;     // float32 (N, K)
  const int8_t* q8 = nullptr;   // int8 (N, K)
  const uint8_t* q4 = nullptr;  // uint8 (N, K / 2)
  const float* s = nullptr;     // int8: float32 scales (N, G)
  const uint16_t* d = nullptr;  // int4: fp16 scales (N, G)
  const uint16_t* m = nullptr;  // int4: fp16 mins (N, G), nullptr for symmetric (-8 d)
};

// Whether the integer kernels take this matrix (else the caller uses another path).
inline bool supported(const QMat& w) {
  if (w.kind == Kind::kInt4) return w.K % kBlock == 0 && w.gs % kBlock == 0;
  if (w.kind == Kind::kInt8) return w.G == 1 || (w.gs % kBlock == 0 && w.K % kBlock == 0);
  return false;
}

inline float half_to_float(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

// x (M, K) quantized per 32-block: q (M, nb * 32) with zeros past K, dx (M, nb), sx (M, nb) = dx * sum(q).
struct QAct {
  int64_t M = 0, K = 0, nb = 0;
  bool valid = false;  // for callers that share one quantized x between matmuls
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
};

inline void quantize_rows_scalar(const float* x, int64_t M, int64_t K, QAct& a) {
  a.M = M, a.K = K, a.nb = (K + kBlock - 1) / kBlock;
  a.q.assign(M * a.nb * kBlock, 0);
  a.dx.resize(M * a.nb), a.sx.resize(M * a.nb);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < a.nb; ++b) {
      const float* xb = x + r * K + b * kBlock;
      const int64_t n = std::min(kBlock, K - b * kBlock);
      float amax = 0.f;
      for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* qb = a.q.data() + (r * a.nb + b) * kBlock;
      int32_t sum = 0;
      for (int64_t i = 0; i < n; ++i) {
        qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));  // round half to even, as _mm256_round_ps
        sum += qb[i];
      }
      a.dx[r * a.nb + b] = d;
      a.sx[r * a.nb + b] = d * static_cast<float>(sum);
    }
}

// ------------------------------------------------------------------------------------------- scalar path
inline void tile_scalar(const QAct& a, const QMat& w, float* y, int64_t n0, int64_t n1) {
  const int64_t K = w.K, nb = a.nb, stride = nb * kBlock;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < a.M; ++r) {
      const int8_t* xq = a.q.data() + r * stride;
      float total = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t g = b * kBlock / w.gs, k0 = b * kBlock, k1 = std::min(K, k0 + kBlock);
        int32_t acc = 0;
        float scale, off = 0.f;
        if (w.kind == Kind::kInt4) {
          const uint8_t* qb = w.q4 + n * (K / 2) + b * 16;
          for (int i = 0; i < 16; ++i) acc += (qb[i] & 0x0F) * xq[k0 + i] + (qb[i] >> 4) * xq[k0 + 16 + i];
          scale = half_to_float(w.d[n * w.G + g]);
          off = w.m ? half_to_float(w.m[n * w.G + g]) : -8.f * scale;
        } else {
          const int8_t* qr = w.q8 + n * K;
          for (int64_t k = k0; k < k1; ++k) acc += qr[k] * xq[k];
          scale = w.s[n * w.G + g];
        }
        total += a.dx[r * nb + b] * scale * static_cast<float>(acc) + off * a.sx[r * nb + b];
      }
      y[r * w.N + n] = total;
    }
}

#ifdef SCRATCHLM_X86
#define QAVX2_FN __attribute__((target("avx2,fma,f16c")))
#define QVNNI_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))

QAVX2_FN inline void quantize_rows_avx2(const float* x, int64_t M, int64_t K, QAct& a) {
  if (K % kBlock) return quantize_rows_scalar(x, M, K, a);
  a.M = M, a.K = K, a.nb = K / kBlock;
  a.q.resize(M * K);
  a.dx.resize(M * a.nb), a.sx.resize(M * a.nb);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < a.nb; ++b) {
      const float* xb = x + r * K + b * kBlock;
      __m256 v[4];
      __m256 mx = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
      }
      const float amax = scratchlm_simd::hmax256(mx);
      const float d = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      const __m256 iv = _mm256_set1_ps(inv);
      __m256i i32[4];
      for (int j = 0; j < 4; ++j)
        i32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], iv), _MM_FROUND_TO_NEAREST_INT |
                                                                                _MM_FROUND_NO_EXC));
      // int32 -> int16 -> int8 with packs (which interleave 128-bit lanes: undo with a permute)
      __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
      __m256i p8 = _mm256_packs_epi16(p16a, p16b);
      p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + r * K + b * kBlock), p8);
      __m256i s = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
      s4 = _mm_hadd_epi32(s4, s4);
      s4 = _mm_hadd_epi32(s4, s4);
      a.dx[r * a.nb + b] = d;
      a.sx[r * a.nb + b] = d * static_cast<float>(_mm_cvtsi128_si32(s4));
    }
}

// 16 packed bytes -> the block's 32 codes as bytes, weight i at byte i.
QAVX2_FN inline __m256i unpack_nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

QAVX2_FN inline __m256i dot_u8s8_avx2(__m256i u, __m256i s) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}
QVNNI_FN inline __m256i dot_u8s8_vnni(__m256i u, __m256i s) {
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
}

// The micro kernel: R weight rows (n .. n + R - 1) against x row r. Weight codes come either straight from the
// packed matrix (unpacked in registers) or from a tile buffer `ub` of already unpacked codes (R x Kp bytes).
// Int8 weights are read as |w| (unsigned) with the sign moved onto x.
#define SCRATCHLM_QMICRO(NAME, ATTR, DOT)                                                                        \
  template <int R>                                                                                               \
  ATTR inline void NAME(const QAct& a, const QMat& w, float* y, int64_t n, int64_t r, const uint8_t* ub,         \
                        const char* pf, int64_t pf_lines, const float* df, const float* mf, const float* sxg,   \
                        const float* cs = nullptr) {                                                             \
    const int64_t nb = w.K / kBlock, Kp = a.nb * kBlock, bpg = std::max<int64_t>(1, w.gs / kBlock), G = w.G;     \
    const int8_t* xq = a.q.data() + r * Kp;                                                                      \
    const float* dx = a.dx.data() + r * a.nb;                                                                    \
    const bool int4 = w.kind == Kind::kInt4;                                                                     \
    __m256 total[R];                                                                                             \
    for (int i = 0; i < R; ++i) total[i] = _mm256_setzero_ps();                                                  \
    const int64_t per_block = (pf_lines + nb - 1) / std::max<int64_t>(1, nb);                                    \
    if (cs) { /* int8 in 32-blocks (GGUF Q8_0): cs = s_nb dx_b, one multiply-add per row-block */                \
      for (int64_t b = 0; b < nb; ++b) {                                                                         \
        for (int64_t p = 0; p < per_block && pf_lines > 0; ++p, pf += 64, --pf_lines) _mm_prefetch(pf, _MM_HINT_T0); \
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));              \
        for (int i = 0; i < R; ++i) {                                                                            \
          const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q8 + (n + i) * w.K + b * kBlock)); \
          const __m256i p = DOT(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));                             \
          total[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcast_ss(cs + i * nb + b), total[i]);     \
        }                                                                                                        \
      }                                                                                                          \
      for (int i = 0; i < R; ++i) y[r * w.N + n + i] = scratchlm_simd::hsum256(total[i]);                        \
      return;                                                                                                    \
    }                                                                                                            \
    for (int64_t b0 = 0, g = 0; b0 < nb; b0 += bpg, ++g) {                                                       \
      const int64_t b1 = std::min(nb, b0 + bpg);                                                                 \
      __m256 acc[R];                                                                                             \
      for (int i = 0; i < R; ++i) acc[i] = _mm256_setzero_ps();                                                  \
      for (int64_t b = b0; b < b1; ++b) {                                                                        \
        for (int64_t p = 0; p < per_block && pf_lines > 0; ++p, pf += 64, --pf_lines) _mm_prefetch(pf, _MM_HINT_T0); \
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * kBlock));              \
        const __m256 dxv = _mm256_broadcast_ss(dx + b);                                                          \
        for (int i = 0; i < R; ++i) {                                                                            \
          __m256i p;                                                                                             \
          if (int4) {                                                                                            \
            const __m256i wv = ub ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ub + i * w.K + b * kBlock)) \
                                  : unpack_nibbles(w.q4 + (n + i) * (w.K / 2) + b * 16);                         \
            p = DOT(wv, xv);                                                                                     \
          } else {                                                                                               \
            const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.q8 + (n + i) * w.K + b * kBlock)); \
            p = DOT(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));                                         \
          }                                                                                                      \
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), dxv, acc[i]);                                          \
        }                                                                                                        \
      }                                                                                                          \
      for (int i = 0; i < R; ++i) total[i] = _mm256_fmadd_ps(acc[i], _mm256_broadcast_ss(df + i * G + g), total[i]); \
    }                                                                                                            \
    for (int i = 0; i < R; ++i) {                                                                                \
      float t = scratchlm_simd::hsum256(total[i]);                                                               \
      if (mf) { /* the min (or -8 d) terms: sum_g m_g * sum_{b in g} dx_b sum(xq_b) */                           \
        __m256 o = _mm256_setzero_ps();                                                                          \
        int64_t g = 0;                                                                                           \
        for (; g + 8 <= G; g += 8) o = _mm256_fmadd_ps(_mm256_loadu_ps(mf + i * G + g), _mm256_loadu_ps(sxg + g), o); \
        t += scratchlm_simd::hsum256(o);                                                                         \
        for (; g < G; ++g) t += mf[i * G + g] * sxg[g];                                                          \
      }                                                                                                          \
      if (!int4 && nb * kBlock < w.K) { /* per-channel int8 with a ragged tail block (K % 32 != 0) */            \
        const int8_t* qr = w.q8 + (n + i) * w.K;                                                                 \
        int32_t acc = 0;                                                                                         \
        for (int64_t k = nb * kBlock; k < w.K; ++k) acc += qr[k] * xq[k];                                        \
        t += df[i * G] * dx[nb] * static_cast<float>(acc);                                                       \
      }                                                                                                          \
      y[r * w.N + n + i] = t;                                                                                    \
    }                                                                                                            \
  }

SCRATCHLM_QMICRO(micro_avx2, QAVX2_FN, dot_u8s8_avx2)
SCRATCHLM_QMICRO(micro_vnni, QVNNI_FN, dot_u8s8_vnni)

// Rows n0 .. n1 of W against every x row. Int4 weights with several x rows are unpacked per tile into `ub`.
#define SCRATCHLM_QTILE(NAME, ATTR, MICRO)                                                                       \
  ATTR inline void NAME(const QAct& a, const QMat& w, float* y, int64_t n0, int64_t n1) {                        \
    std::vector<uint8_t> buf;                                                                                    \
    const bool unpack = w.kind == Kind::kInt4 && a.M > 1;                                                        \
    if (unpack) buf.resize(kTile * w.K);                                                                         \
    const int64_t G = w.G, bpg = std::max<int64_t>(1, w.gs / kBlock);                                            \
    /* per tile: the rows' scales (and mins, or -8 d) as float; per x row: its per-group sums dx * sum(xq) */    \
    std::vector<float> df(kTile * G), mf(w.kind == Kind::kInt4 ? kTile * G : 0), sxg(a.M * G, 0.f);             \
    /* int8 in 32-blocks (GGUF Q8_0): the row-block scales times dx fold into one float per row-block */         \
    const bool blockwise8 = w.kind == Kind::kInt8 && bpg == 1 && G == w.K / kBlock && w.K % kBlock == 0;         \
    std::vector<float> cs(blockwise8 ? kTile * G : 0);                                                           \
    for (int64_t r = 0; r < a.M; ++r)                                                                            \
      for (int64_t b = 0; b < a.nb; ++b) sxg[r * G + std::min(G - 1, b / bpg)] += a.sx[r * a.nb + b];           \
    const int64_t row_bytes = w.kind == Kind::kInt4 ? w.K / 2 : w.K;                                             \
    const char* base = w.kind == Kind::kInt4 ? reinterpret_cast<const char*>(w.q4)                              \
                                             : reinterpret_cast<const char*>(w.q8);                              \
    for (int64_t n = n0; n < n1; n += kTile) {                                                                   \
      const int64_t R = std::min(kTile, n1 - n);                                                                 \
      for (int64_t i = 0; i < R; ++i)                                                                            \
        for (int64_t g = 0; g < G; ++g) {                                                                        \
          if (w.kind == Kind::kInt4) {                                                                           \
            const float d = _cvtsh_ss(w.d[(n + i) * G + g]);                                                     \
            df[i * G + g] = d, mf[i * G + g] = w.m ? _cvtsh_ss(w.m[(n + i) * G + g]) : -8.f * d;                \
          } else {                                                                                               \
            df[i * G + g] = w.s[(n + i) * G + g];                                                                \
          }                                                                                                      \
        }                                                                                                        \
      const uint8_t* ub = nullptr;                                                                               \
      if (unpack) {                                                                                              \
        for (int64_t i = 0; i < R; ++i)                                                                          \
          for (int64_t b = 0; b < w.K / kBlock; ++b)                                                             \
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(buf.data() + i * w.K + b * kBlock),                   \
                                unpack_nibbles(w.q4 + (n + i) * (w.K / 2) + b * 16));                            \
        ub = buf.data();                                                                                         \
      }                                                                                                          \
      const int64_t ahead = n + 2 * kTile; /* prefetch the rows two tiles ahead, during the first x row */       \
      const char* pf = base + ahead * row_bytes;                                                                 \
      const int64_t lines = ahead + kTile <= n1 ? kTile * row_bytes / 64 : 0;                                    \
      const float* mp = mf.empty() ? nullptr : mf.data();                                                        \
      for (int64_t r = 0; r < a.M; ++r) {                                                                        \
        const char* p = r == 0 ? pf : nullptr;                                                                   \
        const int64_t l = r == 0 ? lines : 0;                                                                    \
        if (blockwise8 && R == 4) {                                                                              \
          for (int64_t i = 0; i < 4; ++i)                                                                        \
            for (int64_t b = 0; b < G; ++b) cs[i * G + b] = df[i * G + b] * a.dx[r * a.nb + b];                  \
          MICRO<4>(a, w, y, n, r, ub, p, l, df.data(), mp, sxg.data() + r * G, cs.data());                       \
        } else if (R == 4) MICRO<4>(a, w, y, n, r, ub, p, l, df.data(), mp, sxg.data() + r * G);                 \
        else                                                                                                     \
          for (int64_t i = 0; i < R; ++i)                                                                        \
            MICRO<1>(a, w, y, n + i, r, ub ? ub + i * w.K : nullptr, p, l, df.data() + i * G,                    \
                     mp ? mp + i * G : nullptr, sxg.data() + r * G);                                             \
      }                                                                                                          \
    }                                                                                                            \
  }

SCRATCHLM_QTILE(tile_avx2, QAVX2_FN, micro_avx2)

// Few rows of float x (M <= 2): R weight rows against x row r with the codes turned into floats in registers and
// FMAs (no rounding of x). The per-group terms are factored out: sum_k x_k w_k = sum_g [d_g sum x_k q_k + m_g sum x_k],
// with x's group sums `xg` taken once per call (the min, or -8 d, costs one multiply-add per group).
template <int R>
QAVX2_FN inline void micro_reg(const float* x, const QMat& w, float* y, int64_t n, int64_t r, const float* xg,
                               const char* pf, int64_t pf_lines) {
  const int64_t K = w.K, G = w.G;
  const float* xr = x + r * K;
  __m256 total[R];
  float off[R];
  for (int i = 0; i < R; ++i) total[i] = _mm256_setzero_ps(), off[i] = 0.f;
  const int64_t steps = (K + kBlock - 1) / kBlock, per_step = (pf_lines + steps - 1) / std::max<int64_t>(1, steps);
  for (int64_t g = 0; g < G; ++g) {
    const int64_t k0 = g * w.gs, k1 = std::min(K, k0 + w.gs);
    __m256 acc[R][2];
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    float tail[R] = {};
    int64_t k = k0;
    for (; k + kBlock <= k1; k += kBlock) {
      for (int64_t p = 0; p < per_step && pf_lines > 0; ++p, pf += 64, --pf_lines) _mm_prefetch(pf, _MM_HINT_T0);
      const __m256 x0 = _mm256_loadu_ps(xr + k), x1 = _mm256_loadu_ps(xr + k + 8);
      const __m256 x2 = _mm256_loadu_ps(xr + k + 16), x3 = _mm256_loadu_ps(xr + k + 24);
      for (int i = 0; i < R; ++i) {
        __m256i c0, c1, c2, c3;  // 4 x 8 codes as int32
        if (w.kind == Kind::kInt4) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.q4 + (n + i) * (K / 2) + k / 2));
          const __m128i mask = _mm_set1_epi8(0x0F);
          const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
          c0 = _mm256_cvtepu8_epi32(lo), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8));
          c2 = _mm256_cvtepu8_epi32(hi), c3 = _mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8));
        } else {
          const int8_t* q = w.q8 + (n + i) * K + k;
          c0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q)));
          c1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8)));
          c2 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 16)));
          c3 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 24)));
        }
        acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c0), x0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c1), x1, acc[i][1]);
        acc[i][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c2), x2, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(c3), x3, acc[i][1]);
      }
    }
    for (; k < k1; ++k)  // per-channel int8 rows with K % 32 != 0
      for (int i = 0; i < R; ++i) tail[i] += xr[k] * static_cast<float>(w.q8[(n + i) * K + k]);
    for (int i = 0; i < R; ++i) {
      const __m256 a = _mm256_add_ps(acc[i][0], acc[i][1]);
      if (w.kind == Kind::kInt4) {
        const float d = _cvtsh_ss(w.d[(n + i) * G + g]);
        total[i] = _mm256_fmadd_ps(a, _mm256_set1_ps(d), total[i]);
        off[i] += (w.m ? _cvtsh_ss(w.m[(n + i) * G + g]) : -8.f * d) * xg[r * G + g];
      } else {
        const float s = w.s[(n + i) * G + g];
        total[i] = _mm256_fmadd_ps(a, _mm256_set1_ps(s), total[i]);
        off[i] += s * tail[i];
      }
    }
  }
  for (int i = 0; i < R; ++i) y[r * w.N + n + i] = scratchlm_simd::hsum256(total[i]) + off[i];
}

QAVX2_FN inline void tile_reg(const float* x, const QMat& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  std::vector<float> xg(M * w.G, 0.f);  // x's group sums (M, G)
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < w.K; ++k) xg[r * w.G + k / w.gs] += x[r * w.K + k];
  const int64_t row_bytes = w.kind == Kind::kInt4 ? w.K / 2 : w.K;
  const char* base = w.kind == Kind::kInt4 ? reinterpret_cast<const char*>(w.q4) : reinterpret_cast<const char*>(w.q8);
  for (int64_t n = n0; n < n1; n += kTile) {
    const int64_t R = std::min(kTile, n1 - n), ahead = n + 2 * kTile;
    const int64_t lines = ahead + kTile <= n1 ? kTile * row_bytes / 64 : 0;
    for (int64_t r = 0; r < M; ++r) {
      const char* pf = r == 0 ? base + ahead * row_bytes : nullptr;
      if (R == 4) micro_reg<4>(x, w, y, n, r, xg.data(), pf, r == 0 ? lines : 0);
      else for (int64_t i = 0; i < R; ++i) micro_reg<1>(x, w, y, n + i, r, xg.data(), nullptr, 0);
    }
  }
}

// Rows n .. n + R - 1 of W dequantized to float32 into out (R, K) in registers: exactly s q, d q + m, d (q - 8)
// (a product, then a sum: the values of dequantize_rows and of the Python reference).
QAVX2_FN inline void dequantize_tile_avx2(const QMat& w, int64_t n, int64_t R, float* out) {
  const int64_t K = w.K;
  for (int64_t i = 0; i < R; ++i) {
    float* o = out + i * K;
    for (int64_t g = 0; g < w.G; ++g) {
      const int64_t k0 = g * w.gs, k1 = std::min(K, k0 + w.gs);
      if (w.kind == Kind::kInt8) {
        const __m256 sv = _mm256_set1_ps(w.s[(n + i) * w.G + g]);
        const int8_t* q = w.q8 + (n + i) * K;
        int64_t k = k0;
        for (; k + 8 <= k1; k += 8) {
          const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k));
          _mm256_storeu_ps(o + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), sv));
        }
        for (; k < k1; ++k) o[k] = w.s[(n + i) * w.G + g] * static_cast<float>(q[k]);
      } else {
        const float df = _cvtsh_ss(w.d[(n + i) * w.G + g]);
        const __m256 d = _mm256_set1_ps(df);
        const __m256 m = _mm256_set1_ps(w.m ? _cvtsh_ss(w.m[(n + i) * w.G + g]) : 0.f);
        const __m256 eight = _mm256_set1_ps(8.f);
        for (int64_t c = k0; c < k1; c += kBlock) {
          const __m256i codes = unpack_nibbles(w.q4 + (n + i) * (K / 2) + c / 2);
          const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
          const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
          for (int j = 0; j < 4; ++j) {
            const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[j]));
            _mm256_storeu_ps(o + c + 8 * j, w.m ? _mm256_add_ps(_mm256_mul_ps(d, q), m)
                                                : _mm256_mul_ps(d, _mm256_sub_ps(q, eight)));
          }
        }
      }
    }
  }
}

// Rows n0 .. n1 of W against M float rows of x: each 4-row tile is dequantized into an L1 buffer and multiplied
// by the skinny GEMM's float micro kernels (4 x 2 / 4 x 3 register tiles of FMAs), while the packed rows two
// tiles ahead are prefetched. For M > 1 this beats the integer kernel (measured: docs/quantization.md).
QAVX2_FN inline void tile_fma(const float* x, const QMat& w, float* y, int64_t M, int64_t n0, int64_t n1) {
  std::vector<float> buf(kTile * w.K);
  const int64_t row_bytes = w.kind == Kind::kInt4 ? w.K / 2 : w.K;
  const char* base = w.kind == Kind::kInt4 ? reinterpret_cast<const char*>(w.q4) : reinterpret_cast<const char*>(w.q8);
  for (int64_t n = n0; n < n1; n += kTile) {
    const int64_t R = std::min(kTile, n1 - n), ahead = n + 2 * kTile;
    if (ahead + kTile <= n1)
      for (int64_t b = 0; b < kTile * row_bytes; b += 64) _mm_prefetch(base + ahead * row_bytes + b, _MM_HINT_T0);
    dequantize_tile_avx2(w, n, R, buf.data());
    if (R == 4) scratchlm_gemm::rows_avx2<4>(x, buf.data(), y + n, M, w.K, w.N, 0, 4);
    else for (int64_t i = 0; i < R; ++i) scratchlm_gemm::rows_avx2<1>(x, buf.data() + i * w.K, y + n + i, M, w.K, w.N, 0, 1);
  }
}
SCRATCHLM_QTILE(tile_vnni, QVNNI_FN, micro_vnni)

// ------------------------------------------------------------------ 8-row interleaved integer kernel (int4)
// The batch-1 kernel of the packed 4-bit formats (path 6, AVX512-VNNI on 256-bit registers). Eight weight rows
// are read block by block and transposed in registers so that each 32-bit lane holds one row: lane r of chunk c
// has bytes 4c .. 4c + 3 of row r's 16 packed bytes (weights 4c .. 4c + 3 in the low nibbles, 16 + 4c .. in the
// high ones). One vpdpbusd against x's 4 bytes broadcast then adds 4 products to each of the 8 rows, so a block
// costs 8 dot instructions for 8 rows and no horizontal sums: the per-row-block float work (int32 -> float,
// times d dx, the min term) happens once per 8 rows instead of once per row. High nibbles are masked (0xF0, i.e.
// 16 q) rather than shifted and their sum divided by 16 exactly. Arithmetic per block, as the other integer
// paths: y_n = sum_g d_ng sum_{b in g} dx_b sum_k q_k xq_k + sum_g m_ng sum_{b in g} dx_b sum(xq_b); the integer
// sums are exact, so only the float order differs from paths 1 and 2.
// The scales of a tile (8 rows x G fp16) are transposed the same way (8 x 8 epi16 transposes) into float
// (G, 8) buffers. Up to 8 rows of x share each transposed block (the unpacking is paid once per x chunk).
QAVX2_FN inline void scales_t8(const uint16_t* s, int64_t G, int64_t n, float* out) {
  int64_t g0 = 0;
  for (; g0 + 8 <= G; g0 += 8) {
    __m128i a[8];
    for (int r = 0; r < 8; ++r) a[r] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + (n + r) * G + g0));
    __m128i t[8], u[8];
    for (int p = 0; p < 4; ++p) {
      t[2 * p] = _mm_unpacklo_epi16(a[2 * p], a[2 * p + 1]);
      t[2 * p + 1] = _mm_unpackhi_epi16(a[2 * p], a[2 * p + 1]);
    }
    // t0: rows 0,1 groups 0-3; t1: rows 0,1 groups 4-7; t2, t3: rows 2,3; t4, t5: rows 4,5; t6, t7: rows 6,7
    u[0] = _mm_unpacklo_epi32(t[0], t[2]), u[1] = _mm_unpackhi_epi32(t[0], t[2]);  // rows 0-3, groups 0,1 / 2,3
    u[2] = _mm_unpacklo_epi32(t[1], t[3]), u[3] = _mm_unpackhi_epi32(t[1], t[3]);  // groups 4,5 / 6,7
    u[4] = _mm_unpacklo_epi32(t[4], t[6]), u[5] = _mm_unpackhi_epi32(t[4], t[6]);  // rows 4-7
    u[6] = _mm_unpacklo_epi32(t[5], t[7]), u[7] = _mm_unpackhi_epi32(t[5], t[7]);
    for (int j = 0; j < 4; ++j) {
      _mm256_storeu_ps(out + (g0 + 2 * j) * 8, _mm256_cvtph_ps(_mm_unpacklo_epi64(u[j], u[4 + j])));
      _mm256_storeu_ps(out + (g0 + 2 * j + 1) * 8, _mm256_cvtph_ps(_mm_unpackhi_epi64(u[j], u[4 + j])));
    }
  }
  for (; g0 < G; ++g0)
    for (int r = 0; r < 8; ++r) out[g0 * 8 + r] = _cvtsh_ss(s[(n + r) * G + g0]);
}

// MR rows of x (r0 .. r0 + MR - 1) against weight rows n .. n + 7, into y. dT, mT: the tile's scales and mins
// (or -8 d) as (G, 8) floats; sxg: (M, G) per-group sums dx_b sum(xq_b).
#define SCRATCHLM_T8_INT4(ROWS, TILE, ATTR, DOT, VNNI, MAXR)                                                                  \
template <int MR>                                                                                                             \
ATTR inline void ROWS(const QAct& a, const QMat& w, float* y, int64_t n, int64_t r0, const float* dT,                         \
                                  const float* mT, const float* sxg, const char* pf) {                                        \
  const int64_t K = w.K, nb = K / kBlock, Kp = a.nb * kBlock, bpg = w.gs / kBlock, G = w.G, rb = K / 2;                       \
  const uint8_t* q = w.q4 + n * rb;                                                                                           \
  const __m256i lo_mask = _mm256_set1_epi8(0x0F), hi_mask = _mm256_set1_epi8(static_cast<char>(0xF0));                        \
  __m256 acc[MR];                                                                                                             \
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();                                                                  \
  for (int64_t g = 0, b = 0; g < G; ++g) {                                                                                    \
    __m256 accg[MR];                                                                                                          \
    for (int r = 0; r < MR; ++r) accg[r] = _mm256_setzero_ps();                                                               \
    for (int64_t b1 = std::min(nb, b + bpg); b < b1; ++b) {                                                                   \
      _mm_prefetch(pf + 128 * b, _MM_HINT_T0);                                                                                \
      _mm_prefetch(pf + 128 * b + 64, _MM_HINT_T0);                                                                           \
      __m256i Y[4];                                                                                                           \
      for (int r = 0; r < 4; ++r)                                                                                             \
        Y[r] = _mm256_inserti128_si256(                                                                                       \
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * rb + b * 16))),                   \
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (r + 4) * rb + b * 16)), 1);                                 \
      const __m256i p0 = _mm256_unpacklo_epi32(Y[0], Y[1]), p1 = _mm256_unpackhi_epi32(Y[0], Y[1]);                           \
      const __m256i p2 = _mm256_unpacklo_epi32(Y[2], Y[3]), p3 = _mm256_unpackhi_epi32(Y[2], Y[3]);                           \
      const __m256i C[4] = {_mm256_unpacklo_epi64(p0, p2), _mm256_unpackhi_epi64(p0, p2),                                     \
                            _mm256_unpacklo_epi64(p1, p3), _mm256_unpackhi_epi64(p1, p3)};  /* chunk c, rows 0..7 */          \
      __m256i L[4], H[4];                                                                                                     \
      for (int c = 0; c < 4; ++c) { /* VNNI: high nibbles masked (16 q); maddubs would saturate on those */                   \
        L[c] = _mm256_and_si256(C[c], lo_mask);                                                                               \
        H[c] = VNNI ? _mm256_and_si256(C[c], hi_mask) : _mm256_and_si256(_mm256_srli_epi16(C[c], 4), lo_mask);                \
      }                                                                                                                       \
      for (int r = 0; r < MR; ++r) {                                                                                          \
        const int8_t* xb = a.q.data() + (r0 + r) * Kp + b * kBlock;                                                           \
        __m256i il = _mm256_setzero_si256(), ih = _mm256_setzero_si256();                                                     \
        for (int c = 0; c < 4; ++c) {                                                                                         \
          int32_t xl, xh;                                                                                                     \
          std::memcpy(&xl, xb + 4 * c, 4);                                                                                    \
          std::memcpy(&xh, xb + 16 + 4 * c, 4);                                                                               \
          il = DOT(il, L[c], _mm256_set1_epi32(xl));                                                                          \
          ih = DOT(ih, H[c], _mm256_set1_epi32(xh));                                                                          \
        }                                                                                                                     \
        const __m256i is = _mm256_add_epi32(il, VNNI ? _mm256_srai_epi32(ih, 4) : ih); /* 16 sum(hi q x) exact */             \
        accg[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_broadcast_ss(a.dx.data() + (r0 + r) * a.nb + b),             \
                                  accg[r]);                                                                                   \
      }                                                                                                                       \
    }                                                                                                                         \
    const __m256 dv = _mm256_loadu_ps(dT + g * 8), mv = _mm256_loadu_ps(mT + g * 8);                                          \
    for (int r = 0; r < MR; ++r) {                                                                                            \
      acc[r] = _mm256_fmadd_ps(accg[r], dv, acc[r]);                                                                          \
      acc[r] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sxg + (r0 + r) * G + g), acc[r]);                                      \
    }                                                                                                                         \
  }                                                                                                                           \
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + (r0 + r) * w.N + n, acc[r]);                                              \
}                                                                                                                             \
                                                                                                                              \
/* Weight rows n0 .. n1 (n1 - n0 a multiple of 8) against every row of x. */                                                  \
ATTR inline void TILE(const QAct& a, const QMat& w, float* y, int64_t n0, int64_t n1) {                                       \
  const int64_t G = w.G, bpg = w.gs / kBlock, rb = w.K / 2;                                                                   \
  std::vector<float> dT(G * 8), mT(G * 8), sxg(a.M * G, 0.f);                                                                 \
  for (int64_t r = 0; r < a.M; ++r)                                                                                           \
    for (int64_t b = 0; b < a.nb; ++b) sxg[r * G + b / bpg] += a.sx[r * a.nb + b];                                            \
  for (int64_t n = n0; n < n1; n += 8) {                                                                                      \
    scales_t8(w.d, G, n, dT.data());                                                                                          \
    if (w.m) {                                                                                                                \
      scales_t8(w.m, G, n, mT.data());                                                                                        \
    } else {                                                                                                                  \
      for (int64_t i = 0; i < G * 8; ++i) mT[i] = -8.f * dT[i];                                                               \
    }                                                                                                                         \
    /* prefetch the tile two ahead (8 rows = K / 16 lines, two per block; a prefetch past the end cannot fault) */            \
    const char* pf = reinterpret_cast<const char*>(w.q4) + (n + 16) * rb;                                                     \
    int64_t r = 0;                                                                                                            \
    for (; MAXR >= 8 && r + 8 <= a.M; r += 8) ROWS<MAXR>(a, w, y, n, r, dT.data(), mT.data(), sxg.data(), pf);                \
    for (; MAXR >= 4 && a.M - r >= 4; r += 4) ROWS<(MAXR >= 4 ? 4 : 1)>(a, w, y, n, r, dT.data(), mT.data(), sxg.data(), pf); \
    for (; a.M - r >= 2; r += 2) ROWS<2>(a, w, y, n, r, dT.data(), mT.data(), sxg.data(), pf);                                \
    if (a.M - r >= 1) ROWS<1>(a, w, y, n, r, dT.data(), mT.data(), sxg.data(), pf);                                           \
  }                                                                                                                           \
}

QAVX2_FN inline __m256i dot_acc_avx2(__m256i acc, __m256i u, __m256i s) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
QVNNI_FN inline __m256i dot_acc_vnni(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
SCRATCHLM_T8_INT4(t8_int4_rows, tile_t8_int4, QVNNI_FN, dot_acc_vnni, true, 8)
SCRATCHLM_T8_INT4(t8_int4_rows_avx2, tile_t8_int4_avx2, QAVX2_FN, dot_acc_avx2, false, 2)  // 16 registers

// ------------------------------------------------------------------ 8-row integer kernel (int8)
// The batch-1 kernel of the 8-bit formats (path 6 for int8): eight weight rows per tile, each block's 8 rows
// meet x's block with the sign trick (|w| unsigned times x with w's sign, vpdpbusd) and the 8 int32 vectors are
// reduced to one vector of 8 row sums (hadds and a lane swap), so the int32 -> float conversion and the scale
// multiply-adds run once per 8 row-blocks, not once per row-block. The scales of a tile are transposed to
// (G, 8) floats. The integer sums are exact: only the float order differs from paths 1 and 2.
QVNNI_FN inline void fscales_t8(const float* s, int64_t G, int64_t n, float* out) {
  int64_t g0 = 0;
  for (; g0 + 8 <= G; g0 += 8) {  // 8 x 8 float transpose
    __m256 r[8], t[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(s + (n + i) * G + g0);
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    __m256 u[8];
    u[0] = _mm256_shuffle_ps(t[0], t[2], 0x44), u[1] = _mm256_shuffle_ps(t[0], t[2], 0xEE);
    u[2] = _mm256_shuffle_ps(t[1], t[3], 0x44), u[3] = _mm256_shuffle_ps(t[1], t[3], 0xEE);
    u[4] = _mm256_shuffle_ps(t[4], t[6], 0x44), u[5] = _mm256_shuffle_ps(t[4], t[6], 0xEE);
    u[6] = _mm256_shuffle_ps(t[5], t[7], 0x44), u[7] = _mm256_shuffle_ps(t[5], t[7], 0xEE);
    for (int j = 0; j < 4; ++j) {  // u[j]: rows 0-3 (lanes 0/1: groups j, j + 4); u[j + 4]: rows 4-7
      _mm256_storeu_ps(out + (g0 + j) * 8, _mm256_permute2f128_ps(u[j], u[j + 4], 0x20));
      _mm256_storeu_ps(out + (g0 + j + 4) * 8, _mm256_permute2f128_ps(u[j], u[j + 4], 0x31));
    }
  }
  for (; g0 < G; ++g0)
    for (int r = 0; r < 8; ++r) out[g0 * 8 + r] = s[(n + r) * G + g0];
}

template <int MR>
QVNNI_FN inline void t8_int8_rows(const QAct& a, const QMat& w, float* y, int64_t n, int64_t r0, const float* sT,
                                  const char* pf) {
  const int64_t K = w.K, nb = K / kBlock, Kp = a.nb * kBlock, bpg = std::max<int64_t>(1, w.gs / kBlock), G = w.G;
  const int8_t* q = w.q8 + n * K;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0, b = 0; g < G; ++g) {
    __m256 accg[MR];
    for (int r = 0; r < MR; ++r) accg[r] = _mm256_setzero_ps();
    for (int64_t b1 = std::min(nb, b + bpg); b < b1; ++b) {
      for (int l = 0; l < 4; ++l) _mm_prefetch(pf + 256 * b + 64 * l, _MM_HINT_T0);
      __m256i W[8], A[8];
      for (int i = 0; i < 8; ++i) {
        W[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * K + b * kBlock));
        A[i] = _mm256_abs_epi8(W[i]);
      }
      for (int r = 0; r < MR; ++r) {
        const __m256i X = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q.data() + (r0 + r) * Kp + b * kBlock));
        __m256i P[8];
        for (int i = 0; i < 8; ++i) P[i] = _mm256_dpbusd_epi32(_mm256_setzero_si256(), A[i], _mm256_sign_epi8(X, W[i]));
        const __m256i h01 = _mm256_hadd_epi32(P[0], P[1]), h23 = _mm256_hadd_epi32(P[2], P[3]);
        const __m256i h45 = _mm256_hadd_epi32(P[4], P[5]), h67 = _mm256_hadd_epi32(P[6], P[7]);
        const __m256i lo = _mm256_hadd_epi32(h01, h23), hi = _mm256_hadd_epi32(h45, h67);
        const __m256i S = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
        accg[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(S), _mm256_broadcast_ss(a.dx.data() + (r0 + r) * a.nb + b), accg[r]);
      }
    }
    const __m256 sv = _mm256_loadu_ps(sT + g * 8);
    for (int r = 0; r < MR; ++r) acc[r] = _mm256_fmadd_ps(accg[r], sv, acc[r]);
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + (r0 + r) * w.N + n, acc[r]);
}

// Weight rows n0 .. n1 (n1 - n0 a multiple of 8; K a multiple of 32) against every row of x.
QVNNI_FN inline void tile_t8_int8(const QAct& a, const QMat& w, float* y, int64_t n0, int64_t n1) {
  std::vector<float> sT(w.G * 8);
  for (int64_t n = n0; n < n1; n += 8) {
    fscales_t8(w.s, w.G, n, sT.data());
    const char* pf = reinterpret_cast<const char*>(w.q8) + (n + 16) * w.K;  // the tile two ahead (cannot fault)
    int64_t r = 0;
    for (; r + 4 <= a.M; r += 4) t8_int8_rows<4>(a, w, y, n, r, sT.data(), pf);
    if (a.M - r >= 2) t8_int8_rows<2>(a, w, y, n, r, sT.data(), pf), r += 2;
    if (a.M - r >= 1) t8_int8_rows<1>(a, w, y, n, r, sT.data(), pf);
  }
}

// ------------------------------------------------------------------ prefill GEMM over a weight panel (> 64 rows)
// Paths 8 (AVX512-VNNI: int4 and int8) and 9 (AVX2: int4), what prefill chunks (more than kMaxRows rows of x) run
// by default with integer activations, instead of dequantizing the whole weight to float32 per call. The output
// columns are split into tiles of 16 weight rows; each tile is unpacked ONCE per call into an L1 panel (two
// halves of 8 rows, per 32-block 8 chunks of 8 int32 lanes: lane i of chunk j holds weights 4j .. 4j + 3 of row
// i, as bytes; int4 nibbles unpacked to 0 .. 15, the same in-register transposes as the 8-row kernels) and then
// meets every row of x, MR rows at a time: per chunk two panel loads and one 4-byte broadcast of x per row feed
// two dot instructions (vpdpbusd: 4 products into each of 8 lanes; AVX2: maddubs into int16, 16 products per
// lane at most 16 * 15 * 127 < 2^15, then one madd per block). The float work per block and row is the 8-row
// kernels' (int32 -> float, times dx, per group times d plus m sum(xq)), in the same order, and the integer sums
// are exact, so the result equals path 6 / 7 row by row. int8 weights meet x + 128 as unsigned bytes (x ^ 0x80)
// and the exact correction 128 sum_k q_k per row and block is subtracted from the int32 sum (VNNI only: maddubs
// pairs of 255 * 127 would saturate). Ragged N: the last tile is zero-padded in the panel and stored through a
// buffer. Needs K % 32 == 0 and groups of whole blocks (supported() and the callers' checks).
constexpr int64_t kPanelRows = 16;

#define SCRATCHLM_PANEL_ROWS(NAME, ATTR, VNNI)                                                                   \
template <int MR, bool I8>                                                                                       \
ATTR inline void NAME(const int8_t* xq, int64_t Kp, const float* dx, int64_t nbx, const float* sxg,             \
                      const uint8_t* panel, const int32_t* corr, const float* dT, const float* mT,               \
                      int64_t nb, int64_t bpg, int64_t G, float* y, int64_t ldy) {                               \
  const int64_t half = nb * 8 * 32; /* bytes of one 8-row half of the panel */                                   \
  __m256 acc[MR][2];                                                                                             \
  for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                                      \
  for (int64_t g = 0, b = 0; g < G; ++g) {                                                                       \
    __m256 accg[MR][2];                                                                                          \
    for (int r = 0; r < MR; ++r) accg[r][0] = accg[r][1] = _mm256_setzero_ps();                                  \
    for (int64_t b1 = std::min(nb, b + bpg); b < b1; ++b) {                                                      \
      const uint8_t* p0 = panel + b * 256;                                                                       \
      __m256i is[MR][2];                                                                                         \
      for (int r = 0; r < MR; ++r) is[r][0] = is[r][1] = _mm256_setzero_si256();                                \
      for (int j = 0; j < 8; ++j) {                                                                              \
        const __m256i W0 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p0 + 32 * j));                     \
        const __m256i W1 = _mm256_load_si256(reinterpret_cast<const __m256i*>(p0 + half + 32 * j));              \
        for (int r = 0; r < MR; ++r) {                                                                           \
          int32_t xv;                                                                                            \
          std::memcpy(&xv, xq + r * Kp + b * kBlock + 4 * j, 4);                                                 \
          const __m256i X = _mm256_set1_epi32(xv);                                                               \
          if (VNNI) {                                                                                            \
            is[r][0] = I8 ? _mm256_dpbusd_epi32(is[r][0], X, W0) : _mm256_dpbusd_epi32(is[r][0], W0, X);         \
            is[r][1] = I8 ? _mm256_dpbusd_epi32(is[r][1], X, W1) : _mm256_dpbusd_epi32(is[r][1], W1, X);         \
          } else { /* int16 sums (int4 only), widened once per block below */                                    \
            is[r][0] = _mm256_add_epi16(is[r][0], _mm256_maddubs_epi16(W0, X));                                  \
            is[r][1] = _mm256_add_epi16(is[r][1], _mm256_maddubs_epi16(W1, X));                                  \
          }                                                                                                      \
        }                                                                                                        \
      }                                                                                                          \
      for (int r = 0; r < MR; ++r) {                                                                             \
        const __m256 dxv = _mm256_broadcast_ss(dx + r * nbx + b);                                                \
        for (int h = 0; h < 2; ++h) {                                                                            \
          __m256i s = is[r][h];                                                                                  \
          if (!VNNI) s = _mm256_madd_epi16(s, _mm256_set1_epi16(1));                                             \
          if (I8) s = _mm256_sub_epi32(s, _mm256_load_si256(reinterpret_cast<const __m256i*>(corr + (2 * b + h) * 8))); \
          accg[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), dxv, accg[r][h]);                                  \
        }                                                                                                        \
      }                                                                                                          \
    }                                                                                                            \
    for (int h = 0; h < 2; ++h) {                                                                                \
      const __m256 dv = _mm256_loadu_ps(dT + (h * G + g) * 8);                                                   \
      for (int r = 0; r < MR; ++r) acc[r][h] = _mm256_fmadd_ps(accg[r][h], dv, acc[r][h]);                       \
      if (!I8) {                                                                                                 \
        const __m256 mv = _mm256_loadu_ps(mT + (h * G + g) * 8);                                                 \
        for (int r = 0; r < MR; ++r) acc[r][h] = _mm256_fmadd_ps(mv, _mm256_broadcast_ss(sxg + r * G + g), acc[r][h]); \
      }                                                                                                          \
    }                                                                                                            \
  }                                                                                                              \
  for (int r = 0; r < MR; ++r) {                                                                                 \
    _mm256_storeu_ps(y + r * ldy, acc[r][0]);                                                                    \
    _mm256_storeu_ps(y + r * ldy + 8, acc[r][1]);                                                                \
  }                                                                                                              \
}
SCRATCHLM_PANEL_ROWS(panel_rows_vnni, QVNNI_FN, true)
SCRATCHLM_PANEL_ROWS(panel_rows_avx2, QAVX2_FN, false)

// The panel of weight rows n .. n + 15 of an int4 matrix (rows >= N zero), its scales (dT) and mins or -8 d (mT)
// as (2, G, 8) floats.
QAVX2_FN inline void int4_panel(const QMat& w, int64_t n, uint8_t* panel, float* dT, float* mT,
                                std::vector<uint8_t>& pad, std::vector<uint16_t>& spad) {
  const int64_t K = w.K, nb = K / kBlock, rb = K / 2, G = w.G, valid = std::min(kPanelRows, w.N - n);
  const uint8_t* q = w.q4 + n * rb;
  const uint16_t *d = w.d + n * G, *m = w.m ? w.m + n * G : nullptr;
  if (valid < kPanelRows) {  // zero-padded copies of the ragged end
    pad.assign(kPanelRows * rb, 0), spad.assign(2 * kPanelRows * G, 0);
    std::memcpy(pad.data(), q, valid * rb);
    std::memcpy(spad.data(), d, valid * G * 2);
    if (m) std::memcpy(spad.data() + kPanelRows * G, m, valid * G * 2);
    q = pad.data(), d = spad.data(), m = m ? spad.data() + kPanelRows * G : nullptr;
  }
  const __m256i lo_mask = _mm256_set1_epi8(0x0F);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* qh = q + 8 * h * rb;
    for (int64_t b = 0; b < nb; ++b) {
      __m256i Y[4];
      for (int r = 0; r < 4; ++r)
        Y[r] = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + r * rb + b * 16))),
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + (r + 4) * rb + b * 16)), 1);
      const __m256i p0 = _mm256_unpacklo_epi32(Y[0], Y[1]), p1 = _mm256_unpackhi_epi32(Y[0], Y[1]);
      const __m256i p2 = _mm256_unpacklo_epi32(Y[2], Y[3]), p3 = _mm256_unpackhi_epi32(Y[2], Y[3]);
      const __m256i C[4] = {_mm256_unpacklo_epi64(p0, p2), _mm256_unpackhi_epi64(p0, p2),
                            _mm256_unpacklo_epi64(p1, p3), _mm256_unpackhi_epi64(p1, p3)};
      uint8_t* out = panel + h * nb * 256 + b * 256;
      for (int c = 0; c < 4; ++c) {  // chunk c: weights 4c .. 4c + 3 (low nibbles); chunk 4 + c: 16 + 4c .. (high)
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * c), _mm256_and_si256(C[c], lo_mask));
        _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * (4 + c)),
                           _mm256_and_si256(_mm256_srli_epi16(C[c], 4), lo_mask));
      }
    }
    scales_t8(d, G, 8 * h, dT + h * G * 8);
    if (m) {
      scales_t8(m, G, 8 * h, mT + h * G * 8);
    } else {
      for (int64_t i = 0; i < G * 8; ++i) mT[h * G * 8 + i] = -8.f * dT[h * G * 8 + i];
    }
  }
}

// The panel of weight rows n .. n + 15 of an int8 matrix (rows >= N zero), the corrections 128 sum(q) per block
// (2 * nb, 8) and the scales as (2, G, 8) floats.
QVNNI_FN inline void int8_panel(const QMat& w, int64_t n, uint8_t* panel, int32_t* corr, float* sT,
                                std::vector<uint8_t>& pad, std::vector<float>& spad) {
  const int64_t K = w.K, nb = K / kBlock, G = w.G, valid = std::min(kPanelRows, w.N - n);
  const int8_t* q = w.q8 + n * K;
  const float* s = w.s + n * G;
  if (valid < kPanelRows) {
    pad.assign(kPanelRows * K, 0), spad.assign(kPanelRows * G, 0.f);
    std::memcpy(pad.data(), q, valid * K);
    std::memcpy(spad.data(), s, valid * G * sizeof(float));
    q = reinterpret_cast<const int8_t*>(pad.data()), s = spad.data();
  }
  for (int h = 0; h < 2; ++h) {
    // an 8 x (K / 4) transpose of int32 words (as floats: moves only, bit patterns kept): chunk j of block b is
    // word 8b + j of each row
    fscales_t8(reinterpret_cast<const float*>(q), K / 4, 8 * h, reinterpret_cast<float*>(panel + h * nb * 256));
    fscales_t8(s, G, 8 * h, sT + h * G * 8);
    for (int i = 0; i < 8; ++i) {
      const int8_t* row = q + (8 * h + i) * K;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t sum = 0;
        for (int k = 0; k < kBlock; ++k) sum += row[b * kBlock + k];
        corr[(2 * b + h) * 8 + i] = 128 * sum;
      }
    }
  }
}

// y (M, N) = the quantized rows `a` times W^T through the panels (vnni: path 8, else path 9, int4 only).
inline void qgemm_panel(const QAct& a, const QMat& w, float* y, bool vnni) {
  const int64_t M = a.M, K = w.K, nb = K / kBlock, G = w.G, bpg = w.gs / kBlock, Kp = a.nb * kBlock;
  const bool i8 = w.kind == Kind::kInt8;
  std::vector<float> sxg(i8 ? 0 : M * G, 0.f);  // (M, G): per group sum_b dx_b sum(xq_b)
  for (int64_t r = 0; r < M && !i8; ++r)
    for (int64_t b = 0; b < a.nb; ++b) sxg[r * G + b / bpg] += a.sx[r * a.nb + b];
  std::vector<int8_t> xu;  // int8 weights: x + 128 as unsigned bytes
  if (i8) {
    xu.resize(a.q.size());
    for (size_t i = 0; i < xu.size(); ++i) xu[i] = static_cast<int8_t>(a.q[i] ^ 0x80);
  }
  const int8_t* xs = i8 ? xu.data() : a.q.data();
  const int64_t tiles = (w.N + kPanelRows - 1) / kPanelRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    const int64_t pbytes = 2 * nb * 256;
    std::vector<uint8_t> store(pbytes + 64), pad;
    uint8_t* panel = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t(63));
    std::vector<int32_t> cstore(i8 ? 2 * nb * 8 + 16 : 0);
    int32_t* corr = i8 ? reinterpret_cast<int32_t*>((reinterpret_cast<uintptr_t>(cstore.data()) + 63) & ~uintptr_t(63))
                       : nullptr;
    std::vector<float> dT(2 * G * 8), mT(2 * G * 8), ybuf;
    std::vector<uint16_t> spad;
    std::vector<float> fpad;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = t * kPanelRows, valid = std::min(kPanelRows, w.N - n);
      if (i8) int8_panel(w, n, panel, corr, dT.data(), pad, fpad);
      else int4_panel(w, n, panel, dT.data(), mT.data(), pad, spad);
      float* yt = y + n;
      int64_t ldy = w.N;
      if (valid < kPanelRows) ybuf.assign(M * kPanelRows, 0.f), yt = ybuf.data(), ldy = kPanelRows;
      auto run = [&](auto mr, int64_t r) {
        constexpr int R = decltype(mr)::value;
        const float* sx = i8 ? nullptr : sxg.data() + r * G;
        if (vnni) {
          if (i8) panel_rows_vnni<R, true>(xs + r * Kp, Kp, a.dx.data() + r * a.nb, a.nb, sx, panel, corr,
                                             dT.data(), nullptr, nb, bpg, G, yt + r * ldy, ldy);
          else panel_rows_vnni<R, false>(xs + r * Kp, Kp, a.dx.data() + r * a.nb, a.nb, sx, panel, nullptr,
                                           dT.data(), mT.data(), nb, bpg, G, yt + r * ldy, ldy);
        } else {
          panel_rows_avx2<(R > 2 ? 2 : R), false>(xs + r * Kp, Kp, a.dx.data() + r * a.nb, a.nb, sx, panel,
                                                     nullptr, dT.data(), mT.data(), nb, bpg, G, yt + r * ldy, ldy);
        }
      };
      int64_t r = 0;
      if (vnni)
        for (; r + 4 <= M; r += 4) run(std::integral_constant<int, 4>{}, r);
      for (; r + 2 <= M; r += 2) run(std::integral_constant<int, 2>{}, r);
      if (r < M) run(std::integral_constant<int, 1>{}, r);
      if (valid < kPanelRows)
        for (int64_t i = 0; i < M; ++i) std::memcpy(y + i * w.N + n, ybuf.data() + i * kPanelRows, valid * 4);
    }
  });
}

inline bool cpu_has_vnni() { return scratchlm_simd::cpu_has_avx512vnni(); }  // both honour $SCRATCHLM_ISA
inline bool cpu_has_avx2_f16c() { return scratchlm_simd::cpu_has_avx2(); }
#endif  // SCRATCHLM_X86

// Code paths: 0 scalar, 1 AVX2, 2 AVX512-VNNI (256-bit) integer kernels, 3 dequantize + FMA tiles (AVX2), 4 codes
// to floats in registers + FMA (AVX2), 6 the 8-row integer kernels (AVX512-VNNI, int4 and int8), 7 the 8-row int4
// kernel on AVX2 (maddubs + madd), 8 / 9 the prefill panel kernels (AVX512-VNNI int4 and int8 / AVX2 int4).
// `best_path` is what the CPU runs; tests force each.
inline int best_path() {
#ifdef SCRATCHLM_X86
  static const int p = cpu_has_vnni() ? 2 : cpu_has_avx2_f16c() ? 1 : 0;
  return p;
#else
  return 0;
#endif
}

inline void quantize_rows(const float* x, int64_t M, int64_t K, QAct& a, int path) {
#ifdef SCRATCHLM_X86
  if (path >= 1) return quantize_rows_avx2(x, M, K, a);
#endif
  (void)path;
  quantize_rows_scalar(x, M, K, a);
}

// Rows rows[0 .. n) of `all` into out, valid (a row's rounding does not depend on the other rows: these are the
// bits quantize_rows makes of those rows of x alone).
inline void gather_rows(const QAct& all, const int64_t* rows, int64_t n, QAct& out) {
  const int64_t nb = all.nb, Kp = nb * kBlock;
  out.M = n, out.K = all.K, out.nb = nb, out.valid = true;
  out.q.resize(n * Kp), out.dx.resize(n * nb), out.sx.resize(n * nb);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = rows[j];
    std::memcpy(out.q.data() + j * Kp, all.q.data() + r * Kp, Kp);
    std::memcpy(out.dx.data() + j * nb, all.dx.data() + r * nb, nb * sizeof(float));
    std::memcpy(out.sx.data() + j * nb, all.sx.data() + r * nb, nb * sizeof(float));
  }
}

// y (M, N) = x (M, K) dequant(W)^T with float x: path 3 dequantizes 4-row tiles to L1 for the FMA micro kernels,
// path 4 turns codes into floats in registers (needs AVX2; path 3 also K % 8 == 0).
inline void qgemm_fma(const float* x, int64_t M, const QMat& w, float* y, int path = 3) {
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, w.K * M) / kTile);
  at::parallel_for(0, (w.N + kTile - 1) / kTile, grain, [&](int64_t t0, int64_t t1) {
#ifdef SCRATCHLM_X86
    if (path == 4) return tile_reg(x, w, y, M, t0 * kTile, std::min(w.N, t1 * kTile));
    tile_fma(x, w, y, M, t0 * kTile, std::min(w.N, t1 * kTile));
#endif
  });
}

// y (M, N) = dequant(W) applied to the quantized rows in `a`; path <= best_path().
inline void qgemm(const QAct& a, const QMat& w, float* y, int path) {
#ifdef SCRATCHLM_X86
  if (path == 8 || path == 9) return qgemm_panel(a, w, y, path == 8);
#endif
  const int64_t tile = path >= 6 ? 8 : kTile;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, w.K * a.M) / tile);
  at::parallel_for(0, (w.N + tile - 1) / tile, grain, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * tile, n1 = std::min(w.N, t1 * tile);
#ifdef SCRATCHLM_X86
    if (path == 6) {  // whole 8-row tiles through the 8-row kernels, a ragged end through path 2
      const int64_t n8 = n0 + (n1 - n0) / 8 * 8;
      if (w.kind == Kind::kInt4) tile_t8_int4(a, w, y, n0, n8);
      else tile_t8_int8(a, w, y, n0, n8);
      if (n8 < n1) tile_vnni(a, w, y, n8, n1);
      return;
    }
    if (path == 7) {  // int4: the 8-row kernel on AVX2 (maddubs), a ragged end through path 1
      const int64_t n8 = n0 + (n1 - n0) / 8 * 8;
      tile_t8_int4_avx2(a, w, y, n0, n8);
      if (n8 < n1) tile_avx2(a, w, y, n8, n1);
      return;
    }
    if (path == 2) return tile_vnni(a, w, y, n0, n1);
    if (path == 1) return tile_avx2(a, w, y, n0, n1);
#endif
    tile_scalar(a, w, y, n0, n1);
  });
}

// Rows n0 .. n1 of W as float32 into out ((n1 - n0), K): exactly s q, d q + m, d (q - 8) in float32 (a product
// then a sum, never fused, so the values equal gguf.quants' and the Python reference's bit for bit).
inline void dequantize_rows(const QMat& w, int64_t n0, int64_t n1, float* out) {
  const int64_t K = w.K;
  for (int64_t n = n0; n < n1; ++n) {
    float* o = out + (n - n0) * K;
    for (int64_t g = 0; g < w.G; ++g) {
      const int64_t k0 = g * w.gs, k1 = std::min(K, k0 + w.gs);
      if (w.kind == Kind::kInt8) {
        const float s = w.s[n * w.G + g];
        const int8_t* q = w.q8 + n * K;
        for (int64_t k = k0; k < k1; ++k) o[k] = s * static_cast<float>(q[k]);
      } else {
        const float d = half_to_float(w.d[n * w.G + g]);
        const uint8_t* q = w.q4 + n * (K / 2);
        for (int64_t c = k0; c < k1; c += kBlock)
          for (int64_t i = 0; i < 16; ++i) {
            const float lo = static_cast<float>(q[c / 2 + i] & 0x0F), hi = static_cast<float>(q[c / 2 + i] >> 4);
            if (w.m) {
              const float m = half_to_float(w.m[n * w.G + g]);
              o[c + i] = d * lo + m, o[c + 16 + i] = d * hi + m;  // -std=c++17: no FMA contraction
            } else {
              o[c + i] = d * (lo - 8.f), o[c + 16 + i] = d * (hi - 8.f);
            }
          }
      }
    }
  }
}

}  // namespace scratchlm_qgemm
