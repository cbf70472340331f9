// Which instruction-set features the GEMM kernels may use in this process: CPUID says what the CPU
// has, XCR0 what the OS saves on a context switch (AVX-512 and AMX state), and Linux lends AMX's
// 8 KiB tile state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM). A kernel whose
// features are missing is never called: the op falls back to one that runs (gemm.cpp).
//
// ATEN_CPU_CAPABILITY (default | avx2 | avx512, ATen's own override) and KILN_CPU_ISA
// (default | avx2 | avx512 | avx512_bf16 | amx) cap the features, so that every kernel this CPU
// could skip is testable on it, and an engine can be tried as it would run on an older CPU.

#include <cctype>
#include <cstdlib>
#include <cstring>
#include <string>

#include "gemm.h"
#include "paged_attention_x86.h"

#if KILN_X86_KERNELS
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace kiln {
namespace {

#if KILN_X86_KERNELS
bool cpuid(unsigned leaf, unsigned sub, unsigned (&r)[4]) {
  return __get_cpuid_count(leaf, sub, &r[0], &r[1], &r[2], &r[3]) != 0;
}

uint64_t xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t{hi} << 32) | lo;
}

bool amx_permitted() {
#if defined(__linux__)
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

uint32_t probe() {
  unsigned l1[4], l7[4] = {}, l7s1[4] = {};
  if (!cpuid(1, 0, l1)) return 0;
  const bool osxsave = (l1[2] >> 27) & 1;
  if (!osxsave) return 0;
  const uint64_t xcr = xcr0();
  cpuid(7, 0, l7);
  cpuid(7, 1, l7s1);
  const auto bit = [](unsigned reg, int b) { return ((reg >> b) & 1u) != 0; };
  uint32_t f = 0;
  const bool ymm = (xcr & 0x6) == 0x6, zmm = (xcr & 0xe6) == 0xe6, tiles = (xcr & 0x60000) == 0x60000;
  if (ymm && bit(l7[1], 5) && bit(l1[2], 12) && bit(l1[2], 29)) f |= kAvx2;  // AVX2, FMA, F16C
  if ((f & kAvx2) && zmm && bit(l7[1], 16) && bit(l7[1], 17) && bit(l7[1], 30) && bit(l7[1], 31)) f |= kAvx512;
  if ((f & kAvx512) && bit(l7s1[0], 5)) f |= kAvx512Bf16;
  if ((f & kAvx512) && bit(l7[2], 11)) f |= kAvx512Vnni;
  // AMX-TILE (edx 24) with AMX-BF16 (22) / AMX-INT8 (25); the kernels also use AVX-512 around them.
  if ((f & kAvx512Bf16) && tiles && bit(l7[3], 24) && (bit(l7[3], 22) || bit(l7[3], 25)) && amx_permitted()) {
    if (bit(l7[3], 22)) f |= kAmxBf16;
    if (bit(l7[3], 25)) f |= kAmxInt8;
  }
  return f;
}
#else
uint32_t probe() { return 0; }
#endif

uint32_t ceiling(const char* value) {
  if (value == nullptr || *value == '\0') return ~0u;
  std::string v(value);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (v == "default") return 0;
  if (v == "avx2") return kAvx2;
  if (v == "avx512") return kAvx2 | kAvx512;
  if (v == "avx512_bf16") return kAvx2 | kAvx512 | kAvx512Bf16 | kAvx512Vnni;
  return ~0u;  // "amx" or anything else: no cap (ATen ignores values it does not know, too)
}

}  // namespace

uint32_t cpu_features() {
  static const uint32_t features =
      probe() & ceiling(std::getenv("ATEN_CPU_CAPABILITY")) & ceiling(std::getenv("KILN_CPU_ISA"));
  return features;
}

const char* feature_names(uint32_t mask, char* buffer, int64_t size) {
  static const char* const names[] = {"avx2", "avx512", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8"};
  buffer[0] = '\0';
  for (int i = 0; i < 6; ++i) {
    if (!(mask & (1u << i))) continue;
    if (buffer[0] != '\0') std::strncat(buffer, ",", size - std::strlen(buffer) - 1);
    std::strncat(buffer, names[i], size - std::strlen(buffer) - 1);
  }
  return buffer;
}

}  // namespace kiln
