// The work of one paged decode attention call, as items any thread may take: the torch binding
// (paged_decode_attention_cpu.cpp) runs them with torch's threads, the compiled decode step
// (decode_step_cpu.cpp) inside its own parallel region. Items are (sequence, range of context
// tokens), all KV heads; a sequence split over several items leaves partials that merge_split
// combines by log-sum-exp (flash-decoding).
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <vector>

#include "paged_decode_attention_cpu.h"

namespace tandem_cpu {

// Tokens of one KV head attended before moving to the next head: the heads of a token are
// side by side in the cache, so walking them together in short steps streams each block's
// memory in order (about 1.4x the bandwidth of one head's strided rows at a time, measured).
constexpr int64_t kHeadStep = 64;

struct AttentionItem {
  int64_t seq, begin, end;
  int64_t slot;    // its partial's row, or -1 to write the output
  int64_t splits;  // items of its sequence
};

// What every item of one call reads and writes.
struct AttentionCall {
  const float* q;        // [num_seqs, ...]: the sequence's query heads at q + seq * q_stride, [num_heads, d]
  int64_t q_stride;
  int64_t num_heads, num_kv_heads, d;
  float scale;
  const char* k;         // the caches at KV head 0: [num_blocks, block_size, num_kv_heads, d]
  const char* v;
  int64_t head_bytes;    // bytes from one KV head to the next
  CacheView cache;
  const int64_t* tables;  // [num_seqs, table_width]
  int64_t table_width;
  RangeFn fn;
  float* out;       // [num_seqs, num_heads, d]
  float* partials;  // [num_slots, num_heads, d + 2]: acc | m | l per query head
};

// Cuts the batch into items. A context longer than min_split is cut into about 4 items per
// thread (at least min_split tokens each, whole blocks), so that the threads share even batch 1.
// The cut depends on the sequence's own length and the thread count only: a sequence's result
// does not change with the batch. Empty contexts get no item. -> the number of partial slots.
inline int64_t plan_items(const int64_t* lens, int64_t num_seqs, int64_t block_size, int64_t min_split,
                          int64_t threads, std::vector<AttentionItem>& items) {
  items.clear();
  int64_t num_slots = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (lens[s] <= 0) continue;  // an empty context attends to nothing: its output stays 0
    int64_t chunk = lens[s];
    if (min_split > 0 && threads > 1 && lens[s] > min_split) {
      chunk = std::max(min_split, (lens[s] + 4 * threads - 1) / (4 * threads));
      chunk = (chunk + block_size - 1) / block_size * block_size;
    }
    const int64_t splits = (lens[s] + chunk - 1) / chunk;
    for (int64_t p = 0; p < splits; ++p)
      items.push_back({s, p * chunk, std::min(lens[s], (p + 1) * chunk), splits > 1 ? num_slots++ : -1, splits});
  }
  return num_slots;
}

// A software prefetch into L2. NOTE: asm volatile, not __builtin_prefetch: GCC 12 at -O2
// deleted prefetch_rows' loop as having no effect when written with the builtin.
inline void prefetch_l2(const char* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Asks for the K and V rows of tokens [begin, end) of a sequence (every KV head) before they
// are read. NOTE: the rows about to be read, not the ones after: asked for at once, their misses
// overlap, where the loop's own loads, a few at a time between its arithmetic, left the memory
// idle (docs/kernels.md: 1.2-1.4x from memory; prefetching the next rows instead did not help).
inline void prefetch_rows(const AttentionCall& c, int64_t seq, int64_t begin, int64_t end) {
  const int64_t elem = c.head_bytes / c.d, block_size = c.cache.block_size;
  for (int64_t t = begin; t < end;) {
    const int64_t n = std::min(end - t, block_size - t % block_size);  // rows of one block: contiguous
    const int64_t offset = (c.tables[seq * c.table_width + t / block_size] * c.cache.block_stride +
                            t % block_size * c.cache.token_stride) * elem;
    const int64_t bytes = n * c.cache.token_stride * elem;
    for (int64_t b = 0; b < bytes; b += 64) {
      prefetch_l2(c.k + offset + b);
      prefetch_l2(c.v + offset + b);
    }
    t += n;
  }
}

// One item: its output rows normalised, or its partial. acc, m, l: scratch of
// [num_heads * d], [num_heads], [num_heads].
inline void attend_item(const AttentionCall& c, const AttentionItem& it, float* acc, float* m, float* l) {
  const int64_t group = c.num_heads / c.num_kv_heads, d = c.d;
  std::fill(acc, acc + c.num_heads * d, 0.0f);
  std::fill(m, m + c.num_heads, -FLT_MAX);
  std::fill(l, l + c.num_heads, 0.0f);
  for (int64_t t = it.begin; t < it.end; t += kHeadStep) {
    prefetch_rows(c, it.seq, t, std::min(it.end, t + kHeadStep));
    for (int64_t h = 0; h < c.num_kv_heads; ++h) {
      const int64_t first = h * group;  // the group's first query head
      c.fn(c.q + it.seq * c.q_stride + first * d, group, d, c.scale, c.k + h * c.head_bytes,
           c.v + h * c.head_bytes, c.cache, c.tables + it.seq * c.table_width, t, std::min(it.end, t + kHeadStep),
           acc + first * d, m + first, l + first);
    }
  }
  for (int64_t h = 0; h < c.num_heads; ++h) {
    if (it.slot < 0) {  // the whole context: normalise straight into the output
      float* o = c.out + (it.seq * c.num_heads + h) * d;
      for (int64_t j = 0; j < d; ++j) o[j] = acc[h * d + j] / l[h];
    } else {
      float* p = c.partials + (it.slot * c.num_heads + h) * (d + 2);
      std::copy(acc + h * d, acc + (h + 1) * d, p);
      p[d] = m[h];
      p[d + 1] = l[h];
    }
  }
}

// Query head h of a split sequence, from its partials (`first`: the sequence's first item, its
// others follow it in the slots): out = sum_p w_p acc_p / sum_p w_p l_p, w_p = exp(m_p - max m).
inline void merge_split(const AttentionCall& c, const AttentionItem& first, int64_t h) {
  const int64_t d = c.d, slot_stride = c.num_heads * (d + 2);
  const float* part0 = c.partials + (first.slot * c.num_heads + h) * (d + 2);
  float mx = -FLT_MAX;
  for (int64_t p = 0; p < first.splits; ++p) mx = std::max(mx, part0[p * slot_stride + d]);
  float* o = c.out + (first.seq * c.num_heads + h) * d;
  std::fill(o, o + d, 0.0f);
  float denom = 0.0f;
  for (int64_t p = 0; p < first.splits; ++p) {
    const float* part = part0 + p * slot_stride;
    const float w = exp_nonpositive(part[d] - mx);
    denom += w * part[d + 1];
    for (int64_t j = 0; j < d; ++j) o[j] += w * part[j];
  }
  for (int64_t j = 0; j < d; ++j) o[j] /= denom;
}

}  // namespace tandem_cpu
