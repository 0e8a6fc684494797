// A whole decode step of a Llama-family model on the CPU in one parallel region: the layer loop
// in C++, the threads of one team taking each stage's units as they come (step_stages.h),
// instead of ~12 torch calls a layer, each a Python dispatch and a wake of torch's threads. The stages run the same
// loops as the eager path's kernels (int4/int8_gemv_cpu.h, rms_norm_cpu.h, rope_cpu.h,
// silu_mul_cpu.h, the attention's items), each output element computed by the same code in
// the same order, so the logits equal the eager path's to the bit (tests/model/test_compiled_step.py).
//
// Per layer: qkv product (+ bias) | RoPE, K and V into the cache | attention items | merge of
// split contexts | o product | residual add and norm | gate and up products with SwiGLU |
// down product | residual add and the next norm. A product's units are runs of blocks of 16
// output channels, other stages' rows or attention items.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "f32_gemv_cpu.h"
#include "int4_gemv_cpu.h"
#include "int4_q8_gemv_cpu.h"
#include "int8_gemv_cpu.h"
#include "int8_q8_gemv_cpu.h"
#include "paged_decode_attention_cpu_items.h"
#include "rms_norm_cpu.h"
#include "rope_cpu.h"
#include "silu_mul_cpu.h"
#include "step_stages.h"

namespace {

using tandem_cpu::kGemvChannels;

const tandem_cpu::Isa kIsa = tandem_cpu::detect_isa();

// A product's input as the kernels take it: group sums of x (int4, float32 activations), or x
// rounded to 8 bits (q8_activations_cpu.h) with its scales, group sums and (int8) offset terms.
// Each thread's own, made once per stage.
struct ProductInput {
  std::vector<float> sums, scales, offsets;
  std::vector<int8_t> q;
  ProductInput(int64_t max_elements, int64_t max_rows)
      : sums(max_elements / tandem_cpu::q8::kGroup + 1), scales(sums.size()), offsets(max_rows), q(max_elements) {}
};

// A weight as one of the GEMV kernels takes it: int4 (scale_offset int32) or int8 (scale float32)
// packed, each with float32 or 8-bit activations, or float32 as torch holds it ([N, K], no scales).
struct Projection {
  enum class Kind { kInt4, kInt4Int8Activations, kInt8, kInt8Int8Activations, kF32 };
  torch::Tensor values, scales;
  Kind kind;
  bool int4;
  int64_t N, K;

  Projection(torch::Tensor v, torch::Tensor s, bool int8_activations)
      : values(v), scales(s),
        kind(v.scalar_type() == torch::kFloat32 ? Kind::kF32
             : s.scalar_type() != torch::kInt32 ? (int8_activations ? Kind::kInt8Int8Activations : Kind::kInt8)
             : int8_activations ? Kind::kInt4Int8Activations : Kind::kInt4),
        int4(s.scalar_type() == torch::kInt32),
        N(kind == Kind::kF32 ? v.size(0) : v.size(0) * kGemvChannels),
        K(kind == Kind::kF32 ? v.size(1) : v.size(1) * (int4 ? 8 : 4)) {
    TORCH_CHECK(!int8_activations || (kind != Kind::kF32 && tandem_cpu::q8::cpu_has_int8_dot() &&
                                      K % tandem_cpu::q8::kGroup == 0),
                "Projection: 8-bit activations need an int4 or int8 weight, AVX-512 VNNI and columns in groups of 32");
    if (kind == Kind::kF32) {
      TORCH_CHECK(v.dim() == 2 && v.is_contiguous() && N % kGemvChannels == 0 && K % tandem_cpu::f32::kColumns == 0,
                  "Projection: a float32 weight [N, K], contiguous, N and K multiples of 16");
    } else {
      TORCH_CHECK(v.dim() == 3 && v.scalar_type() == torch::kInt32 && v.is_contiguous() && s.is_contiguous() &&
                      v.size(2) == kGemvChannels && (int4 || s.scalar_type() == torch::kFloat32),
                  "Projection: a packed int4 or int8 weight");
    }
  }

  // What an int4 product needs of x: [M, K] before its blocks run (into `in`).
  void prepare(const float* x, int64_t M, ProductInput& in) const {
    if (kind == Kind::kInt4) tandem_cpu::int4::group_sums(x, M, K, in.sums.data());
    if (kind == Kind::kInt4Int8Activations)
      tandem_cpu::q8::quantize_rows<tandem_cpu::q8::Order::kNibbles>(x, M, K, in.q.data(), in.scales.data(),
                                                                      in.sums.data());
    if (kind == Kind::kInt8Int8Activations) {
      tandem_cpu::q8::quantize_rows<tandem_cpu::q8::Order::kNatural>(x, M, K, in.q.data(), in.scales.data(),
                                                                      in.sums.data());
      tandem_cpu::int8_q8::offset_terms(in.q.data(), in.scales.data(), M, K, in.offsets.data());
    }
  }

  // out[:, blocks [first, end)] of x: [M, K] (`in`: what prepare made of x).
  void run_blocks(const float* x, int64_t M, float* out, int64_t first, int64_t end, const ProductInput& in) const {
    // NOTE: data_ptr<T> throws for another dtype, and nothing may throw in the parallel region.
    const auto* packed = static_cast<const uint32_t*>(values.data_ptr());
    const auto* scale_offset = static_cast<const uint32_t*>(scales.data_ptr());
    switch (kind) {
      case Kind::kInt4:
        tandem_cpu::int4::gemv_blocks(tandem_cpu::int4::int4_blocks(kIsa), packed, scale_offset, x, in.sums.data(),
                                      M, K, N, out, first, end);
        break;
      case Kind::kInt4Int8Activations:
#ifdef TANDEM_HAS_Q8_GEMV
        tandem_cpu::int4_q8::gemv_blocks(packed, scale_offset, in.q.data(), in.scales.data(), in.sums.data(), M, K,
                                         N, out, first, end);
#endif
        break;
      case Kind::kInt8Int8Activations:
#ifdef TANDEM_HAS_Q8_GEMV
        tandem_cpu::int8_q8::gemv_blocks(static_cast<const int32_t*>(values.data_ptr()),
                                         static_cast<const float*>(scales.data_ptr()), in.q.data(), in.scales.data(),
                                         in.offsets.data(), M, K, N, out, first, end);
#endif
        break;
      case Kind::kInt8:
        tandem_cpu::int8::gemv_blocks(tandem_cpu::int8::int8_blocks(kIsa), values.data_ptr<int32_t>(),
                                      scales.data_ptr<float>(), x, M, K, N, out, first, end);
        break;
      case Kind::kF32:
        tandem_cpu::f32::gemv_blocks(tandem_cpu::f32::f32_blocks(kIsa), values.data_ptr<float>(), x, M, K, N, out,
                                     first, end);
        break;
    }
  }
  int64_t num_blocks() const { return N / kGemvChannels; }
};

struct Layer {
  Projection qkv, o, gate_up, down;
  torch::Tensor qkv_bias;  // [N of qkv] float32, or undefined
  torch::Tensor input_norm, post_attention_norm;
};

}  // namespace

class DecodeStep {
 public:
  DecodeStep(torch::Tensor embed, torch::Tensor cos, torch::Tensor sin, torch::Tensor norm, std::vector<Layer> layers,
             Projection lm_head, int64_t num_heads, int64_t num_kv_heads, double eps, double scale, int64_t min_split)
      : embed_(embed), cos_(cos), sin_(sin), norm_(norm), layers_(std::move(layers)), lm_head_(lm_head),
        num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(cos.size(1)), hidden_(embed.size(1)),
        eps_(static_cast<float>(eps)), scale_(static_cast<float>(scale)), min_split_(min_split) {
    TORCH_CHECK(!layers_.empty() && embed.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
                "DecodeStep: contiguous tables and at least one layer");
    for (const Layer& l : layers_)
      TORCH_CHECK(l.qkv.K == hidden_ && l.qkv.N == (num_heads + 2 * num_kv_heads) * head_dim_ &&
                      l.o.K == num_heads * head_dim_ && l.o.N == hidden_ && l.gate_up.K == hidden_ &&
                      l.gate_up.N % (2 * kGemvChannels) == 0 && l.down.K == l.gate_up.N / 2 && l.down.N == hidden_,
                  "DecodeStep: a layer's shapes do not fit the model's");
  }

  // One decode token per sequence. input_ids, positions, slot_mapping, context_lens: [B] int64;
  // block_tables: [B, W] int64; kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads,
  // head_dim] float32 or bfloat16; logits_indices: [n] int64 -> logits [n, vocab] float32.
  torch::Tensor run(torch::Tensor input_ids, torch::Tensor positions, torch::Tensor kv_cache,
                    torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor context_lens,
                    torch::Tensor logits_indices) const {
    const int64_t B = input_ids.size(0), H = hidden_, D = head_dim_, n_logits = logits_indices.size(0);
    const bool bf16 = kv_cache.scalar_type() == torch::kBFloat16;
    TORCH_CHECK((bf16 || kv_cache.scalar_type() == torch::kFloat32) && kv_cache.dim() == 6 &&
                    kv_cache.size(0) == static_cast<int64_t>(layers_.size()) && kv_cache.size(4) == num_kv_heads_ &&
                    kv_cache.size(5) == D && kv_cache.stride(5) == 1,
                "DecodeStep: kv_cache [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]");
    for (const auto* t : {&input_ids, &positions, &slot_mapping, &context_lens, &logits_indices})
      TORCH_CHECK(t->scalar_type() == torch::kLong && t->is_contiguous(), "DecodeStep: int64 index tensors");
    TORCH_CHECK(block_tables.scalar_type() == torch::kLong && block_tables.is_contiguous() &&
                    block_tables.size(0) == B && context_lens.size(0) == B,
                "DecodeStep: block_tables [B, W] int64");
    const int64_t* ids = input_ids.data_ptr<int64_t>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t* lens = context_lens.data_ptr<int64_t>();
    const int64_t* rows = logits_indices.data_ptr<int64_t>();
    const int64_t block_size = kv_cache.size(3), table_width = block_tables.size(1);
    const int64_t num_slots_in_cache = kv_cache.size(2) * block_size;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(ids[b] >= 0 && ids[b] < embed_.size(0) && pos[b] >= 0 && pos[b] < cos_.size(0),
                  "DecodeStep: token or position out of range");
      TORCH_CHECK(slots[b] >= 0 && slots[b] < num_slots_in_cache && lens[b] <= table_width * block_size,
                  "DecodeStep: slot or context out of the cache");
    }
    for (int64_t i = 0; i < n_logits; ++i) TORCH_CHECK(rows[i] >= 0 && rows[i] < B, "DecodeStep: bad logits row");

    const int threads = at::get_num_threads();
    std::vector<tandem_cpu::AttentionItem> items;
    const int64_t num_parts = tandem_cpu::plan_items(lens, B, block_size, min_split_, threads, items);
    std::vector<const tandem_cpu::AttentionItem*> split_firsts;  // a split sequence's first item
    for (const auto& it : items)
      if (it.slot >= 0 && it.begin == 0) split_firsts.push_back(&it);

    const Layer& l0 = layers_.front();
    const int64_t Nqkv = l0.qkv.N, I = l0.gate_up.N / 2, Q = num_heads_ * D;
    auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
    // h: the residual stream; x: its normalised input to the next block; attn: zeros for empty contexts
    auto h = torch::empty({B, H}, f32), x = torch::empty({B, H}, f32), delta = torch::empty({B, H}, f32);
    auto qkv = torch::empty({B, Nqkv}, f32), attn = torch::zeros({B, Q}, f32), gate_up = torch::empty({B, 2 * I}, f32);
    auto act = torch::empty({B, I}, f32), parts = torch::empty({num_parts, num_heads_, D + 2}, f32);
    auto normed = torch::empty({n_logits, H}, f32), logits = torch::empty({n_logits, lm_head_.N}, f32);
    float *hp = h.data_ptr<float>(), *xp = x.data_ptr<float>(), *dp = delta.data_ptr<float>();
    float *qkvp = qkv.data_ptr<float>(), *ap = attn.data_ptr<float>(), *gup = gate_up.data_ptr<float>();
    float *actp = act.data_ptr<float>(), *np = normed.data_ptr<float>(), *lp = logits.data_ptr<float>();
    const int64_t max_k = std::max(H, I);
    const auto range_fn = tandem_cpu::pick_range_fn(bf16).first;
    const int64_t layer_stride = kv_cache.stride(0), kv_stride = kv_cache.stride(1);
    const int64_t s_block = kv_cache.stride(2), s_token = kv_cache.stride(3), s_head = kv_cache.stride(4);
    const int64_t elem = kv_cache.element_size();
    char* cache = static_cast<char*>(kv_cache.data_ptr());
    const float *cosp = cos_.data_ptr<float>(), *sinp = sin_.data_ptr<float>();

    tandem_cpu::StepStages stages(static_cast<int64_t>(layers_.size()) * 9 + 3);
#pragma omp parallel num_threads(threads)
    {
      ProductInput input(B * max_k, B);
      std::vector<float> acc(Q), m(num_heads_), l(num_heads_);
      tandem_cpu::StepStages::Cursor at;
      // A product's input, made by each thread once per stage, before its first unit.
      auto prepare_once = [&](bool& prepared, const Projection& p, const float* in, int64_t rows_in) {
        if (!prepared) p.prepare(in, rows_in, input);
        prepared = true;
      };
      // A product's stage: its blocks in units.
      auto product = [&](const Projection& p, const float* in, int64_t rows_in, float* out) {
        const tandem_cpu::BlockUnits units(p.num_blocks(), threads);
        bool prepared = false;
        stages.run(at, units.count(), [&](int64_t u) {
          prepare_once(prepared, p, in, rows_in);
          p.run_blocks(in, rows_in, out, units.first(u), units.end(u), input);
        });
      };
      stages.run(at, B, [&](int64_t b) {  // embedding, the first norm
        std::copy(embed_.data_ptr<float>() + ids[b] * H, embed_.data_ptr<float>() + (ids[b] + 1) * H, hp + b * H);
        tandem_cpu::rms_norm_row(hp + b * H, l0.input_norm.data_ptr<float>(), xp + b * H, H, eps_);
      });
      for (size_t li = 0; li < layers_.size(); ++li) {
        const Layer& L = layers_[li];
        const tandem_cpu::BlockUnits qkv_units(L.qkv.num_blocks(), threads);
        bool prepared = false;
        stages.run(at, qkv_units.count(), [&](int64_t u) {  // the qkv product and its bias
          prepare_once(prepared, L.qkv, xp, B);
          L.qkv.run_blocks(xp, B, qkvp, qkv_units.first(u), qkv_units.end(u), input);
          if (L.qkv_bias.defined())
            for (int64_t b = 0; b < B; ++b)
              for (int64_t c = qkv_units.first(u) * kGemvChannels; c < qkv_units.end(u) * kGemvChannels; ++c)
                qkvp[b * Nqkv + c] = qkvp[b * Nqkv + c] + L.qkv_bias.data_ptr<float>()[c];
        });
        char* k_layer = cache + li * layer_stride * elem;
        char* v_layer = k_layer + kv_stride * elem;
        stages.run(at, B, [&](int64_t b) {  // RoPE, K and V into the cache
          const int64_t slot = slots[b] / block_size * s_block + slots[b] % block_size * s_token;
          if (bf16)
            tandem_cpu::rope_store_token(qkvp + b * Nqkv, cosp + pos[b] * D, sinp + pos[b] * D, num_heads_,
                                         num_kv_heads_, D, reinterpret_cast<uint16_t*>(k_layer),
                                         reinterpret_cast<uint16_t*>(v_layer), slot, s_head);
          else
            tandem_cpu::rope_store_token(qkvp + b * Nqkv, cosp + pos[b] * D, sinp + pos[b] * D, num_heads_,
                                         num_kv_heads_, D, reinterpret_cast<float*>(k_layer),
                                         reinterpret_cast<float*>(v_layer), slot, s_head);
        });
        const tandem_cpu::AttentionCall call{qkvp, Nqkv, num_heads_, num_kv_heads_, D, scale_, k_layer, v_layer,
                                             s_head * elem, {s_block, s_token, block_size},
                                             block_tables.data_ptr<int64_t>(), table_width, range_fn, ap,
                                             parts.data_ptr<float>()};
        stages.run(at, static_cast<int64_t>(items.size()),
                   [&](int64_t i) { tandem_cpu::attend_item(call, items[i], acc.data(), m.data(), l.data()); });
        if (!split_firsts.empty())
          stages.run(at, static_cast<int64_t>(split_firsts.size()) * num_heads_, [&](int64_t u) {
            tandem_cpu::merge_split(call, *split_firsts[u / num_heads_], u % num_heads_);
          });
        product(L.o, ap, B, dp);
        stages.run(at, B, [&](int64_t b) {
          add_norm(hp + b * H, dp + b * H, L.post_attention_norm.data_ptr<float>(), xp + b * H);
        });
        // Gate block g pairs with up block g + I / 16: a unit's SwiGLU needs only its own products.
        const tandem_cpu::BlockUnits gates(I / kGemvChannels, threads);
        prepared = false;
        stages.run(at, gates.count(), [&](int64_t u) {
          prepare_once(prepared, L.gate_up, xp, B);
          const int64_t first = gates.first(u), end = gates.end(u), up = I / kGemvChannels;
          L.gate_up.run_blocks(xp, B, gup, first, end, input);
          L.gate_up.run_blocks(xp, B, gup, first + up, end + up, input);
          const int64_t c0 = first * kGemvChannels, width = (end - first) * kGemvChannels;
          for (int64_t b = 0; b < B; ++b)
            tandem_cpu::silu_mul_row(gup + b * 2 * I + c0, gup + b * 2 * I + I + c0, actp + b * I + c0, width);
        });
        product(L.down, actp, B, dp);
        const bool last = li + 1 == layers_.size();
        stages.run(at, B, [&](int64_t b) {
          if (last)
            for (int64_t c = 0; c < H; ++c) hp[b * H + c] = hp[b * H + c] + dp[b * H + c];
          else
            add_norm(hp + b * H, dp + b * H, layers_[li + 1].input_norm.data_ptr<float>(), xp + b * H);
        });
      }
      stages.run(at, n_logits, [&](int64_t i) {  // the final norm of the sampled rows, the LM head
        tandem_cpu::rms_norm_row(hp + rows[i] * H, norm_.data_ptr<float>(), np + i * H, H, eps_);
      });
      product(lm_head_, np, n_logits, lp);
      stages.finish(at);
    }
    return logits;
  }

 private:
  // The residual add and the next norm of one row: h += delta (as layer_ops_cpu's add_rms_norm).
  void add_norm(float* h, const float* delta, const float* weight, float* out) const {
#pragma omp simd
    for (int64_t c = 0; c < hidden_; ++c) h[c] += delta[c];
    tandem_cpu::rms_norm_row(h, weight, out, hidden_, eps_);
  }

  torch::Tensor embed_, cos_, sin_, norm_;
  std::vector<Layer> layers_;
  Projection lm_head_;
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_;
  float eps_, scale_;
  int64_t min_split_;
};

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<Projection>(m, "Projection")
      .def(py::init<torch::Tensor, torch::Tensor, bool>(), py::arg("values"), py::arg("scales"),
           py::arg("int8_activations") = false);
  py::class_<Layer>(m, "Layer")
      .def(py::init([](Projection qkv, Projection o, Projection gate_up, Projection down,
                       std::optional<torch::Tensor> qkv_bias, torch::Tensor input_norm,
                       torch::Tensor post_attention_norm) {
             return Layer{qkv, o, gate_up, down, qkv_bias.value_or(torch::Tensor()), input_norm,
                          post_attention_norm};
           }));
  py::class_<DecodeStep>(m, "DecodeStep")
      .def(py::init<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, std::vector<Layer>, Projection,
                    int64_t, int64_t, double, double, int64_t>())
      .def("run", &DecodeStep::run, py::call_guard<py::gil_scoped_release>());
  m.def("isa", [] { return std::string(tandem_cpu::isa_name(kIsa)); }, "the instruction set the products picked");
}
