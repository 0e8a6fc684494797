// A greedy row's token and its log-probability on the CPU, two passes over the row where torch
// takes six (argmax; then logsumexp's max, subtract, exp, sum, log; then the gather), each
// with its own dispatch and thread wake-up: ~0.3 ms a decode step at a 49k vocabulary on the
// 2-core machine against ~20 us here. Its torch reference is Sampler.sample_on_device's
// greedy path (tandem/engine/sampler.py).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "exp_cpu.h"

namespace tandem_cpu {
namespace greedy {

constexpr int kLanes = 16;
typedef float F __attribute__((vector_size(kLanes * 4)));
typedef int32_t I __attribute__((vector_size(kLanes * 4)));

// The index of the first largest value of x[0, n) (n < 2^31), as torch.argmax gives it: a NaN
// counts as the largest, and the first one wins.
__attribute__((target_clones("avx512f", "avx2", "default"))) inline int64_t argmax_row(const float* x, int64_t n) {
  int64_t i = 0, best_at = 0;
  float best = -std::numeric_limits<float>::infinity();
  bool any_nan = false;
  if (n >= kLanes) {
    F best_v, v;
    std::memcpy(&best_v, x, sizeof(best_v));
    I index_v, at_v;
    for (int l = 0; l < kLanes; ++l) index_v[l] = l;
    at_v = index_v;
    I nan_v = best_v != best_v;
    for (i = kLanes; i + kLanes <= n; i += kLanes) {
      std::memcpy(&v, x + i, sizeof(v));
      at_v += kLanes;
      const I larger = v > best_v;  // strict: each lane keeps its first largest
      best_v = larger ? v : best_v;
      index_v = larger ? at_v : index_v;
      nan_v |= v != v;
    }
    for (int l = 0; l < kLanes; ++l) any_nan |= nan_v[l] != 0;
    best = best_v[0];
    best_at = index_v[0];
    for (int l = 1; l < kLanes; ++l)
      if (best_v[l] > best || (best_v[l] == best && index_v[l] < best_at)) best = best_v[l], best_at = index_v[l];
  }
  for (; i < n; ++i) {
    any_nan |= x[i] != x[i];
    if (x[i] > best || i == 0) best = x[i], best_at = i;
  }
  if (any_nan)
    for (int64_t j = 0; j < n; ++j)
      if (x[j] != x[j]) return j;
  return best_at;
}

// log(sum(exp(x[0, n)))) in float32, as torch.logsumexp computes it: the largest value, plus
// the log of the sum of exp(x - largest) (each term clamped at exp(-87): 1e-38, nothing beside
// the largest's 1). -inf for a row of -inf; NaN where x holds a NaN.
__attribute__((target_clones("avx512f", "avx2", "default"))) inline float logsumexp_row(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  F v, m_v = F{} + m;
  for (; i + kLanes <= n; i += kLanes) {
    std::memcpy(&v, x + i, sizeof(v));
    m_v = v > m_v ? v : m_v;
  }
  for (int l = 0; l < kLanes; ++l) m = m_v[l] > m ? m_v[l] : m;
  for (int64_t j = i; j < n; ++j) m = x[j] > m ? x[j] : m;
  if (m == -std::numeric_limits<float>::infinity()) return m;
  const F lo = F{} - 87.0f;
  F sum_v = F{};
  for (i = 0; i + kLanes <= n; i += kLanes) {
    std::memcpy(&v, x + i, sizeof(v));
    F d = v - m;
    d = d < lo ? lo : d;  // (a NaN stays NaN, and so does the sum)
    sum_v += exp_lanes<F, I>(d);
  }
  float sum = 0.0f;
  for (int l = 0; l < kLanes; ++l) sum += sum_v[l];
  for (; i < n; ++i) sum += exp_in_range(x[i] - m < -87.0f ? -87.0f : x[i] - m);
  return m + std::log(sum);
}

}  // namespace greedy
}  // namespace tandem_cpu
