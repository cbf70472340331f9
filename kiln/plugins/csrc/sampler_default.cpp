// The sampler kernel for CPUs without a wider capability, and the fallback everywhere: plain C++
// and ATen's generic Vectorized<float>, no target options.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "sampler_kernel.h"
