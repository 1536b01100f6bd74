// Python bindings of the fp32 kernel choice (panel_gemm.h) and the machine facts `scratchlm bench kernels` prints;
// engine_kernels.cpp calls def_fp32_choice(m). The policy lives in scratchlm/inference/kernel_choice.py.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>
#include <vector>

#include "panel_gemm.h"
#include "simd_common.h"

namespace scratchlm_panel {

// A packed weight as a Python object (fast_linear.PanelLinear holds one): the kernel chosen per call, the plain or
// prepacked copies that other kernels read kept with it (made on first need), one call from Python per matmul.
class PanelMatmul {
 public:
  PanelMatmul(const at::Tensor& panels, std::vector<int64_t> ns) : w_(PanelWeight::from(panels, std::move(ns),
                                                                                          "PanelMatmul")) {}

  // [x (M, K) @ W_i^T]; kernel -1: the one chosen for this shape class, else an Fp32Kernel id.
  std::vector<at::Tensor> forward(const at::Tensor& x, int64_t kernel) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "PanelMatmul: x must be a float32 CPU tensor (M, K), got ", x.sizes());
    TORCH_CHECK(x.size(1) == w_.K, "PanelMatmul: x has K = ", x.size(1), " but the weight has K = ", w_.K);
    const auto xc = x.contiguous();
    std::vector<at::Tensor> ys;
    std::vector<at::Tensor*> ptrs;
    for (int64_t n : w_.ns) ys.push_back(at::empty({xc.size(0), n}, xc.options()));
    for (auto& y : ys) ptrs.push_back(&y);
    w_.forward(xc, ptrs, true, static_cast<int>(kernel));
    return ys;
  }

  // Which copies other kernels made so far: ["plain"] and / or ["onednn"].
  std::vector<std::string> copies() const {
    std::lock_guard<std::mutex> lock(w_.alt->mu);
    std::vector<std::string> out;
    if (w_.alt->plain.defined()) out.emplace_back("plain");
    if (w_.alt->onednn.defined()) out.emplace_back("onednn");
    return out;
  }

 private:
  PanelWeight w_;
};

inline void def_fp32_choice(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<PanelMatmul>(m, "PanelMatmul", "a panel-packed float32 weight (panels (P, K, 16), widths ns) multiplied "
                          "by the kernel chosen per shape class (panel_gemm.h), its other copies kept")
      .def(py::init<const at::Tensor&, std::vector<int64_t>>(), py::arg("panels"), py::arg("ns"))
      .def("forward", &PanelMatmul::forward, "[x @ W_i.T]; kernel -1: the chosen one", py::arg("x"),
           py::arg("kernel") = -1, py::call_guard<py::gil_scoped_release>())
      .def("copies", &PanelMatmul::copies, "the plain / oneDNN copies made so far");
  m.def("isa_name", [] { return std::string(scratchlm_simd::isa_name()); },
        "the ISA the kernels run here (scratchlm_simd::isa_name: avx512-vnni, avx512, avx2-vnni, avx2, scalar)");
  m.def("fp32_kernel_names", [] { return std::vector<std::string>(kFp32KernelNames, kFp32KernelNames + kFp32Kernels); },
        "the fp32 kernels by id (panel_gemm.h Fp32Kernel)");
  m.def("fp32_row_buckets", [] {
          std::vector<int64_t> tops(kBucketTop, kBucketTop + kRowBuckets);
          tops.back() = -1;
          return tops;
        }, "the row buckets' largest M (-1: no limit)");
  m.def("fp32_shape_class", [](int64_t M, int64_t N) { return std::make_tuple(row_bucket(M), n_class(N)); },
        "(row bucket, N class) of M rows against N columns", py::arg("M"), py::arg("N"));
  m.def("fp32_set_choice", [](int bucket, int64_t K, int ncls, int kernel) {
          TORCH_CHECK(bucket >= 0 && bucket < kRowBuckets && kernel >= 0 && kernel < kFp32Kernels,
                      "fp32_set_choice: bucket ", bucket, " or kernel ", kernel, " out of range");
          ChoiceTable& t = choice_table();
          std::lock_guard<std::mutex> lock(t.mu);
          t.chosen[{bucket, K, ncls}] = kernel;
        }, "store the kernel of a shape class", py::arg("bucket"), py::arg("K"), py::arg("n_class"), py::arg("kernel"));
  m.def("fp32_choices", [] {
          ChoiceTable& t = choice_table();
          std::lock_guard<std::mutex> lock(t.mu);
          std::vector<std::tuple<int, int64_t, int, int>> out;
          for (const auto& [key, k] : t.chosen) out.emplace_back(std::get<0>(key), std::get<1>(key), std::get<2>(key), k);
          return out;
        }, "the table: [(bucket, K, n_class, kernel)]");
  m.def("fp32_clear_choices", [] {
          ChoiceTable& t = choice_table();
          std::lock_guard<std::mutex> lock(t.mu);
          t.chosen.clear();
        }, "empty the table (tests)");
  m.def("fp32_kernel_for", &kernel_for, "the kernel M rows against a K x N weight run (measuring a new class first "
        "when a measurer is set)", py::arg("M"), py::arg("K"), py::arg("N"));
  m.def("fp32_force_kernel", [](int kernel) {
          TORCH_CHECK(kernel >= -1 && kernel < kFp32Kernels, "fp32_force_kernel: ", kernel, " is not -1..",
                      kFp32Kernels - 1);
          return choice_table().forced.exchange(kernel);
        }, "run this kernel for every class (-1: the measured choice); returns the previous setting",
        py::arg("kernel"));
  m.def("fp32_forced_kernel", [] { return choice_table().forced.load(); }, "the forced kernel, -1 if none");
  m.def("fp32_set_measurer", [](py::object f) {
          ChoiceTable& t = choice_table();
          std::lock_guard<std::mutex> lock(t.mu);
          if (f.is_none()) {
            t.measure = nullptr;
            return;
          }
          auto* keep = new py::object(f);  // never released: the table outlives the interpreter's teardown
          t.measure = [keep](int bucket, int64_t K, int64_t N) {
            py::gil_scoped_acquire gil;
            try {
              return (*keep)(bucket, K, N).cast<int>();
            } catch (py::error_already_set& e) {
              throw std::runtime_error(e.what());
            }
          };
        }, "f(bucket, K, N) -> kernel, called on a class's first use (None: unset)", py::arg("f"));
  m.def("fp32_onednn_available", &onednn_available, "whether this torch has oneDNN's matmul ops");
  m.def("fp32_avx2_blocking", [] {
          const auto& b = avx2_blocking();
          return std::make_tuple(b.kc_max, b.a_floats);
        }, "the AVX2 panel kernel's (longest k-chunk, floats of packed x per row block), from the cache sizes");
}

}  // namespace scratchlm_panel
