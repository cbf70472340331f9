// The sampler kernel for ATen's AVX2 capability (AVX2 + FMA + F16C), selected at run time by
// sampler.cpp; built as kernels_avx2.cpp is (the target options are set for this file only).
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
#include "sampler_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
