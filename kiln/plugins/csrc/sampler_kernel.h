// The sampler's per-row kernel, written once against ATen's at::vec::Vectorized<float> and compiled
// once per CPU capability (sampler_<cap>.cpp defines CPU_CAPABILITY and the target options, as
// paged_attention_kernel.h is built). Semantics: kiln/runtime/core/sample/torch_sampler.py (vLLM's), the spec.
//
// Each row is a few passes over its vocab, never a sort of it:
// - greedy: argmax of the (penalized) logits;
// - sampled: the penalized logits / temperature; with top-k the tokens >= the k-th value (ties
//   kept) are the candidates, the k-th value found by nth_element on the few elements above a
//   bound from group maxima (top_k_candidates); otherwise the whole row is. exp(x - max) once;
//   min-p is a threshold on x - max;
// - top-p by rejection sampling (as FlashInfer): draw a token from the candidates in proportion
//   to exp, accept it when the mass of the tokens before it (in the order probability
//   descending, token id ascending) is below top_p of the total, else draw again from the tokens
//   before it only. The nucleus is a prefix of that order with mass >= top_p, so each draw is
//   accepted with probability >= top_p, and an accepted token has exactly the probability it has
//   in the renormalized nucleus. Without top-p the first draw is the sample: the inverse CDF of one
//   uniform over the candidates in token order, as the torch sampler draws;
// - logprobs: log_softmax of the raw row, computed as torch does ((x - max) - log(sum)), the top-n
//   by a heap (vectors below its worst are skipped whole), the rank by counting the tokens with a
//   larger logprob.
// A draw's uniforms are a hash of (seed, stream, position, round) (splitmix64), so they need no
// state and do not depend on the batch; kiln/runtime/core/sample/rows.py's draw_uniform is the same hash.
//
// No static data in this file (see paged_attention_kernel.h).

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "sampler.h"
#include "vec_common.h"

namespace kiln {
namespace CPU_CAPABILITY {
namespace {

constexpr int kAllLanes = static_cast<int>((1ull << W) - 1);
constexpr float kInf = std::numeric_limits<float>::infinity();
// Elements summed in float (vector lanes) before the sum joins a double.
constexpr int64_t kBlock = 8 * W;
constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ull;

// Lanes of a comparison result that hold true, as bits.
inline int true_lanes(const Vec& mask) { return ~mask.zero_mask() & kAllLanes; }

inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint64_t absorb(uint64_t h, uint64_t word) { return mix64((h ^ word) + kGamma); }

// In [0, 1), 53 bits.
inline double uniform(uint64_t key, uint64_t round) {
  return static_cast<double>(absorb(key, round) >> 11) * 0x1p-53;
}

// The max of x[0, n); NaN if any element is NaN (as torch.max). Four accumulators: one would wait
// on the latency of each max.
inline float row_max(const float* x, int64_t n) {
  Vec m0(kNegInf), m1(kNegInf), m2(kNegInf), m3(kNegInf);
  int64_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    m0 = at::vec::maximum(m0, Vec::loadu(x + i));
    m1 = at::vec::maximum(m1, Vec::loadu(x + i + W));
    m2 = at::vec::maximum(m2, Vec::loadu(x + i + 2 * W));
    m3 = at::vec::maximum(m3, Vec::loadu(x + i + 3 * W));
  }
  for (; i < n; i += W) {
    const int64_t len = std::min<int64_t>(W, n - i);
    m0 = at::vec::maximum(m0, Vec::set(Vec(kNegInf), Vec::loadu(x + i, len), len));
  }
  return reduce_max(at::vec::maximum(at::vec::maximum(m0, m1), at::vec::maximum(m2, m3)));
}

// The first index of the max (of the first NaN, if any), as torch.argmax.
inline int64_t argmax(const float* x, int64_t n) {
  const float m = row_max(x, n);
  if (std::isnan(m)) {
    for (int64_t i = 0; i < n; ++i) {
      if (std::isnan(x[i])) return i;
    }
  }
  const Vec vm(m);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const int hit = true_lanes(Vec::loadu(x + i) == vm);
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i) {
    if (x[i] == m) return i;
  }
  return 0;
}

// dst = x with NaN as -inf (garbage in must still give a token of the row); dst may be x.
inline void drop_nan(const float* x, float* dst, int64_t n) {
  const Vec ninf(kNegInf);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const Vec v = Vec::loadu(x + i);
    Vec::blendv(v, ninf, v.isnan()).store(dst + i);
  }
  for (; i < n; ++i) dst[i] = std::isnan(x[i]) ? kNegInf : x[i];
}

struct Larger {  // for nth_element: larger first
  bool operator()(float a, float b) const { return a > b; }
};

struct Better {  // value descending, then token id ascending: a heap's top is the worst kept
  bool operator()(const SamplerEntry& a, const SamplerEntry& b) const {
    return a.value > b.value || (a.value == b.value && a.index < b.index);
  }
};

// The n best of x[0, V) (0 < n <= V) in heap[0, n), best first. A vector whose max is not above
// the heap's worst cannot change it (later elements lose ties by index), so most are only read.
inline void top_n(const float* x, int64_t V, int64_t n, SamplerEntry* heap) {
  for (int64_t i = 0; i < n; ++i) heap[i] = {x[i], static_cast<int32_t>(i)};
  std::make_heap(heap, heap + n, Better{});
  auto offer = [&](int64_t i) {
    if (x[i] > heap[0].value) {
      std::pop_heap(heap, heap + n, Better{});
      heap[n - 1] = {x[i], static_cast<int32_t>(i)};
      std::push_heap(heap, heap + n, Better{});
    }
  };
  int64_t i = n;
  for (; i + W <= V; i += W) {
    if (true_lanes(Vec::loadu(x + i) > Vec(heap[0].value))) {
      for (int64_t j = i; j < i + W; ++j) offer(j);
    }
  }
  for (; i < V; ++i) offer(i);
  std::sort_heap(heap, heap + n, Better{});
}

// Top-k's candidates of the row x[0, n) (0 < k < n): the tokens j, in order, whose x[j] / t is at
// least the k-th largest x / t (ties kept), as s.values[c] = x[j] / t and s.index[c] = j; returns
// how many. *max := the max of x; if it is not finite (NaN included), nothing else is done.
// The k-th value: the elements split into groups of m (one lane of m consecutive vectors), and the
// k-th largest group max is a lower bound of it (k groups have an element >= it); one more pass
// keeps the elements above the bound, few for logits, for nth_element. The bound is lowered by a
// few ulps so that values the division by t rounds onto the k-th value's are kept too, as the
// torch sampler (which divides first) keeps them. x may be s.values.
inline int64_t top_k_candidates(const float* x, int64_t n, int64_t k, float t, const SamplerScratch& s, float* max) {
  int64_t m = 64;
  while (m > 1 && n / m < 2 * k) m /= 2;
  float bound = kNegInf;
  if (m == 1) {
    *max = row_max(x, n);
    if (!std::isfinite(*max)) return 0;
  } else {
    Vec all(kNegInf);
    int64_t g = 0, i = 0;
    for (; i + m * W <= n; i += m * W) {
      Vec m0 = Vec::loadu(x + i), m1 = Vec::loadu(x + i + W);  // two chains of maxima
      for (int64_t j = 2; j < m; j += 2) {
        m0 = at::vec::maximum(m0, Vec::loadu(x + i + j * W));
        m1 = at::vec::maximum(m1, Vec::loadu(x + i + (j + 1) * W));
      }
      const Vec group = at::vec::maximum(m0, m1);
      all = at::vec::maximum(all, group);
      group.store(s.spare + g);
      g += W;
    }
    const int64_t tail = n - i;  // each its own group
    std::copy(x + i, x + n, s.spare + g);
    const float head = reduce_max(all), rest = row_max(x + i, tail);
    *max = std::isnan(rest) ? rest : std::max(head, rest);
    if (!std::isfinite(*max)) return 0;
    g += tail;
    std::nth_element(s.spare, s.spare + k - 1, s.spare + g, Larger{});
    bound = s.spare[k - 1];
    if (std::isnormal(bound)) {
      for (int step = 0; step < 8; ++step) bound = std::nextafter(bound, kNegInf);  // a rounding is < 2 ulps
    } else {
      bound = kNegInf;
    }
  }
  int64_t c = 0;
  const Vec vb(bound);
  for (int64_t i = 0; i < n; i += W) {
    const int64_t len = std::min<int64_t>(W, n - i);
    if (len < W || true_lanes(Vec::loadu(x + i) >= vb)) {
      for (int64_t j = i; j < i + len; ++j) {
        if (x[j] >= bound) {
          s.entries[c] = {x[j], static_cast<int32_t>(j)};
          s.spare[c++] = x[j];
        }
      }
    }
  }
  std::nth_element(s.spare, s.spare + k - 1, s.spare + c, Larger{});
  const float threshold = s.spare[k - 1] / t;
  int64_t kept = 0;
  for (int64_t j = 0; j < c; ++j) {
    const float v = s.entries[j].value / t;
    if (v >= threshold) {
      s.values[kept] = v;
      s.index[kept++] = s.entries[j].index;
    }
  }
  return kept;
}

// dst[0, n) := exp(x / t - max), zeroed where x / t - max < log_min_p (min-p); returns the sums
// before (*total) and after (*kept) min-p. dst may be x.
inline void exp_pass(const float* x, float* dst, int64_t n, float t, float max, float log_min_p, double* total,
                     double* kept) {
  const Vec vt(t), vmax(max), vlog(log_min_p), zero(0.f);
  double sum = 0, sum_kept = 0;
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t end = std::min(n, b + kBlock);
    Vec acc(0.f), acc_kept(0.f);
    for (int64_t i = b; i < end; i += W) {
      const int64_t len = std::min<int64_t>(W, end - i);
      const Vec d = Vec::loadu(x + i, len) / vt - vmax;
      const Vec e = Vec::set(zero, d.exp(), len);
      const Vec ek = Vec::blendv(zero, e, d >= vlog);
      acc = acc + e;
      acc_kept = acc_kept + ek;
      ek.store(dst + i, static_cast<int>(len));
    }
    sum += reduce_add(acc);
    sum_kept += reduce_add(acc_kept);
  }
  *total = sum;
  *kept = sum_kept;
}

// The candidates of a row: e[0, n) (exp, zero where min-p dropped them) of tokens idx[0, n), or of
// tokens 0 .. n - 1 when idx is null (the whole row). `Before` is the order of the nucleus:
// probability descending, token id ascending.
struct Candidates {
  const float* e;
  const int32_t* idx;
  int64_t n;
  int64_t token(int64_t j) const { return idx ? idx[j] : j; }
  // Whether candidate j comes before (pe, pt) in the nucleus order.
  bool before(int64_t j, float pe, int64_t pt) const { return e[j] > pe || (e[j] == pe && token(j) < pt); }
};

// Sum of e[j] over the candidates before (pe, pt), by blocks.
inline double mass_before(const Candidates& c, float pe, int64_t pt) {
  const Vec vp(pe), zero(0.f);
  double m = 0;
  for (int64_t b = 0; b < c.n; b += kBlock) {
    const int64_t end = std::min(c.n, b + kBlock);
    Vec acc(0.f);
    bool ties = false;
    for (int64_t i = b; i < end; i += W) {
      const int64_t len = std::min<int64_t>(W, end - i);
      const Vec e = Vec::set(zero, Vec::loadu(c.e + i, len), len);
      acc = acc + Vec::blendv(zero, e, e > vp);
      ties |= true_lanes(e == vp) != 0;
    }
    m += reduce_add(acc);
    if (ties) {
      for (int64_t j = b; j < end; ++j) {
        if (c.e[j] == pe && c.token(j) < pt) m += c.e[j];
      }
    }
  }
  return m;
}

// The first candidate before (pe, pt) at which the running sum of e (in candidate order) exceeds
// target: the inverse CDF. Rounding can leave the sum just short of a target near the total;
// then the last candidate with mass.
inline int64_t walk(const Candidates& c, float pe, int64_t pt, double target) {
  const Vec vp(pe), zero(0.f);
  double cum = 0;
  for (int64_t b = 0; b < c.n; b += kBlock) {
    const int64_t end = std::min(c.n, b + kBlock);
    Vec acc(0.f);
    bool ties = false;
    for (int64_t i = b; i < end; i += W) {
      const int64_t len = std::min<int64_t>(W, end - i);
      const Vec e = Vec::set(zero, Vec::loadu(c.e + i, len), len);
      acc = acc + Vec::blendv(zero, e, e > vp);
      ties |= true_lanes(e == vp) != 0;
    }
    const double block = reduce_add(acc);
    if (!ties && cum + block <= target) {
      cum += block;
      continue;
    }
    for (int64_t j = b; j < end; ++j) {
      if (c.e[j] > 0.f && c.before(j, pe, pt)) {
        cum += c.e[j];
        if (cum > target) return j;
      }
    }
  }
  for (int64_t j = c.n - 1; j >= 0; --j) {
    if (c.e[j] > 0.f && c.before(j, pe, pt)) return j;
  }
  return -1;
}

// Draws a candidate: by the inverse CDF of uniform(key, 0) without top-p, else by rejection
// against the nucleus (see the top of this file). total: the mass top-p is a share of.
inline int64_t draw(const Candidates& c, double total, double kept, float top_p, uint64_t key) {
  float pe = -1.f;  // the pivot: only candidates before it may still be drawn; at first, all
  int64_t pt = 0;
  const double target = static_cast<double>(top_p) * total;
  double mass = kept;  // of the candidates before the pivot
  for (int64_t round = 0; round <= c.n; ++round) {
    const int64_t j = walk(c, pe, pt, uniform(key, round) * mass);
    if (j < 0) break;
    if (top_p >= 1.f) return c.token(j);
    const double m = mass_before(c, c.e[j], c.token(j));
    if (m < target) return c.token(j);
    pe = c.e[j];
    pt = c.token(j);
    mass = m;
  }
  // Unreachable but for rounding (every round removes a token): the most likely candidate.
  int64_t best = 0;
  for (int64_t j = 1; j < c.n; ++j) {
    if (c.e[j] > c.e[best]) best = j;
  }
  return c.token(best);
}

// A sampled row from x, its penalized logits, using scratch.values (x may be it).
inline int64_t sample_row(const float* x, int64_t V, const float* fp, const int64_t* ip, uint64_t key,
                          const SamplerScratch& s) {
  const float t = fp[kTemperature];
  const int64_t k = ip[kTopK];
  const bool top_k = k > 0 && k < V;
  float raw_max;
  const int64_t n = top_k ? top_k_candidates(x, V, k, t, s, &raw_max) : V;
  if (!top_k) raw_max = row_max(x, V);
  if (std::isnan(raw_max)) {  // garbage in must still give a token of the row
    drop_nan(x, s.values, V);
    return sample_row(s.values, V, fp, ip, key, s);
  }
  if (!std::isfinite(raw_max)) return argmax(x, V);  // nothing to sample from, or an overflow
  // Division by t > 0 is monotone: the max of x / t is that of x, divided.
  const float max = raw_max / t;
  const float min_p = fp[kMinP];
  const float log_min_p = min_p > 0.f ? std::log(min_p) : kNegInf;
  double total, kept;
  exp_pass(top_k ? s.values : x, s.values, n, top_k ? 1.f : t, max, log_min_p, &total, &kept);
  return draw(Candidates{s.values, top_k ? s.index : nullptr, n}, total, kept, fp[kTopP], key);
}

// Row r's logprob outputs from its raw logits x (see SamplerBatch).
inline void logprobs(const SamplerBatch& b, int64_t r, const float* x, int64_t token, const SamplerScratch& s) {
  const int64_t V = b.vocab;
  const float max = row_max(x, V);
  const Vec vmax(max), zero(0.f);
  Vec acc(0.f);
  for (int64_t i = 0; i < V; i += W) {
    const int64_t len = std::min<int64_t>(W, V - i);
    acc = acc + Vec::set(zero, (Vec::loadu(x + i, len) - vmax).exp(), len);
  }
  const float log_sum = std::log(reduce_add(acc));
  const float chosen = (x[token] - max) - log_sum;
  const Vec vlog(log_sum), vchosen(chosen), one(1.f);
  Vec larger(0.f);
  for (int64_t i = 0; i < V; i += W) {
    const int64_t len = std::min<int64_t>(W, V - i);
    const Vec lp = (Vec::loadu(x + i, len) - vmax) - vlog;
    larger = larger + Vec::set(zero, Vec::blendv(zero, one, lp > vchosen), len);
  }
  b.chosen_logprob[r] = chosen;
  b.rank[r] = 1 + static_cast<int64_t>(reduce_add(larger));
  const int64_t n = std::min(b.iparams[r * kNumInt + kNumLogprobs], V);
  if (n <= 0) return;
  top_n(x, V, n, s.entries);
  for (int64_t j = 0; j < n; ++j) {
    b.top_ids[r * b.max_logprobs + j] = s.entries[j].index;
    b.top_logprobs[r * b.max_logprobs + j] = (s.entries[j].value - max) - log_sum;
  }
}

}  // namespace

// x with -inf where row r's bitmask refuses the token, into s.masked; x itself when it refuses none.
const float* apply_allowed(const SamplerBatch& b, int64_t r, const float* x, const SamplerScratch& s) {
  if (b.allowed == nullptr) return x;
  const int32_t* words = b.allowed + r * b.allowed_words;
  const int64_t V = b.vocab, full = V / 32;
  bool all = true;
  for (int64_t w = 0; w < full && all; ++w) all = words[w] == -1;
  if (all && V % 32) all = (~static_cast<uint32_t>(words[full]) & ((1u << (V % 32)) - 1)) == 0;
  if (all) return x;
  for (int64_t w = 0; w * 32 < V; ++w) {
    const uint32_t bits = static_cast<uint32_t>(words[w]);
    const int64_t t0 = w * 32, n = std::min<int64_t>(32, V - t0);
    for (int64_t i = 0; i < n; ++i) {
      s.masked[t0 + i] = (bits >> i) & 1u ? x[t0 + i] : -std::numeric_limits<float>::infinity();
    }
  }
  return s.masked;
}

void sample_rows(const SamplerBatch& b, int64_t row_begin, int64_t row_end, const SamplerScratch& s) {
  const int64_t V = b.vocab;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const float* x = apply_allowed(b, r, b.logits + r * b.row_stride, s);
    const float* fp = b.fparams + r * kNumFloat;
    const int64_t* ip = b.iparams + r * kNumInt;
    if (b.processed) {
      float* out = b.processed + r * V;
      std::memcpy(out, x, V * sizeof(float));
      penalize_row(b, r, x, out, s);
      continue;
    }
    const bool modified = b.history_offsets[2 * r] != b.history_offsets[2 * r + 2] ||
                          b.banned_offsets[r] != b.banned_offsets[r + 1];
    const float* src = x;
    if (modified) {
      std::memcpy(s.values, x, V * sizeof(float));
      penalize_row(b, r, x, s.values, s);
      src = s.values;
    }
    int64_t token;
    if (ip[kGreedy]) {
      token = argmax(src, V);
    } else {
      uint64_t key = kGamma;
      for (int64_t w : {ip[kSeed], ip[kStream], ip[kPosition]}) key = absorb(key, static_cast<uint64_t>(w));
      token = sample_row(src, V, fp, ip, key, s);
    }
    b.tokens[r] = token;
    if (ip[kNumLogprobs] >= 0) logprobs(b, r, x, token, s);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace kiln
