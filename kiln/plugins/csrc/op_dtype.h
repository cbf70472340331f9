// The ops' registration files' dtype check (paged_attention.cpp, elementwise.cpp, moe.cpp, lora.cpp):
// a tensor of float32, bfloat16 or float16, or an error naming the op and the input.
#pragma once

#include <ATen/core/Tensor.h>

#include "paged_attention.h"

namespace kiln {

inline DType float_dtype_of(const at::Tensor& t, const char* op, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::Float;
    case at::kBFloat16: return DType::BFloat16;
    case at::kHalf: return DType::Half;
    default: TORCH_CHECK(false, op, name, " must be float32, bfloat16 or float16, got ", t.scalar_type());
  }
}

}  // namespace kiln
