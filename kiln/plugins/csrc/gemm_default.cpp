// The GEMM kernel for CPUs without AVX2 (and the fallback everywhere): plain C++, no target options.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "gemm_kernel.h"
