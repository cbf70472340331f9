// kiln_cpp::gemm's CPU implementation as plans, for ops that run GEMMs of their own (moe.cpp), and
// the packed layouts' helpers that the ops reading packed tables share (embedding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <vector>

#include "gemm.h"

namespace kiln {

// Up to this many rows a GEMM streams its weight (bandwidth-bound): it takes part in the pool's
// prefetch of the next weight (kiln::pool::weight_begins).
constexpr int64_t kPrefetchRows = 16;

// Where a GEMM's x goes once converted for its kernel (float32, padded bf16, int8 with block scales
// and compensations). Grown, never shrunk: calls reuse them.
struct GemmBuffers {
  std::vector<float> xf;
  std::vector<uint16_t> xb;
  std::vector<int8_t> xq;
  std::vector<float> xs;
  std::vector<int32_t> xcomp;
};

// One GEMM (gemm, or gemm_swiglu when swiglu) made ready to run: its kernel picked, x converted into
// buffers, the output allocated. run(begin, end) computes items [begin, end) of items(), on any
// thread; result() is the output once every item has run. kiln_cpp::gemm runs one plan over the
// thread pool; moe.cpp runs a step's experts' plans in one parallel loop. buffers must outlive it.
class GemmPlan {
 public:
  GemmPlan(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
           const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float,
           c10::IntArrayRef tactics, bool swiglu, GemmBuffers& buffers);
  // like's GEMM (its shape, format, bias and output type, all checked) on another weight of the same
  // shape, as a stack of experts holds them, with no tensor made: x [M, K] contiguous in like's x
  // dtype, weight and scale (in scale_type) that weight's packed panels and scales, out [M, fused() ?
  // n / 2 : n] in the output type. ATen's kernel, where the tactics pick it, runs here. It has no
  // result(): the output is out.
  GemmPlan(const GemmPlan& like, const void* x, int64_t M, const void* weight, const void* scale, void* out,
           c10::IntArrayRef tactics, GemmBuffers& buffers);
  int64_t items() const { return items_; }
  // The equal parts of the weight that items() splits alike: 2 when gate and up panels run together.
  int weight_parts() const { return fused_ ? 2 : 1; }
  // Whether a gemm_swiglu's output is the activation already (else the gate and up halves).
  bool fused() const { return fused_; }
  void run(int64_t begin, int64_t end) const;
  at::Tensor result() const;

 private:
  at::Tensor run_aten(const at::Tensor& x, const at::Tensor& weight) const;
  bool fuses(Kernel kernel) const;
  void prepare(Kernel kernel, const void* x, GemmBuffers& buffers);

  GemmParams p_{};
  GemmPanelsFn run_ = nullptr;
  int64_t items_ = 0, panels_ = 0;
  bool swiglu_ = false, fused_ = false;
  at::ScalarType x_type_;
  std::array<int64_t, 3> weight_sizes_{};
  at::ScalarType weight_dtype_ = at::kFloat;
  at::Tensor out_, xc_, scale_, bias_;
};

// kiln_cpp::gemm (gemm_swiglu when swiglu) over the thread pool.
at::Tensor run_gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                    const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float,
                    c10::IntArrayRef tactics, bool swiglu);

// The format of a packed weight, by its dtype (gemm.cpp's header has the layouts).
WeightFormat format_of(const at::Tensor& w);
OutType out_type_of(at::ScalarType t);
// The dtype of a format's scales: float16 group scales for int4, float32 column scales for the others.
at::ScalarType scale_type(WeightFormat f);

// k per stored row, the K padding and the row width of a format's panels.
struct Layout {
  int64_t k_per_row, pad_k, width;
};
Layout layout_of(WeightFormat f);
int64_t panel_rows_for(WeightFormat f, int64_t K);
// t is contiguous [panels, rows, width], else an error naming op and what.
void check_packed(const at::Tensor& t, const char* op, const char* what, int64_t width);

}  // namespace kiln
