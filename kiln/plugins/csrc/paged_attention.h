// Shared by the op's registration (paged_attention.cpp) and the per-CPU-capability kernels
// (kernels_{default,avx2}.cpp, paged_attention_avx512.cpp). Plain data only: no ATen types cross
// this line, so a kernel translation unit compiled for AVX2 / AVX-512 shares as little inline code
// as possible with the code that runs before the CPU's capability is known.
#pragma once

#include <cstdint>

namespace kiln {

// q and out: Float, BFloat16, Half. The KV pool also Int8 and Float8E4M3 (an 8-bit cache: values
// are stored / kv_scale, rounded or cast).
enum class DType : int32_t { Float = 0, BFloat16 = 1, Half = 2, Int8 = 3, Float8E4M3 = 4 };

struct AttentionParams {
  // q [T, H, D]: element (t, h, d) at t * q_token_stride + h * q_head_stride + d.
  const void* q;
  DType q_dtype;
  int64_t q_token_stride, q_head_stride;
  // out [T, H, D], contiguous, q's dtype.
  void* out;
  // kv_cache[layer, 0] (k) and kv_cache[layer, 1] (v): element (block, token, kv_head, d) at
  // block * block_stride + token * token_stride + kv_head * head_stride + d. Read in place.
  const void* k;
  const void* v;
  DType kv_dtype;
  float kv_scale;  // a K/V value is its stored element times kv_scale (1 unless the pool is scaled)
  int64_t block_stride, token_stride, head_stride;
  int64_t num_heads, num_kv_heads, head_dim, block_size;
  float scale;
  // The layer's sliding window: a query at position p sees keys p - window < key <= p (0: all keys
  // up to p). Pages wholly before every query's window are never read.
  int64_t window;
  // Scores pass through tanh(s / softcap) * softcap before the mask and softmax (Gemma 2); 0: not.
  float softcap;
};

// One unit of work: n_q consecutive query tokens of one sequence (a tile of a context-phase chunk,
// or a generation-phase token) against KV heads kv_head_begin .. kv_head_end, i.e. n_q * G query
// rows per KV head (G = num_heads / num_kv_heads: the whole GQA group shares every K/V page it
// reads). Query j sits at position first_pos + j of its sequence and attends keys 0 ..
// first_pos + j (causal; with a window, from first_pos + j - window + 1), of which this item covers
// [key_begin, key_end): all of them, or one partition of a long generation-phase sequence
// (flash-decoding), whose unnormalized result goes to `partial` for a combine pass.
struct WorkItem {
  const int64_t* tokens;  // flat token index of each of the n_q queries
  int64_t n_q;
  int64_t first_pos;
  const int32_t* block_table;  // the sequence's pages, at least ceil(key_end / block_size); those before
                               // key_begin are not read
  int64_t kv_head_begin, kv_head_end;
  int64_t key_begin;  // a multiple of block_size
  int64_t key_end;    // <= first_pos + n_q
  // nullptr: write the output. Otherwise, for query j and head h (of num_heads), D + 2 floats at
  // partial + (j * num_heads + h) * (D + 2): the unnormalized sum of exp(s - m) v, then m and l.
  float* partial;
  int64_t cost;  // estimated work, for scheduling the largest items first
};

// Floats of scratch `attend` needs for an item of n_q queries and kv_heads KV heads (the caller owns
// one buffer per thread).
using ScratchSizeFn = int64_t (*)(const AttentionParams&, int64_t n_q, int64_t kv_heads);
using AttendFn = void (*)(const AttentionParams&, const WorkItem&, float* scratch);

#define KILN_DECLARE_PAGED_ATTENTION_KERNEL(CAP)                              \
  namespace CAP {                                                              \
  int64_t scratch_size(const AttentionParams& p, int64_t n_q, int64_t kv_heads); \
  void attend(const AttentionParams& p, const WorkItem& item, float* scratch); \
  }

KILN_DECLARE_PAGED_ATTENTION_KERNEL(DEFAULT)
KILN_DECLARE_PAGED_ATTENTION_KERNEL(AVX2)
KILN_DECLARE_PAGED_ATTENTION_KERNEL(AVX512)

// Context tiles over a bf16 pool on vdpbf16ps (attention_bf16.cpp): callable where cpu_features()
// reports AVX512_BF16, for the items context_bf16_fits accepts; amx: where it reports AMX-BF16 too,
// the products on AMX tiles.
namespace avx512 {
bool context_bf16_fits(const AttentionParams& p, const WorkItem& item);
int64_t context_bf16_scratch(const AttentionParams& p, int64_t n_q);
void attend_context_bf16(const AttentionParams& p, const WorkItem& item, float* scratch, bool amx);
}  // namespace avx512

}  // namespace kiln
