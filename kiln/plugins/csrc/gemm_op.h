// kiln_cpp::gemm's CPU implementation as plans, for ops that run GEMMs of their own (moe.cpp), and
// the packed layouts' helpers that the ops reading packed tables share (embedding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

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
  int64_t items() const { return items_; }
  // The equal parts of the weight that items() splits alike: 2 when gate and up panels run together.
  int weight_parts() const { return fused_ ? 2 : 1; }
  void run(int64_t begin, int64_t end) const;
  at::Tensor result() const;

 private:
  GemmParams p_{};
  GemmPanelsFn run_ = nullptr;
  int64_t items_ = 0, panels_ = 0;
  bool swiglu_ = false, fused_ = false;
  at::Tensor out_, xc_, scale_, bias_;
};

// kiln_cpp::gemm (gemm_swiglu when swiglu) over the thread pool.
at::Tensor run_gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                    const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float,
                    c10::IntArrayRef tactics, bool swiglu);

// The format of a packed weight, by its dtype (gemm.cpp's header has the layouts).
WeightFormat format_of(const at::Tensor& w);
OutType out_type_of(at::ScalarType t);

// k per stored row, the K padding and the row width of a format's panels.
struct Layout {
  int64_t k_per_row, pad_k, width;
};
Layout layout_of(WeightFormat f);
int64_t panel_rows_for(WeightFormat f, int64_t K);
// t is contiguous [panels, rows, width], else an error naming op and what.
void check_packed(const at::Tensor& t, const char* op, const char* what, int64_t width);

}  // namespace kiln
