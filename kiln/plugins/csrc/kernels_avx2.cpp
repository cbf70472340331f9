// The kernels for ATen's AVX2 capability (AVX2 + FMA + F16C): paged attention, the sampler and the
// elementwise ops, selected at run time by paged_attention.cpp, sampler.cpp and elementwise.cpp,
// and the GEMM's float and int8-activation kernels, which gemm.cpp also runs on AVX-512 CPUs.
// Built into the same library as the rest, so the target options are set for this file only,
// here: cpp_extension has one set of flags for all sources. On other architectures and compilers
// the GEMM's AVX2 entry points forward to the DEFAULT ones (never selected: cpu_features() reports
// no AVX2 there).
#include "paged_attention_x86.h"

#if KILN_X86_KERNELS
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
// What -mavx2 -mfma -mf16c would define: a target pragma does not change the preprocessor's
// macros, and headers test them (sleef.h declares its AVX2 functions under __AVX2__; GCC's
// intrinsic headers then compile under this file's target instead of pushing their own).
#define __SSE3__ 1
#define __SSSE3__ 1
#define __SSE4_1__ 1
#define __SSE4_2__ 1
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#include "gemm_kernel.h"
#include "elementwise_kernel.h"
#include "lora_kernel.h"
#include "paged_attention_kernel.h"
#include "sampler_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
#include "gemm.h"
namespace kiln {
namespace AVX2 {
void gemm_panels(const GemmParams& p, int64_t b, int64_t e, void* s) { DEFAULT::gemm_panels(p, b, e, s); }
void gemm_int8_panels(const GemmParams& p, int64_t b, int64_t e, void* s) { DEFAULT::gemm_int8_panels(p, b, e, s); }
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int32_t offset, int64_t block, int8_t* xq,
                   int64_t ldxq, float* scale, int32_t* comp) {
  DEFAULT::quantize_rows(x, M, K, ldx, offset, block, xq, ldxq, scale, comp);
}
}  // namespace AVX2
}  // namespace kiln
#endif
