// kiln_cpp::gemm: the C++ CPU GEMM plugin for linear layers with packed (and quantized) weights.
//
//   gemm(x [..., K], weight, scale?, bias?, n, group_size, out_float, tactics) -> [..., n]
//   gemm_swiglu(x [..., K], weight, scale?, bias?, n, group_size, tactics) -> [..., n / 2]:
//     silu(y[..., :n / 2]) * y[..., n / 2:] of y = gemm(x, ...), a gated MLP's up projection and
//     activation in one call (the bf16 kernels apply it to the float accumulators in their epilogue)
//   gemm_kernels(weight, x_dtype, group_size) -> int[]: the kernels that run here for that weight
//
// weight holds the [n, K] matrix in panels of 16 output columns (kiln/plugins/gemm.py packs it at
// build time; rows past n and k past K are zero):
//   float32 / float16 / float8_e4m3fn [panels, K, 16];
//   bfloat16 [panels, Kb / 2, 32], Kb = K rounded up to 32: element [p, r, 2j + e] is column
//     16p + j at k = 2r + e (k pairs: a vdpbf16ps operand; 16 rows are an AMX B tile);
//   int8 [panels, Kq / 4, 64], Kq = K rounded up to 64: [p, r, 4j + e] is column 16p + j at k = 4r + e
//     (k quads, a vpdpbusd operand), with scale [panels * 16]: w = q * scale (W8A16, SmoothQuant);
//   uint8 (int4) [panels, K / 8, 64]: bytes 4j .. 4j + 3 of row r hold column 16p + j's eight k
//     8r .. 8r + 7, byte e's low nibble k = 8r + e and its high nibble k = 8r + 4 + e, two's
//     complement, with float16 scale [K / group_size, panels * 16]: w = q * scale[k / group_size];
//   fp8 with scale [panels * 16]: w = fp8 * scale (FP8, W4A8).
// x is float32, bfloat16 or float16; the result is x's dtype (float32 with out_float), computed in
// float32. bias, if given, has n values.
//
// tactics picks the kernel by the call's token count M: pairs (m_max, kernel id, gemm.h's Kernel)
// in increasing m_max, the first with M <= m_max, else the last (empty: Kernel::Auto). engine-build
// times the kernels per GEMM and token bucket and stores the winners in the graph. A kernel this
// CPU cannot run (an engine built elsewhere) falls back, with a warning, to one that does the same
// arithmetic: int8-activation kernels to another int8-activation kernel, the others to Auto. So an
// engine never executes an instruction its CPU lacks.
//
// Registered with a Meta kernel, so torch.export traces it and an AOTInductor package calls it
// without Python, as kiln_cpp::paged_attention.

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <array>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "c_shim.h"
#include "elementwise.h"
#include "gemm_op.h"
#include "op_dtype.h"
#include "thread_pool.h"
#include "paged_attention_x86.h"

namespace kiln {
namespace {
constexpr const char* kOp = "kiln_cpp::gemm: ";
}  // namespace

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

Layout layout_of(WeightFormat f) {
  switch (f) {
    case WeightFormat::BFloat16: return {kPairK, kBf16PadK, kPairK * kPanel};
    case WeightFormat::Int8: return {kQuadK, kInt8PadK, kQuadK * kPanel};
    case WeightFormat::Int4: return {kInt4K, kInt4K, 4 * kPanel};
    default: return {1, 1, kPanel};
  }
}

int64_t panel_rows_for(WeightFormat f, int64_t K) {
  const Layout l = layout_of(f);
  return round_up(K, l.pad_k) / l.k_per_row;
}

void check_packed(const at::Tensor& t, const char* op, const char* what, int64_t width) {
  TORCH_CHECK(t.dim() == 3 && t.size(2) == width && t.is_contiguous(), op, what, " must be contiguous [panels, rows, ",
              width, "] (kiln.plugins.gemm packs it; engines built before the ", width,
              "-wide layout must be rebuilt), got shape ", t.sizes());
}

namespace {

// -- kernels ------------------------------------------------------------------------------------

struct KernelInfo {
  const char* name;
  uint32_t needs;  // features
  bool int8_act;   // quantizes x to int8 (int8 and int4 weights only)
  bool bf16_x;     // multiplies x in bf16 (bf16 x only)
};

const std::array<KernelInfo, kNumKernels> kKernels = {{
    {"auto", 0, false, false},
    {"portable", 0, false, false},
    {"avx2", kAvx2, false, false},
    {"avx512_bf16", kAvx512Bf16, false, true},
    {"amx_bf16", kAmxBf16, false, true},
    {"aten", 0, false, false},
    {"avx2_int8", kAvx2, true, false},
    {"avx512_vnni", kAvx512Vnni, true, false},
    {"portable_int8", 0, true, false},
}};

bool formats_fit(const KernelInfo& k, WeightFormat f, at::ScalarType x) {
  if (k.int8_act) return f == WeightFormat::Int8 || f == WeightFormat::Int4;
  return !k.bf16_x || x == at::kBFloat16;
}

bool runs_here(Kernel kernel, WeightFormat f, at::ScalarType x) {
  const KernelInfo& k = kKernels[static_cast<int>(kernel)];
  return (cpu_features() & k.needs) == k.needs && formats_fit(k, f, x);
}

// The untimed choice: the float kernels' arithmetic (bf16 weights on the bf16 units, where they
// are exact up to the order of the sums; the other formats on the float kernels).
Kernel auto_kernel(int64_t M, WeightFormat f, at::ScalarType x) {
  if (f == WeightFormat::BFloat16 && x == at::kBFloat16) {
    if (M >= 16 && runs_here(Kernel::AmxBf16, f, x)) return Kernel::AmxBf16;
    if (runs_here(Kernel::Avx512Bf16, f, x)) return Kernel::Avx512Bf16;
  }
  return (cpu_features() & kAvx2) ? Kernel::Avx2 : Kernel::Portable;
}

Kernel fallback(Kernel wanted, int64_t M, WeightFormat f, at::ScalarType x) {
  if (kKernels[static_cast<int>(wanted)].int8_act) {
    for (Kernel k : {Kernel::Avx512Vnni, Kernel::Avx2Int8, Kernel::PortableInt8})
      if (runs_here(k, f, x)) return k;
  }
  return auto_kernel(M, f, x);
}

// KILN_GEMM_KERNEL=<name>: that kernel for every call whose operands it takes, whatever the tactics
// say (benchmarks/quant.py measures the perplexity of int8 activations at every token count so).
int forced_kernel() {
  static const int forced = [] {
    const char* name = std::getenv("KILN_GEMM_KERNEL");
    for (int i = 0; name != nullptr && i < kNumKernels; ++i)
      if (std::string(name) == kKernels[i].name) return i;
    TORCH_CHECK(name == nullptr || *name == '\0', kOp, "KILN_GEMM_KERNEL=", name, " is not a kernel name");
    return -1;
  }();
  return forced;
}

// k per activation scale. The int8-activation kernels turn each block's integer sums into float (4
// instructions per accumulator beside the block's k / 4 vpdpbusd), which at 32 k held prefill GEMMs
// back: int8 weights (a scale per column) take blocks of kMaxActBlock, as llama.cpp's k-quants take
// 256; int4 ones their group, which needs its own conversion anyway, up to that. SmolLM-135M's four
// GEMMs of a layer at M = 512, Zen 4, 2 threads, int8 / int4 g64 weights: 32 k 6.00 / 6.23 ms,
// now 5.37 / 5.77. Perplexity of the default model with int8 activations, int8_wo: -0.01% -> +0.03%.
int64_t act_block_for(WeightFormat f, int64_t group_shift) {
  return f == WeightFormat::Int4 ? std::min(kMaxActBlock, int64_t{1} << group_shift) : kMaxActBlock;
}

Kernel pick(const c10::IntArrayRef tactics, int64_t M, WeightFormat f, at::ScalarType x) {
  TORCH_CHECK(tactics.size() % 2 == 0, kOp, "tactics must be (m_max, kernel) pairs, got ", tactics.size(), " values");
  Kernel wanted = Kernel::Auto;
  for (size_t i = 0; i < tactics.size(); i += 2) {
    TORCH_CHECK(tactics[i + 1] >= 0 && tactics[i + 1] < kNumKernels, kOp, "unknown kernel id ", tactics[i + 1],
                " in tactics (this kiln knows 0 .. ", kNumKernels - 1, ")");
    wanted = static_cast<Kernel>(tactics[i + 1]);
    if (M <= tactics[i]) break;
  }
  if (forced_kernel() >= 0 && formats_fit(kKernels[forced_kernel()], f, x)) wanted = static_cast<Kernel>(forced_kernel());
  if (wanted == Kernel::Auto) return auto_kernel(M, f, x);
  if (runs_here(wanted, f, x)) return wanted;
  const Kernel instead = fallback(wanted, M, f, x);
  const KernelInfo& k = kKernels[static_cast<int>(wanted)];
  static std::mutex mutex;
  static std::array<bool, kNumKernels> warned{};
  std::lock_guard<std::mutex> lock(mutex);
  if (!warned[static_cast<int>(wanted)]) {
    warned[static_cast<int>(wanted)] = true;
    char missing[128];
    feature_names(k.needs & ~cpu_features(), missing, sizeof missing);
    TORCH_WARN("kiln_cpp::gemm: this engine's GEMM tactic '", k.name, "' ",
               missing[0] ? std::string("needs ") + missing + ", which this CPU lacks"
                          : std::string("does not take these operands"),
               "; running '", kKernels[static_cast<int>(instead)].name,
               "' instead (rebuild the engine on this machine to time the kernels it has)");
  }
  return instead;
}

// -- buffers ------------------------------------------------------------------------------------

// Per-thread buffers only grow: resizing down and up again, as calls alternate between layers of
// different K, would zero the regrown part every time.
template <typename T>
T* grown(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

void* aligned_scratch(int64_t bytes) {
  thread_local std::vector<uint8_t> scratch;
  uint8_t* base = grown(scratch, bytes + 64);
  return base + (-reinterpret_cast<uintptr_t>(base) & 63);
}

template <typename T>
float to_f(T v) { return static_cast<float>(v); }

// x [M, K] (x_type) as float32 rows of stride ldx, zero past K.
const float* float_x(const void* x, at::ScalarType x_type, int64_t M, int64_t K, int64_t ldx,
                     std::vector<float>& buffer) {
  if (x_type == at::kFloat && ldx == K) return static_cast<const float*>(x);
  float* out = grown(buffer, M * ldx);
  kiln::pool::parallel_for(0, M, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      float* row = out + m * ldx;
      switch (x_type) {
        case at::kFloat: std::memcpy(row, static_cast<const float*>(x) + m * K, K * sizeof(float)); break;
        case at::kBFloat16: {
          const c10::BFloat16* in = static_cast<const c10::BFloat16*>(x) + m * K;
          for (int64_t k = 0; k < K; ++k) row[k] = in[k];
          break;
        }
        default: {
          const c10::Half* in = static_cast<const c10::Half*>(x) + m * K;
          for (int64_t k = 0; k < K; ++k) row[k] = in[k];
        }
      }
      std::fill(row + K, row + ldx, 0.0f);
    }
  });
  return out;
}

// bf16 x as [rows, ldxb]: x itself when its layout already fits, else a zero-padded copy.
const uint16_t* bf16_x(const void* xv, int64_t M, int64_t K, int64_t ldxb, int64_t rows,
                       std::vector<uint16_t>& buffer) {
  const auto* x = static_cast<const uint16_t*>(xv);
  if (ldxb == K && rows == M) return x;
  uint16_t* out = grown(buffer, rows * ldxb);
  for (int64_t m = 0; m < rows; ++m) {
    uint16_t* row = out + m * ldxb;
    if (m < M) std::memcpy(row, x + m * K, K * sizeof(uint16_t));
    std::fill(row + (m < M ? K : 0), row + ldxb, uint16_t{0});
  }
  return out;
}

// The weight as a dense [n, K] matrix in dtype (quantized ones dequantized, their scales folded in).
at::Tensor dense_weight(const at::Tensor& w, const GemmParams& p, at::ScalarType dtype) {
  const int64_t P = w.size(0), R = w.size(1);
  at::Tensor d;
  switch (p.format) {
    case WeightFormat::BFloat16: {  // k pairs are 32-bit units: a transpose of them, in parallel
      d = at::empty({P * kPanel, R * 2}, w.options());
      const auto* in = reinterpret_cast<const uint32_t*>(w.const_data_ptr<c10::BFloat16>());
      auto* out = reinterpret_cast<uint32_t*>(d.mutable_data_ptr<c10::BFloat16>());
      kiln::pool::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
        for (int64_t panel = begin; panel < end; ++panel)
          for (int64_t r = 0; r < R; ++r)
            for (int64_t j = 0; j < kPanel; ++j) out[(panel * kPanel + j) * R + r] = in[(panel * R + r) * kPanel + j];
      });
      d = d.to(dtype);
      break;
    }
    case WeightFormat::Int8: {
      const at::Tensor s = at::from_blob(const_cast<float*>(p.col_scale), {P * kPanel, 1}, at::kFloat);
      d = (w.view({P, R, kPanel, 4}).permute({0, 2, 1, 3}).reshape({P * kPanel, R * 4}).to(at::kFloat) * s).to(dtype);
      break;
    }
    case WeightFormat::Int4: {
      const at::Tensor b = w.view({P, R, kPanel, 4}).to(at::kInt);
      const at::Tensor lo = ((b & 15) ^ 8) - 8, hi = ((at::bitwise_right_shift(b, 4) & 15) ^ 8) - 8;
      const at::Tensor q = at::cat({lo, hi}, -1).permute({0, 2, 1, 3}).reshape({P * kPanel, R * 8});
      const at::Tensor gs =
          at::from_blob(const_cast<uint16_t*>(p.group_scale), {p.K >> p.group_shift, P * kPanel}, at::kHalf).to(at::kFloat);
      d = (q.to(at::kFloat) * gs.t().repeat_interleave(int64_t{1} << p.group_shift, 1)).to(dtype);
      break;
    }
    default: {
      at::Tensor f = w.permute({0, 2, 1}).reshape({P * kPanel, R}).to(at::kFloat);
      if (p.col_scale != nullptr) f = f * at::from_blob(const_cast<float*>(p.col_scale), {P * kPanel, 1}, at::kFloat);
      d = f.to(dtype);
    }
  }
  return d.narrow(0, 0, p.n).narrow(1, 0, p.K);
}

std::vector<int64_t> out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  TORCH_CHECK(!shape.empty(), kOp, "x must have at least one dimension");
  shape.back() = n;
  return shape;
}

// silu(y[..., :I]) * y[..., I:] of a contiguous y [..., 2I], on the elementwise op's kernel: gemm_swiglu
// on the kernels that do not fuse it.
at::Tensor swiglu_of(const at::Tensor& y) {
  const int64_t I = y.size(-1) / 2, rows = I == 0 ? 0 : y.numel() / (2 * I);
  at::Tensor out = at::empty(out_shape(y, I), y.options());
  const SiluMulParams sp{float_dtype_of(y, kOp, "x"), y.const_data_ptr(), out.mutable_data_ptr(), I, 2 * I};
  kiln::pool::parallel_for(0, rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(1, I)),
                           [&](int64_t begin, int64_t end) { silu_and_mul(sp, begin, end); });
  return out;
}

}  // namespace

GemmPlan::GemmPlan(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                   const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float,
                   c10::IntArrayRef tactics, bool swiglu, GemmBuffers& buffers)
    : swiglu_(swiglu), x_type_(x.scalar_type()) {
  TORCH_CHECK(!swiglu || n % 2 == 0, kOp, "gemm_swiglu needs n = 2 x the gated width (gate and up), got n = ", n);
  const WeightFormat format = format_of(weight);
  const at::ScalarType out_dtype = out_float ? at::kFloat : x.scalar_type();
  out_type_of(x.scalar_type());
  const int64_t K = x.size(-1);
  const Layout layout = layout_of(format);
  check_packed(weight, kOp, "weight", layout.width);
  const int64_t panels = weight.size(0), padded = panels * kPanel;
  TORCH_CHECK(n > padded - kPanel && n <= padded, kOp, "n = ", n, " does not match ", panels, " weight panels");
  TORCH_CHECK(weight.size(1) == panel_rows_for(format, K) && (format != WeightFormat::Int4 || K % 16 == 0), kOp,
              "x has K = ", K, " input features but weight is ", weight.sizes());

  GemmParams& p = p_;
  const bool quantized = format == WeightFormat::Int8 || format == WeightFormat::Fp8E4M3 || format == WeightFormat::Int4;
  TORCH_CHECK(scale.has_value() || !quantized, kOp, weight.scalar_type(), " weights need a scale");
  // int4 group scales are float16 (pack_int4 writes them so; float32 ones, from engines built before,
  // are converted here on every call), the others float32.
  if (scale.has_value()) {
    const at::ScalarType type = scale_type(format);
    scale_ = scale->scalar_type() == type && scale->is_contiguous() ? *scale : scale->to(type).contiguous();
  }
  if (format == WeightFormat::Int4) {
    TORCH_CHECK(group_size >= 32 && (group_size & (group_size - 1)) == 0 && K % group_size == 0, kOp,
                "group_size must be a power of two >= 32 dividing K = ", K, ", got ", group_size);
    TORCH_CHECK(scale_.dim() == 2 && scale_.size(0) == K / group_size && scale_.size(1) == padded, kOp,
                "int4 scale must be [K / group_size, panels * 16] = [", K / group_size, ", ", padded, "], got ",
                scale_.sizes());
    p.group_scale = reinterpret_cast<const uint16_t*>(scale_.const_data_ptr<at::Half>());
    while ((int64_t{1} << p.group_shift) < group_size) ++p.group_shift;
  } else if (scale_.defined()) {
    TORCH_CHECK(scale_.numel() == padded, kOp, "scale must have panels * 16 = ", padded, " values, got ",
                scale_.sizes());
    p.col_scale = scale_.const_data_ptr<float>();
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == n, kOp, "bias must have n = ", n, " values, got ", bias->sizes());
    bias_ = bias->to(at::kFloat).contiguous();
    p.bias = bias_.const_data_ptr<float>();
  }
  p.M = K == 0 ? 0 : x.numel() / K;
  p.K = K;
  p.w = weight.const_data_ptr();
  p.format = format;
  p.panel_rows = weight.size(1);
  p.n = n;
  p.out_type = out_type_of(out_dtype);
  weight_sizes_ = {weight.size(0), weight.size(1), weight.size(2)};
  weight_dtype_ = weight.scalar_type();
  panels_ = panels;
  if (p.M == 0) {  // nothing to compute (and no weight for ATen's kernel to unpack)
    out_ = at::empty(out_shape(x, n), x.options().dtype(out_dtype));
    return;
  }
  const Kernel kernel = pick(tactics, p.M, format, x.scalar_type());
  if (kernel == Kernel::Aten) {
    out_ = run_aten(x, weight);
    swiglu_ = false;
    return;
  }
  fused_ = fuses(kernel);
  out_ = at::empty(out_shape(x, fused_ ? n / 2 : n), x.options().dtype(out_dtype));
  p.out = out_.mutable_data_ptr();
  xc_ = x.contiguous();
  prepare(kernel, xc_.const_data_ptr(), buffers);
}

GemmPlan::GemmPlan(const GemmPlan& like, const void* x, int64_t M, const void* weight, const void* scale, void* out,
                   c10::IntArrayRef tactics, GemmBuffers& buffers)
    : p_(like.p_), swiglu_(like.swiglu_), x_type_(like.x_type_), weight_sizes_(like.weight_sizes_),
      weight_dtype_(like.weight_dtype_), panels_(like.panels_), bias_(like.bias_) {
  GemmParams& p = p_;
  p.M = M;
  p.w = weight;
  p.out = out;
  if (p.format == WeightFormat::Int4) p.group_scale = static_cast<const uint16_t*>(scale);
  else if (p.col_scale != nullptr) p.col_scale = static_cast<const float*>(scale);
  if (M == 0) return;
  const Kernel kernel = pick(tactics, M, p.format, x_type_);
  if (kernel == Kernel::Aten) {
    const auto w = at::from_blob(const_cast<void*>(weight), weight_sizes_, at::TensorOptions().dtype(weight_dtype_));
    const auto xt = at::from_blob(const_cast<void*>(x), {M, p.K}, at::TensorOptions().dtype(x_type_));
    const at::Tensor y = run_aten(xt, w);
    at::from_blob(out, y.sizes(), y.options()).copy_(y);
    fused_ = swiglu_;  // out holds the activation already
    return;
  }
  fused_ = fuses(kernel);
  prepare(kernel, x, buffers);
}

// ATen's matmul on the weight unpacked to a dense matrix, computed here (it brings its own threads).
at::Tensor GemmPlan::run_aten(const at::Tensor& x, const at::Tensor& weight) const {
  kiln::pool::OmpThreadsScope threads;
  at::Tensor y = at::linear(x, dense_weight(weight, p_, x.scalar_type()));  // scales folded into the weight
  if (bias_.defined()) y = y + bias_;
  const at::ScalarType out_dtype = p_.out_type == OutType::Float ? at::kFloat : x.scalar_type();
  return swiglu_ ? swiglu_of(y.to(out_dtype).contiguous()) : y.to(out_dtype);
}

// The bf16 kernels (AMX, AVX-512-BF16), and VNNI's past one row, pair each gate panel with its up
// panel and apply the activation to their accumulators; the others write y and result() activates
// it. (VNNI's GEMV reads four panels at once instead.)
bool GemmPlan::fuses(Kernel kernel) const {
  return swiglu_ && p_.n % (2 * kPanel) == 0 &&
         (kernel == Kernel::AmxBf16 || kernel == Kernel::Avx512Bf16 || (kernel == Kernel::Avx512Vnni && p_.M > 1));
}

void GemmPlan::prepare(Kernel kernel, const void* x, GemmBuffers& buffers) {
  GemmParams& p = p_;
  const int64_t K = p.K;
  p.swiglu_panels = fused_ ? panels_ / 2 : 0;
  const bool avx2 = (cpu_features() & kAvx2) != 0;
  switch (kernel) {
    case Kernel::Avx512Bf16:
    case Kernel::AmxBf16: {
      const bool amx = kernel == Kernel::AmxBf16;
      const int64_t ldxb = (K % (amx ? kBf16PadK : 2) == 0) ? K : round_up(K, kBf16PadK);
      p.ldxb = ldxb;
      p.xb = bf16_x(x, p.M, K, ldxb, amx ? round_up(p.M, 16) : p.M, buffers.xb);
      run_ = amx ? &amx::gemm_bf16_panels : &avx512::gemm_bf16_panels;
      break;
    }
    case Kernel::Avx2Int8:
    case Kernel::Avx512Vnni:
    case Kernel::PortableInt8: {
      const bool int4 = p.format == WeightFormat::Int4;
      const int32_t offset = kernel == Kernel::Avx512Vnni ? (int4 ? 8 : 128) : kernel == Kernel::Avx2Int8 && int4 ? 8 : 0;
      p.act_block = act_block_for(p.format, p.group_shift);
      p.ldxq = round_up(K, p.act_block);
      const int64_t blocks = p.ldxq / p.act_block;
      int8_t* q = grown(buffers.xq, p.M * p.ldxq);
      float* s = grown(buffers.xs, p.M * blocks);
      int32_t* c = grown(buffers.xcomp, p.M * blocks);
      const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1));
      // AVX-512 quantizes bf16 or float32 x as it is: the float copy and the AVX2 build's loops cost
      // 7% of an int8 prefill. SmolLM-135M, a layer's GEMMs at M = 512, Zen 4, 2 threads: int8 5.54
      // -> 5.07 ms, int4 g64 5.77 -> 5.39.
      const bool bf16 = x_type_ == at::kBFloat16;
      if ((cpu_features() & kAvx512) && (bf16 || x_type_ == at::kFloat)) {
        const char* x0 = static_cast<const char*>(x);
        const int64_t elem = c10::elementSize(x_type_);
        kiln::pool::parallel_for(0, p.M, grain, [&](int64_t begin, int64_t end) {
          avx512::quantize_rows(x0 + begin * K * elem, bf16, end - begin, K, K, offset, p.act_block,
                                q + begin * p.ldxq, p.ldxq, s + begin * blocks, c + begin * blocks);
        });
      } else {
        const float* xf = float_x(x, x_type_, p.M, K, K, buffers.xf);
        kiln::pool::parallel_for(0, p.M, grain, [&](int64_t begin, int64_t end) {
          auto quantize = avx2 ? &AVX2::quantize_rows : &DEFAULT::quantize_rows;
          quantize(xf + begin * K, end - begin, K, K, offset, p.act_block, q + begin * p.ldxq, p.ldxq,
                   s + begin * blocks, c + begin * blocks);
        });
      }
      p.xq = q;
      p.xq_scale = s;
      p.xq_comp = c;
      run_ = kernel == Kernel::Avx512Vnni ? &avx512::gemm_vnni_panels
             : kernel == Kernel::Avx2Int8 ? &AVX2::gemm_int8_panels
                                          : &DEFAULT::gemm_int8_panels;
      break;
    }
    default: {  // float kernels: x as float32, zero-padded to whole stored rows of k
      p.ldx = K % layout_of(p.format).k_per_row == 0 ? K : round_up(K, kInt4K);
      p.x = float_x(x, x_type_, p.M, K, p.ldx, buffers.xf);
      run_ = kernel == Kernel::Avx2 ? &AVX2::gemm_panels : &DEFAULT::gemm_panels;
    }
  }
  // Items are pairs of panels (the kernels' blocks are two or four panels wide, and an odd share
  // would leave a half-width block at its end), or gate panels when the activation is fused.
  items_ = fused_ ? p.swiglu_panels : (panels_ + 1) / 2;
}

void GemmPlan::run(int64_t begin, int64_t end) const {
  if (begin >= end) return;  // nothing left to compute: ATen's plan ran whole in the constructor, or M = 0
  void* scratch = aligned_scratch(scratch_bytes(p_.K));
  if (fused_) return run_(p_, begin, end, scratch);
  run_(p_, 2 * begin, std::min(2 * end, panels_), scratch);
}

at::Tensor GemmPlan::result() const { return swiglu_ && !fused_ ? swiglu_of(out_) : out_; }

at::ScalarType scale_type(WeightFormat f) { return f == WeightFormat::Int4 ? at::kHalf : at::kFloat; }

at::Tensor run_gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                    const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float,
                    c10::IntArrayRef tactics, bool swiglu) {
  thread_local GemmBuffers buffers;
  const GemmPlan plan(x, weight, scale, bias, n, group_size, out_float, tactics, swiglu, buffers);
  // A few rows: a GEMV that streams the weight, worth fetching ahead (thread_pool.h).
  const bool streams = x.dim() > 0 && x.numel() <= kPrefetchRows * x.size(-1);
  const void* w = weight.const_data_ptr();
  if (streams) kiln::pool::weight_begins(w, weight.numel() * weight.element_size(), plan.weight_parts());
  kiln::pool::parallel_for(0, plan.items(), 1, [&](int64_t begin, int64_t end) { plan.run(begin, end); });
  if (streams) kiln::pool::weight_ends(w);
  return plan.result();
}

namespace {

at::Tensor gemm_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                    const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float,
                    c10::IntArrayRef tactics) {
  return run_gemm(x, weight, scale, bias, n, group_size, out_float, tactics, false);
}

at::Tensor gemm_swiglu_cpu(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                           const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size,
                           c10::IntArrayRef tactics) {
  return run_gemm(x, weight, scale, bias, n, group_size, false, tactics, true);
}

std::vector<int64_t> gemm_kernels(const at::Tensor& weight, at::ScalarType x_dtype) {
  const WeightFormat f = format_of(weight);
  std::vector<int64_t> ids;
  for (int i = 1; i < kNumKernels; ++i)
    if (runs_here(static_cast<Kernel>(i), f, x_dtype)) ids.push_back(i);
  return ids;
}

std::vector<int64_t> gemm_kernels_op(const at::Tensor& weight, at::ScalarType x_dtype) { return gemm_kernels(weight, x_dtype); }

std::string cpu_feature_names() {
  char names[128];
  return feature_names(cpu_features(), names, sizeof names);
}

std::string kernel_name(int64_t id) {
  TORCH_CHECK(id >= 0 && id < kNumKernels, kOp, "unknown kernel id ", id);
  return kKernels[id].name;
}

std::vector<int64_t> kernel_info(int64_t id) {  // (needed features, int8 activations, bf16 x)
  TORCH_CHECK(id >= 0 && id < kNumKernels, kOp, "unknown kernel id ", id);
  const KernelInfo& k = kKernels[id];
  return {k.needs, k.int8_act, k.bf16_x};
}

// Symbolic sizes: torch.export traces with a dynamic number of tokens.
at::Tensor gemm_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                     const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float,
                     c10::IntArrayRef tactics) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  TORCH_CHECK(!shape.empty(), kOp, "x must have at least one dimension");
  shape.back() = n;
  return at::empty_symint(shape, x.options().dtype(out_float ? at::kFloat : x.scalar_type()));
}

at::Tensor gemm_swiglu_meta(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                            const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size,
                            c10::IntArrayRef tactics) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  TORCH_CHECK(!shape.empty(), kOp, "x must have at least one dimension");
  TORCH_CHECK(n % 2 == 0, kOp, "gemm_swiglu needs n = 2 x the gated width (gate and up), got n = ", n);
  shape.back() = n / 2;
  return at::empty_symint(shape, x.options());
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("gemm(Tensor x, Tensor weight, Tensor? scale, Tensor? bias, int n, int group_size=0, "
        "bool out_float=False, int[] tactics=[]) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("gemm_swiglu(Tensor x, Tensor weight, Tensor? scale, Tensor? bias, int n, int group_size=0, "
        "int[] tactics=[]) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  // The kernels that run on this CPU for a weight (its packed dtype) and x dtype: gemm.h's ids.
  m.def("gemm_kernels(Tensor weight, ScalarType x_dtype) -> int[]", &kiln::gemm_kernels_op);
  m.def("gemm_kernel_name(int id) -> str", &kiln::kernel_name);
  // (needed feature mask, quantizes x to int8, multiplies x in bf16)
  m.def("gemm_kernel_info(int id) -> int[]", &kiln::kernel_info);
  // The features this process may use, e.g. "avx2,avx512,avx512_bf16,avx512_vnni,amx_bf16,amx_int8".
  m.def("cpu_features() -> str", &kiln::cpu_feature_names);
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) {
  m.impl("gemm", &kiln::gemm_cpu);
  m.impl("gemm_swiglu", &kiln::gemm_swiglu_cpu);
}

TORCH_LIBRARY_IMPL(kiln_cpp, Meta, m) {
  m.impl("gemm", &kiln::gemm_meta);
  m.impl("gemm_swiglu", &kiln::gemm_swiglu_meta);
}

namespace ks = kiln::shim;

KILN_C_SHIM(gemm, (AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* scale, AtenTensorHandle* bias,
                   int64_t n, int64_t group_size, int32_t out_float, const int64_t* tactics, int64_t tactics_len,
                   AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(gemm, *out = ks::handle(kiln::gemm_cpu(ks::tensor(x), ks::tensor(weight), ks::optional(scale),
                                                          ks::optional(bias), n, group_size, out_float != 0,
                                                          ks::ints(tactics, tactics_len))));
}

KILN_C_SHIM(gemm_swiglu, (AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* scale, AtenTensorHandle* bias,
                          int64_t n, int64_t group_size, const int64_t* tactics, int64_t tactics_len,
                          AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(gemm_swiglu, *out = ks::handle(kiln::gemm_swiglu_cpu(
                                    ks::tensor(x), ks::tensor(weight), ks::optional(scale), ks::optional(bias), n,
                                    group_size, ks::ints(tactics, tactics_len))));
}
