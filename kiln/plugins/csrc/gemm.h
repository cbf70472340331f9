// Shared by the op's registration (gemm.cpp) and the per-CPU-capability kernels
// (kernels_{default,avx2}.cpp). Plain data only, as in paged_attention.h.
#pragma once

#include <cstdint>

namespace kiln {

// How a weight panel stores its values (see gemm.cpp for the layouts).
enum class WeightFormat : int32_t { Float = 0, BFloat16 = 1, Half = 2, Int8 = 3, Fp8E4M3 = 4, Int4 = 5 };
enum class OutType : int32_t { Float = 0, BFloat16 = 1, Half = 2 };

// Columns per panel: two AVX2 registers of floats.
constexpr int64_t kPanel = 16;
// Up to this many rows the kernel decodes weights in the inner loop (one pass over them, bandwidth
// bound); past it, each panel is decoded once into a float scratch that every row block reuses.
constexpr int64_t kDirectRows = 6;

struct GemmParams {
  const float* x;  // [M, K] float32, contiguous
  int64_t M, K;
  const void* w;  // [panels, K, 16] (Int4: [panels, K / 2, 16] bytes, two k per byte)
  WeightFormat format;
  const float* col_scale;    // [panels * 16] or nullptr: multiplies each output column
  const float* group_scale;  // Int4: [K / group_size, panels * 16]
  int64_t group_shift;       // log2(group_size)
  const float* bias;         // [n] or nullptr
  void* out;                 // [M, n], row stride n
  OutType out_type;
  int64_t n;  // output columns (panels * 16 rounded down to n)
};

// scratch: K * kPanel floats per thread when M > kDirectRows (a panel decoded once), else unused.
using GemmPanelsFn = void (*)(const GemmParams&, int64_t panel_begin, int64_t panel_end, float* scratch);

#define KILN_DECLARE_GEMM_KERNEL(CAP) \
  namespace CAP {                     \
  void gemm_panels(const GemmParams& p, int64_t panel_begin, int64_t panel_end, float* scratch); \
  }

KILN_DECLARE_GEMM_KERNEL(DEFAULT)
KILN_DECLARE_GEMM_KERNEL(AVX2)

}  // namespace kiln
