// float32 products for a few rows of float32 activations (the loops; f32_gemv_cpu.cpp binds them
// for torch, decode_step_cpu.cpp runs them inside its step), over the weight as torch holds it:
//
//   out[m, n] = sum_k w[n, k] * x[m, k]        w: [N, K] row-major, K a multiple of 16
//
// Each output channel is a dot product along a contiguous row of the weight, so no packed copy
// is needed (a float model's weights are its largest bytes). Up to 8 channels go together, each
// with its own accumulator per activation row (independent chains, the x vectors loaded once
// for all of them); a sum's W lanes are then added in lane order. A step reads the weight at
// close to the core's bandwidth, where MKL's sgemv reached about 11 of 25-30 GB/s on the
// 2-core AMD machine (2026-11-29). See cpu_gemv.h for the per-ISA versions.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_gemv.h"

namespace tandem_cpu {
namespace f32 {

constexpr int64_t kColumns = 16;  // K must be a multiple: every ISA's vectors divide it

// C channels against R activation rows. w: the first channel's row; x: [R, K]; out: R rows of stride N.
template <int W, int R, int C>
TANDEM_INLINE void channels(const float* w, const float* x, int64_t K, int64_t N, float* out) {
  using F = typename GemvVec<W>::F;
  F acc[C][R];
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) acc[c][r] = F{};
  for (int64_t k = 0; k < K; k += W) {
    F xv[R];
    for (int r = 0; r < R; ++r) std::memcpy(&xv[r], x + r * K + k, sizeof(F));
    for (int c = 0; c < C; ++c) {
      F wv;
      std::memcpy(&wv, w + c * K + k, sizeof(F));
      for (int r = 0; r < R; ++r) acc[c][r] += wv * xv[r];
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float sum = acc[c][r][0];
      for (int i = 1; i < W; ++i) sum += acc[c][r][i];
      out[r * N + c] = sum;
    }
}

// A block of 16 channels, C at a time: 8 accumulator chains in all (as gemv_partials).
template <int W, int R>
TANDEM_INLINE void block(const float* w, const float* x, int64_t K, int64_t N, float* out) {
  constexpr int C = R >= 8 ? 1 : R >= 4 ? 2 : R >= 2 ? 4 : 8;  // a divisor of 16 near 8 / R
  for (int c = 0; c < kGemvChannels; c += C) channels<W, R, C>(w + c * K, x, K, N, out + c);
}

using BlockFn = void (*)(const float*, const float*, int64_t, int64_t, float*);
TANDEM_GEMV_TABLE(f32_blocks, BlockFn, block, (const float* w, const float* x, int64_t K, int64_t N, float* out),
                  (w, x, K, N, out))

// out[:, 16 b : 16 b + 16] for the blocks b in [first_block, end_block) and every row of x:
// [M, K] -> out: [M, N]. w: the whole weight [N, K].
inline void gemv_blocks(const BlockFn* fns, const float* w, const float* x, int64_t M, int64_t K, int64_t N,
                        float* out, int64_t first_block, int64_t end_block) {
  for (int64_t b = first_block; b < end_block; ++b)
    for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxRows)
      fns[std::min(kGemvMaxRows, M - m0) - 1](w + b * kGemvChannels * K, x + m0 * K, K, N,
                                               out + m0 * N + b * kGemvChannels);
}

}  // namespace f32
}  // namespace tandem_cpu
