// The AVX-512 GEMM kernels: bf16 dot products (vdpbf16ps, AVX512_BF16) and int8 ones (vpdpbusd,
// AVX512_VNNI). Built with this file's own target options (the library runs on any x86-64) and
// called only where cpu_features() reports them (gemm.cpp).
//
// gemm_bf16_panels: x in bf16 (p.xb), weights as bf16 pair panels (gemm_avx512.h). One vdpbf16ps
// multiplies 16 columns by one k pair of one row: 32 multiply-adds per instruction, where the float
// kernels do 8 per FMA and first widen the weights.
//  - Up to 4 rows of bf16 weights: read straight from the panels, several panels at once (streams,
//    as the AVX2 kernel), with a software prefetch per line.
//  - More rows, or other formats: each pair of panels is decoded once (bf16 weights need none) and
//    register tiles of 8 rows x 2 panels run every row block over it, from L1/L2.
// gemm_vnni_panels: x quantized to int8 (p.xq, blocks of p.act_block k), int8 or int4 weights. The
// unsigned operand of vpdpbusd is the weight plus an offset (int8: w ^ 0x80 = w + 128; int4:
// q ^ 8 = q + 8), so one instruction multiplies 16 columns by 4 k; the offset's excess,
// offset * sum(xq) per block, comes precomputed with x (p.xq_comp).

#include "gemm.h"
#include "paged_attention_x86.h"

#if KILN_X86_KERNELS
// Standard and intrinsic headers before the target options: their inline code stays generic.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
// GCC 12 flags its own _mm512_undefined_* (a self-initialized variable) in many AVX-512 intrinsics.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,avx2,fma,f16c")
#endif

#include "gemm_avx512.h"

namespace kiln {
namespace avx512 {
namespace {

// Streamed weights are asked into L2 (not L1) 2 KB ahead of each stream: an L1 prefetch 512 bytes
// ahead held the line-fill buffers the demand loads need, and the int4 kernel, which spends more
// instructions per line, then kept fewer lines in flight. Alternated in one process on a 2-core Zen 4
// (one token's GEMVs of SmolLM-135M, M = 1): int4 11.6 -> 14.5 GB/s on one thread, 22.3 -> 25.3 on
// two; int8 16.9 -> 18.2 and 26.1 -> 27.2; bf16 15.1 -> 17.3 and 28.7 -> 29.8.
constexpr int64_t kPrefetchBytes = 2048;

// A stream's prefetch that runs past the end of its panel continues in the panel the stream reads
// next: when a group's NP panels are adjacent (a thread's contiguous share), the one after the
// group, NP - 1 panels further on; otherwise (swiglu's gate and up panels) the next one. Without
// this the first kPrefetchBytes of every panel were demand misses: 44% of an int4 panel at K = 576.
// Same GEMVs, alternated, Zen 4, one thread: int4 14.6 -> 16.7 GB/s, int8 17.1 -> 19.0, bf16 19.1 ->
// 20.0; two threads, int4: 23.5 -> 25.1 (mean of five pairs).
template <int NP, typename T>
inline int64_t past_group(const T* const (&w)[NP], int64_t panel_bytes) {
  const int64_t span = reinterpret_cast<const char*>(w[NP - 1]) - reinterpret_cast<const char*>(w[0]);
  return span == (NP - 1) * panel_bytes ? span : 0;
}

inline void prefetch_stream(const void* row, int64_t offset, int64_t panel_bytes, int64_t skip) {
  const char* ahead = static_cast<const char*>(row) + kPrefetchBytes;
  _mm_prefetch(offset + kPrefetchBytes >= panel_bytes ? ahead + skip : ahead, _MM_HINT_T1);
}

inline __m512 pair_dot(__m512 acc, __m512i w, const uint16_t* x) {
  int32_t pair;
  std::memcpy(&pair, x, 4);
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_set1_epi32(pair));
}

// acc[j][m] = sum over k pairs of rows row0 .. row0 + MR against NP bf16 pair panels. KU partial
// sums per output (pair index mod KU), fixed per MR as in gemm_kernel.h's tile.
template <int MR, int NP, bool Stream>
inline void bf16_tile(const GemmParams& p, const uint16_t* const (&w)[NP], int64_t row0, int64_t pairs,
                      __m512 (&acc)[NP][MR]) {
  constexpr int KU = MR <= 2 ? 2 : 1;
  __m512 part[KU][NP][MR];
  for (int u = 0; u < KU; ++u)
    for (int j = 0; j < NP; ++j)
      for (int m = 0; m < MR; ++m) part[u][j][m] = _mm512_setzero_ps();
  const uint16_t* x = p.xb + row0 * p.ldxb;
  const int64_t panel_bytes = p.panel_rows * 64, skip = past_group(w, panel_bytes);
  auto step = [&](int64_t r, int u) {
#pragma GCC unroll 8
    for (int j = 0; j < NP; ++j) {
      const uint16_t* row = w[j] + r * 2 * kPanel;
      if constexpr (Stream) prefetch_stream(row, r * 64, panel_bytes, skip);
      const __m512i wv = _mm512_loadu_si512(row);
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) part[u][j][m] = pair_dot(part[u][j][m], wv, x + m * p.ldxb + 2 * r);
    }
  };
  int64_t r = 0;
  for (; r + KU <= pairs; r += KU) {
#pragma GCC unroll 2
    for (int u = 0; u < KU; ++u) step(r + u, u);
  }
  for (; r < pairs; ++r) step(r, 0);
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < MR; ++m) {
      acc[j][m] = part[0][j][m];
      for (int u = 1; u < KU; ++u) acc[j][m] = _mm512_add_ps(acc[j][m], part[u][j][m]);
    }
}

template <int MR, int NP, bool Stream>
inline void bf16_rows(const GemmParams& p, const uint16_t* const (&w)[NP], int64_t row0, int64_t panel) {
  __m512 acc[NP][MR];
  bf16_tile<MR, NP, Stream>(p, w, row0, round_up(p.K, 2) / 2, acc);
  if constexpr (NP == 2) {
    if (p.swiglu_panels > 0) {  // w: gate panel `panel` and its up panel
      const Epilogue gate = epilogue(p, panel), up = epilogue(p, panel + p.swiglu_panels);
      for (int m = 0; m < MR; ++m) store_swiglu_row(p, gate, up, row0 + m, acc[0][m], acc[1][m]);
      return;
    }
  }
  for (int j = 0; j < NP; ++j) {
    const Epilogue e = epilogue(p, panel + j);
    for (int m = 0; m < MR; ++m) store_row(p, e, row0 + m, acc[j][m]);
  }
}

template <int NP, bool Stream>
void bf16_rows_any(const GemmParams& p, const uint16_t* const (&w)[NP], int64_t row0, int64_t count, int64_t panel) {
  switch (count) {
    case 1: return bf16_rows<1, NP, Stream>(p, w, row0, panel);
    case 2: return bf16_rows<2, NP, Stream>(p, w, row0, panel);
    case 3: return bf16_rows<3, NP, Stream>(p, w, row0, panel);
    case 4: return bf16_rows<4, NP, Stream>(p, w, row0, panel);
    case 5: return bf16_rows<5, NP, Stream>(p, w, row0, panel);
    case 6: return bf16_rows<6, NP, Stream>(p, w, row0, panel);
    case 7: return bf16_rows<7, NP, Stream>(p, w, row0, panel);
    default: return bf16_rows<8, NP, Stream>(p, w, row0, panel);
  }
}

// Small batches of bf16 weights: NP panels at a time straight from memory.
template <int NP>
void bf16_direct(const GemmParams& p, int64_t begin, int64_t end) {
  const auto* base = static_cast<const uint16_t*>(p.w);
  const int64_t panel_elems = p.panel_rows * 2 * kPanel;
  int64_t panel = begin;
  for (; panel + NP <= end; panel += NP) {
    const uint16_t* w[NP];
    for (int j = 0; j < NP; ++j) w[j] = base + (panel + j) * panel_elems;
    bf16_rows_any<NP, true>(p, w, 0, p.M, panel);
  }
  for (; panel < end; ++panel) {
    const uint16_t* w[1] = {base + panel * panel_elems};
    bf16_rows_any<1, true>(p, w, 0, p.M, panel);
  }
}

void bf16_blocked(const GemmParams& p, int64_t begin, int64_t end, uint16_t* scratch) {
  const int64_t Kb = round_up(p.K, kBf16PadK);
  for (int64_t panel = begin; panel < end; panel += 2) {
    const bool two = panel + 1 < end;
    const uint16_t* w0 = bf16_panel(p, panel, scratch);
    if (two) {
      const uint16_t* w[2] = {w0, bf16_panel(p, panel + 1, scratch + Kb * kPanel)};
      for (int64_t row = 0; row < p.M; row += 8) bf16_rows_any<2, false>(p, w, row, std::min<int64_t>(8, p.M - row), panel);
    } else {
      const uint16_t* w[1] = {w0};
      for (int64_t row = 0; row < p.M; row += 8) bf16_rows_any<1, false>(p, w, row, std::min<int64_t>(8, p.M - row), panel);
    }
  }
}

// gemm_swiglu: each gate panel with its up panel, straight from memory for a few bf16 rows.
void bf16_swiglu(const GemmParams& p, int64_t begin, int64_t end, uint16_t* scratch) {
  const int64_t Kb = round_up(p.K, kBf16PadK);
  const bool direct = p.format == WeightFormat::BFloat16 && p.M <= 4;
  for (int64_t panel = begin; panel < end; ++panel) {
    const uint16_t* w[2] = {bf16_panel(p, panel, scratch), bf16_panel(p, panel + p.swiglu_panels, scratch + Kb * kPanel)};
    for (int64_t row = 0; row < p.M; row += 8) {
      const int64_t rows = std::min<int64_t>(8, p.M - row);
      if (direct) {
        bf16_rows_any<2, true>(p, w, row, rows, panel);
      } else {
        bf16_rows_any<2, false>(p, w, row, rows, panel);
      }
    }
  }
}

// -- int8 activations ---------------------------------------------------------------------------

inline __m512i x_quad(const int8_t* x) {
  int32_t quad;
  std::memcpy(&quad, x, 4);
  return _mm512_set1_epi32(quad);
}

// How vnni_rows reads its panels: int8 rows (4 k of 16 columns, w ^ 0x80 = w + 128), packed int4
// rows (8 k: low and high nibbles, q ^ 8 = q + 8), or int4 unpacked into scratch as int8 rows that
// already hold q + 8 (unpack_int4), read from L1/L2 by many row blocks.
enum class Vnni { Int8, Int4, Int4Unpacked };

// Rows row0 .. row0 + MR of NP panels (stored rows of 64 bytes).
template <int MR, int NP, Vnni kWeights>
void vnni_rows(const GemmParams& p, const uint8_t* const (&w)[NP], int64_t row0, int64_t panel) {
  constexpr bool kInt4 = kWeights == Vnni::Int4, kGroups = kWeights != Vnni::Int8;
  constexpr int64_t kRowK = kInt4 ? kInt4K : kQuadK;
  const int64_t rows = round_up(p.K, kRowK) / kRowK, span_rows = p.act_block / kRowK;
  const int64_t ls = p.ldxq / p.act_block, stride = round_up(p.n, kPanel);
  const int64_t panel_bytes = p.panel_rows * 64, skip = past_group(w, panel_bytes);
  __m512 acc[NP][MR];
  for (int j = 0; j < NP; ++j)
    for (int m = 0; m < MR; ++m) acc[j][m] = _mm512_setzero_ps();
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(kInt4 ? 0x88 : 0x80)), low = _mm512_set1_epi8(0x0f);
  for (int64_t r0 = 0; r0 < rows; r0 += span_rows) {
    const int64_t r1 = std::min(rows, r0 + span_rows), k0 = r0 * kRowK, blk = k0 / p.act_block;
    __m512i sum[NP][MR];
    for (int j = 0; j < NP; ++j)
      for (int m = 0; m < MR; ++m) sum[j][m] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t k = r * kRowK;
#pragma GCC unroll 4
      for (int j = 0; j < NP; ++j) {
        const uint8_t* row = w[j] + r * 4 * kPanel;
        if constexpr (kWeights != Vnni::Int4Unpacked) prefetch_stream(row, r * 64, panel_bytes, skip);
        const __m512i v = _mm512_loadu_si512(row);
        const __m512i u = kWeights == Vnni::Int4Unpacked ? v : _mm512_xor_si512(v, flip);
        if constexpr (kInt4) {
          const __m512i lo = _mm512_and_si512(u, low), hi = _mm512_and_si512(_mm512_srli_epi16(u, 4), low);
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m) {
            const int8_t* xr = p.xq + (row0 + m) * p.ldxq + k;
            sum[j][m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(sum[j][m], lo, x_quad(xr)), hi, x_quad(xr + 4));
          }
        } else {
#pragma GCC unroll 8
          for (int m = 0; m < MR; ++m)
            sum[j][m] = _mm512_dpbusd_epi32(sum[j][m], u, x_quad(p.xq + (row0 + m) * p.ldxq + k));
        }
      }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NP; ++j) {
      __m512 g = _mm512_set1_ps(1.0f);
      if constexpr (kGroups) {
        const uint16_t* scales = p.group_scale + (k0 >> p.group_shift) * stride + panel * kPanel;
        g = half_row(scales + (j > 0 && p.swiglu_panels > 0 ? p.swiglu_panels : j) * kPanel);  // swiglu: the up panel
        // The group scales are a stream of their own (32 bytes per panel and group, rows n * 2 bytes
        // apart) that no weight prefetch covers: fetch the next panel group's. SmolLM-135M's int4 GEMVs
        // alternated on Zen 4, float32 scales then: one thread 15.6 -> 16.9 GB/s, two 22.7 -> 23.5.
        _mm_prefetch(reinterpret_cast<const char*>(scales + (NP + j) * kPanel), _MM_HINT_T0);
      }
#pragma GCC unroll 8
      for (int m = 0; m < MR; ++m) {
        const int64_t at = (row0 + m) * ls + blk;
        const __m512i s = _mm512_sub_epi32(sum[j][m], _mm512_set1_epi32(p.xq_comp[at]));
        acc[j][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(g, _mm512_set1_ps(p.xq_scale[at])), acc[j][m]);
      }
    }
  }
  if constexpr (NP == 2) {
    if (p.swiglu_panels > 0) {  // w: gate panel `panel` and its up panel
      const Epilogue gate = epilogue(p, panel), up = epilogue(p, panel + p.swiglu_panels);
      for (int m = 0; m < MR; ++m) store_swiglu_row(p, gate, up, row0 + m, acc[0][m], acc[1][m]);
      return;
    }
  }
  for (int j = 0; j < NP; ++j) {
    const Epilogue e = epilogue(p, panel + j);
    for (int m = 0; m < MR; ++m) store_row(p, e, row0 + m, acc[j][m]);
  }
}

template <int NP, Vnni kWeights>
void vnni_rows_any(const GemmParams& p, const uint8_t* const (&w)[NP], int64_t row0, int64_t count, int64_t panel) {
  switch (count) {
    case 1: return vnni_rows<1, NP, kWeights>(p, w, row0, panel);
    case 2: return vnni_rows<2, NP, kWeights>(p, w, row0, panel);
    case 3: return vnni_rows<3, NP, kWeights>(p, w, row0, panel);
    default: return vnni_rows<4, NP, kWeights>(p, w, row0, panel);
  }
}

// A packed int4 panel (K / 8 rows of nibbles) -> K / 4 int8 rows of q + 8: row 2r the low nibbles
// (k 8r .. 8r + 3), row 2r + 1 the high ones (8r + 4 .. 8r + 7).
const uint8_t* unpack_int4(const uint8_t* panel, int64_t K, uint8_t* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x88)), low = _mm512_set1_epi8(0x0f);
  for (int64_t r = 0; r < K / kInt4K; ++r) {
    const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(panel + r * 64), flip);
    _mm512_storeu_si512(out + r * 128, _mm512_and_si512(u, low));
    _mm512_storeu_si512(out + r * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(u, 4), low));
  }
  return out;
}

template <int NP, Vnni kWeights>
void vnni_rows_all(const GemmParams& p, const uint8_t* const (&w)[NP], int64_t panel) {
  for (int64_t row = 0; row < p.M; row += 4) vnni_rows_any<NP, kWeights>(p, w, row, std::min<int64_t>(4, p.M - row), panel);
}

// Panels [begin, end) in pairs, or with p.swiglu_panels the gate panels [begin, end), each with its
// up panel. kUnpack: int4 panels are first unpacked into scratch.
template <Vnni kWeights, bool kUnpack>
void vnni_pairs(const GemmParams& p, int64_t begin, int64_t end, uint8_t* scratch) {
  constexpr Vnni kRead = kUnpack ? Vnni::Int4Unpacked : kWeights;
  const auto* base = static_cast<const uint8_t*>(p.w);
  const int64_t panel_bytes = p.panel_rows * 4 * kPanel, up = p.swiglu_panels;
  auto at = [&](int64_t panel, int64_t slot) -> const uint8_t* {
    const uint8_t* w = base + panel * panel_bytes;
    if constexpr (kUnpack) return unpack_int4(w, p.K, scratch + slot * p.K * kPanel);
    return w;
  };
  int64_t panel = begin;
  for (; up > 0 ? panel < end : panel + 2 <= end; panel += up > 0 ? 1 : 2) {
    const uint8_t* w[2] = {at(panel, 0), at(up > 0 ? panel + up : panel + 1, 1)};
    vnni_rows_all<2, kRead>(p, w, panel);
  }
  for (; panel < end; ++panel) {
    const uint8_t* w[1] = {at(panel, 0)};
    vnni_rows_all<1, kRead>(p, w, panel);
  }
}

template <Vnni kWeights>
void vnni_run(const GemmParams& p, int64_t begin, int64_t end, uint8_t* scratch) {
  int64_t panel = begin;
  if (p.M == 1 && p.swiglu_panels == 0) {  // a GEMV: four streams
    const auto* base = static_cast<const uint8_t*>(p.w);
    const int64_t panel_bytes = p.panel_rows * 4 * kPanel;
    for (; panel + 4 <= end; panel += 4) {
      const uint8_t* w[4];
      for (int j = 0; j < 4; ++j) w[j] = base + (panel + j) * panel_bytes;
      vnni_rows<1, 4, kWeights>(p, w, 0, panel);
    }
  }
  // More than one row block of int4 weights: each panel's nibbles are unpacked once, not once per
  // row block (SmolLM-135M's four GEMMs of a layer at M = 512, g64, Zen 4: 5.77 -> 5.63 ms on 2
  // threads; M = 16 unchanged).
  if (kWeights == Vnni::Int4 && p.M > 4) return vnni_pairs<kWeights, true>(p, panel, end, scratch);
  vnni_pairs<kWeights, false>(p, panel, end, scratch);
}

// 16 values of x from `at` (float32 or bf16 bits), the lanes past `mask` zero.
inline __m512 load16(const float* at, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, at); }
inline __m512 load16(const uint16_t* at, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, at)), 16));
}

template <typename T>
void quantize(const T* x, int64_t M, int64_t K, int64_t ldx, int32_t offset, int64_t block, int8_t* xq, int64_t ldxq,
              float* scale, int32_t* comp) {
  const int64_t ls = ldxq / block;
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const T* xr = x + m * ldx;
    for (int64_t blk = 0; blk < ls; ++blk) {
      const int64_t k0 = blk * block, n = std::clamp<int64_t>(K - k0, 0, block);
      auto mask = [&](int64_t i) -> __mmask16 { return i + 16 <= n ? 0xffff : i < n ? (1u << (n - i)) - 1 : 0; };
      __m512 amax = _mm512_setzero_ps();
      for (int64_t i = 0; i < n; i += 16) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, load16(xr + k0 + i, mask(i))));
      const float a = _mm512_reduce_max_ps(amax);
      const __m512 inv = _mm512_set1_ps(a > 0.0f ? 127.0f / a : 0.0f);
      __m512i sum = _mm512_setzero_si512();
      for (int64_t i = 0; i < block; i += 16) {
        // round half to even (the default MXCSR mode), as std::nearbyint in gemm_kernel.h's quantize_rows
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(load16(xr + k0 + i, mask(i)), inv));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(xq + m * ldxq + k0 + i), _mm512_cvtepi32_epi8(q));
        sum = _mm512_add_epi32(sum, q);
      }
      scale[m * ls + blk] = a / 127.0f;
      comp[m * ls + blk] = offset * _mm512_reduce_add_epi32(sum);
    }
  }
}

}  // namespace

void gemm_bf16_panels(const GemmParams& p, int64_t begin, int64_t end, void* scratch) {
  if (p.swiglu_panels > 0) return bf16_swiglu(p, begin, end, static_cast<uint16_t*>(scratch));
  if (p.format == WeightFormat::BFloat16 && p.M <= 4) {
    if (p.M == 1) return bf16_direct<4>(p, begin, end);
    return bf16_direct<2>(p, begin, end);
  }
  bf16_blocked(p, begin, end, static_cast<uint16_t*>(scratch));
}

void gemm_vnni_panels(const GemmParams& p, int64_t begin, int64_t end, void* scratch) {
  auto* s = static_cast<uint8_t*>(scratch);
  if (p.format == WeightFormat::Int4) return vnni_run<Vnni::Int4>(p, begin, end, s);
  vnni_run<Vnni::Int8>(p, begin, end, s);
}

void quantize_rows(const void* x, bool bf16, int64_t M, int64_t K, int64_t ldx, int32_t offset, int64_t block,
                   int8_t* xq, int64_t ldxq, float* scale, int32_t* comp) {
  if (bf16) return quantize(static_cast<const uint16_t*>(x), M, K, ldx, offset, block, xq, ldxq, scale, comp);
  quantize(static_cast<const float*>(x), M, K, ldx, offset, block, xq, ldxq, scale, comp);
}

}  // namespace avx512
}  // namespace kiln

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#else
namespace kiln {
namespace avx512 {  // never called: cpu_features() reports no AVX-512 here
void gemm_bf16_panels(const GemmParams&, int64_t, int64_t, void*) {}
void gemm_vnni_panels(const GemmParams&, int64_t, int64_t, void*) {}
void quantize_rows(const void*, bool, int64_t, int64_t, int64_t, int32_t, int64_t, int8_t*, int64_t, float*, int32_t*) {}
}  // namespace avx512
}  // namespace kiln
#endif
