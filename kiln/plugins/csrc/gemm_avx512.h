// AVX-512 helpers of the bf16 and integer kernels, included by gemm_avx512.cpp and gemm_amx.cpp
// inside their target options and their own namespace (everything here has internal linkage, so
// the two copies never meet at link time).
//
// Both bf16 kernels read a panel as bf16 k pairs, [Kb / 2, 32] (Kb = K rounded up to 32, rows past
// K zero): one 64-byte row is one vdpbf16ps operand, and 16 rows are one AMX B tile. bf16 weights
// are stored that way; other formats are decoded into it (bf16_panel), exactly for int8 and fp8
// (their scales apply per column at the end) and rounded once for fp16, float32 and int4 (whose
// group scale varies along k, so it is applied before the rounding).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "gemm.h"

namespace {

constexpr float kFp8Factor = 256.0f;  // see gemm_kernel.h: fp8 widened through fp16 bits is 2^-8 of its value

inline float column_factor(const kiln::GemmParams& p) {
  return p.format == kiln::WeightFormat::Fp8E4M3 ? kFp8Factor : 1.0f;
}

// Scale, bias and valid columns of one panel's 16 outputs.
struct Epilogue {
  __m512 scale, bias;
  __mmask16 mask;
  int64_t col0;
};

inline Epilogue epilogue(const kiln::GemmParams& p, int64_t panel) {
  Epilogue e;
  e.col0 = panel * kiln::kPanel;
  const int64_t cols = std::min(kiln::kPanel, p.n - e.col0);
  e.mask = static_cast<__mmask16>((1u << cols) - 1);
  e.scale = _mm512_set1_ps(column_factor(p));
  if (p.col_scale != nullptr) e.scale = _mm512_mul_ps(e.scale, _mm512_loadu_ps(p.col_scale + e.col0));
  e.bias = p.bias != nullptr ? _mm512_maskz_loadu_ps(e.mask, p.bias + e.col0) : _mm512_setzero_ps();
  return e;
}

inline void store_row(const kiln::GemmParams& p, const Epilogue& e, int64_t row, __m512 acc) {
  const __m512 v = _mm512_fmadd_ps(acc, e.scale, e.bias);
  const int64_t at = row * p.n + e.col0;
  switch (p.out_type) {
    case kiln::OutType::Float: _mm512_mask_storeu_ps(static_cast<float*>(p.out) + at, e.mask, v); break;
    case kiln::OutType::BFloat16:
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + at, e.mask, (__m256i)_mm512_cvtneps_pbh(v));
      break;
    case kiln::OutType::Half:
      _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p.out) + at, e.mask,
                               _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

// 2^x as 2^n * 2^f, f in [-1/2, 1/2], 2^f by its degree-5 Taylor polynomial: relative error
// < 3e-6, far inside a bf16 rounding; x below -150 (-inf included) gives 0.
inline __m512 exp2_bounded(__m512 x) {
  const __m512 t = _mm512_max_ps(x, _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.33335581e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.61812911e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55041087e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40226507e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93147181e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// gemm_swiglu's epilogue: silu(gate) * up = gate * up / (1 + e^-gate) of one row's 16 gate and up
// columns (their scales and biases applied), into out [M, 16 * swiglu_panels]. e^-gate is capped at
// e^80 so that the reciprocal estimate of a huge denominator is tiny, not 0 (Newton's d * r would be
// inf * 0), as in the elementwise op.
inline void store_swiglu_row(const kiln::GemmParams& p, const Epilogue& gate, const Epilogue& up, int64_t row,
                             __m512 gate_acc, __m512 up_acc) {
  const __m512 g = _mm512_fmadd_ps(gate_acc, gate.scale, gate.bias), u = _mm512_fmadd_ps(up_acc, up.scale, up.bias);
  const __m512 minus_g_log2e = _mm512_mul_ps(g, _mm512_set1_ps(-1.44269504f));
  const __m512 d = _mm512_add_ps(_mm512_set1_ps(1.f), exp2_bounded(_mm512_min_ps(minus_g_log2e, _mm512_set1_ps(115.4f))));
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.f)));
  const __m512 v = _mm512_mul_ps(_mm512_mul_ps(g, u), r);
  const int64_t at = row * (p.swiglu_panels * kiln::kPanel) + gate.col0;
  switch (p.out_type) {
    case kiln::OutType::Float: _mm512_storeu_ps(static_cast<float*>(p.out) + at, v); break;
    case kiln::OutType::BFloat16:
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p.out) + at), (__m256i)_mm512_cvtneps_pbh(v));
      break;
    case kiln::OutType::Half:
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p.out) + at),
                          _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
      break;
  }
}

// Two 16-float rows (k, k + 1) of a panel as one row of bf16 pairs.
inline void store_pairs(uint16_t* out, __m512 even, __m512 odd) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // [even 0..15, odd 0..15]
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  _mm512_storeu_si512(out, _mm512_permutexvar_epi16(interleave, both));
}

inline __m512 half_row(const uint16_t* h) {  // 16 float16 as floats
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
}

inline __m512 fp8_row(const uint8_t* w) {  // 16 fp8 e4m3 as floats, times 2^-8 (exact)
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x80)), 8);
  const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(v, _mm256_set1_epi16(0x7f)), 7);
  return _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
}

// Byte e (k = 4r + e) of each 32-bit lane of an int8 quad row, sign-extended, as floats.
template <int e>
inline __m512 int8_lane(__m512i v) {
  if constexpr (e < 3) v = _mm512_slli_epi32(v, 24 - 8 * e);
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24));
}

// Nibble t (k = 8r + t) of each 32-bit lane of an int4 row (gemm_kernel.h's nibble_shift), as floats.
template <int t>
inline __m512 int4_lane(__m512i v) {
  constexpr int shift = t < 4 ? 8 * t : 8 * (t - 4) + 4;
  if constexpr (shift != 28) v = _mm512_slli_epi32(v, 28 - shift);
  return _mm512_cvtepi32_ps(_mm512_srai_epi32(v, 28));
}

// Panel i of p as bf16 pairs [round_up(K, 32) / 2, 32]: the weights themselves when they are
// bf16, else decoded into out.
inline const uint16_t* bf16_panel(const kiln::GemmParams& p, int64_t i, uint16_t* out) {
  using namespace kiln;
  const int64_t Kb = round_up(p.K, kBf16PadK), P = kPanel;
  if (p.format == WeightFormat::BFloat16) return static_cast<const uint16_t*>(p.w) + i * p.panel_rows * 2 * P;
  int64_t k = 0;  // rows [k, Kb) are zeroed at the end
  switch (p.format) {
    case WeightFormat::Float:
    case WeightFormat::Half:
    case WeightFormat::Fp8E4M3: {  // [K, 16]
      auto row = [&](int64_t kk) -> __m512 {
        if (kk >= p.K) return _mm512_setzero_ps();
        const int64_t at = (i * p.panel_rows + kk) * P;
        if (p.format == WeightFormat::Float) return _mm512_loadu_ps(static_cast<const float*>(p.w) + at);
        if (p.format == WeightFormat::Half)
          return half_row(static_cast<const uint16_t*>(p.w) + at);
        return fp8_row(static_cast<const uint8_t*>(p.w) + at);
      };
      for (; k < p.K; k += 2) store_pairs(out + k * P, row(k), row(k + 1));
      break;
    }
    case WeightFormat::Int8: {  // [Kq / 4, 64]
      const int8_t* w = static_cast<const int8_t*>(p.w) + i * p.panel_rows * 4 * P;
      for (; k < p.K; k += 4) {
        const __m512i v = _mm512_loadu_si512(w + k * P);
        store_pairs(out + k * P, int8_lane<0>(v), int8_lane<1>(v));
        store_pairs(out + (k + 2) * P, int8_lane<2>(v), int8_lane<3>(v));
      }
      break;
    }
    case WeightFormat::Int4: {  // [K / 8, 64], group scales [K / g, padded columns]
      const uint8_t* w = static_cast<const uint8_t*>(p.w) + i * p.panel_rows * 4 * P;
      const int64_t stride = round_up(p.n, P);
      for (; k < p.K; k += 8) {
        const __m512i v = _mm512_loadu_si512(w + k / 2 * P);
        const __m512 s = half_row(p.group_scale + (k >> p.group_shift) * stride + i * P);
        store_pairs(out + k * P, _mm512_mul_ps(int4_lane<0>(v), s), _mm512_mul_ps(int4_lane<1>(v), s));
        store_pairs(out + (k + 2) * P, _mm512_mul_ps(int4_lane<2>(v), s), _mm512_mul_ps(int4_lane<3>(v), s));
        store_pairs(out + (k + 4) * P, _mm512_mul_ps(int4_lane<4>(v), s), _mm512_mul_ps(int4_lane<5>(v), s));
        store_pairs(out + (k + 6) * P, _mm512_mul_ps(int4_lane<6>(v), s), _mm512_mul_ps(int4_lane<7>(v), s));
      }
      break;
    }
    case WeightFormat::BFloat16: break;
  }
  k = round_up(k, 2);
  if (k < Kb) std::memset(out + k * P, 0, (Kb - k) * P * sizeof(uint16_t));
  return out;
}

}  // namespace
