// The engine's CPU kernels in one extension module (scratchlm.inference.kernels):
//   skinny_linear          decode-sized matmuls            (skinny_gemm.h)
//   paged_decode_attention decode attention, paged cache   (paged_attention.h)
//   kv_store               K/V rows into a cache of any KV dtype (paged_attention.h)
//   quant_linear           int8 / int4 / GGUF-packed matmuls (quant_gemm.h, qlinear.h)
//   gguf_linear, gguf_dequantize  GGUF weights in their file blocks: K-quants, Q5_x, IQ4 (gguf_gemm.h)
//   panel_pack / panel_linear  fp32 matmuls over panel-packed weights, any rows (panel_gemm.h)
//   fp32_* , isa_name      the fp32 linears' kernel choice table, the ISA in use (fp32_bindings.h)
//   FusedDecoder           a whole decode step in C++      (decoder.h)
//   MoELayer               its mixture-of-experts feed-forward (moe.h), also callable alone
//   rms_norm, layer_norm, rope_, silu_mul, act_mul  the fused step's row ops, for the unfused path (decoder.h;
//                          inference/engine_ops.py)
// Every entry point releases the GIL.

#include <torch/extension.h>

#include <map>
#include <string>

#include "decoder.h"
#include "fp32_bindings.h"
#include "gguf_gemm.h"
#include "paged_attention.h"
#include "panel_gemm.h"
#include "skinny_gemm.h"

namespace {

torch::Tensor skinny_linear(torch::Tensor x, torch::Tensor w, bool use_simd) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "x must be (M, K) and w (N, K), got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "skinny_linear takes float32");
  TORCH_CHECK(x.size(1) == w.size(1), "x has K = ", x.size(1), " but w has K = ", w.size(1));
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "skinny_linear runs on the CPU");
  x = x.contiguous();
  w = w.contiguous();
  auto y = torch::empty({x.size(0), w.size(0)}, x.options());
  scratchlm_gemm::skinny_gemm(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1),
                              w.size(0), use_simd);
  return y;
}

// Groups of float32 (N, K) matrices -> one (sum ceil(N_i / 16), K, 16) panel tensor per group, the matrices of a
// group packed one after the other (zero-padded, panel_gemm.h); all groups are views of ONE buffer, in huge pages
// where the system gives them (panel_gemm.h alloc_panels).
std::vector<torch::Tensor> panel_pack_groups(const std::vector<std::vector<torch::Tensor>>& groups) {
  constexpr int64_t L = scratchlm_panel::kLanes;
  int64_t total = 0;
  std::vector<int64_t> panels;
  for (const auto& g : groups) {
    TORCH_CHECK(!g.empty(), "panel_pack: an empty group of matrices");
    int64_t p = 0;
    for (const auto& w : g) {
      TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(),
                  "panel_pack takes float32 CPU matrices (N, K), got ", w.sizes(), " ", w.scalar_type());
      TORCH_CHECK(w.size(1) == g[0].size(1), "panel_pack: the matrices of a group must share K, got ", w.size(1),
                  " and ", g[0].size(1));
      p += (w.size(0) + L - 1) / L;
    }
    panels.push_back(p);
    total += p * g[0].size(1) * L;
  }
  auto flat = scratchlm_panel::alloc_panels(total);
  std::vector<torch::Tensor> out;
  int64_t off = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    const int64_t K = groups[i][0].size(1);
    auto t = flat.narrow(0, off, panels[i] * K * L).view({panels[i], K, L});
    float* o = t.data_ptr<float>();
    for (auto w : groups[i]) {
      w = w.contiguous();
      scratchlm_panel::pack(w.data_ptr<float>(), w.size(0), K, o);
      o += (w.size(0) + L - 1) / L * K * L;
    }
    off += panels[i] * K * L;
    out.push_back(t);
  }
  return out;
}

// w (N, K) float32 -> its panels (ceil(N / 16), K, 16), zero-padded (panel_gemm.h).
torch::Tensor panel_pack(torch::Tensor w) { return panel_pack_groups({{w}})[0]; }

// [x @ W_i^T for each of the matrices packed one after another in wp (panel_pack of each, concatenated)]; widths
// ns[i] columns each.
std::vector<torch::Tensor> panel_linear(torch::Tensor x, torch::Tensor wp, std::vector<int64_t> ns, bool use_simd,
                                        int64_t kernel) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "panel_linear: x must be a float32 CPU tensor (M, K), got ", x.sizes());
  auto w = scratchlm_panel::PanelWeight::from(wp, ns, "panel_linear");
  TORCH_CHECK(x.size(1) == w.K, "panel_linear: x has K = ", x.size(1), " but the weight has K = ", w.K);
  x = x.contiguous();
  std::vector<torch::Tensor> ys;
  std::vector<torch::Tensor*> ptrs;
  for (int64_t n : ns) ys.push_back(torch::empty({x.size(0), n}, x.options()));
  for (auto& y : ys) ptrs.push_back(&y);
  w.forward(x, ptrs, use_simd, static_cast<int>(kernel));
  return ys;
}

// The KV element type of a cache tensor (kv_cache.py's storage dtypes).
scratchlm_attn::KV kv_type(const torch::Tensor& cache) {
  switch (cache.scalar_type()) {
    case at::kFloat: return scratchlm_attn::KV::F32;
    case at::kBFloat16: return scratchlm_attn::KV::BF16;
    case at::kHalf: return scratchlm_attn::KV::F16;
    case at::kChar: return scratchlm_attn::KV::I8;
    default: TORCH_CHECK(false, "KV cache dtype ", cache.scalar_type(), " is not float32, bfloat16, float16 or int8");
  }
}

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                                     bool use_simd, c10::optional<torch::Tensor> k_scale,
                                     c10::optional<torch::Tensor> v_scale, int64_t tile_rows, bool avx512,
                                     double softcap, int64_t window) {
  TORCH_CHECK(q.dim() == 3, "q must be (B, H, D), got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k/v caches must be (num_blocks, block_size, Hkv, D) and equal in shape");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "paged_decode_attention takes float32 queries");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches differ in dtype");
  const auto kv = kv_type(k_cache);
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "paged_decode_attention runs on the CPU");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block tables and context lengths must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "k/v caches must be contiguous");
  const float* ks = nullptr;
  const float* vs = nullptr;
  if (kv == scratchlm_attn::KV::I8) {
    TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an int8 KV cache needs k_scale and v_scale");
    for (const auto* t : {&*k_scale, &*v_scale})
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 3 &&
                  t->sizes() == k_cache.sizes().slice(0, 3), "int8 KV scales must be contiguous float32 ",
                  k_cache.sizes().slice(0, 3), ", got ", t->sizes());
    ks = k_scale->data_ptr<float>(), vs = v_scale->data_ptr<float>();
  }
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D, "head dim of q (", D, ") and cache (", k_cache.size(3), ") differ");
  TORCH_CHECK(H % Hkv == 0, H, " query heads is not a multiple of ", Hkv, " kv heads");
  TORCH_CHECK(block_tables.size(0) == B && context_lens.size(0) == B, "one block table and length per query");
  TORCH_CHECK(softcap >= 0.0 && window >= 0, "softcap and window must be >= 0 (0: off), got ", softcap, " and ",
              window);
  auto out = torch::empty_like(q);
  scratchlm_attn::Args a{q.data_ptr<float>(), k_cache.data_ptr(), v_cache.data_ptr(),
                         block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<float>(),
                         B, H, Hkv, D, k_cache.size(1), block_tables.size(1), static_cast<float>(scale), kv, ks, vs};
  a.softcap = static_cast<float>(softcap), a.window = window;
  const int64_t nb = k_cache.size(0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = a.lens[b];
    TORCH_CHECK(len >= 1 && len <= a.max_blocks * a.bs, "context length ", len, " out of range for its block table");
  }
  const int64_t* tp = a.tables;
  for (int64_t i = 0; i < block_tables.numel(); ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < nb, "block ", tp[i], " outside the cache of ", nb, " blocks");
  scratchlm_attn::paged_decode(a, use_simd, tile_rows, avx512);
  return out;
}

// Writes k (N, Hkv, D) float32 into one layer's cache (num_blocks, block_size, Hkv, D) at slots (N,), rounded or
// quantized (paged_attention.h's store_rows, what the fused step writes with); scales (num_blocks, block_size, Hkv)
// for an int8 cache.
void kv_store(torch::Tensor cache, c10::optional<torch::Tensor> scales, torch::Tensor slots, torch::Tensor k) {
  const auto kv = kv_type(cache);
  TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() && cache.device().is_cpu(),
              "cache must be a contiguous CPU (num_blocks, block_size, Hkv, D) tensor");
  const int64_t Hkv = cache.size(2), D = cache.size(3), n_slots = cache.size(0) * cache.size(1);
  TORCH_CHECK(k.scalar_type() == at::kFloat && k.dim() == 3 && k.size(1) == Hkv && k.size(2) == D,
              "k must be float32 (N, ", Hkv, ", ", D, "), got ", k.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == k.size(0), "one int64 slot per row of k");
  float* sp = nullptr;
  if (kv == scratchlm_attn::KV::I8) {
    TORCH_CHECK(scales.has_value() && scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                scales->sizes() == cache.sizes().slice(0, 3), "an int8 cache needs float32 scales ",
                cache.sizes().slice(0, 3));
    sp = scales->data_ptr<float>();
  }
  k = k.contiguous(), slots = slots.contiguous();
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < k.size(0); ++i) {
    TORCH_CHECK(s[i] >= 0 && s[i] < n_slots, "slot ", s[i], " outside the cache of ", n_slots, " slots");
    scratchlm_attn::store_rows(kv, cache.data_ptr(), sp, s[i] * Hkv, k.data_ptr<float>() + i * Hkv * D, Hkv, D);
  }
}

// The fused step's row ops (decoder.h) for the engine's unfused CPU path, so it computes what the fused step does.
void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.device().is_cpu(), what,
              " must be a float32 CPU tensor (rows, n), got ", t.scalar_type(), " ", t.sizes());
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "rms_norm: x");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.numel() == x.size(1) && w.device().is_cpu(),
              "rms_norm: weight must be float32 (", x.size(1), ",), got ", w.scalar_type(), " ", w.sizes());
  x = x.contiguous(), w = w.contiguous();
  auto y = torch::empty_like(x);
  scratchlm_decoder::rmsnorm_rows(x, w, y, static_cast<float>(eps));
  return y;
}

torch::Tensor rope_(torch::Tensor t, int64_t heads, torch::Tensor cos, torch::Tensor sin, bool half_pairs,
                    int64_t rotary_dim) {
  check_rows(t, "rope_: t");
  TORCH_CHECK(t.is_contiguous(), "rope_: t must be contiguous (it is rotated in place)");
  TORCH_CHECK(heads > 0 && t.size(1) % heads == 0 && (t.size(1) / heads) % 2 == 0, "rope_: ", t.size(1),
              " columns are not ", heads, " heads of an even head dim");
  const int64_t D = t.size(1) / heads, R = rotary_dim > 0 ? rotary_dim : D;
  TORCH_CHECK(R <= D && R % 2 == 0, "rope_: rotary dims ", R, " must be even and at most the head dim ", D);
  cos = cos.contiguous(), sin = sin.contiguous();
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.sizes() == sin.sizes() &&
              cos.numel() == t.size(0) * R / 2, "rope_: cos/sin must be float32 (", t.size(0), ", ", R / 2, "), got ",
              cos.sizes(), " and ", sin.sizes());
  scratchlm_decoder::rope_rows(t, heads, D, R, cos, sin, half_pairs);
  return t;
}

torch::Tensor layer_norm(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> b, double eps) {
  check_rows(x, "layer_norm: x");
  const bool has_b = b.has_value() && b->defined();
  for (const auto* t : {&w, has_b ? &*b : &w})
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kFloat && t->numel() == x.size(1) && t->device().is_cpu(),
                "layer_norm: weight and bias must be float32 (", x.size(1), ",), got ", t->scalar_type(), " ",
                t->sizes());
  x = x.contiguous(), w = w.contiguous();
  auto y = torch::empty_like(x);
  scratchlm_decoder::layernorm_rows(x, w, has_b ? b->contiguous() : torch::Tensor(), y, static_cast<float>(eps));
  return y;
}

torch::Tensor act_mul(torch::Tensor g, c10::optional<torch::Tensor> u, int64_t act) {
  check_rows(g, "act_mul: gate");
  TORCH_CHECK(act >= 0 && act <= 2, "act_mul: act must be 0 (silu), 1 (gelu_tanh) or 2 (gelu), got ", act);
  const bool gated = u.has_value() && u->defined();
  if (gated)
    TORCH_CHECK(u->sizes() == g.sizes() && u->scalar_type() == at::kFloat, "act_mul: up must match gate ",
                g.sizes(), ", got ", u->sizes());
  g = g.contiguous();
  auto s = torch::empty_like(g);
  scratchlm_decoder::act_mul_out(static_cast<int>(act), g, gated ? u->contiguous() : torch::Tensor(), s);
  return s;
}

torch::Tensor silu_mul(torch::Tensor g, torch::Tensor u) {
  check_rows(g, "silu_mul: gate");
  TORCH_CHECK(u.sizes() == g.sizes() && u.scalar_type() == at::kFloat, "silu_mul: up must match gate ", g.sizes(),
              ", got ", u.sizes());
  g = g.contiguous(), u = u.contiguous();
  auto s = torch::empty_like(g);
  scratchlm_decoder::silu_mul_out(g, u, s);
  return s;
}

// The fused step's stage profile (decoder.h): {stage: thread CPU seconds} summed over every forward since the
// last reset, plus "steps"; `enable` 1 / 0 switches profiling on / off, -1 leaves it; `reset` zeroes the table.
std::map<std::string, double> decoder_profile(int64_t enable, bool reset) {
  auto& p = scratchlm_decoder::stage_profile();
  std::map<std::string, double> out;
  for (int i = 0; i < scratchlm_decoder::kStages; ++i) out[scratchlm_decoder::kStageNames[i]] = p.seconds[i];
  out["steps"] = static_cast<double>(p.steps);
  if (reset) p.seconds.fill(0.0), p.steps = 0;
  if (enable >= 0) p.on.store(enable != 0);
  return out;
}

// Whether decode rows run paged_attention.h's decode_row_avx2 (1) or the tile kernel per KV head (0); -1 only
// reads. Returns the previous choice (benchmarks/decode_step.py interleaves the two; both give the same floats).
bool set_decode_rows(int64_t set) {
  auto& f = scratchlm_attn::decode_rows_flag();
  return set >= 0 ? f.exchange(set != 0) : f.load();
}

bool has_avx2() { return scratchlm_simd::cpu_has_avx2(); }

// Whether the panel kernel uses its memory hints (next-group prefetch, non-temporal stores of large outputs:
// panel_gemm.h); `set` 0 / 1 changes it, -1 only reads; returns the previous choice.
bool panel_streaming(int64_t set) {
  auto& on = scratchlm_panel::streaming();
  return set >= 0 ? on.exchange(set != 0) : on.load();
}

// The fp32 kernel choice of skinny_gemm.h (for benchmarks interleaving them); returns the previous one.
std::vector<bool> set_fp32_kernels(bool avx512, bool onednn) {
  auto& c = scratchlm_gemm::kernel_choice();
  return {c.avx512.exchange(avx512), c.onednn.exchange(onednn)};
}

// y = x @ W^T for a quantized (or float32) W given as its tensors (qlinear.h); path -1: the best this CPU runs.
torch::Tensor quant_linear(torch::Tensor x, const std::vector<torch::Tensor>& weight, int64_t group_size,
                           int64_t path) {
  TORCH_CHECK(!weight.empty(), "quant_linear: no weight tensors");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "quant_linear: x must be a float32 CPU tensor (M, K), got ", x.sizes());
  x = x.contiguous();
  const int64_t N = weight[0].size(0), K = x.size(1);
  auto w = scratchlm_qgemm::QLinear::from(weight, group_size, N, K, "quant_linear");
  auto y = torch::empty({x.size(0), N}, x.options());
  w.forward(x, y, nullptr, static_cast<int>(path));
  return y;
}

// The float32 weight of quantized tensors (qlinear.h's dequantization: what prefill multiplies with).
torch::Tensor quant_dequantize(const std::vector<torch::Tensor>& weight, int64_t group_size, int64_t K) {
  TORCH_CHECK(!weight.empty(), "quant_dequantize: no weight tensors");
  return scratchlm_qgemm::QLinear::from(weight, group_size, weight[0].size(0), K, "quant_dequantize").dequantized();
}

// The code path quant_linear runs for M rows of x with these weight tensors (path -1: the default here).
int64_t quant_resolved_path(const std::vector<torch::Tensor>& weight, int64_t group_size, int64_t K, int64_t M,
                            int64_t path) {
  TORCH_CHECK(!weight.empty(), "quant_resolved_path: no weight tensors");
  return scratchlm_qgemm::QLinear::from(weight, group_size, weight[0].size(0), K, "quant_resolved_path")
      .resolve_path(M, static_cast<int>(path));
}

// A raw GGUF weight (uint8 (N, row_bytes), the file's blocks of ggml type `type_id`, K weights a row), checked.
scratchlm_gguf::GMat gguf_mat(const torch::Tensor& raw, int64_t type_id, int64_t K, const char* what) {
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.device().is_cpu() && raw.is_contiguous(),
              what, ": raw must be a contiguous uint8 CPU tensor (N, row_bytes), got ", raw.scalar_type(), " ",
              raw.sizes());
  return scratchlm_gguf::make_gmat(type_id, raw.size(0), K, raw.size(1), raw.data_ptr<uint8_t>(), what);
}

// y (M, N) = x (M, K) @ W^T for W a raw GGUF weight; path -1: the default (gguf_gemm.h; kDequantPath with float
// activations, qlinear.h's gguf_path), else the kernel's path number (0: portable scalar), or kDequantPath (100).
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor raw, int64_t type_id, int64_t K, int64_t path) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.size(1) == K,
              "gguf_linear: x must be a float32 CPU tensor (M, ", K, "), got ", x.scalar_type(), " ", x.sizes());
  const auto w = gguf_mat(raw, type_id, K, "gguf_linear");
  x = x.contiguous();
  auto y = torch::empty({x.size(0), w.N}, x.options());
  if (x.size(0) > 0) scratchlm_gguf::gguf_gemm(x, w, y, scratchlm_qgemm::gguf_path(static_cast<int>(path)));
  return y;
}

// The float32 (N, K) weight of a raw GGUF weight (gguf.quants' values).
torch::Tensor gguf_dequantize(torch::Tensor raw, int64_t type_id, int64_t K) {
  return scratchlm_gguf::gguf_dequantize(gguf_mat(raw, type_id, K, "gguf_dequantize"));
}

// The path gguf_linear runs for M rows (path -1: the default here).
int64_t gguf_resolve_path(torch::Tensor raw, int64_t type_id, int64_t K, int64_t M, int64_t path) {
  return scratchlm_gguf::gguf_resolve_path(gguf_mat(raw, type_id, K, "gguf_resolve_path"), M,
                                           scratchlm_qgemm::gguf_path(static_cast<int>(path)));
}

// The ggml type ids this build keeps raw and has kernels for.
std::vector<int64_t> gguf_types() {
  std::vector<int64_t> out;
  for (int id = 0; id < 64; ++id)
    if (scratchlm_gguf::gguf_handles(static_cast<scratchlm_gguf::GType>(id))) out.push_back(id);
  return out;
}

// Whether the default quantized paths keep x in float32 (see qlinear.h); `set` 0 / 1 changes it, -1 only reads.
bool quant_float_activations(int64_t set) {
  if (set >= 0) scratchlm_qgemm::float_activations_flag().store(set != 0);
  return scratchlm_qgemm::float_activations();
}

// Whether prefill chunks (> 64 rows) run the integer panel kernels where decode rounds x (qlinear.h); as above.
bool quant_integer_prefill(int64_t set) {
  if (set >= 0) scratchlm_qgemm::integer_prefill_flag().store(set != 0);
  return scratchlm_qgemm::integer_prefill_flag().load();
}

// Whether the AVX-512 prefill tiles put keys in lanes (paged_attention.h, keys_in_lanes_flag); as above.
bool prefill_keys_in_lanes(int64_t set) {
  if (set >= 0) scratchlm_attn::keys_in_lanes_flag().store(set != 0);
  return scratchlm_attn::keys_in_lanes_flag().load();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using scratchlm_decoder::FusedDecoder;
  using scratchlm_decoder::MoELayer;
  m.def("skinny_linear", &skinny_linear, "y = x @ w.T for few rows of x (CPU, float32)",
        py::arg("x"), py::arg("w"), py::arg("use_simd") = true, py::call_guard<py::gil_scoped_release>());
  m.def("panel_pack", &panel_pack, "a float32 (N, K) weight as panels (ceil(N/16), K, 16)", py::arg("w"),
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_pack_groups", &panel_pack_groups, "groups of float32 (N, K) weights as one panel tensor per group, "
        "all views of one (huge-page) buffer", py::arg("groups"), py::call_guard<py::gil_scoped_release>());
  m.def("panel_linear", &panel_linear, "[x @ W_i.T] for the matrices packed in panels (CPU, float32, any rows)",
        py::arg("x"), py::arg("wp"), py::arg("ns"), py::arg("use_simd") = true, py::arg("kernel") = 0,
        py::call_guard<py::gil_scoped_release>());
  scratchlm_panel::def_fp32_choice(m);  // fp32 kernel choice (panel_gemm.h, kernel_choice.py), isa_name
  m.def("fp32_peak_fmas", &scratchlm_panel::peak_fma, "run iters rounds of independent FMAs in registers (time it): "
        "the float FMAs done (AVX-512 if avx512 and the CPU has it, else AVX2; 0 without SIMD)",
        py::arg("iters"), py::arg("avx512") = true, py::call_guard<py::gil_scoped_release>());
  m.def("paged_decode_attention", &paged_decode_attention, "attention of each row's query over its context in a "
        "paged KV cache (CPU): scores q.k * scale, soft-capped (softcap > 0) and limited to the last `window` keys "
        "(window > 0)", py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("use_simd") = true, py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("tile_rows") = PREFILL_TILE_ROWS, py::arg("avx512") = true,
        py::arg("softcap") = 0.0, py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("kv_store", &kv_store, "write float32 K or V rows into a paged cache of any KV dtype (as the fused step does)",
        py::arg("cache"), py::arg("scales"), py::arg("slots"), py::arg("k"), py::call_guard<py::gil_scoped_release>());
  py::class_<MoELayer, std::shared_ptr<MoELayer>>(m, "MoELayer", "a mixture-of-experts feed-forward for the fused "
                                                  "step (see moe.h)")
      .def(py::init<const std::vector<torch::Tensor>&, int64_t,
                    const std::vector<std::vector<std::vector<torch::Tensor>>>&, const std::vector<std::vector<int64_t>>&, const std::vector<std::vector<torch::Tensor>>&,
                    const std::vector<int64_t>&, const std::vector<torch::Tensor>&, c10::optional<torch::Tensor>,
                    const std::map<std::string, double>&>(),
           py::arg("gate"), py::arg("gate_group_size"), py::arg("experts"), py::arg("expert_group_sizes"),
           py::arg("shared"), py::arg("shared_group_sizes"), py::arg("shared_gate"), py::arg("score_bias"),
           py::arg("values"))
      .def("n_experts", &MoELayer::n_experts)
      .def("top_k", &MoELayer::top_k)
      .def("forward", [](const MoELayer& l, torch::Tensor h, bool use_simd, bool round_once) {
             TORCH_CHECK(h.dim() == 2 && h.scalar_type() == at::kFloat, "h must be float32 (B, d)");
             h = h.contiguous();
             auto out = torch::empty_like(h);
             l.forward(h, out, use_simd, round_once);
             return out;
           }, "out (B, d) = the MoE feed-forward of h (B, d); round_once=False: each expert rounds its rows of h "
           "to int8 itself (the same bits, slower; see moe.h)", py::arg("h"), py::arg("use_simd") = true,
           py::arg("round_once") = true, py::call_guard<py::gil_scoped_release>());
  py::class_<FusedDecoder>(m, "FusedDecoder", "all layers of a decode step in one call (see decoder.h)")
      .def(py::init<const std::vector<std::vector<torch::Tensor>>&, int64_t, int64_t, int64_t, double, bool, bool,
                    const std::vector<std::vector<std::vector<torch::Tensor>>>&,
                    const std::vector<std::vector<int64_t>>&, const std::vector<std::map<std::string, torch::Tensor>>&,
                    const std::vector<std::map<std::string, double>>&,
                    const std::map<int64_t, std::shared_ptr<scratchlm_decoder::MoELayer>>&>(),
           py::arg("layers"), py::arg("n_heads"), py::arg("n_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("rope_half"), py::arg("use_simd") = true,
           py::arg("linears") = std::vector<std::vector<std::vector<torch::Tensor>>>{},
           py::arg("group_sizes") = std::vector<std::vector<int64_t>>{},
           py::arg("tensors") = std::vector<std::map<std::string, torch::Tensor>>{},
           py::arg("values") = std::vector<std::map<std::string, double>>{},
           py::arg("moe") = std::map<int64_t, std::shared_ptr<scratchlm_decoder::MoELayer>>{})
      .def("forward", &FusedDecoder::forward, py::arg("x"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("slots"), py::arg("cos"), py::arg("sin"), py::arg("block_tables"), py::arg("context_lens"),
           py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), py::arg("cos_local") = py::none(),
           py::arg("sin_local") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "the fused step's RMSNorm: (x (M, d) * rsqrt(mean(x^2) + eps)) * w, float32",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("rope_", &rope_, "the fused step's RoPE, in place on the first rotary_dim (0: all) dims of each head of t "
        "(M, heads * D) with cos/sin (M, rotary_dim/2)", py::arg("t"), py::arg("heads"), py::arg("cos"),
        py::arg("sin"), py::arg("half_pairs"), py::arg("rotary_dim") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("layer_norm", &layer_norm, "the fused step's LayerNorm: ((x - mean) * rsqrt(var + eps)) * w (+ b), float32",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("eps"), py::call_guard<py::gil_scoped_release>());
  m.def("act_mul", &act_mul, "the fused step's MLP activation: act(gate) (* up when given); act 0 silu, 1 gelu_tanh, "
        "2 gelu", py::arg("gate"), py::arg("up"), py::arg("act"), py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "the fused step's silu(gate) * up, float32 (M, d_ff)", py::arg("gate"), py::arg("up"),
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_streaming", &panel_streaming, "whether the panel kernel prefetches its next panel group and writes "
        "large outputs with non-temporal stores (panel_gemm.h); set = 0 / 1 changes it, -1 reads; returns the "
        "previous choice", py::arg("set") = -1);
  m.def("decoder_profile", &decoder_profile, "the fused step's per-stage thread CPU seconds since the last reset "
        "(enable 1 / 0 turns profiling on / off, -1 leaves it)", py::arg("enable") = -1, py::arg("reset") = false);
  m.def("set_decode_rows", &set_decode_rows, "decode rows through the all-heads row kernel (1) or the tile kernel "
        "per KV head (0), -1 reads; returns the previous choice", py::arg("set") = -1);
  m.def("has_avx2", &has_avx2, "whether the CPU runs the AVX2+FMA path");
  m.def("set_fp32_kernels", &set_fp32_kernels, "AVX-512 skinny tiles / oneDNN for many rows on or off; the old choice",
        py::arg("avx512"), py::arg("onednn"));
  m.def("quant_linear", &quant_linear, "y = x @ W^T, W float32 / int8 / int4 tensors (qlinear.h)", py::arg("x"),
        py::arg("weight"), py::arg("group_size"), py::arg("path") = -1, py::call_guard<py::gil_scoped_release>());
  m.def("quant_dequantize", &quant_dequantize, "the float32 (N, K) weight of int8 / int4 tensors",
        py::arg("weight"), py::arg("group_size"), py::arg("K"), py::call_guard<py::gil_scoped_release>());
  m.def("quant_best_path", &scratchlm_qgemm::best_path, "quant_linear's code path here: 0 scalar, 1 AVX2, 2 VNNI");
  m.def("quant_resolved_path", &quant_resolved_path, "the code path quant_linear runs for M rows (qlinear.h)",
        py::arg("weight"), py::arg("group_size"), py::arg("K"), py::arg("M"), py::arg("path") = -1);
  m.def("gguf_linear", &gguf_linear, "y = x @ W^T for W a GGUF weight kept in its file blocks (raw uint8 (N, "
        "row_bytes) of ggml type type_id); path -1: the default for this CPU and M (gguf_gemm.h)", py::arg("x"),
        py::arg("raw"), py::arg("type_id"), py::arg("K"), py::arg("path") = -1,
        py::call_guard<py::gil_scoped_release>());
  m.def("gguf_dequantize", &gguf_dequantize, "the float32 (N, K) weight of a raw GGUF weight (gguf.quants' values)",
        py::arg("raw"), py::arg("type_id"), py::arg("K"), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_resolve_path", &gguf_resolve_path, "the code path gguf_linear runs for M rows (gguf_gemm.h)",
        py::arg("raw"), py::arg("type_id"), py::arg("K"), py::arg("M"), py::arg("path") = -1);
  m.def("gguf_types", &gguf_types, "the ggml type ids this build keeps raw and has kernels for");
  m.def("gguf_dequant_path", [] { return scratchlm_gguf::kDequantPath; },
        "gguf_linear's path number for: dequantize row chunks to float32, then the fp32 GEMM");
  m.def("quant_float_activations", &quant_float_activations,
        "whether the default quantized paths keep x in float32; set = 0 / 1 changes it, -1 reads",
        py::arg("set") = -1);
  m.def("quant_integer_prefill", &quant_integer_prefill,
        "whether prefill chunks (> 64 rows) run the integer panel kernels; set = 0 / 1 changes it, -1 reads",
        py::arg("set") = -1);
  m.def("prefill_keys_in_lanes", &prefill_keys_in_lanes,
        "whether AVX-512 prefill tiles compute scores with keys in lanes (off: the tiles of before, the same floats); "
        "set = 0 / 1 changes it, -1 reads", py::arg("set") = -1);
}
