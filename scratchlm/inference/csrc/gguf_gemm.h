// GGUF weights kept raw (the file's own blocks, gguf_blocks.h's GMat): one entry point per operation, dispatched
// on the block type to the kernel header that handles it:
//   gguf_kquants.h   Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS  (256-weight super-blocks; kq_*)
//   gguf_blocks32.h  Q5_0, Q5_1, IQ4_NL                    (32-weight blocks; b32_*)
// (Q4_0, Q4_1 and Q8_0 are not raw here: their codes and scales are split into planes for quant_gemm.h.)
//
// Policy: a raw weight's type must be one of the nine above AND handled by its header (`gguf_handles`), else the
// caller gets an error naming the type; nothing is dequantized behind its back. Decode-sized inputs (M <= 64 rows)
// run the kernel header's own path choice (-1: measured best for the CPU and M), and so do prefill chunks (M > 64):
// both headers' integer kernels beat kDequantPath (the weight dequantized to float32 in chunks of rows, at most
// kDequantChunk floats so a 7B layer never needs a full float copy, each chunk through the fp32 GEMM, skinny_gemm.h's
// large_gemm) there, measured on one Zen 4 core, thread CPU time: gguf_blocks32.h's panels 245-275 GFLOP/s against
// 80-150 (576 x 1536, 1536 x 768; 65-512 rows), gguf_kquants.h's path 3 (AVX512-VNNI) 156-218 and path 1 (AVX2)
// 106-140 against 78-108 (Q4_K / Q6_K, 576 x 1536 and 2048 x 5632; 128 and 512 rows). kDequantPath is what float
// activations run (qlinear.h's gguf_path: exact up to the summation order) and can be forced for any M (tests,
// benchmarks), as can any kernel path.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>

#include "gguf_blocks.h"
#include "gguf_blocks32.h"
#include "gguf_kquants.h"
#include "skinny_gemm.h"

namespace scratchlm_gguf {

constexpr int kDequantPath = 100;             // dequantize row chunks to float32, then the fp32 GEMM
constexpr int64_t kDequantChunk = 1 << 21;    // floats of one dequantized chunk of rows (8 MiB)

// Weights per block, bytes per block and the name of each type a raw GGUF weight may have; {0, 0, nullptr} else.
struct BlockShape {
  int64_t weights, bytes;
  const char* name;
};
inline BlockShape block_shape(GType t) {
  switch (t) {
    case GType::Q5_0: return {32, 22, "Q5_0"};
    case GType::Q5_1: return {32, 24, "Q5_1"};
    case GType::IQ4_NL: return {32, 18, "IQ4_NL"};
    case GType::Q2_K: return {256, 84, "Q2_K"};
    case GType::Q3_K: return {256, 110, "Q3_K"};
    case GType::Q4_K: return {256, 144, "Q4_K"};
    case GType::Q5_K: return {256, 176, "Q5_K"};
    case GType::Q6_K: return {256, 210, "Q6_K"};
    case GType::IQ4_XS: return {256, 136, "IQ4_XS"};
    default: return {0, 0, nullptr};
  }
}

// Whether this build has kernels for raw weights of type t.
inline bool gguf_handles(GType t) {
  if (block_shape(t).name == nullptr) return false;
  return kq_handles(t) || b32_handles(t);
}

// A GMat over raw (N, row_bytes) bytes of type `type_id` with K weights per row, checked: a known raw type with
// kernels in this build, K a multiple of its block, row_bytes matching. `what` names the weight in errors.
inline GMat make_gmat(int64_t type_id, int64_t N, int64_t K, int64_t row_bytes, const uint8_t* raw,
                      const std::string& what) {
  const auto t = static_cast<GType>(type_id);
  const BlockShape b = block_shape(t);
  TORCH_CHECK(b.name != nullptr, what, ": ggml type id ", type_id, " is not a raw GGUF block type (Q5_0, Q5_1, "
              "IQ4_NL, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS)");
  TORCH_CHECK(gguf_handles(t), what, ": this build has no kernel for GGUF type ", b.name);
  TORCH_CHECK(K > 0 && K % b.weights == 0, what, ": ", b.name, " needs K to be a multiple of ", b.weights, ", got ",
              K);
  TORCH_CHECK(row_bytes == K / b.weights * b.bytes, what, ": ", b.name, " rows of ", K, " weights take ",
              K / b.weights * b.bytes, " bytes, got ", row_bytes);
  return GMat{t, N, K, row_bytes, raw};
}

// Rows n0 .. n1 of W as float32 into out ((n1 - n0), K): the values of gguf.quants' dequantizer.
inline void gguf_dequantize_rows(const GMat& w, int64_t n0, int64_t n1, float* out) {
  if (kq_handles(w.type)) return kq_dequantize_rows(w, n0, n1, out);
  if (b32_handles(w.type)) return b32_dequantize_rows(w, n0, n1, out);
  TORCH_CHECK(false, "gguf_dequantize_rows: no kernel for ggml type ", static_cast<int>(w.type));
}

// The whole weight as float32 (N, K), rows split over threads.
inline at::Tensor gguf_dequantize(const GMat& w) {
  auto out = at::empty({w.N, w.K}, at::TensorOptions().dtype(at::kFloat));
  float* p = out.data_ptr<float>();
  at::parallel_for(0, w.N, std::max<int64_t>(1, (1 << 16) / w.K),
                   [&](int64_t n0, int64_t n1) { gguf_dequantize_rows(w, n0, n1, p + n0 * w.K); });
  return out;
}

// The path gguf_gemm runs for M rows when asked for `path` (-1: the default): kDequantPath, or the kernel header's.
inline int gguf_resolve_path(const GMat& w, int64_t M, int path) {
  if (path == kDequantPath) return kDequantPath;
  if (kq_handles(w.type)) return kq_resolve_path(w, M, path);
  if (b32_handles(w.type)) return b32_resolve_path(w, M, path);
  TORCH_CHECK(false, "gguf_resolve_path: no kernel for ggml type ", static_cast<int>(w.type));
}

// y (M, N) = x (M, K) W^T through float32 chunks of W's rows (kDequantPath): each chunk dequantized (threads over
// rows), then multiplied by the fp32 GEMM into its columns of y.
inline void gguf_gemm_dequantized(const at::Tensor& x, const GMat& w, at::Tensor& y) {
  const int64_t rows = std::min(w.N, std::max<int64_t>(16, kDequantChunk / w.K));
  if (rows == w.N) return scratchlm_gemm::large_gemm(x, gguf_dequantize(w), y);
  auto chunk = at::empty({rows, w.K}, x.options());
  auto part = at::empty({x.size(0), rows}, x.options());
  for (int64_t n0 = 0; n0 < w.N; n0 += rows) {
    const int64_t n = std::min(rows, w.N - n0);
    float* p = chunk.data_ptr<float>();
    at::parallel_for(0, n, std::max<int64_t>(1, (1 << 16) / w.K),
                     [&](int64_t a, int64_t b) { gguf_dequantize_rows(w, n0 + a, n0 + b, p + a * w.K); });
    auto c = chunk.narrow(0, 0, n);
    auto out = part.narrow(1, 0, n);
    if (n == rows) {
      scratchlm_gemm::large_gemm(x, c, part);
    } else {
      auto last = at::empty({x.size(0), n}, x.options());
      scratchlm_gemm::large_gemm(x, c, last);
      out = last;
    }
    y.narrow(1, n0, n).copy_(out);
  }
}

// y (M, N) = x (M, K) W^T, x contiguous float32 (M, K), y float32 (M, N) contiguous; path as gguf_resolve_path.
inline void gguf_gemm(const at::Tensor& x, const GMat& w, at::Tensor& y, int path = -1) {
  const int64_t M = x.size(0);
  const int p = gguf_resolve_path(w, M, path);
  if (p == kDequantPath) return gguf_gemm_dequantized(x, w, y);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (kq_handles(w.type)) return kq_gemm(xp, M, w, yp, p);
  b32_gemm(xp, M, w, yp, p);
}

}  // namespace scratchlm_gguf
