// Paged decode attention on the CPU, reading the K/V blocks in place through the block table:
// the hot loop (the torch binding, work split and merge are in paged_decode_attention_cpu.cpp).
//
// One query token per sequence. Work items are (sequence, KV head, range of context tokens):
// each item loads its GQA group's query heads once, then streams its K and V rows exactly once
// (every row serves all query heads of the group), with an online softmax over tiles of up to
// kTile tokens. Long contexts are split into several items (flash-decoding), whose partial
// results are merged by log-sum-exp, so that both cores are busy even at batch 1.
//
// The hot loop is written with GCC/Clang vector extensions, compiled three times (AVX-512,
// AVX2+FMA, baseline x86-64) and picked at run time from the CPU's features, so the cached build
// never uses an instruction the machine lacks (no -march=native), and specialised for head_dim
// 64 and 128.
#include "paged_decode_attention_cpu.h"

#include "exp_cpu.h"

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>

#define TANDEM_INLINE inline __attribute__((always_inline))

namespace tandem_cpu {
namespace {

constexpr int64_t kTile = 16;         // tokens scored together before one softmax update

// exp(x) for x <= 0 (about 1 ulp), for single values; exp_nonpositive below is the same lane
// by lane. Below -87 it gives ~1e-38, not 0.
TANDEM_INLINE float exp_scalar(float x) { return exp_in_range(std::max(x, -87.0f)); }

// W floats as one GCC/Clang vector (W = 16, 8, 4: one zmm, ymm or xmm register in the
// AVX-512, AVX2 and baseline versions). Explicit vectors give the dot products and the softmax
// sums tree reductions: an `omp simd` reduction ends in a serial chain of scalar adds, which
// dominated the loop.
template <int W> struct Vec;
template <> struct Vec<16> {
  typedef float F __attribute__((vector_size(64)));
  typedef uint16_t H __attribute__((vector_size(32)));
  typedef int32_t I __attribute__((vector_size(64)));
};
template <> struct Vec<8> {
  typedef float F __attribute__((vector_size(32)));
  typedef uint16_t H __attribute__((vector_size(16)));
  typedef int32_t I __attribute__((vector_size(32)));
};
template <> struct Vec<4> {
  typedef float F __attribute__((vector_size(16)));
  typedef uint16_t H __attribute__((vector_size(8)));
  typedef int32_t I __attribute__((vector_size(16)));
};

template <int W> TANDEM_INLINE typename Vec<W>::F load(const float* p) {
  typename Vec<W>::F x;
  std::memcpy(&x, p, sizeof(x));
  return x;
}

template <int W> TANDEM_INLINE typename Vec<W>::F load(const uint16_t* p) {
  // bfloat16 bits are the high half of a float32's
  typename Vec<W>::H h;
  std::memcpy(&h, p, sizeof(h));
  const typename Vec<W>::I w = __builtin_convertvector(h, typename Vec<W>::I) << 16;
  typename Vec<W>::F x;
  std::memcpy(&x, &w, sizeof(x));
  return x;
}

template <int W> TANDEM_INLINE void store(float* p, typename Vec<W>::F x) { std::memcpy(p, &x, sizeof(x)); }

TANDEM_INLINE float hsum(Vec<4>::F x) { return (x[0] + x[2]) + (x[1] + x[3]); }
TANDEM_INLINE float hsum(Vec<8>::F x) {
  return hsum(__builtin_shufflevector(x, x, 0, 1, 2, 3) + __builtin_shufflevector(x, x, 4, 5, 6, 7));
}
TANDEM_INLINE float hsum(Vec<16>::F x) {
  return hsum(__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
              __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15));
}

// exp_nonpositive, lane by lane.
template <int W> TANDEM_INLINE typename Vec<W>::F exp_nonpositive(typename Vec<W>::F x) {
  const typename Vec<W>::F lo = x * 0.0f - 87.0f;
  return exp_lanes<typename Vec<W>::F, typename Vec<W>::I>(x < lo ? lo : x);
}

// RangeFn's body (see the header), W lanes wide. D: head_dim known at compile time (fully
// unrolled rows), or 0 to use d_arg.
template <int W, int D, typename T>
TANDEM_INLINE void attend_range(const float* q, int64_t group, int64_t d_arg, float scale, const T* k,
                                const T* v, CacheView c, const int64_t* table, int64_t begin,
                                int64_t end, float* acc, float* m, float* l) {
  using F = typename Vec<W>::F;
  alignas(64) float s[kMaxGroup][kTile];
  const int64_t d = D > 0 ? D : d_arg;
  const int64_t chunks = d / W;
  for (int64_t t0 = begin; t0 < end;) {
    // A tile never crosses a block: its rows are at a fixed stride from one base.
    const int64_t off = t0 % c.block_size;
    const int64_t n = std::min({kTile, c.block_size - off, end - t0});
    const int64_t base = table[t0 / c.block_size] * c.block_stride + off * c.token_stride;
    for (int64_t i = 0; i < n; ++i) {  // scores: each K row read once for the whole group
      const T* kr = k + base + i * c.token_stride;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * d;
        F dot = load<W>(qg) * load<W>(kr);
        for (int64_t j = 1; j < chunks; ++j) dot += load<W>(qg + j * W) * load<W>(kr + j * W);
        s[g][i] = hsum(dot) * scale;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      // Lanes past n hold -FLT_MAX: exp gives them ~1e-38, nothing next to the maximum's 1,
      // and the V loop below never reads them.
      for (int64_t i = n; i < kTile; ++i) s[g][i] = -FLT_MAX;
      F vmax = load<W>(s[g]);
      for (int64_t i = W; i < kTile; i += W) {
        const F x = load<W>(s[g] + i);
        vmax = x > vmax ? x : vmax;
      }
      float mx = m[g];
      for (int64_t j = 0; j < W; ++j) mx = std::max(mx, vmax[j]);
      if (mx > m[g]) {  // rescale what came before to the new maximum
        const float alpha = exp_scalar(m[g] - mx);
        l[g] *= alpha;
        float* ag = acc + g * d;
        for (int64_t j = 0; j < chunks; ++j) store<W>(ag + j * W, load<W>(ag + j * W) * alpha);
        m[g] = mx;
      }
      F sum = load<W>(s[g]) * 0.0f;
      for (int64_t i = 0; i < kTile; i += W) {
        const F p = exp_nonpositive<W>(load<W>(s[g] + i) - mx);
        store<W>(s[g] + i, p);
        sum += p;
      }
      l[g] += hsum(sum);
    }
    for (int64_t i = 0; i < n; ++i) {  // values: each V row read once for the whole group
      const T* vr = v + base + i * c.token_stride;
      for (int64_t j = 0; j < chunks; ++j) {
        const F x = load<W>(vr + j * W);
        for (int64_t g = 0; g < group; ++g) {
          float* a = acc + g * d + j * W;
          store<W>(a, load<W>(a) + s[g][i] * x);
        }
      }
    }
    t0 += n;
  }
}

// One entry point per (ISA, dtype): the always-inline body is compiled for the caller's target.
#define TANDEM_RANGE_FN(NAME, TARGET, W, T)                                                      \
  TARGET void NAME(const float* q, int64_t group, int64_t d, float scale, const void* k,        \
                   const void* v, CacheView c, const int64_t* table, int64_t begin, int64_t end, \
                   float* acc, float* m, float* l) {                                            \
    const auto kt = static_cast<const T*>(k);                                                   \
    const auto vt = static_cast<const T*>(v);                                                   \
    if (d == 64)                                                                                \
      attend_range<W, 64, T>(q, group, d, scale, kt, vt, c, table, begin, end, acc, m, l);      \
    else if (d == 128)                                                                          \
      attend_range<W, 128, T>(q, group, d, scale, kt, vt, c, table, begin, end, acc, m, l);     \
    else                                                                                        \
      attend_range<W, 0, T>(q, group, d, scale, kt, vt, c, table, begin, end, acc, m, l);       \
  }

TANDEM_RANGE_FN(range_f32_base, , 4, float)
TANDEM_RANGE_FN(range_bf16_base, , 4, uint16_t)
#if defined(__x86_64__) && defined(__GNUC__)
#define TANDEM_AVX2 __attribute__((target("avx2,fma")))
#define TANDEM_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
TANDEM_RANGE_FN(range_f32_avx2, TANDEM_AVX2, 8, float)
TANDEM_RANGE_FN(range_bf16_avx2, TANDEM_AVX2, 8, uint16_t)
TANDEM_RANGE_FN(range_f32_avx512, TANDEM_AVX512, 16, float)
TANDEM_RANGE_FN(range_bf16_avx512, TANDEM_AVX512, 16, uint16_t)
#endif

}  // namespace

// -> the widest version this CPU runs, and its name.
std::pair<RangeFn, const char*> pick_range_fn(bool bf16) {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
    return {bf16 ? range_bf16_avx512 : range_f32_avx512, "avx512"};
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return {bf16 ? range_bf16_avx2 : range_f32_avx2, "avx2"};
#endif
  return {bf16 ? range_bf16_base : range_f32_base, "baseline"};
}

float exp_nonpositive(float x) { return exp_scalar(x); }

}  // namespace tandem_cpu
