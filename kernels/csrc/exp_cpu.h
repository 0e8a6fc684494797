// exp(x) in float32 by range reduction and Cephes' polynomial (about 1 ulp), written without
// calls or branches over GCC/Clang vectors of any width (glibc's expf is a scalar call). Shared
// by the attention's softmax (paged_decode_attention_cpu_loop.cpp) and SwiGLU (silu_mul_cpu.h).
#pragma once

#include <cstdint>
#include <cstring>

namespace tandem_cpu {

// exp of each lane of x, every lane in [-87, 88] (the caller clamps: past them 2^n leaves
// float's exponent range). F: a vector of floats; I: the vector of int32 of its width.
template <typename F, typename I> inline __attribute__((always_inline)) F exp_lanes(F x) {
  const F fx = x * 1.44269504088896341f;
  // Round to nearest by the 1.5 * 2^23 trick (no floor/rint: vectorises without SSE4.1).
  const F n = (fx + 12582912.0f) - 12582912.0f;
  const F r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  F y = r * 1.9875691500e-4f + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return y * scale;
}

// One value: exp_lanes on a vector of one lane (the same arithmetic).
inline __attribute__((always_inline)) float exp_in_range(float x) {
  typedef float F1 __attribute__((vector_size(4)));
  typedef int32_t I1 __attribute__((vector_size(4)));
  const F1 v = {x};
  return exp_lanes<F1, I1>(v)[0];
}

}  // namespace tandem_cpu
