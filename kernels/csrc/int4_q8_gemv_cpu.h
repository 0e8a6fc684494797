// The int4 products of int4_gemv_cpu.h with the activations rounded to 8 bits, for CPUs with
// AVX-512 VNNI: one `vpdpbusd` multiplies 16 channels by 4 columns in integers and adds them up,
// where the float32 loop spends a shift, a table lookup and a multiply-add per 16 weights and
// row. That float loop is bound by its instructions at one row (29-31 GB/s of a 32 GB/s copy;
// 17-22 before the lookup) and by its multiply-adds at 8; this one reads the weight at its
// bytes' pace. llama.cpp's CPU products work the same way (Q8_1 activations).
//
// The activations (q8_activations_cpu.h), per row and group of 32 columns: d = max |x| / 127,
// q = round(x / d) in int8 (ties to even), and sum(x) kept in float32 for the offset term:
//
//   out[m, n] = sum_g scale[n, g] * d[m, g] * sum_{i in g} w[n, i] * q[m, i]  +  offset[n, g] * xsum[m, g]
//
// Each |x - d q| <= d / 2: tests/kernels/test_int4_gemv_cpu.py bounds the product by it.
// The weight is int4_gemv_cpu.h's packed layout as it is: the low nibbles of a lane's 4 bytes
// are columns 0, 2, 4, 6 of its 8, the high ones 1, 3, 5, 7, so the activations are stored in
// that order (kNibbleOrder), and one 4-byte broadcast meets each half.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_gemv.h"
#include "int4_gemv_cpu.h"
#include "q8_activations_cpu.h"

namespace tandem_cpu {
namespace int4_q8 {

using int4::kGroup;

#ifdef TANDEM_HAS_Q8_GEMV
// A block of 16 channels (one vector) against R rows. values, scale_offset: the block's packed
// words; q: [R, K]; scale, xsum: [R, K / 32]; out: R rows of stride N, at the block's first channel.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma"))) void block(
    const uint32_t* values, const uint32_t* scale_offset, const int8_t* q, const float* scale, const float* xsum,
    int64_t K, int64_t N, float* out) {
  constexpr int P = R <= 2 ? 2 : 1;  // independent integer sums a row, so the dot products overlap
  const int64_t groups = K / kGroup;
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i so = _mm512_loadu_si512(scale_offset + g * kGemvChannels);
    const __m512 w_scale = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(so));
    const __m512 w_offset = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(so, 16)));
    __m512i dots[R][P];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) dots[r][p] = _mm512_setzero_si512();
    for (int l = 0; l < kGroup / 8; ++l) {
      const __m512i lanes = _mm512_loadu_si512(values + (g * (kGroup / 8) + l) * kGemvChannels);
      const __m512i even = _mm512_and_si512(lanes, nibble), odd = _mm512_and_si512(_mm512_srli_epi32(lanes, 4), nibble);
      for (int r = 0; r < R; ++r) {
        int32_t lo, hi;
        std::memcpy(&lo, q + r * K + g * kGroup + l * 8, 4);
        std::memcpy(&hi, q + r * K + g * kGroup + l * 8 + 4, 4);
        __m512i& dot = dots[r][l % P];
        dot = _mm512_dpbusd_epi32(dot, even, _mm512_set1_epi32(lo));
        dot = _mm512_dpbusd_epi32(dot, odd, _mm512_set1_epi32(hi));
      }
    }
    for (int r = 0; r < R; ++r) {
      __m512i dot = dots[r][0];
      for (int p = 1; p < P; ++p) dot = _mm512_add_epi32(dot, dots[r][p]);
      const __m512 d = _mm512_mul_ps(w_scale, _mm512_set1_ps(scale[r * groups + g]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc[r]);
      acc[r] = _mm512_fmadd_ps(w_offset, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * N, acc[r]);
}

using BlockFn = void (*)(const uint32_t*, const uint32_t*, const int8_t*, const float*, const float*, int64_t,
                         int64_t, float*);
inline const BlockFn* blocks() {
  static const BlockFn table[] = TANDEM_ROWS_TABLE(block);
  return table;
}

// out[:, 16 b : 16 b + 16] for the blocks b in [first_block, end_block) and every row of the
// quantized activations (quantize_rows) -> out: [M, N]. values, scale_offset: the whole packed weight.
inline void gemv_blocks(const uint32_t* values, const uint32_t* scale_offset, const int8_t* q, const float* scale,
                        const float* xsum, int64_t M, int64_t K, int64_t N, float* out, int64_t first_block,
                        int64_t end_block) {
  const BlockFn* fns = blocks();
  const int64_t groups = K / kGroup;
  for (int64_t b = first_block; b < end_block; ++b)
    for (int64_t m0 = 0; m0 < M; m0 += kGemvMaxRows)
      fns[std::min(kGemvMaxRows, M - m0) - 1](values + b * (K / 8) * kGemvChannels,
                                               scale_offset + b * groups * kGemvChannels, q + m0 * K,
                                               scale + m0 * groups, xsum + m0 * groups, K, N,
                                               out + m0 * N + b * kGemvChannels);
}
#endif

}  // namespace int4_q8
}  // namespace tandem_cpu
