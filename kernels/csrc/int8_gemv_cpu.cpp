// Weight-only int8 products for a few rows of float32 activations on the CPU: the torch
// binding of int8_gemv_cpu.h's loops, the blocks of output channels split over torch's threads.
#include <torch/extension.h>

#include "int8_gemv_cpu.h"
#include "int8_q8_gemv_cpu.h"

using tandem_cpu::kGemvChannels;

static const tandem_cpu::Isa kIsa = tandem_cpu::detect_isa();

static const bool kInt8Dot = tandem_cpu::q8::cpu_has_int8_dot();

// x: [M, K] float32; values: [N / 16, K / 4, 16] int32 (see int8_gemv_cpu.h); scale: [N]
// float32 -> [M, N] float32. int8_activations: x rounded to 8 bits per group of 32
// (int8_q8_gemv_cpu.h; only where has_int8_dot(), K a multiple of 32).
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor values, torch::Tensor scale, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: [M, K] float32");
  TORCH_CHECK(values.dim() == 3 && values.scalar_type() == torch::kInt32 && values.is_contiguous() &&
              values.size(2) == kGemvChannels, "values: [N / 16, K / 4, 16] contiguous int32");
  const int64_t M = x.size(0), K = x.size(1), num_blocks = values.size(0), N = num_blocks * kGemvChannels;
  TORCH_CHECK(values.size(1) * 4 == K, "int8_gemv: x has ", K, " columns, the weight ", values.size(1) * 4);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == N,
              "scale: [N] contiguous float32");
  TORCH_CHECK(!int8_activations || (kInt8Dot && K % tandem_cpu::q8::kGroup == 0),
              "int8_gemv: 8-bit activations need AVX-512 VNNI and columns in groups of 32");
  const auto xc = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  const int32_t* v = values.data_ptr<int32_t>();
  const float* s = scale.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
#ifdef TANDEM_HAS_Q8_GEMV
  if (int8_activations) {
    const int64_t groups = K / tandem_cpu::q8::kGroup;
    auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
    auto floats = torch::empty({2 * M * groups + M}, x.options());  // scales, group sums (unused), offset terms
    float* d = floats.data_ptr<float>();
    float* c = d + 2 * M * groups;
    int8_t* qp = q.data_ptr<int8_t>();
    tandem_cpu::q8::quantize_rows<tandem_cpu::q8::Order::kNatural>(xp, M, K, qp, d, d + M * groups);
    tandem_cpu::int8_q8::offset_terms(qp, d, M, K, c);
    at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
      tandem_cpu::int8_q8::gemv_blocks(v, s, qp, d, c, M, K, N, o, begin, end);
    });
    return out;
  }
#endif
  const auto* fns = tandem_cpu::int8::int8_blocks(kIsa);
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    tandem_cpu::int8::gemv_blocks(fns, v, s, xp, M, K, N, o, begin, end);
  });
  return out;
}

std::string isa() { return tandem_cpu::isa_name(kIsa); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("int8_gemv", &int8_gemv, "weight-only int8 product for a few rows of float32 activations", py::arg("x"),
        py::arg("values"), py::arg("scale"), py::arg("int8_activations") = false);
  m.def("isa", &isa, "the instruction set the kernel picked");
}
