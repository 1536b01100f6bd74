// GGUF K-quant and i-quant kernels over the file's own 256-weight super-blocks (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
// IQ4_XS): dequantization and y = x W^T (the interface in gguf_blocks.h; gguf_gemm.h dispatches here).
// Placeholder until the "kquants" kernels land: no type is handled yet, so gguf_gemm.h reports every K-quant as
// having no kernel (a clear error at load), never a wrong result.
#pragma once

#include <cstdint>

#include "gguf_blocks.h"

namespace scratchlm_gguf {

inline bool kq_handles(GType) { return false; }
inline void kq_dequantize_rows(const GMat&, int64_t, int64_t, float*) {}
inline void kq_gemm(const float*, int64_t, const GMat&, float*, int) {}
inline int kq_resolve_path(const GMat&, int64_t, int) { return -1; }  // -1: not handled

}  // namespace scratchlm_gguf
