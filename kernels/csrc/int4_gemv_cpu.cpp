// Weight-only int4 products for a few rows of float32 activations on the CPU: the torch
// binding of int4_gemv_cpu.h's loops, the blocks of output channels split over torch's threads.
#include <torch/extension.h>

#include "int4_gemv_cpu.h"
#include "int4_q8_gemv_cpu.h"

using tandem_cpu::kGemvChannels;
using tandem_cpu::int4::kGroup;

static const tandem_cpu::Isa kIsa = tandem_cpu::detect_isa();

static const bool kInt8Dot = tandem_cpu::q8::cpu_has_int8_dot();

// x: [M, K] float32; values: [N / 16, K / 8, 16] int32; scale_offset: [N / 16, K / 32, 16]
// int32 (see int4_gemv_cpu.h) -> [M, N] float32. int8_activations: x rounded to 8 bits per group
// of 32 (int4_q8_gemv_cpu.h; only where has_int8_dot()).
torch::Tensor int4_gemv(torch::Tensor x, torch::Tensor values, torch::Tensor scale_offset, bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: [M, K] float32");
  TORCH_CHECK(values.dim() == 3 && values.scalar_type() == torch::kInt32 && values.is_contiguous() &&
              values.size(2) == kGemvChannels, "values: [N / 16, K / 8, 16] contiguous int32");
  const int64_t M = x.size(0), K = x.size(1), num_blocks = values.size(0), N = num_blocks * kGemvChannels;
  TORCH_CHECK(K % kGroup == 0 && values.size(1) * 8 == K, "int4_gemv: x has ", K, " columns, the weight ",
              values.size(1) * 8);
  TORCH_CHECK(scale_offset.scalar_type() == torch::kInt32 && scale_offset.is_contiguous() &&
              scale_offset.sizes() == torch::IntArrayRef({num_blocks, K / kGroup, kGemvChannels}),
              "scale_offset: [N / 16, K / 32, 16] contiguous int32");
  TORCH_CHECK(!int8_activations || kInt8Dot, "int4_gemv: this CPU has no 8-bit dot products (AVX-512 VNNI)");
  const auto xc = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  const auto* v = reinterpret_cast<const uint32_t*>(values.data_ptr<int32_t>());
  const auto* so = reinterpret_cast<const uint32_t*>(scale_offset.data_ptr<int32_t>());
  float* o = out.data_ptr<float>();
#ifdef TANDEM_HAS_Q8_GEMV
  if (int8_activations) {
    auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
    auto scales = torch::empty({2, M, K / kGroup}, x.options());
    float* d = scales.data_ptr<float>();
    float* sums = d + M * (K / kGroup);
    tandem_cpu::q8::quantize_rows<tandem_cpu::q8::Order::kNibbles>(xc.data_ptr<float>(), M, K, q.data_ptr<int8_t>(), d, sums);
    const int8_t* qp = q.data_ptr<int8_t>();
    at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
      tandem_cpu::int4_q8::gemv_blocks(v, so, qp, d, sums, M, K, N, o, begin, end);
    });
    return out;
  }
#endif
  auto xsum = torch::empty({M, K / kGroup}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* sums = xsum.data_ptr<float>();
  tandem_cpu::int4::group_sums(xp, M, K, sums);
  const auto* fns = tandem_cpu::int4::int4_blocks(kIsa);
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    tandem_cpu::int4::gemv_blocks(fns, v, so, xp, sums, M, K, N, o, begin, end);
  });
  return out;
}

std::string isa() { return tandem_cpu::isa_name(kIsa); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("int4_gemv", &int4_gemv, "weight-only int4 product for a few rows of float32 activations", py::arg("x"),
        py::arg("values"), py::arg("scale_offset"), py::arg("int8_activations") = false);
  m.def("has_int8_dot", [] { return kInt8Dot; }, "whether int8_activations runs here (AVX-512 VNNI)");
  m.def("isa", &isa, "the instruction set the kernel picked");
}
