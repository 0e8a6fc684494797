// The int8 products of int8_gemv_cpu.h with the activations rounded to 8 bits
// (q8_activations_cpu.h, natural column order), for CPUs with AVX-512 VNNI. The float loop
// spends a multiply-add per 16 weights and row, so the LM head at 8 rows or more is bound by
// them; `vpdpbusd` multiplies 16 channels by 4 columns in one instruction.
//
// `vpdpbusd` takes unsigned bytes against signed ones, so the weight's bytes are read as
// w + 128 (one xor), and what that adds, 128 * sum(q) per group, is taken off once per row:
//
//   out[m, n] = scale[n] * (sum_g d[m, g] * sum_{i in g} (w[n, i] + 128) * q[m, i]  -  c[m]),
//   c[m] = 128 * sum_g d[m, g] * sum_{i in g} q[m, i]
//
// The weight is int8_gemv_cpu.h's packed layout as it is (a lane's 4 bytes: 4 consecutive columns).
#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_gemv.h"
#include "q8_activations_cpu.h"

namespace tandem_cpu {
namespace int8_q8 {

using q8::kGroup;

// c: [M] (see above) of the rounded activations q: [M, K] with their scales: [M, K / 32].
inline void offset_terms(const int8_t* q, const float* scale, int64_t M, int64_t K, float* c) {
  const int64_t groups = K / kGroup;
  for (int64_t m = 0; m < M; ++m) {
    float sum = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t qsum = 0;
      for (int64_t i = 0; i < kGroup; ++i) qsum += q[m * K + g * kGroup + i];
      sum += scale[m * groups + g] * static_cast<float>(qsum);
    }
    c[m] = 128.0f * sum;
  }
}

#ifdef TANDEM_HAS_Q8_GEMV
// A block of 16 channels against R rows. values: the block's packed words; w_scale: its 16
// scales; q: [R, K]; scale: [R, K / 32]; c: [R]; out: R rows of stride N, at the block's first channel.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"))) void block(
    const int32_t* values, const float* w_scale, const int8_t* q, const float* scale, const float* c, int64_t K,
    int64_t N, float* out) {
  constexpr int P = R <= 2 ? 2 : 1;  // independent integer sums a row, so the dot products overlap
  const int64_t groups = K / kGroup;
  const __m512i to_unsigned = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dots[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) dots[r][p] = _mm512_setzero_si512();
    for (int l = 0; l < kGroup / 4; ++l) {
      const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(values + (g * (kGroup / 4) + l) * kGemvChannels),
                                         to_unsigned);
      for (int r = 0; r < R; ++r) {
        int32_t x4;
        std::memcpy(&x4, q + r * K + g * kGroup + l * 4, 4);
        dots[r][l % P] = _mm512_dpbusd_epi32(dots[r][l % P], w, _mm512_set1_epi32(x4));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512i dot = dots[r][0];
      for (int p = 1; p < P; ++p) dot = _mm512_add_epi32(dot, dots[r][p]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(scale[r * groups + g]), acc[r]);
    }
  }
  const __m512 s = _mm512_loadu_ps(w_scale);
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * N, _mm512_mul_ps(_mm512_sub_ps(acc[r], _mm512_set1_ps(c[r])), s));
}

using BlockFn = void (*)(const int32_t*, const float*, const int8_t*, const float*, const float*, int64_t, int64_t,
                         float*);
inline const BlockFn* blocks() {
  static const BlockFn table[] = TANDEM_ROWS_TABLE(block);
  return table;
}

// out[:, 16 b : 16 b + 16] for the blocks b in [first_block, end_block) and every row of the
// rounded activations (q, scale; c: offset_terms) -> out: [M, N]. values, w_scale: the whole packed weight.
inline void gemv_blocks(const int32_t* values, const float* w_scale, const int8_t* q, const float* scale,
                        const float* c, int64_t M, int64_t K, int64_t N, float* out, int64_t first_block,
                        int64_t end_block) {
  const BlockFn* fns = blocks();
  for (int64_t b = first_block; b < end_block; ++b)
    for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxRows)
      fns[std::min(kGemvMaxRows, M - m0) - 1](values + b * (K / 4) * kGemvChannels, w_scale + b * kGemvChannels,
                                               q + m0 * K, scale + m0 * (K / kGroup), c + m0, K, N,
                                               out + m0 * N + b * kGemvChannels);
}
#endif

}  // namespace int8_q8
}  // namespace tandem_cpu
