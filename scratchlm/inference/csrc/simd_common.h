// Shared by the engine's C++ kernels: AVX2 horizontal sum / max, a vectorised exp, and the run-time CPU checks.
//
// ISA cap: every kernel family picks its code path with the cpu_has_* checks below, and those honour
// $SCRATCHLM_ISA, read once per process: `scalar` (no SIMD), `avx2` (AVX2 + FMA + F16C, with AVX-VNNI only as
// `avx2-vnni`), `avx512` / unset / `native` (whatever the CPU has). So an AVX-512 machine runs, and its tests
// check, exactly the code an AVX2-only CPU (Zen 2/3, most Intel client CPUs) would run. An unknown value is an
// error at the first check (std::runtime_error naming the variable), never a silent default.
#pragma once

#include <cstdlib>
#include <initializer_list>
#include <stdexcept>
#include <string>

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

AVX2_FN inline float hmax256(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// exp(x) for 8 floats (Cephes' expf: exp(x) = 2^n exp(r), r = x - n ln 2 in two parts, a degree-5 polynomial);
// relative error ~2e-7 on [-87, 88]; inputs below -87.3 give ~0 (not denormals), NaN stays NaN.
AVX2_FN inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3365478515625f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

}  // namespace scratchlm_simd
#endif

namespace scratchlm_simd {

// The highest ISA level kernels may use: 0 scalar, 1 AVX2 (+FMA, F16C), 2 AVX2 + AVX-VNNI, 3 native (AVX-512 ...).
inline int isa_cap() {
  static const int cap = [] {
    const char* e = std::getenv("SCRATCHLM_ISA");
    const std::string v = e ? e : "";
    if (v.empty() || v == "native" || v == "avx512") return 3;
    if (v == "avx2-vnni") return 2;
    if (v == "avx2") return 1;
    if (v == "scalar") return 0;
    throw std::runtime_error("SCRATCHLM_ISA=" + v + " is not one of native, avx512, avx2-vnni, avx2, scalar");
  }();
  return cap;
}

#ifdef SCRATCHLM_X86
inline bool cpu_supports_all(std::initializer_list<const char*> features) {
  __builtin_cpu_init();
  for (const char* f : features) {
    // __builtin_cpu_supports needs a literal; this switch lists the features the kernels ask for
    const std::string s = f;
    bool ok = s == "avx2" ? __builtin_cpu_supports("avx2") : s == "fma" ? __builtin_cpu_supports("fma")
              : s == "f16c" ? __builtin_cpu_supports("f16c") : s == "avx512f" ? __builtin_cpu_supports("avx512f")
              : s == "avx512bw" ? __builtin_cpu_supports("avx512bw") : s == "avx512vl" ? __builtin_cpu_supports("avx512vl")
              : s == "avx512dq" ? __builtin_cpu_supports("avx512dq")
              : s == "avx512vnni" ? __builtin_cpu_supports("avx512vnni") : s == "avxvnni" ? __builtin_cpu_supports("avxvnni")
              : false;
    if (!ok) return false;
  }
  return true;
}
// AVX2 + FMA + F16C (every x86 CPU since Haswell / Zen 1).
inline bool cpu_has_avx2() {
  static const bool v = isa_cap() >= 1 && cpu_supports_all({"avx2", "fma", "f16c"});
  return v;
}
// AVX-VNNI: vpdpbusd on 256-bit registers without AVX-512 (Alder Lake+, Zen 5); only with the avx2-vnni cap or
// native.
inline bool cpu_has_avxvnni() {
  static const bool v = isa_cap() >= 2 && cpu_has_avx2() && cpu_supports_all({"avxvnni"});
  return v;
}
// AVX-512 F + BW + VL + DQ (Skylake-X+, Zen 4+); native only.
inline bool cpu_has_avx512() {
  static const bool v = isa_cap() >= 3 && cpu_has_avx2() && cpu_supports_all({"avx512f", "avx512bw", "avx512vl", "avx512dq"});
  return v;
}
// AVX-512 VNNI (vpdpbusd on 128/256/512-bit registers, with VL); native only.
inline bool cpu_has_avx512vnni() {
  static const bool v = cpu_has_avx512() && cpu_supports_all({"avx512vnni"});
  return v;
}
#else
inline bool cpu_has_avx2() { return false; }
inline bool cpu_has_avxvnni() { return false; }
inline bool cpu_has_avx512() { return false; }
inline bool cpu_has_avx512vnni() { return false; }
#endif

// The name of what the kernels run on this process (for logs, `scratchlm bench kernels`, the tests).
inline const char* isa_name() {
  return cpu_has_avx512vnni() ? "avx512-vnni" : cpu_has_avx512() ? "avx512" : cpu_has_avxvnni() ? "avx2-vnni"
         : cpu_has_avx2() ? "avx2" : "scalar";
}

}  // namespace scratchlm_simd
