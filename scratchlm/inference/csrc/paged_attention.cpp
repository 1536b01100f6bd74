// Paged decode attention on the CPU (scratchlm.inference.attention): one query token per sequence
// attends to its context in the block-table KV cache, read in place (no gather copy).
//
//   q            (B, H, D)  float32
//   k/v_cache    (num_blocks, block_size, Hkv, D)  float32, slot s = block * block_size + offset
//   block_tables (B, max_blocks) int64;  context_lens (B,) int64
//   out          (B, H, D)  float32
//
// Work item = (sequence b, kv head h): its G = H / Hkv query heads share every K/V row they read
// (grouped-query attention without repeating K/V). Two passes over the context: scores
// s[t, g] = q_g . k_t * scale (K read once), a softmax per query head, then out_g = sum_t p[t, g] v_t
// (V read once). Items are split across threads with at::parallel_for. The GIL is released while it runs.
// An AVX2+FMA path (function target attributes, chosen at run time) and a portable scalar path.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd_common.h"

namespace {

using scratchlm_simd::cpu_has_avx2;

struct Args {
  const float* q; const float* k; const float* v;
  const int64_t* tables; const int64_t* lens;
  float* out;
  int64_t B, H, Hkv, D, bs, max_blocks;
  float scale;
};

inline const float* row(const float* cache, const Args& a, const int64_t* table, int64_t t, int64_t h) {
  const int64_t block = table[t / a.bs];
  return cache + ((block * a.bs + t % a.bs) * a.Hkv + h) * a.D;
}

// Softmax over t of scores[t * G + g] for each g, in place.
void softmax_columns(float* scores, int64_t T, int64_t G) {
  for (int64_t g = 0; g < G; ++g) {
    float mx = -INFINITY;
    for (int64_t t = 0; t < T; ++t) mx = std::max(mx, scores[t * G + g]);
    float sum = 0.f;
    for (int64_t t = 0; t < T; ++t) {
      const float e = std::exp(scores[t * G + g] - mx);
      scores[t * G + g] = e;
      sum += e;
    }
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < T; ++t) scores[t * G + g] *= inv;
  }
}

void item_scalar(const Args& a, int64_t b, int64_t h, float* scores) {
  const int64_t G = a.H / a.Hkv, D = a.D, T = a.lens[b];
  const int64_t* table = a.tables + b * a.max_blocks;
  const float* q = a.q + (b * a.H + h * G) * D;  // (G, D)
  for (int64_t t = 0; t < T; ++t) {
    const float* kr = row(a.k, a, table, t, h);
    for (int64_t g = 0; g < G; ++g) {
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[g * D + d] * kr[d];
      scores[t * G + g] = acc * a.scale;
    }
  }
  softmax_columns(scores, T, G);
  float* o = a.out + (b * a.H + h * G) * D;  // (G, D)
  std::fill(o, o + G * D, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    const float* vr = row(a.v, a, table, t, h);
    for (int64_t g = 0; g < G; ++g) {
      const float p = scores[t * G + g];
      for (int64_t d = 0; d < D; ++d) o[g * D + d] += p * vr[d];
    }
  }
}

#ifdef SCRATCHLM_X86
using scratchlm_simd::hsum256;

// Head dim D = 8 * NC. Walks the block table block by block (no division per token). Scores: each K row is
// loaded once per 8-float chunk and multiplied into all G query heads. Values: one query head at a time with
// its D outputs held in NC registers while V streams by (V of one sequence stays in L2 across the G passes).
template <int NC>
AVX2_FN void item_avx2(const Args& a, int64_t b, int64_t h, float* scores) {
  constexpr int64_t D = 8 * NC;
  const int64_t G = a.H / a.Hkv, T = a.lens[b], stride = a.Hkv * D;
  const int64_t* table = a.tables + b * a.max_blocks;
  const float* q = a.q + (b * a.H + h * G) * D;  // (G, D)
  for (int64_t t0 = 0, blk = 0; t0 < T; t0 += a.bs, ++blk) {
    const float* base = a.k + (table[blk] * a.bs * a.Hkv + h) * D;
    const int64_t n = std::min(a.bs, T - t0);
    for (int64_t i = 0; i < n; ++i) {
      const float* kr = base + i * stride;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = q + g * D;
        __m256 acc0 = _mm256_mul_ps(_mm256_loadu_ps(qg), _mm256_loadu_ps(kr));
        __m256 acc1 = _mm256_setzero_ps();
        for (int c = 1; c < NC; c += 2) {
          acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), _mm256_loadu_ps(kr + 8 * c), acc1);
          if (c + 1 < NC) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c + 8), _mm256_loadu_ps(kr + 8 * c + 8), acc0);
        }
        scores[(t0 + i) * G + g] = hsum256(_mm256_add_ps(acc0, acc1)) * a.scale;
      }
    }
  }
  softmax_columns(scores, T, G);
  for (int64_t g = 0; g < G; ++g) {
    __m256 o[NC];
    for (int c = 0; c < NC; ++c) o[c] = _mm256_setzero_ps();
    for (int64_t t0 = 0, blk = 0; t0 < T; t0 += a.bs, ++blk) {
      const float* base = a.v + (table[blk] * a.bs * a.Hkv + h) * D;
      const int64_t n = std::min(a.bs, T - t0);
      for (int64_t i = 0; i < n; ++i) {
        const float* vr = base + i * stride;
        const __m256 p = _mm256_set1_ps(scores[(t0 + i) * G + g]);
        for (int c = 0; c < NC; ++c) o[c] = _mm256_fmadd_ps(p, _mm256_loadu_ps(vr + 8 * c), o[c]);
      }
    }
    float* og = a.out + (b * a.H + h * G + g) * D;
    for (int c = 0; c < NC; ++c) _mm256_storeu_ps(og + 8 * c, o[c]);
  }
}

using ItemFn = void (*)(const Args&, int64_t, int64_t, float*);

ItemFn avx2_item_for(int64_t D) {
  switch (D) {
    case 32: return item_avx2<4>;
    case 64: return item_avx2<8>;
    case 80: return item_avx2<10>;
    case 96: return item_avx2<12>;
    case 128: return item_avx2<16>;
    default: return nullptr;
  }
}

#endif

}  // namespace

bool has_avx2() { return cpu_has_avx2(); }

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     bool use_simd) {
  TORCH_CHECK(q.dim() == 3, "q must be (B, H, D), got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k/v caches must be (num_blocks, block_size, Hkv, D) and equal in shape");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "paged_decode_attention takes float32 tensors");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k/v caches must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head dim of q (", D, ") and cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(H % Hkv == 0, H, " query heads is not a multiple of ", Hkv, " kv heads");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "one block table and length per query");
  auto out = torch::empty_like(q);
  Args a{q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
         block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
         B, H, Hkv, D, k_cache.size(1), block_tables.size(1), static_cast<float>(scale)};
  int64_t max_len = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = a.lens[b];
    TORCH_CHECK(len >= 1 && len <= a.max_blocks * a.bs, "context length ", len, " out of range for its block table");
    max_len = std::max(max_len, len);
  }
  const int64_t G = H / Hkv;
  ItemFn item = item_scalar;
#ifdef SCRATCHLM_X86
  if (use_simd && cpu_has_avx2() && avx2_item_for(D) != nullptr) item = avx2_item_for(D);
#endif
  // Grain: enough items per thread that small batches stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, max_len * D));
  at::parallel_for(0, B * Hkv, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(max_len * G);
    for (int64_t i = begin; i < end; ++i) item(a, i / Hkv, i % Hkv, scores.data());
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("use_simd") = true, py::call_guard<py::gil_scoped_release>());
  m.def("has_avx2", &has_avx2, "whether the CPU runs the AVX2+FMA path");
}
