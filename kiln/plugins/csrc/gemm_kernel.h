// The weight-panel GEMM kernels of ATen's CPU capabilities, compiled once per capability as
// paged_attention_kernel.h is: kernels_<cap>.cpp defines CPU_CAPABILITY (the namespace) and the
// target options, then includes this. The AVX-512 and AMX kernels live in gemm_avx512.cpp and
// gemm_amx.cpp.
//
// out[M, n] = x[M, K] . W^T, times a per-column scale, plus bias. W is stored in panels of 16 output
// columns (gemm.cpp has the layouts): a panel is one contiguous stream, a thread's share of the
// panels is one contiguous range. Two families:
//  - float (gemm_panels): x in float32.
//    - M <= kDirectRows (decode, small batches): weights are decoded in the inner loop and read
//      once, with 1-6 rows of x broadcast against them: a GEMV at memory bandwidth in whatever
//      width the weights are stored. One or two rows read several panels at once, as several
//      streams (see direct).
//    - M > kDirectRows (prefill, large batches): each panel is decoded once into a float scratch
//      (16 x K, L1/L2 resident) and a 6 x 16 register tile of FMAs runs every row block over it.
//  - int8 activations (gemm_int8_panels; int8 and int4 weights): x quantized to int8 in blocks of
//    act_block k (quantize_rows, once per call), integer dot products per block, each block's sum
//    scaled into a float accumulator. On AVX2, vpmaddubsw (u8 x s8 -> s16 pairs) + vpmaddwd: int8
//    weights go through it as |w| and x with w's sign (exact: |w| <= 128, |x| <= 127, no s16
//    saturation), int4 ones as q + 8 in [0, 15], whose excess 8 * sum(x) is subtracted per block.
// The AVX2 path uses raw intrinsics (the decodes are bit manipulations at::vec has no words for);
// the DEFAULT path is plain C++ with the same semantics, for CPUs without AVX2.

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

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

inline int64_t padded_columns(const GemmParams& p) { return round_up(p.n, kPanel); }

inline float half_value(uint16_t bits) { return static_cast<float>(c10::Half(bits, c10::Half::from_bits())); }

inline void store_value(const GemmParams& p, int64_t at, float y) {
  switch (p.out_type) {
    case OutType::Float: static_cast<float*>(p.out)[at] = y; break;
    case OutType::BFloat16: static_cast<c10::BFloat16*>(p.out)[at] = c10::BFloat16(y); break;
    case OutType::Half: static_cast<c10::Half*>(p.out)[at] = c10::Half(y); break;
  }
}

#if defined(CPU_CAPABILITY_AVX2)

// With the hardware prefetchers alone a core streams a panel from DRAM at ~13 GB/s, where a plain
// sum reads ~17; asking for the line 512 bytes ahead, once per line of a panel, made the batch-1
// layer GEMMs faster in every paired run (bf16 +2-40% in 8 of 8, int8 +11-36% in 3 of 3).
constexpr int64_t kPrefetchBytes = 512;

// 16 float16 (a panel row, or its group scales) as two registers of floats.
inline void half16(const uint16_t* h, __m256& s0, __m256& s1) {
  s0 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
  s1 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 8)));
}

// At stored row r of a panel whose rows are RowBytes wide (<= 64): one prefetch per line.
template <int64_t RowBytes>
inline void prefetch_ahead(const void* row, int64_t r) {
  if (r % (64 / RowBytes) == 0) _mm_prefetch(static_cast<const char*>(row) + kPrefetchBytes, _MM_HINT_T0);
}

// -- decoders: at<e>(r, a, b) gives the 16 weights of k = r * kK + e as two 8-float registers --

// Float weights streamed from memory, or (Stream = false) a panel decoded into the cache-resident
// scratch, which the tile loop of a larger batch reads with nothing to prefetch.
template <bool Stream>
struct F32PanelOf {
  static constexpr int kK = 1;
  const float* w;
  template <int e>
  void at(int64_t r, __m256& a, __m256& b) const {
    if constexpr (Stream) prefetch_ahead<64>(w + r * kPanel, r);
    a = _mm256_loadu_ps(w + r * kPanel);
    b = _mm256_loadu_ps(w + r * kPanel + 8);
  }
};
using F32Panel = F32PanelOf<true>;
using ScratchPanel = F32PanelOf<false>;

// k pairs: a 32-bit lane holds column j's bf16 at k (low half) and k + 1 (high half), so the even
// k's float is the lane shifted up and the odd k's is the lane masked.
struct BF16Panel {
  static constexpr int kK = 2;
  const uint16_t* w;
  template <int e>
  void at(int64_t r, __m256& a, __m256& b) const {
    const __m256i* row = reinterpret_cast<const __m256i*>(w + r * 2 * kPanel);
    if constexpr (e == 0) {
      prefetch_ahead<64>(row, r);
      a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(row), 16));
      b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(row + 1), 16));
    } else {
      const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
      a = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(row), high));
      b = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(row + 1), high));
    }
  }
};

struct HalfPanel {
  static constexpr int kK = 1;
  const uint16_t* w;
  template <int e>
  void at(int64_t r, __m256& a, __m256& b) const {
    prefetch_ahead<32>(w + r * kPanel, r);
    half16(w + r * kPanel, a, b);
  }
};

// k quads: byte e of column j's 32-bit lane is its int8 at k = 4r + e; shifting it to the top and
// back sign-extends it.
struct Int8Panel {
  static constexpr int kK = 4;
  const int8_t* w;
  template <int e>
  static __m256 lane(__m256i v) {
    if constexpr (e < 3) v = _mm256_slli_epi32(v, 24 - 8 * e);
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
  }
  template <int e>
  void at(int64_t r, __m256& a, __m256& b) const {
    const __m256i* row = reinterpret_cast<const __m256i*>(w + r * 4 * kPanel);
    if constexpr (e == 0) prefetch_ahead<64>(row, r);
    a = lane<e>(_mm256_loadu_si256(row));
    b = lane<e>(_mm256_loadu_si256(row + 1));
  }
};

struct Fp8Panel {
  static constexpr int kK = 1;
  const uint8_t* w;
  template <int e>
  void at(int64_t r, __m256& a, __m256& b) const {
    prefetch_ahead<16>(w + r * kPanel, r);
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * kPanel)));
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7f)), 7);
    const __m256i h = _mm256_or_si256(sign, rest);
    a = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
    b = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
  }
};

// int4, k in eights: column j's 32-bit lane holds its nibbles for k = 8r + t at bit 8t (t < 4) and
// 8(t - 4) + 4 (t >= 4), two's complement: shifted to the top and back, a nibble sign-extends.
constexpr int nibble_shift(int t) { return t < 4 ? 8 * t : 8 * (t - 4) + 4; }

template <int t>
inline __m256 int4_lane(__m256i v) {
  if constexpr (nibble_shift(t) != 28) v = _mm256_slli_epi32(v, 28 - nibble_shift(t));
  return _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 28));
}

struct Int4Panel {
  static constexpr int kK = 8;
  const uint8_t* w;
  const uint16_t* scale;  // this panel's column 0 of group_scale
  int64_t scale_stride;
  int64_t group_shift;

  void group_scale(int64_t group, __m256& s0, __m256& s1) const { half16(scale + group * scale_stride, s0, s1); }
  template <int t>
  void at(int64_t r, __m256& a, __m256& b) const {
    const __m256i* row = reinterpret_cast<const __m256i*>(w + r * 4 * kPanel);
    if constexpr (t == 0) prefetch_ahead<64>(row, r);
    a = int4_lane<t>(_mm256_loadu_si256(row));
    b = int4_lane<t>(_mm256_loadu_si256(row + 1));
  }
};

template <class F, int... I>
inline void unrolled(F&& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

// -- the register tile ----------------------------------------------------------------------------

// acc[j][m] = sum_k x[m, k] * w[j][k, 0:16] for NP panels and MR rows, k < K (a whole number of
// the panel's k per row; x is zero past the true K). KU independent partial sums per output
// (k = u mod KU), added up at the end, keep the FMA pipes busy when NP * MR is small. An output's
// sum depends on KU but not on NP, so KU is fixed per MR: results do not depend on how the panels
// were split between threads.
template <int MR, int KU, int NP, class Panel>
inline void tile(const Panel* w, const float* x, int64_t ldx, int64_t K, __m256 (&acc)[NP][MR][2]) {
  constexpr int KB = Panel::kK, L = KB > KU ? KB : KU;
  __m256 part[KU][NP][MR][2];
#pragma GCC unroll 8
  for (int u = 0; u < KU; ++u)
    for (int j = 0; j < NP; ++j)
      for (int m = 0; m < MR; ++m) part[u][j][m][0] = part[u][j][m][1] = _mm256_setzero_ps();
  // k = r * KB + e goes into partial set S (compile-time, so the partial sums stay in registers)
  auto step = [&](int64_t r, auto e, auto s) {
    constexpr int E = decltype(e)::value, S = decltype(s)::value;
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      __m256 a, b;
      w[j].template at<E>(r, a, b);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const __m256 xv = _mm256_broadcast_ss(x + m * ldx + r * KB + E);
        part[S][j][m][0] = _mm256_fmadd_ps(xv, a, part[S][j][m][0]);
        part[S][j][m][1] = _mm256_fmadd_ps(xv, b, part[S][j][m][1]);
      }
    }
  };
  auto block = [&](int64_t r, auto first) {
    unrolled([&](auto e) { step(r, e, std::integral_constant<int, (decltype(first)::value + decltype(e)::value) % KU>{}); },
             std::make_integer_sequence<int, KB>{});
  };
  int64_t k = 0;
  for (; k + L <= K; k += L) {
    unrolled([&](auto b) { block(k / KB + decltype(b)::value, std::integral_constant<int, decltype(b)::value * KB>{}); },
             std::make_integer_sequence<int, L / KB>{});
  }
  for (; k < K; k += KB) block(k / KB, std::integral_constant<int, 0>{});
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
  for (int64_t j = 0; j < cols; ++j) store_value(p, at + j, tmp[j]);
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

inline int64_t loop_k(const GemmParams& p, int kK) { return round_up(p.K, kK); }

// Rows row0 .. row0 + MR of NP consecutive panels from `panel` on.
template <int MR, int NP = 1, class Panel>
inline void rows(const GemmParams& p, const Panel* w, int64_t row0, int64_t panel) {
  constexpr int KU = MR <= 2 ? 2 : 1;
  __m256 acc[NP][MR][2];
  tile<MR, KU, NP>(w, p.x + row0 * p.ldx, p.ldx, loop_k(p, Panel::kK), acc);
  for (int j = 0; j < NP; ++j) finish<MR>(p, row0, panel + j, acc[j]);
}

// The direct path for int4: per group, partial sums for even and odd k (for 1-2 rows; more rows
// are independent chains already) keep the FMA pipes busy; the group scale then folds them into acc.
template <int MR, int NP = 1>
inline void rows(const GemmParams& p, const Int4Panel* panel_w, int64_t row0, int64_t panel) {
  static_assert(NP == 1, "int4 panels are read one at a time");
  const Int4Panel& w = *panel_w;
  constexpr int S = MR <= 2 ? 2 : 1;
  const float* x = p.x + row0 * p.ldx;
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t group = 0; group < (p.K >> w.group_shift); ++group) {
    __m256 part[S][MR][2];
#pragma GCC unroll 8
    for (int u = 0; u < S; ++u)
      for (int m = 0; m < MR; ++m) part[u][m][0] = part[u][m][1] = _mm256_setzero_ps();
    const int64_t end = ((group + 1) << w.group_shift) / Int4Panel::kK;
    for (int64_t r = (group << w.group_shift) / Int4Panel::kK; r < end; ++r) {
      unrolled([&](auto t) {
        constexpr int T = decltype(t)::value;
        __m256 a, b;
        w.at<T>(r, a, b);
#pragma GCC unroll 8
        for (int m = 0; m < MR; ++m) {
          const __m256 xv = _mm256_broadcast_ss(x + m * p.ldx + r * Int4Panel::kK + T);
          part[T % S][m][0] = _mm256_fmadd_ps(xv, a, part[T % S][m][0]);
          part[T % S][m][1] = _mm256_fmadd_ps(xv, b, part[T % S][m][1]);
        }
      }, std::make_integer_sequence<int, Int4Panel::kK>{});
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
    case 1: return rows<1>(p, &w, row0, panel);
    case 2: return rows<2>(p, &w, row0, panel);
    case 3: return rows<3>(p, &w, row0, panel);
    case 4: return rows<4>(p, &w, row0, panel);
    case 5: return rows<5>(p, &w, row0, panel);
    default: return rows<6>(p, &w, row0, panel);
  }
}

// The whole panel as floats (int4's group scales applied) into scratch [K, 16].
template <class Panel>
void decode(const GemmParams& p, const Panel& w, float* out) {
  const int64_t K = loop_k(p, Panel::kK);
  for (int64_t r = 0; r < K / Panel::kK; ++r) {
    unrolled([&](auto e) {
      constexpr int E = decltype(e)::value;
      const int64_t k = r * Panel::kK + E;
      __m256 a, b;
      w.template at<E>(r, a, b);
      if constexpr (std::is_same_v<Panel, Int4Panel>) {
        __m256 s0, s1;
        w.group_scale(k >> w.group_shift, s0, s1);
        a = _mm256_mul_ps(a, s0);
        b = _mm256_mul_ps(b, s1);
      }
      _mm256_storeu_ps(out + k * kPanel, a);
      _mm256_storeu_ps(out + k * kPanel + 8, b);
    }, std::make_integer_sequence<int, Panel::kK>{});
  }
}

// NP panels at w, or count < NP of them.
template <int MR, int NP, class Panel>
void rows_of_panels(const GemmParams& p, const Panel* w, int64_t count, int64_t panel) {
  if constexpr (NP > 1) {
    if (count < NP) return rows_of_panels<MR, NP - 1>(p, w, count, panel);
  }
  rows<MR, NP>(p, w, 0, panel);
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
    decode(p, panel_at(panel), scratch);
    const ScratchPanel decoded{scratch};
    int64_t row = 0;
    for (; row + kDirectRows <= p.M; row += kDirectRows) rows<kDirectRows>(p, &decoded, row, panel);
    if (row < p.M) rows_any(p, decoded, row, p.M - row, panel);
  }
}

template <class Panel, class T>
void run_dense(const GemmParams& p, int64_t begin, int64_t end, float* scratch) {
  const T* w = static_cast<const T*>(p.w);
  const int64_t panel_elems = p.panel_rows * Panel::kK * kPanel;
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
      const int64_t stride = padded_columns(p), panel_bytes = p.panel_rows * 4 * kPanel;
      auto panel_at = [&](int64_t i) {
        return Int4Panel{w + i * panel_bytes, p.group_scale + i * kPanel, stride, p.group_shift};
      };
      return run_panels(p, panel_at, begin, end, scratch);
    }
  }
}

// -- int8 activations ---------------------------------------------------------------------------

// Panels a single row reads at once (int8_rows' NP).
constexpr int kInt8Streams = 2;

// Sum over the 4 bytes of each 32-bit lane of u8 a times s8 b, as int32 (no saturation for the
// ranges used here: pairs of |a| <= 128, |b| <= 127).
inline __m256i dot4(__m256i a, __m256i b) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1));
}

// Rows row0 .. row0 + MR of NP consecutive panels from `panel` on (w: the first one's weights):
// per activation block, int32 sums of 8 columns per register, then acc += float(sum - comp) * scale,
// scale = x's block scale (times int4's group scale). NP > 1 reads the panels as NP streams at
// once, for a single row, where one stream leaves DRAM bandwidth unused (see direct).
template <int MR, bool kInt4, int NP = 1>
void int8_rows(const GemmParams& p, const uint8_t* w, int64_t row0, int64_t panel) {
  // int8: a stored row is 4 k of 16 columns (64 bytes); int4: 8 k of 16 columns (64 bytes).
  constexpr int64_t kRowK = kInt4 ? kInt4K : kQuadK;
  const int64_t rows = round_up(p.K, kRowK) / kRowK, block_rows = p.act_block / kRowK, ls = p.ldxq / p.act_block;
  const int64_t stride = padded_columns(p), panel_bytes = p.panel_rows * 4 * kPanel;
  __m256 acc[NP][MR][2];
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < MR; ++m) acc[j][m][0] = acc[j][m][1] = _mm256_setzero_ps();
  const __m256i low = _mm256_set1_epi8(0x0f), flip = _mm256_set1_epi8(static_cast<char>(0x88));
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    const int64_t r1 = std::min(rows, r0 + block_rows), k0 = r0 * kRowK, blk = k0 / p.act_block;
    __m256i sum[NP][MR][2];
    for (int j = 0; j < NP; ++j)
      for (int m = 0; m < MR; ++m) sum[j][m][0] = sum[j][m][1] = _mm256_setzero_si256();
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t k = r * kRowK;
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        const __m256i* row = reinterpret_cast<const __m256i*>(w + j * panel_bytes + r * 4 * kPanel);
        prefetch_ahead<64>(row, r);
        for (int h = 0; h < 2; ++h) {
          const __m256i v = _mm256_loadu_si256(row + h);
          if constexpr (kInt4) {
            const __m256i u = _mm256_xor_si256(v, flip);  // q + 8, in [0, 15]
            const __m256i lo = _mm256_and_si256(u, low), hi = _mm256_and_si256(_mm256_srli_epi16(u, 4), low);
#pragma GCC unroll 8
            for (int m = 0; m < MR; ++m) {
              const int8_t* xr = p.xq + (row0 + m) * p.ldxq + k;
              int32_t x0, x1;
              std::memcpy(&x0, xr, 4);
              std::memcpy(&x1, xr + 4, 4);
              // two s16 products of <= 2 * 15 * 127 each: their sum does not saturate
              const __m256i s = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(x0)),
                                                 _mm256_maddubs_epi16(hi, _mm256_set1_epi32(x1)));
              sum[j][m][h] = _mm256_add_epi32(sum[j][m][h], _mm256_madd_epi16(s, _mm256_set1_epi16(1)));
            }
          } else {
            const __m256i mag = _mm256_abs_epi8(v);
#pragma GCC unroll 8
            for (int m = 0; m < MR; ++m) {
              int32_t x0;
              std::memcpy(&x0, p.xq + (row0 + m) * p.ldxq + k, 4);
              sum[j][m][h] = _mm256_add_epi32(sum[j][m][h], dot4(mag, _mm256_sign_epi8(_mm256_set1_epi32(x0), v)));
            }
          }
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      __m256 g0 = _mm256_set1_ps(1.0f), g1 = g0;
      if constexpr (kInt4) {
        const uint16_t* gs = p.group_scale + (k0 >> p.group_shift) * stride + (panel + j) * kPanel;
        half16(gs, g0, g1);
        // The next panel group's scales, as gemm_avx512.cpp's vnni_rows does; the same GEMVs on this
        // kernel, one thread on Zen 4: 15.1 -> 15.9 GB/s (medians of 4 pairs, all ahead).
        _mm_prefetch(reinterpret_cast<const char*>(gs + NP * kPanel), _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (row0 + m) * ls + blk;
        const __m256i comp = _mm256_set1_epi32(p.xq_comp[at]);
        const __m256 xs = _mm256_set1_ps(p.xq_scale[at]);
        acc[j][m][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[j][m][0], comp)), _mm256_mul_ps(xs, g0),
                                       acc[j][m][0]);
        acc[j][m][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(sum[j][m][1], comp)), _mm256_mul_ps(xs, g1),
                                       acc[j][m][1]);
      }
    }
  }
  for (int j = 0; j < NP; ++j) finish<MR>(p, row0, panel + j, acc[j]);
}

template <bool kInt4>
void int8_run(const GemmParams& p, int64_t begin, int64_t end) {
  const auto* w = static_cast<const uint8_t*>(p.w);
  const int64_t panel_bytes = p.panel_rows * 4 * kPanel;
  int64_t panel = begin;
  if (p.M == 1) {
    for (; panel + kInt8Streams <= end; panel += kInt8Streams)
      int8_rows<1, kInt4, kInt8Streams>(p, w + panel * panel_bytes, 0, panel);
  }
  for (; panel < end; ++panel) {
    const uint8_t* pw = w + panel * panel_bytes;
    int64_t row = 0;
    for (; row + 4 <= p.M; row += 4) int8_rows<4, kInt4>(p, pw, row, panel);
    switch (p.M - row) {
      case 1: int8_rows<1, kInt4>(p, pw, row, panel); break;
      case 2: int8_rows<2, kInt4>(p, pw, row, panel); break;
      case 3: int8_rows<3, kInt4>(p, pw, row, panel); break;
      default: break;
    }
  }
}

void run_int8(const GemmParams& p, int64_t begin, int64_t end) {
  if (p.format == WeightFormat::Int4) return int8_run<true>(p, begin, end);
  return int8_run<false>(p, begin, end);
}

#else  // DEFAULT: plain C++

int8_t int4_at(const uint8_t* panel, int64_t k, int64_t j) {
  const int64_t r = k / kInt4K, t = k % kInt4K;
  const uint8_t byte = panel[(r * kPanel + j) * 4 + (t & 3)];
  const int q = (t < 4 ? byte : byte >> 4) & 0x0f;
  return static_cast<int8_t>(q >= 8 ? q - 16 : q);
}

float weight_at(const GemmParams& p, int64_t panel, int64_t k, int64_t j) {
  switch (p.format) {
    case WeightFormat::Float: return static_cast<const float*>(p.w)[(panel * p.panel_rows + k) * kPanel + j];
    case WeightFormat::Half: return static_cast<const c10::Half*>(p.w)[(panel * p.panel_rows + k) * kPanel + j];
    case WeightFormat::BFloat16: {
      const auto* w = static_cast<const c10::BFloat16*>(p.w) + panel * p.panel_rows * 2 * kPanel;
      return w[(k / 2 * kPanel + j) * 2 + k % 2];
    }
    case WeightFormat::Int8: {
      const auto* w = static_cast<const int8_t*>(p.w) + panel * p.panel_rows * 4 * kPanel;
      return w[(k / 4 * kPanel + j) * 4 + k % 4];
    }
    case WeightFormat::Fp8E4M3: {
      const uint8_t v = static_cast<const uint8_t*>(p.w)[(panel * p.panel_rows + k) * kPanel + j];
      const uint16_t h = static_cast<uint16_t>(((v & 0x80) << 8) | ((v & 0x7f) << 7));
      return half_value(h);
    }
    case WeightFormat::Int4: {
      const auto* w = static_cast<const uint8_t*>(p.w) + panel * p.panel_rows * 4 * kPanel;
      const float s = half_value(p.group_scale[(k >> p.group_shift) * padded_columns(p) + panel * kPanel + j]);
      return static_cast<float>(int4_at(w, k, j)) * s;
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
      for (int64_t k = 0; k < p.K; ++k) acc += p.x[m * p.ldx + k] * scratch[k];
      store_value(p, m * p.n + col0 + j, acc * s + bias);
    }
  }
}

void run(const GemmParams& p, int64_t begin, int64_t end, float* scratch) {
  for (int64_t panel = begin; panel < end; ++panel) run_panel(p, panel, scratch);
}

// The int8-activation arithmetic in plain C++: exact integer sums per block, as the vector kernels.
void run_int8(const GemmParams& p, int64_t begin, int64_t end) {
  const int64_t B = p.act_block, ls = p.ldxq / B;
  const bool int4 = p.format == WeightFormat::Int4;
  for (int64_t panel = begin; panel < end; ++panel) {
    const int64_t col0 = panel * kPanel, cols = std::min(kPanel, p.n - col0);
    const auto* w = static_cast<const uint8_t*>(p.w) + panel * p.panel_rows * 4 * kPanel;
    for (int64_t j = 0; j < cols; ++j) {
      const float s = p.col_scale != nullptr ? p.col_scale[col0 + j] : 1.0f;
      const float bias = p.bias != nullptr ? p.bias[col0 + j] : 0.0f;
      for (int64_t m = 0; m < p.M; ++m) {
        float acc = 0.0f;
        for (int64_t blk = 0; blk * B < p.K; ++blk) {
          int32_t sum = 0;
          for (int64_t k = blk * B; k < std::min(p.K, (blk + 1) * B); ++k) {
            const int32_t q = int4 ? int4_at(w, k, j) : reinterpret_cast<const int8_t*>(w)[(k / 4 * kPanel + j) * 4 + k % 4];
            sum += q * p.xq[m * p.ldxq + k];
          }
          const float g = int4 ? half_value(p.group_scale[((blk * B) >> p.group_shift) * padded_columns(p) + col0 + j]) : 1.0f;
          acc += static_cast<float>(sum) * (p.xq_scale[m * ls + blk] * g);
        }
        store_value(p, m * p.n + col0 + j, acc * s + bias);
      }
    }
  }
}

#endif

}  // namespace

void gemm_panels(const GemmParams& p, int64_t panel_begin, int64_t panel_end, void* scratch) {
  run(p, panel_begin, panel_end, static_cast<float*>(scratch));
}

void gemm_int8_panels(const GemmParams& p, int64_t panel_begin, int64_t panel_end, void* scratch) {
  run_int8(p, panel_begin, panel_end);
}

// x [M, K] (row stride ldx) -> xq [M, ldxq] int8 (zero past K), per `block` k one scale
// (block max / 127, so |xq| <= 127) and comp = offset * the block's sum of xq: a kernel that reads
// the weights as w + offset subtracts it.
void quantize_rows(const float* x, int64_t M, int64_t K, int64_t ldx, int32_t offset, int64_t block, int8_t* xq,
                   int64_t ldxq, float* scale, int32_t* comp) {
  const int64_t ls = ldxq / block;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * ldx;
    int8_t* qr = xq + m * ldxq;
    for (int64_t blk = 0; blk < ls; ++blk) {
      const int64_t k0 = blk * block, k1 = std::min(K, k0 + block);
      float amax = 0.0f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      int32_t sum = 0;
      for (int64_t k = k0; k < k0 + block; ++k) {
        const int32_t q = k < k1 ? static_cast<int32_t>(std::nearbyint(xr[k] * inv)) : 0;
        qr[k] = static_cast<int8_t>(q);
        sum += q;
      }
      scale[m * ls + blk] = amax / 127.0f;
      comp[m * ls + blk] = offset * sum;
    }
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace kiln
