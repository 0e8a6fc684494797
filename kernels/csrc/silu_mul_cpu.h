// SwiGLU's product of one float32 row: silu(gate) * up, silu(g) = g / (1 + exp(-g)), each step
// rounded in float32 in torch's order (its exp may differ from this one by an ulp).
#pragma once

#include <cmath>
#include <cstdint>

namespace tandem_cpu {

inline void silu_mul_row(const float* gate, const float* up, float* out, int64_t n) {
  for (int64_t j = 0; j < n; ++j) {
    const float g = gate[j];
    out[j] = g / (1.0f + std::exp(-g)) * up[j];
  }
}

}  // namespace tandem_cpu
