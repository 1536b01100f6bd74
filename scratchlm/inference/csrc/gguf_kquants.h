// GGUF's K-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) and IQ4_XS: y (M, N) = x (M, K) @ W^T with W kept exactly as the
// file stores its 256-weight super-blocks (GMat, gguf_blocks.h), on the CPU. Block layouts and the dequantization
// math follow llama.cpp's ggml-common.h / ggml-quants.c (dequantize_row_q4_K etc.); the kernels are our own.
//
// Every type is read as   w_k = (D * s_g) * c_k - (Dm * m_g)   (float32, a product then a difference, as
// ggml's dequantize_row_* and gguf.quants compute it), k in a sub-block g of 16 or 32 weights:
//   type    bytes/256  bits/w  c_k                         s_g (per)           m_g            D, Dm
//   Q2_K       84      2.625   0..3                        4-bit (16)          4-bit (16)     d, dmin
//   Q3_K      110      3.4375  -4..3 (2 bits + hmask)      6-bit - 32 (16)     -              d
//   Q4_K      144      4.5     0..15                       6-bit (32)          6-bit (32)     d, dmin
//   Q5_K      176      5.5     0..31 (4 bits + qh)         6-bit (32)          6-bit (32)     d, dmin
//   Q6_K      210      6.5625  -32..31 (4 bits + 2 bits)   int8 (16)           -              d
//   IQ4_XS    136      4.25    kvalues_iq4nl[4 bits]       6-bit - 32 (32)     -              d
// kq_dequantize_rows computes exactly that (equal to gguf.quants.dequantize, bit for bit).
//
// The matmul rounds x to int8 per 32-block, as llama.cpp does for its integer dot products (its Q8_K rounds per
// 256): dx_b = max_{k in b} |x_k| / 127, xq_k = round-half-even(x_k * (127 / max|x|)) in [-127, 127]
// (quant_gemm.h's rounding). Then every path computes, per row and 32-block b of x,
//   y += dx_b * [ D * sum_{g in b} s_g * sum_{k in g} c_k xq_k  -  Dm * sum_{g in b} m_g * sum_{k in g} xq_k ]
// with exact integer sums, i.e. y = W_deq x^ (x^ = dx xq, the rounded x) up to the float32 order of the sums.
// Its error against float64 W_deq x is sum_k w_k (x_k - x^_k), at most sum_b (dx_b / 2) sum_{k in b} |w_k|.
// Per 32 rather than per 256: a block holding one of SmolLM2's outlier channels then rounds only its own 31
// neighbours coarsely, and the per-32 scale costs one float multiply per 8 rows and 32 weights here.
//
// Paths (kq_gemm's `path`; kq_resolve_path says which one runs):
//   0  portable scalar: the integer sums above, one weight row at a time (any CPU).
// Threads: at::parallel_for over tiles of 8 output rows (in chunks of >= ~64k multiply-adds).
// K must be a multiple of 256 (llama.cpp stores tensors whose rows are not in other types).
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "simd_common.h"

namespace scratchlm_gguf {

constexpr int64_t kQK = 256;      // weights per super-block
constexpr int64_t kXBlock = 32;   // weights per int8 block of x

// ggml's IQ4_NL / IQ4_XS code book (kvalues_iq4nl)
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline bool kq_handles(GType t) {
  return t == GType::Q2_K || t == GType::Q3_K || t == GType::Q4_K || t == GType::Q5_K || t == GType::Q6_K ||
         t == GType::IQ4_XS;
}

// Bytes per 256-weight super-block.
inline int64_t kq_block_bytes(GType t) {
  switch (t) {
    case GType::Q2_K: return 84;
    case GType::Q3_K: return 110;
    case GType::Q4_K: return 144;
    case GType::Q5_K: return 176;
    case GType::Q6_K: return 210;
    case GType::IQ4_XS: return 136;
    default: return 0;
  }
}

inline const char* kq_type_name(GType t) {
  switch (t) {
    case GType::Q2_K: return "Q2_K";
    case GType::Q3_K: return "Q3_K";
    case GType::Q4_K: return "Q4_K";
    case GType::Q5_K: return "Q5_K";
    case GType::Q6_K: return "Q6_K";
    case GType::IQ4_XS: return "IQ4_XS";
    default: return "not a K-quant";
  }
}

inline void kq_check(const GMat& w) {
  TORCH_CHECK(kq_handles(w.type), "gguf_kquants: GGML type ", static_cast<int>(w.type),
              " is not one of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS");
  TORCH_CHECK(w.K % kQK == 0, "gguf_kquants: ", kq_type_name(w.type), " needs K (the row length) a multiple of 256, "
              "got K = ", w.K);
  TORCH_CHECK(w.row_bytes == w.K / kQK * kq_block_bytes(w.type), "gguf_kquants: ", kq_type_name(w.type), " rows of ",
              w.K, " weights take ", w.K / kQK * kq_block_bytes(w.type), " bytes, got row_bytes = ", w.row_bytes);
}

inline float kq_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// One super-block decoded: w_k = (D * s[k / gs]) * c[k] - (Dm * m[k / gs]), gs = 16 or 32 (ng = 256 / gs groups).
struct SuperBlock {
  float D = 0.f, Dm = 0.f;
  int gs = 32, ng = 8;
  bool has_min = false;
  int32_t s[16] = {}, m[16] = {};
  int8_t c[kQK] = {};
};

// Q4_K / Q5_K's 6-bit scales and mins (ggml's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int32_t& sc, int32_t& mn) {
  if (j < 4) {
    sc = q[j] & 63, mn = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The portable decoder of one super-block (layouts: ggml-common.h's block_q2_K ... block_iq4_xs).
inline void decode_superblock(GType t, const uint8_t* b, SuperBlock& o) {
  switch (t) {
    case GType::Q2_K: {  // scales[16] (low 4 bits scale, high 4 bits min), qs[64], d, dmin
      const uint8_t* qs = b + 16;
      o.D = kq_half(b + 80), o.Dm = kq_half(b + 82), o.gs = 16, o.ng = 16, o.has_min = true;
      for (int g = 0; g < 16; ++g) o.s[g] = b[g] & 0xF, o.m[g] = b[g] >> 4;
      for (int k = 0; k < kQK; ++k) {  // weight k: byte 32 (k / 128) + k % 32, bits 2 ((k % 128) / 32)
        const int h = k / 128, j = (k % 128) / 32, l = k % 32;
        o.c[k] = static_cast<int8_t>((qs[32 * h + l] >> (2 * j)) & 3);
      }
      break;
    }
    case GType::Q3_K: {  // hmask[32], qs[64], scales[12], d
      const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
      o.D = kq_half(b + 108), o.gs = 16, o.ng = 16, o.has_min = false;
      for (int g = 0; g < 16; ++g) {
        const int lo = g < 8 ? sc[g] & 0xF : sc[g - 8] >> 4, hi = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
        o.s[g] = (lo | (hi << 4)) - 32;
      }
      for (int k = 0; k < kQK; ++k) {  // 2 low bits as Q2_K; the high bit (hmask bit 4h + j of byte l) set: +0, else -4
        const int h = k / 128, j = (k % 128) / 32, l = k % 32;
        const int low = (qs[32 * h + l] >> (2 * j)) & 3, high = (hm[l] >> (4 * h + j)) & 1;
        o.c[k] = static_cast<int8_t>(low - (high ? 0 : 4));
      }
      break;
    }
    case GType::Q4_K:
    case GType::Q5_K: {  // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
      const bool five = t == GType::Q5_K;
      const uint8_t *sc = b + 4, *qh = b + 16, *qs = b + (five ? 48 : 16);
      o.D = kq_half(b), o.Dm = kq_half(b + 2), o.gs = 32, o.ng = 8, o.has_min = true;
      for (int g = 0; g < 8; ++g) scale_min_k4(g, sc, o.s[g], o.m[g]);
      for (int k = 0; k < kQK; ++k) {  // pair p = k / 64: low nibbles of qs[32p ..] then the high ones
        const int p = k / 64, l = k % 32, hi = (k % 64) / 32;
        int v = (qs[32 * p + l] >> (4 * hi)) & 0xF;
        if (five) v |= ((qh[l] >> (k / 32)) & 1) << 4;
        o.c[k] = static_cast<int8_t>(v);
      }
      break;
    }
    case GType::Q6_K: {  // ql[128], qh[64], scales[16] (int8), d
      const uint8_t *ql = b, *qh = b + 128;
      o.D = kq_half(b + 208), o.gs = 16, o.ng = 16, o.has_min = false;
      for (int g = 0; g < 16; ++g) o.s[g] = static_cast<int8_t>(b[192 + g]);
      for (int k = 0; k < kQK; ++k) {  // half h: quarter qd uses ql[64h + 32 (qd & 1) + l] (low / high nibble)
        const int h = k / 128, qd = (k % 128) / 32, l = k % 32;
        const int low = (ql[64 * h + 32 * (qd & 1) + l] >> (4 * (qd >> 1))) & 0xF;
        const int high = (qh[32 * h + l] >> (2 * qd)) & 3;
        o.c[k] = static_cast<int8_t>((low | (high << 4)) - 32);
      }
      break;
    }
    case GType::IQ4_XS: {  // d, scales_h (uint16), scales_l[4], qs[128]
      const uint16_t sh = static_cast<uint16_t>(b[2] | (b[3] << 8));
      const uint8_t *sl = b + 4, *qs = b + 8;
      o.D = kq_half(b), o.gs = 32, o.ng = 8, o.has_min = false;
      for (int g = 0; g < 8; ++g)
        o.s[g] = (((sl[g / 2] >> (4 * (g % 2))) & 0xF) | (((sh >> (2 * g)) & 3) << 4)) - 32;
      for (int k = 0; k < kQK; ++k) {  // sub-block g: 16 bytes, weight l low nibble, l + 16 high
        const int g = k / 32, l = k % 16, hi = (k % 32) / 16;
        o.c[k] = kIQ4Values[(qs[16 * g + l] >> (4 * hi)) & 0xF];
      }
      break;
    }
    default: TORCH_CHECK(false, "gguf_kquants: unsupported type ", static_cast<int>(t));
  }
}

// Rows n0 .. n1 of W as float32 into out ((n1 - n0), K): exactly gguf.quants' values.
inline void kq_dequantize_rows(const GMat& w, int64_t n0, int64_t n1, float* out) {
  kq_check(w);
  const int64_t nsb = w.K / kQK, bb = kq_block_bytes(w.type);
  at::parallel_for(n0, n1, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, nsb)), [&](int64_t r0, int64_t r1) {
    SuperBlock sb;
    for (int64_t n = r0; n < r1; ++n)
      for (int64_t i = 0; i < nsb; ++i) {
        decode_superblock(w.type, w.raw + n * w.row_bytes + i * bb, sb);
        float* o = out + (n - n0) * w.K + i * kQK;
        for (int g = 0; g < sb.ng; ++g) {
          const float a = sb.D * static_cast<float>(sb.s[g]);  // as gguf.quants: (d * scale) * q - (dmin * min)
          const float mm = sb.Dm * static_cast<float>(sb.m[g]);
          for (int k = g * sb.gs; k < (g + 1) * sb.gs; ++k) {
            const float v = a * static_cast<float>(sb.c[k]);
            o[k] = sb.has_min ? v - mm : v;
          }
        }
      }
  });
}

// ------------------------------------------------------------------------------------- x rounded to int8
// x (M, K) per 32-block: q (M, K) int8, dx (M, K / 32), and the per-16 sums of q (M, K / 16) as int32.
struct KAct {
  int64_t M = 0, K = 0;
  std::vector<int8_t> q;
  std::vector<float> dx;
  std::vector<int32_t> s16;
};

inline void quantize_x_scalar(const float* x, int64_t M, int64_t K, KAct& a) {
  const int64_t nb = K / kXBlock;
  a.M = M, a.K = K;
  a.q.resize(M * K), a.dx.resize(M * nb), a.s16.resize(M * K / 16);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kXBlock;
      float amax = 0.f;
      for (int i = 0; i < kXBlock; ++i) amax = std::max(amax, std::fabs(xb[i]));
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int8_t* qb = a.q.data() + r * K + b * kXBlock;
      for (int h = 0; h < 2; ++h) {
        int32_t sum = 0;
        for (int i = 16 * h; i < 16 * h + 16; ++i) {
          qb[i] = static_cast<int8_t>(std::nearbyint(xb[i] * inv));  // round half to even
          sum += qb[i];
        }
        a.s16[(r * nb + b) * 2 + h] = sum;
      }
      a.dx[r * nb + b] = amax / 127.f;
    }
}

// ------------------------------------------------------------------------------------------- scalar path
inline void rows_scalar(const KAct& a, const GMat& w, float* y, int64_t n0, int64_t n1) {
  const int64_t nsb = w.K / kQK, bb = kq_block_bytes(w.type), nb = w.K / kXBlock;
  SuperBlock sb;
  std::vector<float> acc(a.M);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t i = 0; i < nsb; ++i) {
      decode_superblock(w.type, w.raw + n * w.row_bytes + i * bb, sb);
      for (int64_t r = 0; r < a.M; ++r) {
        const int8_t* xq = a.q.data() + r * w.K + i * kQK;
        for (int b = 0; b < kQK / kXBlock; ++b) {
          int32_t is = 0, im = 0;
          for (int g = b * kXBlock / sb.gs; g < (b + 1) * kXBlock / sb.gs; ++g) {
            int32_t dot = 0;
            for (int k = g * sb.gs; k < (g + 1) * sb.gs; ++k) dot += sb.c[k] * xq[k];
            is += sb.s[g] * dot;
            if (sb.has_min) {
              const int64_t h0 = (r * nb + i * 8 + b) * 2;  // the x block's two 16-sums
              const int32_t xs = sb.gs == 32 ? a.s16[h0] + a.s16[h0 + 1] : a.s16[h0 + (g * sb.gs % 32) / 16];
              im += sb.m[g] * xs;
            }
          }
          acc[r] += a.dx[r * nb + i * 8 + b] * (sb.D * static_cast<float>(is) - sb.Dm * static_cast<float>(im));
        }
      }
    }
    for (int64_t r = 0; r < a.M; ++r) y[r * w.N + n] = acc[r];
  }
}

#ifdef SCRATCHLM_X86
// ------------------------------------------------------------------------------------------- SIMD paths
// Design (measured against llama.cpp's kernels in benchmarks/gguf_gemv.py). Eight weight rows at a time, their
// blocks read in the file's layout. Per "unit" of 32 (or 64) weights each row's codes become 32 unsigned bytes in
// the order of x's bytes (a signed code c gets an offset o: u = c + o, and o * sum(xq) is subtracted below), one
// integer dot product per row gives 8 int32 lanes (AVX2: maddubs + madd; AVX-VNNI / AVX512-VNNI: vpdpbusd), and
// one reduction tree of 6 hadds turns the 8 rows' vectors into G0123 = [rows 0-3, bytes 0-15 | rows 0-3, bytes
// 16-31] and G4567, so each 16-weight half keeps its own sum: the per-16 scales (Q2_K, Q3_K, Q6_K) and per-32
// ones multiply them as int32 (the scales of 8 rows transposed once per super-block), then int32 -> float, times
// dx, into float accumulators; D (and Dm times the mins' dot with x's sums) once per super-block.
// The dot instruction is one body for all three ISAs: vpdpbusd is inline assembly ({vex}: AVX-VNNI, {evex}:
// AVX512-VNNI on ymm), so the kernels are compiled once with the AVX2 target and never use an instruction the
// CPU lacks. M > 1: the tile's codes are unpacked once per super-block into an L1 buffer (8 rows x 256 bytes)
// and every x row meets them there.
#define KQ_FN __attribute__((target("avx2,fma,f16c")))

enum KIsa : int { kIsaAvx2 = 1, kIsaAvxVnni = 2, kIsaAvx512Vnni = 3 };

// acc + per int32 lane the sum of 4 products u8 (u) x s8 (x). AVX2: maddubs (pairs, int16; no saturation for
// u <= 128: 2 * 128 * 127 < 2^15) then madd.
template <int ISA>
KQ_FN inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i x) {
  if constexpr (ISA == kIsaAvxVnni) {
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(x));
    return acc;
  } else if constexpr (ISA == kIsaAvx512Vnni) {
    asm("%{evex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(x));
    return acc;
  } else {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
  }
}

KQ_FN inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
KQ_FN inline __m128i load128(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
KQ_FN inline __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }

// Per 8 rows and super-block: per unit u the int32 scales S[u][g] = [s(row 4g + i, half A) for i < 4 | s(row 4g + i,
// half B)], the mins as float in the same layout, and D, Dm for rows 0..7.
struct alignas(32) Prep {
  int32_t S[8][2][8];
  float Mn[8][2][8];
  float D[8], Dm[8];
};

// hs[r]: row r's 16 int8 "half scales" (byte 2u + h: unit u, half h) -> out[u][g] as int32 (8 rows transposed).
KQ_FN inline void transpose_half_scales(const __m128i hs[8], int units, int32_t (*out)[2][8]) {
  for (int g = 0; g < 2; ++g) {
    const __m128i* h = hs + 4 * g;
    const __m128i a = _mm_unpacklo_epi8(h[0], h[1]), b = _mm_unpackhi_epi8(h[0], h[1]);
    const __m128i c = _mm_unpacklo_epi8(h[2], h[3]), d = _mm_unpackhi_epi8(h[2], h[3]);
    // v[q]: half-indices 4q .. 4q + 3, 4 rows each (4 bytes per half-index)
    const __m128i v[4] = {_mm_unpacklo_epi16(a, c), _mm_unpackhi_epi16(a, c), _mm_unpacklo_epi16(b, d),
                          _mm_unpackhi_epi16(b, d)};
    for (int u = 0; u < units; ++u) {
      const __m128i q = (u & 1) ? _mm_srli_si128(v[u / 2], 8) : v[u / 2];
      _mm256_store_si256(reinterpret_cast<__m256i*>(out[u][g]), _mm256_cvtepi8_epi32(q));
    }
  }
}

KQ_FN inline void transpose_half_mins(const __m128i hm[8], int units, float (*out)[2][8]) {
  int32_t tmp[8][2][8] __attribute__((aligned(32)));
  transpose_half_scales(hm, units, tmp);
  for (int u = 0; u < units; ++u)
    for (int g = 0; g < 2; ++g)
      _mm256_store_ps(out[u][g], _mm256_cvtepi32_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(tmp[u][g]))));
}

// 8 fp16 values at p[r] + off as 8 floats.
KQ_FN inline void halves8(const uint8_t* const blk[8], int off, float* out) {
  uint16_t h[8];
  for (int r = 0; r < 8; ++r) std::memcpy(h + r, blk[r] + off, 2);
  _mm256_storeu_ps(out, _mm256_cvtph_ps(load128(h)));
}

// Q4_K / Q5_K: the 12 scale bytes at b + 4 -> [s0 .. s7, m0 .. m7] (6-bit each; ggml's get_scale_min_k4).
KQ_FN inline __m128i scales_k4(const uint8_t* b) {
  const __m128i v = load128(b + 4);  // 12 scale bytes, then 4 of the next field (ignored)
  const __m128i lo6 = _mm_and_si128(v, _mm_set1_epi8(0x3F));                                   // s0-3, m0-3
  const __m128i top = _mm_and_si128(_mm_srli_epi16(v, 2), _mm_set1_epi8(0x30));                // bits 6,7 -> 4,5
  const __m128i t = _mm_shuffle_epi8(v, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
  const __m128i w = _mm_blend_epi16(_mm_and_si128(t, _mm_set1_epi8(0x0F)),
                                    _mm_and_si128(_mm_srli_epi16(t, 4), _mm_set1_epi8(0x0F)), 0x0C);
  const __m128i hi = _mm_or_si128(w, top);                                                     // s4-7, m4-7
  return _mm_unpacklo_epi32(lo6, hi);
}

// ------------------------------------------------------------------------------------------- type traits
// kUnit: weights per reduction unit (32, or 64 with x's bytes permuted, see IQ4_XS); kOffShift: log2 of the code
// offset o (-1: none); kMin: w has the Dm * m term. prep(): per 8 rows and super-block. codes(): row b's unit u
// as unsigned bytes aligned with x's unit bytes (1 or 2 vectors).
struct TQ4K {
  static constexpr int kUnit = 32, kOffShift = -1;
  static constexpr bool kMin = true;
  KQ_FN static void prep(const uint8_t* const blk[8], Prep& p) {
    __m128i hs[8], hm[8];
    for (int r = 0; r < 8; ++r) {
      const __m128i sm = scales_k4(blk[r]);
      hs[r] = _mm_shuffle_epi8(sm, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
      hm[r] = _mm_shuffle_epi8(sm, _mm_setr_epi8(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15));
    }
    transpose_half_scales(hs, 8, p.S);
    transpose_half_mins(hm, 8, p.Mn);
    halves8(blk, 0, p.D), halves8(blk, 2, p.Dm);
  }
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) {
    const __m256i raw = load256(b + 16 + 32 * (u / 2));
    c[0] = _mm256_and_si256(u & 1 ? _mm256_srli_epi16(raw, 4) : raw, bytes(0x0F));
  }
};

struct TQ5K {
  static constexpr int kUnit = 32, kOffShift = -1;
  static constexpr bool kMin = true;
  KQ_FN static void prep(const uint8_t* const blk[8], Prep& p) { TQ4K::prep(blk, p); }
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) {
    const __m256i raw = load256(b + 48 + 32 * (u / 2)), qh = load256(b + 16);
    const __m256i lo = _mm256_and_si256(u & 1 ? _mm256_srli_epi16(raw, 4) : raw, bytes(0x0F));
    // bit u of qh[l] -> bit 4 (16-bit shifts: the mask keeps each byte's own bit)
    const __m256i h = u >= 4 ? _mm256_srli_epi16(qh, u - 4) : _mm256_slli_epi16(qh, 4 - u);
    c[0] = _mm256_or_si256(lo, _mm256_and_si256(h, bytes(0x10)));
  }
};

struct TQ6K {
  static constexpr int kUnit = 32, kOffShift = 5;  // c = q - 32
  static constexpr bool kMin = false;
  KQ_FN static void prep(const uint8_t* const blk[8], Prep& p) {
    __m128i hs[8];
    for (int r = 0; r < 8; ++r) hs[r] = load128(blk[r] + 192);
    transpose_half_scales(hs, 8, p.S);
    halves8(blk, 208, p.D);
  }
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) {
    const int h = u / 4, qd = u % 4;
    const __m256i ql = load256(b + 64 * h + 32 * (qd & 1)), qh = load256(b + 128 + 32 * h);
    const __m256i lo = _mm256_and_si256(qd < 2 ? ql : _mm256_srli_epi16(ql, 4), bytes(0x0F));
    const __m256i hs = qd == 0 ? _mm256_slli_epi16(qh, 4) : qd == 1 ? _mm256_slli_epi16(qh, 2)
                       : qd == 2 ? qh : _mm256_srli_epi16(qh, 2);  // bits 2qd, 2qd + 1 -> 4, 5
    c[0] = _mm256_or_si256(lo, _mm256_and_si256(hs, bytes(0x30)));
  }
};

struct TQ3K {
  static constexpr int kUnit = 32, kOffShift = 2;  // c = low + 4 high - 4
  static constexpr bool kMin = false;
  KQ_FN static void prep(const uint8_t* const blk[8], Prep& p) {
    __m128i hs[8];
    for (int r = 0; r < 8; ++r) {
      const uint8_t* s = blk[r] + 96;
      const __m128i v8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));  // bytes 0-7: low 4 bits
      int32_t w;
      std::memcpy(&w, s + 8, 4);                                                  // bytes 8-11: high 2 bits
      const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(v8, _mm_set1_epi8(0x0F)),
                                            _mm_and_si128(_mm_srli_epi16(v8, 4), _mm_set1_epi8(0x0F)));
      // group g: (byte 8 + g % 4) >> 2 (g / 4): dword q = g / 4 shifted by 2q
      const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(w), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
      hs[r] = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
    }
    transpose_half_scales(hs, 8, p.S);
    halves8(blk, 108, p.D);
  }
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) {
    const int h = u / 4, j = u % 4;
    const __m256i qs = load256(b + 32 + 32 * h), hm = load256(b);
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), bytes(3));
    const __m256i hb = u >= 2 ? _mm256_srli_epi16(hm, u - 2) : _mm256_slli_epi16(hm, 2 - u);  // bit u -> bit 2
    c[0] = _mm256_or_si256(lo, _mm256_and_si256(hb, bytes(4)));
  }
};

struct TQ2K {
  static constexpr int kUnit = 32, kOffShift = -1;
  static constexpr bool kMin = true;
  KQ_FN static void prep(const uint8_t* const blk[8], Prep& p) {
    __m128i hs[8], hm[8];
    for (int r = 0; r < 8; ++r) {
      const __m128i v = load128(blk[r]);
      hs[r] = _mm_and_si128(v, _mm_set1_epi8(0x0F));
      hm[r] = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
    }
    transpose_half_scales(hs, 8, p.S);
    transpose_half_mins(hm, 8, p.Mn);
    halves8(blk, 80, p.D), halves8(blk, 82, p.Dm);
  }
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) {
    const __m256i qs = load256(b + 16 + 32 * (u / 4));
    c[0] = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (u % 4)), bytes(3));
  }
};

// IQ4_XS: a unit is two sub-blocks (64 weights, 32 bytes): the low nibbles hold weights 0-15 of each sub-block,
// the high ones 16-31, so x's unit bytes are permuted to [x 0-15 of each | x 16-31 of each] and the halves of the
// reduction are the two sub-blocks (their own dx). The code book + 128 as unsigned bytes (VNNI); AVX2 keeps the
// signed values and the sign trick (maddubs(|c|, sign(x, c)): u8 * 241 would saturate maddubs).
struct TIQ4XS {
  static constexpr int kUnit = 64, kOffShift = 7;
  static constexpr bool kMin = false;
  KQ_FN static void prep(const uint8_t* const blk[8], Prep& p) {
    __m128i hs[8];
    for (int r = 0; r < 8; ++r) {
      const uint8_t* b = blk[r];
      const int sh = b[2] | (b[3] << 8);
      alignas(16) int8_t s[16] = {};
      for (int j = 0; j < 8; ++j) s[j] = static_cast<int8_t>((((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((sh >> (2 * j)) & 3) << 4)) - 32);
      hs[r] = _mm_load_si128(reinterpret_cast<const __m128i*>(s));
    }
    transpose_half_scales(hs, 4, p.S);
    halves8(blk, 0, p.D);
  }
  template <bool kSigned>
  KQ_FN static void codes_t(const uint8_t* b, int u, __m256i* c) {
    const __m256i raw = load256(b + 8 + 32 * u);
    const __m256i tab = kSigned ? _mm256_broadcastsi128_si256(load128(kIQ4Values))
                                : _mm256_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153,
                                                   (char)166, (char)181, (char)197, (char)217, (char)241, 1, 24, 45, 63,
                                                   79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166,
                                                   (char)181, (char)197, (char)217, (char)241);
    c[0] = _mm256_shuffle_epi8(tab, _mm256_and_si256(raw, bytes(0x0F)));
    c[1] = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(raw, 4), bytes(0x0F)));
  }
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) { codes_t<false>(b, u, c); }
};

// ------------------------------------------------------------------------------------------- x side
// One x row in a type's unit order: bytes (int8; permuted for 64-weight units), and per unit 8 lanes each of dx
// ([half A x4 | half B x4]), the offset correction o * sum(xq) per half (int32) and dx * sum(xq) per half (mins).
struct XRows {
  int64_t M = 0, units = 0, unit = 32;
  std::vector<int8_t> perm;  // only for 64-weight units
  std::vector<float> dxv, sxf;
  std::vector<int32_t> xsv;
  const int8_t* bytes(const KAct& a, int64_t r) const {
    return perm.empty() ? a.q.data() + r * a.K : perm.data() + r * a.K;
  }
};

template <class Tr>
KQ_FN inline void prepare_x(const KAct& a, XRows& xr) {
  const int64_t K = a.K, nb = K / kXBlock, U = K / Tr::kUnit;
  xr.M = a.M, xr.units = U, xr.unit = Tr::kUnit;
  xr.dxv.resize(a.M * U * 8);
  if (Tr::kOffShift >= 0) xr.xsv.resize(a.M * U * 8);
  if (Tr::kMin) xr.sxf.resize(a.M * U * 8);
  if (Tr::kUnit == 64) xr.perm.resize(a.M * K);
  for (int64_t r = 0; r < a.M; ++r)
    for (int64_t u = 0; u < U; ++u) {
      float* dv = xr.dxv.data() + (r * U + u) * 8;
      for (int h = 0; h < 2; ++h) {
        // half h: x block and its 16-sums
        const int64_t b = Tr::kUnit == 64 ? 2 * u + h : u;
        const float dx = a.dx[r * nb + b];
        const int32_t xs = Tr::kUnit == 64 ? a.s16[(r * nb + b) * 2] + a.s16[(r * nb + b) * 2 + 1]
                                           : a.s16[(r * nb + b) * 2 + h];
        for (int i = 0; i < 4; ++i) {
          dv[4 * h + i] = dx;
          if (Tr::kOffShift >= 0) xr.xsv[(r * U + u) * 8 + 4 * h + i] = xs * (1 << (Tr::kOffShift < 0 ? 0 : Tr::kOffShift));
          if (Tr::kMin) xr.sxf[(r * U + u) * 8 + 4 * h + i] = dx * static_cast<float>(xs);
        }
      }
      if (Tr::kUnit == 64) {  // [x 0-15 of sub-block 2u, of 2u + 1 | x 16-31 of 2u, of 2u + 1]
        const int8_t* src = a.q.data() + r * K + 64 * u;
        int8_t* dst = xr.perm.data() + r * K + 64 * u;
        std::memcpy(dst, src, 16), std::memcpy(dst + 16, src + 32, 16);
        std::memcpy(dst + 32, src + 16, 16), std::memcpy(dst + 48, src + 48, 16);
      }
    }
}

// ------------------------------------------------------------------------------------------- the 8-row kernel
// [rows 0-3 | rows 0-3] and [rows 4-7 | rows 4-7] (halves A, B) -> rows 0..7 (the halves added).
KQ_FN inline __m256 fold_halves(__m256 f0, __m256 f1) {
  return _mm256_add_ps(_mm256_permute2f128_ps(f0, f1, 0x20), _mm256_permute2f128_ps(f0, f1, 0x31));
}

// One unit of 8 rows against one x row: adds dx * sum_h s_h (S_h - o xs_h) into f0 (rows 0-3) and f1 (4-7).
template <class Tr, int ISA, bool kSigned>
KQ_FN inline void unit8(const __m256i (*c)[2], const int8_t* xb, const XRows& xr, int64_t ui, const Prep& p, int u,
                        __m256& f0, __m256& f1) {
  constexpr int V = Tr::kUnit / 32;
  __m256i X[V];
  for (int v = 0; v < V; ++v) X[v] = load256(xb + 32 * v);
  __m256i P[8];
  for (int r = 0; r < 8; ++r) {
    P[r] = _mm256_setzero_si256();
    for (int v = 0; v < V; ++v) {
      if constexpr (kSigned)  // |c| x sign(x, c): |products| <= 127 * 127, the pair sums fit int16
        P[r] = _mm256_add_epi32(P[r], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(c[r][v], c[r][v]),
                                                                             _mm256_sign_epi8(X[v], c[r][v])),
                                                        _mm256_set1_epi16(1)));
      else
        P[r] = dot_u8s8<ISA>(P[r], c[r][v], X[v]);
    }
  }
  const __m256i h01 = _mm256_hadd_epi32(P[0], P[1]), h23 = _mm256_hadd_epi32(P[2], P[3]);
  const __m256i h45 = _mm256_hadd_epi32(P[4], P[5]), h67 = _mm256_hadd_epi32(P[6], P[7]);
  __m256i g0 = _mm256_hadd_epi32(h01, h23), g1 = _mm256_hadd_epi32(h45, h67);
  if constexpr (Tr::kOffShift >= 0 && !kSigned) {
    const __m256i o = load256(xr.xsv.data() + ui * 8);
    g0 = _mm256_sub_epi32(g0, o), g1 = _mm256_sub_epi32(g1, o);
  }
  g0 = _mm256_mullo_epi32(g0, _mm256_load_si256(reinterpret_cast<const __m256i*>(p.S[u][0])));
  g1 = _mm256_mullo_epi32(g1, _mm256_load_si256(reinterpret_cast<const __m256i*>(p.S[u][1])));
  const __m256 dx = _mm256_loadu_ps(xr.dxv.data() + ui * 8);
  f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g0), dx, f0);
  f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g1), dx, f1);
}

// Weight rows n0 .. n1 (whole tiles of 8; a ragged last tile repeats its last row and stores only the valid ones)
// against every x row.
template <class Tr, int ISA>
KQ_FN void tile8(const KAct& a, const XRows& xr, const GMat& w, float* y, int64_t n0, int64_t n1) {
  constexpr bool kSigned = std::is_same<Tr, TIQ4XS>::value && ISA == kIsaAvx2;
  constexpr int V = Tr::kUnit / 32, U = kQK / Tr::kUnit;
  const int64_t nsb = w.K / kQK, bb = kq_block_bytes(w.type), M = a.M;
  Prep p;
  std::vector<float> accs(M * 8);  // (M, 8) float accumulators (std::vector does not align __m256)
  float* acc = accs.data();
  alignas(32) __m256i cbuf[U][8][2];  // M > 1: the super-block's codes, unpacked once
  for (int64_t n = n0; n < n1; n += 8) {
    const int64_t valid = std::min<int64_t>(8, n1 - n);
    const uint8_t* rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w.raw + (n + std::min<int64_t>(r, valid - 1)) * w.row_bytes;
    std::fill(accs.begin(), accs.end(), 0.f);
    for (int64_t i = 0; i < nsb; ++i) {
      const uint8_t* blk[8];
      for (int r = 0; r < 8; ++r) blk[r] = rows[r] + i * bb;
      Tr::prep(blk, p);
      const __m256 D = _mm256_loadu_ps(p.D), Dm = _mm256_loadu_ps(p.Dm);
      if (M > 1)
        for (int u = 0; u < U; ++u)
          for (int r = 0; r < 8; ++r) {
            if constexpr (kSigned) TIQ4XS::codes_t<true>(blk[r], u, cbuf[u][r]);
            else Tr::codes(blk[r], u, cbuf[u][r]);
          }
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xb = xr.bytes(a, m) + i * kQK;
        __m256 f0 = _mm256_setzero_ps(), f1 = _mm256_setzero_ps(), m0 = f0, m1 = f0;
        for (int u = 0; u < U; ++u) {
          const int64_t ui = m * xr.units + i * U + u;
          if (M == 1) {
            __m256i c[8][2];
            for (int r = 0; r < 8; ++r) {
              if constexpr (kSigned) TIQ4XS::codes_t<true>(blk[r], u, c[r]);
              else Tr::codes(blk[r], u, c[r]);
            }
            unit8<Tr, ISA, kSigned>(c, xb + u * Tr::kUnit, xr, ui, p, u, f0, f1);
          } else {
            unit8<Tr, ISA, kSigned>(cbuf[u], xb + u * Tr::kUnit, xr, ui, p, u, f0, f1);
          }
          if constexpr (Tr::kMin) {
            const __m256 sx = _mm256_loadu_ps(xr.sxf.data() + ui * 8);
            m0 = _mm256_fmadd_ps(_mm256_load_ps(p.Mn[u][0]), sx, m0);
            m1 = _mm256_fmadd_ps(_mm256_load_ps(p.Mn[u][1]), sx, m1);
          }
        }
        __m256 t = _mm256_fmadd_ps(D, fold_halves(f0, f1), _mm256_loadu_ps(acc + 8 * m));
        if constexpr (Tr::kMin) t = _mm256_fnmadd_ps(Dm, fold_halves(m0, m1), t);
        _mm256_storeu_ps(acc + 8 * m, t);
        (void)V;
      }
    }
    for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * w.N + n, acc + 8 * m, valid * sizeof(float));
  }
}

template <class Tr>
inline void gemm_simd(const KAct& a, const GMat& w, float* y, int isa) {
  XRows xr;
  prepare_x<Tr>(a, xr);
  const int64_t tiles = (w.N + 7) / 8;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, w.K * a.M * 8));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * 8, n1 = std::min(w.N, t1 * 8);
    if (isa == kIsaAvx512Vnni) tile8<Tr, kIsaAvx512Vnni>(a, xr, w, y, n0, n1);
    else if (isa == kIsaAvxVnni) tile8<Tr, kIsaAvxVnni>(a, xr, w, y, n0, n1);
    else tile8<Tr, kIsaAvx2>(a, xr, w, y, n0, n1);
  });
}

inline void gemm_simd_any(const KAct& a, const GMat& w, float* y, int isa) {
  switch (w.type) {
    case GType::Q2_K: return gemm_simd<TQ2K>(a, w, y, isa);
    case GType::Q3_K: return gemm_simd<TQ3K>(a, w, y, isa);
    case GType::Q4_K: return gemm_simd<TQ4K>(a, w, y, isa);
    case GType::Q5_K: return gemm_simd<TQ5K>(a, w, y, isa);
    case GType::Q6_K: return gemm_simd<TQ6K>(a, w, y, isa);
    case GType::IQ4_XS: return gemm_simd<TIQ4XS>(a, w, y, isa);
    default: TORCH_CHECK(false, "gguf_kquants: unsupported type");
  }
}
#endif  // SCRATCHLM_X86

// ------------------------------------------------------------------------------------------- dispatch
// Paths: 0 scalar; 1 AVX2 (maddubs + madd); 2 AVX-VNNI (vpdpbusd, VEX: Alder Lake+, Zen 5); 3 AVX512-VNNI (vpdpbusd
// on ymm, EVEX: Ice Lake+, Zen 4). A path the CPU (or $SCRATCHLM_ISA) lacks resolves to the best one it has.
constexpr int kPathScalar = 0, kPathAvx2 = 1, kPathAvxVnni = 2, kPathAvx512Vnni = 3;

inline int kq_best_isa_path() {
  return scratchlm_simd::cpu_has_avx512vnni() ? kPathAvx512Vnni : scratchlm_simd::cpu_has_avxvnni() ? kPathAvxVnni
         : scratchlm_simd::cpu_has_avx2() ? kPathAvx2 : kPathScalar;
}

inline bool kq_path_available(int p) {
  switch (p) {
    case kPathScalar: return true;
    case kPathAvx2: return scratchlm_simd::cpu_has_avx2();
    case kPathAvxVnni: return scratchlm_simd::cpu_has_avxvnni();
    case kPathAvx512Vnni: return scratchlm_simd::cpu_has_avx512vnni();
    default: return false;
  }
}

inline int kq_resolve_path(const GMat& w, int64_t M, int path) {
  (void)w, (void)M;
  TORCH_CHECK(path >= -1 && path <= 3, "gguf_kquants: path ", path, " is not one of -1 (best), 0 (scalar), 1 (AVX2), "
              "2 (AVX-VNNI), 3 (AVX512-VNNI)");
  if (path == -1 || !kq_path_available(path)) return kq_best_isa_path();
  return path;
}

inline void kq_gemm(const float* x, int64_t M, const GMat& w, float* y, int path) {
  kq_check(w);
  const int p = kq_resolve_path(w, M, path);
  KAct a;
  quantize_x_scalar(x, M, w.K, a);
#ifdef SCRATCHLM_X86
  if (p != kPathScalar) return gemm_simd_any(a, w, y, p);
#endif
  constexpr int64_t kRows = 8;
  const int64_t tiles = (w.N + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, w.K * M * kRows));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    rows_scalar(a, w, y, t0 * kRows, std::min(w.N, t1 * kRows));
  });
}

}  // namespace scratchlm_gguf
