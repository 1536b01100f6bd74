// Fused dequantize + GEMV/GEMM kernels for weight-only int8 / int4 (scratchlm.inference.quantization).
//
// y (M, N) = x (M, K) @ W^T with W stored quantized (formats: scheme.py):
//   int8: q int8 (N, K), scales float32 (N, G)                  w = s * q
//   int4: q uint8 (N, K/2) nibbles in 32-weight chunks, d float16 (N, G), optional m float16 (N, G)
//         w = d * (q - 8) (symmetric, Q4_0)   or   w = d * q + m (asymmetric, Q4_1)
// Group sums of x are taken once per call, so the min / -8 terms cost one FMA per group:
//   sum_k x_k w_k = sum_g [ d_g * sum_{k in g} x_k q_k + m_g * sum_{k in g} x_k ].
//
// Two code paths in one binary: a portable scalar path (compiled with -O3 only) and an AVX2+FMA
// path (function-level target attributes, with F16C for the float16 scales) chosen at run time when the CPU has AVX2, so the same
// build runs on any x86-64 or ARM machine and both paths can be tested against each other.
// Output rows are split across threads with at::parallel_for. For M <= kFusedMaxRows each weight
// row is decoded on the fly per x row (the row stays in L1); for larger M a row is decoded once
// into a float buffer and dotted with every x row.

#include <cstdlib>
#include <string>
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SCRATCHLM_X86 1
#endif

namespace {

constexpr int64_t kChunk = 32;
constexpr int64_t kFusedMaxRows = 4;
constexpr int64_t kMinWorkPerThread = 1 << 16;  // weights x rows: smaller problems stay on one thread

inline float half_bits_to_float(uint16_t bits) {
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

struct Int4Args {
  const float* x; int64_t M, K, N, G, gs;
  const uint8_t* q; const uint16_t* d; const uint16_t* m;  // m == nullptr: symmetric
  const float* xsum;  // (M, G) group sums of x
  float* y;
};

struct Int8Args {
  const float* x; int64_t M, K, N, G, gs;
  const int8_t* q; const float* s;
  float* y;
};

inline float group_offset(const Int4Args& a, int64_t n, int64_t g) {
  float d = half_bits_to_float(a.d[n * a.G + g]);
  return a.m ? half_bits_to_float(a.m[n * a.G + g]) : -8.0f * d;
}

// ---------------------------------------------------------------- scalar (portable) path
void int4_decode_row_scalar(const Int4Args& a, int64_t n, float* out) {
  const uint8_t* qr = a.q + n * (a.K / 2);
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t start = g * a.gs, end = std::min(a.K, start + a.gs);
    const float d = half_bits_to_float(a.d[n * a.G + g]), off = group_offset(a, n, g);
    for (int64_t c = start; c < end; c += kChunk) {
      const uint8_t* b = qr + c / 2;
      for (int i = 0; i < 16; ++i) {
        out[c + i] = d * float(b[i] & 0x0F) + off;
        out[c + 16 + i] = d * float(b[i] >> 4) + off;
      }
    }
  }
}

float int4_dot_scalar(const Int4Args& a, int64_t n, int64_t mrow) {
  const uint8_t* qr = a.q + n * (a.K / 2);
  const float* xr = a.x + mrow * a.K;
  float total = 0.f;
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t start = g * a.gs, end = std::min(a.K, start + a.gs);
    float acc = 0.f;
    for (int64_t c = start; c < end; c += kChunk) {
      const uint8_t* b = qr + c / 2;
      for (int i = 0; i < 16; ++i) acc += xr[c + i] * float(b[i] & 0x0F) + xr[c + 16 + i] * float(b[i] >> 4);
    }
    total += half_bits_to_float(a.d[n * a.G + g]) * acc + group_offset(a, n, g) * a.xsum[mrow * a.G + g];
  }
  return total;
}

float int8_dot_scalar(const Int8Args& a, int64_t n, int64_t mrow) {
  const int8_t* qr = a.q + n * a.K;
  const float* xr = a.x + mrow * a.K;
  float total = 0.f;
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t start = g * a.gs, end = std::min(a.K, start + a.gs);
    float acc = 0.f;
    for (int64_t k = start; k < end; ++k) acc += xr[k] * float(qr[k]);
    total += a.s[n * a.G + g] * acc;
  }
  return total;
}

void int8_decode_row_scalar(const Int8Args& a, int64_t n, float* out) {
  const int8_t* qr = a.q + n * a.K;
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t start = g * a.gs, end = std::min(a.K, start + a.gs);
    const float s = a.s[n * a.G + g];
    for (int64_t k = start; k < end; ++k) out[k] = s * float(qr[k]);
  }
}

float dot_scalar(const float* x, const float* w, int64_t K) {
  float acc = 0.f;
  for (int64_t k = 0; k < K; ++k) acc += x[k] * w[k];
  return acc;
}

// ---------------------------------------------------------------- AVX2 + FMA path
#ifdef SCRATCHLM_X86
#define AVX2_FN __attribute__((target("avx2,fma,f16c")))

// F16C: one instruction instead of c10::Half's bit-twiddling (it runs once per 32-weight group).
AVX2_FN inline float half_f16c(uint16_t bits) { return _cvtsh_ss(bits); }

AVX2_FN inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 16 packed bytes -> the chunk's 32 weights as four 8-float vectors (values 0..15).
AVX2_FN inline void nibbles_to_float(const uint8_t* b, __m256* w) {
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m128i lo = _mm_and_si128(raw, mask);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
}

AVX2_FN float int4_dot_avx2(const Int4Args& a, int64_t n, int64_t mrow) {
  const uint8_t* qr = a.q + n * (a.K / 2);
  const float* xr = a.x + mrow * a.K;
  __m256 total = _mm256_setzero_ps();
  float offsets = 0.f;
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t start = g * a.gs, end = std::min(a.K, start + a.gs);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t c = start; c < end; c += kChunk) {
      __m256 w[4];
      nibbles_to_float(qr + c / 2, w);
      acc0 = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xr + c), acc0);
      acc1 = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xr + c + 8), acc1);
      acc0 = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xr + c + 16), acc0);
      acc1 = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xr + c + 24), acc1);
    }
    const float d = half_f16c(a.d[n * a.G + g]);
    const float off = a.m ? half_f16c(a.m[n * a.G + g]) : -8.0f * d;
    total = _mm256_fmadd_ps(_mm256_add_ps(acc0, acc1), _mm256_set1_ps(d), total);
    offsets += off * a.xsum[mrow * a.G + g];
  }
  return hsum256(total) + offsets;
}

AVX2_FN void int4_decode_row_avx2(const Int4Args& a, int64_t n, float* out) {
  const uint8_t* qr = a.q + n * (a.K / 2);
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t start = g * a.gs, end = std::min(a.K, start + a.gs);
    const float df = half_f16c(a.d[n * a.G + g]);
    const __m256 d = _mm256_set1_ps(df);
    const __m256 off = _mm256_set1_ps(a.m ? half_f16c(a.m[n * a.G + g]) : -8.0f * df);
    for (int64_t c = start; c < end; c += kChunk) {
      __m256 w[4];
      nibbles_to_float(qr + c / 2, w);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + c + 8 * j, _mm256_fmadd_ps(w[j], d, off));
    }
  }
}

AVX2_FN float int8_dot_avx2(const Int8Args& a, int64_t n, int64_t mrow) {
  const int8_t* qr = a.q + n * a.K;
  const float* xr = a.x + mrow * a.K;
  __m256 total = _mm256_setzero_ps();
  float tail = 0.f;
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t start = g * a.gs, end = std::min(a.K, start + a.gs);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int64_t k = start;
    for (; k + 16 <= end; k += 16) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qr + k));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
      acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr + k), acc0);
      acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + k + 8), acc1);
    }
    float rest = 0.f;
    for (; k < end; ++k) rest += xr[k] * float(qr[k]);
    const float s = a.s[n * a.G + g];
    total = _mm256_fmadd_ps(_mm256_add_ps(acc0, acc1), _mm256_set1_ps(s), total);
    tail += s * rest;
  }
  return hsum256(total) + tail;
}

AVX2_FN void int8_decode_row_avx2(const Int8Args& a, int64_t n, float* out) {
  const int8_t* qr = a.q + n * a.K;
  for (int64_t g = 0; g < a.G; ++g) {
    const int64_t start = g * a.gs, end = std::min(a.K, start + a.gs);
    const float s = a.s[n * a.G + g];
    const __m256 sv = _mm256_set1_ps(s);
    int64_t k = start;
    for (; k + 8 <= end; k += 8) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qr + k));
      _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw)), sv));
    }
    for (; k < end; ++k) out[k] = s * float(qr[k]);
  }
}

AVX2_FN float dot_avx2(const float* x, const float* w, int64_t K) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_loadu_ps(w + k + 8), acc1);
  }
  float rest = 0.f;
  for (; k < K; ++k) rest += x[k] * w[k];
  return hsum256(_mm256_add_ps(acc0, acc1)) + rest;
}
#endif  // SCRATCHLM_X86

bool cpu_has_avx2() {
#ifdef SCRATCHLM_X86
  const char* isa = std::getenv("SCRATCHLM_ISA");  // scalar: no SIMD (as the engine kernels, simd_common.h)
  if (isa != nullptr && std::string(isa) == "scalar") return false;
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

// Run `dot(n, m)` (fused) or `decode(n, buf)` + `dot(x_m, buf)` over all output rows in parallel.
template <typename Dot, typename Decode, typename FDot>
void run_rows(int64_t M, int64_t N, int64_t K, const float* x, float* y, Dot dot, Decode decode, FDot fdot) {
  // Thread wake-ups cost more than a small matvec (and much more on a loaded machine): split
  // the rows only into chunks of at least kMinWorkPerThread multiply-adds.
  const int64_t grain = std::max<int64_t>(1, kMinWorkPerThread / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (M <= kFusedMaxRows) {
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < M; ++m) y[m * N + n] = dot(n, m);
      return;
    }
    std::vector<float> buf(K);
    for (int64_t n = n0; n < n1; ++n) {
      decode(n, buf.data());
      for (int64_t m = 0; m < M; ++m) y[m * N + n] = fdot(x + m * K, buf.data(), K);
    }
  });
}

void check_x(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu(), "quant kernel: x must be a CPU tensor, got ", x.device());
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "quant kernel: x must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "quant kernel: x must be (M, ", K, "), got ", x.sizes());
}

}  // namespace

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor d, c10::optional<torch::Tensor> m,
                          int64_t group_size, bool use_simd) {
  TORCH_CHECK(q.scalar_type() == torch::kUInt8 && q.dim() == 2, "int4_linear: q must be uint8 (N, K/2)");
  const int64_t N = q.size(0), K = q.size(1) * 2;
  TORCH_CHECK(K % kChunk == 0, "int4_linear: K=", K, " must be a multiple of 32");
  TORCH_CHECK(group_size > 0 && group_size % kChunk == 0, "int4_linear: group_size=", group_size,
              " must be a positive multiple of 32");
  const int64_t G = (K + group_size - 1) / group_size;
  TORCH_CHECK(d.scalar_type() == torch::kFloat16 && d.sizes() == torch::IntArrayRef({N, G}),
              "int4_linear: d must be float16 (", N, ", ", G, "), got ", d.scalar_type(), " ", d.sizes());
  check_x(x, K);
  x = x.contiguous(); q = q.contiguous(); d = d.contiguous();
  torch::Tensor mm;
  if (m.has_value()) {
    mm = m->contiguous();
    TORCH_CHECK(mm.scalar_type() == torch::kFloat16 && mm.sizes() == d.sizes(), "int4_linear: m must match d");
  }
  const int64_t M = x.size(0);
  // Group sums of x (M, G) for the -8 d / m terms.
  auto xs = torch::empty({M, G}, x.options());
  {
    const float* xp = x.data_ptr<float>();
    float* sp = xs.data_ptr<float>();
    for (int64_t r = 0; r < M; ++r)
      for (int64_t g = 0; g < G; ++g) {
        float acc = 0.f;
        for (int64_t k = g * group_size; k < std::min(K, (g + 1) * group_size); ++k) acc += xp[r * K + k];
        sp[r * G + g] = acc;
      }
  }
  auto y = torch::empty({M, N}, x.options());
  Int4Args a{x.data_ptr<float>(), M, K, N, G, group_size, q.data_ptr<uint8_t>(),
             reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>()),
             m.has_value() ? reinterpret_cast<const uint16_t*>(mm.data_ptr<at::Half>()) : nullptr,
             xs.data_ptr<float>(), y.data_ptr<float>()};
#ifdef SCRATCHLM_X86
  if (use_simd && cpu_has_avx2()) {
    run_rows(M, N, K, a.x, a.y, [&](int64_t n, int64_t r) { return int4_dot_avx2(a, n, r); },
             [&](int64_t n, float* o) { int4_decode_row_avx2(a, n, o); }, dot_avx2);
    return y;
  }
#endif
  run_rows(M, N, K, a.x, a.y, [&](int64_t n, int64_t r) { return int4_dot_scalar(a, n, r); },
           [&](int64_t n, float* o) { int4_decode_row_scalar(a, n, o); }, dot_scalar);
  return y;
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor s, int64_t group_size, bool use_simd) {
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.dim() == 2, "int8_linear: q must be int8 (N, K)");
  const int64_t N = q.size(0), K = q.size(1);
  TORCH_CHECK(group_size > 0, "int8_linear: group_size must be positive");
  const int64_t G = (K + group_size - 1) / group_size;
  TORCH_CHECK(s.scalar_type() == torch::kFloat32 && s.sizes() == torch::IntArrayRef({N, G}),
              "int8_linear: scales must be float32 (", N, ", ", G, "), got ", s.scalar_type(), " ", s.sizes());
  check_x(x, K);
  x = x.contiguous(); q = q.contiguous(); s = s.contiguous();
  const int64_t M = x.size(0);
  auto y = torch::empty({M, N}, x.options());
  Int8Args a{x.data_ptr<float>(), M, K, N, G, group_size, q.data_ptr<int8_t>(), s.data_ptr<float>(),
             y.data_ptr<float>()};
#ifdef SCRATCHLM_X86
  if (use_simd && cpu_has_avx2()) {
    run_rows(M, N, K, a.x, a.y, [&](int64_t n, int64_t r) { return int8_dot_avx2(a, n, r); },
             [&](int64_t n, float* o) { int8_decode_row_avx2(a, n, o); }, dot_avx2);
    return y;
  }
#endif
  run_rows(M, N, K, a.x, a.y, [&](int64_t n, int64_t r) { return int8_dot_scalar(a, n, r); },
           [&](int64_t n, float* o) { int8_decode_row_scalar(a, n, o); }, dot_scalar);
  return y;
}

bool has_avx2() { return cpu_has_avx2(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("int4_linear", &int4_linear, "y = x @ W^T, W int4 (packed nibbles, fp16 scales [, mins])",
          py::arg("x"), py::arg("q"), py::arg("d"), py::arg("m"), py::arg("group_size"), py::arg("use_simd") = true,
          py::call_guard<py::gil_scoped_release>());  // other threads (the server's event loop) run meanwhile
  mod.def("int8_linear", &int8_linear, "y = x @ W^T, W int8 with float32 group scales",
          py::arg("x"), py::arg("q"), py::arg("s"), py::arg("group_size"), py::arg("use_simd") = true,
          py::call_guard<py::gil_scoped_release>());
  mod.def("has_avx2", &has_avx2, "whether the CPU supports AVX2 + FMA (the vectorized path)");
}
