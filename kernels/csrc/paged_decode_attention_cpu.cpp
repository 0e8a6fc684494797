// Paged decode attention on the CPU: the torch binding. It cuts the batch into work items
// (sequence, range of context tokens), runs the hot loop of
// paged_decode_attention_cpu_loop.cpp on them with torch's own threads (at::parallel_for), and
// merges the items of a split context by log-sum-exp (flash-decoding), so that both cores are
// busy even at batch 1.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <vector>

#include "paged_decode_attention_cpu.h"

using tandem_cpu::CacheView;
using tandem_cpu::exp_nonpositive;
using tandem_cpu::kMaxGroup;
using tandem_cpu::kMaxHeadDim;
using tandem_cpu::pick_range_fn;

namespace {

// Tokens of one KV head attended before moving to the next head: the heads of a token are
// side by side in the cache, so walking them together in short steps streams each block's
// memory in order (about 1.4x the bandwidth of one head's strided rows at a time, measured).
constexpr int64_t kHeadStep = 64;

struct Item {
  int64_t seq, begin, end;
  int64_t slot;    // its partial's row, or -1 to write the output
  int64_t splits;  // items of its sequence
};

}  // namespace

// q: [num_seqs, num_heads, head_dim] float32/bfloat16
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype as q
// block_tables: [num_seqs, max_blocks] int64; context_lens: [num_seqs] int64, on the host
// min_split: fewest context tokens per work item (0: no context splitting)
// returns: [num_seqs, num_heads, head_dim], q's dtype
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, int64_t min_split) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.dtype() == q.dtype() && v_cache.dtype() == q.dtype(), "q and the cache differ in dtype");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k_cache and v_cache strides differ");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d <= kMaxHeadDim && d % 16 == 0,
              "head_dim must match the cache's, be a multiple of 16 and at most 256");
  TORCH_CHECK(num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= kMaxGroup, "bad GQA group");
  const int64_t group = num_heads / num_kv_heads;
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens_t = context_lens.to(at::kLong).contiguous();
  const int64_t* lens = lens_t.data_ptr<int64_t>();
  const int64_t* table0 = tables.data_ptr<int64_t>();
  const int64_t table_width = tables.size(1);

  // Items are (sequence, range of context tokens), all KV heads. A context longer than
  // min_split is cut into about 4 items per thread (at least min_split tokens each, whole
  // blocks), so that the threads share even batch 1. The cut depends on the sequence's own
  // length and the thread count only: a sequence's result does not change with the batch.
  const int64_t threads = at::get_num_threads();
  std::vector<Item> items;
  int64_t num_slots = 0;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(lens[s] <= table_width * block_size, "context longer than its block table");
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

  auto q32 = q.to(at::kFloat).contiguous();
  auto out32 = at::zeros({num_seqs, num_heads, d}, q32.options());  // zeros: empty contexts
  auto part = at::empty({num_slots, num_heads, d + 2}, q32.options());  // acc | m | l per query head
  const float* qp = q32.data_ptr<float>();
  float* op = out32.data_ptr<float>();
  float* pp = part.data_ptr<float>();
  const CacheView cv{k_cache.stride(0), k_cache.stride(1), block_size};
  const int64_t head_bytes = k_cache.stride(2) * static_cast<int64_t>(k_cache.element_size());
  const auto fn = pick_range_fn(q.scalar_type() == at::kBFloat16).first;
  const char* kp = static_cast<const char*>(k_cache.data_ptr());
  const char* vp = static_cast<const char*>(v_cache.data_ptr());
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(num_heads * d), m(num_heads), l(num_heads);
    for (int64_t i = lo; i < hi; ++i) {
      const Item& it = items[i];
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -FLT_MAX);
      std::fill(l.begin(), l.end(), 0.0f);
      for (int64_t t = it.begin; t < it.end; t += kHeadStep) {
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const int64_t first = h * group;  // the group's first query head
          fn(qp + (it.seq * num_heads + first) * d, group, d, fscale, kp + h * head_bytes, vp + h * head_bytes,
             cv, table0 + it.seq * table_width, t, std::min(it.end, t + kHeadStep), acc.data() + first * d,
             m.data() + first, l.data() + first);
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        if (it.slot < 0) {  // the whole context: normalise straight into the output
          float* o = op + (it.seq * num_heads + h) * d;
          for (int64_t j = 0; j < d; ++j) o[j] = acc[h * d + j] / l[h];
        } else {
          float* p = pp + (it.slot * num_heads + h) * (d + 2);
          std::copy(acc.begin() + h * d, acc.begin() + (h + 1) * d, p);
          p[d] = m[h];
          p[d + 1] = l[h];
        }
      }
    }
  });

  // Merge the split contexts by log-sum-exp: one sequence's slots are consecutive.
  for (const Item& it : items) {
    if (it.slot < 0 || it.begin != 0) continue;
    const int64_t splits = it.splits;
    const int64_t slot_stride = num_heads * (d + 2);
    for (int64_t h = 0; h < num_heads; ++h) {
      const float* first = pp + (it.slot * num_heads + h) * (d + 2);
      float mx = -FLT_MAX;
      for (int64_t p = 0; p < splits; ++p) mx = std::max(mx, first[p * slot_stride + d]);
      float* o = op + (it.seq * num_heads + h) * d;
      float denom = 0.0f;
      for (int64_t p = 0; p < splits; ++p) {
        const float* part_p = first + p * slot_stride;
        const float w = exp_nonpositive(part_p[d] - mx);
        denom += w * part_p[d + 1];
        for (int64_t j = 0; j < d; ++j) o[j] += w * part_p[j];
      }
      for (int64_t j = 0; j < d; ++j) o[j] /= denom;
    }
  }
  return q.scalar_type() == at::kFloat ? out32 : out32.to(q.scalar_type());
}

// The instruction set the hot loop runs with here: "avx512", "avx2" or "baseline".
std::string isa() { return pick_range_fn(false).second; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("isa", &isa, "the instruction set the kernel picked");
}
