// SwiGLU's product of one float32 row: silu(gate) * up, silu(g) = g / (1 + exp(-g)), with
// exp_cpu.h's exp (within about 1 ulp of torch's vectorised one; below -88, where the true
// value is under 1e-36, -0 as torch gives from about -88.7). Four lanes at a time (baseline
// x86-64 vectors: the loop is compiled once, for every CPU). The eager layer kernel
// (layer_ops_cpu.cpp) and the compiled decode step (decode_step_cpu.cpp) both run this, so
// the two paths agree to the bit.
#pragma once

#include <cstdint>
#include <cstring>

#include "exp_cpu.h"

namespace tandem_cpu {

template <typename F, typename I> inline __attribute__((always_inline)) F silu_lanes(F g) {
  const F lo = F{} - 87.0f, hi = F{} + 88.0f;  // every lane
  F e = -g;
  e = e < lo ? lo : e;
  e = e > hi ? hi : e;
  const F silu = g / (1.0f + exp_lanes<F, I>(e));
  return g < -88.0f ? g * 0.0f : silu;  // past exp's range torch's exp is inf: silu is -0
}

inline void silu_mul_row(const float* gate, const float* up, float* dst, int64_t n) {
  typedef float F4 __attribute__((vector_size(16)));
  typedef int32_t I4 __attribute__((vector_size(16)));
  typedef float F1 __attribute__((vector_size(4)));
  typedef int32_t I1 __attribute__((vector_size(4)));
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    F4 g, u;
    std::memcpy(&g, gate + i, sizeof(g));
    std::memcpy(&u, up + i, sizeof(u));
    const F4 out = silu_lanes<F4, I4>(g) * u;
    std::memcpy(dst + i, &out, sizeof(out));
  }
  for (; i < n; ++i) {
    const F1 g = {gate[i]};
    dst[i] = silu_lanes<F1, I1>(g)[0] * up[i];
  }
}

}  // namespace tandem_cpu
