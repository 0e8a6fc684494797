// Shared by the CPU weight-only GEMV kernels (int4_gemv_cpu.h, int8_gemv_cpu.h): vector types,
// the run-time choice of instruction set, and the per-(ISA, rows) dispatch table.
//
// Each kernel writes its loop once, as an always-inline template on the vector width W (16,
// 8, 4 floats: AVX-512, AVX2, baseline x86-64) and the number of activation rows R (1..8),
// then instantiates it per target with TANDEM_GEMV_TABLE, so that no cached build ever uses an
// instruction the machine lacks (no -march=native).
#pragma once

#include <algorithm>
#include <cstdint>

#define TANDEM_INLINE inline __attribute__((always_inline))

namespace tandem_cpu {

constexpr int64_t kGemvChannels = 16;  // output channels interleaved in the packed layouts
constexpr int64_t kGemvMaxRows = 8;    // activation rows per pass over the weight

template <int W> struct GemvVec {
  typedef float F __attribute__((vector_size(4 * W)));
  typedef uint32_t U __attribute__((vector_size(4 * W)));
  typedef int32_t I __attribute__((vector_size(4 * W)));
};

// Independent partial sums per activation row, so that the adds do not wait on each other
// (4-cycle latency): 8 chains in all, fewer with 8 rows (more would spill registers).
template <int R> constexpr int gemv_partials() { return R >= 8 ? 1 : 8 / R; }

enum class Isa { kBaseline, kAvx2, kAvx512 };

inline Isa detect_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kBaseline;
}

inline const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "baseline";
}

}  // namespace tandem_cpu

#define TANDEM_ROWS_TABLE(FN) {FN<1>, FN<2>, FN<3>, FN<4>, FN<5>, FN<6>, FN<7>, FN<8>}

// Defines `FnType TABLE_NAME(Isa)` -> the 8-entry table (rows 1..8) of BODY<W, R> compiled for
// the widest target the CPU runs. BODY: an always-inline template<int W, int R> function with
// signature SIGNATURE (the parameter list) called with ARGS.
#if defined(__x86_64__) && defined(__GNUC__)
#define TANDEM_GEMV_TABLE(TABLE_NAME, FN_TYPE, BODY, SIGNATURE, ARGS)                                  \
  template <int R> void TABLE_NAME##_base SIGNATURE { BODY<4, R> ARGS; }                               \
  template <int R> __attribute__((target("avx2,fma"))) void TABLE_NAME##_avx2 SIGNATURE {              \
    BODY<8, R> ARGS;                                                                                   \
  }                                                                                                    \
  template <int R> __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma"))) void TABLE_NAME##_avx512 \
      SIGNATURE {                                                                                      \
    BODY<16, R> ARGS;                                                                                  \
  }                                                                                                    \
  inline const FN_TYPE* TABLE_NAME(tandem_cpu::Isa isa) {                                                     \
    static const FN_TYPE base[] = TANDEM_ROWS_TABLE(TABLE_NAME##_base);                                \
    static const FN_TYPE avx2[] = TANDEM_ROWS_TABLE(TABLE_NAME##_avx2);                                \
    static const FN_TYPE avx512[] = TANDEM_ROWS_TABLE(TABLE_NAME##_avx512);                            \
    return isa == tandem_cpu::Isa::kAvx512 ? avx512 : isa == tandem_cpu::Isa::kAvx2 ? avx2 : base;     \
  }
#else
#define TANDEM_GEMV_TABLE(TABLE_NAME, FN_TYPE, BODY, SIGNATURE, ARGS)                                  \
  template <int R> void TABLE_NAME##_base SIGNATURE { BODY<4, R> ARGS; }                               \
  inline const FN_TYPE* TABLE_NAME(tandem_cpu::Isa) {                                                         \
    static const FN_TYPE base[] = TANDEM_ROWS_TABLE(TABLE_NAME##_base);                                \
    return base;                                                                                       \
  }
#endif
