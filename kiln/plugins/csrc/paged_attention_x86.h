// Whether the AVX2 / AVX-512 kernels are built: x86-64 with a GCC-compatible compiler (target
// options per file). Everywhere else only the DEFAULT kernel exists. No includes, so that it can
// come before the target options.
#pragma once

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define KILN_X86_KERNELS 1
#else
#define KILN_X86_KERNELS 0
#endif
