// float32 products for a few rows of float32 activations on the CPU: the torch binding of
// f32_gemv_cpu.h's loops, the blocks of output channels split over torch's threads.
#include <torch/extension.h>

#include "f32_gemv_cpu.h"

using tandem_cpu::kGemvChannels;

static const tandem_cpu::Isa kIsa = tandem_cpu::detect_isa();

// x: [M, K] float32; w: [N, K] contiguous float32, N a multiple of 16, K of 16 -> [M, N] float32.
torch::Tensor f32_gemv(torch::Tensor x, torch::Tensor w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "x: [M, K] float32");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat32 && w.is_contiguous() &&
                  w.size(0) % kGemvChannels == 0 && w.size(1) % tandem_cpu::f32::kColumns == 0,
              "w: [N, K] contiguous float32, N and K multiples of 16");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K, "f32_gemv: x has ", K, " columns, the weight ", w.size(1));
  const auto xc = x.contiguous();
  auto out = torch::empty({M, N}, x.options());
  const auto* fns = tandem_cpu::f32::f32_blocks(kIsa);
  const float* wp = w.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, N / kGemvChannels, 1, [&](int64_t begin, int64_t end) {
    tandem_cpu::f32::gemv_blocks(fns, wp, xp, M, K, N, o, begin, end);
  });
  return out;
}

std::string isa() { return tandem_cpu::isa_name(kIsa); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("f32_gemv", &f32_gemv, "float32 product for a few rows of float32 activations");
  m.def("isa", &isa, "the instruction set the kernel picked");
}
