// Shared by the op's registration (gemm.cpp), the CPU feature probe (cpu_features.cpp) and the
// kernels: per ATen CPU capability (kernels_{default,avx2}.cpp), AVX-512 (gemm_avx512.cpp) and AMX
// (gemm_amx.cpp). Plain data only, as in paged_attention.h.
#pragma once

#include <cstdint>

namespace kiln {

// How a weight panel stores its values (gemm.cpp has the layouts).
enum class WeightFormat : int32_t { Float = 0, BFloat16 = 1, Half = 2, Int8 = 3, Fp8E4M3 = 4, Int4 = 5 };
enum class OutType : int32_t { Float = 0, BFloat16 = 1, Half = 2 };

// Columns per panel: one AVX-512 register of floats, two AVX2 ones.
constexpr int64_t kPanel = 16;
// k per stored row of a panel: bf16 in pairs (what vdpbf16ps and AMX B tiles read), int8 in
// quads (vpdpbusd, AMX-INT8), int4 in eights (one 32-bit word of nibbles per column).
constexpr int64_t kPairK = 2, kQuadK = 4, kInt4K = 8;
// bf16 / int8 panels are zero-padded along K to whole AMX tiles (32 bf16 or 64 int8 k).
constexpr int64_t kBf16PadK = 32, kInt8PadK = 64;
// Up to this many rows the float kernels decode weights in the inner loop (one pass over them,
// bandwidth bound); past it, each panel is decoded once into a scratch that every row block reuses.
constexpr int64_t kDirectRows = 6;
// Activations of the integer kernels are quantized in blocks of k with one scale each: kMaxActBlock
// k for int8 weights (one scale per column), int4 ones' group size up to that. The kernels turn
// their integer sums into float once per block (see act_block_for in gemm.cpp).
constexpr int64_t kMaxActBlock = 128;

inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

// Instruction-set features a kernel needs (cpu_features.cpp probes them: CPUID, the OS's XCR0,
// and for AMX Linux's arch_prctl permission).
enum Feature : uint32_t {
  kAvx2 = 1u << 0,        // with FMA and F16C
  kAvx512 = 1u << 1,      // F, BW, VL, DQ
  kAvx512Bf16 = 1u << 2,  // vdpbf16ps
  kAvx512Vnni = 1u << 3,  // vpdpbusd
  kAmxBf16 = 1u << 4,     // AMX-TILE + AMX-BF16, permitted by the kernel
  kAmxInt8 = 1u << 5,
};
// The features this process may use: what the CPU and OS offer, capped by ATEN_CPU_CAPABILITY and
// KILN_CPU_ISA (default | avx2 | avx512 | avx512_bf16 | amx).
uint32_t cpu_features();
// "avx2,avx512,..." for a mask.
const char* feature_names(uint32_t mask, char* buffer, int64_t size);

// The GEMM's kernels ("tactics": engine-build times them per GEMM and token-count bucket and the
// op runs the winner). Ids are stored in engines: append only.
enum class Kernel : int32_t {
  Auto = 0,        // the op's own choice for this CPU (no timing)
  Portable = 1,    // plain C++
  Avx2 = 2,        // float FMAs on weights decoded in registers
  Avx512Bf16 = 3,  // vdpbf16ps on bf16 pair panels (other formats decoded into them)
  AmxBf16 = 4,     // AMX tiles on bf16 pair panels
  Aten = 5,        // the weight unpacked to a dense matrix, then ATen's matmul (oneDNN / MKL)
  Avx2Int8 = 6,    // activations quantized to int8: vpmaddubsw / vpmaddwd
  Avx512Vnni = 7,  // activations quantized to int8: vpdpbusd
  PortableInt8 = 8,
};
constexpr int32_t kNumKernels = 9;

struct GemmParams {
  const float* x;      // float kernels: [M, ldx] float32 (k past K zero up to the format's k per row)
  int64_t ldx;
  const uint16_t* xb;  // bf16 kernels: [M rounded up to 32 rows, ldxb] bf16 bits, zero-padded
  int64_t ldxb;
  const int8_t* xq;    // int8 kernels: [M, ldxq] int8, k past K zero
  int64_t ldxq;
  int64_t act_block;        // k per activation block (act_block_for): a power of two; int4: its group or a part of it
  const float* xq_scale;    // [M, ldxq / act_block]: x[m, k] ~ xq[m, k] * xq_scale[m, k / act_block]
  const int32_t* xq_comp;   // [M, ldxq / act_block]: offset * sum of the block's xq (see the kernels)
  int64_t M, K;
  const void* w;  // the packed panels (gemm.cpp)
  WeightFormat format;
  int64_t panel_rows;        // stored rows per panel (K / k per row, padded)
  const float* col_scale;    // [panels * 16] or nullptr: multiplies each output column
  const uint16_t* group_scale;  // Int4: [K / group_size, panels * 16] float16 bits (as q4_0's block scales)
  int64_t group_shift;       // log2(group_size)
  const float* bias;         // [n] or nullptr
  void* out;                 // [M, n], row stride n
  OutType out_type;
  int64_t n;  // output columns (panels * 16 rounded down to n)
  // gemm_swiglu on a kernel that fuses it (AMX, AVX-512-BF16): > 0, the gate's panels, and the panel range a kernel
  // is given counts them: it multiplies panel j and up panel j + swiglu_panels and stores
  // silu(gate) * up into out [M, 16 * swiglu_panels].
  int64_t swiglu_panels;
};

// Per-thread scratch every kernel fits in: a panel pair decoded (float or bf16) plus a tile buffer.
inline int64_t scratch_bytes(int64_t K) { return round_up(K, kInt8PadK) * kPanel * 4 * 2 + 32 * 32 * 4 + 4096; }

using GemmPanelsFn = void (*)(const GemmParams&, int64_t panel_begin, int64_t panel_end, void* scratch);

#define KILN_DECLARE_GEMM_KERNEL(CAP)                                                              \
  namespace CAP {                                                                                  \
  void gemm_panels(const GemmParams& p, int64_t panel_begin, int64_t panel_end, void* scratch);    \
  void gemm_int8_panels(const GemmParams& p, int64_t panel_begin, int64_t panel_end, void* scratch); \
  void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int32_t offset, int64_t block, \
                     int8_t* xq, int64_t ldxq, float* scale, int32_t* comp);                       \
  }

KILN_DECLARE_GEMM_KERNEL(DEFAULT)
KILN_DECLARE_GEMM_KERNEL(AVX2)

namespace avx512 {
void gemm_bf16_panels(const GemmParams& p, int64_t panel_begin, int64_t panel_end, void* scratch);
void gemm_vnni_panels(const GemmParams& p, int64_t panel_begin, int64_t panel_end, void* scratch);
// DEFAULT::quantize_rows' results, from float32 x or (bf16) bf16 x, with no float copy first
void quantize_rows(const void* x, bool bf16, int64_t M, int64_t K, int64_t ldx, int32_t offset, int64_t block,
                   int8_t* xq, int64_t ldxq, float* scale, int32_t* comp);
}  // namespace avx512
namespace amx {
void gemm_bf16_panels(const GemmParams& p, int64_t panel_begin, int64_t panel_end, void* scratch);
}  // namespace amx

}  // namespace kiln
