// The paged-attention kernel, written once against ATen's at::vec::Vectorized<float> and compiled
// once per CPU capability, as ATen builds its own kernels: kernels_<cap>.cpp or
// paged_attention_avx512.cpp defines CPU_CAPABILITY (which names the namespace the code lands in,
// and ATen's vec namespace) and CPU_CAPABILITY_AVX2 / CPU_CAPABILITY_AVX512 with the matching
// target options, then includes this file. No raw intrinsics: the same source is plain C++ loops
// (DEFAULT), 8-wide AVX2 or 16-wide AVX-512, and builds on any CPU ATen supports.
//
// A work item (paged_attention.h) is some query tokens of one sequence against some KV heads: a
// context-phase tile (a few dozen tokens, one KV head) or a generation-phase token (all KV heads,
// or a partition of the keys of a long sequence). Its query rows walk the sequence's pages in
// order, reading each K/V page in place through the block table, with an online softmax per row
// (flash-attention style: running max m, running sum l, rescaled accumulator o), so no
// [rows, context] score matrix is ever formed. The whole GQA group of a KV head shares each page.
// A generation token's rows read the page straight from the pool, widening in registers (see
// decode_pass); a context tile's widen bf16 / fp16 / 8-bit pages into a small scratch once, then
// take scores as dot products (few rows) or broadcast-FMAs against the transposed K (many rows), and
// p.V two rows per pass over the V page. An 8-bit pool's scale never touches a K/V element: it
// multiplies the queries (scores) and the outputs (p.V) instead.
//
// No static data in this file: it would be initialized with this TU's target options at load
// time, before the capability check (see ATen's Note [Do not compile initializers with AVX]).

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "vec_common.h"

#include "paged_attention.h"

namespace kiln {
namespace CPU_CAPABILITY {
namespace {

// From this many query rows on, a page's scores come from its transposed K (see scores_kt).
constexpr int64_t kTiledRows = 12;

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// An fp8 e4m3 byte's bits moved into an fp16 (sign, then exponent and mantissa shifted up by 7) read
// as the fp8 value / 256, exactly, subnormals included (a pool holds no NaN: writes clamp to +-448).
// The 1/256 joins the pool's scale (kWidened).
inline c10::Half fp8_as_half(c10::Float8_e4m3fn x) {
  return c10::Half(static_cast<uint16_t>(((x.x & 0x80) << 8) | ((x.x & 0x7F) << 7)), c10::Half::from_bits());
}

// An element as float: exact for float, bf16, fp16 and int8; an fp8 element comes out 1/256 of its
// value, made up by kWidened<T>.
template <typename T>
inline float widen(T x) {
  if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
    return static_cast<float>(fp8_as_half(x));
  } else {
    return static_cast<float>(x);
  }
}

template <typename T>
constexpr float kWidened = std::is_same_v<T, c10::Float8_e4m3fn> ? 256.f : 1.f;

// W elements as float (see widen): read in place, widened in registers. int8 by ATen's convert. fp8's
// sign-extended byte shifted up by 20 and masked to sign, exponent and mantissa reads as a float of
// the fp8 value * 2^-120 (subnormals as float denormals, still exact), scaled to widen's value / 256
// by one multiply. The portable build goes through halves (fp8_as_half), as widen does.
template <typename T>
inline Vec load_vec(const T* src) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else if constexpr (std::is_same_v<T, int8_t>) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    return at::vec::convert_int8_to_float(at::vec::Vectorized<int8_t>::loadu_one_fourth(src));
#else
    float f[W];
    for (int64_t i = 0; i < W; ++i) f[i] = static_cast<float>(src[i]);
    return Vec::loadu(f);
#endif
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn>) {
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
    using Int = at::vec::Vectorized<int32_t>;
    const Int bits = at::vec::convert<int32_t>(at::vec::Vectorized<int8_t>::loadu_one_fourth(src));
    return at::vec::cast<float>((bits << Int(20)) & Int(static_cast<int32_t>(0x87F00000u))) * Vec(0x1p112f);
#else
    c10::Half h[W];
    for (int64_t i = 0; i < W; ++i) h[i] = fp8_as_half(src[i]);
    Vec x;
    at::vec::load_to_float(h, x);
    return x;
#endif
  } else {
    Vec x;
    at::vec::load_to_float(src, x);
    return x;
  }
}

// dst[0, n) = widen(src[0, n)) * mul, dst[n, padded) = 0.
template <typename T>
inline void load_row(const T* src, float mul, float* dst, int64_t n, int64_t padded) {
  const Vec vm(mul);
  int64_t i = 0;
  for (; i + W <= n; i += W) (load_vec(src + i) * vm).store(dst + i);
  for (; i < n; ++i) dst[i] = widen(src[i]) * mul;
  for (; i < padded; ++i) dst[i] = 0.f;
}

// dst[0, n) = T(src[0, n) * mul), rounding once (to nearest even, as Tensor.to does).
template <typename T>
inline void store_row(const float* src, float mul, T* dst, int64_t n) {
  const Vec vm(mul);
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    for (; i + W <= n; i += W) (Vec::loadu(src + i) * vm).store(dst + i);
  }
  for (; i < n; ++i) dst[i] = static_cast<T>(src[i] * mul);
}

inline void load_q_row(const AttentionParams& p, const void* src, float mul, float* dst, int64_t Dp) {
  switch (p.q_dtype) {
    case DType::BFloat16: return load_row(static_cast<const c10::BFloat16*>(src), mul, dst, p.head_dim, Dp);
    case DType::Half: return load_row(static_cast<const c10::Half*>(src), mul, dst, p.head_dim, Dp);
    default: return load_row(static_cast<const float*>(src), mul, dst, p.head_dim, Dp);
  }
}

inline void store_out_row(const AttentionParams& p, const float* src, float mul, int64_t offset) {
  switch (p.q_dtype) {
    case DType::BFloat16: return store_row(src, mul, static_cast<c10::BFloat16*>(p.out) + offset, p.head_dim);
    case DType::Half: return store_row(src, mul, static_cast<c10::Half*>(p.out) + offset, p.head_dim);
    default: return store_row(src, mul, static_cast<float*>(p.out) + offset, p.head_dim);
  }
}

// a[0, Dp) . b[0, Dp), Dp a multiple of W; two accumulators to hide the FMA latency.
inline float dot(const float* a, const float* b, int64_t Dp) {
  Vec acc0(0.f), acc1(0.f);
  int64_t c = 0;
  for (; c + 2 * W <= Dp; c += 2 * W) {
    acc0 = at::vec::fmadd(Vec::loadu(a + c), Vec::loadu(b + c), acc0);
    acc1 = at::vec::fmadd(Vec::loadu(a + c + W), Vec::loadu(b + c + W), acc1);
  }
  if (c < Dp) acc0 = at::vec::fmadd(Vec::loadu(a + c), Vec::loadu(b + c), acc0);
  return reduce_add(acc0 + acc1);
}

// sr[t] = qr . K[t] for t < n, with the query row held in registers across the keys (ND = Dp / W).
template <int ND>
inline void scores_row(const float* qr, const float* K, int64_t stride, int64_t n, float* sr) {
  Vec q[ND];
  for (int k = 0; k < ND; ++k) q[k] = Vec::loadu(qr + k * W);
  for (int64_t t = 0; t < n; ++t) {
    const float* kr = K + t * stride;
    Vec acc0 = q[0] * Vec::loadu(kr);
    Vec acc1(0.f);
    for (int k = 1; k + 1 < ND; k += 2) {
      acc1 = at::vec::fmadd(q[k], Vec::loadu(kr + k * W), acc1);
      acc0 = at::vec::fmadd(q[k + 1], Vec::loadu(kr + (k + 1) * W), acc0);
    }
    if (ND % 2 == 0) acc1 = at::vec::fmadd(q[ND - 1], Vec::loadu(kr + (ND - 1) * W), acc1);
    sr[t] = reduce_add(acc0 + acc1);
  }
}

inline void scores(const float* qr, const float* K, int64_t stride, int64_t n, float* sr, int64_t Dp) {
  switch (Dp / W) {
    case 1: return scores_row<1>(qr, K, stride, n, sr);
    case 2: return scores_row<2>(qr, K, stride, n, sr);
    case 3: return scores_row<3>(qr, K, stride, n, sr);
    case 4: return scores_row<4>(qr, K, stride, n, sr);
    case 5: return scores_row<5>(qr, K, stride, n, sr);
    case 6: return scores_row<6>(qr, K, stride, n, sr);
    case 8: return scores_row<8>(qr, K, stride, n, sr);
    case 10: return scores_row<10>(qr, K, stride, n, sr);
    case 12: return scores_row<12>(qr, K, stride, n, sr);
    case 16: return scores_row<16>(qr, K, stride, n, sr);
    default:
      for (int64_t t = 0; t < n; ++t) sr[t] = dot(qr, K + t * stride, Dp);
  }
}

// o[0, NV * W) = o * corr + sum_{t < n} p[t] * V[t][0, NV * W): the accumulator stays in registers.
template <int NV>
inline void pv_chunk(float* o, float corr, const float* p, const float* V, int64_t vstride, int64_t n) {
  Vec acc[NV];
  const Vec vc(corr);
  for (int k = 0; k < NV; ++k) acc[k] = Vec::loadu(o + k * W) * vc;
  for (int64_t t = 0; t < n; ++t) {
    const Vec pt(p[t]);
    const float* vr = V + t * vstride;
    for (int k = 0; k < NV; ++k) acc[k] = at::vec::fmadd(pt, Vec::loadu(vr + k * W), acc[k]);
  }
  for (int k = 0; k < NV; ++k) acc[k].store(o + k * W);
}

inline void pv(float* o, float corr, const float* p, const float* V, int64_t vstride, int64_t n, int64_t Dp) {
  int64_t c = 0;
  for (; c + 8 * W <= Dp; c += 8 * W) pv_chunk<8>(o + c, corr, p, V + c, vstride, n);
  switch ((Dp - c) / W) {
    case 1: return pv_chunk<1>(o + c, corr, p, V + c, vstride, n);
    case 2: return pv_chunk<2>(o + c, corr, p, V + c, vstride, n);
    case 3: return pv_chunk<3>(o + c, corr, p, V + c, vstride, n);
    case 4: return pv_chunk<4>(o + c, corr, p, V + c, vstride, n);
    case 5: return pv_chunk<5>(o + c, corr, p, V + c, vstride, n);
    case 6: return pv_chunk<6>(o + c, corr, p, V + c, vstride, n);
    case 7: return pv_chunk<7>(o + c, corr, p, V + c, vstride, n);
    default: return;
  }
}

// Two rows at once: each V load feeds both rows' accumulators (4 vectors of D per row at a time).
template <int NV>
inline void pv2_chunk(float* o0, float* o1, float c0, float c1, const float* p0, const float* p1, const float* V,
                      int64_t vstride, int64_t n) {
  Vec a0[NV], a1[NV];
  const Vec vc0(c0), vc1(c1);
  for (int k = 0; k < NV; ++k) {
    a0[k] = Vec::loadu(o0 + k * W) * vc0;
    a1[k] = Vec::loadu(o1 + k * W) * vc1;
  }
  for (int64_t t = 0; t < n; ++t) {
    const Vec b0(p0[t]), b1(p1[t]);
    const float* vr = V + t * vstride;
    for (int k = 0; k < NV; ++k) {
      const Vec v = Vec::loadu(vr + k * W);
      a0[k] = at::vec::fmadd(b0, v, a0[k]);
      a1[k] = at::vec::fmadd(b1, v, a1[k]);
    }
  }
  for (int k = 0; k < NV; ++k) {
    a0[k].store(o0 + k * W);
    a1[k].store(o1 + k * W);
  }
}

inline void pv2(float* o0, float* o1, float c0, float c1, const float* p0, const float* p1, const float* V,
                int64_t vstride, int64_t n, int64_t Dp) {
  int64_t c = 0;
  for (; c + 4 * W <= Dp; c += 4 * W) pv2_chunk<4>(o0 + c, o1 + c, c0, c1, p0, p1, V + c, vstride, n);
  switch ((Dp - c) / W) {
    case 1: return pv2_chunk<1>(o0 + c, o1 + c, c0, c1, p0, p1, V + c, vstride, n);
    case 2: return pv2_chunk<2>(o0 + c, o1 + c, c0, c1, p0, p1, V + c, vstride, n);
    case 3: return pv2_chunk<3>(o0 + c, o1 + c, c0, c1, p0, p1, V + c, vstride, n);
    default: return;
  }
}

// A K page transposed to kt[d][t] (float, Bp columns, zero past the page's n keys), so that the
// scores of many query rows are broadcast-FMAs over keys with no horizontal sums.
template <typename T>
inline void load_transposed(const T* kp, int64_t stride, int64_t n, int64_t D, int64_t Bp, float* kt) {
  for (int64_t t = 0; t < n; ++t) {
    const T* row = kp + t * stride;
    for (int64_t d = 0; d < D; ++d) kt[d * Bp + t] = widen(row[d]);
  }
  if (n < Bp) {
    for (int64_t d = 0; d < D; ++d) std::fill(kt + d * Bp + n, kt + (d + 1) * Bp, 0.f);
  }
}

// s{0,1}[0, NV * W) = q{0,1} . kt[:, 0, NV * W): two query rows against NV vectors of keys.
template <int NV, int R>
inline void scores_kt_chunk(const float* q0, const float* q1, const float* kt, int64_t Bp, int64_t D, float* s0,
                            float* s1) {
  Vec a0[NV], a1[NV];
  for (int k = 0; k < NV; ++k) a0[k] = a1[k] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const Vec b0(q0[d]);
    const Vec b1(R == 2 ? q1[d] : 0.f);
    const float* kr = kt + d * Bp;
    for (int k = 0; k < NV; ++k) {
      const Vec kv = Vec::loadu(kr + k * W);
      a0[k] = at::vec::fmadd(b0, kv, a0[k]);
      if (R == 2) a1[k] = at::vec::fmadd(b1, kv, a1[k]);
    }
  }
  for (int k = 0; k < NV; ++k) {
    a0[k].store(s0 + k * W);
    if (R == 2) a1[k].store(s1 + k * W);
  }
}

template <int NV>
inline void scores_kt_rows(const float* qf, int64_t Dp, int64_t r0, int64_t r1, const float* kt, int64_t Bp,
                           int64_t D, float* s, int64_t c) {
  int64_t r = r0;
  for (; r + 1 < r1; r += 2) {
    scores_kt_chunk<NV, 2>(qf + r * Dp, qf + (r + 1) * Dp, kt + c, Bp, D, s + r * Bp + c, s + (r + 1) * Bp + c);
  }
  if (r < r1) scores_kt_chunk<NV, 1>(qf + r * Dp, nullptr, kt + c, Bp, D, s + r * Bp + c, nullptr);
}

// s[r][0, Bp) for rows r0 .. r1 (all Bp keys; the caller masks).
inline void scores_kt(const float* qf, int64_t Dp, int64_t r0, int64_t r1, const float* kt, int64_t Bp, int64_t D,
                      float* s) {
  for (int64_t c = 0; c < Bp; c += 4 * W) {
    switch (std::min<int64_t>(4, (Bp - c) / W)) {
      case 1: scores_kt_rows<1>(qf, Dp, r0, r1, kt, Bp, D, s, c); break;
      case 2: scores_kt_rows<2>(qf, Dp, r0, r1, kt, Bp, D, s, c); break;
      case 3: scores_kt_rows<3>(qf, Dp, r0, r1, kt, Bp, D, s, c); break;
      default: scores_kt_rows<4>(qf, Dp, r0, r1, kt, Bp, D, s, c); break;
    }
  }
}

// Asks for the lines of [p, p + bytes) shifted by `ahead` elements: the same bytes of the next page
// of the block table, requested as this page's twin is read, so the requests spread over the page's
// compute (one burst of a page's lines fills the miss queue and stalls) and the next page is in
// cache when reached. Pages lie anywhere in the pool, so the hardware prefetchers stop at a page's
// end. ahead = 0 (no next page) asks for lines being read anyway.
template <typename T>
inline void prefetch_twin(const T* p, int64_t ahead, int64_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
  const char* twin = reinterpret_cast<const char*>(p + ahead);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(twin + off, 0, 3);
#endif
}

// Generation-phase pages (one query token: a GQA group of G rows per KV head) are attended straight
// from the pool, R <= 4 rows at a time: each K/V element is widened once, in registers, and feeds
// every row; a key's score is left as W lane sums (part[r][t][0, W)), and W keys' lanes are summed
// together after one W x W transpose instead of one horizontal sum per key and row.
constexpr int64_t kDecodeRows = 4;

// ND = D / W, known at compile time for the common head sizes so that the loop over D unrolls; two
// accumulators per row halve the FMA chain.
template <typename T, int R, int ND>
inline void decode_lanes(const float* q, int64_t D, const T* kp, int64_t stride, int64_t n, float* part,
                         int64_t Bp, int64_t ahead) {
  const int64_t nd = ND > 0 ? ND : D / W;
  for (int64_t t = 0; t < n; ++t) {
    const T* kr = kp + t * stride;
    prefetch_twin(kr, ahead, D * static_cast<int64_t>(sizeof(T)));
    Vec acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec(0.f);
    for (int64_t j = 0; j < nd; ++j) {
      const Vec k = load_vec(kr + j * W);
      for (int r = 0; r < R; ++r) acc[r][j % 2] = at::vec::fmadd(Vec::loadu(q + r * D + j * W), k, acc[r][j % 2]);
    }
    for (int r = 0; r < R; ++r) (acc[r][0] + acc[r][1]).store(part + (r * Bp + t) * W);
  }
}

template <typename T, int R>
inline void decode_lanes(const float* q, int64_t D, const T* kp, int64_t stride, int64_t n, float* part,
                         int64_t Bp, int64_t ahead) {
  switch (D / W) {
    case 4: return decode_lanes<T, R, 4>(q, D, kp, stride, n, part, Bp, ahead);
    case 8: return decode_lanes<T, R, 8>(q, D, kp, stride, n, part, Bp, ahead);
    case 16: return decode_lanes<T, R, 16>(q, D, kp, stride, n, part, Bp, ahead);
    default: return decode_lanes<T, R, 0>(q, D, kp, stride, n, part, Bp, ahead);
  }
}

// s[t] = sum of the W lanes of part[t], t < n (rounded up to W).
inline void sum_lanes(const float* part, int64_t n, float* s) {
  float tr[W * W];
  for (int64_t t0 = 0; t0 < n; t0 += W) {
    at::vec::transpose_mxn<float, W, W>(part + t0 * W, W, tr, W);
    Vec sum = Vec::loadu(tr);
    for (int64_t j = 1; j < W; ++j) sum = sum + Vec::loadu(tr + j * W);
    sum.store(s + t0);
  }
}

// o[r][0, D) = o[r] * corr[r] + sum_{t < n} p[r][t] * v_t for R rows, CH vectors of D at a time
// in registers (R * CH accumulators).
template <typename T, int R, int CH>
inline void decode_pv(float* o, const float* corr, const float* p, int64_t Bp, const T* vp, int64_t stride,
                      int64_t n, int64_t D, int64_t ahead) {
  for (int64_t c = 0; c < D; c += CH * W) {
    Vec acc[R][CH];
    for (int r = 0; r < R; ++r) {
      const Vec cr(corr[r]);
      for (int k = 0; k < CH; ++k) acc[r][k] = Vec::loadu(o + r * D + c + k * W) * cr;
    }
    for (int64_t t = 0; t < n; ++t) {
      const T* vr = vp + t * stride + c;
      prefetch_twin(vr, ahead, CH * W * static_cast<int64_t>(sizeof(T)));
      Vec v[CH];
      for (int k = 0; k < CH; ++k) v[k] = load_vec(vr + k * W);
      for (int r = 0; r < R; ++r) {
        const Vec pt(p[r * Bp + t]);
        for (int k = 0; k < CH; ++k) acc[r][k] = at::vec::fmadd(pt, v[k], acc[r][k]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int k = 0; k < CH; ++k) acc[r][k].store(o + r * D + c + k * W);
    }
  }
}

// Whether the decode path takes a head_dim: whole pairs of vectors (the CH of decode_pv).
inline bool decode_fits(int64_t D) { return D % (2 * W) == 0; }

template <typename T, int R>
inline void decode_rows_pv(float* o, const float* corr, const float* p, int64_t Bp, const T* vp, int64_t stride,
                           int64_t n, int64_t D, int64_t ahead) {
  // One row alone has too few accumulators at two vectors wide to hide the FMA latency.
  if (R == 1 && D % (4 * W) == 0) return decode_pv<T, 1, 4>(o, corr, p, Bp, vp, stride, n, D, ahead);
  decode_pv<T, R, 2>(o, corr, p, Bp, vp, stride, n, D, ahead);
}

template <typename T, int R>
inline void decode_rows(const float* q, float* o, const float* corr, float* s, float* part, int64_t Bp,
                        const T* kp, const T* vp, int64_t stride, int64_t n, int64_t D, int64_t ahead,
                        bool scores) {
  if (scores) {
    decode_lanes<T, R>(q, D, kp, stride, n, part, Bp, ahead);
    for (int r = 0; r < R; ++r) sum_lanes(part + r * Bp * W, n, s + r * Bp);
  } else {
    decode_rows_pv<T, R>(o, corr, s, Bp, vp, stride, n, D, ahead);
  }
}

// A page's scores (scores = true) or its p.V (false) for `rows` rows, in groups of kDecodeRows. The
// first group asks for the next page's lines, `ahead` elements on (see prefetch_twin).
template <typename T>
void decode_pass(const float* q, float* o, const float* corr, float* s, float* part, int64_t rows, int64_t Bp,
                 const T* kp, const T* vp, int64_t stride, int64_t n, int64_t D, int64_t ahead, bool scores) {
  for (int64_t r = 0; r < rows; r += kDecodeRows) {
    const float* qr = q + r * D;
    float* orow = o + r * D;
    const int64_t a = r == 0 ? ahead : 0;
    switch (std::min(kDecodeRows, rows - r)) {
      case 1: decode_rows<T, 1>(qr, orow, corr + r, s + r * Bp, part, Bp, kp, vp, stride, n, D, a, scores); break;
      case 2: decode_rows<T, 2>(qr, orow, corr + r, s + r * Bp, part, Bp, kp, vp, stride, n, D, a, scores); break;
      case 3: decode_rows<T, 3>(qr, orow, corr + r, s + r * Bp, part, Bp, kp, vp, stride, n, D, a, scores); break;
      default: decode_rows<T, 4>(qr, orow, corr + r, s + r * Bp, part, Bp, kp, vp, stride, n, D, a, scores); break;
    }
  }
}

// Running state of one KV head's query rows (rows of them): see attend_impl.
struct HeadRows {
  const float* q;  // [rows][Dp] queries times scale; row r = j * G + g
  float* o;        // [rows][Dp] unnormalized outputs
  float* m;        // [rows] running max of the scores
  float* l;        // [rows] running sum of exp(score - m)
  float* corr;     // [rows] this page's correction exp(m_old - m_new)
};

// Online softmax of rows r0 .. rows over a page's scores s[r][0, Bp), of which row r sees keys
// hidden(r) .. visible(r) (hidden: keys before its sliding window), soft-capped first where softcap
// is set: turns the scores into probabilities (0 for the unseen keys), updates m and l, and sets
// corr to the factor the row's accumulator must be rescaled by.
template <typename Visible, typename Hidden>
inline void online_softmax(const HeadRows& h, int64_t r0, int64_t rows, float* s, int64_t Bp, Visible visible,
                           Hidden hidden, float softcap) {
  for (int64_t r = r0; r < rows; ++r) {
    float* sr = s + r * Bp;
    if (softcap > 0) {
      for (int64_t t = 0, n = visible(r); t < n; ++t) sr[t] = softcap * std::tanh(sr[t] / softcap);
    }
    std::fill(sr + visible(r), sr + Bp, kNegInf);
    std::fill(sr, sr + std::min<int64_t>(hidden(r), Bp), kNegInf);
    Vec mx(kNegInf);
    for (int64_t t = 0; t < Bp; t += W) mx = at::vec::maximum(mx, Vec::loadu(sr + t));
    // A row that has seen no key yet (its window starts on a later page) keeps m = -inf; exp is
    // taken against 0 then, so that its probabilities and corr are 0, not NaN.
    const float m_new = std::max(h.m[r], reduce_max(mx)), m_exp = m_new == kNegInf ? 0.f : m_new;
    h.corr[r] = std::exp(h.m[r] - m_exp);  // 0 on the first page (m = -inf)
    const Vec vm(m_exp);
    Vec sum(0.f);
    for (int64_t t = 0; t < Bp; t += W) {
      const Vec e = (Vec::loadu(sr + t) - vm).exp_u20();  // ATen's softmax exp (20 ULP)
      e.store(sr + t);
      sum = sum + e;
    }
    h.l[r] = h.l[r] * h.corr[r] + reduce_add(sum);
    h.m[r] = m_new;
  }
}

// One page (keys start .. start + n) of one KV head against that head's query rows; the item's next
// page is `ahead` elements on.
template <typename T>
void attend_page(const AttentionParams& p, const WorkItem& it, const HeadRows& h, int64_t rows, const T* kp,
                 const T* vp, int64_t ahead, int64_t start, int64_t n, float* s, float* kf, float* vf, float* kt) {
  const int64_t G = p.num_heads / p.num_kv_heads, D = p.head_dim;
  const int64_t Dp = round_up(D, W), Bp = round_up(p.block_size, W);
  // Row r's query sits at first_pos + r / G: keys before pos - window + 1 are outside its window.
  const auto hidden = [&](int64_t r) {
    return p.window == 0 ? int64_t{0} : std::clamp<int64_t>(it.first_pos + r / G - p.window + 1 - start, 0, n);
  };
  if (it.n_q == 1 && decode_fits(D)) {  // a generation token: every row sees all n keys but the hidden
    const auto all = [n](int64_t) { return n; };
    decode_pass(h.q, h.o, h.corr, s, kf, rows, Bp, kp, vp, p.token_stride, n, D, ahead, true);
    online_softmax(h, 0, rows, s, Bp, all, hidden, p.softcap);
    decode_pass(h.q, h.o, h.corr, s, kf, rows, Bp, kp, vp, p.token_stride, n, D, ahead, false);
    return;
  }
  // A context tile computes on a page long enough for one burst of requests for the next page.
  for (int64_t t = 0; t < n; ++t) {
    prefetch_twin(kp + t * p.token_stride, ahead, D * static_cast<int64_t>(sizeof(T)));
    prefetch_twin(vp + t * p.token_stride, ahead, D * static_cast<int64_t>(sizeof(T)));
  }
  // Query j sees this page's keys start .. first_pos + j: queries before j0 see none of them.
  const int64_t r0 = std::max<int64_t>(0, start - it.first_pos) * G;
  auto visible = [&](int64_t r) { return std::min(n, it.first_pos + r / G - start + 1); };
  // Many rows (a context tile): transpose the K page once and broadcast-FMA over keys; a few rows
  // (a generation token's GQA group): dot products against the K rows.
  const bool tiled = rows - r0 >= kTiledRows;
  // A float cache whose rows are whole vectors is read straight from the pool.
  const bool direct = std::is_same_v<T, float> && D == Dp;
  const float *K = kf, *V = vf;
  int64_t stride = Dp;
  if (direct) {
    K = reinterpret_cast<const float*>(kp);
    V = reinterpret_cast<const float*>(vp);
    stride = p.token_stride;
  } else {
    for (int64_t t = 0; t < n; ++t) {
      if (!tiled) load_row(kp + t * p.token_stride, 1.f, kf + t * Dp, D, Dp);
      load_row(vp + t * p.token_stride, 1.f, vf + t * Dp, D, Dp);
    }
  }
  if (tiled) {
    load_transposed(kp, p.token_stride, n, D, Bp, kt);
    scores_kt(h.q, Dp, r0, rows, kt, Bp, D, s);
  } else {
    for (int64_t r = r0; r < rows; ++r) scores(h.q + r * Dp, K, stride, visible(r), s + r * Bp, Dp);
  }
  online_softmax(h, r0, rows, s, Bp, visible, hidden, p.softcap);
  // o = o * corr + p V, two rows per pass over the V page (row r + 1 sees at least row r's keys).
  int64_t r = r0;
  for (; r + 1 < rows; r += 2) {
    pv2(h.o + r * Dp, h.o + (r + 1) * Dp, h.corr[r], h.corr[r + 1], s + r * Bp, s + (r + 1) * Bp, V, stride,
        visible(r + 1), Dp);
  }
  if (r < rows) pv(h.o + r * Dp, h.corr[r], s + r * Bp, V, stride, visible(r), Dp);
}

// Query rows: n_q tokens x G heads per KV head, for KV heads kv_head_begin .. kv_head_end. Every
// page of the item's key range is read once, all its KV heads together (whole cache lines, in
// order, which the hardware prefetchers follow), and attended by each head's rows in turn.
template <typename T>
void attend_impl(const AttentionParams& p, const WorkItem& it, float* scratch) {
  const int64_t G = p.num_heads / p.num_kv_heads, D = p.head_dim, bs = p.block_size;
  const int64_t Dp = round_up(D, W), Bp = round_up(bs, W);
  const int64_t heads = it.kv_head_end - it.kv_head_begin, rows = it.n_q * G, all = heads * rows;
  float* qf = scratch;       // [all][Dp], head-major: row kh * rows + j * G + g
  float* o = qf + all * Dp;  // [all][Dp]
  float* m = o + all * Dp;   // [all]
  float* l = m + all;        // [all]
  float* cr = l + all;       // [all]
  float* s = cr + all;       // [rows][Bp] one page's scores, then probabilities, of one head
  float* kf = s + rows * Bp; // [bs][Dp] a K page of one head widened to float (when not read directly);
                             // a generation token's lane sums [kDecodeRows][Bp][W] (decode_pass)
  float* vf = kf + bs * Dp;  // [bs][Dp] the V page
  float* kt = vf + bs * Dp;  // [D][Bp] the K page transposed (context tiles)
  // K/V elements are read widened (widen), their scale left out: K's joins the queries, V's the
  // outputs.
  const float kv = p.kv_scale * kWidened<T>;

  for (int64_t kh = 0; kh < heads; ++kh) {
    for (int64_t j = 0; j < it.n_q; ++j) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t head = (it.kv_head_begin + kh) * G + g;
        const int64_t elem = it.tokens[j] * p.q_token_stride + head * p.q_head_stride;
        const void* row = static_cast<const char*>(p.q) + elem * (p.q_dtype == DType::Float ? 4 : 2);
        load_q_row(p, row, p.scale * kv, qf + (kh * rows + j * G + g) * Dp, Dp);
      }
    }
  }
  std::fill(o, o + all * Dp, 0.f);
  std::fill(m, m + all, kNegInf);
  std::fill(l, l + all, 0.f);

  const T* k_base = static_cast<const T*>(p.k);
  const T* v_base = static_cast<const T*>(p.v);
  for (int64_t b = it.key_begin / bs; b * bs < it.key_end; ++b) {
    const int64_t start = b * bs, n = std::min(bs, it.key_end - start);
    const int64_t ahead = start + bs < it.key_end ? (it.block_table[b + 1] - it.block_table[b]) * p.block_stride : 0;
    for (int64_t kh = 0; kh < heads; ++kh) {
      const int64_t offset = it.block_table[b] * p.block_stride + (it.kv_head_begin + kh) * p.head_stride;
      const HeadRows h{qf + kh * rows * Dp, o + kh * rows * Dp, m + kh * rows, l + kh * rows, cr + kh * rows};
      attend_page(p, it, h, rows, k_base + offset, v_base + offset, ahead, start, n, s, kf, vf, kt);
    }
  }

  for (int64_t kh = 0; kh < heads; ++kh) {
    for (int64_t j = 0; j < it.n_q; ++j) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t r = kh * rows + j * G + g, head = (it.kv_head_begin + kh) * G + g;
        if (it.partial != nullptr) {  // one partition of the keys: the combine pass normalizes
          float* dst = it.partial + (j * p.num_heads + head) * (D + 2);
          for (int64_t d = 0; d < D; ++d) dst[d] = o[r * Dp + d] * kv;
          dst[D] = m[r];
          dst[D + 1] = l[r];
        } else {  // every query sees key 0, so l >= 1
          store_out_row(p, o + r * Dp, kv / l[r], (it.tokens[j] * p.num_heads + head) * D);
        }
      }
    }
  }
}

}  // namespace

int64_t scratch_size(const AttentionParams& p, int64_t n_q, int64_t kv_heads) {
  const int64_t rows = n_q * (p.num_heads / p.num_kv_heads), all = rows * kv_heads;
  const int64_t Dp = round_up(p.head_dim, W), Bp = round_up(p.block_size, W);
  // The page buffers kf, vf, kt; a generation token's lane sums (decode_pass) use the same space.
  const int64_t pages = std::max(2 * p.block_size * Dp + p.head_dim * Bp, kDecodeRows * Bp * W);
  return all * (2 * Dp + 3) + rows * Bp + pages;
}

void attend(const AttentionParams& p, const WorkItem& item, float* scratch) {
  switch (p.kv_dtype) {
    case DType::Float: return attend_impl<float>(p, item, scratch);
    case DType::BFloat16: return attend_impl<c10::BFloat16>(p, item, scratch);
    case DType::Half: return attend_impl<c10::Half>(p, item, scratch);
    case DType::Int8: return attend_impl<int8_t>(p, item, scratch);
    case DType::Float8E4M3: return attend_impl<c10::Float8_e4m3fn>(p, item, scratch);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace kiln
