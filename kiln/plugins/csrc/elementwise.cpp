// The elementwise plugins of the Llama step, on Kiln's thread pool (thread_pool.h):
//
//   rms_norm(x [..., D], weight [D], float eps) -> [..., D]
//   fused_add_rms_norm(x [..., D], residual [..., D], weight [D], float eps) -> (rms_norm(x + residual), x + residual)
//   rotary_embedding(q [T, Hq, D], k [T, Hk, D], cos [T, R/2], sin [T, R/2]) -> (q, k) rotated (GPT-NeoX)
//   silu_and_mul(x [..., 2I]) -> silu(x[..., :I]) * x[..., I:]
//
// kiln/plugins/reference.py is their spec (float math, one rounding per output). An engine step's
// compiled loops run on one thread (kiln/engine/loader.py, serial graph loops) so that a busy machine
// cannot stall them at OpenMP barriers; these ops give the step's elementwise work, which grows with
// the tokens of a prefill, back to the pool's dynamically claimed chunks. Inputs may be strided views
// (q/k/v split out of the fused QKV output) as long as the last dim is contiguous; outputs are
// contiguous.

#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "c_shim.h"
#include "elementwise.h"
#include "op_dtype.h"
#include "paged_attention_x86.h"
#include "thread_pool.h"

namespace kiln {
namespace {

struct Kernels {
  void (*rms_norm)(const NormParams&, int64_t, int64_t);
  void (*rope)(const RopeParams&, int64_t, int64_t);
  void (*silu_and_mul)(const SiluMulParams&, int64_t, int64_t);
};

Kernels select_kernels() {
  const std::string capability = at::get_cpu_capability();
#if KILN_X86_KERNELS
  if (capability == "AVX512") return {&AVX512::rms_norm_rows, &AVX512::rope_tokens, &AVX512::silu_and_mul_rows};
  if (capability == "AVX2") return {&AVX2::rms_norm_rows, &AVX2::rope_tokens, &AVX2::silu_and_mul_rows};
#endif
  return {&DEFAULT::rms_norm_rows, &DEFAULT::rope_tokens, &DEFAULT::silu_and_mul_rows};
}

const Kernels& kernels() {
  static const Kernels k = select_kernels();
  return k;
}

// Rows per chunk: about 16k elements each, so a decode step's few rows run inline on the caller
// instead of waking the pool for a microsecond of work.
int64_t grain(int64_t elements_per_row) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, elements_per_row)); }

void check_cpu(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.dim() >= 1 && (t.size(-1) <= 1 || t.stride(-1) == 1), op, name,
              " must have a contiguous last dim, got shape ", t.sizes(), " strides ", t.strides());
}

// The layout NormParams reads: [rows, D], [T, H, D] or anything else after a copy (check_cpu has
// seen a contiguous last dim).
at::Tensor rows_view(const at::Tensor& x, NormParams& p) {
  if (x.dim() == 3) {
    p.rows = x.size(0) * x.size(1);
    p.inner = std::max<int64_t>(1, x.size(1));
    p.outer_stride = x.stride(0);
    p.inner_stride = x.stride(1);
    return x;
  }
  const at::Tensor flat = x.dim() == 2 ? x : x.contiguous().view({-1, x.size(-1)});
  p.rows = flat.size(0);
  p.inner = 1;
  p.outer_stride = flat.stride(0);
  p.inner_stride = 0;
  return flat;
}

NormParams norm_params(const at::Tensor& x, const at::Tensor& weight, double eps, const char* op) {
  check_cpu(x, op, "x");
  NormParams p{};
  p.dtype = float_dtype_of(x, op, "x");
  p.dim = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == p.dim && weight.is_contiguous() && weight.device().is_cpu(), op,
              "weight must be a contiguous 1-D CPU tensor of x's last dim (", p.dim, "), got shape ", weight.sizes());
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat, op,
              "weight must be x's dtype (", x.scalar_type(), ") or float32, got ", weight.scalar_type());
  p.weight = weight.const_data_ptr();
  p.weight_dtype = float_dtype_of(weight, op, "weight");
  p.eps = static_cast<float>(eps);
  return p;
}

at::Tensor rms_norm_cpu(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* op = "kiln_cpp::rms_norm: ";
  NormParams p = norm_params(x, weight, eps, op);
  const at::Tensor rows = rows_view(x, p);
  at::Tensor out = at::empty(x.sizes(), x.options());
  p.x = rows.const_data_ptr();
  p.out = out.mutable_data_ptr();
  run_norm(p);
  return out;
}

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_cpu(const at::Tensor& x, const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps) {
  constexpr const char* op = "kiln_cpp::fused_add_rms_norm: ";
  NormParams p = norm_params(x, weight, eps, op);
  check_cpu(residual, op, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), op,
              "x and residual must have one shape and dtype, got ", x.sizes(), " ", x.scalar_type(), " and ",
              residual.sizes(), " ", residual.scalar_type());
  const at::Tensor rows = x.reshape({-1, p.dim}), res = residual.reshape({-1, p.dim});
  rows_view(rows, p);
  at::Tensor out = at::empty(x.sizes(), x.options()), sum = at::empty(x.sizes(), x.options());
  p.x = rows.const_data_ptr();
  p.residual = res.const_data_ptr();
  p.residual_stride = res.size(0) > 1 ? res.stride(0) : p.dim;
  p.out = out.mutable_data_ptr();
  p.residual_out = sum.mutable_data_ptr();
  run_norm(p);
  return {out, sum};
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding_cpu(const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& cos, const at::Tensor& sin) {
  constexpr const char* op = "kiln_cpp::rotary_embedding: ";
  check_cpu(q, op, "q");
  check_cpu(k, op, "k");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  k.scalar_type() == q.scalar_type(), op,
              "q and k must be [T, H, D] tensors of one T, D and dtype, got ", q.sizes(), " ", q.scalar_type(), " and ",
              k.sizes(), " ", k.scalar_type());
  const int64_t T = q.size(0), D = q.size(2);
  TORCH_CHECK(cos.dim() == 2 && sin.sizes() == cos.sizes() && cos.size(0) == T && 2 * cos.size(1) <= D &&
                  cos.device().is_cpu() && sin.device().is_cpu(), op,
              "cos and sin must be [T, R/2] CPU tensors with T = ", T, " and R <= head size ", D, ", got ", cos.sizes(),
              " and ", sin.sizes());
  const at::Tensor c = cos.to(at::kFloat).contiguous(), s = sin.to(at::kFloat).contiguous();
  at::Tensor q_out = at::empty(q.sizes(), q.options()), k_out = at::empty(k.sizes(), k.options());
  RopeParams p{float_dtype_of(q, op, "q"), q.const_data_ptr(), k.const_data_ptr(), c.const_data_ptr<float>(),
               s.const_data_ptr<float>(), q_out.mutable_data_ptr(), k_out.mutable_data_ptr(),
               q.size(1), k.size(1), D, cos.size(1), q.stride(0), q.stride(1), k.stride(0), k.stride(1)};
  const auto kernel = kernels().rope;
  kiln::pool::parallel_for(0, T, grain((q.size(1) + k.size(1)) * D), [&](int64_t b, int64_t e) { kernel(p, b, e); });
  return {q_out, k_out};
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  constexpr const char* op = "kiln_cpp::silu_and_mul: ";
  check_cpu(x, op, "x");
  TORCH_CHECK(x.size(-1) % 2 == 0, op, "x must be a [..., 2I] tensor, got shape ", x.sizes());
  const int64_t I = x.size(-1) / 2;
  const at::Tensor rows = x.reshape({-1, 2 * I});
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, x.options());
  const int64_t T = rows.size(0);
  SiluMulParams p{float_dtype_of(x, op, "x"), rows.const_data_ptr(), out.mutable_data_ptr(), I,
                  T > 1 ? rows.stride(0) : 2 * I};
  const auto kernel = kernels().silu_and_mul;
  kiln::pool::parallel_for(0, T, grain(I), [&](int64_t b, int64_t e) { kernel(p, b, e); });
  return out;
}

// Symbolic sizes: torch.export traces with a dynamic number of tokens.
at::Tensor like(const at::Tensor& x) { return at::empty_symint(x.sym_sizes(), x.options()); }

at::Tensor rms_norm_meta(const at::Tensor& x, const at::Tensor& weight, double eps) { return like(x); }

std::tuple<at::Tensor, at::Tensor> fused_add_rms_norm_meta(const at::Tensor& x, const at::Tensor& residual,
                                                           const at::Tensor& weight, double eps) {
  return {like(x), like(x)};
}

std::tuple<at::Tensor, at::Tensor> rotary_embedding_meta(const at::Tensor& q, const at::Tensor& k,
                                                         const at::Tensor& cos, const at::Tensor& sin) {
  return {like(q), like(k)};
}

at::Tensor silu_and_mul_meta(const at::Tensor& x) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape.back() = shape.back() / 2;
  return at::empty_symint(shape, x.options());
}

}  // namespace

void silu_and_mul(const SiluMulParams& p, int64_t begin, int64_t end) { kernels().silu_and_mul(p, begin, end); }
void run_norm(const NormParams& p) {
  const auto k = kernels().rms_norm;
  kiln::pool::parallel_for(0, p.rows, grain(p.dim), [&](int64_t b, int64_t e) { k(p, b, e); });
}
void rope_tokens(const RopeParams& p, int64_t begin, int64_t end) { kernels().rope(p, begin, end); }

}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("fused_add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("rotary_embedding(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)",
        {at::Tag::pt2_compliant_tag});
  m.def("silu_and_mul(Tensor x) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) {
  m.impl("rms_norm", &kiln::rms_norm_cpu);
  m.impl("fused_add_rms_norm", &kiln::fused_add_rms_norm_cpu);
  m.impl("rotary_embedding", &kiln::rotary_embedding_cpu);
  m.impl("silu_and_mul", &kiln::silu_and_mul_cpu);
}

TORCH_LIBRARY_IMPL(kiln_cpp, Meta, m) {
  m.impl("rms_norm", &kiln::rms_norm_meta);
  m.impl("fused_add_rms_norm", &kiln::fused_add_rms_norm_meta);
  m.impl("rotary_embedding", &kiln::rotary_embedding_meta);
  m.impl("silu_and_mul", &kiln::silu_and_mul_meta);
}

namespace ks = kiln::shim;

KILN_C_SHIM(rms_norm, (AtenTensorHandle x, AtenTensorHandle weight, double eps, AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(rms_norm, *out = ks::handle(kiln::rms_norm_cpu(ks::tensor(x), ks::tensor(weight), eps)));
}

KILN_C_SHIM(fused_add_rms_norm, (AtenTensorHandle x, AtenTensorHandle residual, AtenTensorHandle weight, double eps,
                                 AtenTensorHandle* out, AtenTensorHandle* residual_out)) {
  KILN_C_SHIM_BODY(fused_add_rms_norm, {
    auto [y, sum] = kiln::fused_add_rms_norm_cpu(ks::tensor(x), ks::tensor(residual), ks::tensor(weight), eps);
    *out = ks::handle(std::move(y));
    *residual_out = ks::handle(std::move(sum));
  });
}

KILN_C_SHIM(rotary_embedding, (AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle cos, AtenTensorHandle sin,
                               AtenTensorHandle* q_out, AtenTensorHandle* k_out)) {
  KILN_C_SHIM_BODY(rotary_embedding, {
    auto [qr, kr] = kiln::rotary_embedding_cpu(ks::tensor(q), ks::tensor(k), ks::tensor(cos), ks::tensor(sin));
    *q_out = ks::handle(std::move(qr));
    *k_out = ks::handle(std::move(kr));
  });
}

KILN_C_SHIM(silu_and_mul, (AtenTensorHandle x, AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(silu_and_mul, *out = ks::handle(kiln::silu_and_mul_cpu(ks::tensor(x))));
}
