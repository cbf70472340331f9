// kiln_cpp::gemm's CPU implementation, for ops that run GEMMs of their own (moe.cpp), and the packed
// layouts' helpers that the ops reading packed tables share (embedding.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "gemm.h"

namespace kiln {

at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float,
                c10::IntArrayRef tactics);

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
