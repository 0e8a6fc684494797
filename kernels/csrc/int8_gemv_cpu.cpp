// Weight-only int8 products (one float32 scale per output channel, as Int8Weight holds them)
// for a few rows of activations on the CPU, in float32 throughout, over a weight packed once
// for it (kernels/int8_gemv_cpu.py, `pack`) with 16 output channels interleaved:
//
//   out[m, n] = scale[n] * sum_i q[n, i] * x[m, i]
//
// Packed layout: values [N / 16, K / 4, 16] int32, lane j of a 16-lane word holding 4 values
// (columns 4 l .. 4 l + 3, low byte first) of channel 16 b + j. So one vector load brings the
// same 4 columns of W channels, byte t of every lane is two shifts away (sign-extending, no
// byte widening), each activation is a broadcast, and the accumulators are the W outputs
// themselves. See cpu_gemv.h for the threads and the per-ISA versions.
#include <torch/extension.h>

#include <cstring>

#include "cpu_gemv.h"

using tandem_cpu::GemvVec;
using tandem_cpu::kGemvChannels;

namespace {

// W channels (one vector) against R activation rows. values: the block's packed words at this
// vector's first channel; scale: its W scales; x: [R, K]; out: R rows of stride N.
template <int W, int R>
TANDEM_INLINE void channels(const int32_t* values, const float* scale, const float* x, int64_t K, int64_t N,
                            float* out) {
  using F = typename GemvVec<W>::F;
  using I = typename GemvVec<W>::I;
  using U = typename GemvVec<W>::U;
  constexpr int P = tandem_cpu::gemv_partials<R>();
  F part[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) part[r][p] = F{};
  for (int64_t l = 0; l < K / 4; ++l) {
    U lanes;
    std::memcpy(&lanes, values + l * kGemvChannels, sizeof(lanes));
    for (int t = 0; t < 4; ++t) {
      // Byte t to the top, then an arithmetic shift down: its value, sign-extended.
      const F v = __builtin_convertvector(reinterpret_cast<I>(lanes << (24 - 8 * t)) >> 24, F);
      for (int r = 0; r < R; ++r) part[r][(l * 4 + t) % P] += v * x[r * K + l * 4 + t];
    }
  }
  F s;
  std::memcpy(&s, scale, sizeof(s));
  for (int r = 0; r < R; ++r) {
    F sum = part[r][0];
    for (int p = 1; p < P; ++p) sum += part[r][p];
    sum *= s;
    std::memcpy(out + r * N, &sum, sizeof(sum));
  }
}

// A block of 16 channels in vectors of W.
template <int W, int R>
TANDEM_INLINE void block(const int32_t* values, const float* scale, const float* x, int64_t K, int64_t N,
                         float* out) {
  for (int s = 0; s < kGemvChannels; s += W) channels<W, R>(values + s, scale + s, x, K, N, out + s);
}

using BlockFn = void (*)(const int32_t*, const float*, const float*, int64_t, int64_t, float*);
TANDEM_GEMV_TABLE(int8_blocks, BlockFn, block,
                  (const int32_t* v, const float* scale, const float* x, int64_t K, int64_t N, float* out),
                  (v, scale, x, K, N, out))

const tandem_cpu::Isa kIsa = tandem_cpu::detect_isa();

}  // namespace

// x: [M, K] float32; values: [N / 16, K / 4, 16] int32 (see the layout above); scale: [N]
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
  const BlockFn* fns = int8_blocks(kIsa);
  const int32_t* v = values.data_ptr<int32_t>();
  const float* s = scale.data_ptr<float>();
  const float* xp = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  tandem_cpu::for_each_block(num_blocks, M, [&](int64_t b, int64_t m0, int64_t rows) {
    fns[rows - 1](v + b * (K / 4) * kGemvChannels, s + b * kGemvChannels, xp + m0 * K, K, N,
                  o + m0 * N + b * kGemvChannels);
  });
  return out;
}

std::string isa() { return tandem_cpu::isa_name(kIsa); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemv", &int8_gemv, "weight-only int8 product for a few rows of float32 activations");
  m.def("isa", &isa, "the instruction set the kernel picked");
}
