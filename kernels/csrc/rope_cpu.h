// Rotary position embedding of one float32 head, in place, as transformers computes it:
// x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for the halves x1, x2. Each
// product and the sum rounded in float32 in that order (built with -ffp-contract=off: no fused
// multiply-add), so the result is torch's to the bit.
#pragma once

#include <cstdint>

namespace tandem_cpu {

constexpr int64_t kMaxRopeHeadDim = 256;

inline void rope_head(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  float in[kMaxRopeHeadDim];
  for (int64_t i = 0; i < d; ++i) in[i] = x[i];
  for (int64_t i = 0; i < half; ++i) x[i] = in[i] * cos[i] + (-in[i + half]) * sin[i];
  for (int64_t i = half; i < d; ++i) x[i] = in[i] * cos[i] + in[i - half] * sin[i];
}

}  // namespace tandem_cpu
