// Shared by kiln_cpp::lora's registration (lora.cpp) and its per-CPU-capability kernels
// (lora_kernel.h). Plain data only, as in paged_attention.h.
#pragma once

#include <cstdint>

#include "paged_attention.h"

namespace kiln {

// One linear's output plus the LoRA updates of the modules it holds (kiln/models/lora.py): for each
// token t with an adapter slot s = slot[t] >= 0 and each pool p,
//   out[t, offset[p] + o] = base[t, offset[p] + o] + sum_{r < rank[s]} B_p[s][r][o] * (A_p[s][r] . x[t])
// where pool p is [slots, max_rank, in + out_p], row r of slot s holding A's row r (in values) then
// B's column r (out_p values). Rows of tokens without a slot are base's. Float accumulation, one
// rounding into dtype.
struct LoraParams {
  DType dtype;
  const void* x;  // [T, in], rows x_stride apart
  const void* base;  // [T, N], contiguous
  void* out;  // [T, N], contiguous
  const int64_t* order;  // the T tokens sorted by slot: a slot's A and B stay in cache across its rows
  const int64_t* tiles;  // tile t: order[tiles[t] .. tiles[t + 1]), at most kLoraTile tokens of one slot
  const int64_t* slot;  // [T]
  const int64_t* rank;  // [slots]
  int64_t in, x_stride, N, max_rank, num_pools;
  const void* const* pools;  // [num_pools], each contiguous
  const int64_t* pool_out;  // out_p
  const int64_t* offset;  // column of out where pool p's outputs start
};

// Tokens of one slot computed together: each of the adapter's A and B values is widened once for all.
constexpr int64_t kLoraTile = 4;

#define KILN_DECLARE_LORA_KERNELS(CAP) \
  namespace CAP {                      \
  void lora_rows(const LoraParams& p, int64_t begin, int64_t end);  /* tiles [begin, end) */ \
  }

KILN_DECLARE_LORA_KERNELS(DEFAULT)
KILN_DECLARE_LORA_KERNELS(AVX2)
KILN_DECLARE_LORA_KERNELS(AVX512)

namespace avx512 {  // lora_bf16.cpp: bf16 pools on vdpbf16ps, where cpu_features() reports AVX512_BF16
bool lora_bf16_fits(const LoraParams& p);
void lora_rows_bf16(const LoraParams& p, int64_t begin, int64_t end);
}  // namespace avx512

}  // namespace kiln
