// The kernel for CPUs without a wider capability (and the fallback everywhere): ATen's generic
// Vectorized<float>, no target options.
#define CPU_CAPABILITY DEFAULT
#define CPU_CAPABILITY_DEFAULT
#include "paged_attention_kernel.h"
