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
//   (the integer paths below round x to int8: see "Rounding x")
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

inline bool cpu_vnni() { return scratchlm_simd::cpu_has_avx512vnni(); }
inline bool cpu_avx2() { return scratchlm_simd::cpu_has_avx2(); }

}  // namespace b32

// Whether this header has kernels for weights of type t.
inline bool b32_handles(GType t) { return t == GType::Q5_0 || t == GType::Q5_1 || t == GType::IQ4_NL; }

// Rows n0 .. n1 of W as float32 into out ((n1 - n0), K): exactly gguf.quants' values.
inline void b32_dequantize_rows(const GMat& w, int64_t n0, int64_t n1, float* out) { b32::dequantize_rows(w, n0, n1, out); }

// The path b32_gemm runs for M rows of x when asked for `path` (-1: the default for this CPU and M).
inline int b32_resolve_path(const GMat& w, int64_t M, int path) {
  (void)b32::layout(w.type);  // throws for a type this header does not handle
  (void)M;
  if (path != -1 && path != 0)
    throw std::invalid_argument("b32_gemm: unknown code path " + std::to_string(path) + " (paths: -1, 0)");
  return 0;
}

// y (M, N) = x (M, K) W^T, x and y float32 row-major; path as b32_resolve_path.
inline void b32_gemm(const float* x, int64_t M, const GMat& w, float* y, int path) {
  const int p = b32_resolve_path(w, M, path);
  (void)p;
  if (M > scratchlm_qgemm::kMaxRows) return b32::gemm_float_dequantized(x, M, w, y);
  b32::gemm_float_rows(x, M, w, y);
}

}  // namespace scratchlm_gguf
