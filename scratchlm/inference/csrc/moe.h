// The mixture-of-experts feed-forward of the fused step (decoder.h calls `MoELayer::forward` in place of a dense
// layer's MLP): scratchlm.model.moe's `MoE`, the same arithmetic, op for op.
//
//   logits = h Wg^T (B, E), float32 (the router stays float32 in quantized models too)
//   route (model/moe.py `route`): softmax or sigmoid scores; the choice = scores (+ score bias); group-limited
//     (n_groups > 1): a group's score is its best choice (max) or the sum of its best two (top2), only the experts
//     of the topk_groups best groups stay eligible (the others' choice -inf; DeepSeek-V2's max groups without a
//     bias zero the others' scores, weights included, as HF); top_k by choice (torch.topk's own loop: its ties); the
//     weights are the chosen scores (without the bias), / their sum when norm_topk (+ 1e-20 for sigmoid),
//     x routed_scale
//   the step's B tokens grouped by expert (a counting sort: experts in id order, tokens in order within one), so
//     each chosen expert's weights are read ONCE per step: its rows of h gathered, one skinny GEMM per linear over
//     them (GatedMLP: any format of qlinear.h, gate/up one panel GEMM; where they round x to int8, h is rounded
//     once per layer and each expert gets its rows' int8 codes: mlp.h RoundedRows), and out[t] += y * w added back
//     expert by expert in id order (the Python path's index_add_ order: the same float sums); experts no token
//     chose cost nothing
//   plus the shared expert on every token, scaled by sigmoid(h . w_sg) when it has a gate: out += s
// The scores are ATen's softmax / sigmoid (one call per layer: the same floats as the Python path's), the rest of
// the routing plain loops per token (a few dozen floats; ATen's per-op dispatch would cost more than them), top-k
// through ATen's own selection loop (`torch_topk`), so equal scores are settled as torch.topk settles them.

#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include <ATen/AccumulateType.h>
#include <ATen/native/TopKImpl.h>

#include "mlp.h"

namespace scratchlm_decoder {

// The indices of torch.topk(v, k) (largest, sorted) on the CPU: ATen's own selection loop (TopKImpl.h, the header
// of the torch this builds against), so ties go where torch's sends them: not by index (libstdc++'s
// nth_element / partial_sort decide; torch.topk([.1, .5, .2, .5, .5], 2) is [1, 4]), but the same way here as in
// model/moe.py and HF's routers.
inline void torch_topk(const float* v, int64_t n, int64_t k, int64_t* ids) {
  std::vector<float> values(k);
  char* data[3] = {reinterpret_cast<char*>(values.data()), reinterpret_cast<char*>(ids),
                   reinterpret_cast<char*>(const_cast<float*>(v))};
  const int64_t strides[3] = {0, 0, 0};  // one row
  at::native::topk_impl_loop<float, at::acc_type<float, false>>(1, 1, 1, k, n, true, true, data, strides, 1);
}

class MoELayer {
 public:
  // gate: the router (E, d) as [tensors] + group size (float32: [w] or [panels]); experts[e] = [w1, w2, w3] with
  // expert_gs[e] their group sizes; shared = [w1, w2, w3] or [] (no shared expert); shared_gate [w (1, d)] or [];
  // score_bias (E,) float32 or undefined; values {n_experts, top_k, d_model, d_expert, d_shared, scoring (0
  // softmax, 1 sigmoid), norm_topk, routed_scale, n_groups, topk_groups, group_score (0 max, 1 top2), act
  // (decoder.h's Act)}, all required; an unknown key is an error.
  MoELayer(const std::vector<torch::Tensor>& gate, int64_t gate_gs,
           const std::vector<std::vector<std::vector<torch::Tensor>>>& experts,
           const std::vector<std::vector<int64_t>>& expert_gs, const std::vector<std::vector<torch::Tensor>>& shared,
           const std::vector<int64_t>& shared_gs, const std::vector<torch::Tensor>& shared_gate,
           c10::optional<torch::Tensor> score_bias, const std::map<std::string, double>& values) {
    static const std::vector<std::string> keys = {"n_experts", "top_k", "d_model", "d_expert", "d_shared",
                                                  "scoring", "norm_topk", "routed_scale", "n_groups",
                                                  "topk_groups", "group_score", "act"};
    for (const auto& kv : values)
      TORCH_CHECK(std::find(keys.begin(), keys.end(), kv.first) != keys.end(), "MoE: unknown value '", kv.first, "'");
    for (const auto& key : keys) TORCH_CHECK(values.count(key), "MoE: value '", key, "' missing");
    auto as_int = [&](const char* key) { return static_cast<int64_t>(values.at(key)); };
    E_ = as_int("n_experts"), k_ = as_int("top_k"), d_ = as_int("d_model"), de_ = as_int("d_expert");
    ds_ = as_int("d_shared"), groups_ = as_int("n_groups"), topk_groups_ = as_int("topk_groups");
    sigmoid_ = values.at("scoring") != 0.0, norm_topk_ = values.at("norm_topk") != 0.0;
    top2_ = values.at("group_score") != 0.0, act_ = static_cast<int>(as_int("act"));
    scale_ = static_cast<float>(values.at("routed_scale"));
    TORCH_CHECK(E_ > 0 && k_ >= 1 && k_ <= E_ && d_ > 0 && de_ > 0 && ds_ >= 0, "MoE: bad sizes: ", E_,
                " experts, top_k ", k_, ", d_model ", d_, ", d_expert ", de_, ", d_shared ", ds_);
    TORCH_CHECK(groups_ >= 1 && E_ % groups_ == 0 && topk_groups_ >= 1 && topk_groups_ <= groups_ &&
                k_ <= topk_groups_ * (E_ / groups_), "MoE: n_groups ", groups_, " / topk_groups ", topk_groups_,
                " do not fit ", E_, " experts and top_k ", k_);
    TORCH_CHECK(act_ >= kSilu && act_ <= kGelu, "MoE: act must be 0 (silu), 1 (gelu_tanh) or 2 (gelu)");
    TORCH_CHECK(static_cast<int64_t>(experts.size()) == E_ && expert_gs.size() == experts.size(), "MoE: ",
                experts.size(), " experts given for n_experts = ", E_);
    gate_ = QLinear::from(gate, gate_gs, E_, d_, "MoE router gate");
    TORCH_CHECK(!gate_.quantized(), "MoE router gate: must be float32 (the router is not quantized)");
    for (int64_t e = 0; e < E_; ++e)
      experts_.push_back(GatedMLP::from(experts[e], expert_gs[e], d_, de_, "MoE expert " + std::to_string(e)));
    TORCH_CHECK(shared.empty() == (ds_ == 0), "MoE: shared expert weights must come exactly when d_shared > 0");
    if (!shared.empty()) shared_ = GatedMLP::from(shared, shared_gs, d_, ds_, "MoE shared expert");
    if (!shared_gate.empty()) {
      TORCH_CHECK(ds_ > 0, "MoE: a shared_gate needs a shared expert");
      shared_gate_ = QLinear::from(shared_gate, 0, 1, d_, "MoE shared_gate");
      TORCH_CHECK(!shared_gate_.quantized(), "MoE shared_gate: must be float32");
      has_shared_gate_ = true;
    }
    if (score_bias.has_value() && score_bias->defined()) {
      bias_ = *score_bias;
      TORCH_CHECK(bias_.device().is_cpu() && bias_.scalar_type() == at::kFloat && bias_.is_contiguous() &&
                  bias_.numel() == E_ && bias_.dim() == 1, "MoE score_bias must be contiguous float32 (", E_, ",)");
    }
  }

  int64_t n_experts() const { return E_; }
  int64_t top_k() const { return k_; }

  // out (B, d) = the MoE of h (B, d) (out may not alias h). `simd` false: the kernels' portable paths.
  // `round_once` (the default): where the experts' gate/up linears round x to int8 (int8 / int4 / Q8_0 planes, raw
  // K-quants), h is rounded once for all B rows and each expert gets its rows' int8 codes gathered (RoundedRows:
  // the same bits); false: each expert's gathered float rows are rounded by its own GEMMs (top_k times per token;
  // kept for the test that the two are equal and for benchmarks/moe_round_once.py's before / after).
  void forward(const torch::Tensor& h, torch::Tensor& out, bool simd, bool round_once = true) const {
    const int64_t B = h.size(0);
    const int path = simd ? -1 : 0;
    auto opt = h.options();
    auto logits = torch::empty({B, E_}, opt), scores = torch::empty({B, E_}, opt);
    gate_.forward(h, logits, nullptr, path);
    if (sigmoid_) at::sigmoid_out(scores, logits);  // ATen's, as model/moe.py: the same scores, so the same ties
    else at::_softmax_out(scores, logits, 1, false);
    std::vector<int64_t> ids(B * k_);
    std::vector<float> w(B * k_);
    for (int64_t b = 0; b < B; ++b) route(scores.data_ptr<float>() + b * E_, ids.data() + b * k_, w.data() + b * k_);
    // counting sort of the B * k (token, choice) slots by expert; slots in order within an expert
    std::vector<int64_t> start(E_ + 1, 0), slots(B * k_);
    for (int64_t id : ids) ++start[id + 1];
    std::partial_sum(start.begin(), start.end(), start.begin());
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t s = 0; s < B * k_; ++s) slots[fill[ids[s]]++] = s;
    out.zero_();
    int64_t rows = 0;  // the most tokens any expert has
    for (int64_t e = 0; e < E_; ++e) rows = std::max(rows, start[e + 1] - start[e]);
    auto xe = torch::empty({rows, d_}, opt), ye = torch::empty({rows, d_}, opt);
    auto g = torch::empty({rows, de_}, opt), u = torch::empty({rows, de_}, opt), s = torch::empty({rows, de_}, opt);
    const float* hp = h.data_ptr<float>();
    float* op = out.data_ptr<float>();
    RoundedRows hr(h);
    std::vector<int64_t> tok(rows);
    for (int64_t e = 0; e < E_; ++e) {
      const int64_t n = start[e + 1] - start[e];
      if (n == 0) continue;
      const int64_t* sl = slots.data() + start[e];
      auto y = ye.narrow(0, 0, n), gn = g.narrow(0, 0, n), un = u.narrow(0, 0, n), sn = s.narrow(0, 0, n);
      if (round_once) {
        for (int64_t j = 0; j < n; ++j) tok[j] = sl[j] / k_;
        experts_[e].forward_rows(hr, h, tok.data(), n, xe, gn, un, sn, y, act_, simd);
      } else {
        const bool all = n == B;  // every token, in order (a token picks an expert at most once): h itself
        auto x = all ? h : xe.narrow(0, 0, n);
        if (!all)
          for (int64_t j = 0; j < n; ++j)
            std::memcpy(x.data_ptr<float>() + j * d_, hp + (sl[j] / k_) * d_, d_ * sizeof(float));
        experts_[e].forward(x, gn, un, sn, y, act_, simd);
      }
      const float* yp = y.data_ptr<float>();
      // out[t] += y * w, the product rounded before the add as index_add_ of y * w (the baseline target has no FMA
      // to contract them into)
      for (int64_t j = 0; j < n; ++j) {
        float* o = op + (sl[j] / k_) * d_;
        const float* yr = yp + j * d_;
        const float wj = w[sl[j]];
        for (int64_t c = 0; c < d_; ++c) o[c] += yr[c] * wj;
      }
    }
    if (ds_ == 0) return;
    auto gs = torch::empty({B, ds_}, opt), us = torch::empty({B, ds_}, opt), ss = torch::empty({B, ds_}, opt);
    auto sh = torch::empty({B, d_}, opt);
    shared_.forward(h, gs, us, ss, sh, act_, simd);
    if (has_shared_gate_) {
      auto gl = torch::empty({B, 1}, opt);
      shared_gate_.forward(h, gl, nullptr, path);
      at::sigmoid_(gl);
      sh.mul_(gl);  // (B, d) * (B, 1)
    }
    out.add_(sh);
  }

 private:
  // One token's routing: its scores (E,) -> ids (k,) and weights (k,), as model/moe.py route.
  void route(const float* sc, int64_t* ids, float* w) const {
    std::vector<float> scores(sc, sc + E_), choice(E_);
    const float* bias = bias_.defined() ? bias_.data_ptr<float>() : nullptr;
    for (int64_t e = 0; e < E_; ++e) choice[e] = bias ? scores[e] + bias[e] : scores[e];
    if (groups_ > 1) {
      const int64_t per = E_ / groups_;
      std::vector<float> gscore(groups_);
      for (int64_t gi = 0; gi < groups_; ++gi) {
        const float* c = choice.data() + gi * per;
        if (!top2_) {
          gscore[gi] = *std::max_element(c, c + per);
        } else {  // the sum of the best two (the larger first, as topk(2).sum)
          float a = -std::numeric_limits<float>::infinity(), b = a;
          for (int64_t j = 0; j < per; ++j)
            if (c[j] > a) b = a, a = c[j];
            else if (c[j] > b) b = c[j];
          gscore[gi] = a + b;
        }
      }
      std::vector<int64_t> best(topk_groups_);
      torch_topk(gscore.data(), groups_, topk_groups_, best.data());
      std::vector<char> keep(groups_, 0);
      for (int64_t gi : best) keep[gi] = 1;
      const bool zero = !top2_ && !bias;  // DeepSeek-V2 (HF's group_limited_greedy): the scores zeroed, weights too
      for (int64_t e = 0; e < E_; ++e)
        if (!keep[e / per]) {
          if (zero) scores[e] = choice[e] = 0.f;
          else choice[e] = -std::numeric_limits<float>::infinity();
        }
    }
    torch_topk(choice.data(), E_, k_, ids);
    float sum = 0.f;
    for (int64_t j = 0; j < k_; ++j) w[j] = scores[ids[j]], sum += w[j];
    if (norm_topk_) {
      const float denom = sigmoid_ ? sum + 1e-20f : sum;
      for (int64_t j = 0; j < k_; ++j) w[j] /= denom;
    }
    if (scale_ != 1.f)
      for (int64_t j = 0; j < k_; ++j) w[j] *= scale_;
  }

  int64_t E_ = 0, k_ = 0, d_ = 0, de_ = 0, ds_ = 0, groups_ = 1, topk_groups_ = 1;
  bool sigmoid_ = false, norm_topk_ = true, top2_ = false, has_shared_gate_ = false;
  int act_ = kSilu;
  float scale_ = 1.f;
  QLinear gate_, shared_gate_;
  torch::Tensor bias_;
  std::vector<GatedMLP> experts_;
  GatedMLP shared_;
};

}  // namespace scratchlm_decoder
