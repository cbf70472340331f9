// Shared by the elementwise ops' registration (elementwise.cpp) and their per-CPU-capability kernels
// (elementwise_kernel.h): RMSNorm, residual add + RMSNorm, rotary embedding, SiLU-and-multiply.
// Plain data only, as in paged_attention.h. Every kernel widens to float, computes in float and
// rounds once on store, as kiln/plugins/reference.py specifies.
#pragma once

#include <cstdint>

#include "paged_attention.h"

namespace kiln {

// Rows of `dim` elements; row r starts at (r / inner) * outer_stride + (r % inner) * inner_stride
// (elements), so a [T, H, D] view of the fused QKV output is read in place. out is contiguous.
// With residual set: s = x + residual is rounded to dtype and written to residual_out (contiguous),
// and the norm is taken of that rounded sum.
struct NormParams {
  DType dtype;
  const void* x;
  const void* residual;
  const void* weight;  // [dim], in weight_dtype (dtype or float)
  DType weight_dtype;
  void* out;
  void* residual_out;
  int64_t rows, dim, inner, outer_stride, inner_stride, residual_stride;
  float eps;
};

// GPT-NeoX rotation of the first 2 * half dims of each head of q [T, Hq, D] and k [T, Hk, D]
// (strided in T and H, contiguous in D); the rest of each head is copied. cos/sin [T, half] float.
struct RopeParams {
  DType dtype;
  const void* q;
  const void* k;
  const float* cos;
  const float* sin;
  void* q_out;  // contiguous
  void* k_out;
  int64_t q_heads, k_heads, head_dim, half;
  int64_t q_stride_t, q_stride_h, k_stride_t, k_stride_h;
};

// out[r, i] = silu(x[r, i]) * x[r, inter + i]; x rows `x_stride` apart, out contiguous [rows, inter].
struct SiluMulParams {
  DType dtype;
  const void* x;
  void* out;
  int64_t inter, x_stride;
};

#define KILN_DECLARE_ELEMENTWISE_KERNELS(CAP)                                                     \
  namespace CAP {                                                                                \
  void rms_norm_rows(const NormParams& p, int64_t begin, int64_t end);                           \
  void rope_tokens(const RopeParams& p, int64_t begin, int64_t end);                             \
  void silu_and_mul_rows(const SiluMulParams& p, int64_t begin, int64_t end);                    \
  }

KILN_DECLARE_ELEMENTWISE_KERNELS(DEFAULT)
KILN_DECLARE_ELEMENTWISE_KERNELS(AVX2)
KILN_DECLARE_ELEMENTWISE_KERNELS(AVX512)

// Rows (tokens) [begin, end) on this CPU's kernels, for ops with loops of their own (moe.cpp,
// attention.cpp).
void silu_and_mul(const SiluMulParams& p, int64_t begin, int64_t end);
void rope_tokens(const RopeParams& p, int64_t begin, int64_t end);
// All of p's rows, over the thread pool (rms_norm's own loop).
void run_norm(const NormParams& p);

}  // namespace kiln
