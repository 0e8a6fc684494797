// Paged decode attention on the CPU: the torch binding. It cuts the batch into work items
// (sequence, range of context tokens), runs the hot loop of
// paged_decode_attention_cpu_loop.cpp on them with torch's own threads (at::parallel_for), and
// merges the items of a split context by log-sum-exp (flash-decoding), so that both cores are
// busy even at batch 1.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "paged_decode_attention_cpu_items.h"

using tandem_cpu::AttentionCall;
using tandem_cpu::AttentionItem;
using tandem_cpu::kMaxGroup;
using tandem_cpu::kMaxHeadDim;

// q: [num_seqs, num_heads, head_dim] float32/bfloat16
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim] float32/bfloat16 (either with
// either query dtype: a bfloat16 cache under float32 activations reads half the bytes)
// block_tables: [num_seqs, max_blocks] int64; context_lens: [num_seqs] int64, on the host
// min_split: fewest context tokens per work item (0: no context splitting)
// returns: [num_seqs, num_heads, head_dim], q's dtype
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens,
                                     double scale, int64_t min_split) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(v_cache.dtype() == k_cache.dtype(), "k_cache and v_cache differ in dtype");
  for (const auto* t : {&q, &k_cache})
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16, "float32 or bfloat16 only");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.strides() == v_cache.strides(), "k_cache and v_cache strides differ");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && d <= kMaxHeadDim && d % 16 == 0,
              "head_dim must match the cache's, be a multiple of 16 and at most 256");
  TORCH_CHECK(num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= kMaxGroup, "bad GQA group");
  auto tables = block_tables.to(at::kLong).contiguous();
  auto lens_t = context_lens.to(at::kLong).contiguous();
  const int64_t* lens = lens_t.data_ptr<int64_t>();
  const int64_t* table0 = tables.data_ptr<int64_t>();
  const int64_t table_width = tables.size(1);

  for (int64_t s = 0; s < num_seqs; ++s)
    TORCH_CHECK(lens[s] <= table_width * block_size, "context longer than its block table");
  std::vector<AttentionItem> items;
  const int64_t num_slots = tandem_cpu::plan_items(lens, num_seqs, block_size, min_split, at::get_num_threads(),
                                                   items);

  auto q32 = q.to(at::kFloat).contiguous();
  auto out32 = at::zeros({num_seqs, num_heads, d}, q32.options());  // zeros: empty contexts
  auto part = at::empty({num_slots, num_heads, d + 2}, q32.options());
  const AttentionCall call{q32.data_ptr<float>(), num_heads * d, num_heads, num_kv_heads, d,
                           static_cast<float>(scale), static_cast<const char*>(k_cache.data_ptr()),
                           static_cast<const char*>(v_cache.data_ptr()),
                           k_cache.stride(2) * static_cast<int64_t>(k_cache.element_size()),
                           {k_cache.stride(0), k_cache.stride(1), block_size}, table0, table_width,
                           tandem_cpu::pick_range_fn(k_cache.scalar_type() == at::kBFloat16).first,
                           out32.data_ptr<float>(), part.data_ptr<float>()};
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(num_heads * d), m(num_heads), l(num_heads);
    for (int64_t i = lo; i < hi; ++i) tandem_cpu::attend_item(call, items[i], acc.data(), m.data(), l.data());
  });
  for (const AttentionItem& it : items)  // one sequence's slots are consecutive, from its first item
    if (it.slot >= 0 && it.begin == 0)
      for (int64_t h = 0; h < num_heads; ++h) tandem_cpu::merge_split(call, it, h);
  return q.scalar_type() == at::kFloat ? out32 : out32.to(q.scalar_type());
}

// The instruction set the hot loop runs with here: "avx512", "avx2" or "baseline".
std::string isa() { return tandem_cpu::pick_range_fn(false).second; }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("isa", &isa, "the instruction set the kernel picked");
}
