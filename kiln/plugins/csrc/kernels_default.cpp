// The kernels (paged attention, GEMM, sampler, elementwise) for CPUs without a wider capability, and the fallback
// everywhere: plain C++ and ATen's generic Vectorized<float>, no target options.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "gemm_kernel.h"
#include "elementwise_kernel.h"
#include "lora_kernel.h"
#include "paged_attention_kernel.h"
#include "sampler_kernel.h"
