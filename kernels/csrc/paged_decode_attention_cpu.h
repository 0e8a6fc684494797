// Shared by the two halves of the CPU paged decode attention kernel: the hot loop
// (paged_decode_attention_cpu_loop.cpp, no torch headers) and its torch binding
// (paged_decode_attention_cpu.cpp). kernels/paged_decode_attention_cpu.py puts this file's hash
// into the build flags, since torch's JIT cache hashes the sources only.
#pragma once

#include <cstdint>
#include <utility>

namespace tandem_cpu {

constexpr int64_t kMaxGroup = 16;     // query heads per KV head
constexpr int64_t kMaxHeadDim = 256;

// Where one KV head's cache lives: element strides of the cache's block and token dims.
struct CacheView {
  int64_t block_stride, token_stride, block_size;
};

// Attention of one (sequence, KV head) over tokens [begin, end) of its context, continuing an
// online softmax. q: [group, d] float32 (d a multiple of 16); table: the sequence's block ids;
// k, v: the cache at this KV head (float32 or bfloat16 bits). Updates acc: [group, d] (not
// normalised), m: [group] running max of the scores, l: [group] sum of their exp (start them
// at 0, -FLT_MAX, 0).
using RangeFn = void (*)(const float* q, int64_t group, int64_t d, float scale, const void* k,
                         const void* v, CacheView c, const int64_t* table, int64_t begin,
                         int64_t end, float* acc, float* m, float* l);

// -> the widest version this CPU runs ("avx512", "avx2" or "baseline") for the cache's dtype.
std::pair<RangeFn, const char*> pick_range_fn(bool bf16);

// exp(x) for x <= 0, about 1 ulp (the merge of split contexts uses it too).
float exp_nonpositive(float x);

}  // namespace tandem_cpu
