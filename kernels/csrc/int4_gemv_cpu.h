// Weight-only int4 products (the loops; int4_gemv_cpu.cpp binds them for torch, decode_step_cpu.cpp
// runs them inside its step) for a few rows of activations on the CPU, in float32 throughout,
// over a weight packed once for it (kernels/int4_gemv_cpu.py, `pack`): GGUF Q4_1's values
// (two a byte, low nibble first; a float16 scale and offset per group of 32 columns) with 16
// output channels interleaved.
//
//   out[m, n] = sum_g scale[n, g] * sum_{i in g} q[n, i] * x[m, i]  +  sum_g offset[n, g] * xsum[m, g]
//
// Packed layout: values [N / 16, K / 8, 16] uint32, lane j of a 16-lane word holding 8 values
// (columns 8 l .. 8 l + 7) of channel 16 b + j; scale_offset [N / 16, K / 32, 16] uint32, the
// float16 scale's bits low and the offset's high. So one vector load brings the same 8
// columns of W channels, nibble k of every lane is a shift and a mask (or a table) away (no
// byte widening, which compilers lower to scalar code), each activation is a broadcast, and
// the accumulators are the W outputs themselves (no horizontal sums). See cpu_gemv.h for the
// threads and the per-ISA versions.
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_gemv.h"

namespace tandem_cpu {
namespace int4 {

constexpr int64_t kGroup = 32;  // columns per scale and offset: 4 lanes of 8

// float16 bits (low 16 bits of each lane) -> float, for zeros, subnormals and normals (no
// scale is inf or nan): exponent and mantissa moved into float position read 2^-112 times too
// small, subnormals included, so one multiply corrects both; then the sign.
template <int W> TANDEM_INLINE typename GemvVec<W>::F half_to_float(typename GemvVec<W>::U h) {
  using F = typename GemvVec<W>::F;
  using U = typename GemvVec<W>::U;
  const U magnitude = (h & 0x7fffu) << 13;
  F f;
  std::memcpy(&f, &magnitude, sizeof(f));
  f *= 0x1p112f;
  U bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits |= (h & 0x8000u) << 16;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// The low nibble of each lane as a float. AVX-512 (W = 16): one vpermps from a table of 0..15,
// whose index is the lane's low 4 bits (GCC's __builtin_shuffle takes the mask modulo 16),
// in place of a mask and a conversion: the loop is bound by its instructions.
template <int W> TANDEM_INLINE typename GemvVec<W>::F nibbles_to_float(typename GemvVec<W>::U bits) {
  using F = typename GemvVec<W>::F;
#if defined(__GNUC__) && !defined(__clang__)
  if constexpr (W == 16) {
    const F table = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    return __builtin_shuffle(table, bits);
  }
#endif
  return __builtin_convertvector(bits & 15u, F);
}

// W channels (one vector) against R activation rows. values, scale_offset: the block's packed
// words, at this vector's first channel; x: [R, K]; xsum: [R, groups]; out: R rows of stride
// N, at this vector's first channel.
template <int W, int R>
TANDEM_INLINE void channels(const uint32_t* values, const uint32_t* scale_offset, const float* x,
                            const float* xsum, int64_t K, int64_t N, float* out) {
  using F = typename GemvVec<W>::F;
  using U = typename GemvVec<W>::U;
  constexpr int P = tandem_cpu::gemv_partials<R>();
  const int64_t groups = K / kGroup;
  F acc[R];
  for (int r = 0; r < R; ++r) acc[r] = F{};
  for (int64_t g = 0; g < groups; ++g) {
    U so;
    std::memcpy(&so, scale_offset + g * kGemvChannels, sizeof(so));
    const F scale = half_to_float<W>(so & 0xffffu);
    const F offset = half_to_float<W>(so >> 16);
    F part[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) part[r][p] = F{};
    for (int l = 0; l < kGroup / 8; ++l) {
      U lanes;
      std::memcpy(&lanes, values + (g * (kGroup / 8) + l) * kGemvChannels, sizeof(lanes));
      const int64_t col = g * kGroup + l * 8;
      for (int k = 0; k < 8; ++k) {
        const F v = nibbles_to_float<W>(lanes >> (4 * k));
        for (int r = 0; r < R; ++r) part[r][(l * 8 + k) % P] += v * x[r * K + col + k];
      }
    }
    for (int r = 0; r < R; ++r) {
      F sum = part[r][0];
      for (int p = 1; p < P; ++p) sum += part[r][p];
      acc[r] += sum * scale + offset * xsum[r * groups + g];
    }
  }
  for (int r = 0; r < R; ++r) std::memcpy(out + r * N, &acc[r], sizeof(acc[r]));
}

// A block of 16 channels in vectors of W.
template <int W, int R>
TANDEM_INLINE void block(const uint32_t* values, const uint32_t* scale_offset, const float* x, const float* xsum,
                         int64_t K, int64_t N, float* out) {
  for (int s = 0; s < kGemvChannels; s += W) channels<W, R>(values + s, scale_offset + s, x, xsum, K, N, out + s);
}

using BlockFn = void (*)(const uint32_t*, const uint32_t*, const float*, const float*, int64_t, int64_t, float*);
TANDEM_GEMV_TABLE(int4_blocks, BlockFn, block,
                  (const uint32_t* v, const uint32_t* so, const float* x, const float* xsum, int64_t K, int64_t N,
                   float* out),
                  (v, so, x, xsum, K, N, out))

// Each group of 32 columns' sum of activations, for the offsets' term (a loop: cheaper than
// torch's sum here). x: [M, K] -> sums: [M, K / 32].
inline void group_sums(const float* x, int64_t M, int64_t K, float* sums) {
  for (int64_t i = 0; i < M * (K / kGroup); ++i) {
    float sum = 0.0f;
    for (int64_t c = 0; c < kGroup; ++c) sum += x[i * kGroup + c];
    sums[i] = sum;
  }
}

// out[:, 16 b : 16 b + 16] for the blocks b in [first_block, end_block) and every row of x:
// [M, K] (xsum: group_sums of x) -> out: [M, N]. values, scale_offset: the whole packed weight.
inline void gemv_blocks(const BlockFn* fns, const uint32_t* values, const uint32_t* scale_offset, const float* x,
                        const float* xsum, int64_t M, int64_t K, int64_t N, float* out, int64_t first_block,
                        int64_t end_block) {
  for (int64_t b = first_block; b < end_block; ++b)
    for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxRows)
      fns[std::min(kGemvMaxRows, M - m0) - 1](values + b * (K / 8) * kGemvChannels,
                                               scale_offset + b * (K / kGroup) * kGemvChannels, x + m0 * K,
                                               xsum + m0 * (K / kGroup), K, N, out + m0 * N + b * kGemvChannels);
}

}  // namespace int4
}  // namespace tandem_cpu
