// Activations rounded to 8 bits for the CPU's integer products (int4_q8_gemv_cpu.h,
// int8_q8_gemv_cpu.h), per row and group of 32 columns: d = max |x| / 127, q = round(x / d) in
// int8 (ties to even; |x - d q| <= d / 2), and the group's float32 sum. Needs AVX-512 VNNI.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_gemv.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define TANDEM_HAS_Q8_GEMV 1
#endif

namespace tandem_cpu {
namespace q8 {

constexpr int64_t kGroup = 32;  // columns per activation scale

// Whether the CPU runs the 8-bit products (AVX-512 with VNNI).
inline bool cpu_has_int8_dot() {
#ifdef TANDEM_HAS_Q8_GEMV
  __builtin_cpu_init();
  return detect_isa() == Isa::kAvx512 && __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

// Where column c of 8 goes: as stored (int8 weights' lanes hold 4 consecutive columns), or the
// int4 lanes' nibble order, columns 0, 2, 4, 6 then 1, 3, 5, 7.
enum class Order { kNatural, kNibbles };

// x: [M, K] -> q: [M, K] int8 in `order`; scale, xsum: [M, K / 32].
template <Order order>
inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* scale, float* xsum) {
  for (int64_t i = 0; i < M * (K / kGroup); ++i) {
    const float* xg = x + i * kGroup;
    float amax = 0.0f, sum = 0.0f;
    for (int64_t c = 0; c < kGroup; ++c) {
      amax = std::max(amax, std::fabs(xg[c]));
      sum += xg[c];
    }
    const float d = amax / 127.0f, inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int64_t c = 0; c < kGroup; ++c) {
      const int64_t at = order == Order::kNatural ? c : (c & ~7) + (c & 1) * 4 + (c & 7) / 2;
      q[i * kGroup + at] = static_cast<int8_t>(std::nearbyint(xg[c] * inv));
    }
    scale[i] = d;
    xsum[i] = sum;
  }
}

}  // namespace q8
}  // namespace tandem_cpu
