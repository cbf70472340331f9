// The weight-panel GEMM kernel, compiled once per CPU capability as paged_attention_kernel.h is:
// kernels_<cap>.cpp defines CPU_CAPABILITY (the namespace) and the target options, then includes this.
//
// out[M, n] = x[M, K] . W^T, times a per-column scale, plus bias. W is stored in panels of 16 output
// columns, [panels, K, 16]: a panel is one contiguous stream, a thread's share of the panels is one
// contiguous range, and each k of a panel is two 8-float registers after decoding. So:
//  - M <= kDirectRows (decode, small batches): weights are decoded in the inner loop and read once,
//    with 1-6 rows of x broadcast against them: a GEMV at memory bandwidth, in whatever width the
//    weights are stored (bf16, fp16, int8, fp8, int4), which is what weight-only quantization buys.
//    One or two rows read several panels at once, as several streams (see direct).
//  - M > kDirectRows (prefill, large batches): each panel is decoded once into a float scratch
//    (16 x K, L1/L2 resident) and a 6 x 16 register tile of FMAs runs every row block over it: the
//    decode cost is paid once per panel instead of once per row, and the loop is FMA-bound.
// The AVX2 path uses raw intrinsics (the decodes are bit manipulations at::vec has no words for);
// the DEFAULT path is plain C++ with the same semantics, for CPUs without AVX2.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

#include "gemm.h"

namespace kiln {
namespace CPU_CAPABILITY {
namespace {

// fp8 e4m3 bits land in an fp16 (sign, then exponent and mantissa shifted up by 7): exact,
// subnormals included, but with a bias of 15 instead of 7, i.e. 2^-8 of the value.
constexpr float kFp8Factor = 256.0f;

inline float column_factor(const GemmParams& p) {
  return p.format == WeightFormat::Fp8E4M3 ? kFp8Factor : 1.0f;
}

#if defined(CPU_CAPABILITY_AVX2)

// With the hardware prefetchers alone a core streams a panel from DRAM at ~13 GB/s, where a plain
// sum reads ~17; asking for the line 512 bytes ahead, once per line of a panel, made the batch-1
// layer GEMMs faster in every paired run (bf16 +2-40% in 8 of 8, int8 +11-36% in 3 of 3).
constexpr int64_t kPrefetchBytes = 512;

// At k of a panel whose rows of 16 weights are RowBytes wide (<= 64): one prefetch per line.
template <int64_t RowBytes>
inline void prefetch_ahead(const void* row, int64_t k) {
  if (k % (64 / RowBytes) == 0) _mm_prefetch(static_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
}

// -- decoders: 16 weights of row k of one panel, as two 8-float registers ----------------------

// Float weights streamed from memory, or (Stream = false) a panel decoded into the cache-resident
// scratch, which the tile loop of a larger batch reads with nothing to prefetch.
template <bool Stream>
struct F32PanelOf {
  const float* w;
  void operator()(int64_t k, __m256& a, __m256& b) const {
    if constexpr (Stream) prefetch_ahead<64>(w + k * kPanel, k);
    a = _mm256_loadu_ps(w + k * kPanel);
    b = _mm256_loadu_ps(w + k * kPanel + 8);
  }
};
using F32Panel = F32PanelOf<true>;
using ScratchPanel = F32PanelOf<false>;

struct BF16Panel {
  const uint16_t* w;
  void operator()(int64_t k, __m256& a, __m256& b) const {
    prefetch_ahead<32>(w + k * kPanel, k);
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel + 8));
    a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(lo), 16));
    b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(hi), 16));
  }
};

struct HalfPanel {
  const uint16_t* w;
  void operator()(int64_t k, __m256& a, __m256& b) const {
    prefetch_ahead<32>(w + k * kPanel, k);
    a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel)));
    b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel + 8)));
  }
};

struct Int8Panel {
  const int8_t* w;
  void operator()(int64_t k, __m256& a, __m256& b) const {
    // Two 8-byte loads widen straight from memory: no byte shift on the shuffle ports.
    prefetch_ahead<16>(w + k * kPanel, k);
    a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * kPanel))));
    b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k * kPanel + 8))));
  }
};

struct Fp8Panel {
  const uint8_t* w;
  void operator()(int64_t k, __m256& a, __m256& b) const {
    prefetch_ahead<16>(w + k * kPanel, k);
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k * kPanel)));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7f)), 7);
    const __m256i h = _mm256_or_si256(sign, rest);
    a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
};

// int4: two k per byte, low nibble first, each a two's-complement q in [-8, 7]. Masking a nibble
// into a byte's high half gives the int8 16 * q, so a sign-extending widen decodes it; the 1/16 joins
// the group scale, which multiplies a group's partial sums rather than every weight.
inline void int4_pair(const uint8_t* w, int64_t k, __m256& l0, __m256& l1, __m256& h0, __m256& h1) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (k >> 1) * kPanel));
  const __m128i high = _mm_set1_epi8(static_cast<char>(0xf0));
  const __m128i lo = _mm_and_si128(_mm_slli_epi16(v, 4), high), hi = _mm_and_si128(v, high);
  l0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  l1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  h0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  h1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}

struct Int4Panel {
  const uint8_t* w;
  const float* scale;  // this panel's column 0 of group_scale
  int64_t scale_stride;
  int64_t group_shift;

  void group_scale(int64_t group, __m256& s0, __m256& s1) const {
    const __m256 sixteenth = _mm256_set1_ps(1.0f / 16.0f);
    s0 = _mm256_mul_ps(_mm256_loadu_ps(scale + group * scale_stride), sixteenth);
    s1 = _mm256_mul_ps(_mm256_loadu_ps(scale + group * scale_stride + 8), sixteenth);
  }

  // The whole panel as floats (scales applied) into scratch [K, 16].
  void decode(int64_t K, float* out) const {
    for (int64_t group = 0; group < (K >> group_shift); ++group) {
      __m256 s0, s1;
      group_scale(group, s0, s1);
      for (int64_t k = group << group_shift; k < (group + 1) << group_shift; k += 2) {
        __m256 l0, l1, h0, h1;
        int4_pair(w, k, l0, l1, h0, h1);
        _mm256_storeu_ps(out + k * kPanel, _mm256_mul_ps(l0, s0));
        _mm256_storeu_ps(out + k * kPanel + 8, _mm256_mul_ps(l1, s1));
        _mm256_storeu_ps(out + (k + 1) * kPanel, _mm256_mul_ps(h0, s0));
        _mm256_storeu_ps(out + (k + 1) * kPanel + 8, _mm256_mul_ps(h1, s1));
      }
    }
  }
};

// -- the register tile ----------------------------------------------------------------------------

// acc[j][m] = sum_k x[m, k] * w[j][k, 0:16] for NP panels and MR rows. KU independent partial
// sums per output (k = u mod KU), added up at the end, keep the FMA pipes busy when NP * MR is small
// (an FMA waits for the previous one on its register). An output's sum depends on KU but not on NP,
// so KU is fixed per MR: results do not depend on how the panels were split between threads.
template <int MR, int KU, int NP, class Panel>
inline void tile(const Panel* w, const float* x, int64_t ldx, int64_t K, __m256 (&acc)[NP][MR][2]) {
  __m256 part[KU][NP][MR][2];
#pragma GCC unroll 8
  for (int u = 0; u < KU; ++u)
    for (int j = 0; j < NP; ++j)
      for (int m = 0; m < MR; ++m) part[u][j][m][0] = part[u][j][m][1] = _mm256_setzero_ps();
  auto step = [&](int u, int64_t k) {
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      __m256 a, b;
      w[j](k, a, b);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);
        part[u][j][m][0] = _mm256_fmadd_ps(xv, a, part[u][j][m][0]);
        part[u][j][m][1] = _mm256_fmadd_ps(xv, b, part[u][j][m][1]);
      }
    }
  };
  int64_t k = 0;
  for (; k + KU <= K; k += KU) {
#pragma GCC unroll 8
    for (int u = 0; u < KU; ++u) step(u, k + u);
  }
  for (; k < K; ++k) step(0, k);
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < MR; ++m) {
      acc[j][m][0] = part[0][j][m][0];
      acc[j][m][1] = part[0][j][m][1];
      for (int u = 1; u < KU; ++u) {
        acc[j][m][0] = _mm256_add_ps(acc[j][m][0], part[u][j][m][0]);
        acc[j][m][1] = _mm256_add_ps(acc[j][m][1], part[u][j][m][1]);
      }
    }
}

inline __m128i to_bf16(__m256 v) {  // round to nearest even
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline void store_row(const GemmParams& p, int64_t row, int64_t col0, int64_t cols, __m256 lo, __m256 hi) {
  const int64_t at = row * p.n + col0;
  if (cols == kPanel) {
    switch (p.out_type) {
      case OutType::Float:
        _mm256_storeu_ps(static_cast<float*>(p.out) + at, lo);
        _mm256_storeu_ps(static_cast<float*>(p.out) + at + 8, hi);
        return;
      case OutType::BFloat16: {
        auto* out = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p.out) + at);
        _mm_storeu_si128(out, to_bf16(lo));
        _mm_storeu_si128(out + 1, to_bf16(hi));
        return;
      }
      case OutType::Half: {
        auto* out = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p.out) + at);
        _mm_storeu_si128(out, _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEAREST_INT));
        _mm_storeu_si128(out + 1, _mm256_cvtps_ph(hi, _MM_FROUND_TO_NEAREST_INT));
        return;
      }
    }
  }
  float tmp[kPanel];
  _mm256_storeu_ps(tmp, lo);
  _mm256_storeu_ps(tmp + 8, hi);
  for (int64_t j = 0; j < cols; ++j) {
    switch (p.out_type) {
      case OutType::Float: static_cast<float*>(p.out)[at + j] = tmp[j]; break;
      case OutType::BFloat16: static_cast<c10::BFloat16*>(p.out)[at + j] = c10::BFloat16(tmp[j]); break;
      case OutType::Half: static_cast<c10::Half*>(p.out)[at + j] = c10::Half(tmp[j]); break;
    }
  }
}

template <int MR>
inline void finish(const GemmParams& p, int64_t row0, int64_t panel, __m256 (&acc)[MR][2]) {
  const int64_t col0 = panel * kPanel, cols = std::min(kPanel, p.n - col0);
  __m256 s0 = _mm256_set1_ps(column_factor(p)), s1 = s0;
  if (p.col_scale != nullptr) {
    s0 = _mm256_mul_ps(s0, _mm256_loadu_ps(p.col_scale + col0));
    s1 = _mm256_mul_ps(s1, _mm256_loadu_ps(p.col_scale + col0 + 8));
  }
  float bias[kPanel] = {};
  if (p.bias != nullptr) std::memcpy(bias, p.bias + col0, cols * sizeof(float));
  const __m256 b0 = _mm256_loadu_ps(bias), b1 = _mm256_loadu_ps(bias + 8);
  for (int m = 0; m < MR; ++m)
    store_row(p, row0 + m, col0, cols, _mm256_fmadd_ps(acc[m][0], s0, b0), _mm256_fmadd_ps(acc[m][1], s1, b1));
}

// Rows row0 .. row0 + MR of NP consecutive panels from `panel` on.
template <int MR, int NP = 1, class Panel>
inline void rows(const GemmParams& p, const Panel* w, int64_t row0, int64_t panel, int64_t K) {
  constexpr int KU = MR <= 2 ? 2 : 1;
  __m256 acc[NP][MR][2];
  tile<MR, KU, NP>(w, p.x + row0 * p.K, p.K, K, acc);
  for (int j = 0; j < NP; ++j) finish<MR>(p, row0, panel + j, acc[j]);
}

// One k pair of the int4 direct path: even k into partial set L, odd k into set H (compile-time
// indices, so the partial sums stay in registers).
template <int MR, int L, int H, int S>
inline void int4_step(const uint8_t* w, const float* x, int64_t ldx, int64_t k, __m256 (&part)[S][MR][2]) {
  __m256 l0, l1, h0, h1;
  int4_pair(w, k, l0, l1, h0, h1);
#pragma GCC unroll 8
  for (int m = 0; m < MR; ++m) {
    const __m256 x0 = _mm256_broadcast_ss(x + m * ldx + k), x1 = _mm256_broadcast_ss(x + m * ldx + k + 1);
    part[L][m][0] = _mm256_fmadd_ps(x0, l0, part[L][m][0]);
    part[L][m][1] = _mm256_fmadd_ps(x0, l1, part[L][m][1]);
    part[H][m][0] = _mm256_fmadd_ps(x1, h0, part[H][m][0]);
    part[H][m][1] = _mm256_fmadd_ps(x1, h1, part[H][m][1]);
  }
}

// The direct path for int4: per group, partial sums for even and odd k (for 1-2 rows; more rows
// are independent chains already) keep the FMA pipes busy; the group scale then folds them into acc.
// On AVX2 the widening costs about as many instructions per weight as bf16's, so int4 buys
// bandwidth, not compute: at batch 1 it runs at about 1.3-1.5x bf16, not 4x.
template <int MR, int NP = 1>
inline void rows(const GemmParams& p, const Int4Panel* panel_w, int64_t row0, int64_t panel, int64_t K) {
  static_assert(NP == 1, "int4 panels are read one at a time");
  const Int4Panel& w = *panel_w;
  constexpr int S = MR <= 2 ? 2 : 1;
  const float* x = p.x + row0 * p.K;
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t group = 0; group < (K >> w.group_shift); ++group) {
    __m256 part[S][MR][2];
#pragma GCC unroll 8
    for (int u = 0; u < S; ++u)
      for (int m = 0; m < MR; ++m) part[u][m][0] = part[u][m][1] = _mm256_setzero_ps();
    const int64_t end = (group + 1) << w.group_shift;  // groups are >= 16 k: whole steps of 4
    for (int64_t k = group << w.group_shift; k < end; k += 4) {
      prefetch_ahead<16>(w.w + (k >> 1) * kPanel, k >> 1);  // a pair of k per 16 bytes
      if constexpr (S == 2) {
        int4_step<MR, 0, 1>(w.w, x, p.K, k, part);
        int4_step<MR, 0, 1>(w.w, x, p.K, k + 2, part);
      } else {
        int4_step<MR, 0, 0>(w.w, x, p.K, k, part);
        int4_step<MR, 0, 0>(w.w, x, p.K, k + 2, part);
      }
    }
    __m256 s0, s1;
    w.group_scale(group, s0, s1);
#pragma GCC unroll 8
    for (int m = 0; m < MR; ++m) {
      __m256 a = part[0][m][0], b = part[0][m][1];
#pragma GCC unroll 4
      for (int u = 1; u < S; ++u) {
        a = _mm256_add_ps(a, part[u][m][0]);
        b = _mm256_add_ps(b, part[u][m][1]);
      }
      acc[m][0] = _mm256_fmadd_ps(a, s0, acc[m][0]);
      acc[m][1] = _mm256_fmadd_ps(b, s1, acc[m][1]);
    }
  }
  finish<MR>(p, row0, panel, acc);
}

template <class Panel>
void rows_any(const GemmParams& p, const Panel& w, int64_t row0, int64_t count, int64_t panel) {
  switch (count) {
    case 1: return rows<1>(p, &w, row0, panel, p.K);
    case 2: return rows<2>(p, &w, row0, panel, p.K);
    case 3: return rows<3>(p, &w, row0, panel, p.K);
    case 4: return rows<4>(p, &w, row0, panel, p.K);
    case 5: return rows<5>(p, &w, row0, panel, p.K);
    default: return rows<6>(p, &w, row0, panel, p.K);
  }
}

template <class Panel>
void decode(const Panel& w, int64_t K, float* out) {
  for (int64_t k = 0; k < K; ++k) {
    __m256 a, b;
    w(k, a, b);
    _mm256_storeu_ps(out + k * kPanel, a);
    _mm256_storeu_ps(out + k * kPanel + 8, b);
  }
}

inline void decode(const Int4Panel& w, int64_t K, float* out) { w.decode(K, out); }

// NP panels at w, or count < NP of them.
template <int MR, int NP, class Panel>
void rows_of_panels(const GemmParams& p, const Panel* w, int64_t count, int64_t panel) {
  if constexpr (NP > 1) {
    if (count < NP) return rows_of_panels<MR, NP - 1>(p, w, count, panel);
  }
  rows<MR, NP>(p, w, 0, panel, p.K);
}

// The direct path (M = MR rows): panels [begin, end), NP at a time. A core keeps more lines in
// flight for several streams than for one (its prefetchers follow each), and a small batch's GEMM
// is all weight streaming: a plain read of 4 streams per thread moved ~25-37 GB/s here where one
// stream moved ~20-29 (2 threads). Against reading one panel at a time, in-process A/B of decode
// steps of the SmolLM-135M shape: one row reading 4 panels, 0.85-0.89x the step time; two rows
// reading 2, 0.95x. Three or four rows reading 2 were 13% and 41% slower (too few registers).
template <int MR, int NP, class PanelAt>
void direct(const GemmParams& p, const PanelAt& panel_at, int64_t begin, int64_t end) {
  for (int64_t panel = begin; panel < end; panel += NP) {
    const int64_t count = std::min<int64_t>(NP, end - panel);
    decltype(panel_at(0)) w[NP];
    for (int64_t j = 0; j < count; ++j) w[j] = panel_at(panel + j);
    rows_of_panels<MR, NP>(p, w, count, panel);
  }
}

// panel_at(i): the decoder of panel i.
template <class PanelAt>
void run_panels(const GemmParams& p, const PanelAt& panel_at, int64_t begin, int64_t end, float* scratch) {
  // fp8 and int4 decodes are bound by their arithmetic, not by memory: more streams do not help
  // (fp8 read 4 at a time was ~5% slower).
  using Panel = decltype(panel_at(0));
  constexpr bool wide = !std::is_same_v<Panel, Fp8Panel> && !std::is_same_v<Panel, Int4Panel>;
  if (p.M == 1) return direct<1, wide ? 4 : 1>(p, panel_at, begin, end);
  if (p.M == 2) return direct<2, wide ? 2 : 1>(p, panel_at, begin, end);
  if (p.M <= kDirectRows) {
    for (int64_t panel = begin; panel < end; ++panel) rows_any(p, panel_at(panel), 0, p.M, panel);
    return;
  }
  for (int64_t panel = begin; panel < end; ++panel) {
    decode(panel_at(panel), p.K, scratch);
    const ScratchPanel decoded{scratch};
    int64_t row = 0;
    for (; row + kDirectRows <= p.M; row += kDirectRows) rows<kDirectRows>(p, &decoded, row, panel, p.K);
    if (row < p.M) rows_any(p, decoded, row, p.M - row, panel);
  }
}

template <class Panel, class T>
void run_dense(const GemmParams& p, int64_t begin, int64_t end, float* scratch) {
  const T* w = static_cast<const T*>(p.w);
  const int64_t panel_elems = p.K * kPanel;
  run_panels(p, [&](int64_t i) { return Panel{w + i * panel_elems}; }, begin, end, scratch);
}

void run(const GemmParams& p, int64_t begin, int64_t end, float* scratch) {
  switch (p.format) {
    case WeightFormat::Float: return run_dense<F32Panel, float>(p, begin, end, scratch);
    case WeightFormat::BFloat16: return run_dense<BF16Panel, uint16_t>(p, begin, end, scratch);
    case WeightFormat::Half: return run_dense<HalfPanel, uint16_t>(p, begin, end, scratch);
    case WeightFormat::Int8: return run_dense<Int8Panel, int8_t>(p, begin, end, scratch);
    case WeightFormat::Fp8E4M3: return run_dense<Fp8Panel, uint8_t>(p, begin, end, scratch);
    case WeightFormat::Int4: {
      const auto* w = static_cast<const uint8_t*>(p.w);
      const int64_t stride = (p.n + kPanel - 1) / kPanel * kPanel, panel_bytes = p.K / 2 * kPanel;
      auto panel_at = [&](int64_t i) {
        return Int4Panel{w + i * panel_bytes, p.group_scale + i * kPanel, stride, p.group_shift};
      };
      return run_panels(p, panel_at, begin, end, scratch);
    }
  }
}

#else  // DEFAULT: plain C++

float weight_at(const GemmParams& p, int64_t panel, int64_t k, int64_t j) {
  const int64_t i = (panel * p.K + k) * kPanel + j;
  switch (p.format) {
    case WeightFormat::Float: return static_cast<const float*>(p.w)[i];
    case WeightFormat::BFloat16: return static_cast<const c10::BFloat16*>(p.w)[i];
    case WeightFormat::Half: return static_cast<const c10::Half*>(p.w)[i];
    case WeightFormat::Int8: return static_cast<const int8_t*>(p.w)[i];
    case WeightFormat::Fp8E4M3: {
      const uint8_t v = static_cast<const uint8_t*>(p.w)[i];
      const uint16_t h = static_cast<uint16_t>(((v & 0x80) << 8) | ((v & 0x7f) << 7));
      return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
    }
    case WeightFormat::Int4: {
      const uint8_t v = static_cast<const uint8_t*>(p.w)[(panel * p.K / 2 + k / 2) * kPanel + j];
      const int64_t stride = (p.n + kPanel - 1) / kPanel * kPanel;
      const float s = p.group_scale[(k >> p.group_shift) * stride + panel * kPanel + j];
      const int q = (v >> (4 * (k & 1))) & 0x0f;
      return static_cast<float>(q >= 8 ? q - 16 : q) * s;
    }
  }
  return 0.0f;
}

void run_panel(const GemmParams& p, int64_t panel, float* scratch) {
  const int64_t col0 = panel * kPanel, cols = std::min(kPanel, p.n - col0);
  for (int64_t j = 0; j < cols; ++j) {
    for (int64_t k = 0; k < p.K; ++k) scratch[k] = weight_at(p, panel, k, j);
    const float s = column_factor(p) * (p.col_scale != nullptr ? p.col_scale[col0 + j] : 1.0f);
    const float bias = p.bias != nullptr ? p.bias[col0 + j] : 0.0f;
    for (int64_t m = 0; m < p.M; ++m) {
      float acc = 0.0f;
      for (int64_t k = 0; k < p.K; ++k) acc += p.x[m * p.K + k] * scratch[k];
      const float y = acc * s + bias;
      const int64_t at = m * p.n + col0 + j;
      switch (p.out_type) {
        case OutType::Float: static_cast<float*>(p.out)[at] = y; break;
        case OutType::BFloat16: static_cast<c10::BFloat16*>(p.out)[at] = c10::BFloat16(y); break;
        case OutType::Half: static_cast<c10::Half*>(p.out)[at] = c10::Half(y); break;
      }
    }
  }
}

void run(const GemmParams& p, int64_t begin, int64_t end, float* scratch) {
  for (int64_t panel = begin; panel < end; ++panel) run_panel(p, panel, scratch);
}

#endif

}  // namespace

void gemm_panels(const GemmParams& p, int64_t panel_begin, int64_t panel_end, float* scratch) {
  run(p, panel_begin, panel_end, scratch);
}

}  // namespace CPU_CAPABILITY
}  // namespace kiln
