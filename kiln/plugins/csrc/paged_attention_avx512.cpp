// The kernels (paged attention, sampler, elementwise) for ATen's AVX512 capability (AVX-512
// F/BW/VL/DQ + AVX2 + FMA + F16C), selected at run time by paged_attention.cpp, sampler.cpp and
// elementwise.cpp; built as kernels_avx2.cpp is.
#include "paged_attention_x86.h"

#if KILN_X86_KERNELS
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
#define __SSE3__ 1
#define __SSSE3__ 1
#define __SSE4_1__ 1
#define __SSE4_2__ 1
#define __AVX__ 1
#define __AVX2__ 1
#define __FMA__ 1
#define __F16C__ 1
#define __AVX512F__ 1
#define __AVX512BW__ 1
#define __AVX512VL__ 1
#define __AVX512DQ__ 1
#define CPU_CAPABILITY AVX512
#define CPU_CAPABILITY_AVX512
#include "elementwise_kernel.h"
#include "lora_kernel.h"
#include "paged_attention_kernel.h"
#include "sampler_kernel.h"
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif
