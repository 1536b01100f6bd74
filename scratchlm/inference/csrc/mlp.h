// A gated MLP's pieces for the fused step (decoder.h's dense layers, moe.h's experts): the activation between the
// linears, the panel groups that read one input (gate/up in one GEMM), and `GatedMLP`, a bias-free gated MLP whose
// linears come in any format the fused step takes (qlinear.h): w2(act(x W1^T) * x W3^T).
#pragma once

#include <torch/extension.h>

#include <cstring>
#include <string>
#include <vector>

#include "panel_gemm.h"
#include "qlinear.h"

namespace scratchlm_decoder {

using scratchlm_panel::PanelWeight;
using scratchlm_qgemm::QAct;
using scratchlm_qgemm::QLinear;

enum Act : int { kSilu = 0, kGeluTanh = 1, kGelu = 2 };

// s = silu(g) * u = sigmoid(g) * g * u (the Python SwiGLU's op order); g, u, s (B, d_ff).
inline void silu_mul_out(const torch::Tensor& g, const torch::Tensor& u, torch::Tensor& s) {
  at::sigmoid_out(s, g);
  s.mul_(g).mul_(u);
}

// s = act(g) (* u when u is defined: a gated MLP); act kSilu (sigmoid(g) * g), kGeluTanh or kGelu (ATen's gelu).
inline void act_mul_out(int act, const torch::Tensor& g, const torch::Tensor& u, torch::Tensor& s) {
  if (act == kSilu && u.defined()) return silu_mul_out(g, u, s);
  if (act == kSilu) at::sigmoid_out(s, g), s.mul_(g);
  else at::gelu_out(s, g, act == kGeluTanh ? "tanh" : "none");
  if (u.defined()) s.mul_(u);
}

// Matrices that read one input, with ns[i] output columns each: one PanelWeight over all of them when their panel
// tensors are adjacent in memory (the views fast_linear.py makes of one packed tensor), else one each.
inline std::vector<PanelWeight> panel_group(const std::vector<torch::Tensor>& ts, const std::vector<int64_t>& ns,
                                            const std::string& what) {
  bool adjacent = true;
  int64_t panels = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    PanelWeight::from(ts[i], {ns[i]}, what);  // shape checks
    panels += ts[i].size(0);
    if (i > 0)
      adjacent = adjacent && ts[i].size(1) == ts[0].size(1) &&
                 ts[i].data_ptr<float>() == ts[i - 1].data_ptr<float>() + ts[i - 1].numel();
  }
  std::vector<PanelWeight> out;
  if (adjacent) {
    auto all = at::from_blob(ts[0].data_ptr<float>(), {panels, ts[0].size(1), scratchlm_panel::kLanes},
                             ts[0].options());
    out.push_back(PanelWeight::from(all, ns, what));
    out.back().keep = ts;
  } else {
    for (size_t i = 0; i < ts.size(); ++i) out.push_back(PanelWeight::from(ts[i], {ns[i]}, what));
  }
  return out;
}

// x (B, d) rounded to int8 once for all its rows, for GEMMs that each read some of them (moe.h: h, read by the chosen
// experts' gate/up linears; before, each expert rounded its gathered rows again, top_k times per token). One copy
// per rounding (QAct / KAct; the scalar or the AVX2 loop, told apart by the path: >= 1 the AVX2 one), made on first
// use. A row's rounding does not depend on the other rows, so the rows gathered from here are the bits the GEMMs
// would make of the gathered float rows.
class RoundedRows {
 public:
  explicit RoundedRows(const torch::Tensor& x) : x_(x) {}

  // rows[0 .. n) of x, rounded for `r` (a linear's rounding(n, path), kind kQAct or kKAct), into q or k
  void gather(const QLinear::Rounding& r, const int64_t* rows, int64_t n, QAct& q, scratchlm_gguf::KAct& k) {
    const int v = r.p >= 1 ? 1 : 0;
    const int64_t B = x_.size(0), d = x_.size(1);
    if (r.kind == QLinear::kQAct) {
      if (!has_q_[v]) scratchlm_qgemm::quantize_rows(x_.data_ptr<float>(), B, d, q_[v], r.p), has_q_[v] = true;
      scratchlm_qgemm::gather_rows(q_[v], rows, n, q);
    } else {
      if (!has_k_[v]) scratchlm_gguf::kq_quantize_x(x_.data_ptr<float>(), B, d, k_[v], r.p), has_k_[v] = true;
      scratchlm_gguf::kq::gather_rows(k_[v], rows, n, k);
    }
  }

  QAct rows_q;  // one MLP's gathered rows (GatedMLP::forward_rows), kept between MLPs: no allocation per expert
  scratchlm_gguf::KAct rows_k;

 private:
  const torch::Tensor& x_;
  QAct q_[2];
  scratchlm_gguf::KAct k_[2];
  bool has_q_[2] = {false, false}, has_k_[2] = {false, false};
};

// w2(act(x W1^T) * x W3^T) without biases, the weights in any format of qlinear.h; w1/w3 as one panel GEMM when
// both are float32 panels (adjacent: fast_linear.py packs an expert's gate/up together), w2 then panels too.
struct GatedMLP {
  bool panel = false;
  std::vector<PanelWeight> gu;
  PanelWeight p2;
  QLinear w1, w2, w3;
  int64_t ff = 0;

  // lin = [w1, w2, w3], each in a form QLinear::from takes, with their group sizes; d model width, ff hidden width.
  static GatedMLP from(const std::vector<std::vector<torch::Tensor>>& lin, const std::vector<int64_t>& gs,
                       int64_t d, int64_t ff, const std::string& what) {
    TORCH_CHECK(lin.size() == 3 && gs.size() == 3, what, ": expected 3 linears (w1, w2, w3), got ", lin.size());
    GatedMLP m;
    m.ff = ff;
    auto is_panels = [&](int j) { return lin[j].size() == 1 && lin[j][0].dim() == 3; };
    m.panel = is_panels(0) && is_panels(1) && is_panels(2);
    if (m.panel) {
      m.gu = panel_group({lin[0][0], lin[2][0]}, {ff, ff}, what + ": w1/w3");
      m.p2 = PanelWeight::from(lin[1][0], {d}, what + ": w2");
      TORCH_CHECK(m.gu[0].K == d && m.p2.K == ff, what, ": panels have K = ", m.gu[0].K, " / ", m.p2.K,
                  ", expected ", d, " / ", ff);
      return m;
    }
    m.w1 = QLinear::from(lin[0], gs[0], ff, d, what + ": w1");
    m.w2 = QLinear::from(lin[1], gs[1], d, ff, what + ": w2");
    m.w3 = QLinear::from(lin[2], gs[2], ff, d, what + ": w3");
    return m;
  }

  // y (M, d) = the MLP of x (M, d); g, u, s (M, ff) scratch.
  void forward(const torch::Tensor& x, torch::Tensor& g, torch::Tensor& u, torch::Tensor& s, torch::Tensor& y,
               int act, bool simd) const {
    if (panel) {
      if (gu.size() == 1) gu[0].forward(x, {&g, &u}, simd);
      else gu[0].forward(x, {&g}, simd), gu[1].forward(x, {&u}, simd);
      act_mul_out(act, g, u, s);
      p2.forward(s, {&y}, simd);
      return;
    }
    QAct xq;  // x quantized once for w1 and w3
    w1.forward(x, g, &xq, simd ? -1 : 0);
    w3.forward(x, u, &xq, simd ? -1 : 0);
    act_mul_out(act, g, u, s);
    w2.forward(s, y, nullptr, simd ? -1 : 0);
  }

  // forward() of rows rows[0 .. n) of xr's x (B, d): where w1 / w3 round x to int8, their rows are gathered from
  // xr (the same bits); where not (float32 linears, float activations), from x into xs (>= n rows, d) scratch.
  void forward_rows(RoundedRows& xr, const torch::Tensor& x, const int64_t* rows, int64_t n, torch::Tensor& xs,
                    torch::Tensor& g, torch::Tensor& u, torch::Tensor& s, torch::Tensor& y, int act, bool simd) const {
    const int path = simd ? -1 : 0;
    const QLinear::Rounding r1 = panel ? QLinear::Rounding{} : w1.rounding(n, path);
    const QLinear::Rounding r3 = panel ? QLinear::Rounding{} : w3.rounding(n, path);
    torch::Tensor xf;  // the float rows, gathered when a linear takes them
    if (r1.kind == QLinear::kNone || r3.kind == QLinear::kNone) {
      xf = xs.narrow(0, 0, n);
      const int64_t d = x.size(1);
      for (int64_t j = 0; j < n; ++j)
        std::memcpy(xf.data_ptr<float>() + j * d, x.data_ptr<float>() + rows[j] * d, d * sizeof(float));
    }
    if (panel) return forward(xf, g, u, s, y, act, simd);
    QAct& xq = xr.rows_q;  // w1's rows (QAct or KAct), reused by w3 when it rounds alike
    scratchlm_gguf::KAct& xk = xr.rows_k;
    auto run = [&](const QLinear& w, const QLinear::Rounding& r, torch::Tensor& out, bool have) {
      if (r.kind == QLinear::kNone) return w.forward(xf, out, nullptr, path);
      if (!have) xr.gather(r, rows, n, xq, xk);
      if (r.kind == QLinear::kQAct) w.forward_rounded(xq, out, r.p);
      else w.forward_rounded(xk, out, r.p);
    };
    run(w1, r1, g, false);
    run(w3, r3, u, r3.kind == r1.kind && (r3.p >= 1) == (r1.p >= 1));
    act_mul_out(act, g, u, s);
    w2.forward(s, y, nullptr, path);
  }
};

}  // namespace scratchlm_decoder
