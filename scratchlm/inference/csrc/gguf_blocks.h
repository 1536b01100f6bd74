// GGUF block-quantized weights kept exactly as the file stores them (no repacking), for the types whose kernels
// read the blocks in place: the K-quants (gguf_kquants.h) and the 32-weight types beyond Q4_0 / Q4_1 / Q8_0
// (gguf_blocks32.h; those three keep their older planes in quant_gemm.h). gguf_gemm.h dispatches on the type.
#pragma once

#include <cstdint>

namespace scratchlm_gguf {

// ggml's type ids (gguf.GGMLQuantizationType), the number stored in the file for each tensor.
enum class GType : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9, Q2_K = 10, Q3_K = 11, Q4_K = 12,
  Q5_K = 13, Q6_K = 14, Q8_K = 15, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30,
};

// A weight matrix W (N, K) as the GGUF file stores it: N rows of K / block_weights blocks, row_bytes each, with
// the blocks' bytes unchanged. Pointers into a tensor the caller keeps alive.
struct GMat {
  GType type = GType::F32;
  int64_t N = 0, K = 0, row_bytes = 0;
  const uint8_t* raw = nullptr;
};

}  // namespace scratchlm_gguf
