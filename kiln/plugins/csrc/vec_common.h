// Vector helpers the kernel headers share, in the capability's namespace (CPU_CAPABILITY) of the
// translation unit that includes them; once per translation unit, which builds one capability.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <limits>

namespace kiln {
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, v);
}

inline float reduce_max(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, v);
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace kiln
