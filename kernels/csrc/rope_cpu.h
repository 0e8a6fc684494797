// Rotary position embedding of one float32 head, in place, as transformers computes it:
// x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for the halves x1, x2. Each
// product and the sum rounded in float32 in that order (baseline x86-64 code has no fused
// multiply-add, and the layer kernels are built with -ffp-contract=off too), so the result is
// torch's to the bit. Then a token's keys and values into their cache slot, float32 or
// bfloat16 (rounded to nearest even, as torch's conversion).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace tandem_cpu {

constexpr int64_t kMaxRopeHeadDim = 256;

inline void rope_head(float* x, const float* cos, const float* sin, int64_t d) {
  const int64_t half = d / 2;
  float in[kMaxRopeHeadDim];
  for (int64_t i = 0; i < d; ++i) in[i] = x[i];
  for (int64_t i = 0; i < half; ++i) x[i] = in[i] * cos[i] + (-in[i + half]) * sin[i];
  for (int64_t i = half; i < d; ++i) x[i] = in[i] * cos[i] + in[i - half] * sin[i];
}

// float32 -> bfloat16 bits, rounded to nearest even (NaN stays a quiet NaN): c10::BFloat16's.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline void store_row(const float* src, float* dst, int64_t n) { std::copy(src, src + n, dst); }
inline void store_row(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits(src[i]);
}

// One token: RoPE on its q and k heads in place, then its k and v heads into the caches at
// element offset `at` (the slot's), KV heads `head_stride` apart. row: [(num_heads + 2 *
// num_kv_heads) * d] (q heads, k heads, v heads); cos, sin: [d], the token's position's.
// T: float (a float32 cache) or uint16_t (bfloat16 bits).
template <typename T>
inline void rope_store_token(float* row, const float* cos, const float* sin, int64_t num_heads, int64_t num_kv_heads,
                             int64_t d, T* k_cache, T* v_cache, int64_t at, int64_t head_stride) {
  for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) rope_head(row + h * d, cos, sin, d);
  const float* k = row + num_heads * d;
  const float* v = k + num_kv_heads * d;
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    store_row(k + h * d, k_cache + at + h * head_stride, d);
    store_row(v + h * d, v_cache + at + h * head_stride, d);
  }
}

}  // namespace tandem_cpu
