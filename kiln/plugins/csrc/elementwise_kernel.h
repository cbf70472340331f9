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
#include <utility>
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

// Elements i .. i + 2W of a row as floats: x, or x + residual rounded to T (and written to sum),
// widened again, since the norm is of the rounded sum.
template <typename T>
inline std::pair<Vec, Vec> norm_input(const T* x, const T* res, T* sum, int64_t i) {
  if (res == nullptr) return {ew_load(x + i), ew_load(x + i + W)};
  const Vec a = ew_load(x + i) + ew_load(res + i), b = ew_load(x + i + W) + ew_load(res + i + W);
  if constexpr (std::is_same_v<T, float>) {
    a.store(sum + i);
    b.store(sum + i + W);
    return {a, b};
  } else {
    const auto rounded = at::vec::convert_from_float<T>(a, b);
    rounded.store(sum + i);
    const auto [ra, rb] = at::vec::convert_to_float<T>(rounded);
    return {ra, rb};
  }
}

// Two passes per row: the (rounded) input and its squares, then the scaled output, 2W at a time.
template <typename T>
void rms_norm_impl(const NormParams& p, int64_t begin, int64_t end) {
  const int64_t n = p.dim, whole = n / (2 * W) * (2 * W);
  std::vector<float> buffer(2 * n);
  float* s = buffer.data();
  float* w = s + n;
  ew_widen_any(p.weight_dtype, p.weight, w, n);
  const T* x = static_cast<const T*>(p.x);
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + (r / p.inner) * p.outer_stride + (r % p.inner) * p.inner_stride;
    const T* res = p.residual == nullptr ? nullptr : static_cast<const T*>(p.residual) + r * p.residual_stride;
    T* sum = res == nullptr ? nullptr : static_cast<T*>(p.residual_out) + r * n;
    Vec acc(0.f);
    for (int64_t i = 0; i < whole; i += 2 * W) {
      const auto [a, b] = norm_input(xr, res, sum, i);
      a.store(s + i);
      b.store(s + i + W);
      acc = at::vec::fmadd(b, b, at::vec::fmadd(a, a, acc));
    }
    float squares = reduce_add(acc);
    for (int64_t i = whole; i < n; ++i) {
      float v = static_cast<float>(xr[i]);
      if (res != nullptr) {
        sum[i] = static_cast<T>(v + static_cast<float>(res[i]));
        v = static_cast<float>(sum[i]);
      }
      s[i] = v;
      squares += v * v;
    }
    const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + p.eps);
    const Vec vinv(inv);
    T* out = static_cast<T*>(p.out) + r * n;
    for (int64_t i = 0; i < whole; i += 2 * W) {
      const Vec a = Vec::loadu(s + i) * vinv * Vec::loadu(w + i);
      const Vec b = Vec::loadu(s + i + W) * vinv * Vec::loadu(w + i + W);
      if constexpr (std::is_same_v<T, float>) {
        a.store(out + i);
        b.store(out + i + W);
      } else {
        at::vec::convert_from_float<T>(a, b).store(out + i);
      }
    }
    for (int64_t i = whole; i < n; ++i) out[i] = static_cast<T>(s[i] * inv * w[i]);
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

// g / (1 + e^-g). Where the ISA has a reciprocal estimate, it and one Newton step replace the
// division (relative error ~2^-23), which otherwise bounds the loop; e^-g is capped at e^80 so that
// the estimate of a huge denominator is a tiny number, not 0 (Newton's d * r would be inf * 0).
inline Vec silu(Vec g) {
  const Vec d = Vec(1.f) + at::vec::minimum(g.neg(), Vec(80.f)).exp_u20();
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 r = _mm512_rcp14_ps(d);
  return g * Vec(_mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f))));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 r = _mm256_rcp_ps(d);
  return g * Vec(_mm256_mul_ps(r, _mm256_fnmadd_ps(d, r, _mm256_set1_ps(2.f))));
#else
  return g / d;
#endif
}

template <typename T>
void silu_and_mul_impl(const SiluMulParams& p, int64_t begin, int64_t end) {
  const int64_t n = p.inter;
  std::vector<float> buffer(n);
  float* y = buffer.data();
  for (int64_t r = begin; r < end; ++r) {
    const T* gate = static_cast<const T*>(p.x) + r * p.x_stride;
    const T* up = gate + n;
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      (silu(ew_load(gate + i)) * ew_load(up + i)).store(y + i);
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
