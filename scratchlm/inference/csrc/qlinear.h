// A linear layer's weight for the fused step, float32 or quantized, built from the tensors of a SkinnyLinear ([w]),
// a PanelLinear ([panels (P, K, 16)]), a QuantLinear with int planes ([qweight, scales] or [qweight, scales, mins],
// with its group size: quant_gemm.h) or a QuantLinear holding a GGUF weight raw ([bytes uint8 (N, row_bytes)] with
// group_size = -(ggml type id): gguf_gemm.h).
#pragma once

#include <torch/extension.h>

#include <atomic>
#include <cstdlib>
#include <string>
#include <vector>

#include "gguf_gemm.h"
#include "panel_gemm.h"
#include "quant_gemm.h"
#include "skinny_gemm.h"

namespace scratchlm_qgemm {

// Whether the default path keeps x in float32 (exact up to the summation order, slower) instead of the integer
// kernels that round x to int8 per 32-block. Starts from $SCRATCHLM_QUANT_FLOAT_ACTIVATIONS (1: float); tests
// and benchmarks switch it at run time (quant_float_activations in engine_kernels.cpp).
inline std::atomic<bool>& float_activations_flag() {
  static std::atomic<bool> v{[] {
    const char* e = std::getenv("SCRATCHLM_QUANT_FLOAT_ACTIVATIONS");
    return e != nullptr && e[0] != '\0' && e[0] != '0';
  }()};
  return v;
}
inline bool float_activations() { return float_activations_flag().load(std::memory_order_relaxed); }

// Whether prefill chunks (more than kMaxRows rows) of weights with integer decode kernels run the integer panel
// kernels by default (else: dequantize once per call and the fp32 GEMM). Starts from
// $SCRATCHLM_QUANT_INTEGER_PREFILL (default on; 0: off); benchmarks switch it (quant_integer_prefill).
inline std::atomic<bool>& integer_prefill_flag() {
  static std::atomic<bool> v{[] {
    const char* e = std::getenv("SCRATCHLM_QUANT_INTEGER_PREFILL");
    return e == nullptr || e[0] != '0';
  }()};
  return v;
}

// The group_size that marks a raw GGUF weight of ggml type t (QLinear::from; runner.py passes the same).
inline int64_t gguf_group_code(int64_t type_id) { return -type_id; }

// The gguf_gemm.h path asked for a raw GGUF weight: with float_activations() the default (-1) is kDequantPath
// (float32 weights and x, exact up to the summation order) at every M, as the int planes' float kernels are.
inline int gguf_path(int path) { return path < 0 && float_activations() ? scratchlm_gguf::kDequantPath : path; }

struct QLinear {
  QMat mat;
  scratchlm_gguf::GMat raw;             // a GGUF weight as the file's blocks (raw.raw != nullptr), else unused
  scratchlm_panel::PanelWeight panels;  // float32 panels (panels.P > 0), else unused
  std::vector<torch::Tensor> keep;      // the tensors `mat` / `raw` / `panels` point into

  // tensors: [w float32 (N, K)] | [panels float32 (P, K, 16)] | [q int8 (N, K), s float32 (N, G)] |
  // [q uint8 (N, K/2), d fp16 (N, G) (, m fp16)] | [raw uint8 (N, row_bytes)] with group_size = gguf_group_code(type)
  static QLinear from(const std::vector<torch::Tensor>& t, int64_t group_size, int64_t N, int64_t K,
                      const std::string& what) {
    QLinear l;
    l.keep = t;
    QMat& m = l.mat;
    TORCH_CHECK(!t.empty() && t.size() <= 3, what, ": expected 1 to 3 tensors, got ", t.size());
    for (const auto& x : t)
      TORCH_CHECK(x.defined() && x.device().is_cpu() && x.is_contiguous(), what,
                  ": weight tensors must be contiguous CPU tensors");
    m.N = N, m.K = K;
    const auto& q = t[0];
    if (group_size < 0) {  // a raw GGUF weight
      TORCH_CHECK(t.size() == 1 && q.scalar_type() == at::kByte && q.dim() == 2 && q.size(0) == N, what,
                  ": a raw GGUF weight is one uint8 tensor (", N, ", row_bytes), got ", t.size(), " tensors, ",
                  q.scalar_type(), " ", q.sizes());
      l.raw = scratchlm_gguf::make_gmat(-group_size, N, K, q.size(1), q.data_ptr<uint8_t>(), what);
      return l;
    }
    if (q.scalar_type() == at::kFloat && q.dim() == 3) {  // panels (a float linear among quantized ones)
      l.panels = scratchlm_panel::PanelWeight::from(q, {N}, what);
      TORCH_CHECK(l.panels.K == K, what, ": panels have K = ", l.panels.K, ", expected ", K);
      return l;
    }
    if (q.scalar_type() == at::kFloat) {
      TORCH_CHECK(t.size() == 1 && q.sizes() == c10::IntArrayRef({N, K}), what, " has shape ", q.sizes(),
                  ", expected (", N, ", ", K, ")");
      m.kind = Kind::kF32, m.w = q.data_ptr<float>(), m.gs = K, m.G = 1;
      return l;
    }
    TORCH_CHECK(group_size > 0, what, ": group_size must be positive, got ", group_size);
    m.gs = group_size, m.G = (K + group_size - 1) / group_size;
    if (q.scalar_type() == at::kChar) {
      TORCH_CHECK(t.size() == 2 && q.sizes() == c10::IntArrayRef({N, K}) && t[1].scalar_type() == at::kFloat &&
                  t[1].sizes() == c10::IntArrayRef({N, m.G}), what, ": int8 needs q (", N, ", ", K,
                  ") and float32 scales (", N, ", ", m.G, ")");
      m.kind = Kind::kInt8, m.q8 = q.data_ptr<int8_t>(), m.s = t[1].data_ptr<float>();
    } else {
      TORCH_CHECK(q.scalar_type() == at::kByte && (t.size() == 2 || t.size() == 3) &&
                  q.sizes() == c10::IntArrayRef({N, K / 2}) && K % kBlock == 0, what,
                  ": int4 needs uint8 q (", N, ", ", K / 2, ") with K a multiple of 32, got ", q.sizes());
      for (size_t i = 1; i < t.size(); ++i)
        TORCH_CHECK(t[i].scalar_type() == at::kHalf && t[i].sizes() == c10::IntArrayRef({N, m.G}), what,
                    ": int4 scales / mins must be float16 (", N, ", ", m.G, ")");
      m.kind = Kind::kInt4, m.q4 = q.data_ptr<uint8_t>();
      m.d = reinterpret_cast<const uint16_t*>(t[1].data_ptr<at::Half>());
      m.m = t.size() == 3 ? reinterpret_cast<const uint16_t*>(t[2].data_ptr<at::Half>()) : nullptr;
    }
    TORCH_CHECK(supported(m), what, ": group size ", group_size, " with K = ", K,
                " is not supported by the integer kernels (needs multiples of 32, or one scale per row)");
    return l;
  }

  bool is_raw() const { return raw.raw != nullptr; }
  bool is_panels() const { return panels.P > 0; }
  bool quantized() const { return mat.kind != Kind::kF32 || is_raw(); }
  const torch::Tensor& mat_tensor() const { return keep[0]; }

  // The float32 weight (N, K), dequantized (path 0: no SIMD, or more than kMaxRows rows with float activations).
  torch::Tensor dequantized() const {
    TORCH_CHECK(!is_panels(), "dequantized: a panel-packed float32 weight has no (N, K) copy");
    if (is_raw()) return scratchlm_gguf::gguf_dequantize(raw);
    if (!quantized()) return keep[0];
    auto w = torch::empty({mat.N, mat.K}, torch::dtype(torch::kFloat));
    float* p = w.data_ptr<float>();
    at::parallel_for(0, mat.N, 64, [&](int64_t n0, int64_t n1) { dequantize_rows(mat, n0, n1, p + n0 * mat.K); });
    return w;
  }

  // The code path forward() runs for M rows of x when asked for `path` (-1: the default for this CPU and M).
  int resolve_path(int64_t M, int path) const {
    if (is_raw()) return scratchlm_gguf::gguf_resolve_path(raw, M, gguf_path(path));  // gguf_gemm.h's choice
    if (!quantized()) return 0;
    const int best = best_path();
    // Measured (benchmarks/quant_gemv.py, one core; docs/quantization.md "Kernels"): the 8-row integer kernels
    // (x quantized to int8 per 32-block, as llama.cpp) are the fastest at every M <= 64 for int4: path 6 on
    // AVX512-VNNI, path 7 (maddubs) on AVX2, 2-2.7x the float kernels at 1 row, 1.2-1.9x the FMA tiles at 32: the
    // int4 default. int8 (K a multiple of 32) on AVX512-VNNI: the 4-row VNNI kernel (path 2) at 1 row, where int8 is
    // memory-bound and path 6 is slower, path 6 from 2 rows (up to 1.9x the float kernels). Rounding x no longer
    // splits the fused and unfused paths' greedy ids: both feed every linear the same bits (inference/engine_ops.py;
    // docs/quantization.md "Rounding x, and greedy ids"). int8 on AVX2 without VNNI (no 8-row int8 kernel there),
    // and everything with float_activations() (SCRATCHLM_QUANT_FLOAT_ACTIVATIONS=1), take the float kernels:
    // codes to floats in registers (path 4) up to 2 rows, the FMA tiles (path 3) above. Without AVX2 the weight is
    // dequantized and ATen multiplies (portable, exact). Paths 1, 5 (integer, AVX2 / scalar, 4 rows per tile) are
    // there to be measured and tested.
    // Above kMaxRows rows (prefill chunks) a weight whose decode kernel has integer activations (path 6 / 7) runs
    // the panel kernels (path 8 on AVX512-VNNI, 9 on AVX2: 2.4-5.4x / 1.3-2.7x dequantize + fp32 per layer at
    // 65-512 rows, benchmarks/quant_speed.py --prefill-kernels), so prefill and decode round x the same way; float
    // activations dequantize the weight once per call for oneDNN / MKL (path 0).
    int p = path;
    if (p < 0 && M > kMaxRows) {
      const int decode = resolve_path(2, -1);  // the batched decode kernel (int8 runs path 2 at 1 row only)
      p = integer_prefill_flag().load(std::memory_order_relaxed) && (decode == 6 || decode == 7) ? decode + 2 : 0;
    }
    if (p < 0 && !float_activations() && best >= 1 && mat.kind == Kind::kInt4) p = best == 2 ? 6 : 7;
    if (p < 0 && !float_activations() && best == 2 && mat.kind == Kind::kInt8 && mat.K % kBlock == 0)
      p = M == 1 ? 2 : 6;
    if (p < 0) p = best == 0 ? 0 : (M <= 2 || mat.K % 8) ? 4 : 3;
    if (p == 3 && (best == 0 || mat.K % 8)) p = best == 0 ? 0 : 4;
    if ((p == 4 || p == 1) && best == 0) p = 0;
    if (p == 8 && (best < 2 || mat.K % kBlock)) p = (best >= 1 && mat.kind == Kind::kInt4) ? 9 : best;
    if (p == 9 && (best < 1 || mat.kind != Kind::kInt4)) p = best;
    if (p == 6 && (best < 2 || (mat.kind == Kind::kInt8 && mat.K % kBlock))) p = best;
    if (p == 7 && (best < 1 || mat.kind != Kind::kInt4)) p = best;
    if (p == 2 && best < 2) p = best;
    return p;
  }

  // How forward() rounds M rows of x to int8 at `path`: kind kNone (x stays float32, or a raw type whose kernels
  // round x their own way: gguf_blocks32.h), kQAct (quantize_rows at resolved path p, then qgemm at p) or kKAct
  // (raw K-quants: kq_quantize_x at p, then kq_gemm_rounded at p). forward_rounded takes x rounded so.
  enum : int { kNone = 0, kQAct = 1, kKAct = 2 };
  struct Rounding {
    int kind = kNone, p = 0;
  };
  Rounding rounding(int64_t M, int path) const {
    if (is_raw()) {
      const int gp = gguf_path(path);
      if (gp == scratchlm_gguf::kDequantPath || !scratchlm_gguf::kq_handles(raw.type)) return {};
      return {kKAct, scratchlm_gguf::kq_resolve_path(raw, M, gp)};
    }
    if (is_panels() || !quantized()) return {};
    const int p = resolve_path(M, path);
    if (p == 0 || p == 3 || p == 4) return {};
    return {kQAct, p == 5 ? 0 : p};
  }
  // y (a.M, N) from x rounded as rounding(a.M, path) says ({kind, p}): the values forward() gives for that x.
  void forward_rounded(const QAct& a, torch::Tensor& y, int p) const { qgemm(a, mat, y.data_ptr<float>(), p); }
  void forward_rounded(const scratchlm_gguf::KAct& a, torch::Tensor& y, int p) const {
    scratchlm_gguf::kq_gemm_rounded(a, raw, y.data_ptr<float>(), p);
  }

  // y (M, N) = x (M, K) W^T. `xq`: a cache of x quantized, shared by the matmuls of one input (q/k/v, gate/up):
  // used when valid, else filled; the caller clears `valid` when x changes. nullptr: no cache.
  // path: quant_gemm's code path (-1: the measured best for M on this CPU; 0: portable, also for float32 weights).
  // Raw GGUF weights: gguf_gemm.h's paths (xq unused: the kernels quantize x their own way, per 32 or 256).
  void forward(const torch::Tensor& x, torch::Tensor& y, QAct* xq, int path = -1) const {
    const int64_t M = x.size(0);
    if (is_raw()) return scratchlm_gguf::gguf_gemm(x, raw, y, gguf_path(path));
    if (is_panels()) return panels.forward(x, {&y}, path != 0);
    if (!quantized()) {
      if (M > kMaxRows) scratchlm_gemm::large_gemm(x, mat_tensor(), y);  // oneDNN where torch has it
      else scratchlm_gemm::skinny_gemm(x.data_ptr<float>(), mat.w, y.data_ptr<float>(), M, mat.K, mat.N, path != 0);
      return;
    }
    int p = resolve_path(M, path);
    if (p == 0) {
      if (M > kMaxRows) scratchlm_gemm::large_gemm(x, dequantized(), y);  // dequantized once per call
      else at::mm_out(y, x, dequantized().t());
      return;
    }
    if (p == 3 || p == 4) {
      qgemm_fma(x.data_ptr<float>(), M, mat, y.data_ptr<float>(), p);
      return;
    }
    if (p == 5) p = 0;  // the integer kernel's scalar code
    QAct local;
    if (xq == nullptr) xq = &local;
    if (!xq->valid || xq->M != M || xq->K != mat.K) {
      quantize_rows(x.data_ptr<float>(), M, mat.K, *xq, p);
      xq->valid = true;
    }
    qgemm(*xq, mat, y.data_ptr<float>(), p);
  }
};

}  // namespace scratchlm_qgemm
