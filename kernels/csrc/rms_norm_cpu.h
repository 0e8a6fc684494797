// RMSNorm of one float32 row, the arithmetic of transformers' LlamaRMSNorm in float32: mean
// of squares, 1 / sqrt(mean + eps), x times that, times weight. The mean is summed in 16
// interleaved partial sums (another order than torch's reduction: within float32 rounding).
#pragma once

#include <cmath>
#include <cstdint>

namespace tandem_cpu {

inline void rms_norm_row(const float* row, const float* weight, float* dst, int64_t H, float eps) {
  constexpr int kLanes = 16;
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= H; i += kLanes)
#pragma omp simd
    for (int j = 0; j < kLanes; ++j) part[j] += row[i + j] * row[i + j];
  float sum = 0.0f;
  for (int j = 0; j < kLanes; ++j) sum += part[j];
  for (; i < H; ++i) sum += row[i] * row[i];
  const float scale = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
#pragma omp simd
  for (int64_t c = 0; c < H; ++c) dst[c] = weight[c] * (row[c] * scale);
}

}  // namespace tandem_cpu
