// GGUF's 32-weight block types beyond Q4_0 / Q4_1 / Q8_0, read in the file's own blocks (no repacking): Q5_0, Q5_1
// and IQ4_NL. Dequantization and y = x W^T, the interface of gguf_blocks.h (gguf_gemm.h dispatches here).
//
// Block layouts (llama.cpp's ggml-common.h; 32 weights each, rows of K / 32 blocks, row_bytes = K / 32 * bytes):
//   Q5_0   22 bytes: fp16 d, uint32 qh, 16 bytes qs          w_i = d (q_i - 16)
//   Q5_1   24 bytes: fp16 d, fp16 m, uint32 qh, 16 bytes qs  w_i = d q_i + m
//   IQ4_NL 18 bytes: fp16 d, 16 bytes qs                     w_i = d kvalues[c_i]
// with, for i < 16, the 4-bit code c_i = qs[i] & 15 and c_{i+16} = qs[i] >> 4 (byte i: weight i low, weight i + 16
// high, as Q4_0 / Q4_1), q_i = c_i | (bit i of qh) << 4 (5 bits), and kvalues the 16-entry non-linear codebook.
// llama.cpp's quantizer stores every tensor whose rows are not a multiple of 256 in these types when the file's
// scheme is a K-quant (all of SmolLM2-135M's K = 576 linears are Q5_0 in a Q4_K_M file, Q5_1 in Q5_K_M); IQ4_NL is
// the fallback of IQ4_XS and the low-bit i-quants.
//
// Dequantization (b32_dequantize_rows) gives exactly gguf.quants' float32 values: d (q - 16) and d kvalues[c] as one
// float32 product, d q + m as a product then a sum (never fused: -std=c++17 turns off FMA contraction).
//
// Code paths of b32_gemm (b32_resolve_path says which runs; path -1 = the default for this CPU and M):
//   0  portable, float x: each weight row dequantized as above and float32 dot products (M <= 64); above 64 rows the
//      weight dequantized in chunks of rows and multiplied by the fp32 GEMM (skinny_gemm.h's large_gemm). Exact up
//      to the float32 summation order.
//   6  AVX512-VNNI, 16 weight rows transposed in registers per block (vpdpbusd on 512-bit registers)
//   7  AVX2 + FMA + F16C, 8 weight rows per block on 256-bit registers (maddubs + madd)
//   8  AVX512-VNNI panels: each 16-row tile unpacked once per call into L1, then every x row (512-bit registers)
//   9  AVX2 panels of 8-row tiles
// Default (-1; measured with benchmarks/gguf_gemv.py, one Zen 4 core, interleaved; results 2026-12-02): the
// in-register kernel (6, or 7 without VNNI) for 1 row of x (with VNNI, 6 and 8 are within noise of each other there:
// 0.9-1.07x in direct interleaved reruns), the panels (8, or 9) from 2 rows on, prefill included (where they run
// 2-5x the dequantize + fp32 GEMM path, which gguf_gemm.h used to take above 64 rows); 0 without AVX2.
// A forced path the CPU lacks resolves to one it has (6 -> 7, 8 -> 9, 6 .. 9 -> 0 without AVX2); any other number
// is an error.
//
// Rounding x (paths 6 .. 9): x is rounded to int8 per 32-block as quant_gemm.h's Q4_0 / Q4_1 / Q8_0 kernels do
// (its QAct / quantize_rows: xq = round-half-to-even(x * 127 / amax), dx = amax / 127, |x - dx xq| <= amax / 254
// per element of the block), then every block is an exact integer dot product (int32; AVX2's int16 partial sums
// cannot saturate, bounds below) times float32 d dx, summed in float32. The rounding of x is the only difference
// from path 0 beyond the summation order; the four integer paths give the same floats bit for bit.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "gguf_blocks.h"
#include "quant_gemm.h"
#include "skinny_gemm.h"

namespace scratchlm_gguf {
namespace b32 {

using scratchlm_qgemm::half_to_float;

// IQ4_NL's codebook (ggml-common.h kvalues_iq4nl).
constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// Where the parts of one block lie: its size, and the byte offsets of qh (-1: none) and qs.
struct Layout {
  int64_t bytes, qh, qs;
  bool min;  // Q5_1: an fp16 min after d
};
inline Layout layout(GType t) {
  switch (t) {
    case GType::Q5_0: return {22, 2, 6, false};
    case GType::Q5_1: return {24, 4, 8, true};
    case GType::IQ4_NL: return {18, -1, 2, false};
    default: throw std::invalid_argument("gguf_blocks32: ggml type " + std::to_string(static_cast<int>(t)) +
                                         " is not Q5_0, Q5_1 or IQ4_NL");
  }
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// One block's 32 weights as float32 into o: gguf.quants' values, bit for bit.
inline void dequantize_block(GType t, const uint8_t* blk, float* o) {
  const float d = half_to_float(load_u16(blk));
  if (t == GType::IQ4_NL) {
    const uint8_t* qs = blk + 2;
    for (int j = 0; j < 16; ++j) {
      o[j] = d * static_cast<float>(kIq4nlValues[qs[j] & 15]);
      o[j + 16] = d * static_cast<float>(kIq4nlValues[qs[j] >> 4]);
    }
    return;
  }
  const bool q51 = t == GType::Q5_1;
  const uint32_t qh = load_u32(blk + (q51 ? 4 : 2));
  const uint8_t* qs = blk + (q51 ? 8 : 6);
  const float m = q51 ? half_to_float(load_u16(blk + 2)) : 0.f;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | static_cast<int>((qh >> j) & 1) << 4;
    const int hi = (qs[j] >> 4) | static_cast<int>((qh >> (j + 16)) & 1) << 4;
    if (q51) {
      o[j] = d * static_cast<float>(lo) + m;
      o[j + 16] = d * static_cast<float>(hi) + m;
    } else {
      o[j] = d * static_cast<float>(lo - 16);
      o[j + 16] = d * static_cast<float>(hi - 16);
    }
  }
}

inline void dequantize_rows(const GMat& w, int64_t n0, int64_t n1, float* out) {
  const Layout L = layout(w.type);
  const int64_t nb = w.K / 32;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nb; ++b) dequantize_block(w.type, w.raw + n * w.row_bytes + b * L.bytes, out + (n - n0) * w.K + b * 32);
}

// ------------------------------------------------------------------------------------------ path 0 (float)
// y (M, N) = x W^T with float x, M <= 64: each row of W dequantized once into a buffer and dotted with every x row
// (8 partial float32 sums per dot).
inline void gemm_float_rows(const float* x, int64_t M, const GMat& w, float* y) {
  const int64_t K = w.K;
  at::parallel_for(0, w.N, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, K * M)), [&](int64_t n0, int64_t n1) {
    std::vector<float> row(K);
    for (int64_t n = n0; n < n1; ++n) {
      dequantize_rows(w, n, n + 1, row.data());
      for (int64_t r = 0; r < M; ++r) {
        const float* xr = x + r * K;
        float s[8] = {};
        for (int64_t k = 0; k < K; k += 8)
          for (int j = 0; j < 8; ++j) s[j] += xr[k + j] * row[k + j];
        y[r * w.N + n] = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
      }
    }
  });
}

// y (M, N) = x W^T with float x for many rows: chunks of W's rows (at most 2^21 floats) dequantized, then the fp32
// GEMM (oneDNN / MKL through large_gemm) into the chunk's columns of y.
inline void gemm_float_dequantized(const float* x, int64_t M, const GMat& w, float* y) {
  const int64_t K = w.K, N = w.N;
  const auto opts = at::TensorOptions().dtype(at::kFloat);
  const at::Tensor xt = at::from_blob(const_cast<float*>(x), {M, K}, opts);
  const int64_t rows = std::min(N, std::max<int64_t>(16, (int64_t{1} << 21) / K));
  at::Tensor chunk = at::empty({rows, K}, opts), part = at::empty({M, rows}, opts);
  at::Tensor yt = at::from_blob(y, {M, N}, opts);
  for (int64_t n0 = 0; n0 < N; n0 += rows) {
    const int64_t n = std::min(rows, N - n0);
    float* p = chunk.data_ptr<float>();
    at::parallel_for(0, n, std::max<int64_t>(1, (1 << 14) / K),
                     [&](int64_t a, int64_t b) { dequantize_rows(w, n0 + a, n0 + b, p + a * K); });
    if (n == N) {
      scratchlm_gemm::large_gemm(xt, chunk, yt);
      return;
    }
    at::Tensor out = n == rows ? part : at::empty({M, n}, opts);
    scratchlm_gemm::large_gemm(xt, chunk.narrow(0, 0, n).contiguous(), out);
    yt.narrow(1, n0, n).copy_(out);
  }
}

#ifdef SCRATCHLM_X86
// ---------------------------------------------------------------------------- integer paths (6, 7): x prepared
// x rounded to int8 per 32-block (quant_gemm.h's QAct: xq = round-half-even(x * 127 / amax), dx = amax / 127, so
// |x - dx xq| <= amax / 254 per element; the same rounding as the Q4_0 / Q4_1 / Q8_0 kernels), plus per block:
//   xp    (Q5_0, Q5_1) the block's 32 bytes reordered for the 5th-bit planes: dword s = x_s, x_{s+8}, x_{s+16},
//         x_{s+24} (s = 0 .. 7), the weights whose high bits sit at bit s of qh's bytes 0 .. 3
//   corr  the integer subtracted from each block's sum: 16 sum(xq) for Q5_0 (q - 16), 128 sum(xq) for IQ4_NL on
//         VNNI (codes read as kvalue + 128, unsigned), none else
struct XPrep {
  scratchlm_qgemm::QAct a;
  std::vector<int8_t> xp;
  std::vector<int32_t> corr;
};

inline void prepare_x(const float* x, int64_t M, int64_t K, GType t, bool vnni, XPrep& p) {
  scratchlm_qgemm::quantize_rows(x, M, K, p.a, 1);
  const int64_t nb = K / 32;
  const int8_t* xq = p.a.q.data();
  const int32_t mult = t == GType::Q5_0 ? 16 : (t == GType::IQ4_NL && vnni) ? 128 : 0;
  p.corr.assign(mult ? M * nb : 0, 0);
  if (mult)
    for (int64_t i = 0; i < M * nb; ++i) {
      int32_t s = 0;
      for (int k = 0; k < 32; ++k) s += xq[i * 32 + k];
      p.corr[i] = mult * s;
    }
  p.xp.resize(t == GType::IQ4_NL ? 0 : M * nb * 32);
  if (t != GType::IQ4_NL)
    for (int64_t i = 0; i < M * nb; ++i)
      for (int s = 0; s < 8; ++s)
        for (int j = 0; j < 4; ++j) p.xp[i * 32 + 4 * s + j] = xq[i * 32 + 8 * j + s];
}

// ------------------------------------------------------------------ transposed blocks (in registers)
// The method of quant_gemm.h's 8-row int4 kernels (paths 6 / 7 there), extended to the 5th bit and the codebook:
// eight weight rows (AVX2; sixteen on 512-bit registers) are read block by block and transposed so that each 32-bit
// lane holds one row; one dot instruction against 4 bytes of x broadcast then adds 4 products to each row, with no
// horizontal sums.
//   codes   lane i of chunk c = qs bytes 4c .. 4c + 3 of row i: low nibbles are weights 4c .. 4c + 3, high nibbles
//           16 + 4c .. 16 + 4c + 3 (as Q4_0); x broadcast from the matching 4 bytes
//   5th bit (Q5_0, Q5_1) qh's 8 rows as one vector of dwords; plane s (s = 0 .. 7) = (qh shifted so that bit s of
//           each byte lands on bit 4) & 0x10: byte j of lane i = 16 * (bit 8j + s of row i's qh), against x's
//           bytes s, s + 8, s + 16, s + 24 (XPrep::xp). 2 ops and one dot per plane, no per-row shuffles (llama.cpp
//           spreads qh to bytes with a shuffle + or + compare per row and block instead)
//   IQ4_NL  codes through the codebook with one byte shuffle (pshufb) per chunk: VNNI reads kvalue + 128 (1 .. 241)
//           as the unsigned operand and subtracts 128 sum(xq) exactly per block; AVX2's maddubs would saturate on
//           that, so it moves the sign onto x (|w| unsigned, x * sign(w)) as llama.cpp does
//   scales  the blocks' fp16 d (and Q5_1's m) of the rows, transposed with the same unpacks into a float vector
// Per block and x row: int32 sum -> float, times d dx (+ m dx sum(xq) for Q5_1), one float lane per weight row. The
// integer sums are exact (AVX2's int16 partial sums cannot saturate: |maddubs| <= 2 * 15 * 127 per code pair and
// 2 * 16 * 127 per plane pair, eight of each summed: 30480 and 32512 < 2^15), and every path does the same float
// work per lane (block_out), so paths 6 .. 9 agree bit for bit.
#define B32_AVX2_FN __attribute__((target("avx2,fma,f16c")))
#define B32_VNNI_FN __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

constexpr int64_t kAhead = 4;  // 8-row tiles ahead to prefetch (measured: 2-4 best, 1 and 6 worse)
enum Kind : int { kQ5_0 = 0, kQ5_1 = 1, kIQ4NL = 2 };
constexpr int64_t kBytes[3] = {22, 24, 18}, kQs[3] = {6, 8, 2};

// The 16 qs bytes of 8 rows (p: row 0's, stride rb) transposed: lane i of C[c] = bytes 4c .. 4c + 3 of row i.
B32_AVX2_FN inline void codes_t8(const uint8_t* p, int64_t rb, __m256i C[4]) {
  __m256i Y[4];
  for (int r = 0; r < 4; ++r)
    Y[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + r * rb))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (r + 4) * rb)), 1);
  const __m256i p0 = _mm256_unpacklo_epi32(Y[0], Y[1]), p1 = _mm256_unpackhi_epi32(Y[0], Y[1]);
  const __m256i p2 = _mm256_unpacklo_epi32(Y[2], Y[3]), p3 = _mm256_unpackhi_epi32(Y[2], Y[3]);
  C[0] = _mm256_unpacklo_epi64(p0, p2), C[1] = _mm256_unpackhi_epi64(p0, p2);
  C[2] = _mm256_unpacklo_epi64(p1, p3), C[3] = _mm256_unpackhi_epi64(p1, p3);
}

// The headers of one block of 8 rows (p: row 0's block start): d (and m) as floats, qh as dwords, lane i = row i.
// Words of a header: Q5_0 d, qh lo, qh hi; Q5_1 d, m, qh lo, qh hi; IQ4_NL d. (Two vpgatherdd instead: measured
// 25 % slower on Zen 4, and gathers are slower still on Intel cores with the GDS microcode.)
template <int T>
B32_AVX2_FN inline void header_t8(const uint8_t* p, int64_t rb, __m256& d, __m256& m, __m256i& qh) {
  __m256i Z[4];
  for (int r = 0; r < 4; ++r)
    Z[r] = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + r * rb))),
                                   _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + (r + 4) * rb)), 1);
  const __m256i a01 = _mm256_unpacklo_epi16(Z[0], Z[1]), a23 = _mm256_unpacklo_epi16(Z[2], Z[3]);
  const __m256i w01 = _mm256_unpacklo_epi32(a01, a23);  // per 128-bit lane: word 0 of its 4 rows, then word 1
  const __m256i dm = _mm256_permute4x64_epi64(w01, 0xD8);  // word 0 of rows 0 .. 7, then word 1 of rows 0 .. 7
  d = _mm256_cvtph_ps(_mm256_castsi256_si128(dm));
  if constexpr (T == kQ5_1) m = _mm256_cvtph_ps(_mm256_extracti128_si256(dm, 1));
  if constexpr (T != kIQ4NL) {
    const __m256i w23 = _mm256_unpackhi_epi32(a01, a23);  // words 2, 3
    qh = T == kQ5_0 ? _mm256_unpacklo_epi16(_mm256_bsrli_epi128(w01, 8), w23)
                    : _mm256_unpacklo_epi16(w23, _mm256_bsrli_epi128(w23, 8));
  }
}

// 5th-bit plane s: byte j of lane i = 16 * bit (8j + s) of row i's qh.
template <int S>
B32_AVX2_FN inline __m256i plane(__m256i qh) {
  const __m256i m = _mm256_set1_epi8(0x10);
  if constexpr (S < 4) return _mm256_and_si256(_mm256_slli_epi32(qh, 4 - S), m);
  else if constexpr (S == 4) return _mm256_and_si256(qh, m);
  else return _mm256_and_si256(_mm256_srli_epi32(qh, S - 4), m);
}
B32_AVX2_FN inline void planes(__m256i qh, __m256i P[8]) {
  P[0] = plane<0>(qh), P[1] = plane<1>(qh), P[2] = plane<2>(qh), P[3] = plane<3>(qh);
  P[4] = plane<4>(qh), P[5] = plane<5>(qh), P[6] = plane<6>(qh), P[7] = plane<7>(qh);
}

typedef int32_t __attribute__((may_alias, aligned(1))) unaligned_i32;
B32_AVX2_FN inline __m256i bcast4(const int8_t* p) {  // a plain load, so that EVEX code folds it into the dot
  return _mm256_set1_epi32(*reinterpret_cast<const unaligned_i32*>(p));
}

// Where one call's x rows are: xq (M, nb * 32), dx / sx (M, nb), xp (M, nb, 32), corr (M, nb).
struct XView {
  const int8_t *xq, *xp;
  const float *dx, *sx;
  const int32_t* corr;
  int64_t nb;
};

// The per-block float work, shared by both ISAs (same order, so paths 6 and 7 agree bit for bit).
template <int T>
B32_AVX2_FN inline __m256 block_out(__m256 acc, __m256i is, __m256 d, __m256 m, const XView& x, int64_t rb_) {
  if constexpr (T != kQ5_1) {
    if (x.corr) is = _mm256_sub_epi32(is, _mm256_set1_epi32(x.corr[rb_]));
  }
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(is), _mm256_mul_ps(d, _mm256_set1_ps(x.dx[rb_])), acc);
  if constexpr (T == kQ5_1) acc = _mm256_fmadd_ps(m, _mm256_set1_ps(x.sx[rb_]), acc);
  return acc;
}

// Path 6 (AVX512-VNNI): the same method on 512-bit registers, 16 weight rows per tile (lane i of a chunk = row i:
// each 128-bit lane holds 4 rows through the same unpacks). Measured on Zen 4, which runs 512-bit ops as two 256-bit
// halves: 1.25x the 8-row 256-bit version in cache and 1.15-1.35x streaming from memory at 1 row of x (half the
// instructions per weight; the loads stay the same). Rows r0 .. r0 + MR - 1 of x against weight rows q (16 rows,
// stride rb) into y (+ r * ldy).

// 16 bytes of rows 0, 4, 8, 12 (p, stride rb) in the four 128-bit lanes.
B32_VNNI_FN inline __m512i load4x16(const uint8_t* p, int64_t rb) {
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4 * rb)), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8 * rb)), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 12 * rb)), 3);
}
B32_VNNI_FN inline __m512i bcast4z(const int8_t* p) {
  return _mm512_set1_epi32(*reinterpret_cast<const unaligned_i32*>(p));
}
template <int S>
B32_VNNI_FN inline __m512i plane_z(__m512i qh) {
  const __m512i m = _mm512_set1_epi8(0x10);
  if constexpr (S < 4) return _mm512_and_si512(_mm512_slli_epi32(qh, 4 - S), m);
  else if constexpr (S == 4) return _mm512_and_si512(qh, m);
  else return _mm512_and_si512(_mm512_srli_epi32(qh, S - 4), m);
}

template <int T, int MR>
B32_VNNI_FN inline void rows16_vnni(const uint8_t* q, int64_t rb, const XView& x, int64_t r0, float* y, int64_t ldy,
                                 const char* pf) {
  constexpr int64_t BB = kBytes[T], QS = kQs[T];
  const __m512i lo = _mm512_set1_epi8(0x0F), hi = _mm512_set1_epi8(static_cast<char>(0xF0));
  const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75,
                                                           -59, -39, -15));  // kvalue + 128
  __m512 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    if (pf)
      for (int l = 0; l < (16 * BB + 63) / 64; ++l) _mm_prefetch(pf + b * 16 * BB + 64 * l, _MM_HINT_T0);
    const uint8_t* p = q + b * BB;
    __m512i Y[4], Z[4];
    for (int r = 0; r < 4; ++r) Y[r] = load4x16(p + QS + r * rb, rb);
    const __m512i p0 = _mm512_unpacklo_epi32(Y[0], Y[1]), p1 = _mm512_unpackhi_epi32(Y[0], Y[1]);
    const __m512i p2 = _mm512_unpacklo_epi32(Y[2], Y[3]), p3 = _mm512_unpackhi_epi32(Y[2], Y[3]);
    const __m512i C[4] = {_mm512_unpacklo_epi64(p0, p2), _mm512_unpackhi_epi64(p0, p2),
                          _mm512_unpacklo_epi64(p1, p3), _mm512_unpackhi_epi64(p1, p3)};
    // the headers as header_t8, per 128-bit lane of 4 rows; the d (and m) words of the 4 lanes gathered in order
    for (int r = 0; r < 4; ++r) Z[r] = load4x16(p + r * rb, rb);
    const __m512i a01 = _mm512_unpacklo_epi16(Z[0], Z[1]), a23 = _mm512_unpacklo_epi16(Z[2], Z[3]);
    const __m512i w01 = _mm512_unpacklo_epi32(a01, a23);
    const __m512i dm = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), w01);
    const __m512 d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    __m512 m = _mm512_setzero_ps();
    if constexpr (T == kQ5_1) m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
    __m512i L[4], H[4], P[8];
    for (int c = 0; c < 4; ++c) {
      if constexpr (T == kIQ4NL) {
        L[c] = _mm512_shuffle_epi8(tab, _mm512_and_si512(C[c], lo));
        H[c] = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(C[c], 4), lo));
      } else {
        L[c] = _mm512_and_si512(C[c], lo), H[c] = _mm512_and_si512(C[c], hi);
      }
    }
    if constexpr (T != kIQ4NL) {
      const __m512i w23 = _mm512_unpackhi_epi32(a01, a23);
      const __m512i qh = T == kQ5_0 ? _mm512_unpacklo_epi16(_mm512_bsrli_epi128(w01, 8), w23)
                                    : _mm512_unpacklo_epi16(w23, _mm512_bsrli_epi128(w23, 8));
      P[0] = plane_z<0>(qh), P[1] = plane_z<1>(qh), P[2] = plane_z<2>(qh), P[3] = plane_z<3>(qh);
      P[4] = plane_z<4>(qh), P[5] = plane_z<5>(qh), P[6] = plane_z<6>(qh), P[7] = plane_z<7>(qh);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t rb_ = (r0 + r) * x.nb + b;
      const int8_t* xb = x.xq + rb_ * 32;
      __m512i il = _mm512_setzero_si512(), ih = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        il = _mm512_dpbusd_epi32(il, L[c], bcast4z(xb + 4 * c));
        ih = _mm512_dpbusd_epi32(ih, H[c], bcast4z(xb + 16 + 4 * c));
      }
      __m512i is;
      if constexpr (T == kIQ4NL) {
        is = _mm512_add_epi32(il, ih);
      } else {
        const int8_t* xs = x.xp + rb_ * 32;
        __m512i pa = _mm512_setzero_si512(), pb = _mm512_setzero_si512();
        for (int s = 0; s < 4; ++s) {
          pa = _mm512_dpbusd_epi32(pa, P[s], bcast4z(xs + 4 * s));
          pb = _mm512_dpbusd_epi32(pb, P[4 + s], bcast4z(xs + 16 + 4 * s));
        }
        is = _mm512_add_epi32(_mm512_add_epi32(il, _mm512_srai_epi32(ih, 4)), _mm512_add_epi32(pa, pb));
      }
      // block_out's float work, lane for lane (so path 6 equals paths 7 - 9 bit for bit)
      if constexpr (T != kQ5_1) {
        if (x.corr) is = _mm512_sub_epi32(is, _mm512_set1_epi32(x.corr[rb_]));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(x.dx[rb_])), acc[r]);
      if constexpr (T == kQ5_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sx[rb_]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// The same on AVX2: maddubs into int16 (summed eight at a time, see above), one madd per block and row.
template <int T, int MR>
B32_AVX2_FN inline void rows8_avx2(const uint8_t* q, int64_t rb, const XView& x, int64_t r0, float* y, int64_t ldy,
                                   const char* pf) {
  constexpr int64_t BB = kBytes[T], QS = kQs[T];
  const __m256i lo = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i tab = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                       -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    if (pf)
      for (int l = 0; l < 3; ++l) _mm_prefetch(pf + b * 8 * BB + 64 * l, _MM_HINT_T0);
    const uint8_t* p = q + b * BB;
    __m256i C[4], W[8], P[8], qh;
    __m256 d, m;
    codes_t8(p + QS, rb, C);
    header_t8<T>(p, rb, d, m, qh);
    for (int c = 0; c < 4; ++c) {  // W[c]: weights 4c .. (low nibbles), W[4 + c]: 16 + 4c .. (high nibbles)
      W[c] = _mm256_and_si256(C[c], lo);
      W[4 + c] = _mm256_and_si256(_mm256_srli_epi16(C[c], 4), lo);
      if constexpr (T == kIQ4NL) W[c] = _mm256_shuffle_epi8(tab, W[c]), W[4 + c] = _mm256_shuffle_epi8(tab, W[4 + c]);
    }
    if constexpr (T != kIQ4NL) planes(qh, P);
    for (int r = 0; r < MR; ++r) {
      const int64_t rb_ = (r0 + r) * x.nb + b;
      const int8_t* xb = x.xq + rb_ * 32;
      __m256i is;
      if constexpr (T == kIQ4NL) {  // |w| against x * sign(w): each pair fits int16, so one madd per chunk
        __m256i s32[4];
        for (int c = 0; c < 4; ++c) {
          const __m256i xl = _mm256_sign_epi8(bcast4(xb + 4 * c), W[c]);
          const __m256i xh = _mm256_sign_epi8(bcast4(xb + 16 + 4 * c), W[4 + c]);
          s32[c] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(W[c]), xl), ones),
                                    _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(W[4 + c]), xh), ones));
        }
        is = _mm256_add_epi32(_mm256_add_epi32(s32[0], s32[1]), _mm256_add_epi32(s32[2], s32[3]));
      } else {
        const int8_t* xs = x.xp + rb_ * 32;
        __m256i t[8], u[8];
        for (int c = 0; c < 4; ++c) {
          t[c] = _mm256_maddubs_epi16(W[c], bcast4(xb + 4 * c));
          t[4 + c] = _mm256_maddubs_epi16(W[4 + c], bcast4(xb + 16 + 4 * c));
        }
        for (int s = 0; s < 8; ++s) u[s] = _mm256_maddubs_epi16(P[s], bcast4(xs + 4 * s));
        for (int k = 0; k < 4; ++k) t[k] = _mm256_add_epi16(t[k], t[k + 4]), u[k] = _mm256_add_epi16(u[k], u[k + 4]);
        t[0] = _mm256_add_epi16(_mm256_add_epi16(t[0], t[1]), _mm256_add_epi16(t[2], t[3]));
        u[0] = _mm256_add_epi16(_mm256_add_epi16(u[0], u[1]), _mm256_add_epi16(u[2], u[3]));
        is = _mm256_add_epi32(_mm256_madd_epi16(t[0], ones), _mm256_madd_epi16(u[0], ones));
      }
      acc[r] = block_out<T>(acc[r], is, d, m, x, rb_);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// ------------------------------------------------------------------ panels (the tile unpacked once)
// Paths 9 (AVX2, 8-row tiles) and 8 (AVX512-VNNI, 16-row tiles on 512-bit registers), for several rows of x: each
// tile is unpacked ONCE per call into an L1 panel (per block 8 chunk vectors, lane i = row i, chunk c = weights
// 4c .. 4c + 3, chunk 4 + c = 16 + 4c ..) of finished codes: Q5's 5 bits (the 5th bit spread from qh into the
// chunk's bytes: a byte shuffle replicating one qh byte across each lane, then AVX2 and + compare against the bit of
// each byte, and 0x10, or; AVX-512 a byte-mask test and a masked add of 16), IQ4_NL's codebook values (+ 128 for
// VNNI) -- and the blocks' d (and m) as (nb, rows) floats. Every x row then costs 8 dot instructions per block (the
// in-register kernels above pay 16 for Q5: codes and 5th-bit planes). The integer sums are the same integers and the
// float work per lane is block_out's, so paths 8 / 9 equal paths 6 / 7 bit for bit.
template <int T>
B32_AVX2_FN inline void unpack_tile(const uint8_t* q, int64_t rb, int64_t nb, uint8_t* panel, float* dT, float* mT,
                                    const char* pf) {
  constexpr int64_t BB = kBytes[T], QS = kQs[T];
  const __m256i lo = _mm256_set1_epi8(0x0F), b16 = _mm256_set1_epi8(0x10);
  const __m256i tab = _mm256_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
                                       -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
  const __m256i bm[2] = {_mm256_set1_epi32(0x08040201), _mm256_set1_epi32(static_cast<int>(0x80402010u))};
  for (int64_t b = 0; b < nb; ++b) {
    if (pf)
      for (int l = 0; l < 3; ++l) _mm_prefetch(pf + b * 8 * BB + 64 * l, _MM_HINT_T0);
    const uint8_t* p = q + b * BB;
    __m256i C[4], qh;
    __m256 d, m;
    codes_t8(p + QS, rb, C);
    header_t8<T>(p, rb, d, m, qh);
    __m256i V[4];  // V[j]: byte j of each row's qh in all 4 bytes of its lane
    if constexpr (T != kIQ4NL)
      for (int j = 0; j < 4; ++j)
        V[j] = _mm256_shuffle_epi8(qh, _mm256_add_epi8(_mm256_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12,
                                                                        12, 0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12,
                                                                        12, 12),
                                                       _mm256_set1_epi8(static_cast<char>(j))));
    uint8_t* out = panel + b * 256;
    for (int c = 0; c < 4; ++c) {
      __m256i l = _mm256_and_si256(C[c], lo), h = _mm256_and_si256(_mm256_srli_epi16(C[c], 4), lo);
      if constexpr (T == kIQ4NL) {
        l = _mm256_shuffle_epi8(tab, l), h = _mm256_shuffle_epi8(tab, h);
      } else {  // weights 4c + k: bit 4c + k of qh = bit 4 (c & 1) + k of byte c / 2 (16 + 4c + k: of byte 2 + c / 2)
        const __m256i m0 = bm[c & 1];
        l = _mm256_or_si256(l, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(V[c / 2], m0), m0), b16));
        h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(V[2 + c / 2], m0), m0), b16));
      }
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + 32 * c), l);
      _mm256_store_si256(reinterpret_cast<__m256i*>(out + 128 + 32 * c), h);
    }
    _mm256_storeu_ps(dT + 8 * b, d);
    if constexpr (T == kQ5_1) _mm256_storeu_ps(mT + 8 * b, m);
  }
}

template <int T, int MR>
B32_AVX2_FN inline void panel_rows_avx2(const uint8_t* panel, const float* dT, const float* mT, const XView& x,
                                        int64_t r0, float* y, int64_t ldy) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR];
  __m256 m = _mm256_setzero_ps();
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m256i W[8];
    for (int j = 0; j < 8; ++j) W[j] = _mm256_load_si256(reinterpret_cast<const __m256i*>(panel + b * 256 + 32 * j));
    const __m256 d = _mm256_loadu_ps(dT + 8 * b);
    if constexpr (T == kQ5_1) m = _mm256_loadu_ps(mT + 8 * b);
    for (int r = 0; r < MR; ++r) {
      const int64_t rb_ = (r0 + r) * x.nb + b;
      const int8_t* xb = x.xq + rb_ * 32;
      __m256i is;
      if constexpr (T == kIQ4NL) {  // the sign trick, one madd per chunk (pairs up to 2 * 127 * 127)
        __m256i s[4];
        for (int c = 0; c < 4; ++c) {
          const __m256i a = _mm256_maddubs_epi16(_mm256_abs_epi8(W[c]), _mm256_sign_epi8(bcast4(xb + 4 * c), W[c]));
          const __m256i e = _mm256_maddubs_epi16(_mm256_abs_epi8(W[4 + c]),
                                                 _mm256_sign_epi8(bcast4(xb + 16 + 4 * c), W[4 + c]));
          s[c] = _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(e, ones));
        }
        is = _mm256_add_epi32(_mm256_add_epi32(s[0], s[1]), _mm256_add_epi32(s[2], s[3]));
      } else {  // 5-bit codes: four pairs of 2 * 31 * 127 summed in int16 (31496 < 2^15), one madd per half
        __m256i t[8];
        for (int c = 0; c < 4; ++c) {
          t[c] = _mm256_maddubs_epi16(W[c], bcast4(xb + 4 * c));
          t[4 + c] = _mm256_maddubs_epi16(W[4 + c], bcast4(xb + 16 + 4 * c));
        }
        const __m256i l = _mm256_add_epi16(_mm256_add_epi16(t[0], t[1]), _mm256_add_epi16(t[2], t[3]));
        const __m256i h = _mm256_add_epi16(_mm256_add_epi16(t[4], t[5]), _mm256_add_epi16(t[6], t[7]));
        is = _mm256_add_epi32(_mm256_madd_epi16(l, ones), _mm256_madd_epi16(h, ones));
      }
      acc[r] = block_out<T>(acc[r], is, d, m, x, rb_);
    }
  }
  for (int r = 0; r < MR; ++r) _mm256_storeu_ps(y + r * ldy, acc[r]);
}

// Path 8's panels: 16 weight rows per tile (lane i = row i as rows16_vnni), the 5th bit spread with AVX-512BW byte
// masks (vptestmb against each lane's replicated qh byte, then a masked add of 16). Measured: 1.8x the 8-row 256-bit
// panels at 8-64 rows of x on Zen 4.
template <int T>
B32_VNNI_FN inline void unpack_tile16(const uint8_t* q, int64_t rb, int64_t nb, uint8_t* panel, float* dT, float* mT,
                                   const char* pf) {
  constexpr int64_t BB = kBytes[T], QS = kQs[T];
  const __m512i lo = _mm512_set1_epi8(0x0F), s16 = _mm512_set1_epi8(0x10);
  const __m512i tab = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, -127, -115, -103, -90, -75,
                                                           -59, -39, -15));
  const __m512i rep = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
  const __m512i bm[2] = {_mm512_set1_epi32(0x08040201), _mm512_set1_epi32(static_cast<int>(0x80402010u))};
  for (int64_t b = 0; b < nb; ++b) {
    if (pf)
      for (int l = 0; l < (16 * BB + 63) / 64; ++l) _mm_prefetch(pf + b * 16 * BB + 64 * l, _MM_HINT_T0);
    const uint8_t* p = q + b * BB;
    __m512i Y[4], Z[4];
    for (int r = 0; r < 4; ++r) Y[r] = load4x16(p + QS + r * rb, rb), Z[r] = load4x16(p + r * rb, rb);
    const __m512i p0 = _mm512_unpacklo_epi32(Y[0], Y[1]), p1 = _mm512_unpackhi_epi32(Y[0], Y[1]);
    const __m512i p2 = _mm512_unpacklo_epi32(Y[2], Y[3]), p3 = _mm512_unpackhi_epi32(Y[2], Y[3]);
    const __m512i C[4] = {_mm512_unpacklo_epi64(p0, p2), _mm512_unpackhi_epi64(p0, p2),
                          _mm512_unpacklo_epi64(p1, p3), _mm512_unpackhi_epi64(p1, p3)};
    const __m512i a01 = _mm512_unpacklo_epi16(Z[0], Z[1]), a23 = _mm512_unpacklo_epi16(Z[2], Z[3]);
    const __m512i w01 = _mm512_unpacklo_epi32(a01, a23);
    const __m512i dm = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), w01);
    _mm512_storeu_ps(dT + 16 * b, _mm512_cvtph_ps(_mm512_castsi512_si256(dm)));
    if constexpr (T == kQ5_1) _mm512_storeu_ps(mT + 16 * b, _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1)));
    __m512i V[4];
    if constexpr (T != kIQ4NL) {
      const __m512i w23 = _mm512_unpackhi_epi32(a01, a23);
      const __m512i qh = T == kQ5_0 ? _mm512_unpacklo_epi16(_mm512_bsrli_epi128(w01, 8), w23)
                                    : _mm512_unpacklo_epi16(w23, _mm512_bsrli_epi128(w23, 8));
      for (int j = 0; j < 4; ++j) V[j] = _mm512_shuffle_epi8(qh, _mm512_add_epi8(rep, _mm512_set1_epi8(static_cast<char>(j))));
    }
    uint8_t* out = panel + b * 512;
    for (int c = 0; c < 4; ++c) {
      __m512i l = _mm512_and_si512(C[c], lo), h = _mm512_and_si512(_mm512_srli_epi16(C[c], 4), lo);
      if constexpr (T == kIQ4NL) {
        l = _mm512_shuffle_epi8(tab, l), h = _mm512_shuffle_epi8(tab, h);
      } else {
        l = _mm512_mask_add_epi8(l, _mm512_test_epi8_mask(V[c / 2], bm[c & 1]), l, s16);
        h = _mm512_mask_add_epi8(h, _mm512_test_epi8_mask(V[2 + c / 2], bm[c & 1]), h, s16);
      }
      _mm512_store_si512(reinterpret_cast<__m512i*>(out + 64 * c), l);
      _mm512_store_si512(reinterpret_cast<__m512i*>(out + 256 + 64 * c), h);
    }
  }
}

template <int T, int MR>
B32_VNNI_FN inline void panel_rows16_vnni(const uint8_t* panel, const float* dT, const float* mT, const XView& x,
                                       int64_t r0, float* y, int64_t ldy) {
  __m512 acc[MR];
  __m512 m = _mm512_setzero_ps();
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    __m512i W[8];
    for (int j = 0; j < 8; ++j) W[j] = _mm512_load_si512(reinterpret_cast<const __m512i*>(panel + b * 512 + 64 * j));
    const __m512 d = _mm512_loadu_ps(dT + 16 * b);
    if constexpr (T == kQ5_1) m = _mm512_loadu_ps(mT + 16 * b);
    for (int r = 0; r < MR; ++r) {
      const int64_t rb_ = (r0 + r) * x.nb + b;
      const int8_t* xb = x.xq + rb_ * 32;
      __m512i il = _mm512_setzero_si512(), ih = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        il = _mm512_dpbusd_epi32(il, W[c], bcast4z(xb + 4 * c));
        ih = _mm512_dpbusd_epi32(ih, W[4 + c], bcast4z(xb + 16 + 4 * c));
      }
      __m512i is = _mm512_add_epi32(il, ih);
      if constexpr (T != kQ5_1) {
        if (x.corr) is = _mm512_sub_epi32(is, _mm512_set1_epi32(x.corr[rb_]));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(is), _mm512_mul_ps(d, _mm512_set1_ps(x.dx[rb_])), acc[r]);
      if constexpr (T == kQ5_1) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x.sx[rb_]), acc[r]);
    }
  }
  for (int r = 0; r < MR; ++r) _mm512_storeu_ps(y + r * ldy, acc[r]);
}

// Weight rows n0 .. n1 against every row of x through panels (path 8: vnni, 9: AVX2); ragged end as tile_regs.
template <int T>
inline void tile_panel(const XView& x, int64_t M, const GMat& w, float* y, int64_t n0, int64_t n1, bool vnni) {
  const int64_t rb = w.row_bytes, nb = x.nb, ts = vnni ? 16 : 8;  // weight rows per tile
  std::vector<uint8_t> store(nb * 32 * ts + 64), pad;
  uint8_t* panel = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(store.data()) + 63) & ~uintptr_t(63));
  std::vector<float> dT(nb * ts), mT(T == kQ5_1 ? nb * ts : 0), ybuf;
  for (int64_t n = n0; n < n1; n += ts) {
    const int64_t valid = std::min(ts, w.N - n);
    const uint8_t* q = w.raw + n * rb;
    float* yt = y + n;
    int64_t ldy = w.N;
    if (valid < ts) {
      pad.assign(ts * rb, 0);
      std::memcpy(pad.data(), q, valid * rb);
      q = pad.data();
      ybuf.assign(M * ts, 0.f), yt = ybuf.data(), ldy = ts;
    }
    const char* pf = reinterpret_cast<const char*>(w.raw) + (n + 8 * kAhead) * rb;
    if (vnni) unpack_tile16<T>(q, rb, nb, panel, dT.data(), mT.data(), pf);
    else unpack_tile<T>(q, rb, nb, panel, dT.data(), mT.data(), pf);
    int64_t r = 0;
    const float *d = dT.data(), *m = mT.data();
    // x rows per call (measured, one Zen 4 core: VNNI 8, 6 for Q5_1's extra registers; AVX2 4 for Q5, 2 for
    // IQ4_NL's longer chains)
    if (vnni) {
      constexpr int R = T == kQ5_1 ? 6 : 8;
      for (; r + R <= M; r += R) panel_rows16_vnni<T, R>(panel, d, m, x, r, yt + r * ldy, ldy);
      for (; r + 2 <= M; r += 2) panel_rows16_vnni<T, 2>(panel, d, m, x, r, yt + r * ldy, ldy);
      if (r < M) panel_rows16_vnni<T, 1>(panel, d, m, x, r, yt + r * ldy, ldy);
    } else {
      constexpr int R = T == kIQ4NL ? 2 : 4;
      for (; r + R <= M; r += R) panel_rows_avx2<T, R>(panel, d, m, x, r, yt + r * ldy, ldy);
      for (; r + 2 <= M; r += 2) panel_rows_avx2<T, 2>(panel, d, m, x, r, yt + r * ldy, ldy);
      if (r < M) panel_rows_avx2<T, 1>(panel, d, m, x, r, yt + r * ldy, ldy);
    }
    if (valid < ts)
      for (int64_t i = 0; i < M; ++i) std::memcpy(y + i * w.N + n, ybuf.data() + i * ts, valid * sizeof(float));
  }
}

// Weight rows n0 .. n1 (whole tiles apart, or the ragged end) against every row of x: tiles of 16 rows (VNNI) or 8
// (AVX2), each meeting the x rows in chunks of 2 and 1 (the transposed block is rebuilt per chunk; from 3 rows on
// the default is the panels). A ragged last tile (N % 16 or N % 8 rows) is copied into a zero-padded tile (d = 0
// rows add nothing) and its outputs go through a buffer.
template <int T>
inline void tile_regs(const XView& x, int64_t M, const GMat& w, float* y, int64_t n0, int64_t n1, bool vnni) {
  const int64_t rb = w.row_bytes, ts = vnni ? 16 : 8;
  std::vector<uint8_t> pad;
  std::vector<float> ybuf;
  for (int64_t n = n0; n < n1; n += ts) {
    const int64_t valid = std::min(ts, w.N - n);
    const uint8_t* q = w.raw + n * rb;
    float* yt = y + n;
    int64_t ldy = w.N;
    if (valid < ts) {
      pad.assign(ts * rb, 0);
      std::memcpy(pad.data(), q, valid * rb);
      q = pad.data();
      ybuf.assign(M * ts, 0.f), yt = ybuf.data(), ldy = ts;
    }
    // 32 rows ahead, spread over the blocks (a prefetch past the end cannot fault; without it Q5_0 and IQ4_NL rows,
    // 396 and 324 bytes, ran at 3 GB/s out of cache: the hardware prefetchers miss 8 such streams)
    const char* pf = reinterpret_cast<const char*>(w.raw) + (n + 8 * kAhead) * rb;
    int64_t r = 0;
    const char* p = pf;  // the prefetch rides on the first x chunk only
    if (vnni) {
      for (; r + 2 <= M; r += 2, p = nullptr) rows16_vnni<T, 2>(q, rb, x, r, yt + r * ldy, ldy, p);
      if (r < M) rows16_vnni<T, 1>(q, rb, x, r, yt + r * ldy, ldy, p);
    } else {
      for (; r + 2 <= M; r += 2, p = nullptr) rows8_avx2<T, 2>(q, rb, x, r, yt + r * ldy, ldy, p);
      if (r < M) rows8_avx2<T, 1>(q, rb, x, r, yt + r * ldy, ldy, p);
    }
    if (valid < ts)
      for (int64_t i = 0; i < M; ++i) std::memcpy(y + i * w.N + n, ybuf.data() + i * ts, valid * sizeof(float));
  }
}

// y (M, N) = x W^T through the integer kernels: in registers (path 6: VNNI, 7: AVX2) or panels (8: VNNI, 9: AVX2).
inline void gemm_int(const float* x, int64_t M, const GMat& w, float* y, int path) {
  const bool vnni = path == 6 || path == 8, panel = path >= 8;
  XPrep prep;
  prepare_x(x, M, w.K, w.type, vnni, prep);
  const XView xv{prep.a.q.data(), prep.xp.empty() ? nullptr : prep.xp.data(), prep.a.dx.data(), prep.a.sx.data(),
                 prep.corr.empty() ? nullptr : prep.corr.data(), w.K / 32};
  const int64_t ts = vnni ? 16 : 8, tiles = (w.N + ts - 1) / ts;  // weight rows per tile
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(1, w.K * M) / ts);
  at::parallel_for(0, tiles, grain, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * ts, n1 = std::min(w.N, t1 * ts);
    switch (w.type) {
      case GType::Q5_0:
        return panel ? tile_panel<kQ5_0>(xv, M, w, y, n0, n1, vnni) : tile_regs<kQ5_0>(xv, M, w, y, n0, n1, vnni);
      case GType::Q5_1:
        return panel ? tile_panel<kQ5_1>(xv, M, w, y, n0, n1, vnni) : tile_regs<kQ5_1>(xv, M, w, y, n0, n1, vnni);
      default:
        return panel ? tile_panel<kIQ4NL>(xv, M, w, y, n0, n1, vnni) : tile_regs<kIQ4NL>(xv, M, w, y, n0, n1, vnni);
    }
  });
}
#endif  // SCRATCHLM_X86

inline bool cpu_vnni() { return scratchlm_simd::cpu_has_avx512vnni(); }
inline bool cpu_avx2() { return scratchlm_simd::cpu_has_avx2(); }

}  // namespace b32

// Whether this header has kernels for weights of type t.
inline bool b32_handles(GType t) { return t == GType::Q5_0 || t == GType::Q5_1 || t == GType::IQ4_NL; }

// Rows n0 .. n1 of W as float32 into out ((n1 - n0), K): exactly gguf.quants' values.
inline void b32_dequantize_rows(const GMat& w, int64_t n0, int64_t n1, float* out) { b32::dequantize_rows(w, n0, n1, out); }

// The path b32_gemm runs for M rows of x when asked for `path` (-1: the default for this CPU and M). A path this
// CPU lacks is replaced by the best it has (6 -> 7 and 8 -> 9 without AVX512-VNNI, 6 .. 9 -> 0 without AVX2).
// Default (measured, benchmarks/gguf_gemv.py and docs/quantization.md): the in-register kernel for 1 row of x (2
// with VNNI), the panels above, prefill included.
inline int b32_resolve_path(const GMat& w, int64_t M, int path) {
  const b32::Layout L = b32::layout(w.type);  // throws for a type this header does not handle
  if (w.K <= 0 || w.K % 32 || w.row_bytes != w.K / 32 * L.bytes)
    throw std::invalid_argument("b32_gemm: rows of K = " + std::to_string(w.K) + " weights in 32-blocks of " +
                                std::to_string(L.bytes) + " bytes (K a multiple of 32), got row_bytes " +
                                std::to_string(w.row_bytes));
  if (path != -1 && path != 0 && (path < 6 || path > 9))
    throw std::invalid_argument("b32_gemm: unknown code path " + std::to_string(path) + " (paths: -1, 0, 6, 7, 8, 9)");
  const bool vnni = b32::cpu_vnni(), avx2 = b32::cpu_avx2();
  if (path < 0) {
    if (!avx2) return 0;
    return M == 1 ? (vnni ? 6 : 7) : (vnni ? 8 : 9);
  }
  if (path == 0 || !avx2) return 0;
  if (!vnni && (path == 6 || path == 8)) return path + 1;
  return path;
}

// y (M, N) = x (M, K) W^T, x and y float32 row-major; path as b32_resolve_path.
inline void b32_gemm(const float* x, int64_t M, const GMat& w, float* y, int path) {
  const int p = b32_resolve_path(w, M, path);
  if (M == 0 || w.N == 0) return;
#ifdef SCRATCHLM_X86
  if (p != 0) return b32::gemm_int(x, M, w, y, p);
#endif
  if (M > scratchlm_qgemm::kMaxRows) return b32::gemm_float_dequantized(x, M, w, y);
  b32::gemm_float_rows(x, M, w, y);
}

}  // namespace scratchlm_gguf
