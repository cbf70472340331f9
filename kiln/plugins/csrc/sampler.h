// Shared by the sampler's registration (sampler.cpp) and its per-CPU-capability kernels
// (sampler_{default,avx2,avx512}.cpp). Plain data only, as in paged_attention.h.
#pragma once

#include <cstdint>

namespace kiln {

// Columns of SamplerBatch::fparams and ::iparams (kiln/runtime/core/sample/sampler.py packs them).
enum SamplerFloat : int64_t { kTemperature, kTopP, kMinP, kRepetition, kFrequency, kPresence, kNumFloat };
enum SamplerInt : int64_t { kGreedy, kTopK, kNumLogprobs, kSeed, kStream, kPosition, kNumInt };

struct SamplerBatch {
  const float* logits;  // [N, V], row r at logits + r * row_stride; never written
  int64_t num_rows, vocab, row_stride;
  const float* fparams;    // [N, kNumFloat]
  const int64_t* iparams;  // [N, kNumInt]; kNumLogprobs -1: none; kTopK outside (0, V): off
  // Row r's prompt tokens for the repetition penalty are history[offsets[2r] .. offsets[2r+1]),
  // its output tokens history[offsets[2r+1] .. offsets[2r+2]) (both empty without penalties).
  const int64_t* history;
  const int64_t* history_offsets;  // [2N + 1]
  // Row r's tokens to mask to -inf (min_tokens): banned[banned_offsets[r] .. banned_offsets[r+1]).
  const int64_t* banned;
  const int64_t* banned_offsets;  // [N + 1]
  // Guided decoding: row r's allowed tokens, words allowed[r * allowed_words ..] with bit t % 32 of
  // word t / 32 set where token t is allowed; the others are -inf before anything else, raw
  // logprobs included. nullptr: every token of every row.
  const int32_t* allowed;
  int64_t allowed_words;
  // Outputs. processed: if set, the penalized logits [N, V] are written there and nothing is
  // sampled. Otherwise tokens [N], and for rows with logprobs chosen_logprob [N], rank [N],
  // top_ids / top_logprobs [N, max_logprobs] (the first num_logprobs of row r, best first).
  float* processed;
  int64_t* tokens;
  float* chosen_logprob;
  int64_t* rank;
  int64_t* top_ids;
  float* top_logprobs;
  int64_t max_logprobs;
};

struct SamplerEntry {
  float value;
  int32_t index;
};

// Per-thread scratch, owned by the caller, vocab elements each; counts and marks must be all zero
// on entry (a row leaves them zero again).
struct SamplerScratch {
  float* masked;  // a guided row's logits with its grammar's bitmask applied
  float* values;
  float* spare;
  int32_t* index;
  SamplerEntry* entries;
  int32_t* counts;
  uint8_t* marks;
};

// dst[t] = the penalized x[t] for each token t row r has seen, then dst[t] = -inf for its banned
// tokens; x[t] elsewhere is not read. Defined in sampler.cpp, built without target options: the
// frequency penalty's multiply and subtract must round apart, as torch's two ops do, never fused
// into an FMA.
void penalize_row(const SamplerBatch& b, int64_t r, const float* x, float* dst, const SamplerScratch& s);

using SampleRowsFn = void (*)(const SamplerBatch&, int64_t row_begin, int64_t row_end, const SamplerScratch&);

#define KILN_DECLARE_SAMPLER_KERNEL(CAP) \
  namespace CAP {                        \
  void sample_rows(const SamplerBatch& b, int64_t row_begin, int64_t row_end, const SamplerScratch& s); \
  }

KILN_DECLARE_SAMPLER_KERNEL(DEFAULT)
KILN_DECLARE_SAMPLER_KERNEL(AVX2)
KILN_DECLARE_SAMPLER_KERNEL(AVX512)

}  // namespace kiln
