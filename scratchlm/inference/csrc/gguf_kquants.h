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
// dequantize_rows computes exactly that (equal to gguf.quants.dequantize, bit for bit).
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
// Paths (kq_gemm's `path`; kq_resolve_path says which one runs; every path takes any M):
//   0  portable scalar: the integer sums above, one weight row at a time (any CPU).
//   1  AVX2 (+FMA, F16C): 8 weight rows per tile, maddubs against x in file order, the rows' vectors reduced by
//      unpacks and adds (int16 through two levels where the codes allow), scales by madd / mullo.
//   2  AVX-VNNI: path 1's body with vpdpbusd (VEX) where the codes do not fit the int16 route.
//   3  AVX512-VNNI: 8 rows' block segments transposed by 8-byte words on 512-bit registers, vpdpbusd against x's
//      8-byte words broadcast: no horizontal sums (see "SIMD paths" below).
// -1 (the default) is the best of these the CPU has, for every M: measured on one Zen 5 core against llama.cpp's
// own kernels (benchmarks/gguf_gemv.py, kquants section): at 1 row path 3 reads Q4_K at 1.4-1.6x llama.cpp's
// vec_dot and its repacked 8-row gemv, path 1 at about 1.0-1.2x (near the memory system's rate for weights from
// DRAM); at 512 rows (prefill) the integer kernels took 170-260 ms where dequantizing to float32 for oneDNN / MKL
// took 440-490 ms on the 1B-like shapes, so they stay the choice above 64 rows as well. A forced path the CPU (or
// $SCRATCHLM_ISA) lacks resolves to the best one it has (tests force every path).
// Threads: at::parallel_for over tiles of 8 output rows (in chunks of >= ~64k multiply-adds).
// K must be a multiple of 256 (llama.cpp stores tensors whose rows are not in other types): a clear error otherwise.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "gguf_blocks.h"
#include "simd_common.h"

namespace scratchlm_gguf {
namespace kq {  // the internals; the interface (kq_*) is at the end

constexpr int64_t kQK = 256;      // weights per super-block
constexpr int64_t kXBlock = 32;   // weights per int8 block of x

// ggml's IQ4_NL / IQ4_XS code book (kvalues_iq4nl)
constexpr int8_t kIQ4Values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline bool handles(GType t) {
  return t == GType::Q2_K || t == GType::Q3_K || t == GType::Q4_K || t == GType::Q5_K || t == GType::Q6_K ||
         t == GType::IQ4_XS;
}

// Bytes per 256-weight super-block.
inline int64_t block_bytes(GType t) {
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

inline const char* type_name(GType t) {
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

inline void check(const GMat& w) {
  TORCH_CHECK(handles(w.type), "gguf_kquants: GGML type ", static_cast<int>(w.type),
              " is not one of Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS");
  TORCH_CHECK(w.K % kQK == 0, "gguf_kquants: ", type_name(w.type), " needs K (the row length) a multiple of 256, "
              "got K = ", w.K);
  TORCH_CHECK(w.row_bytes == w.K / kQK * block_bytes(w.type), "gguf_kquants: ", type_name(w.type), " rows of ",
              w.K, " weights take ", w.K / kQK * block_bytes(w.type), " bytes, got row_bytes = ", w.row_bytes);
}

inline float half(const uint8_t* p) {
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
      o.D = half(b + 80), o.Dm = half(b + 82), o.gs = 16, o.ng = 16, o.has_min = true;
      for (int g = 0; g < 16; ++g) o.s[g] = b[g] & 0xF, o.m[g] = b[g] >> 4;
      for (int k = 0; k < kQK; ++k) {  // weight k: byte 32 (k / 128) + k % 32, bits 2 ((k % 128) / 32)
        const int h = k / 128, j = (k % 128) / 32, l = k % 32;
        o.c[k] = static_cast<int8_t>((qs[32 * h + l] >> (2 * j)) & 3);
      }
      break;
    }
    case GType::Q3_K: {  // hmask[32], qs[64], scales[12], d
      const uint8_t *hm = b, *qs = b + 32, *sc = b + 96;
      o.D = half(b + 108), o.gs = 16, o.ng = 16, o.has_min = false;
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
      o.D = half(b), o.Dm = half(b + 2), o.gs = 32, o.ng = 8, o.has_min = true;
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
      o.D = half(b + 208), o.gs = 16, o.ng = 16, o.has_min = false;
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
      o.D = half(b), o.gs = 32, o.ng = 8, o.has_min = false;
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

inline void dequantize_rows(const GMat& w, int64_t n0, int64_t n1, float* out) {
  check(w);
  const int64_t nsb = w.K / kQK, bb = block_bytes(w.type);
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
  const int64_t nsb = w.K / kQK, bb = block_bytes(w.type), nb = w.K / kXBlock;
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
// All kernels take 8 weight rows at a time (a tile) and read their blocks straight from the file's bytes, one
// super-block of the 8 rows after the other, while the next tile is prefetched: 8 interleaved rows defeat the
// hardware prefetcher (a standalone read of 8 interleaved Q4_K rows on one core here: 12 GB/s without, 28-30 GB/s
// with the software prefetch, as fast as a sequential read). Storing unpacked codes for a whole tile costs about as
// much again (the stores leave L1: a read-unpack-store loop ran at 12 GB/s against 27 without stores), so M = 1
// computes from the registers; M > 1 unpacks one super-block of the tile (2 KiB, stays in L1) and every x row meets
// it there.
//
// Path 3 (AVX512-VNNI, 512-bit registers): each 32-byte segment of the block (nibbles, high bits) is read for the 8
// rows and transposed by 8-byte words (in-lane unpacks and 128-bit lane shuffles), so a 64-byte vector holds one
// 8-byte word of every row (lanes 2j, 2j + 1: row kRowOrder[j]). The codes come out of those words with byte-wise
// shifts and masks (the same operations as in the file's layout), and one vpdpbusd against x's matching 8 bytes
// (broadcast) adds 4 products into each lane: no horizontal sums at all. Per unit (32 weights) the two halves' sums
// are paired up ([half A, half B] per row), multiplied by the rows' int scales, converted, and multiplied by dx;
// Q4_K / Q5_K (one scale per unit) multiply the row sums by vpmuldq instead. D and the mins once per super-block.
// (The idea of one dot instruction feeding 8 rows is quant_gemm.h's paths 6 / 7; llama.cpp gets 8 rows per
// instruction by repacking Q4_K at load, which this header does not do: the file's blocks stay as they are.)
// Paths 1 (AVX2: maddubs) and 2 (AVX-VNNI: vpdpbusd, VEX), 256-bit: per unit each row's 32 codes in file order
// meet x's 32 bytes, and a tree of unpacks and adds reduces the 8 rows' vectors to [rows 0-3 half A | rows 0-3
// half B] and the same for rows 4-7. Where the codes allow it (codes <= 31: 8 products of <= 31 * 127 fit int16)
// the sums stay int16 through two levels and the scales come in with madd (llama.cpp's vec_dot_q4_K multiplies
// its scales with madd the same way); otherwise int32 sums and mullo.
// Signed codes c (Q3_K, Q6_K; IQ4_XS on the VNNI paths) are read as c + o (unsigned) and o * s_g * sum(xq) is
// subtracted in float with the mins: the "min" of such a type is its scale and Dm = o * D.
// vpdpbusd is inline assembly ({vex}: AVX-VNNI, {evex}: AVX512-VNNI+VL on ymm) so that paths 1 / 2 share one body
// compiled for AVX2; path 3's functions carry the AVX-512 target and run only where cpu_has_avx512vnni().
#define KQ_FN __attribute__((target("avx2,fma,f16c")))
#define KQ5_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

enum KIsa : int { kIsaAvx2 = 1, kIsaAvxVnni = 2, kIsaAvx512Vnni = 3 };

// quantize_x_scalar's values, 32 floats at a time: |x| max, x * inv rounded half to even by _mm256_round_ps (what
// nearbyint does under the default rounding mode), packs to int8 (packs interleave 128-bit lanes: a permute undoes
// it), and the two per-16 sums. The scalar loop is compiled for the baseline ISA (a serial max chain and a libm call
// per element): it cost as much as the Q4_K GEMMs of a MoE's skinny experts (benchmarks/results/*-moe_decode.md).
KQ_FN inline void quantize_x_avx2(const float* x, int64_t M, int64_t K, KAct& a) {
  const int64_t nb = K / kXBlock;
  a.M = M, a.K = K;
  a.q.resize(M * K), a.dx.resize(M * nb), a.s16.resize(M * K / 16);
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + r * K + b * kXBlock;
      __m256 v[4];
      __m256 mx = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = _mm256_loadu_ps(xb + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
      }
      const float amax = scratchlm_simd::hmax256(mx);
      const __m256 iv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i i32[4];
      for (int j = 0; j < 4; ++j)
        i32[j] = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(v[j], iv), _MM_FROUND_TO_NEAREST_INT |
                                                                                _MM_FROUND_NO_EXC));
      const __m256i p8 = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(i32[0], i32[1]), _mm256_packs_epi32(i32[2], i32[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.q.data() + r * K + b * kXBlock), p8);
      for (int h = 0; h < 2; ++h) {  // the sums of elements 0-15 and 16-31
        const __m256i s = _mm256_add_epi32(i32[2 * h], i32[2 * h + 1]);
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        a.s16[(r * nb + b) * 2 + h] = _mm_cvtsi128_si32(_mm_hadd_epi32(s4, s4));
      }
      a.dx[r * nb + b] = amax / 127.f;
    }
}

KQ_FN inline __m256i load256(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
KQ_FN inline __m128i load128(const void* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
KQ_FN inline __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
// Two floats as one double's bits (for a 64-bit broadcast of the pair).
inline double pair_of(const float* p) {
  double d;
  std::memcpy(&d, p, 8);
  return d;
}

// acc + per int32 lane the sum of 4 products u8 (u) x s8 (x) (VNNI paths).
template <int ISA>
KQ_FN inline __m256i dpbusd256(__m256i acc, __m256i u, __m256i x) {
  if constexpr (ISA == kIsaAvxVnni) {
    asm("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(x));
  } else {
    asm("%{evex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(u), "x"(x));
  }
  return acc;
}

// ------------------------------------------------------------------------------------------- scales
// Per 8 rows and super-block, for "pair index" k = 0..7: xs[k] = 16 int8 [s_A(row 0), s_B(row 0), s_A(row 1), ...,
// s_B(row 7)], the scales of the two halves (A: weights 0-15, B: 16-31 of the unit; for IQ4_XS: the two sub-blocks
// of segment k) of every row; xm[k] the mins (or, for an offset type, the scales again); D and Dm (Dm = o * D for an
// offset type) as 8 floats.
struct ScalesT {
  __m128i xs[8], xm[8];
  __m256 D, Dm;
  __m256 D_o, Dm_o;  // path 3, (s, m)-word types: D and Dm in kRowOrder
};

// Q4_K / Q5_K: the 12 scale bytes at b + 4 -> [s0 .. s7, m0 .. m7] (6-bit each; ggml's get_scale_min_k4).
KQ_FN inline __m128i scales_k4(const uint8_t* b) {
  const __m128i v = load128(b + 4);  // 12 scale bytes, then 4 of the next field (unused)
  const __m128i lo6 = _mm_and_si128(v, _mm_set1_epi8(0x3F));                                 // s0-3, m0-3
  const __m128i top = _mm_and_si128(_mm_srli_epi16(v, 2), _mm_set1_epi8(0x30));              // bits 6,7 -> 4,5
  const __m128i t = _mm_shuffle_epi8(v, _mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
  const __m128i w = _mm_blend_epi16(_mm_and_si128(t, _mm_set1_epi8(0x0F)),
                                    _mm_and_si128(_mm_srli_epi16(t, 4), _mm_set1_epi8(0x0F)), 0x0C);
  return _mm_unpacklo_epi32(lo6, _mm_or_si128(w, top));                                      // s4-7, m4-7
}

// ------------------------------------------------------------------------------------------- type traits
// kPer16: scales per 16 weights (a unit's halves have their own); kOff: code offset o (0: none); kMin: Dm * m term;
// kCodeMax: the largest unsigned code (AVX2's int16 sums); kUnit64: the ymm paths take 64-weight units (IQ4_XS).
// rows(): per row 16 bytes of scale words (word k: [s_A, s_B] of pair k) and mins. codes(): ymm paths, row b's unit
// u as unsigned bytes in x's order. Path 3: kSegs 32-byte segments at seg_off(); zcode(u, q, T): unit u's codes in
// transposed word q (T[s][q]: segment s, word q of the 8 rows); xoff(u, q): offset of the x bytes they meet.
struct TQ4K {
  // kSM: per-32 scale and min of a unit travel as one word (s, m) per row, one transpose for both
  static constexpr bool kPer16 = false, kMin = true, kUnit64 = false, kHi16 = true, kSM = true;
  static constexpr int kOff = 0, kCodeMax = 15, kSegs = 4;
  KQ_FN static void rows(const uint8_t* b, __m128i& hs, __m128i& hm) {  // words (s_k, m_k)
    const __m128i sm = scales_k4(b);
    hs = hm = _mm_unpacklo_epi8(sm, _mm_srli_si128(sm, 8));
  }
  static constexpr int kDOff = 0, kDmOff = 2;
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) {
    const __m256i raw = load256(b + 16 + 32 * (u / 2));
    c[0] = _mm256_and_si256(u & 1 ? _mm256_srli_epi16(raw, 4) : raw, bytes(0x0F));
  }
  static constexpr int seg_off(int s) { return 16 + 32 * s; }
  KQ5_FN static __m512i zcode(int u, int q, const __m512i (*T)[4]) {  // odd units: the high nibble kept in place (16 q)
    return _mm512_and_si512(T[u / 2][q], _mm512_set1_epi8(u & 1 ? static_cast<char>(0xF0) : 0x0F));
  }
  static constexpr int xoff(int u, int q) { return 32 * u + 8 * q; }
};

struct TQ5K {
  static constexpr bool kPer16 = false, kMin = true, kUnit64 = false, kHi16 = false, kSM = true;
  static constexpr int kOff = 0, kCodeMax = 31, kSegs = 5;  // segments 0-3: qs, 4: qh
  KQ_FN static void rows(const uint8_t* b, __m128i& hs, __m128i& hm) { TQ4K::rows(b, hs, hm); }
  static constexpr int kDOff = 0, kDmOff = 2;
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) {
    const __m256i raw = load256(b + 48 + 32 * (u / 2)), qh = load256(b + 16);
    const __m256i lo = _mm256_and_si256(u & 1 ? _mm256_srli_epi16(raw, 4) : raw, bytes(0x0F));
    // bit u of qh[l] -> bit 4 (16-bit shifts: the mask keeps each byte's own bit)
    const __m256i h = u >= 4 ? _mm256_srli_epi16(qh, u - 4) : _mm256_slli_epi16(qh, 4 - u);
    c[0] = _mm256_or_si256(lo, _mm256_and_si256(h, bytes(0x10)));
  }
  static constexpr int seg_off(int s) { return s < 4 ? 48 + 32 * s : 16; }
  KQ5_FN static __m512i zcode(int u, int q, const __m512i (*T)[4]) {
    const __m512i raw = T[u / 2][q], qh = T[4][q];
    const __m512i lo = _mm512_and_si512(u & 1 ? _mm512_srli_epi16(raw, 4) : raw, _mm512_set1_epi8(0x0F));
    const __m512i h = u >= 4 ? _mm512_srli_epi16(qh, u - 4) : _mm512_slli_epi16(qh, 4 - u);
    return _mm512_or_si512(lo, _mm512_and_si512(h, _mm512_set1_epi8(0x10)));
  }
  static constexpr int xoff(int u, int q) { return 32 * u + 8 * q; }
};

struct TQ6K {
  static constexpr bool kPer16 = true, kMin = false, kUnit64 = false, kHi16 = false, kSM = false;
  static constexpr int kOff = 32, kCodeMax = 63, kSegs = 6;  // segments 0-3: ql, 4-5: qh
  KQ_FN static void rows(const uint8_t* b, __m128i& hs, __m128i& hm) { hs = hm = load128(b + 192); }
  static constexpr int kDOff = 208, kDmOff = -1;
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) {
    const int h = u / 4, qd = u % 4;
    const __m256i ql = load256(b + 64 * h + 32 * (qd & 1)), qh = load256(b + 128 + 32 * h);
    const __m256i lo = _mm256_and_si256(qd < 2 ? ql : _mm256_srli_epi16(ql, 4), bytes(0x0F));
    const __m256i hs = qd == 0 ? _mm256_slli_epi16(qh, 4) : qd == 1 ? _mm256_slli_epi16(qh, 2)
                       : qd == 2 ? qh : _mm256_srli_epi16(qh, 2);  // bits 2qd, 2qd + 1 -> 4, 5
    c[0] = _mm256_or_si256(lo, _mm256_and_si256(hs, bytes(0x30)));
  }
  static constexpr int seg_off(int s) { return 32 * s; }  // ql: 0, 32, 64, 96; qh: 128, 160
  KQ5_FN static __m512i zcode(int u, int q, const __m512i (*T)[4]) {
    const int h = u / 4, qd = u % 4;
    const __m512i ql = T[2 * h + (qd & 1)][q], qh = T[4 + h][q];
    const __m512i lo = _mm512_and_si512(qd < 2 ? ql : _mm512_srli_epi16(ql, 4), _mm512_set1_epi8(0x0F));
    const __m512i hs = qd == 0 ? _mm512_slli_epi16(qh, 4) : qd == 1 ? _mm512_slli_epi16(qh, 2)
                       : qd == 2 ? qh : _mm512_srli_epi16(qh, 2);
    return _mm512_ternarylogic_epi32(hs, _mm512_set1_epi8(0x30), lo, 0xEA);  // (hs & 0x30) | lo
  }
  static constexpr int xoff(int u, int q) { return 32 * u + 8 * q; }
};

struct TQ3K {
  static constexpr bool kPer16 = true, kMin = false, kUnit64 = false, kHi16 = false, kSM = false;
  static constexpr int kOff = 4, kCodeMax = 7, kSegs = 3;  // segment 0: hmask, 1-2: qs
  KQ_FN static void rows(const uint8_t* b, __m128i& hs, __m128i& hm) {
    const uint8_t* s = b + 96;
    const __m128i v8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s));  // bytes 0-7: low 4 bits
    int32_t w;
    std::memcpy(&w, s + 8, 4);                                                  // bytes 8-11: high 2 bits
    const __m128i lo = _mm_unpacklo_epi64(_mm_and_si128(v8, _mm_set1_epi8(0x0F)),
                                          _mm_and_si128(_mm_srli_epi16(v8, 4), _mm_set1_epi8(0x0F)));
    // group g: (byte 8 + g % 4) >> 2 (g / 4): dword q = g / 4 of w shifted right by 2q
    const __m128i hi = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(w), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    hs = hm = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hi, 4)), _mm_set1_epi8(32));
  }
  static constexpr int kDOff = 108, kDmOff = -1;
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) {
    const int h = u / 4, j = u % 4;
    const __m256i qs = load256(b + 32 + 32 * h), hm = load256(b);
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * j), bytes(3));
    const __m256i hb = u >= 2 ? _mm256_srli_epi16(hm, u - 2) : _mm256_slli_epi16(hm, 2 - u);  // bit u -> bit 2
    c[0] = _mm256_or_si256(lo, _mm256_and_si256(hb, bytes(4)));
  }
  static constexpr int seg_off(int s) { return 32 * s; }  // hmask 0, qs 32, 64
  KQ5_FN static __m512i zcode(int u, int q, const __m512i (*T)[4]) {
    const __m512i qs = T[1 + u / 4][q], hm = T[0][q];
    const __m512i lo = _mm512_and_si512(_mm512_srli_epi16(qs, 2 * (u % 4)), _mm512_set1_epi8(3));
    const __m512i hb = u >= 2 ? _mm512_srli_epi16(hm, u - 2) : _mm512_slli_epi16(hm, 2 - u);
    return _mm512_ternarylogic_epi32(hb, _mm512_set1_epi8(4), lo, 0xEA);
  }
  static constexpr int xoff(int u, int q) { return 32 * u + 8 * q; }
};

struct TQ2K {
  static constexpr bool kPer16 = true, kMin = true, kUnit64 = false, kHi16 = false, kSM = false;
  static constexpr int kOff = 0, kCodeMax = 3, kSegs = 2;
  KQ_FN static void rows(const uint8_t* b, __m128i& hs, __m128i& hm) {
    const __m128i v = load128(b);
    hs = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    hm = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
  }
  static constexpr int kDOff = 80, kDmOff = 82;
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) {
    const __m256i qs = load256(b + 16 + 32 * (u / 4));
    c[0] = _mm256_and_si256(_mm256_srli_epi16(qs, 2 * (u % 4)), bytes(3));
  }
  static constexpr int seg_off(int s) { return 16 + 32 * s; }
  KQ5_FN static __m512i zcode(int u, int q, const __m512i (*T)[4]) {
    return _mm512_and_si512(_mm512_srli_epi16(T[u / 4][q], 2 * (u % 4)), _mm512_set1_epi8(3));
  }
  static constexpr int xoff(int u, int q) { return 32 * u + 8 * q; }
};

// IQ4_XS: segment p (32 bytes) holds sub-blocks 2p (bytes 0-15) and 2p + 1 (16-31); a low nibble is weight l of
// its sub-block, the high one weight 16 + l. The ymm paths take the segment as one 64-weight unit with x's bytes
// permuted to [x 0-15 of each sub-block | x 16-31 of each] (the reduction's halves are then the two sub-blocks);
// path 3 reads units 2p (low nibbles) and 2p + 1 (high) of segment p against x's bytes where they belong. The
// code book + 128 as unsigned bytes (offset 128); AVX2 keeps the signed values and the sign trick instead
// (maddubs(|c|, sign(x, c)): u8 up to 241 would saturate maddubs).
struct TIQ4XS {
  static constexpr bool kPer16 = false, kMin = false, kUnit64 = true, kHi16 = false, kSM = false;
  static constexpr int kOff = 128, kCodeMax = 255, kSegs = 4;
  KQ_FN static void rows(const uint8_t* b, __m128i& hs, __m128i& hm) {
    // 8 scales: low 4 bits from scales_l (nibbles), high 2 from scales_h (2 bits each), minus 32
    uint32_t l4;
    std::memcpy(&l4, b + 4, 4);
    const int sh = b[2] | (b[3] << 8);
    const __m128i l = _mm_cvtsi32_si128(static_cast<int>(l4));
    const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(l, _mm_set1_epi8(0x0F)),
                                          _mm_and_si128(_mm_srli_epi16(l, 4), _mm_set1_epi8(0x0F)));  // 8 low parts
    // (sh >> 2j) & 3 for j = 0..7: 16-bit lanes multiplied to put field j at bits 14-15, then shifted down
    const __m128i f = _mm_srli_epi16(_mm_mullo_epi16(_mm_set1_epi16(static_cast<int16_t>(sh)),
                                                     _mm_setr_epi16(1 << 14, 1 << 12, 1 << 10, 1 << 8, 1 << 6, 1 << 4,
                                                                    1 << 2, 1)), 14);
    const __m128i hi = _mm_packus_epi16(f, _mm_setzero_si128());
    hs = hm = _mm_sub_epi8(_mm_or_si128(nib, _mm_slli_epi16(hi, 4)), _mm_setr_epi8(32, 32, 32, 32, 32, 32, 32, 32,
                                                                                    0, 0, 0, 0, 0, 0, 0, 0));
  }
  static constexpr int kDOff = 0, kDmOff = -1;
  template <bool kSigned>
  KQ_FN static void codes_t(const uint8_t* b, int u, __m256i* c) {
    const __m256i raw = load256(b + 8 + 32 * u);
    const __m256i tab = kSigned ? _mm256_broadcastsi128_si256(load128(kIQ4Values))
                                : _mm256_add_epi8(_mm256_broadcastsi128_si256(load128(kIQ4Values)), bytes(128));
    c[0] = _mm256_shuffle_epi8(tab, _mm256_and_si256(raw, bytes(0x0F)));
    c[1] = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(raw, 4), bytes(0x0F)));
  }
  KQ_FN static void codes(const uint8_t* b, int u, __m256i* c) { codes_t<false>(b, u, c); }
  static constexpr int seg_off(int s) { return 8 + 32 * s; }
  KQ5_FN static __m512i zcode(int u, int q, const __m512i (*T)[4]) {
    const __m512i tab = _mm512_add_epi8(_mm512_broadcast_i32x4(load128(kIQ4Values)), _mm512_set1_epi8(static_cast<char>(128)));
    const __m512i raw = T[u / 2][q];
    return _mm512_shuffle_epi8(tab, _mm512_and_si512(u & 1 ? _mm512_srli_epi16(raw, 4) : raw, _mm512_set1_epi8(0x0F)));
  }
  // unit u = (segment u / 2, nibble u % 2); words 0-1: sub-block 2 (u / 2), 2-3: the next one
  static constexpr int xoff(int u, int q) { return 64 * (u / 2) + (q >= 2 ? 32 : 0) + (u & 1 ? 16 : 0) + 8 * (q & 1); }
};

// D (and Dm) of the 8 rows: one 4-byte load per row (d and dmin are adjacent where a type has both).
template <class Tr>
KQ_FN inline void d_dm8(const uint8_t* const blk[8], ScalesT& st) {
  // the 4 bytes from d (d, dmin) or, where d ends the block (Q3_K, Q6_K), the 4 bytes ending with d
  constexpr bool kEnd = !Tr::kMin && Tr::kDOff > 0;
  int32_t w[8];
  for (int r = 0; r < 8; ++r) std::memcpy(w + r, blk[r] + Tr::kDOff - (kEnd ? 2 : 0), 4);
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  const __m256i lo = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), hi = _mm256_srli_epi32(v, 16);
  const __m256i d = kEnd ? hi : lo;
  st.D = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1)));
  if constexpr (Tr::kMin)
    st.Dm = _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1)));
  else
    st.Dm = _mm256_mul_ps(st.D, _mm256_set1_ps(static_cast<float>(Tr::kOff)));
}

// Q4_K / Q5_K's scales of rows a and b at once (scales_k4 on the two 128-bit lanes).
KQ_FN inline __m256i scales_k4x2(const uint8_t* a, const uint8_t* b) {
  const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(load128(a + 4)), load128(b + 4), 1);
  const __m256i lo6 = _mm256_and_si256(v, bytes(0x3F));
  const __m256i top = _mm256_and_si256(_mm256_srli_epi16(v, 2), bytes(0x30));
  const __m256i t = _mm256_shuffle_epi8(v, _mm256_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11,
                                                            8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10, 11));
  const __m256i w = _mm256_blend_epi16(_mm256_and_si256(t, bytes(0x0F)), _mm256_and_si256(_mm256_srli_epi16(t, 4), bytes(0x0F)),
                                       0x0C);
  return _mm256_unpacklo_epi32(lo6, _mm256_or_si256(w, top));
}

// y[j] = [row j | row j + 4] (8 words each) -> out[k] = word k of rows 0 .. 7: the 8 x 8 int16 transpose with both
// 128-bit lanes at work (rows 0-3 in the low lanes, 4-7 in the high ones), then one lane-crossing step per pair.
KQ_FN inline void transpose_words_ymm(const __m256i y[4], __m128i out[8]) {
  const __m256i a0 = _mm256_unpacklo_epi16(y[0], y[1]), a1 = _mm256_unpackhi_epi16(y[0], y[1]);
  const __m256i a2 = _mm256_unpacklo_epi16(y[2], y[3]), a3 = _mm256_unpackhi_epi16(y[2], y[3]);
  const __m256i b[4] = {_mm256_unpacklo_epi32(a0, a2), _mm256_unpackhi_epi32(a0, a2), _mm256_unpacklo_epi32(a1, a3),
                        _mm256_unpackhi_epi32(a1, a3)};  // b[j]: words 2j, 2j + 1 of [rows 0-3 | rows 4-7]
  for (int j = 0; j < 4; ++j) {
    const __m256i o = _mm256_permute4x64_epi64(b[j], 0xD8);  // [word 2j: rows 0-3, 4-7 | word 2j + 1]
    out[2 * j] = _mm256_castsi256_si128(o);
    out[2 * j + 1] = _mm256_extracti128_si256(o, 1);
  }
}

// The 8 rows' scale words transposed, mins, D and Dm for one super-block.
template <class Tr>
KQ_FN inline void scales8(const uint8_t* const blk[8], ScalesT& st) {
  __m256i ys[4], ym[4];
  for (int j = 0; j < 4; ++j) {
    if constexpr (std::is_same<Tr, TQ4K>::value || std::is_same<Tr, TQ5K>::value) {
      const __m256i sm = scales_k4x2(blk[j], blk[j + 4]);
      ys[j] = ym[j] = _mm256_unpacklo_epi8(sm, _mm256_srli_si256(sm, 8));  // words (s_k, m_k)
    } else {
      __m128i s0, m0, s1, m1;
      Tr::rows(blk[j], s0, m0), Tr::rows(blk[j + 4], s1, m1);
      ys[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(s0), s1, 1);
      ym[j] = _mm256_inserti128_si256(_mm256_castsi128_si256(m0), m1, 1);
    }
  }
  transpose_words_ymm(ys, st.xs);
  if (Tr::kMin && !Tr::kSM) transpose_words_ymm(ym, st.xm);
  else for (int k = 0; k < 8; ++k) st.xm[k] = st.xs[k];
  d_dm8<Tr>(blk, st);
}

// ------------------------------------------------------------------------------------------- x side
// One call's x rows: the int8 bytes (KAct; for the ymm IQ4_XS kernels also permuted), and per pair index k of
// each super-block two floats for the halves A, B: dx, and dx * sum(xq) (the mins' / offsets' multiplier).
struct XSide {
  const KAct* a = nullptr;
  std::vector<int8_t> perm;
  std::vector<float> dxp, sxp;  // (M, K / 32, 2)
  const int8_t* bytes(int64_t r) const { return perm.empty() ? a->q.data() + r * a->K : perm.data() + r * a->K; }
};

template <class Tr>
inline void prepare_x(const KAct& a, XSide& xs, bool permute) {
  const int64_t K = a.K, nb = K / kXBlock;
  xs.a = &a;
  xs.dxp.assign(a.M * nb * 2, 0.f), xs.sxp.assign(a.M * nb * 2, 0.f);
  if (permute) xs.perm.resize(a.M * K);
  for (int64_t r = 0; r < a.M; ++r)
    for (int64_t k = 0; k < nb; ++k) {  // k: pair index over the whole row (8 per super-block)
      const int64_t sb = k / 8, kk = k % 8, base = r * nb + sb * 8;
      float* dp = xs.dxp.data() + (r * nb + k) * 2;
      float* sp = xs.sxp.data() + (r * nb + k) * 2;
      auto s16 = [&](int64_t b, int h) { return a.s16[(r * nb + b) * 2 + h]; };
      if (Tr::kUnit64) {  // IQ4_XS: pair k < 4 = sub-blocks 2k, 2k + 1 (full 32-sums)
        if (kk >= 4) continue;
        for (int h = 0; h < 2; ++h) {
          const int64_t b = sb * 8 + 2 * kk + h;
          dp[h] = a.dx[r * nb + b];
          sp[h] = a.dx[r * nb + b] * static_cast<float>(s16(b, 0) + s16(b, 1));
        }
      } else {  // unit kk: halves of x block b = sb * 8 + kk
        const int64_t b = sb * 8 + kk;
        const float dx = a.dx[base + kk];
        dp[0] = dp[1] = dx;
        if (Tr::kPer16) sp[0] = dx * static_cast<float>(s16(b, 0)), sp[1] = dx * static_cast<float>(s16(b, 1));
        else sp[0] = dx * static_cast<float>(s16(b, 0) + s16(b, 1));  // per-32 mins: in half A
      }
    }
  if (permute)
    for (int64_t r = 0; r < a.M; ++r)
      for (int64_t u = 0; u < K / 64; ++u) {  // [x 0-15 of sub-block 2u, of 2u + 1 | x 16-31 of 2u, of 2u + 1]
        const int8_t* src = a.q.data() + r * K + 64 * u;
        int8_t* dst = xs.perm.data() + r * K + 64 * u;
        std::memcpy(dst, src, 16), std::memcpy(dst + 16, src + 32, 16);
        std::memcpy(dst + 32, src + 16, 16), std::memcpy(dst + 48, src + 48, 16);
      }
}

// prefetcht0 as inline assembly: GCC deletes a loop whose only statements are __builtin_prefetch / _mm_prefetch
// (no side effects, so the loop is dead code; found here: the loop below compiled to nothing, and DRAM-bound
// matrices ran 3x slower). An asm volatile statement is never removed.
inline void prefetch_l1(const char* p) { asm volatile("prefetcht0 %0" : : "m"(*p)); }

// The next tile (rows n + 8 .. n + 15, contiguous), the share of super-block i (8 block sizes). (One tile ahead
// measured as fast as two or three for Q4_K and 10 % faster for Q6_K on the AVX2 path, whose tiles are larger.)
KQ_FN inline void prefetch_share(const GMat& w, int64_t n, int64_t i, int64_t bb) {
  const int64_t first = std::min(n + 8, w.N), last = std::min(n + 16, w.N);
  const char* p = reinterpret_cast<const char*>(w.raw + first * w.row_bytes);
  const int64_t end = std::min((last - first) * w.row_bytes, (i + 1) * 8 * bb);
  for (int64_t o = i * 8 * bb; o < end; o += 64) prefetch_l1(p + o);
}

// ------------------------------------------------------------------------------------------- ymm kernels (1, 2)
// The reductions of 4 rows' vectors use unpacks and adds rather than hadds (single-uop instructions instead of
// multi-uop ones; measured about the same speed on this Zen 5 core, where the kernel is not bound by them).
// 4 rows' int16 vectors (per 128-bit lane: 8 words of one half) -> per lane [r0 r0 r1 r1 r2 r2 r3 r3], each word a
// sum of 4 of the inputs' words of its row (the sums of two words per row add up to the row's half).
KQ_FN inline __m256i reduce4_epi16(const __m256i* P) {
  const __m256i t01 = _mm256_add_epi16(_mm256_unpacklo_epi32(P[0], P[1]), _mm256_unpackhi_epi32(P[0], P[1]));
  const __m256i t23 = _mm256_add_epi16(_mm256_unpacklo_epi32(P[2], P[3]), _mm256_unpackhi_epi32(P[2], P[3]));
  return _mm256_add_epi16(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}
// 4 rows' int32 vectors -> per 128-bit lane [r0 r1 r2 r3] (each the sum of the row's 4 dwords of that lane).
KQ_FN inline __m256i reduce4_epi32(const __m256i* P) {
  const __m256i t01 = _mm256_add_epi32(_mm256_unpacklo_epi32(P[0], P[1]), _mm256_unpackhi_epi32(P[0], P[1]));
  const __m256i t23 = _mm256_add_epi32(_mm256_unpacklo_epi32(P[2], P[3]), _mm256_unpackhi_epi32(P[2], P[3]));
  return _mm256_add_epi32(_mm256_unpacklo_epi64(t01, t23), _mm256_unpackhi_epi64(t01, t23));
}

// Whether the ymm kernel takes an offset type's codes through int16 sums with the offset subtracted there (the
// codes within 32 of the offset: Q3_K, Q6_K), so that no float offset term is needed.
template <class Tr, int ISA, bool kSigned>
constexpr bool ymm_offset_int16() {
  return ISA != kIsaAvx512Vnni && !kSigned && !Tr::kUnit64 && Tr::kOff > 0 && Tr::kOff <= 32 && Tr::kCodeMax < 2 * Tr::kOff;
}

// One unit of 8 rows (codes c[r * V + v]) against x's unit bytes xb: adds dx * (s_A S_A + s_B S_B) into f0 (rows
// 0-3: [half A | half B]) and f1 (rows 4-7).
template <class Tr, int ISA, bool kSigned, class Codes>
KQ_FN inline void unit8(const Codes& c, const int8_t* xb, const float* dxp, const __m128i& xsk, __m256& f0,
                        __m256& f1) {
  constexpr int V = Tr::kUnit64 ? 2 : 1;
  __m256i X[V];
  for (int v = 0; v < V; ++v) X[v] = load256(xb + 32 * v);
  __m256i g0, g1;
  if constexpr (ymm_offset_int16<Tr, ISA, kSigned>()) {
    // offset codes (Q3_K, Q6_K): maddubs(c, x) - maddubs(o, x) = pair sums of (c - o) x, |.| <= 2 * 32 * 127; after
    // two reduction levels 8 products (<= 32512, int16); the offset needs no float term then (llama.cpp's
    // vec_dot_q6_K subtracts its 32 the same way, with one maddubs of x shared by the rows)
    const __m256i ox = _mm256_maddubs_epi16(bytes(Tr::kOff), X[0]);
    __m256i P[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) P[r] = _mm256_sub_epi16(_mm256_maddubs_epi16(c(r, 0), X[0]), ox);
    const __m256i l0 = reduce4_epi16(P), l1 = reduce4_epi16(P + 4);
    const __m128i s0 = _mm_shuffle_epi8(xsk, _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 1, 1, 3, 3, 5, 5, 7, 7));
    const __m128i s1 = _mm_shuffle_epi8(xsk, _mm_setr_epi8(8, 8, 10, 10, 12, 12, 14, 14, 9, 9, 11, 11, 13, 13, 15, 15));
    g0 = _mm256_madd_epi16(l0, _mm256_cvtepi8_epi16(s0));
    g1 = _mm256_madd_epi16(l1, _mm256_cvtepi8_epi16(s1));
  } else if constexpr (ISA != kIsaAvx512Vnni && !kSigned && Tr::kCodeMax <= 31 && V == 1) {
    // (on the AVX-VNNI path as well: measured as fast as vpdpbusd + int32 sums + mullo, or faster)
    // int16 sums: 2 products per maddubs word, 8 after the two reduction levels (<= 8 * 31 * 127 < 2^15); the
    // scales come in with madd: [s_A(r) x2 for rows 0-3 | s_B(r) x2]
    __m256i P[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) P[r] = _mm256_maddubs_epi16(c(r, 0), X[0]);
    const __m256i l0 = reduce4_epi16(P), l1 = reduce4_epi16(P + 4);
    constexpr int b = Tr::kSM ? 0 : 1;  // the byte of half B's scale in a word ((s, m) words: s for both)
    const __m128i s0 = _mm_shuffle_epi8(xsk, _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, b, b, 2 + b, 2 + b, 4 + b, 4 + b,
                                                           6 + b, 6 + b));
    const __m128i s1 = _mm_shuffle_epi8(xsk, _mm_setr_epi8(8, 8, 10, 10, 12, 12, 14, 14, 8 + b, 8 + b, 10 + b, 10 + b,
                                                           12 + b, 12 + b, 14 + b, 14 + b));
    g0 = _mm256_madd_epi16(l0, _mm256_cvtepi8_epi16(s0));
    g1 = _mm256_madd_epi16(l1, _mm256_cvtepi8_epi16(s1));
  } else {
    __m256i P[8];
#pragma GCC unroll 8
    for (int r = 0; r < 8; ++r) {
      P[r] = _mm256_setzero_si256();
#pragma GCC unroll 2
      for (int v = 0; v < V; ++v) {
        const __m256i cv = c(r, v);
        if constexpr (kSigned)  // |c| x sign(x, c): |products| <= 127 * 127, the pair sums fit int16
          P[r] = _mm256_add_epi32(P[r], _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(cv, cv),
                                                                               _mm256_sign_epi8(X[v], cv)),
                                                          _mm256_set1_epi16(1)));
        else if constexpr (ISA == kIsaAvx2)  // codes <= 63 here: pair sums <= 2 * 63 * 127 fit int16
          P[r] = _mm256_add_epi32(P[r], _mm256_madd_epi16(_mm256_maddubs_epi16(cv, X[v]), _mm256_set1_epi16(1)));
        else
          P[r] = dpbusd256<ISA>(P[r], cv, X[v]);
      }
    }
    g0 = reduce4_epi32(P), g1 = reduce4_epi32(P + 4);
    constexpr int b = Tr::kSM ? 0 : 1;
    // [A0 B0 A1 B1 ..] -> [A0 A1 A2 A3 | B0 B1 B2 B3] (rows 0-3), and rows 4-7
    const __m128i s = _mm_shuffle_epi8(xsk, _mm_setr_epi8(0, 2, 4, 6, b, 2 + b, 4 + b, 6 + b, 8, 10, 12, 14, 8 + b,
                                                          10 + b, 12 + b, 14 + b));
    g0 = _mm256_mullo_epi32(g0, _mm256_cvtepi8_epi32(s));
    g1 = _mm256_mullo_epi32(g1, _mm256_cvtepi8_epi32(_mm_srli_si128(s, 8)));
  }
  const __m256 dx = V == 1 ? _mm256_broadcast_ss(dxp)  // both halves: one x block
                           : _mm256_permutevar8x32_ps(_mm256_castpd_ps(_mm256_set1_pd(pair_of(dxp))),
                                                      _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1));
  f0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g0), dx, f0);
  f1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(g1), dx, f1);
}

// [rows 0-3 half A | rows 0-3 half B] and the same for rows 4-7 -> rows 0..7.
KQ_FN inline __m256 fold_halves(__m256 f0, __m256 f1) {
  return _mm256_add_ps(_mm256_permute2f128_ps(f0, f1, 0x20), _mm256_permute2f128_ps(f0, f1, 0x31));
}

// (s, m) words: sum_k m_k sxf_k with the 8 rows' m_k as the words' high bytes (rows 0..7 in the lanes).
KQ_FN inline __m256 min_term8_sm(const __m128i* xw, const float* sxp) {
  __m256 m = _mm256_setzero_ps();
  for (int k = 0; k < 8; ++k)
    m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_cvtepi16_epi32(xw[k]), 8)),
                        _mm256_broadcast_ss(sxp + 2 * k), m);
  return m;
}

// sum_k m_k * sxf_k over the super-block's pairs: m as [A0 B0 A1 B1 ..] per row, sxf (A, B) -> rows 0..7.
KQ_FN inline __m256 min_term8(const __m128i* xm, const float* sxp, int pairs) {
  __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
  for (int k = 0; k < pairs; ++k) {
    const __m256 s = _mm256_castpd_ps(_mm256_set1_pd(pair_of(sxp + 2 * k)));
    m0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(xm[k])), s, m0);
    m1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(xm[k], 8))), s, m1);
  }
  // [r0A r0B r1A r1B r2A r2B r3A r3B], rows 4-7 -> hadd: [r0 r1 r4 r5 | r2 r3 r6 r7]
  return _mm256_permutevar8x32_ps(_mm256_hadd_ps(m0, m1), _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7));
}

// Row r's codes (vector v) of unit u: straight from the block (M = 1; the compiler keeps them in registers) or
// from the super-block's buffer (M > 1).
template <class Tr, bool kSigned>
struct YDirect {
  const uint8_t* const* blk;
  int u;
  KQ_FN __m256i operator()(int r, int v) const {
    __m256i c[2];
    if constexpr (kSigned) Tr::template codes_t<true>(blk[r], u, c);
    else Tr::codes(blk[r], u, c);
    return c[v];
  }
};
template <int V>
struct YBuffered {
  const __m256i* c;
  KQ_FN __m256i operator()(int r, int v) const { return _mm256_load_si256(c + r * V + v); }
};

// Weight rows n0 .. n1 (tiles of 8; a ragged last tile repeats its last row and stores only the valid ones)
// against every x row.
template <class Tr, int ISA>
KQ_FN void tile8_ymm(const XSide& xs, const GMat& w, float* y, int64_t n0, int64_t n1) {
  constexpr bool kSigned = Tr::kUnit64 && ISA == kIsaAvx2;
  constexpr int V = Tr::kUnit64 ? 2 : 1, U = Tr::kUnit64 ? 4 : 8;
  const int64_t nsb = w.K / kQK, bb = block_bytes(w.type), M = xs.a->M, nb = w.K / kXBlock;
  ScalesT st;
  std::vector<float> accs(M * 8);  // (M, 8) float accumulators (std::vector does not align __m256)
  float* acc = accs.data();
  alignas(32) __m256i cbuf[8 * 8 * 2];  // M > 1: one super-block's codes (unit, row, v)
  for (int64_t n = n0; n < n1; n += 8) {
    const int64_t valid = std::min<int64_t>(8, n1 - n);
    const uint8_t* rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w.raw + (n + std::min<int64_t>(r, valid - 1)) * w.row_bytes;
    std::fill(accs.begin(), accs.end(), 0.f);
    for (int64_t i = 0; i < nsb; ++i) {
      prefetch_share(w, n, i, bb);
      const uint8_t* blk[8];
      for (int r = 0; r < 8; ++r) blk[r] = rows[r] + i * bb;
      scales8<Tr>(blk, st);
      if (M > 1)
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u)
#pragma GCC unroll 8
          for (int r = 0; r < 8; ++r) {
            if constexpr (kSigned) Tr::template codes_t<true>(blk[r], u, cbuf + (u * 8 + r) * V);
            else Tr::codes(blk[r], u, cbuf + (u * 8 + r) * V);
          }
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xb = xs.bytes(m) + i * kQK;
        const float* dxp = xs.dxp.data() + (m * nb + i * 8) * 2;
        __m256 f0 = _mm256_setzero_ps(), f1 = f0;
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) {
          if (M == 1) {
            unit8<Tr, ISA, kSigned>(YDirect<Tr, kSigned>{blk, u}, xb + u * 32 * V, dxp + 2 * u, st.xs[u], f0, f1);
          } else {
            unit8<Tr, ISA, kSigned>(YBuffered<V>{cbuf + u * 8 * V}, xb + u * 32 * V, dxp + 2 * u, st.xs[u], f0, f1);
          }
        }
        __m256 t = _mm256_fmadd_ps(st.D, fold_halves(f0, f1), _mm256_loadu_ps(acc + 8 * m));
        if constexpr (Tr::kSM)
          t = _mm256_fnmadd_ps(st.Dm, min_term8_sm(st.xs, xs.sxp.data() + (m * nb + i * 8) * 2), t);
        else if constexpr (Tr::kMin || (Tr::kOff > 0 && !kSigned && !ymm_offset_int16<Tr, ISA, kSigned>()))
          t = _mm256_fnmadd_ps(st.Dm, min_term8(st.xm, xs.sxp.data() + (m * nb + i * 8) * 2, U), t);
        _mm256_storeu_ps(acc + 8 * m, t);
      }
    }
    for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * w.N + n, acc + 8 * m, valid * sizeof(float));
  }
}

// ------------------------------------------------------------------------------------------- zmm kernel (3)
// The order of the 8 rows in path 3's lanes (see transpose_seg; an involution).
constexpr int kRowOrder[8] = {0, 1, 4, 5, 2, 3, 6, 7};
// Q4_K / Q5_K's scales of 4 rows at once (scales_k4 on the four 128-bit lanes).
KQ5_FN inline __m512i scales_k4x4(const uint8_t* const* b) {
  __m512i v = _mm512_castsi128_si512(load128(b[0] + 4));
  v = _mm512_inserti32x4(v, load128(b[1] + 4), 1);
  v = _mm512_inserti32x4(v, load128(b[2] + 4), 2);
  v = _mm512_inserti32x4(v, load128(b[3] + 4), 3);
  const __m512i lo6 = _mm512_and_si512(v, _mm512_set1_epi8(0x3F));
  const __m512i top = _mm512_and_si512(_mm512_srli_epi16(v, 2), _mm512_set1_epi8(0x30));
  const __m512i t = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(8, 9, 10, 11, 8, 9, 10, 11, 8, 9, 10,
                                                                                11, 8, 9, 10, 11)));
  const __m512i w = _mm512_mask_blend_epi16(0xCCCCCCCC, _mm512_and_si512(t, _mm512_set1_epi8(0x0F)),
                                            _mm512_and_si512(_mm512_srli_epi16(t, 4), _mm512_set1_epi8(0x0F)));
  return _mm512_unpacklo_epi32(lo6, _mm512_or_si512(w, top));  // per lane: s0 .. s7, m0 .. m7
}

// Rows 0-3 (a) and 4-7 (b), 8 words each per 128-bit lane -> out[k] = word k of the 8 rows in kRowOrder
// (vpermt2w: an 8 x 8 int16 transpose in two instructions).
KQ5_FN inline void transpose_words_zmm(__m512i a, __m512i b, __m128i out[8]) {
  // word 8 kk + j of output j2 = word 4 j2 + kk of row kRowOrder[j] (row r: word 8 r + k of a, b)
  alignas(64) static const int16_t idx[2][32] = {
      {0, 8, 32, 40, 16, 24, 48, 56, 1, 9, 33, 41, 17, 25, 49, 57, 2, 10, 34, 42, 18, 26, 50, 58, 3, 11, 35, 43, 19, 27, 51, 59},
      {4, 12, 36, 44, 20, 28, 52, 60, 5, 13, 37, 45, 21, 29, 53, 61, 6, 14, 38, 46, 22, 30, 54, 62, 7, 15, 39, 47, 23, 31, 55, 63}};
  for (int j = 0; j < 2; ++j) {
    const __m512i o = _mm512_permutex2var_epi16(a, _mm512_load_si512(idx[j]), b);
    out[4 * j] = _mm512_castsi512_si128(o);
    out[4 * j + 1] = _mm512_extracti32x4_epi32(o, 1);
    out[4 * j + 2] = _mm512_extracti32x4_epi32(o, 2);
    out[4 * j + 3] = _mm512_extracti32x4_epi32(o, 3);
  }
}

template <class Tr>
KQ5_FN inline void scales8_zmm(const uint8_t* const blk[8], ScalesT& st) {
  __m512i hs[2], hm[2];
  if constexpr (std::is_same<Tr, TQ4K>::value || std::is_same<Tr, TQ5K>::value) {
    for (int g = 0; g < 2; ++g) {
      const __m512i sm = scales_k4x4(blk + 4 * g);
      hs[g] = hm[g] = _mm512_unpacklo_epi8(sm, _mm512_bsrli_epi128(sm, 8));  // words (s_k, m_k)
    }
  } else {
    for (int g = 0; g < 2; ++g) {
      __m128i s[4], m[4];
      for (int r = 0; r < 4; ++r) Tr::rows(blk[4 * g + r], s[r], m[r]);
      hs[g] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(s[0]), s[1], 1), s[2], 2), s[3], 3);
      hm[g] = _mm512_inserti32x4(_mm512_inserti32x4(_mm512_inserti32x4(_mm512_castsi128_si512(m[0]), m[1], 1), m[2], 2), m[3], 3);
    }
  }
  transpose_words_zmm(hs[0], hs[1], st.xs);
  if (Tr::kMin && !Tr::kSM) transpose_words_zmm(hm[0], hm[1], st.xm);
  else for (int k = 0; k < 8; ++k) st.xm[k] = st.xs[k];
  d_dm8<Tr>(blk, st);
  if constexpr (Tr::kSM) {
    const __m256i order = _mm256_setr_epi32(kRowOrder[0], kRowOrder[1], kRowOrder[2], kRowOrder[3], kRowOrder[4],
                                            kRowOrder[5], kRowOrder[6], kRowOrder[7]);
    st.D_o = _mm256_permutevar8x32_ps(st.D, order), st.Dm_o = _mm256_permutevar8x32_ps(st.Dm, order);
  }
}

// Segment s of the 8 rows' block (32 bytes each) transposed by 8-byte words: T[q] = word q of every row, rows in
// the lane order kRowOrder (lanes 2j, 2j + 1: row kRowOrder[j]): in-lane unpacks of [row k | row k + 4] pairs,
// then 128-bit lane shuffles (cheaper than full two-source permutes; the order is undone when the rows are stored).
KQ5_FN inline void transpose_seg(const uint8_t* const blk[8], int off, __m512i T[4]) {
  __m512i Z[4];
  for (int k = 0; k < 4; ++k)  // [row k | row k + 4]
    Z[k] = _mm512_inserti64x4(_mm512_castsi256_si512(load256(blk[k] + off)), load256(blk[k + 4] + off), 1);
  // lanes: [r0 w0, r1 w0 | r0 w2, r1 w2 | r4 w0, r5 w0 | r4 w2, r5 w2] and the same for words 1, 3
  const __m512i l01 = _mm512_unpacklo_epi64(Z[0], Z[1]), h01 = _mm512_unpackhi_epi64(Z[0], Z[1]);
  const __m512i l23 = _mm512_unpacklo_epi64(Z[2], Z[3]), h23 = _mm512_unpackhi_epi64(Z[2], Z[3]);
  T[0] = _mm512_shuffle_i64x2(l01, l23, 0x88);  // lanes 0, 2 of each: [r0 r1 | r4 r5 | r2 r3 | r6 r7] word 0
  T[2] = _mm512_shuffle_i64x2(l01, l23, 0xDD);  // lanes 1, 3: word 2
  T[1] = _mm512_shuffle_i64x2(h01, h23, 0x88);
  T[3] = _mm512_shuffle_i64x2(h01, h23, 0xDD);
}

// Lanes (2r, 2r + 1) of a (half A) and b (half B) -> [sum_A(r), sum_B(r)].
KQ5_FN inline __m512i pair_ab(__m512i a, __m512i b) {
  const __m512i t1 = _mm512_mask_blend_epi32(0xAAAA, a, b), t2 = _mm512_mask_blend_epi32(0xAAAA, b, a);
  return _mm512_add_epi32(t1, _mm512_shuffle_epi32(t2, _MM_PERM_CDAB));
}

// (s, m)-word types (per-32 scale, one x block per unit): both halves summed, the row sums in the even dwords
// multiplied by s (vpmuldq), as 8 floats (rows in kRowOrder).
template <class Tr, class Codes>
KQ5_FN inline __m256 zrow_sm(const Codes& codes, const int8_t* xb, const float* dxp, const ScalesT& st) {
  __m256 f = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int u = 0; u < 8; ++u) {
    __m512i acc = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      int64_t xw;
      std::memcpy(&xw, xb + Tr::xoff(u, q), 8);
      acc = _mm512_dpbusd_epi32(acc, codes(u, q), _mm512_set1_epi64(xw));
    }
    acc = _mm512_add_epi32(acc, _mm512_shuffle_epi32(acc, _MM_PERM_CDAB));
    if (Tr::kHi16 && (u & 1)) acc = _mm512_srai_epi32(acc, 4);  // Q4_K's high nibbles were 16 q
    const __m512i s = _mm512_and_si512(_mm512_cvtepu16_epi64(st.xs[u]), _mm512_set1_epi64(0xFF));
    f = _mm256_fmadd_ps(_mm512_cvtepi64_ps(_mm512_mul_epi32(acc, s)), _mm256_broadcast_ss(dxp + 2 * u), f);
  }
  return f;
}

// Sum over super-block units of one x row against the transposed codes (codes(u, q) yields a 512-bit vector):
// returns the 16-lane float sum_u dx (s_A S_A, s_B S_B) per row (lanes 2r, 2r + 1).
template <class Tr, class Codes>
KQ5_FN inline __m512 zrow(const Codes& codes, const int8_t* xb, const float* dxp, const ScalesT& st) {
  __m512 f = _mm512_setzero_ps();
  __m512i accA = _mm512_setzero_si512(), accB = accA;
#pragma GCC unroll 8
  for (int u = 0; u < 8; ++u) {
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      int64_t xw;
      std::memcpy(&xw, xb + Tr::xoff(u, q), 8);
      const __m512i xv = _mm512_set1_epi64(xw);
      if (q < 2) accA = _mm512_dpbusd_epi32(accA, codes(u, q), xv);
      else accB = _mm512_dpbusd_epi32(accB, codes(u, q), xv);
    }
    if (Tr::kUnit64 && !(u & 1)) continue;  // IQ4_XS: both nibbles of a segment, then its two sub-blocks
    const int k = Tr::kUnit64 ? u / 2 : u;
    __m512i c = pair_ab(accA, accB);
    if (Tr::kHi16 && (u & 1)) c = _mm512_srai_epi32(c, 4);  // Q4_K's high nibbles were 16 q
    c = _mm512_mullo_epi32(c, _mm512_cvtepi8_epi32(st.xs[k]));
    const __m512 dx = _mm512_castpd_ps(_mm512_set1_pd(pair_of(dxp + 2 * k)));
    f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), dx, f);
    accA = accB = _mm512_setzero_si512();
  }
  return f;
}

// 16 lanes (row pairs, in kRowOrder) -> rows 0 .. 7.
KQ5_FN inline __m256 fold_pairs(__m512 f) {
  const __m512 s = _mm512_add_ps(f, _mm512_permute_ps(f, 0xB1));
  // row r is in lanes 2j, j = position of r in kRowOrder (an involution: j = kRowOrder[r])
  return _mm512_castps512_ps256(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 8, 10, 4, 6, 12, 14, 0, 2, 8, 10, 4, 6, 12, 14), s));
}

KQ5_FN inline __m256 min_term16(const __m128i* xm, const float* sxp, int pairs) {
  __m512 m = _mm512_setzero_ps();
  for (int k = 0; k < pairs; ++k)
    m = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(xm[k])),
                        _mm512_castpd_ps(_mm512_set1_pd(pair_of(sxp + 2 * k))), m);
  return fold_pairs(m);
}

// Unit u's codes in word q: computed from the transposed segments (M = 1) or read back from the super-block's
// buffer (M > 1). (Functors, not lambdas: a lambda does not inherit the target attribute, and would not inline.)
template <class Tr>
struct ZDirect {
  const __m512i (*T)[4];
  KQ5_FN __m512i operator()(int u, int q) const { return Tr::zcode(u, q, T); }
};
struct ZBuffered {
  const __m512i* z;
  KQ5_FN __m512i operator()(int u, int q) const { return _mm512_load_si512(z + u * 4 + q); }
};

template <class Tr>
KQ5_FN void tile8_zmm(const XSide& xs, const GMat& w, float* y, int64_t n0, int64_t n1) {
  const int64_t nsb = w.K / kQK, bb = block_bytes(w.type), M = xs.a->M, nb = w.K / kXBlock;
  ScalesT st;
  std::vector<float> accs(M * 8);
  float* acc = accs.data();
  std::vector<uint8_t> zstore(8 * 4 * 64 + 64);  // M > 1: one super-block's transposed codes (unit, word)
  __m512i* zbuf = reinterpret_cast<__m512i*>((reinterpret_cast<uintptr_t>(zstore.data()) + 63) & ~uintptr_t(63));
  for (int64_t n = n0; n < n1; n += 8) {
    const int64_t valid = std::min<int64_t>(8, n1 - n);
    const uint8_t* rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w.raw + (n + std::min<int64_t>(r, valid - 1)) * w.row_bytes;
    std::fill(accs.begin(), accs.end(), 0.f);
    for (int64_t i = 0; i < nsb; ++i) {
      prefetch_share(w, n, i, bb);
      const uint8_t* blk[8];
      for (int r = 0; r < 8; ++r) blk[r] = rows[r] + i * bb;
      scales8_zmm<Tr>(blk, st);
      __m512i T[Tr::kSegs][4];
#pragma GCC unroll 6
      for (int s = 0; s < Tr::kSegs; ++s) transpose_seg(blk, Tr::seg_off(s), T[s]);
      if (M > 1)
#pragma GCC unroll 8
        for (int u = 0; u < 8; ++u)
#pragma GCC unroll 4
          for (int q = 0; q < 4; ++q) _mm512_store_si512(zbuf + u * 4 + q, Tr::zcode(u, q, T));
      const ZDirect<Tr> direct{T};
      const ZBuffered buffered{zbuf};
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xb = xs.bytes(m) + i * kQK;
        const float* dxp = xs.dxp.data() + (m * nb + i * 8) * 2;
        const float* sxp = xs.sxp.data() + (m * nb + i * 8) * 2;
        __m256 t;
        if constexpr (Tr::kSM) {  // scale and min terms in kRowOrder, put back in row order once
          const __m256 f = M == 1 ? zrow_sm<Tr>(direct, xb, dxp, st) : zrow_sm<Tr>(buffered, xb, dxp, st);
          const __m256i order = _mm256_setr_epi32(kRowOrder[0], kRowOrder[1], kRowOrder[2], kRowOrder[3], kRowOrder[4],
                                                  kRowOrder[5], kRowOrder[6], kRowOrder[7]);
          const __m256 fr = _mm256_permutevar8x32_ps(_mm256_fnmadd_ps(st.Dm_o, min_term8_sm(st.xs, sxp), _mm256_mul_ps(st.D_o, f)), order);
          t = _mm256_add_ps(fr, _mm256_loadu_ps(acc + 8 * m));
        } else {
          const __m512 f = M == 1 ? zrow<Tr>(direct, xb, dxp, st) : zrow<Tr>(buffered, xb, dxp, st);
          t = _mm256_fmadd_ps(st.D, fold_pairs(f), _mm256_loadu_ps(acc + 8 * m));
          if constexpr (Tr::kMin || Tr::kOff > 0)
            t = _mm256_fnmadd_ps(st.Dm, min_term16(st.xm, sxp, Tr::kUnit64 ? 4 : 8), t);
        }
        _mm256_storeu_ps(acc + 8 * m, t);
      }
    }
    for (int64_t m = 0; m < M; ++m) std::memcpy(y + m * w.N + n, acc + 8 * m, valid * sizeof(float));
  }
}

template <class Tr>
inline void gemm_simd(const KAct& a, const GMat& w, float* y, int isa) {
  XSide xs;
  prepare_x<Tr>(a, xs, Tr::kUnit64 && isa != kIsaAvx512Vnni);
  const int64_t tiles = (w.N + 7) / 8;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, w.K * a.M * 8));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * 8, n1 = std::min(w.N, t1 * 8);
    if (isa == kIsaAvx512Vnni) tile8_zmm<Tr>(xs, w, y, n0, n1);
    else if (isa == kIsaAvxVnni) tile8_ymm<Tr, kIsaAvxVnni>(xs, w, y, n0, n1);
    else tile8_ymm<Tr, kIsaAvx2>(xs, w, y, n0, n1);
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

inline int best_isa_path() {
  return scratchlm_simd::cpu_has_avx512vnni() ? kPathAvx512Vnni : scratchlm_simd::cpu_has_avxvnni() ? kPathAvxVnni
         : scratchlm_simd::cpu_has_avx2() ? kPathAvx2 : kPathScalar;
}

inline bool path_available(int p) {
  switch (p) {
    case kPathScalar: return true;
    case kPathAvx2: return scratchlm_simd::cpu_has_avx2();
    case kPathAvxVnni: return scratchlm_simd::cpu_has_avxvnni();
    case kPathAvx512Vnni: return scratchlm_simd::cpu_has_avx512vnni();
    default: return false;
  }
}

inline int resolve_path(const GMat& w, int64_t M, int path) {
  (void)w, (void)M;
  TORCH_CHECK(path >= -1 && path <= 3, "gguf_kquants: path ", path, " is not one of -1 (best), 0 (scalar), 1 (AVX2), "
              "2 (AVX-VNNI), 3 (AVX512-VNNI)");
  if (path == -1 || !path_available(path)) return best_isa_path();
  return path;
}

// x rounded to int8 as resolved path p does it (the SIMD paths: the AVX2 loop; the scalar path: the scalar one).
inline void quantize_x(const float* x, int64_t M, int64_t K, KAct& a, int p) {
#ifdef SCRATCHLM_X86
  if (p != kPathScalar) return quantize_x_avx2(x, M, K, a);
#endif
  (void)p;
  quantize_x_scalar(x, M, K, a);
}

// Rows rows[0 .. n) of `all` into out (a row's rounding does not depend on the other rows: these are the bits
// quantize_x makes of those rows of x alone).
inline void gather_rows(const KAct& all, const int64_t* rows, int64_t n, KAct& out) {
  const int64_t K = all.K, nb = K / kXBlock;
  out.M = n, out.K = K;
  out.q.resize(n * K), out.dx.resize(n * nb), out.s16.resize(n * K / 16);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t r = rows[j];
    std::memcpy(out.q.data() + j * K, all.q.data() + r * K, K);
    std::memcpy(out.dx.data() + j * nb, all.dx.data() + r * nb, nb * sizeof(float));
    std::memcpy(out.s16.data() + j * 2 * nb, all.s16.data() + r * 2 * nb, 2 * nb * sizeof(int32_t));
  }
}

// y (a.M, N) = the rounded rows `a` (quantize_x at the same p) times W^T at resolved path p.
inline void gemm_rounded(const KAct& a, const GMat& w, float* y, int p) {
  check(w);
  TORCH_CHECK(a.K == w.K, "gguf_kquants: rounded x has K = ", a.K, ", the weight ", w.K);
#ifdef SCRATCHLM_X86
  if (p != kPathScalar) return gemm_simd_any(a, w, y, p);
#endif
  constexpr int64_t kRows = 8;
  const int64_t tiles = (w.N + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, w.K * a.M * kRows));
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    rows_scalar(a, w, y, t0 * kRows, std::min(w.N, t1 * kRows));
  });
}

inline void gemm(const float* x, int64_t M, const GMat& w, float* y, int path) {
  check(w);
  const int p = resolve_path(w, M, path);
  KAct a;
  quantize_x(x, M, w.K, a, p);
  gemm_rounded(a, w, y, p);
}

}  // namespace kq

// ------------------------------------------------------------------------------------------- the interface
inline bool kq_handles(GType t) { return kq::handles(t); }
// Rows n0 .. n1 of W as float32 into out ((n1 - n0), K): exactly gguf.quants' values.
inline void kq_dequantize_rows(const GMat& w, int64_t n0, int64_t n1, float* out) { kq::dequantize_rows(w, n0, n1, out); }
// The path kq_gemm runs for M rows of x when asked for `path` (-1: the default for this CPU and M).
inline int kq_resolve_path(const GMat& w, int64_t M, int path) { return kq::resolve_path(w, M, path); }
// y (M, N) = x (M, K) W^T, x and y float32 row-major; path: see the top of this file.
inline void kq_gemm(const float* x, int64_t M, const GMat& w, float* y, int path) { kq::gemm(x, M, w, y, path); }
// The same in two steps (moe.h: x rounded once for all rows, each expert's rows gathered): x rounded to int8 as
// resolved path p rounds it, then y (a.M, N) = those rows times W^T at p.
using kq::KAct;
inline void kq_quantize_x(const float* x, int64_t M, int64_t K, KAct& a, int p) { kq::quantize_x(x, M, K, a, p); }
inline void kq_gemm_rounded(const KAct& a, const GMat& w, float* y, int p) { kq::gemm_rounded(a, w, y, p); }

}  // namespace scratchlm_gguf
