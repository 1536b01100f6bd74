// A whole step of a Llama-style decoder in one C++ call: every layer, for B rows (tokens), with no Python between
// the ops. Each row carries its own block table and context length: a decode row attends to its sequence's whole
// context, row j of a prefill chunk to the tokens up to its own, so mixed prefill/decode steps run here too
// (scratchlm.inference.runner builds the per-row metadata). All K/V of a layer are written before its attention.
//
// Per layer, on x (B, d), the residual stream, updated in place (the Llama block):
//   h = rmsnorm(x) * w_attn_norm;  q, k, v = h Wq^T (+bq), h Wk^T (+bk), h Wv^T (+bv)
//   rotate q, k (RoPE, "half" = HF rotate-half pairs (i, i + D/2), else adjacent pairs (2i, 2i + 1))
//   write k, v into the paged cache at each token's slot; a = paged decode attention (paged_attention.h)
//   x += a Wo^T;  h = rmsnorm(x) * w_ffn_norm;  x += (silu(h W1^T) * h W3^T) W2^T
// and every feature of scratchlm.model's one TransformerBlock, per layer (`Features`, built in Python from the
// ModelConfig by runner.fused_decoder_for): norms pre / post / both (sandwich), RMSNorm or LayerNorm (with bias),
// o bias, q/k-norm (RMSNorm per head or over the whole projection, before RoPE), RoPE on the first R dims only
// (partial rotary), one of two cos/sin tables per layer (Gemma 3's sliding layers) or none (NoPE), any query
// scale, the logit soft-cap and a sliding window (in the attention kernel: the blocks before a window are not
// read), a gated or plain MLP with silu / gelu-tanh / gelu and biases, a residual multiplier. A layer whose
// features are all the Llama block's runs exactly the code of before (`Features::on` false).
// float32 weights come packed in panels (panel_gemm.h, packed by fast_linear.py): every B runs the panel kernel, q/k/v
// in one GEMM and gate/up in one (the input read once). Plain float32 weights (the constructor's 9-tensor layers)
// use the skinny GEMM (skinny_gemm.h) up to 64 rows. Quantized weights use the integer kernels of
// quant_gemm.h for int8 / int4 planes (GGUF Q4_0 / Q4_1 / Q8_0 among them; their quantized x is shared by the
// q/k/v and the gate/up matmuls), larger ones ATen's mm (quantized weights dequantized once per call); GGUF weights
// kept in their file blocks (K-quants, Q5_x, IQ4) run gguf_gemm.h's kernels (qlinear.h). A layer may mix them
// (a Q4_K_M file mixes Q5_0, Q8_0, Q4_K and Q6_K). The arithmetic is the Python
// model's, op for op (tests compare the two); only the per-op dispatch is gone: at batch 1 that was ~40 % of a
// SmolLM2-135M step (about 45 torch ops per layer).

#pragma once

#include <torch/extension.h>

#include <time.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "moe.h"
#include "paged_attention.h"
#include "panel_gemm.h"
#include "qlinear.h"
#include "skinny_gemm.h"

namespace scratchlm_decoder {

using scratchlm_qgemm::QAct;
using scratchlm_qgemm::QLinear;

using scratchlm_panel::PanelWeight;

// A layer's features beyond the Llama block (all off by default). Tensors undefined when absent.
struct Features {
  bool on = false;  // any of the below differs from the Llama block: forward takes the general path
  bool pre = true, post = false;  // norms before each sublayer / on each sublayer's output (both: sandwich)
  bool layer_norm = false;        // LayerNorm (with *_b biases when given) instead of RMSNorm
  bool gated = true;              // act(h W1^T) * h W3^T; false: act(h W1^T) (no W3)
  int act = 0;                    // kSilu, kGeluTanh, kGelu
  int rope = 0;                   // 0: the first cos/sin tables, 1: the second, -1: no RoPE
  int64_t rotary = 0;             // leading dims of each head that rotate (head_dim: all)
  float scale = 0.f, softcap = 0.f;  // query scale, logit soft-cap (0: off)
  double mult = 1.0;                  // residual multiplier (a double, as the Python block's scalar)
  int64_t window = 0;                 // sliding window (0: off)
  torch::Tensor attn_norm_b, ffn_norm_b, attn_post, attn_post_b, ffn_post, ffn_post_b, bo, b1, b2, b3;
  torch::Tensor q_norm, k_norm;  // RMSNorm weights: (D,) per head or (heads * D,) over the whole projection
};

struct Layer {
  torch::Tensor attn_norm, ffn_norm, bq, bk, bv;  // biases undefined when absent; the norms when placed before
  QLinear wq, wk, wv, wo, w1, w2, w3;
  Features f;
  // float32 weights packed in panels (panel_gemm.h) instead: q/k/v and gate/up each one GEMM when their panels
  // lie one after another (fast_linear.py packs them so), else one part per matrix.
  bool panel = false;
  std::vector<PanelWeight> qkv, gu;
  PanelWeight po, p2;
  std::shared_ptr<MoELayer> moe;  // a mixture-of-experts layer (moe.h) in place of the MLP; null: dense
};

inline void check_weight(const torch::Tensor& t, std::vector<int64_t> shape, const char* what, size_t layer) {
  TORCH_CHECK(t.defined() && t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
              "layer ", layer, ": ", what, " must be a contiguous float32 CPU tensor");
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(shape), "layer ", layer, ": ", what, " has shape ", t.sizes(),
              ", expected ", c10::IntArrayRef(shape));
}

// The row ops between the linears. The engine's unfused CPU path runs these same functions (engine_kernels.cpp
// exposes them; scratchlm/inference/engine_ops.py swaps the model's RMSNorm / RoPE / SwiGLU to them), so both
// paths feed every linear bit-identical inputs: the integer kernels round x to int8 per block, and a few-ulp
// difference between two implementations of a norm would otherwise round some x to the other int8 code.
// Plain loops (RMSNorm's sum of squares in fixed-order AVX2 partial sums; no FMA contraction: the baseline target
// and the norm's "avx2" target have none; no reassociation: no -ffast-math), so the results do not depend on the
// caller.

#ifdef SCRATCHLM_X86
#define NORM_FN __attribute__((target("avx2")))  // no "fma": the products are rounded before they are added

// sum_i x[i]^2 over [0, d): 4 x 8 lanes over 32-element steps, then one 8-lane step, the lanes reduced in a fixed
// order, then the last d % 8 elements in order. A row's sum depends on its values alone.
NORM_FN inline float sum_squares_avx2(const float* x, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t i = 0;
  for (; i + 32 <= d; i += 32) {
    const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
    const __m256 x2 = _mm256_loadu_ps(x + i + 16), x3 = _mm256_loadu_ps(x + i + 24);
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(x0, x0));
    a1 = _mm256_add_ps(a1, _mm256_mul_ps(x1, x1));
    a2 = _mm256_add_ps(a2, _mm256_mul_ps(x2, x2));
    a3 = _mm256_add_ps(a3, _mm256_mul_ps(x3, x3));
  }
  for (; i + 8 <= d; i += 8) {
    const __m256 x0 = _mm256_loadu_ps(x + i);
    a0 = _mm256_add_ps(a0, _mm256_mul_ps(x0, x0));
  }
  const __m256 a = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float ss = _mm_cvtss_f32(h);
  for (; i < d; ++i) ss += x[i] * x[i];
  return ss;
}

// y[i] = (x[i] * r) * w[i], as the scalar loop (two roundings per element).
NORM_FN inline void scale_row_avx2(const float* x, const float* w, float r, float* y, int64_t d) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(y + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
  for (; i < d; ++i) y[i] = (x[i] * r) * w[i];
}
#endif

// y = (x * (1 / sqrt(mean(x^2) + eps))) * w, row by row, in float32; x, y (M, d). The sum of squares runs in 8-lane
// partial sums where the CPU has AVX2 (sum_squares_avx2; a scalar loop summing in order is latency-bound, ~4 cycles
// an element, and was ~0.3 s of the 32-request workload's steps), in order otherwise.
inline void rmsnorm_rows(const torch::Tensor& x, const torch::Tensor& w, torch::Tensor& y, float eps) {
  const int64_t M = x.size(0), d = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
#ifdef SCRATCHLM_X86
  static const bool avx2 = scratchlm_simd::cpu_has_avx2();
#else
  constexpr bool avx2 = false;
#endif
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * d;
    float* yr = yp + m * d;
    float ss = 0.f;
#ifdef SCRATCHLM_X86
    if (avx2) {
      ss = sum_squares_avx2(xr, d);
      scale_row_avx2(xr, wp, 1.f / std::sqrt(ss / static_cast<float>(d) + eps), yr, d);
      continue;
    }
#endif
    for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
    const float r = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    for (int64_t i = 0; i < d; ++i) yr[i] = (xr[i] * r) * wp[i];
  }
}

// y = ((x - mean) * (1 / sqrt(var + eps))) * w (+ b), row by row, mean and variance in float64 (exact enough
// to be order-free); x, y (M, d), b undefined for a LayerNorm without bias. torch's layer_norm within float32
// rounding.
inline void layernorm_rows(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b, torch::Tensor& y,
                           float eps) {
  const int64_t M = x.size(0), d = x.size(1);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = xp + m * d;
    float* yr = yp + m * d;
    double sum = 0.0;
    for (int64_t i = 0; i < d; ++i) sum += xr[i];
    const double mean = sum / static_cast<double>(d);
    double ss = 0.0;
    for (int64_t i = 0; i < d; ++i) ss += (xr[i] - mean) * (xr[i] - mean);
    const float mf = static_cast<float>(mean);
    const float r = static_cast<float>(1.0 / std::sqrt(ss / static_cast<double>(d) + static_cast<double>(eps)));
    if (bp) for (int64_t i = 0; i < d; ++i) yr[i] = ((xr[i] - mf) * r) * wp[i] + bp[i];
    else for (int64_t i = 0; i < d; ++i) yr[i] = ((xr[i] - mf) * r) * wp[i];
  }
}

// Rotate t (B, heads * D) in place by cos/sin (B, R/2) on the first R = rotary dims of each head (the rest pass
// through): "half" pairs (i, i + R/2) (HF rotate-half), else adjacent pairs (2i, 2i + 1); (x1, x2) ->
// (x1 c - x2 s, x2 c + x1 s), as RotaryEmbedding.rotate.
inline void rope_rows(torch::Tensor& t, int64_t heads, int64_t D, int64_t rotary, const torch::Tensor& cos,
                      const torch::Tensor& sin, bool half_pairs) {
  const int64_t B = t.size(0), half = rotary / 2;
  float* tp = t.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    const float* c = cp + b * half;
    const float* s = sp + b * half;
    for (int64_t hd = 0; hd < heads; ++hd) {
      float* r = tp + (b * heads + hd) * D;
      for (int64_t i = 0; i < half; ++i) {
        float* a = half_pairs ? r + i : r + 2 * i;
        float* bb = half_pairs ? r + i + half : r + 2 * i + 1;
        const float x1 = *a, x2 = *bb;
        *a = x1 * c[i] - x2 * s[i];
        *bb = x2 * c[i] + x1 * s[i];
      }
    }
  }
}

// Where a fused step's time goes, for benchmarks/decode_step.py: with profiling on, forward adds the calling
// thread's CPU seconds of each stage (all layers) into one process-wide table (off: one flag test per stage).
// Features go to the stage beside them: q/k-norm to "rope", post norms and the residual multiplier to "residual",
// any MLP activation to "silu_mul"; norms of post-only placement are not "attn_norm" / "ffn_norm".
enum Stage : int { kSetup, kAttnNorm, kQKV, kRope, kStore, kAttention, kO, kResidual, kFfnNorm, kGateUp, kSiluMul,
                   kDown, kMoE, kStages };
inline const char* const kStageNames[kStages] = {"setup", "attn_norm", "qkv_gemm", "rope", "kv_store", "attention",
                                                 "o_gemm", "residual", "ffn_norm", "gate_up_gemm", "silu_mul",
                                                 "down_gemm", "moe"};
struct StageProfile {
  std::atomic<bool> on{false};
  std::array<double, kStages> seconds{};
  int64_t steps = 0;
};
inline StageProfile& stage_profile() {
  static StageProfile p;
  return p;
}
inline double thread_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}
// Charges the time since the last mark to a stage (nothing when profiling is off).
struct StageClock {
  StageProfile* p;
  double t = 0.0;
  explicit StageClock(StageProfile& prof) : p(prof.on.load(std::memory_order_relaxed) ? &prof : nullptr) {
    if (p) t = thread_seconds(), ++p->steps;
  }
  void mark(Stage s) {
    if (!p) return;
    const double now = thread_seconds();
    p->seconds[s] += now - t;
    t = now;
  }
};

class FusedDecoder {
 public:
  // layers[i] = [attn_norm, wq, wk, wv, wo, ffn_norm, w1 (gate), w2 (down), w3 (up)] (+ [bq, bk, bv]), float32.
  // With `linears` (quantized models): layers[i] = [attn_norm, ffn_norm] (+ [bq, bk, bv]) and linears[i] the
  // 7 matrices [wq, wk, wv, wo, w1, w2, w3], each [w] (float32), [panels] (float32 (P, K, 16)), [q int8, scales],
  // [q uint8, d (, m)] or [raw uint8 (N, row_bytes)] (a GGUF weight in its file blocks, group size -(ggml type
  // id): qlinear.h), with their group sizes in group_sizes[i]. A layer whose linears are all panels runs the panel
  // groups (q/k/v and gate/up one GEMM each); any other mix runs one QLinear per matrix.
  // With `tensors` / `values` (one map each per layer; runner.fused_decoder_for builds them from the ModelConfig):
  // layers[i] = [] and linears[i] as above (w3 = [] for a plain MLP); the norms, biases and features come from
  // the maps: tensors {attn_norm, attn_norm_b, attn_post_norm, attn_post_norm_b, ffn_norm, ffn_norm_b,
  // ffn_post_norm, ffn_post_norm_b, bq, bk, bv, bo, b1, b2, b3, q_norm, k_norm} (absent keys: no such tensor),
  // values {scale, softcap, window, rope (-1 / 0 / 1), rotary_dim, act (0 silu, 1 gelu_tanh, 2 gelu), gated,
  // layer_norm, residual_multiplier} (all required). An unknown key is an error.
  // `moe` (layer -> MoELayer, moe.h): those layers' feed-forward is the mixture of experts; their linears[i] hold
  // the attention's 4 (w1, w2, w3 = []) and their values act / gated are the experts' (gated), no MLP biases.
  FusedDecoder(const std::vector<std::vector<torch::Tensor>>& layers, int64_t n_heads, int64_t n_kv_heads,
               int64_t head_dim, double eps, bool rope_half, bool use_simd,
               const std::vector<std::vector<std::vector<torch::Tensor>>>& linears = {},
               const std::vector<std::vector<int64_t>>& group_sizes = {},
               const std::vector<std::map<std::string, torch::Tensor>>& tensors = {},
               const std::vector<std::map<std::string, double>>& values = {},
               const std::map<int64_t, std::shared_ptr<MoELayer>>& moe = {})
      : H_(n_heads), Hkv_(n_kv_heads), D_(head_dim), eps_(static_cast<float>(eps)), rope_half_(rope_half),
        simd_(use_simd) {
    TORCH_CHECK(!layers.empty(), "FusedDecoder needs at least one layer");
    TORCH_CHECK(H_ > 0 && Hkv_ > 0 && H_ % Hkv_ == 0 && D_ > 0 && D_ % 2 == 0,
                "bad head configuration: ", H_, " heads, ", Hkv_, " kv heads, head dim ", D_);
    const bool split = !linears.empty();
    const bool featured = !tensors.empty() || !values.empty();
    TORCH_CHECK(!split || (linears.size() == layers.size() && group_sizes.size() == layers.size()),
                "linears and group_sizes need one entry per layer");
    TORCH_CHECK(!featured || (split && tensors.size() == layers.size() && values.size() == layers.size()),
                "features (tensors and values) need linears and one entry per layer");
    TORCH_CHECK(moe.empty() || featured, "MoE layers need features (tensors and values)");
    for (const auto& [i, m] : moe)
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(layers.size()) && m, "moe: bad layer ", i, " or no MoELayer");
    static const char* names[7] = {"wq", "wk", "wv", "wo", "w1", "w2", "w3"};
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto moe_it = moe.find(static_cast<int64_t>(i));
      const std::shared_ptr<MoELayer> sparse = moe_it == moe.end() ? nullptr : moe_it->second;
      const auto& w = layers[i];
      std::vector<std::vector<torch::Tensor>> lin(7);
      std::vector<int64_t> gs(7, 0);
      torch::Tensor attn_norm, ffn_norm;
      std::vector<torch::Tensor> bias;
      Features f;
      f.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D_)));
      f.rotary = D_;
      if (featured) {
        TORCH_CHECK(w.empty(), "layer ", i, ": with features, the norms and biases come in `tensors` (layers[i] = [])");
        TORCH_CHECK(linears[i].size() == 7 && group_sizes[i].size() == 7, "layer ", i, ": expected 7 linears");
        lin = linears[i], gs = group_sizes[i];
        f = parse_features(tensors[i], values[i], i, attn_norm, ffn_norm, bias);
        if (sparse) {
          TORCH_CHECK(lin[4].empty() && lin[5].empty() && lin[6].empty() && f.gated && !f.b1.defined() &&
                      !f.b2.defined() && !f.b3.defined(), "layer ", i, ": an MoE layer has no MLP linears or "
                      "biases (w1, w2, w3 = [])");
        } else {
          TORCH_CHECK(lin[6].empty() != f.gated, "layer ", i, ": w3 must be given exactly when the MLP is gated");
        }
      } else if (split) {
        TORCH_CHECK(w.size() == 2 || w.size() == 5, "layer ", i, " has ", w.size(), " tensors, expected 2 or 5");
        TORCH_CHECK(linears[i].size() == 7 && group_sizes[i].size() == 7, "layer ", i, ": expected 7 linears");
        attn_norm = w[0], ffn_norm = w[1], bias.assign(w.begin() + 2, w.end());
        lin = linears[i], gs = group_sizes[i];
      } else {
        TORCH_CHECK(w.size() == 9 || w.size() == 12, "layer ", i, " has ", w.size(), " tensors, expected 9 or 12");
        attn_norm = w[0], ffn_norm = w[5], bias.assign(w.begin() + 9, w.end());
        const int idx[7] = {1, 2, 3, 4, 6, 7, 8};
        for (int j = 0; j < 7; ++j) lin[j] = {w[idx[j]]};
      }
      const int n_lin = sparse ? 4 : f.gated ? 7 : 6;  // an MoE layer: the attention's
      auto is_panels = [&](int j) { return lin[j].size() == 1 && lin[j][0].dim() == 3; };  // float32 (P, K, 16)
      bool panel = true;  // every linear float32 panels: q/k/v and gate/up as panel groups; else one QLinear each
      for (int j = 0; j < n_lin; ++j) panel = panel && is_panels(j);
      if (i == 0) {
        const torch::Tensor& norm0 = f.pre ? attn_norm : f.attn_post;
        TORCH_CHECK(norm0.defined() && norm0.dim() == 1, "layer 0: attn_norm must be (d,)");
        d_ = norm0.numel();
      }
      if (ff_ == 0 && !sparse) {  // the first dense layer
        // d_ff: the rows of w1 (any 2-D form: float, int planes, raw GGUF bytes), else the K of w2's panels
        const bool ff_known = !lin[4].empty() && (lin[4][0].dim() == 2 || is_panels(5));
        TORCH_CHECK(ff_known, "layer ", i, ": w1 must be (d_ff, ...) (or w2 panels (P, d_ff, 16))");
        ff_ = lin[4][0].dim() == 2 ? lin[4][0].size(0) : lin[5][0].size(1);
      }
      const int64_t shapes[7][2] = {{H_ * D_, d_}, {Hkv_ * D_, d_}, {Hkv_ * D_, d_}, {d_, H_ * D_},
                                    {ff_, d_},     {d_, ff_},       {ff_, d_}};
      if (panel) {  // every linear of the layer float32 panels
        const std::string what = "layer " + std::to_string(i);
        for (int j = 0; j < n_lin; ++j)
          TORCH_CHECK(lin[j][0].size(1) == shapes[j][1], what, ": ", names[j], " has K = ", lin[j][0].size(1),
                      ", expected ", shapes[j][1]);
        check_features(f, attn_norm, ffn_norm, i);
        Layer l{attn_norm, ffn_norm};
        l.f = f;
        l.panel = true;
        l.qkv = panel_group({lin[0][0], lin[1][0], lin[2][0]}, {shapes[0][0], shapes[1][0], shapes[2][0]},
                            what + ": wq/wk/wv");
        if (sparse) l.moe = sparse;
        else if (f.gated) l.gu = panel_group({lin[4][0], lin[6][0]}, {shapes[4][0], shapes[6][0]}, what + ": w1/w3");
        else l.gu = {PanelWeight::from(lin[4][0], {shapes[4][0]}, what + ": w1")};
        l.po = PanelWeight::from(lin[3][0], {shapes[3][0]}, what + ": wo");
        if (!sparse) l.p2 = PanelWeight::from(lin[5][0], {shapes[5][0]}, what + ": w2");
        add_biases(l, bias, i);
        second_rope_ = second_rope_ || f.rope == 1;
        layers_.push_back(l);
        continue;
      }
      QLinear q[7];
      for (int j = 0; j < n_lin; ++j) {
        const std::string what = "layer " + std::to_string(i) + ": " + names[j];
        if (lin[j].size() == 1 && lin[j][0].scalar_type() == at::kFloat && lin[j][0].dim() == 2)
          check_weight(lin[j][0], {shapes[j][0], shapes[j][1]}, names[j], i);
        q[j] = QLinear::from(lin[j], gs[j], shapes[j][0], shapes[j][1], what);
      }
      check_features(f, attn_norm, ffn_norm, i);
      Layer l{attn_norm, ffn_norm, {}, {}, {}, q[0], q[1], q[2], q[3], q[4], q[5], q[6]};
      l.f = f;
      l.moe = sparse;
      add_biases(l, bias, i);
      second_rope_ = second_rope_ || f.rope == 1;
      layers_.push_back(l);
    }
  }

  // x (B, d) embedded tokens; caches (L, num_blocks, block_size, Hkv, D) float32, bfloat16, float16 or int8 (then
  // with scales k/v_scale (L, num_blocks, block_size, Hkv) float32; kv_cache.py); slots (B,); cos/sin (B, D/2) at
  // each token's position; tables (B, max_blocks); lens (B,) context lengths including the new token. Returns x.
  torch::Tensor forward(torch::Tensor x, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                        torch::Tensor cos, torch::Tensor sin, torch::Tensor tables, torch::Tensor lens,
                        c10::optional<torch::Tensor> k_scale = c10::nullopt,
                        c10::optional<torch::Tensor> v_scale = c10::nullopt,
                        c10::optional<torch::Tensor> cos_local = c10::nullopt,
                        c10::optional<torch::Tensor> sin_local = c10::nullopt) {
    StageClock clock(stage_profile());
    const int64_t L = static_cast<int64_t>(layers_.size());
    TORCH_CHECK(x.dim() == 2 && x.size(1) == d_ && x.scalar_type() == at::kFloat && x.is_contiguous(),
                "x must be contiguous float32 (B, ", d_, "), got ", x.sizes());
    const int64_t B = x.size(0);
    TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == L && k_cache.size(3) == Hkv_ && k_cache.size(4) == D_ &&
                v_cache.sizes() == k_cache.sizes(), "caches must be (", L, ", blocks, block_size, ", Hkv_, ", ",
                D_, "), got ", k_cache.sizes(), " and ", v_cache.sizes());
    TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(),
                "caches must be contiguous and of one dtype");
    using scratchlm_attn::KV;
    const KV kv = k_cache.scalar_type() == at::kFloat ? KV::F32 : k_cache.scalar_type() == at::kBFloat16 ? KV::BF16
                : k_cache.scalar_type() == at::kHalf ? KV::F16 : KV::I8;
    TORCH_CHECK(kv != KV::I8 || k_cache.scalar_type() == at::kChar, "KV cache dtype ", k_cache.scalar_type(),
                " is not float32, bfloat16, float16 or int8");
    float* ksc = nullptr;
    float* vsc = nullptr;
    if (kv == KV::I8) {
      TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an int8 KV cache needs k_scale and v_scale");
      for (const auto* t : {&*k_scale, &*v_scale})
        TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == k_cache.sizes().slice(0, 4),
                    "int8 KV scales must be contiguous float32 ", k_cache.sizes().slice(0, 4), ", got ", t->sizes());
      ksc = k_scale->data_ptr<float>(), vsc = v_scale->data_ptr<float>();
    }
    TORCH_CHECK(slots.scalar_type() == at::kLong && tables.scalar_type() == at::kLong &&
                lens.scalar_type() == at::kLong, "slots, block tables and lengths must be int64");
    slots = slots.contiguous(), tables = tables.contiguous(), lens = lens.contiguous();
    cos = cos.contiguous(), sin = sin.contiguous();
    TORCH_CHECK(slots.numel() == B && lens.numel() == B && tables.dim() == 2 && tables.size(0) == B,
                "one slot, block table and length per token");
    const int64_t rot = layers_[0].f.rotary;
    TORCH_CHECK(cos.sizes() == sin.sizes() && cos.numel() == B * rot / 2 && cos.scalar_type() == at::kFloat &&
                sin.scalar_type() == at::kFloat, "cos/sin must be float32 (B, ", rot / 2, "), got ", cos.sizes());
    torch::Tensor cos2, sin2;  // the second tables (layers with rope 1)
    if (second_rope_) {
      TORCH_CHECK(cos_local.has_value() && sin_local.has_value(), "layers use the second RoPE: give cos_local and "
                  "sin_local");
      cos2 = cos_local->contiguous(), sin2 = sin_local->contiguous();
      TORCH_CHECK(cos2.sizes() == cos.sizes() && sin2.sizes() == cos.sizes() && cos2.scalar_type() == at::kFloat &&
                  sin2.scalar_type() == at::kFloat, "cos_local/sin_local must be float32 like cos, got ", cos2.sizes());
    }
    const int64_t nb = k_cache.size(1), bs = k_cache.size(2), maxb = tables.size(1);
    const int64_t* sp = slots.data_ptr<int64_t>();
    const int64_t* lp = lens.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(sp[b] >= 0 && sp[b] < nb * bs, "slot ", sp[b], " outside the cache of ", nb * bs, " slots");
      TORCH_CHECK(lp[b] >= 1 && lp[b] <= maxb * bs, "context length ", lp[b], " out of range for its block table");
    }
    const int64_t* tp = tables.data_ptr<int64_t>();
    for (int64_t i = 0; i < tables.numel(); ++i)
      TORCH_CHECK(tp[i] >= 0 && tp[i] < nb, "block ", tp[i], " outside the cache of ", nb, " blocks");

    auto opt = x.options();
    auto h = torch::empty({B, d_}, opt), o = torch::empty({B, d_}, opt);
    auto q = torch::empty({B, H_ * D_}, opt), att = torch::empty({B, H_ * D_}, opt);
    auto k = torch::empty({B, Hkv_ * D_}, opt), v = torch::empty({B, Hkv_ * D_}, opt);
    auto g = torch::empty({B, ff_}, opt), u = torch::empty({B, ff_}, opt), s = torch::empty({B, ff_}, opt);
    const int64_t row = Hkv_ * D_, layer_stride = nb * bs * row;  // elements of one token, of one layer
    const int64_t item = scratchlm_attn::kv_itemsize(kv);
    char* kc = static_cast<char*>(k_cache.data_ptr());
    char* vc = static_cast<char*>(v_cache.data_ptr());
    QAct hq;  // h quantized for the integer kernels, shared by the matmuls that read it
    clock.mark(kSetup);
    for (int64_t l = 0; l < L; ++l) {
      const Layer& w = layers_[l];
      const Features& f = w.f;
      if (f.pre) norm_rows(f, x, w.attn_norm, f.attn_norm_b, h);
      const torch::Tensor& a_in = f.pre ? h : x;  // the attention's input: normed, or x itself (post norms only)
      clock.mark(kAttnNorm);
      hq.valid = false;
      if (w.panel) {
        panel_linear(a_in, w.qkv, {&q, &k, &v});
        for (auto [b, y] : {std::pair{&w.bq, &q}, {&w.bk, &k}, {&w.bv, &v}})
          if (b->defined()) y->add_(*b);
      } else {
        linear(a_in, w.wq, w.bq, q, &hq);
        linear(a_in, w.wk, w.bk, k, &hq);
        linear(a_in, w.wv, w.bv, v, &hq);
      }
      clock.mark(kQKV);
      if (f.on) qk_norm(f, q, k, B);
      if (f.rope >= 0) {
        const torch::Tensor& c = f.rope == 0 ? cos : cos2;
        const torch::Tensor& sn = f.rope == 0 ? sin : sin2;
        rope_rows(q, H_, D_, f.rotary, c, sn, rope_half_);
        rope_rows(k, Hkv_, D_, f.rotary, c, sn, rope_half_);
      }
      clock.mark(kRope);
      char* kl = kc + l * layer_stride * item;  // this layer's caches and scales
      char* vl = vc + l * layer_stride * item;
      float* ksl = ksc ? ksc + l * nb * bs * Hkv_ : nullptr;
      float* vsl = vsc ? vsc + l * nb * bs * Hkv_ : nullptr;
      for (int64_t b = 0; b < B; ++b) {  // rounded / quantized as kv_cache.py does
        scratchlm_attn::store_rows(kv, kl, ksl, sp[b] * Hkv_, k.data_ptr<float>() + b * row, Hkv_, D_);
        scratchlm_attn::store_rows(kv, vl, vsl, sp[b] * Hkv_, v.data_ptr<float>() + b * row, Hkv_, D_);
      }
      clock.mark(kStore);
      scratchlm_attn::Args a{q.data_ptr<float>(), kl, vl, tp, lp, att.data_ptr<float>(), B, H_, Hkv_, D_, bs, maxb,
                             f.scale, kv, ksl, vsl};
      a.softcap = f.softcap, a.window = f.window;
      scratchlm_attn::paged_decode(a, simd_);
      clock.mark(kAttention);
      if (w.panel) {
        w.po.forward(att, {&o}, simd_);
        if (f.bo.defined()) o.add_(f.bo);
      } else {
        linear(att, w.wo, f.bo, o, nullptr);
      }
      clock.mark(kO);
      if (f.on) residual(f, x, o, f.attn_post, f.attn_post_b, h);
      else x.add_(o);
      clock.mark(kResidual);
      if (f.pre) norm_rows(f, x, w.ffn_norm, f.ffn_norm_b, h);
      const torch::Tensor& m_in = f.pre ? h : x;  // the MLP's input
      clock.mark(kFfnNorm);
      hq.valid = false;
      if (w.moe) {
        w.moe->forward(m_in, o, simd_);
        clock.mark(kMoE);
        if (f.on) residual(f, x, o, f.ffn_post, f.ffn_post_b, h);
        else x.add_(o);
        clock.mark(kResidual);
        continue;
      }
      if (w.panel) {
        if (f.gated) panel_linear(m_in, w.gu, {&g, &u});
        else panel_linear(m_in, w.gu, {&g});
        if (f.b1.defined()) g.add_(f.b1);
        if (f.b3.defined()) u.add_(f.b3);
      } else {
        linear(m_in, w.w1, f.b1, g, &hq);
        if (f.gated) linear(m_in, w.w3, f.b3, u, &hq);
      }
      clock.mark(kGateUp);
      if (f.on) act_mul_out(f.act, g, f.gated ? u : torch::Tensor(), s);
      else silu_mul_out(g, u, s);
      clock.mark(kSiluMul);
      if (w.panel) {
        w.p2.forward(s, {&o}, simd_);
        if (f.b2.defined()) o.add_(f.b2);
      } else {
        linear(s, w.w2, f.b2, o, nullptr);
      }
      clock.mark(kDown);
      if (f.on) residual(f, x, o, f.ffn_post, f.ffn_post_b, h);
      else x.add_(o);
      clock.mark(kResidual);
    }
    return x;
  }

 private:
  // y = the layer's norm of x (RMSNorm, or LayerNorm with bias b when given).
  void norm_rows(const Features& f, const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& b,
                 torch::Tensor& y) const {
    if (f.layer_norm) layernorm_rows(x, w, b, y, eps_);
    else rmsnorm_rows(x, w, y, eps_);
  }

  // q/k-norm in place (RMSNorm, before RoPE): per head on (B * heads, D) rows, or over each token's projection.
  void qk_norm(const Features& f, torch::Tensor& q, torch::Tensor& k, int64_t B) const {
    if (!f.q_norm.defined()) return;
    auto qr = f.q_norm.numel() == D_ ? q.view({B * H_, D_}) : q;  // (rows, width) views of q and k
    auto kr = f.k_norm.numel() == D_ ? k.view({B * Hkv_, D_}) : k;
    rmsnorm_rows(qr, f.q_norm, qr, eps_);
    rmsnorm_rows(kr, f.k_norm, kr, eps_);
  }

  // x += m * post_norm(o): a sublayer's residual add with its post norm (when placed so) and the multiplier;
  // tmp (B, d) holds the normed output.
  void residual(const Features& f, torch::Tensor& x, torch::Tensor& o, const torch::Tensor& post,
                const torch::Tensor& post_b, torch::Tensor& tmp) const {
    torch::Tensor* y = &o;
    if (post.defined()) norm_rows(f, o, post, post_b, tmp), y = &tmp;
    if (f.mult != 1.0) y->mul_(f.mult);
    x.add_(*y);
  }

  // The features of layer i from the maps of runner.fused_decoder_for (see the constructor), its pre norms and
  // q/k/v biases (into attn_norm / ffn_norm / bias).
  Features parse_features(const std::map<std::string, torch::Tensor>& t, const std::map<std::string, double>& v,
                          size_t i, torch::Tensor& attn_norm, torch::Tensor& ffn_norm,
                          std::vector<torch::Tensor>& bias) const {
    static const std::vector<std::string> tensor_keys = {
        "attn_norm", "attn_norm_b", "attn_post_norm", "attn_post_norm_b", "ffn_norm", "ffn_norm_b", "ffn_post_norm",
        "ffn_post_norm_b", "bq", "bk", "bv", "bo", "b1", "b2", "b3", "q_norm", "k_norm"};
    static const std::vector<std::string> value_keys = {"scale", "softcap", "window", "rope", "rotary_dim", "act",
                                                        "gated", "layer_norm", "residual_multiplier"};
    for (const auto& kv : t)
      TORCH_CHECK(std::find(tensor_keys.begin(), tensor_keys.end(), kv.first) != tensor_keys.end(), "layer ", i,
                  ": unknown feature tensor '", kv.first, "'");
    for (const auto& kv : v)
      TORCH_CHECK(std::find(value_keys.begin(), value_keys.end(), kv.first) != value_keys.end(), "layer ", i,
                  ": unknown feature value '", kv.first, "'");
    for (const auto& key : value_keys) TORCH_CHECK(v.count(key), "layer ", i, ": feature value '", key, "' missing");
    auto get = [&](const char* key) {
      const auto it = t.find(key);
      return it == t.end() ? torch::Tensor() : it->second;
    };
    Features f;
    attn_norm = get("attn_norm"), ffn_norm = get("ffn_norm");
    f.attn_norm_b = get("attn_norm_b"), f.ffn_norm_b = get("ffn_norm_b");
    f.attn_post = get("attn_post_norm"), f.attn_post_b = get("attn_post_norm_b");
    f.ffn_post = get("ffn_post_norm"), f.ffn_post_b = get("ffn_post_norm_b");
    f.bo = get("bo"), f.b1 = get("b1"), f.b2 = get("b2"), f.b3 = get("b3");
    f.q_norm = get("q_norm"), f.k_norm = get("k_norm");
    const auto bq = get("bq"), bk = get("bk"), bv = get("bv");
    TORCH_CHECK(bq.defined() == bk.defined() && bk.defined() == bv.defined(), "layer ", i,
                ": bq, bk and bv come together");
    if (bq.defined()) bias = {bq, bk, bv};
    f.pre = attn_norm.defined(), f.post = f.attn_post.defined();
    f.scale = static_cast<float>(v.at("scale")), f.softcap = static_cast<float>(v.at("softcap"));
    f.window = static_cast<int64_t>(v.at("window")), f.rope = static_cast<int>(v.at("rope"));
    f.rotary = static_cast<int64_t>(v.at("rotary_dim")), f.act = static_cast<int>(v.at("act"));
    f.gated = v.at("gated") != 0.0, f.layer_norm = v.at("layer_norm") != 0.0;
    f.mult = v.at("residual_multiplier");
    f.on = !f.pre || f.post || f.layer_norm || !f.gated || f.act != kSilu || f.rope != 0 || f.rotary != D_ ||
           f.softcap != 0.f || f.window != 0 || f.mult != 1.0 || f.bo.defined() || f.b1.defined() ||
           f.b2.defined() || f.b3.defined() || f.q_norm.defined();
    return f;
  }

  // Shapes and ranges of layer i's features and norms.
  void check_features(const Features& f, const torch::Tensor& attn_norm, const torch::Tensor& ffn_norm,
                      size_t i) const {
    TORCH_CHECK(f.pre || f.post, "layer ", i, ": no norm before or after its sublayers");
    TORCH_CHECK(ffn_norm.defined() == f.pre && f.ffn_post.defined() == f.post, "layer ", i,
                ": attention and MLP norms must be placed alike");
    if (f.pre) check_weight(attn_norm, {d_}, "attn_norm", i), check_weight(ffn_norm, {d_}, "ffn_norm", i);
    if (f.post) check_weight(f.attn_post, {d_}, "attn_post_norm", i), check_weight(f.ffn_post, {d_}, "ffn_post_norm", i);
    const std::pair<const torch::Tensor*, const char*> norm_biases[4] = {
        {&f.attn_norm_b, "attn_norm_b"}, {&f.ffn_norm_b, "ffn_norm_b"}, {&f.attn_post_b, "attn_post_norm_b"},
        {&f.ffn_post_b, "ffn_post_norm_b"}};
    for (const auto& [b, name] : norm_biases) {
      if (!b->defined()) continue;
      TORCH_CHECK(f.layer_norm, "layer ", i, ": ", name, " needs LayerNorm");
      check_weight(*b, {d_}, name, i);
    }
    if (f.bo.defined()) check_weight(f.bo, {d_}, "bo", i);
    if (f.b1.defined()) check_weight(f.b1, {ff_}, "b1", i);
    if (f.b2.defined()) check_weight(f.b2, {d_}, "b2", i);
    if (f.b3.defined()) check_weight(f.b3, {ff_}, "b3", i);
    TORCH_CHECK(!f.b3.defined() || f.gated, "layer ", i, ": b3 needs a gated MLP");
    TORCH_CHECK(f.q_norm.defined() == f.k_norm.defined(), "layer ", i, ": q_norm and k_norm come together");
    if (f.q_norm.defined()) {
      check_weight(f.q_norm, {f.q_norm.numel() == D_ ? D_ : H_ * D_}, "q_norm", i);
      check_weight(f.k_norm, {f.k_norm.numel() == D_ ? D_ : Hkv_ * D_}, "k_norm", i);
    }
    TORCH_CHECK(f.rope >= -1 && f.rope <= 1, "layer ", i, ": rope must be -1 (none), 0 or 1, got ", f.rope);
    TORCH_CHECK(f.rotary > 0 && f.rotary <= D_ && f.rotary % 2 == 0, "layer ", i, ": rotary dims ", f.rotary,
                " must be even and in 1..", D_);
    TORCH_CHECK(f.act >= kSilu && f.act <= kGelu, "layer ", i, ": act must be 0 (silu), 1 (gelu_tanh) or 2 (gelu)");
    TORCH_CHECK(f.window >= 0 && f.softcap >= 0.f && f.scale > 0.f, "layer ", i,
                ": window and softcap must be >= 0 and the scale > 0");
    TORCH_CHECK(i == 0 || f.rotary == layers_[0].f.rotary, "layer ", i, ": every layer rotates the same dims");
  }

  void add_biases(Layer& l, const std::vector<torch::Tensor>& bias, size_t i) const {
    if (bias.empty()) return;
    l.bq = bias[0], l.bk = bias[1], l.bv = bias[2];
    check_weight(l.bq, {H_ * D_}, "bq", i);
    check_weight(l.bk, {Hkv_ * D_}, "bk", i);
    check_weight(l.bv, {Hkv_ * D_}, "bv", i);
  }

  // ys = x @ W^T for a panel group (one GEMM, or one per part).
  void panel_linear(const torch::Tensor& x, const std::vector<PanelWeight>& parts,
                    const std::vector<torch::Tensor*>& ys) const {
    if (parts.size() == 1) {
      parts[0].forward(x, ys, simd_);
      return;
    }
    for (size_t i = 0; i < parts.size(); ++i) parts[i].forward(x, {ys[i]}, simd_);
  }

  void linear(const torch::Tensor& x, const QLinear& w, const torch::Tensor& bias, torch::Tensor& y,
              QAct* xq) const {
    w.forward(x, y, xq, simd_ ? -1 : 0);
    if (bias.defined()) y.add_(bias);
  }

  std::vector<Layer> layers_;
  bool second_rope_ = false;  // whether a layer rotates by the second cos/sin tables
  int64_t H_, Hkv_, D_, d_ = 0, ff_ = 0;
  float eps_;
  bool rope_half_, simd_;
};

}  // namespace scratchlm_decoder
