// The elementwise kernels (elementwise.h), written once against at::vec::Vectorized<float> and
// compiled once per CPU capability, as paged_attention_kernel.h is. Each row is widened into a
// float buffer, computed there and rounded once into the output.
//
// No static data in this file (see paged_attention_kernel.h).

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_common.h"

#include "elementwise.h"

namespace kiln {
namespace CPU_CAPABILITY {
namespace {

// Round to nearest even, as Tensor.to does.
template <typename T>
inline void ew_narrow(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

inline void ew_widen_any(DType dtype, const void* src, float* dst, int64_t n) {
  switch (dtype) {
    case DType::BFloat16: return ew_widen(static_cast<const c10::BFloat16*>(src), dst, n);
    case DType::Half: return ew_widen(static_cast<const c10::Half*>(src), dst, n);
    default: return ew_widen(static_cast<const float*>(src), dst, n);
  }
}

template <typename T>
void rms_norm_impl(const NormParams& p, int64_t begin, int64_t end) {
  const int64_t n = p.dim;
  std::vector<float> buffer(2 * n);
  float* s = buffer.data();
  float* w = s + n;
  ew_widen_any(p.weight_dtype, p.weight, w, n);
  const T* x = static_cast<const T*>(p.x);
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + (r / p.inner) * p.outer_stride + (r % p.inner) * p.inner_stride;
    if (p.residual != nullptr) {
      const T* res = static_cast<const T*>(p.residual) + r * p.residual_stride;
      T* sum = static_cast<T*>(p.residual_out) + r * n;
      int64_t i = 0;
      for (; i + W <= n; i += W) (ew_load(xr + i) + ew_load(res + i)).store(s + i);
      for (; i < n; ++i) s[i] = static_cast<float>(xr[i]) + static_cast<float>(res[i]);
      ew_narrow(s, sum, n);
      if constexpr (!std::is_same_v<T, float>) ew_widen(sum, s, n);  // the norm of the rounded sum
    } else {
      ew_widen(xr, s, n);
    }
    Vec acc(0.f);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const Vec v = Vec::loadu(s + i);
      acc = at::vec::fmadd(v, v, acc);
    }
    float squares = reduce_add(acc);
    for (; i < n; ++i) squares += s[i] * s[i];
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + p.eps);
    const Vec vinv(inv);
    for (i = 0; i + W <= n; i += W) (Vec::loadu(s + i) * vinv * Vec::loadu(w + i)).store(s + i);
    for (; i < n; ++i) s[i] = s[i] * inv * w[i];
    ew_narrow(s, static_cast<T*>(p.out) + r * n, n);
  }
}

template <typename T>
void rope_heads(const T* src, int64_t stride_h, int64_t heads, const float* c, const float* sn, T* dst,
                int64_t D, int64_t half, float* a, float* b) {
  for (int64_t h = 0; h < heads; ++h) {
    ew_widen(src + h * stride_h, a, D);
    const float* x1 = a;
    const float* x2 = a + half;
    int64_t i = 0;
    for (; i + W <= half; i += W) {
      const Vec v1 = Vec::loadu(x1 + i), v2 = Vec::loadu(x2 + i);
      const Vec vc = Vec::loadu(c + i), vs = Vec::loadu(sn + i);
      (v1 * vc - v2 * vs).store(b + i);
      (v2 * vc + v1 * vs).store(b + half + i);
    }
    for (; i < half; ++i) {
      b[i] = x1[i] * c[i] - x2[i] * sn[i];
      b[half + i] = x2[i] * c[i] + x1[i] * sn[i];
    }
    std::memcpy(b + 2 * half, a + 2 * half, (D - 2 * half) * sizeof(float));
    ew_narrow(b, dst + h * D, D);
  }
}

template <typename T>
void rope_impl(const RopeParams& p, int64_t begin, int64_t end) {
  const int64_t D = p.head_dim, half = p.half;
  std::vector<float> buffer(2 * D);
  for (int64_t t = begin; t < end; ++t) {
    const float* c = p.cos + t * half;
    const float* sn = p.sin + t * half;
    rope_heads(static_cast<const T*>(p.q) + t * p.q_stride_t, p.q_stride_h, p.q_heads, c, sn,
               static_cast<T*>(p.q_out) + t * p.q_heads * D, D, half, buffer.data(), buffer.data() + D);
    rope_heads(static_cast<const T*>(p.k) + t * p.k_stride_t, p.k_stride_h, p.k_heads, c, sn,
               static_cast<T*>(p.k_out) + t * p.k_heads * D, D, half, buffer.data(), buffer.data() + D);
  }
}

template <typename T>
void silu_and_mul_impl(const SiluMulParams& p, int64_t begin, int64_t end) {
  const int64_t n = p.inter;
  std::vector<float> buffer(n);
  float* y = buffer.data();
  const Vec one(1.f);
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = static_cast<const T*>(p.x) + r * p.x_stride;
    const T* up = gate + n;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const Vec g = ew_load(gate + i);
      (g / (one + g.neg().exp_u20()) * ew_load(up + i)).store(y + i);
    }
    for (; i < n; ++i) {
      const float g = static_cast<float>(gate[i]);
      y[i] = g / (1.f + std::exp(-g)) * static_cast<float>(up[i]);
    }
    ew_narrow(y, static_cast<T*>(p.out) + r * n, n);
  }
}

}  // namespace

void rms_norm_rows(const NormParams& p, int64_t begin, int64_t end) {
  switch (p.dtype) {
    case DType::BFloat16: return rms_norm_impl<c10::BFloat16>(p, begin, end);
    case DType::Half: return rms_norm_impl<c10::Half>(p, begin, end);
    default: return rms_norm_impl<float>(p, begin, end);
  }
}

void rope_tokens(const RopeParams& p, int64_t begin, int64_t end) {
  switch (p.dtype) {
    case DType::BFloat16: return rope_impl<c10::BFloat16>(p, begin, end);
    case DType::Half: return rope_impl<c10::Half>(p, begin, end);
    default: return rope_impl<float>(p, begin, end);
  }
}

void silu_and_mul_rows(const SiluMulParams& p, int64_t begin, int64_t end) {
  switch (p.dtype) {
    case DType::BFloat16: return silu_and_mul_impl<c10::BFloat16>(p, begin, end);
    case DType::Half: return silu_and_mul_impl<c10::Half>(p, begin, end);
    default: return silu_and_mul_impl<float>(p, begin, end);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace kiln
