// kiln_cpp::gemm's CPU implementation, for ops that run GEMMs of their own (moe.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace kiln {

at::Tensor gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                const std::optional<at::Tensor>& bias, int64_t n, int64_t group_size, bool out_float,
                c10::IntArrayRef tactics);

}  // namespace kiln
