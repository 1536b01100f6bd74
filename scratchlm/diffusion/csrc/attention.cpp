// Fused non-causal attention on the CPU for small head dims (scratchlm.diffusion.fused_attention).
//
//   q    (B, T, H, D)  float32, last dim contiguous (any other strides: a projection's (B, T, H*D) viewed as heads)
//   k/v  (B, S, H, D)  float32, the same
//   out  (B, T, H, D)  float32, contiguous: softmax(q k^T * scale) v, never holding more than R x S scores
//
// Why: a UNet's top level attends over h*w tokens with a head dim of 8-40 (SD 1.5 at reduced width: 8). There
// the work per score is a handful of FMAs and one exp, and torch's flash kernel (GEMM calls with K = D, then
// separate max / exp / rescale passes over a (32 x 512) block) spends most of its time outside arithmetic. Here
// one work item is one (batch, head): its K and V are transposed once into D x S panels (keys in lanes), then
// each tile of R = 8 query rows runs over the keys in blocks of KEY_BLOCK = 512 (online softmax across blocks):
//   pass 1: s[r, j..j+16] = sum_d q[r, d] * Kt[d, j..j+16]  (one Kt load feeds R FMAs), times scale, the block's
//           row maxima on the way, into an L1 buffer of R x 512 floats;
//   pass 2: p = exp(s - max) in place, row sums (16 lanes at a time, a masked tail, never exp of padding); the
//           earlier blocks' sums and outputs rescaled by exp(old max - new max);
//   pass 3: o[r, d] += sum_j p[r, j] Vt[d, j] with 16-lane accumulators (d in groups of 8, 2 rows a time), reduced
//           across lanes per block; out = o / sum at the end.
// Exact attention (no approximation beyond float rounding: exp is a ~1-ulp polynomial, Cephes' expf), the sums
// in a different order than torch's, so results differ from sdpa by float rounding (~1e-7 relative).
// AVX-512F only; callers check `supported()` (and $SCRATCHLM_ISA, scratchlm.isa) and use torch's sdpa otherwise.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define F512 __attribute__((target("avx512f")))

namespace {

// 2^x for x <= 0 (scores minus their row maximum, in log2 units): x = n + f with n = round(x), |f| <= 1/2,
// 2^f = e^(f ln 2) by its degree-6 Taylor polynomial (relative error < 1.3e-7, about one float ulp), times 2^n by
// scalef (exact). Below x = -126 the result is flushed to 0: those terms are < 2^-126 of the row's largest (1), far
// under float rounding of the sum, and as subnormal floats they would make every later FMA on them take a
// microcode assist (tens of times slower: scores spread over a wide range, as in trained models, hit this).
F512 inline __m512 exp2_512(__m512 x) {
  const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-126.f), _CMP_GE_OQ);
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(x, n), _mm512_set1_ps(0.693147180559945309f));  // f ln 2
  __m512 y = _mm512_set1_ps(1.f / 720.f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f / 120.f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f / 24.f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f / 6.f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(0.5f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.f));
  return _mm512_maskz_scalef_ps(normal, y, n);
}

struct Item {
  const float *q, *k, *v;
  float* out;
  int64_t T, S, D, Sp;       // Sp: S rounded up to 16 (the panels' row length)
  int64_t qs, ks, vs, os;    // row strides (between tokens) of q, k, v, out
  float scale;
};

// Kt[d * Sp + j] = k[j, d]; zero padding past S (never used: the tail is masked).
F512 void transpose_panel(const float* src, int64_t stride, int64_t S, int64_t D, int64_t Sp, float* dst) {
  for (int64_t j = 0; j < S; ++j) {
    const float* row = src + j * stride;
    for (int64_t d = 0; d < D; ++d) dst[d * Sp + j] = row[d];
  }
  for (int64_t d = 0; d < D; ++d)
    for (int64_t j = S; j < Sp; ++j) dst[d * Sp + j] = 0.f;
}

// Keys per block: a tile's scores (ROWS x KEY_BLOCK floats) and the block's slices of the K/V panels stay in L1/L2
// however long the sequence (16k tokens at a 128x128 latent); the row maxima, sums and outputs carry across blocks
// with the online-softmax rescaling.
constexpr int64_t KEY_BLOCK = 512;

// Scores of R rows against keys [j0, j0 + n) (pass 1) into buf (R x KEY_BLOCK), the row maxima into mx.
template <int R>
F512 void scores(const Item& it, const float* Kt, int64_t t0, int64_t j0, int64_t n, float* buf, float* mx) {
  const int64_t D = it.D, Sp = it.Sp;
  const float* q[R];
  for (int r = 0; r < R; ++r) q[r] = it.q + (t0 + r) * it.qs;
  __m512 m[R];
  for (int r = 0; r < R; ++r) m[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 sc = _mm512_set1_ps(it.scale);
  for (int64_t j = 0; j < n; j += 16) {
    __m512 s[R];
    for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 kt = _mm512_loadu_ps(Kt + d * Sp + j0 + j);
      for (int r = 0; r < R; ++r) s[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d]), kt, s[r]);
    }
    const __mmask16 valid = j + 16 <= n ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1u);
    for (int r = 0; r < R; ++r) {
      s[r] = _mm512_mul_ps(s[r], sc);
      _mm512_storeu_ps(buf + r * KEY_BLOCK + j, s[r]);
      m[r] = _mm512_mask_max_ps(m[r], valid, m[r], s[r]);
    }
  }
  for (int r = 0; r < R; ++r) mx[r] = _mm512_reduce_max_ps(m[r]);
}

// p = 2^(s - max) = e^(score - max score) in place for n scores (s: scores times log2 e; the padding lanes of the
// last vector set to 0); returns their sum.
F512 float exp_row(float* s, int64_t n, float mx) {
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 p = exp2_512(_mm512_sub_ps(_mm512_loadu_ps(s + j), m));
    _mm512_storeu_ps(s + j, p);
    acc = _mm512_add_ps(acc, p);
  }
  if (j < n) {
    const __mmask16 valid = (__mmask16)((1u << (n - j)) - 1u);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp2_512(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
    _mm512_storeu_ps(s + j, p);
    acc = _mm512_add_ps(acc, p);
  }
  return _mm512_reduce_add_ps(acc);
}

// o (R2 rows of D floats) += P (R2 rows of buf, keys [j0, j0 + n)) @ V, for the head features d0..d0+8.
template <int R2>
F512 void values8(const Item& it, const float* Vt, const float* buf, int64_t j0, int64_t n, int64_t d0, float* o) {
  const int64_t Sp = it.Sp;
  const int nd = (int)std::min<int64_t>(8, it.D - d0);
  __m512 acc[R2][8];
  for (int r = 0; r < R2; ++r)
    for (int d = 0; d < 8; ++d) acc[r][d] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    __m512 p[R2];
    for (int r = 0; r < R2; ++r) p[r] = _mm512_loadu_ps(buf + r * KEY_BLOCK + j);
    for (int d = 0; d < nd; ++d) {
      const __m512 vt = _mm512_loadu_ps(Vt + (d0 + d) * Sp + j0 + j);
      for (int r = 0; r < R2; ++r) acc[r][d] = _mm512_fmadd_ps(p[r], vt, acc[r][d]);
    }
  }
  for (int r = 0; r < R2; ++r)
    for (int d = 0; d < nd; ++d) o[r * it.D + d0 + d] += _mm512_reduce_add_ps(acc[r][d]);
}

template <int R>
F512 void tile(const Item& it, const float* Kt, const float* Vt, int64_t t0, float* buf, float* o) {
  const int64_t D = it.D;
  float m[R], l[R], bm[R];
  for (int r = 0; r < R; ++r) m[r] = -std::numeric_limits<float>::infinity(), l[r] = 0.f;
  std::fill(o, o + R * D, 0.f);
  for (int64_t j0 = 0; j0 < it.S; j0 += KEY_BLOCK) {
    const int64_t n = std::min(KEY_BLOCK, it.S - j0);
    scores<R>(it, Kt, t0, j0, n, buf, bm);
    for (int r = 0; r < R; ++r) {
      const float mn = std::max(m[r], bm[r]);
      const float f = j0 ? std::exp2(m[r] - mn) : 0.f;  // rescales what the earlier blocks summed
      if (j0)
        for (int64_t d = 0; d < D; ++d) o[r * D + d] *= f;
      l[r] = l[r] * f + exp_row(buf + r * KEY_BLOCK, n, mn);
      m[r] = mn;
    }
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      int r = 0;
      for (; r + 2 <= R; r += 2) values8<2>(it, Vt, buf + r * KEY_BLOCK, j0, n, d0, o + r * D);
      for (; r < R; ++r) values8<1>(it, Vt, buf + r * KEY_BLOCK, j0, n, d0, o + r * D);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* out = it.out + (t0 + r) * it.os;
    const float inv = 1.f / l[r];
    for (int64_t d = 0; d < D; ++d) out[d] = o[r * D + d] * inv;
  }
}

constexpr int ROWS = 8;

F512 void run_item(const Item& it) {
  std::vector<float> panels(2 * it.D * it.Sp), buf(ROWS * KEY_BLOCK), o(ROWS * it.D);
  float* Kt = panels.data();
  float* Vt = Kt + it.D * it.Sp;
  transpose_panel(it.k, it.ks, it.S, it.D, it.Sp, Kt);
  transpose_panel(it.v, it.vs, it.S, it.D, it.Sp, Vt);
  int64_t t = 0;
  for (; t + ROWS <= it.T; t += ROWS) tile<ROWS>(it, Kt, Vt, t, buf.data(), o.data());
  for (; t < it.T; ++t) tile<1>(it, Kt, Vt, t, buf.data(), o.data());
}

bool cpu_ok() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}

}  // namespace

bool supported() {
  static const bool ok = cpu_ok();
  return ok;
}

torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(supported(), "fused attention needs AVX-512F");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "q, k, v must be (B, T|S, H, D)");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "fused attention takes float32");
  TORCH_CHECK(q.device().is_cpu(), "fused attention runs on the CPU");
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3), S = k.size(1);
  TORCH_CHECK(k.size(0) == B && v.size(0) == B && k.size(2) == H && v.size(2) == H && k.size(3) == D &&
              v.size(3) == D && v.size(1) == S, "shape mismatch between q, k, v");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "the head dim must be contiguous");
  auto out = torch::empty({B, T, H, D}, q.options());
  const int64_t Sp = (S + 15) / 16 * 16;
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / H, h = i % H;
      Item it{qp + b * q.stride(0) + h * q.stride(2), kp + b * k.stride(0) + h * k.stride(2),
              vp + b * v.stride(0) + h * v.stride(2), op + b * T * H * D + h * D,
              T, S, D, Sp, q.stride(1), k.stride(1), v.stride(1), H * D,
              (float)(scale * 1.4426950408889634)};  // scores in log2 units (exp2_512)
      run_item(it);
    }
  });
  return out;
}

#else
bool supported() { return false; }
torch::Tensor attention(torch::Tensor q, torch::Tensor, torch::Tensor, double) {
  TORCH_CHECK(false, "fused attention needs x86-64 AVX-512F");
  return q;
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &supported, "whether this CPU runs the fused attention (AVX-512F)");
  m.def("attention", &attention, "softmax(q k^T * scale) v for q (B, T, H, D), k/v (B, S, H, D) -> (B, T, H, D)");
}
