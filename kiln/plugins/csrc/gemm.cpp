// kiln_cpp::gemm: the C++ CPU GEMM plugin for linear layers with packed (and quantized) weights.
//
//   gemm(x [..., K], weight, scale?, bias?, n, group_size, out_float) -> [..., n]
//   embedding(packed [panels, K, 16], ids [...], n) -> [..., K]: rows of a packed table
//
// weight holds the [n, K] matrix in panels of 16 output columns (kiln/plugins/gemm.py packs it at
// build time; rows past n are zero):
//   float32 / bfloat16 / float16 [panels, K, 16]: dense;
//   int8 [panels, K, 16] with scale [panels * 16]: w = q * scale (W8A16; SmoothQuant's int8 weights);
//   float8_e4m3fn [panels, K, 16] with scale [panels * 16]: w = fp8 * scale (FP8, W4A8);
//   uint8 [panels, K / 2, 16] with scale [K / group_size, panels * 16]: two int4 per byte along k
//     (low nibble first, two's complement), w = q * scale[k / group_size] (W4A16, AWQ, GPTQ).
// x is float32, bfloat16 or float16; the result is x's dtype (float32 with out_float), computed
// in float32. bias, if given, has n values. Registered with a Meta kernel, so torch.export traces
// it and an AOTInductor package calls it without Python, as kiln_cpp::paged_attention.

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "gemm.h"
#include "paged_attention_x86.h"

namespace kiln {
namespace {

constexpr const char* kOp = "kiln_cpp::gemm: ";

GemmPanelsFn select_kernel() {
  const std::string capability = at::get_cpu_capability();
#if KILN_X86_KERNELS
  if (capability == "AVX512" || capability == "AVX2") return &AVX2::gemm_panels;
#endif
  return &DEFAULT::gemm_panels;
}

WeightFormat format_of(const at::Tensor& w) {
  switch (w.scalar_type()) {
    case at::kFloat: return WeightFormat::Float;
    case at::kBFloat16: return WeightFormat::BFloat16;
    case at::kHalf: return WeightFormat::Half;
    case at::kChar: return WeightFormat::Int8;
    case at::kFloat8_e4m3fn: return WeightFormat::Fp8E4M3;
    case at::kByte: return WeightFormat::Int4;
    default:
      TORCH_CHECK(false, kOp, "weight must be float32, bfloat16, float16, int8, float8_e4m3fn or uint8 (int4), got ",
                  w.scalar_type());
  }
}

OutType out_type_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return OutType::Float;
    case at::kBFloat16: return OutType::BFloat16;
    case at::kHalf: return OutType::Half;
    default: TORCH_CHECK(false, kOp, "x must be float32, bfloat16 or float16, got ", t);
  }
}

// Per-thread buffers only grow: resizing down and up again, as calls alternate between layers of
// different K, would zero the regrown part every time.
template <typename T>
void grow(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
}

template <typename T>
void to_float(const T* in, float* out, int64_t count) {
  at::parallel_for(0, count, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) out[i] = static_cast<float>(in[i]);
  });
}

void check_packed(const at::Tensor& t, const char* op, const char* what) {
  TORCH_CHECK(t.dim() == 3 && t.size(2) == kPanel && t.is_contiguous(), op, what,
              " must be contiguous [panels, K, 16] (kiln.plugins.gemm packs it), got shape ", t.sizes());
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  TORCH_CHECK(!shape.empty(), kOp, "x must have at least one dimension");
  shape.back() = n;
  return shape;
}

at::Tensor gemm_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                    const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float) {
  const WeightFormat format = format_of(weight);
  const at::ScalarType out_dtype = out_float ? at::kFloat : x.scalar_type();
  out_type_of(x.scalar_type());
  const int64_t K = x.size(-1);
  check_packed(weight, kOp, "weight");
  const int64_t panels = weight.size(0), padded = panels * kPanel;
  TORCH_CHECK(n > padded - kPanel && n <= padded, kOp, "n = ", n, " does not match ", panels, " weight panels");
  const int64_t k_rows = format == WeightFormat::Int4 ? K / 2 : K;
  TORCH_CHECK(weight.size(1) == k_rows && (format != WeightFormat::Int4 || K % 2 == 0), kOp, "x has K = ", K,
              " input features but weight is ", weight.sizes());

  GemmParams p{};
  at::Tensor scale_f, bias_f;
  const bool quantized = format == WeightFormat::Int8 || format == WeightFormat::Fp8E4M3 || format == WeightFormat::Int4;
  TORCH_CHECK(scale.has_value() || !quantized, kOp, weight.scalar_type(), " weights need a scale");
  if (scale.has_value()) scale_f = scale->to(at::kFloat).contiguous();
  if (format == WeightFormat::Int4) {
    TORCH_CHECK(group_size >= 16 && (group_size & (group_size - 1)) == 0 && K % group_size == 0, kOp,
                "group_size must be a power of two >= 16 dividing K = ", K, ", got ", group_size);
    TORCH_CHECK(scale_f.dim() == 2 && scale_f.size(0) == K / group_size && scale_f.size(1) == padded, kOp,
                "int4 scale must be [K / group_size, panels * 16] = [", K / group_size, ", ", padded, "], got ",
                scale_f.sizes());
    p.group_scale = scale_f.const_data_ptr<float>();
    while ((int64_t{1} << p.group_shift) < group_size) ++p.group_shift;
  } else if (scale_f.defined()) {
    TORCH_CHECK(scale_f.numel() == padded, kOp, "scale must have panels * 16 = ", padded, " values, got ",
                scale_f.sizes());
    p.col_scale = scale_f.const_data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, kOp, "bias must have n = ", n, " values, got ", bias->sizes());
    bias_f = bias->to(at::kFloat).contiguous();
    p.bias = bias_f.const_data_ptr<float>();
  }

  at::Tensor out = at::empty(out_shape(x, n), x.options().dtype(out_dtype));
  p.M = K == 0 ? 0 : x.numel() / K;
  // x as float32 [M, K]: converted here rather than by ATen ops, whose dispatch costs more than a
  // decode step's conversion (the GEMM runs ~120 times per step).
  const at::Tensor xc = x.contiguous();
  thread_local std::vector<float> x_float;
  if (xc.scalar_type() == at::kFloat) {
    p.x = xc.const_data_ptr<float>();
  } else {
    grow(x_float, p.M * K);
    if (xc.scalar_type() == at::kBFloat16) {
      to_float(xc.const_data_ptr<c10::BFloat16>(), x_float.data(), p.M * K);
    } else {
      to_float(xc.const_data_ptr<c10::Half>(), x_float.data(), p.M * K);
    }
    p.x = x_float.data();
  }
  p.K = K;
  p.w = weight.const_data_ptr();
  p.format = format;
  p.out = out.mutable_data_ptr();
  p.out_type = out_type_of(out_dtype);
  p.n = n;
  if (p.M == 0) return out;

  static const GemmPanelsFn kernel = select_kernel();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> scratch;
    grow(scratch, K * kPanel);
    kernel(p, begin, end, scratch.data());
  });
  return out;
}

// Rows `ids` of a packed [n, K] table (a tied embedding reads the lm_head's packed copy): element k
// of row i is packed[i / 16, k, i % 16]. An op of its own so that the compiler materializes the
// embedding once; as indexing it fused the strided gather into every consumer of the residual.
// T only fixes the element width: rows are copied bit for bit.
template <typename T>
void gather_rows(const void* packed, const int64_t* ids, void* rows, int64_t count, int64_t K) {
  const T* table = static_cast<const T*>(packed);
  T* out = static_cast<T*>(rows);
  at::parallel_for(0, count, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* column = table + (ids[i] / kPanel) * K * kPanel + ids[i] % kPanel;
      for (int64_t k = 0; k < K; ++k) out[i * K + k] = column[k * kPanel];
    }
  });
}

at::Tensor embedding_cpu(const at::Tensor& packed, const at::Tensor& ids, int64_t n) {
  constexpr const char* op = "kiln_cpp::embedding: ";
  check_packed(packed, op, "table");
  TORCH_CHECK(n > 0 && n <= packed.size(0) * kPanel, op, "n = ", n, " rows do not fit ", packed.size(0), " panels");
  TORCH_CHECK(ids.scalar_type() == at::kLong, op, "ids must be int64, got ", ids.scalar_type());
  const at::Tensor idc = ids.contiguous();
  const int64_t count = idc.numel(), K = packed.size(1);
  const int64_t* id = idc.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < count; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n, op, "token id ", id[i], " is outside the vocabulary [0, ", n, ")");
  }
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(K);
  at::Tensor out = at::empty(shape, packed.options());
  const void* table = packed.const_data_ptr();
  void* rows = out.mutable_data_ptr();
  switch (packed.element_size()) {
    case 1: gather_rows<uint8_t>(table, id, rows, count, K); break;
    case 2: gather_rows<uint16_t>(table, id, rows, count, K); break;
    case 4: gather_rows<uint32_t>(table, id, rows, count, K); break;
    default: TORCH_CHECK(false, op, "table must have 1-, 2- or 4-byte elements, got ", packed.scalar_type());
  }
  return out;
}

at::Tensor embedding_meta(const at::Tensor& packed, const at::Tensor& ids, int64_t n) {
  std::vector<c10::SymInt> shape(ids.sym_sizes().begin(), ids.sym_sizes().end());
  shape.push_back(packed.sym_size(1));
  return at::empty_symint(shape, packed.options());
}

// Symbolic sizes: torch.export traces with a dynamic number of tokens.
at::Tensor gemm_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                     const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  TORCH_CHECK(!shape.empty(), kOp, "x must have at least one dimension");
  shape.back() = n;
  return at::empty_symint(shape, x.options().dtype(out_float ? at::kFloat : x.scalar_type()));
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("gemm(Tensor x, Tensor weight, Tensor? scale, Tensor? bias, int n, int group_size=0, "
        "bool out_float=False) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("embedding(Tensor packed, Tensor ids, int n) -> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) {
  m.impl("gemm", &kiln::gemm_cpu);
  m.impl("embedding", &kiln::embedding_cpu);
}

TORCH_LIBRARY_IMPL(kiln_cpp, Meta, m) {
  m.impl("gemm", &kiln::gemm_meta);
  m.impl("embedding", &kiln::embedding_meta);
}
