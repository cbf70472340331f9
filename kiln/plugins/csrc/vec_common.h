// Vector helpers the kernel headers share, in the capability's namespace (CPU_CAPABILITY) of the
// translation unit that includes them; once per translation unit, which builds one capability.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>
#include <limits>
#include <type_traits>

namespace kiln {
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// W floats from float, bf16 or fp16 values.
template <typename T>
inline Vec ew_load(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else {
    Vec x;
    at::vec::load_to_float(src, x);
    return x;
  }
}

template <typename T>
inline void ew_widen(const T* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) ew_load(src + i).store(dst + i);
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

inline float reduce_add(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return a + b; }, v);
}

inline float reduce_max(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec a, Vec b) { return at::vec::maximum(a, b); }, v);
}

}  // namespace
}  // namespace CPU_CAPABILITY
}  // namespace kiln
