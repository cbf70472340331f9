// kiln_cpp::attention: one layer's attention from its fused QKV projection, in one call.
//
//   attention(qkv [T, (H + 2 KH) * D], cos [T, R/2], sin [T, R/2], kv_cache (written), layer,
//             slot_mapping [T], <the step's ctx_* and gen_* tensors>, num_heads, scale, q_norm? [D],
//             k_norm? [D], eps, window, softcap) -> [T, H, D]
//
// q and k are RMS-normed per head where q_norm and k_norm are given (Qwen3), rotated (GPT-NeoX, the
// first R dims of each head), k and v written to the pool at slot_mapping, and q attends the pool
// as kiln_cpp::paged_attention does. It is what the separate ops compute (rms_norm, rotary_embedding,
// the KV write, paged_attention), rounded the same way; a decode step saved two to four calls per
// layer on its serial path. The pool holds a float dtype (8-bit pools keep the separate write,
// which quantizes by the layer's scale).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "c_shim.h"
#include "elementwise.h"
#include "op_dtype.h"
#include "paged_attention_op.h"
#include "thread_pool.h"

namespace kiln {
namespace {

constexpr const char* kOp = "kiln_cpp::attention: ";

template <typename Src, typename Dst>
void convert(const void* src, void* dst, int64_t n) {
  const Src* s = static_cast<const Src*>(src);
  Dst* d = static_cast<Dst*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<Dst>(static_cast<float>(s[i]));
}

// n elements from src (dtype from) to dst (dtype to), rounded once.
void store(const void* src, DType from, void* dst, DType to, int64_t n, int64_t elem) {
  if (from == to) {
    std::memcpy(dst, src, n * elem);
    return;
  }
  auto to_dst = [&](auto s) {
    using S = decltype(s);
    switch (to) {
      case DType::Float: return convert<S, float>(src, dst, n);
      case DType::BFloat16: return convert<S, c10::BFloat16>(src, dst, n);
      default: return convert<S, c10::Half>(src, dst, n);
    }
  };
  switch (from) {
    case DType::Float: return to_dst(float{});
    case DType::BFloat16: return to_dst(c10::BFloat16{});
    default: return to_dst(c10::Half{});
  }
}

// heads heads of D at `x` (token stride row, head stride D), RMS-normed into a new [T, heads, D].
at::Tensor norm_heads(const void* x, const at::Tensor& qkv, DType dtype, int64_t T, int64_t heads, int64_t D,
                      int64_t row, const at::Tensor& weight, double eps, const char* name) {
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == D && weight.is_contiguous() &&
                  (weight.scalar_type() == qkv.scalar_type() || weight.scalar_type() == at::kFloat),
              kOp, name, " must be a contiguous [head_dim=", D, "] tensor in qkv's dtype or float32, got ",
              weight.sizes(), " ", weight.scalar_type());
  at::Tensor out = at::empty({T, heads, D}, qkv.options());
  NormParams p{};
  p.dtype = dtype;
  p.x = x;
  p.weight = weight.const_data_ptr();
  p.weight_dtype = float_dtype_of(weight, kOp, name);
  p.out = out.mutable_data_ptr();
  p.rows = T * heads;
  p.dim = D;
  p.inner = heads;
  p.outer_stride = row;
  p.inner_stride = D;
  p.eps = static_cast<float>(eps);
  run_norm(p);
  return out;
}

at::Tensor attention_cpu(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& kv_cache, int64_t layer, const at::Tensor& slot_mapping,
                         const at::Tensor& ctx_token_index, const at::Tensor& ctx_block_tables,
                         const at::Tensor& ctx_context_lens, const at::Tensor& gen_token_index,
                         const at::Tensor& gen_block_tables, const at::Tensor& gen_context_lens, int64_t num_heads,
                         double scale, const std::optional<at::Tensor>& q_norm,
                         const std::optional<at::Tensor>& k_norm, double eps, int64_t window, double softcap) {
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.size(1) == 2 && kv_cache.is_contiguous(), kOp,
              "kv_cache must be a contiguous [layers, 2, blocks, block_size, kv_heads, head_dim] pool, got shape ",
              kv_cache.sizes());
  const int64_t H = num_heads, KH = kv_cache.size(4), D = kv_cache.size(5), T = qkv.size(0);
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (H + 2 * KH) * D && qkv.stride(1) == 1, kOp,
              "qkv must be [tokens, (num_heads + 2 * kv_heads) * head_dim] = [T, ", (H + 2 * KH) * D,
              "] with contiguous rows, got shape ", qkv.sizes(), " strides ", qkv.strides());
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(0), kOp, "layer ", layer, " is outside the cache's ",
              kv_cache.size(0), " layers");
  const DType dtype = float_dtype_of(qkv, kOp, "qkv");
  const DType kv_dtype = float_dtype_of(kv_cache, kOp, "kv_cache (8-bit pools take kv_cache_write and its scale)");
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == T && 2 * cos.size(1) <= D, kOp,
              "cos and sin must be [T, R/2] with T = ", T, " and R <= head_dim ", D, ", got ", cos.sizes(), " and ",
              sin.sizes());
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T && !at::isFloatingType(slot_mapping.scalar_type()),
              kOp, "slot_mapping must be an integer [T = ", T, "] tensor, got ", slot_mapping.sizes(), " ",
              slot_mapping.scalar_type());
  const int64_t row = T > 1 ? qkv.stride(0) : qkv.size(1), elem = qkv.element_size();
  const char* base = static_cast<const char*>(qkv.const_data_ptr());
  const char *q_src = base, *k_src = base + H * D * elem, *v_src = base + (H + KH) * D * elem;
  int64_t q_row = row, k_row = row;
  at::Tensor qn, kn;
  if (q_norm.has_value()) {
    qn = norm_heads(q_src, qkv, dtype, T, H, D, row, *q_norm, eps, "q_norm");
    q_src = static_cast<const char*>(qn.const_data_ptr()), q_row = H * D;
  }
  if (k_norm.has_value()) {
    kn = norm_heads(k_src, qkv, dtype, T, KH, D, row, *k_norm, eps, "k_norm");
    k_src = static_cast<const char*>(kn.const_data_ptr()), k_row = KH * D;
  }

  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  at::Tensor q = at::empty({T, H, D}, qkv.options()), k = at::empty({T, KH, D}, qkv.options());
  const RopeParams rope{dtype, q_src, k_src, c.const_data_ptr<float>(), s.const_data_ptr<float>(),
                        q.mutable_data_ptr(), k.mutable_data_ptr(), H, KH, D, cos.size(1), q_row, D, k_row, D};
  // The KV write after each token's rotation, on the same thread: the slots of one step are distinct.
  const int64_t blocks = kv_cache.size(2), bs = kv_cache.size(3), kv_elem = kv_cache.element_size();
  const at::Tensor slot_ids = slot_mapping.to(at::kLong).contiguous();
  const int64_t* slots = slot_ids.const_data_ptr<int64_t>();
  char* pool = static_cast<char*>(kv_cache.mutable_data_ptr()) + layer * kv_cache.stride(0) * kv_elem;
  const int64_t v_offset = kv_cache.stride(1) * kv_elem;
  const char* k_rot = static_cast<const char*>(k.const_data_ptr());
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < blocks * bs, kOp, "slot_mapping[", t, "] = ", slots[t],
                " is outside the pool's ", blocks * bs, " slots");
  kiln::pool::parallel_for(0, T, std::max<int64_t>(1, 4096 / ((H + 2 * KH) * D)), [&](int64_t b, int64_t e) {
    rope_tokens(rope, b, e);
    for (int64_t t = b; t < e; ++t) {
      char* dst = pool + slots[t] * KH * D * kv_elem;  // block * bs + offset, the pool being contiguous
      store(k_rot + t * KH * D * elem, dtype, dst, kv_dtype, KH * D, elem);
      store(v_src + t * row * elem, dtype, dst + v_offset, kv_dtype, KH * D, elem);
    }
  });
  return paged_attention_cpu(q, kv_cache, layer, ctx_token_index, ctx_block_tables, ctx_context_lens, gen_token_index,
                             gen_block_tables, gen_context_lens, scale, std::nullopt, window, softcap);
}

at::Tensor attention_meta(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& kv_cache, int64_t layer, const at::Tensor& slot_mapping,
                          const at::Tensor& ctx_token_index, const at::Tensor& ctx_block_tables,
                          const at::Tensor& ctx_context_lens, const at::Tensor& gen_token_index,
                          const at::Tensor& gen_block_tables, const at::Tensor& gen_context_lens, int64_t num_heads,
                          double scale, const std::optional<at::Tensor>& q_norm,
                          const std::optional<at::Tensor>& k_norm, double eps, int64_t window, double softcap) {
  return at::empty_symint({qkv.sym_size(0), num_heads, kv_cache.sym_size(5)}, qkv.options());
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) kv_cache, int layer, Tensor slot_mapping, "
        "Tensor ctx_token_index, Tensor ctx_block_tables, Tensor ctx_context_lens, Tensor gen_token_index, "
        "Tensor gen_block_tables, Tensor gen_context_lens, int num_heads, float scale, Tensor? q_norm=None, "
        "Tensor? k_norm=None, float eps=1e-6, int window=0, float softcap=0.0) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) { m.impl("attention", &kiln::attention_cpu); }

TORCH_LIBRARY_IMPL(kiln_cpp, Meta, m) { m.impl("attention", &kiln::attention_meta); }

namespace ks = kiln::shim;

KILN_C_SHIM(attention, (AtenTensorHandle qkv, AtenTensorHandle cos, AtenTensorHandle sin, AtenTensorHandle kv_cache,
                        int64_t layer, AtenTensorHandle slot_mapping, AtenTensorHandle ctx_token_index,
                        AtenTensorHandle ctx_block_tables, AtenTensorHandle ctx_context_lens,
                        AtenTensorHandle gen_token_index, AtenTensorHandle gen_block_tables,
                        AtenTensorHandle gen_context_lens, int64_t num_heads, double scale, AtenTensorHandle* q_norm,
                        AtenTensorHandle* k_norm, double eps, int64_t window, double softcap, AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(attention, *out = ks::handle(kiln::attention_cpu(
                                  ks::tensor(qkv), ks::tensor(cos), ks::tensor(sin), ks::tensor(kv_cache), layer,
                                  ks::tensor(slot_mapping), ks::tensor(ctx_token_index), ks::tensor(ctx_block_tables),
                                  ks::tensor(ctx_context_lens), ks::tensor(gen_token_index),
                                  ks::tensor(gen_block_tables), ks::tensor(gen_context_lens), num_heads, scale,
                                  ks::optional(q_norm), ks::optional(k_norm), eps, window, softcap)));
}
