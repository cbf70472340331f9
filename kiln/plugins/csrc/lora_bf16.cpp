// kiln_cpp::lora over bf16 pools on bf16 dot products (vdpbf16ps, AVX512_BF16): 32 multiply-adds per
// instruction where the generic kernel (lora_kernel.h) does 16 per FMA after widening each value.
// Built with this file's own target options and called only where cpu_features() reports AVX512_BF16
// (lora.cpp). Same tiles as the generic kernel:
//  - shrink: h[u][r] = A[r] . x_u, A's row and x's (bf16 already) read as k pairs;
//  - expand: y_u += B^T h_u, the pool's rows r and r + 1 interleaved into (B[r][o], B[r + 1][o])
//    pairs against the broadcast pair (h_u[r], h_u[r + 1]). h is rounded to bf16 first, as the
//    model's bf16 A GEMM rounds its output (PEFT's lora_A(x) in bf16); y stays float.

#include "lora.h"
#include "paged_attention_x86.h"

#if KILN_X86_KERNELS
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#endif

namespace kiln {
namespace avx512 {
namespace {

inline __mmask16 first16(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1); }
inline __mmask32 first32(int64_t n) { return n >= 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1ull << n) - 1); }

inline __m512 widen16(const uint16_t* src, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, src)), 16));
}

inline void widen(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_mask_storeu_ps(dst + i, first16(n - i), widen16(src + i, first16(n - i)));
}

inline void narrow(const float* src, uint16_t* dst, int64_t n) {  // round to nearest even
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = first16(n - i);
    const __m256bh v = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, src + i));
    _mm256_mask_storeu_epi16(dst + i, m, (__m256i)v);
  }
}

inline uint16_t to_bf16(float f) {
  const __m256bh v = _mm512_cvtneps_pbh(_mm512_set1_ps(f));
  return static_cast<uint16_t>(_mm256_extract_epi16((__m256i)v, 0));
}

template <int NT>
void shrink(const uint16_t* const* x, int64_t in, const uint16_t* a, int64_t width, int64_t rank, float* h,
            int64_t max_rank) {
  for (int64_t r = 0; r < rank; ++r, a += width) {
    __m512 sum[NT];
    for (int u = 0; u < NT; ++u) sum[u] = _mm512_setzero_ps();
    for (int64_t j = 0; j < in; j += 32) {
      const __mmask32 m = first32(in - j);
      // the next row's line: rows are in + out apart, which the hardware prefetchers do not follow
      _mm_prefetch(reinterpret_cast<const char*>(a + 4 * width + j), _MM_HINT_T0);
      const __m512i av = _mm512_maskz_loadu_epi16(m, a + j);
      for (int u = 0; u < NT; ++u)
        sum[u] = _mm512_dpbf16_ps(sum[u], (__m512bh)av, (__m512bh)_mm512_maskz_loadu_epi16(m, x[u] + j));
    }
    for (int u = 0; u < NT; ++u) h[u * max_rank + r] = _mm512_reduce_add_ps(sum[u]);
  }
}

template <int NT>
void expand(const float* h, int64_t max_rank, const uint16_t* b, int64_t width, int64_t rank, float* y, int64_t ld,
            int64_t out) {
  // h_u's (r, r + 1) pairs in bf16, a zero past an odd rank
  int32_t pairs[NT][64];
  for (int u = 0; u < NT; ++u)
    for (int64_t r = 0; r < rank; r += 2) {
      const uint32_t lo = to_bf16(h[u * max_rank + r]), hi = r + 1 < rank ? to_bf16(h[u * max_rank + r + 1]) : 0;
      pairs[u][r / 2] = static_cast<int32_t>(lo | hi << 16);
    }
  for (int64_t o = 0; o < out; o += 16) {
    const __mmask16 m = first16(out - o);
    __m512 acc[NT];
    for (int u = 0; u < NT; ++u) acc[u] = _mm512_maskz_loadu_ps(m, y + u * ld + o);
    for (int64_t r = 0; r < rank; r += 2) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b + r * width + o));
      const __m512i hi = r + 1 < rank ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b + (r + 1) * width + o))
                                      : _mm512_setzero_si512();
      const __m512i bv = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
      for (int u = 0; u < NT; ++u)
        acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)bv, (__m512bh)_mm512_set1_epi32(pairs[u][r / 2]));
    }
    for (int u = 0; u < NT; ++u) _mm512_mask_storeu_ps(y + u * ld + o, m, acc[u]);
  }
}

template <int NT>
void tile(const LoraParams& p, const int64_t* tokens, int64_t s, float* acc, float* h) {
  const auto* x = static_cast<const uint16_t*>(p.x);
  const auto* base = static_cast<const uint16_t*>(p.base);
  const uint16_t* rows_x[NT];
  for (int u = 0; u < NT; ++u) {
    rows_x[u] = x + tokens[u] * p.x_stride;
    widen(base + tokens[u] * p.N, acc + u * p.N, p.N);
  }
  const int64_t rank = p.rank[s];
  for (int64_t m = 0; m < p.num_pools; ++m) {
    const int64_t width = p.in + p.pool_out[m];
    const uint16_t* rows = static_cast<const uint16_t*>(p.pools[m]) + s * p.max_rank * width;
    shrink<NT>(rows_x, p.in, rows, width, rank, h, p.max_rank);
    expand<NT>(h, p.max_rank, rows + p.in, width, rank, acc + p.offset[m], p.N, p.pool_out[m]);
  }
  auto* out = static_cast<uint16_t*>(p.out);
  for (int u = 0; u < NT; ++u) narrow(acc + u * p.N, out + tokens[u] * p.N, p.N);
}

}  // namespace

bool lora_bf16_fits(const LoraParams& p) { return p.dtype == DType::BFloat16 && p.max_rank <= 128; }

void lora_rows_bf16(const LoraParams& p, int64_t begin, int64_t end) {
  std::vector<float> buffer(kLoraTile * (p.N + p.max_rank));
  float* acc = buffer.data();
  float* h = acc + kLoraTile * p.N;
  const auto* base = static_cast<const uint16_t*>(p.base);
  auto* out = static_cast<uint16_t*>(p.out);
  for (int64_t t = begin; t < end; ++t) {
    const int64_t* tokens = p.order + p.tiles[t];
    const int64_t n = p.tiles[t + 1] - p.tiles[t], s = p.slot[tokens[0]];
    if (s < 0 || p.rank[s] == 0) {
      for (int64_t u = 0; u < n; ++u) std::memcpy(out + tokens[u] * p.N, base + tokens[u] * p.N, p.N * 2);
      continue;
    }
    switch (n) {
      case 1: tile<1>(p, tokens, s, acc, h); break;
      case 2: tile<2>(p, tokens, s, acc, h); break;
      case 3: tile<3>(p, tokens, s, acc, h); break;
      default: tile<4>(p, tokens, s, acc, h); break;
    }
  }
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
bool lora_bf16_fits(const LoraParams&) { return false; }
void lora_rows_bf16(const LoraParams&, int64_t, int64_t) {}
}  // namespace avx512
}  // namespace kiln
#endif
