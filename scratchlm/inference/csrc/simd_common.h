// Shared by the engine's C++ kernels: the AVX2 horizontal sum and the run-time CPU check.
#pragma once

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SCRATCHLM_X86 1
#define AVX2_FN __attribute__((target("avx2,fma")))

namespace scratchlm_simd {

AVX2_FN inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace scratchlm_simd
#else
namespace scratchlm_simd {
inline bool cpu_has_avx2() { return false; }
}  // namespace scratchlm_simd
#endif
