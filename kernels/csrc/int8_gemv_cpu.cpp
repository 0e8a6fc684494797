// Weight-only int8 products for a few rows of float32 activations on the CPU: the torch
// binding of int8_gemv_cpu.h's loops, the blocks of output channels split over torch's threads.
#include <torch/extension.h>

#include "int8_gemv_cpu.h"

using tandem_cpu::kGemvChannels;

static const tandem_cpu::Isa kIsa = tandem_cpu::detect_isa();

// x: [M, K] float32; values: [N / 16, K / 4, 16] int32 (see int8_gemv_cpu.h); scale: [N]
// float32 -> [M, N] float32.
torch::Tensor int8_gemv(torch::Tensor x, torch::Tensor values, torch::Tensor scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: [M, K] float32");
  TORCH_CHECK(values.dim() == 3 && values.scalar_type() == torch::kInt32 && values.is_contiguous() &&
              values.size(2) == kGemvChannels, "values: [N / 16, K / 4, 16] contiguous int32");
  const int64_t M = x.size(0), K = x.size(1), num_blocks = values.size(0), N = num_blocks * kGemvChannels;
  TORCH_CHECK(values.size(1) * 4 == K, "int8_gemv: x has ", K, " columns, the weight ", values.size(1) * 4);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 && scale.is_contiguous() && scale.numel() == N,
              "scale: [N] contiguous float32");
  const auto xc = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  const auto* fns = tandem_cpu::int8::int8_blocks(kIsa);
  const int32_t* v = values.data_ptr<int32_t>();
  const float* s = scale.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, num_blocks, 1, [&](int64_t begin, int64_t end) {
    tandem_cpu::int8::gemv_blocks(fns, v, s, xp, M, K, N, o, begin, end);
  });
  return out;
}

std::string isa() { return tandem_cpu::isa_name(kIsa); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv", &int8_gemv, "weight-only int8 product for a few rows of float32 activations");
  m.def("isa", &isa, "the instruction set the kernel picked");
}
