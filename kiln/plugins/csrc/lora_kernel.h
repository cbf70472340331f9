// kiln_cpp::lora's kernel (lora.h), written once against at::vec::Vectorized<float> and compiled once
// per CPU capability, as elementwise_kernel.h is. Per tile of tokens of one slot: their x and base rows
// widened to float, each module's rank dot products (shrink), its B rows added (expand), one rounding.
//
// No static data in this file (see paged_attention_kernel.h).

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "vec_common.h"

#include "lora.h"

namespace kiln {
namespace CPU_CAPABILITY {
namespace {

// h[u * max_rank + r] = A[r] . x_u for u < NT, r < rank; A's rows `width` apart.
template <typename T, int NT>
void lora_shrink(const float* xf, int64_t in, const T* a, int64_t width, int64_t rank, float* h, int64_t max_rank) {
  for (int64_t r = 0; r < rank; ++r, a += width) {
    Vec sum[NT];
    for (int u = 0; u < NT; ++u) sum[u] = Vec(0.0f);
    int64_t j = 0;
    for (; j + W <= in; j += W) {
      const Vec av = ew_load(a + j);
      for (int u = 0; u < NT; ++u) sum[u] = at::vec::fmadd(Vec::loadu(xf + u * in + j), av, sum[u]);
    }
    for (int u = 0; u < NT; ++u) {
      float v = reduce_add(sum[u]);
      for (int64_t jj = j; jj < in; ++jj) v += xf[u * in + jj] * static_cast<float>(a[jj]);
      h[u * max_rank + r] = v;
    }
  }
}

// y_u[o] += sum_r h_u[r] * B[r][o] for u < NT (y_u `ld` apart), B's rows `width` apart.
template <typename T, int NT>
void lora_expand(const float* h, int64_t max_rank, const T* b, int64_t width, int64_t rank, float* y, int64_t ld,
                 int64_t out) {
  int64_t o = 0;
  for (; o + W <= out; o += W) {
    Vec acc[NT];
    for (int u = 0; u < NT; ++u) acc[u] = Vec::loadu(y + u * ld + o);
    for (int64_t r = 0; r < rank; ++r) {
      const Vec bv = ew_load(b + r * width + o);
      for (int u = 0; u < NT; ++u) acc[u] = at::vec::fmadd(Vec(h[u * max_rank + r]), bv, acc[u]);
    }
    for (int u = 0; u < NT; ++u) acc[u].store(y + u * ld + o);
  }
  for (; o < out; ++o)
    for (int64_t r = 0; r < rank; ++r) {
      const float bv = static_cast<float>(b[r * width + o]);
      for (int u = 0; u < NT; ++u) y[u * ld + o] += h[u * max_rank + r] * bv;
    }
}

// Tokens order[i .. i + NT) share slot s: their rows of out, from x's and base's.
template <typename T, int NT>
void lora_tile(const LoraParams& p, const int64_t* tokens, int64_t s, float* xf, float* acc, float* h) {
  const T* x = static_cast<const T*>(p.x);
  const T* base = static_cast<const T*>(p.base);
  for (int u = 0; u < NT; ++u) {
    ew_widen(x + tokens[u] * p.x_stride, xf + u * p.in, p.in);
    ew_widen(base + tokens[u] * p.N, acc + u * p.N, p.N);
  }
  const int64_t rank = p.rank[s];
  for (int64_t m = 0; m < p.num_pools; ++m) {
    const int64_t width = p.in + p.pool_out[m];
    const T* rows = static_cast<const T*>(p.pools[m]) + s * p.max_rank * width;
    lora_shrink<T, NT>(xf, p.in, rows, width, rank, h, p.max_rank);
    lora_expand<T, NT>(h, p.max_rank, rows + p.in, width, rank, acc + p.offset[m], p.N, p.pool_out[m]);
  }
  T* out = static_cast<T*>(p.out);
  for (int u = 0; u < NT; ++u) {
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(out + tokens[u] * p.N, acc + u * p.N, p.N * sizeof(float));
    } else {
      at::vec::convert(acc + u * p.N, out + tokens[u] * p.N, p.N);
    }
  }
}

template <typename T>
void lora_impl(const LoraParams& p, int64_t begin, int64_t end) {
  std::vector<float> buffer(kLoraTile * (p.in + p.N + p.max_rank));
  float* xf = buffer.data();
  float* acc = xf + kLoraTile * p.in;
  float* h = acc + kLoraTile * p.N;
  const T* base = static_cast<const T*>(p.base);
  T* out = static_cast<T*>(p.out);
  for (int64_t tile = begin; tile < end; ++tile) {
    const int64_t* tokens = p.order + p.tiles[tile];
    const int64_t n = p.tiles[tile + 1] - p.tiles[tile], s = p.slot[tokens[0]];
    if (s < 0 || p.rank[s] == 0) {
      for (int64_t u = 0; u < n; ++u) std::memcpy(out + tokens[u] * p.N, base + tokens[u] * p.N, p.N * sizeof(T));
      continue;
    }
    switch (n) {
      case 1: lora_tile<T, 1>(p, tokens, s, xf, acc, h); break;
      case 2: lora_tile<T, 2>(p, tokens, s, xf, acc, h); break;
      case 3: lora_tile<T, 3>(p, tokens, s, xf, acc, h); break;
      default: lora_tile<T, 4>(p, tokens, s, xf, acc, h); break;
    }
  }
}

}  // namespace

void lora_rows(const LoraParams& p, int64_t begin, int64_t end) {
  switch (p.dtype) {
    case DType::BFloat16: return lora_impl<c10::BFloat16>(p, begin, end);
    case DType::Half: return lora_impl<c10::Half>(p, begin, end);
    default: return lora_impl<float>(p, begin, end);
  }
}

}  // namespace CPU_CAPABILITY
}  // namespace kiln
