// The context phase of paged attention on bf16 dot products (vdpbf16ps, AVX512_BF16): a tile of
// bf16 query rows (n_q tokens x the G heads of one KV head) against a bf16 KV pool, flash-style (a
// chunk of whole pages, ~128 keys, at a time, online softmax), with both matrix products on the
// instruction the bf16 GEMMs use, 32 multiply-adds each where the float kernel
// (paged_attention_kernel.h) does 16 per FMA after widening every page. Built with this file's own
// target options and called only where cpu_features() reports AVX512_BF16 (paged_attention.cpp).
//
// The query rows are the columns: 16 rows are one vector lane each, so
//  - S^T = K Q^T: a key's two bf16 elements (d, d + 1) are broadcast straight from the pool against
//    the queries as bf16 pair panels [D / 2][16 rows] (built once per tile, not per chunk);
//  - the online softmax is elementwise over keys (a row's max and sum are lanes: no horizontal
//    reductions). It scales the raw scores itself, in log2 units (exps are 2^x), masks only the keys
//    some row must not see (one compare of the rows' positions against the key's), and writes P^T
//    straight to bf16 pairs of keys (t, t + 1) per row lane. A row's reference max moves only when
//    the max rises well above it, so that most chunks leave O^T and l as they are;
//  - O^T += V^T P^T: each V element pair (V[t][d], V[t + 1][d]) is broadcast against P^T's pairs;
//    O^T [D][rows] stays float.
// P is rounded to bf16 before P.V, as GPU flash attention does; scores, the softmax and O stay float.
//
// Where the CPU has AMX (and D is a multiple of 32), both products run on tiles instead, 16x the work
// of a vdpbf16ps per instruction, in the same layouts:
//  - S^T = K Q^T per 16 keys: A is 16 keys x 32 d read straight from the pool (rows token_stride
//    apart), B the query pair panels above, C a 16 x 16 block of S^T;
//  - O^T += V^T P^T per 32 keys: B is 16 rows of P^T's key pairs, A the chunk's V pairs transposed
//    into 16 d x 16 key pairs, C a block of O^T, which stays in its tile across up to four such
//    products (128 keys) between one load and one store.
// A chunk's last keys short of a whole tile take the vdpbf16ps code.

#include "gemm.h"
#include "paged_attention.h"
#include "paged_attention_x86.h"

#if KILN_X86_KERNELS
#include <immintrin.h>

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")
#endif

#include "amx_tiles.h"
#include "gemm_avx512.h"

namespace kiln {
namespace avx512 {
namespace {

constexpr int64_t L = 16;  // query rows per panel: the lanes of one vector
constexpr int kMaxPanels = 4;  // panels one register tile covers

inline int64_t up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

inline __m512 dot_pair(__m512 acc, __m512i panel_row, const void* pair) {
  int32_t bits;
  std::memcpy(&bits, pair, 4);
  return _mm512_dpbf16_ps(acc, (__m512bh)panel_row, (__m512bh)_mm512_set1_epi32(bits));
}

// Two float vectors as one vector of bf16 pairs: lane l holds (even[l], odd[l]).
inline __m512i pairs_of(__m512 even, __m512 odd) {
  const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(odd, even);  // [even 0..15, odd 0..15]
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                              22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(interleave, both);
}

// r[j][i] = r[i][j]: a 16 x 16 transpose of 32-bit words, in registers.
inline void transpose16(__m512i r[16]) {
  __m512i u[16];
  for (int i = 0; i < 16; i += 2) {
    u[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    u[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(u[i], u[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(u[i], u[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(u[i + 1], u[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(u[i + 1], u[i + 3]);
  }
  // r[4b + j] holds, in each 128-bit lane l, column 4l + j of rows 4b .. 4b + 3
  for (int b = 0; b < 2; ++b)
    for (int j = 0; j < 4; ++j) {
      u[8 * b + j] = _mm512_shuffle_i32x4(r[8 * b + j], r[8 * b + 4 + j], 0x88);
      u[8 * b + 4 + j] = _mm512_shuffle_i32x4(r[8 * b + j], r[8 * b + 4 + j], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_i32x4(u[j], u[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_i32x4(u[j], u[8 + j], 0xdd);
  }
}

// The scratch of one tile (floats and 32-bit words, in the caller's float buffer).
struct Tile {
  int64_t rows, panels, width;  // width = panels * 16 lanes
  uint32_t* qp;  // [D / 2][width] the queries as bf16 pairs (d, d + 1), rows past `rows` zero
  float* s;      // [chunk][width] a chunk's S^T (chunk: its keys)
  uint32_t* pp;  // [chunk / 2][width] P^T as bf16 pairs of keys (t, t + 1)
  uint32_t* vp;  // [chunk / 2][Dv] V as bf16 pairs of keys (t, t + 1), Dv = D rounded up to 32
  uint32_t* vt;  // AMX: [chunk / 32][D / 16][16 d][16 key pairs] vp's 16-pair tiles, transposed
  float* o;      // [D][width] O^T
  float* m;      // [width] running max
  float* l;      // [width] running sum
  float* corr;   // [width] this chunk's rescale factor of O^T
  int32_t* pos;  // [width] each lane's query position (padding lanes: the last one's)
};

// Keys per softmax step: whole pages, about 128 keys where pages are even (an odd page's last key
// pairs with the next page's first), so that the P.V tiles of four 32-key blocks accumulate into
// one O^T tile between its load and store, and the running max moves less often.
int64_t pages_per_chunk(int64_t block_size) {
  return block_size % 2 == 0 ? std::max<int64_t>(1, 128 / block_size) : 1;
}

int64_t chunk_keys(int64_t block_size) { return up(pages_per_chunk(block_size) * block_size, 32); }

// Scratch floats of a tile of `width` lanes, carved out in this order by carve().
int64_t scratch_floats(int64_t width, int64_t D, int64_t chunk) {
  return up(D / 2 * width, 16) + up(chunk * width, 16) + up(chunk / 2 * width, 16) + up(chunk / 2 * up(D, 32), 16) +
         up(chunk / 2 * up(D, 16), 16) + up(D * width, 16) + 4 * up(width, 16);
}

Tile carve(const AttentionParams& p, int64_t n_q, float* scratch) {
  Tile t;
  t.rows = n_q * (p.num_heads / p.num_kv_heads);
  t.panels = (t.rows + L - 1) / L;
  t.width = t.panels * L;
  const int64_t D = p.head_dim, chunk = chunk_keys(p.block_size);
  float* at = scratch;
  auto take = [&](int64_t n) { float* r = at; at += up(n, 16); return r; };
  t.qp = reinterpret_cast<uint32_t*>(take(D / 2 * t.width));
  t.s = take(chunk * t.width);
  t.pp = reinterpret_cast<uint32_t*>(take(chunk / 2 * t.width));
  t.vp = reinterpret_cast<uint32_t*>(take(chunk / 2 * up(D, 32)));
  t.vt = reinterpret_cast<uint32_t*>(take(chunk / 2 * up(D, 16)));
  t.o = take(D * t.width);
  t.m = take(t.width);
  t.l = take(t.width);
  t.corr = take(t.width);
  t.pos = reinterpret_cast<int32_t*>(take(t.width));
  return t;
}

// Row r of the tile is query j = r / G, head g = r % G of the item's KV head; qp takes 16 rows x 16
// pairs at a time by a transpose (rows past `rows` zero).
void load_queries(const AttentionParams& p, const WorkItem& it, const Tile& t) {
  const int64_t G = p.num_heads / p.num_kv_heads, words = p.head_dim / 2;
  for (int64_t r0 = 0; r0 < t.width; r0 += L) {
    const uint32_t* row[L];
    for (int64_t i = 0; i < L; ++i) {
      const int64_t r = std::min(r0 + i, t.rows - 1);
      const int64_t head = it.kv_head_begin * G + r % G;
      row[i] = reinterpret_cast<const uint32_t*>(static_cast<const uint16_t*>(p.q) + it.tokens[r / G] * p.q_token_stride +
                                                 head * p.q_head_stride);
    }
    for (int64_t w0 = 0; w0 < words; w0 += L) {
      const __mmask16 valid = words - w0 >= L ? __mmask16(0xffff) : static_cast<__mmask16>((1u << (words - w0)) - 1);
      __m512i r[L];
      for (int64_t i = 0; i < L; ++i) {
        r[i] = r0 + i < t.rows ? _mm512_maskz_loadu_epi32(valid, row[i] + w0) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t i = 0; i < std::min<int64_t>(L, words - w0); ++i) _mm512_storeu_si512(t.qp + (w0 + i) * t.width + r0, r[i]);
    }
  }
  for (int64_t r = 0; r < t.width; ++r) {
    t.pos[r] = static_cast<int32_t>(it.first_pos + std::min(r, t.rows - 1) / G);
    t.m[r] = -std::numeric_limits<float>::infinity();
    t.l[r] = 0.f;
  }
  std::memset(t.o, 0, p.head_dim * t.width * sizeof(float));
}

// s[s_row + k0 + k][c0 * 16 ..] = sum_d K[k0 + k][d] Q[row][d], for KR keys x NP panels (unscaled:
// the softmax applies the scale).
template <int KR, int NP>
inline void scores_tile(const Tile& t, const uint16_t* kp, int64_t token_stride, int64_t pairs, int64_t k0,
                        int64_t c0, int64_t s_row) {
  __m512 acc[KR][NP];
  for (int k = 0; k < KR; ++k)
    for (int j = 0; j < NP; ++j) acc[k][j] = _mm512_setzero_ps();
  const uint16_t* key = kp + k0 * token_stride;
  for (int64_t i = 0; i < pairs; ++i) {
    __m512i q[NP];
    for (int j = 0; j < NP; ++j) q[j] = _mm512_loadu_si512(t.qp + i * t.width + (c0 + j) * L);
    for (int k = 0; k < KR; ++k) {
      for (int j = 0; j < NP; ++j) acc[k][j] = dot_pair(acc[k][j], q[j], key + k * token_stride + 2 * i);
    }
  }
  for (int k = 0; k < KR; ++k)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(t.s + (s_row + k0 + k) * t.width + (c0 + j) * L, acc[k][j]);
}

template <int NP>
void scores_panels(const Tile& t, const uint16_t* kp, int64_t token_stride, int64_t pairs, int64_t n, int64_t c0,
                   int64_t k_begin, int64_t s_row) {
  int64_t k = k_begin;
  for (; k + 4 <= n; k += 4) scores_tile<4, NP>(t, kp, token_stride, pairs, k, c0, s_row);
  switch (n - k) {
    case 3: scores_tile<3, NP>(t, kp, token_stride, pairs, k, c0, s_row); break;
    case 2: scores_tile<2, NP>(t, kp, token_stride, pairs, k, c0, s_row); break;
    case 1: scores_tile<1, NP>(t, kp, token_stride, pairs, k, c0, s_row); break;
    default: break;
  }
}

// O^T[d0 + m][c0 * 16 ..] = O^T * corr + sum over key pairs of V pairs x P^T pairs, for DR rows of
// O^T x NP panels.
template <int DR, int NP>
inline void pv_tile(const Tile& t, int64_t kp_begin, int64_t key_pairs, int64_t Dv, int64_t d0, int64_t c0,
                    bool rescale) {
  __m512 acc[DR][NP];
  for (int j = 0; j < NP; ++j) {
    const __m512 c = rescale ? _mm512_loadu_ps(t.corr + (c0 + j) * L) : _mm512_set1_ps(1.f);
    for (int m = 0; m < DR; ++m) acc[m][j] = _mm512_mul_ps(_mm512_loadu_ps(t.o + (d0 + m) * t.width + (c0 + j) * L), c);
  }
  for (int64_t kp = kp_begin; kp < key_pairs; ++kp) {
    __m512i pr[NP];
    for (int j = 0; j < NP; ++j) pr[j] = _mm512_loadu_si512(t.pp + kp * t.width + (c0 + j) * L);
    for (int m = 0; m < DR; ++m) {
      for (int j = 0; j < NP; ++j) acc[m][j] = dot_pair(acc[m][j], pr[j], t.vp + kp * Dv + d0 + m);
    }
  }
  for (int m = 0; m < DR; ++m)
    for (int j = 0; j < NP; ++j) _mm512_storeu_ps(t.o + (d0 + m) * t.width + (c0 + j) * L, acc[m][j]);
}

// Key pairs [kp_begin, key_pairs); rescale: O^T by corr first (the AMX path has done it already).
template <int NP>
void pv_panels(const Tile& t, int64_t kp_begin, int64_t key_pairs, int64_t D, int64_t Dv, int64_t c0,
               bool rescale = true) {
  int64_t d = 0;
  for (; d + 4 <= D; d += 4) pv_tile<4, NP>(t, kp_begin, key_pairs, Dv, d, c0, rescale);
  switch (D - d) {
    case 3: pv_tile<3, NP>(t, kp_begin, key_pairs, Dv, d, c0, rescale); break;
    case 2: pv_tile<2, NP>(t, kp_begin, key_pairs, Dv, d, c0, rescale); break;
    case 1: pv_tile<1, NP>(t, kp_begin, key_pairs, Dv, d, c0, rescale); break;
    default: break;
  }
}

template <typename Fn>
inline void by_panels(const Tile& t, Fn fn) {
  for (int64_t c0 = 0; c0 < t.panels; c0 += kMaxPanels) {
    switch (std::min<int64_t>(kMaxPanels, t.panels - c0)) {
      case 1: fn(std::integral_constant<int, 1>{}, c0); break;
      case 2: fn(std::integral_constant<int, 2>{}, c0); break;
      case 3: fn(std::integral_constant<int, 3>{}, c0); break;
      default: fn(std::integral_constant<int, 4>{}, c0); break;
    }
  }
}

// How far (in powers of 2) a row's running max may rise above the max its exps are taken against
// before O^T and l are rescaled to a new one: exps up to 2^12, far from float's range, and most
// chunks rescale nothing.
constexpr float kRescaleAbove = 12.f;

// One panel's lanes of a chunk: the rows' positions, the last key before each row's window (below
// every key when there is no window), and the first key some row of the tile must not see.
struct PanelMask {
  __m512i pos, before;
  int64_t start, masked_from;

  // Key k's raw scores, -inf where the lane's row must not see it.
  __m512 scores(const float* col, int64_t width, int64_t k) const {
    const __m512 s = _mm512_loadu_ps(col + k * width);
    if (k < masked_from) return s;
    const __m512i key = _mm512_set1_epi32(static_cast<int32_t>(start + k));
    const __mmask16 seen = _mm512_cmpge_epi32_mask(pos, key) & _mm512_cmplt_epi32_mask(before, key);
    return _mm512_mask_mov_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), seen, s);
  }
};

// exp(scale * s - m) of a panel's n keys against the lanes' reference max m_exp (log2 units), as bf16
// pairs of keys into pp; returns their sum per lane, and in mx the largest exponent taken.
inline __m512 exp_panel(const Tile& t, const PanelMask& mask, int64_t panel, int64_t n, __m512 c, __m512 m_exp,
                        __m512& mx) {
  const float* col = t.s + panel * L;
  __m512 sum = _mm512_setzero_ps();
  mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t k = 0; k < n; k += 2) {
    const __m512 x_even = _mm512_fmsub_ps(mask.scores(col, t.width, k), c, m_exp);
    const __m512 x_odd = k + 1 < n ? _mm512_fmsub_ps(mask.scores(col, t.width, k + 1), c, m_exp)
                                   : _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    mx = _mm512_max_ps(mx, _mm512_max_ps(x_even, x_odd));
    const __m512 even = exp2_bounded(x_even), odd = exp2_bounded(x_odd);
    _mm512_storeu_si512(t.pp + k / 2 * t.width + panel * L, pairs_of(even, odd));
    sum = _mm512_add_ps(sum, _mm512_add_ps(even, odd));
  }
  return sum;
}

// The chunk's n raw scores (keys start .. start + n) to P^T as bf16 pairs of keys (t, t + 1) in pp:
// exp(scale * s - m), masked by causality and the sliding window (a row at pos sees keys pos - window
// < key <= pos) where some row does not see every key; updates m (kept in log2 units: the max of
// scale * log2(e) * s the exps are taken against) and l, and leaves each lane's rescale factor of O^T
// in corr. Returns whether any corr is not 1. scale > 0 (context_bf16_fits).
//
// A panel whose rows have seen keys already takes one pass against their reference max, which most
// chunks leave where it is; only where some exponent came out above kRescaleAbove (or no key has been
// seen yet) is the chunk's max taken first and the pass repeated against it.
bool online_softmax(const Tile& t, int64_t start, int64_t n, int64_t window, float scale) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 c = _mm512_set1_ps(scale * 1.44269504f), one = _mm512_set1_ps(1.f);
  const __m512 above = _mm512_set1_ps(kRescaleAbove);
  // Keys before `masked_from` are seen by every row (the first row sees up to its own position; with
  // a window, the last row sees from its position - window + 1 on: then every key is masked).
  const int64_t first_row_pos = t.pos[0], last_row_pos = t.pos[t.width - 1];
  const bool windowed = window > 0 && start <= last_row_pos - window;
  const int64_t masked_from = windowed ? 0 : std::clamp<int64_t>(first_row_pos + 1 - start, 0, n);
  bool rescaled = false;
  for (int64_t panel = 0; panel < t.panels; ++panel) {
    const __m512i pos = _mm512_loadu_si512(t.pos + panel * L);
    const PanelMask mask{pos,
                         window == 0 ? _mm512_set1_epi32(std::numeric_limits<int32_t>::min())
                                     : _mm512_sub_epi32(pos, _mm512_set1_epi32(static_cast<int32_t>(window))),
                         start, masked_from};
    const __m512 m_old = _mm512_loadu_ps(t.m + panel * L);
    __m512 mx, sum;
    bool settled = _mm512_cmpeq_ps_mask(m_old, neg_inf) == 0;
    if (settled) {
      sum = exp_panel(t, mask, panel, n, c, m_old, mx);
      settled = _mm512_cmp_ps_mask(mx, above, _CMP_GT_OQ) == 0;
    }
    __m512 corr = one;
    if (!settled) {
      const float* col = t.s + panel * L;
      mx = neg_inf;
      for (int64_t k = 0; k < n; ++k) mx = _mm512_max_ps(mx, mask.scores(col, t.width, k));
      mx = _mm512_mul_ps(mx, c);
      // The softmax is the same against any reference max: only a lane whose max rose by more than
      // kRescaleAbove moves its own (as a lane's first seen key always does: m_old is -inf).
      const __mmask16 move = _mm512_cmp_ps_mask(mx, _mm512_add_ps(m_old, above), _CMP_GT_OQ);
      const __m512 m_new = _mm512_mask_mov_ps(m_old, move, mx);
      // A row that has seen no key yet (its window starts on a later page) keeps m = -inf; its exps
      // are taken against 0 then, so that they and corr are 0, not NaN.
      const __m512 m_exp = _mm512_mask_mov_ps(m_new, _mm512_cmpeq_ps_mask(m_new, neg_inf), _mm512_setzero_ps());
      corr = move ? exp2_bounded(_mm512_sub_ps(m_old, m_exp)) : one;
      rescaled = rescaled || move;
      sum = exp_panel(t, mask, panel, n, c, m_exp, mx);
      _mm512_storeu_ps(t.m + panel * L, m_new);
    }
    _mm512_storeu_ps(t.l + panel * L, _mm512_fmadd_ps(_mm512_loadu_ps(t.l + panel * L), corr, sum));
    _mm512_storeu_ps(t.corr + panel * L, corr);
  }
  return rescaled;
}

// A V page of n keys as bf16 pairs of keys (t, t + 1) from pair row kp_begin of vp; an odd n's last
// pair takes a zero.
void pair_values(const Tile& t, const uint16_t* vp, int64_t token_stride, int64_t n, int64_t D, int64_t Dv,
                 int64_t kp_begin) {
  const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6,
                                          37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
  for (int64_t kp = 0; kp < (n + 1) / 2; ++kp) {
    const bool two = 2 * kp + 1 < n;
    const uint16_t* r0 = vp + 2 * kp * token_stride;
    const uint16_t* r1 = r0 + token_stride;
    for (int64_t d = 0; d < D; d += 32) {
      const __mmask32 valid = D - d >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((1u << (D - d)) - 1);
      const __m512i a = _mm512_maskz_loadu_epi16(valid, r0 + d);
      const __m512i b = two ? _mm512_maskz_loadu_epi16(valid, r1 + d) : _mm512_setzero_si512();
      _mm512_storeu_si512(t.vp + (kp_begin + kp) * Dv + d, _mm512_permutex2var_epi16(a, lo_idx, b));
      _mm512_storeu_si512(t.vp + (kp_begin + kp) * Dv + d + 16, _mm512_permutex2var_epi16(a, hi_idx, b));
    }
  }
}

// ---------------------------------------------------------------------------------------------- AMX

// S^T rows s_row + k0 .. + 16 from a page's keys k0 .. k0 + 16, every panel: tmm0-1 A (K, 32 d
// each), tmm2 B, tmm3 C.
void amx_scores(const Tile& t, const uint16_t* kp, int64_t token_stride, int64_t D, int64_t k0, int64_t s_row) {
  const uint16_t* key = kp + k0 * token_stride;
  const int64_t lda = token_stride * 2, ldb = t.width * 4;
  for (int64_t d0 = 0; d0 < D; d0 += 64) {  // two A tiles of 32 d at a time
    const bool two = d0 + 32 < D;
    _tile_loadd(0, key + d0, lda);
    if (two) _tile_loadd(1, key + d0 + 32, lda);
    for (int64_t c = 0; c < t.panels; ++c) {
      float* s = t.s + (s_row + k0) * t.width + c * L;
      if (d0 == 0) {
        _tile_zero(3);
      } else {
        _tile_loadd(3, s, ldb);
      }
      _tile_loadd(2, t.qp + (d0 / 2) * t.width + c * L, ldb);
      _tile_dpbf16ps(3, 0, 2);
      if (two) {
        _tile_loadd(2, t.qp + (d0 / 2 + 16) * t.width + c * L, ldb);
        _tile_dpbf16ps(3, 1, 2);
      }
      _tile_stored(3, s, ldb);
    }
  }
}

// O^T += V^T P^T over the chunk's key pairs 16 * kt0 .. 16 * (kt0 + tiles) (tiles <= 4), every d
// block and panel: tmm0-3 B (P^T pairs of each 16-pair tile: the scores are done with them), tmm4 A
// (V^T), tmm6 C, loaded and stored once for all the tiles.
void amx_pv(const Tile& t, int64_t kt0, int64_t tiles, int64_t D, int64_t Dv) {
  const int64_t ld = t.width * 4;
  for (int64_t kt = 0; kt < tiles; ++kt)
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(t.vp + (16 * (kt0 + kt) + i) * Dv + d0);
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(t.vt + (kt * D + d0 + i) * 16, r[i]);
    }
  for (int64_t c = 0; c < t.panels; ++c) {
    const uint32_t* pp = t.pp + 16 * kt0 * t.width + c * L;
    switch (tiles) {  // tile registers are named by immediates
      case 4: _tile_loadd(3, pp + 48 * t.width, ld); [[fallthrough]];
      case 3: _tile_loadd(2, pp + 32 * t.width, ld); [[fallthrough]];
      case 2: _tile_loadd(1, pp + 16 * t.width, ld); [[fallthrough]];
      default: _tile_loadd(0, pp, ld);
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      float* o = t.o + d0 * t.width + c * L;
      const uint32_t* vt = t.vt + d0 * 16;
      _tile_loadd(6, o, ld);
      _tile_loadd(4, vt, 64);
      _tile_dpbf16ps(6, 4, 0);
      if (tiles > 1) {
        _tile_loadd(4, vt + D * 16, 64);
        _tile_dpbf16ps(6, 4, 1);
      }
      if (tiles > 2) {
        _tile_loadd(4, vt + 2 * D * 16, 64);
        _tile_dpbf16ps(6, 4, 2);
      }
      if (tiles > 3) {
        _tile_loadd(4, vt + 3 * D * 16, 64);
        _tile_dpbf16ps(6, 4, 3);
      }
      _tile_stored(6, o, ld);
    }
  }
}

// O^T *= corr, per lane (the online softmax's rescale for this chunk).
void rescale_o(const Tile& t, int64_t D) {
  for (int64_t x = 0; x < t.width; x += L) {
    const __m512 c = _mm512_loadu_ps(t.corr + x);
    for (int64_t d = 0; d < D; ++d) {
      float* o = t.o + d * t.width + x;
      _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), c));
    }
  }
}

// O^T back to rows, 16 d x 16 rows at a time by a transpose, each row times kv_scale / l.
void store_rows(const AttentionParams& p, const WorkItem& it, const Tile& t) {
  const int64_t G = p.num_heads / p.num_kv_heads, D = p.head_dim;
  auto* out = static_cast<uint16_t*>(p.out);
  for (int64_t r0 = 0; r0 < t.rows; r0 += L) {
    // Every query sees its own key, so l >= 1 (padding lanes too: they copy the last row).
    const __m512 mul = _mm512_div_ps(_mm512_set1_ps(p.kv_scale), _mm512_loadu_ps(t.l + r0));
    float muls[L];
    _mm512_storeu_ps(muls, mul);
    for (int64_t d0 = 0; d0 < D; d0 += L) {
      const int64_t nd = std::min<int64_t>(L, D - d0);
      __m512i r[L];
      for (int64_t i = 0; i < L; ++i) {
        r[i] = i < nd ? _mm512_loadu_si512(t.o + (d0 + i) * t.width + r0) : _mm512_setzero_si512();
      }
      transpose16(r);
      const __mmask16 valid = static_cast<__mmask16>((1u << nd) - 1);
      for (int64_t i = 0; i < std::min<int64_t>(L, t.rows - r0); ++i) {
        const int64_t row = r0 + i;
        uint16_t* dst = out + (it.tokens[row / G] * p.num_heads + it.kv_head_begin * G + row % G) * D + d0;
        const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(r[i]), _mm512_set1_ps(muls[i]));
        _mm256_mask_storeu_epi16(dst, valid, (__m256i)_mm512_cvtneps_pbh(v));
      }
    }
  }
}

}  // namespace

bool context_bf16_fits(const AttentionParams& p, const WorkItem& it) {
  const int64_t G = p.num_heads / p.num_kv_heads;
  return p.q_dtype == DType::BFloat16 && p.kv_dtype == DType::BFloat16 && p.head_dim % 2 == 0 && p.softcap == 0 &&
         p.scale > 0 && it.partial == nullptr && it.kv_head_end == it.kv_head_begin + 1 && it.n_q * G >= L;
}

int64_t context_bf16_scratch(const AttentionParams& p, int64_t n_q) {
  return scratch_floats(up(n_q * (p.num_heads / p.num_kv_heads), L), p.head_dim, chunk_keys(p.block_size));
}

void attend_context_bf16(const AttentionParams& p, const WorkItem& it, float* scratch, bool amx) {
  const Tile t = carve(p, it.n_q, scratch);
  const int64_t D = p.head_dim, bs = p.block_size, Dv = up(D, 32);
  amx = amx && D % 32 == 0;
  if (amx) amx_tiles::configure();
  load_queries(p, it, t);
  const auto* k_base = static_cast<const uint16_t*>(p.k);
  const auto* v_base = static_cast<const uint16_t*>(p.v);
  const float scale = p.scale * p.kv_scale;
  const int64_t per_chunk = pages_per_chunk(bs);
  for (int64_t b0 = it.key_begin / bs; b0 * bs < it.key_end; b0 += per_chunk) {
    const int64_t start = b0 * bs, n = std::min(per_chunk * bs, it.key_end - start);
    for (int64_t b = b0; b < b0 + per_chunk && b * bs < it.key_end; ++b) {
      const int64_t row = (b - b0) * bs, page_n = std::min(bs, it.key_end - b * bs);
      const int64_t offset = it.block_table[b] * p.block_stride + it.kv_head_begin * p.head_stride;
      const int64_t keys_on_tiles = amx ? page_n / 16 * 16 : 0;
      for (int64_t k0 = 0; k0 < keys_on_tiles; k0 += 16) amx_scores(t, k_base + offset, p.token_stride, D, k0, row);
      by_panels(t, [&](auto np, int64_t c0) {
        scores_panels<decltype(np)::value>(t, k_base + offset, p.token_stride, D / 2, page_n, c0, keys_on_tiles, row);
      });
      pair_values(t, v_base + offset, p.token_stride, page_n, D, Dv, row / 2);
    }
    const bool rescaled = online_softmax(t, start, n, p.window, scale);
    const int64_t pairs = (n + 1) / 2, pairs_on_tiles = amx ? pairs / 16 * 16 : 0;
    if (amx && rescaled) rescale_o(t, D);
    for (int64_t kt = 0; kt < pairs_on_tiles / 16; kt += 4) amx_pv(t, kt, std::min<int64_t>(4, pairs_on_tiles / 16 - kt), D, Dv);
    if (pairs_on_tiles < pairs) {
      by_panels(t, [&](auto np, int64_t c0) {
        pv_panels<decltype(np)::value>(t, pairs_on_tiles, pairs, D, Dv, c0, !amx);
      });
    }
  }
  if (amx) _tile_release();
  store_rows(p, it, t);
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
bool context_bf16_fits(const AttentionParams&, const WorkItem&) { return false; }
int64_t context_bf16_scratch(const AttentionParams&, int64_t) { return 0; }
void attend_context_bf16(const AttentionParams&, const WorkItem&, float*, bool) {}
}  // namespace avx512
}  // namespace kiln
#endif
