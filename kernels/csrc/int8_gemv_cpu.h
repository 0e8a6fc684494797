// Weight-only int8 products (the loops; int8_gemv_cpu.cpp binds them for torch, decode_step_cpu.cpp
// runs them inside its step; one float32 scale per output channel, as Int8Weight holds them)
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
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_gemv.h"

namespace tandem_cpu {
namespace int8 {

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

// out[:, 16 b : 16 b + 16] for the blocks b in [first_block, end_block) and every row of x:
// [M, K] -> out: [M, N]. values, scale: the whole packed weight.
inline void gemv_blocks(const BlockFn* fns, const int32_t* values, const float* scale, const float* x, int64_t M,
                        int64_t K, int64_t N, float* out, int64_t first_block, int64_t end_block) {
  for (int64_t b = first_block; b < end_block; ++b)
    for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxRows)
      fns[std::min(kGemvMaxRows, M - m0) - 1](values + b * (K / 4) * kGemvChannels, scale + b * kGemvChannels,
                                               x + m0 * K, K, N, out + m0 * N + b * kGemvChannels);
}

}  // namespace int8
}  // namespace tandem_cpu
