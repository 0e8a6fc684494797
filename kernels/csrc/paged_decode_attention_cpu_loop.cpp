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
constexpr int64_t kRowChunks = 8;     // vectors of a V row summed in registers at once (head_dim 128 in AVX-512)

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

// out[i] = the sum of v[i]'s lanes, for W vectors: a tree of shuffles and adds across the
// vectors (W - 1 adds of whole vectors), where summing each alone takes log2(W) steps apiece.
TANDEM_INLINE Vec<4>::F sum_each(const Vec<4>::F* v) {
  const Vec<4>::F a = __builtin_shufflevector(v[0], v[1], 0, 1, 4, 5) + __builtin_shufflevector(v[0], v[1], 2, 3, 6, 7);
  const Vec<4>::F b = __builtin_shufflevector(v[2], v[3], 0, 1, 4, 5) + __builtin_shufflevector(v[2], v[3], 2, 3, 6, 7);
  return __builtin_shufflevector(a, b, 0, 2, 4, 6) + __builtin_shufflevector(a, b, 1, 3, 5, 7);
}
TANDEM_INLINE Vec<8>::F sum_each(const Vec<8>::F* v) {
  Vec<8>::F h[4];  // h[p]: v[2p]'s halves summed in lanes 0-3, v[2p + 1]'s in 4-7
  for (int p = 0; p < 4; ++p)
    h[p] = __builtin_shufflevector(v[2 * p], v[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11) +
           __builtin_shufflevector(v[2 * p], v[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15);
  Vec<8>::F q[2];  // q[p]: 2 lanes each of v[4p .. 4p + 3]
  for (int p = 0; p < 2; ++p)
    q[p] = __builtin_shufflevector(h[2 * p], h[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13) +
           __builtin_shufflevector(h[2 * p], h[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(q[0], q[1], 0, 2, 4, 6, 8, 10, 12, 14) +
         __builtin_shufflevector(q[0], q[1], 1, 3, 5, 7, 9, 11, 13, 15);
}
TANDEM_INLINE Vec<16>::F sum_each(const Vec<16>::F* v) {
  Vec<16>::F h[8];  // h[p]: v[2p]'s halves summed in lanes 0-7, v[2p + 1]'s in 8-15
  for (int p = 0; p < 8; ++p)
    h[p] = __builtin_shufflevector(v[2 * p], v[2 * p + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * p], v[2 * p + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                   31);
  Vec<16>::F q[4];  // q[p]: 4 lanes each of v[4p .. 4p + 3]
  for (int p = 0; p < 4; ++p)
    q[p] = __builtin_shufflevector(h[2 * p], h[2 * p + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(h[2 * p], h[2 * p + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  Vec<16>::F e[2];  // e[p]: 2 lanes each of v[8p .. 8p + 7]
  for (int p = 0; p < 2; ++p)
    e[p] = __builtin_shufflevector(q[2 * p], q[2 * p + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(q[2 * p], q[2 * p + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(e[0], e[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(e[0], e[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
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
    for (int64_t g = 0; g < group; ++g) {  // scores: the tile's K rows stay in L1 for the group
      const float* qg = q + g * d;
      for (int64_t i0 = 0; i0 < n; i0 += W) {  // W tokens' dot products, summed across in one go
        F dots[W];
        for (int64_t i = 0; i < W; ++i) {
          const T* kr = k + base + std::min(i0 + i, n - 1) * c.token_stride;  // past n: a row again, unused
          F dot = load<W>(qg) * load<W>(kr);
          for (int64_t j = 1; j < chunks; ++j) dot += load<W>(qg + j * W) * load<W>(kr + j * W);
          dots[i] = dot;
        }
        store<W>(s[g] + i0, sum_each(dots) * scale);
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
    for (int64_t g = 0; g < group; ++g) {  // values: a head's sums in registers over the tile's rows
      float* ag = acc + g * d;
      for (int64_t j0 = 0; j0 < chunks; j0 += kRowChunks) {
        const int64_t nj = std::min(kRowChunks, chunks - j0);
        F a[kRowChunks];
        for (int64_t j = 0; j < nj; ++j) a[j] = load<W>(ag + (j0 + j) * W);
        for (int64_t i = 0; i < n; ++i) {
          const T* vr = v + base + i * c.token_stride + j0 * W;
          for (int64_t j = 0; j < nj; ++j) a[j] += s[g][i] * load<W>(vr + j * W);
        }
        for (int64_t j = 0; j < nj; ++j) store<W>(ag + (j0 + j) * W, a[j]);
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
