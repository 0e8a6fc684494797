// The small operations of a float32 layer on the CPU, one call each where torch runs several:
// a decode step runs about twenty of them a layer on a handful of rows, and each torch
// operation costs ~5-10 us of dispatch on the 2-core machine against ~1 us of arithmetic.
// The loops are in the headers (one operation each); this file checks shapes and binds them.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <tuple>

#include "greedy_pick_cpu.h"
#include "rms_norm_cpu.h"
#include "rope_cpu.h"
#include "silu_mul_cpu.h"

namespace {

void check_float32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu(), what, " must be a float32 CPU tensor");
}

// A [rows, H] tensor whose rows are contiguous (a step's activations, or column slices of them).
void check_rows(const torch::Tensor& t, int64_t H, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.size(1) == H && t.stride(1) == 1, what, " must be [rows, ", H, "] with contiguous rows");
}

}  // namespace

// x: [..., H] float32; weight: [H] float32 -> [..., H] float32.
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_float32(x, "rms_norm: x");
  check_float32(weight, "rms_norm: weight");
  const int64_t H = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H, "rms_norm: weight of ", H, " values");
  const auto xc = x.contiguous();
  const auto wc = weight.contiguous();
  auto out = torch::empty_like(xc);
  const int64_t rows = H ? xc.numel() / H : 0;
  for (int64_t r = 0; r < rows; ++r)
    tandem_cpu::rms_norm_row(xc.data_ptr<float>() + r * H, wc.data_ptr<float>(), out.data_ptr<float>() + r * H, H,
                             static_cast<float>(eps));
  return out;
}

// The residual add and the next norm: h += delta (in place), -> rms_norm(h).
// h, delta: [T, H] float32 (h contiguous); weight: [H] float32 -> [T, H] float32.
torch::Tensor add_rms_norm(torch::Tensor h, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_float32(h, "add_rms_norm: h");
  check_float32(delta, "add_rms_norm: delta");
  check_float32(weight, "add_rms_norm: weight");
  TORCH_CHECK(h.is_contiguous() && h.dim() == 2 && delta.sizes() == h.sizes(), "add_rms_norm: h and delta [T, H], h contiguous");
  const int64_t H = h.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.is_contiguous(), "add_rms_norm: weight of ", H);
  check_rows(delta, H, "add_rms_norm: delta");
  const int64_t rows = h.size(0), delta_stride = delta.stride(0);
  auto out = torch::empty_like(h);
  float* hp = h.data_ptr<float>();
  const float* dp = delta.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) {
    float* row = hp + r * H;
    const float* add = dp + r * delta_stride;
#pragma omp simd
    for (int64_t c = 0; c < H; ++c) row[c] += add[c];
    tandem_cpu::rms_norm_row(row, weight.data_ptr<float>(), out.data_ptr<float>() + r * H, H, static_cast<float>(eps));
  }
  return out;
}

// SwiGLU's product: gate_up: [T, 2 I] float32 (gate | up), rows contiguous -> [T, I] float32.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_float32(gate_up, "silu_mul: gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1,
              "silu_mul: gate_up must be [T, 2 I] with contiguous rows");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, stride = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  const float* g = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t) tandem_cpu::silu_mul_row(g + t * stride, g + t * stride + I, o + t * I, I);
  return out;
}

// RoPE on the query and key heads of a projection's output, in place, and the keys and
// values written into their cache slots.
// qkv: [T, (num_heads + 2 * num_kv_heads) * D] float32, rows contiguous (q heads, k heads, v heads)
// cos, sin: [T, D] float32, each token's rows of the tables
// k_cache, v_cache: [num_blocks, block_size, num_kv_heads, D] float32 or bfloat16; slot_mapping: [T] int64
// -> q: [T, num_heads, D], k, v: [T, num_kv_heads, D], views of qkv
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> rope_store_kv(
    torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache,
    torch::Tensor slot_mapping, int64_t num_heads, int64_t num_kv_heads) {
  for (const auto* t : {&qkv, &cos, &sin}) check_float32(*t, "rope_store_kv: qkv, cos and sin");
  const bool bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK((bf16 || k_cache.scalar_type() == torch::kFloat32) && v_cache.scalar_type() == k_cache.scalar_type() &&
                  k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "rope_store_kv: the caches must be float32 or bfloat16 CPU tensors, alike");
  const int64_t T = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(D % 2 == 0 && D <= tandem_cpu::kMaxRopeHeadDim, "rope_store_kv: head_dim even, at most 256");
  check_rows(qkv, (num_heads + 2 * num_kv_heads) * D, "rope_store_kv: qkv");
  const int64_t row_stride = qkv.stride(0);
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() && cos.size(0) == T,
              "rope_store_kv: cos and sin [T, D], contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.size(2) == num_kv_heads && k_cache.size(3) == D && k_cache.stride(3) == 1,
              "rope_store_kv: caches [num_blocks, block_size, num_kv_heads, D] alike");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == T,
              "rope_store_kv: slot_mapping [T] int64");
  const auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t block_size = k_cache.size(1), num_slots = k_cache.size(0) * block_size;
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "rope_store_kv: slot ", sp[t], " out of the cache");
  float* base = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* snp = sin.data_ptr<float>();
  const int64_t s0 = k_cache.stride(0), s1 = k_cache.stride(1), s2 = k_cache.stride(2);
  at::parallel_for(0, T, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t t = lo; t < hi; ++t) {
      const int64_t at = sp[t] / block_size * s0 + sp[t] % block_size * s1;
      float* row = base + t * row_stride;
      if (bf16)
        tandem_cpu::rope_store_token(row, cp + t * D, snp + t * D, num_heads, num_kv_heads, D,
                                     static_cast<uint16_t*>(k_cache.data_ptr()),
                                     static_cast<uint16_t*>(v_cache.data_ptr()), at, s2);
      else
        tandem_cpu::rope_store_token(row, cp + t * D, snp + t * D, num_heads, num_kv_heads, D,
                                     k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), at, s2);
    }
  });
  auto q = qkv.narrow(1, 0, num_heads * D).view({T, num_heads, D});
  auto k = qkv.narrow(1, num_heads * D, num_kv_heads * D).view({T, num_kv_heads, D});
  auto v = qkv.narrow(1, (num_heads + num_kv_heads) * D, num_kv_heads * D).view({T, num_kv_heads, D});
  return {q, k, v};
}

// Each row's greedy token (logits' argmax) and its log-probability under log_softmax(raw).
// logits, raw: [R, V] float32, rows contiguous -> (token ids [R] int64, logprobs [R] float32)
std::tuple<torch::Tensor, torch::Tensor> greedy_pick(torch::Tensor logits, torch::Tensor raw) {
  check_float32(logits, "greedy_pick: logits");
  check_float32(raw, "greedy_pick: raw");
  TORCH_CHECK(logits.dim() == 2 && raw.sizes() == logits.sizes() && logits.size(1) > 0 &&
                  logits.size(1) < (int64_t{1} << 31),
              "greedy_pick: logits and raw [R, V] alike, 0 < V < 2^31");
  const int64_t R = logits.size(0), V = logits.size(1);
  check_rows(logits, V, "greedy_pick: logits");
  check_rows(raw, V, "greedy_pick: raw");
  auto chosen = torch::empty({R}, logits.options().dtype(torch::kLong));
  auto logprobs = torch::empty({R}, logits.options());
  const float* lp = logits.data_ptr<float>();
  const float* rp = raw.data_ptr<float>();
  const int64_t ls = logits.stride(0), rs = raw.stride(0);
  int64_t* cp = chosen.data_ptr<int64_t>();
  float* op = logprobs.data_ptr<float>();
  // A row is ~20 us: threads only pay for themselves from a few rows on.
  at::parallel_for(0, R, 4, [&](int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t at = tandem_cpu::greedy::argmax_row(lp + r * ls, V);
      cp[r] = at;
      op[r] = rp[r * rs + at] - tandem_cpu::greedy::logsumexp_row(rp + r * rs, V);
    }
  });
  return {chosen, logprobs};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 rows");
  m.def("add_rms_norm", &add_rms_norm, "h += delta in place, then RMSNorm of h");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] rows");
  m.def("rope_store_kv", &rope_store_kv, "RoPE on q and k in place, k and v into their cache slots");
  m.def("greedy_pick", &greedy_pick, "each row's argmax and its log-probability under log_softmax(raw)");
}
