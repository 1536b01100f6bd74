// A gated MLP's pieces for the fused step (decoder.h's dense layers, moe.h's experts): the activation between the
// linears, the panel groups that read one input (gate/up in one GEMM), and `GatedMLP`, a bias-free gated MLP whose
// linears come in any format the fused step takes (qlinear.h): w2(act(x W1^T) * x W3^T).
#pragma once

#include <torch/extension.h>

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
};

}  // namespace scratchlm_decoder
