// kiln_cpp::sample and kiln_cpp::process_logits: the token sampler of
// kiln/runtime/core/sample/torch_sampler.py (the spec, vLLM's semantics) for a whole batch in one
// call, one pass per row, rows in parallel.
//
//   sample(logits [N, V] float32, fparams [N, 6] float32, iparams [N, 6] int64, history, history_offsets [2N + 1],
//          banned, banned_offsets [N + 1], int max_logprobs)
//     -> (tokens [N] int64, logprobs [N] float32, ranks [N] int64, top_ids [N, max_logprobs] int64,
//         top_logprobs [N, max_logprobs] float32)
//   process_logits(the same but max_logprobs) -> [N, V] float32: min_tokens masking and penalties
//   allowed (both, optional): [N, ceil(V / 32)] int32, guided decoding's bitmask of the allowed
//     tokens, applied before anything else (raw logprobs included)
//
// The columns of fparams / iparams and the history layout are sampler.h's; _pack in
// kiln/runtime/core/sample/sampler.py packs them from SampleRows. logprobs / ranks / top_* rows of
// rows without logprobs are left unset. This file validates the inputs and runs the kernel ATen's CPU-capability dispatch would
// pick (sampler_kernel.h, built once per capability).

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "paged_attention_x86.h"
#include "sampler.h"
#include "thread_pool.h"

namespace kiln {

void penalize_row(const SamplerBatch& b, int64_t r, const float* x, float* dst, const SamplerScratch& s) {
  const float* fp = b.fparams + r * kNumFloat;
  const float rep = fp[kRepetition], freq = fp[kFrequency], pres = fp[kPresence];
  const int64_t* prompt = b.history + b.history_offsets[2 * r];
  const int64_t* output = b.history + b.history_offsets[2 * r + 1];
  const int64_t* end = b.history + b.history_offsets[2 * r + 2];
  for (const int64_t* t = output; t < end; ++t) ++s.counts[*t];
  for (const int64_t* t = prompt; t < output; ++t) s.marks[*t] = 1;  // in the prompt
  for (const int64_t* t = prompt; t < end; ++t) {
    if (s.marks[*t] & 2) continue;  // done
    s.marks[*t] |= 2;
    const int32_t count = s.counts[*t];
    float v = x[*t];
    // The torch sampler's ops, in its order and float32 arithmetic.
    if (rep != 1.f && (count > 0 || (s.marks[*t] & 1))) v = v > 0.f ? v / rep : v * rep;
    if (freq != 0.f) v = v - freq * static_cast<float>(count);
    if (pres != 0.f && count > 0) v = v - pres;
    dst[*t] = v;
  }
  for (const int64_t* t = prompt; t < end; ++t) {
    s.counts[*t] = 0;
    s.marks[*t] = 0;
  }
  for (int64_t j = b.banned_offsets[r]; j < b.banned_offsets[r + 1]; ++j) {
    dst[b.banned[j]] = -std::numeric_limits<float>::infinity();
  }
}

namespace {

constexpr const char* kOp = "kiln_cpp::sample: ";

SampleRowsFn select_kernel() {
  const std::string capability = at::get_cpu_capability();
#if KILN_X86_KERNELS
  if (capability == "AVX512") return &AVX512::sample_rows;
  if (capability == "AVX2") return &AVX2::sample_rows;
#endif
  return &DEFAULT::sample_rows;
}

SampleRowsFn kernel() {
  static const SampleRowsFn k = select_kernel();
  return k;
}

void check_1d_int64(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong && t.is_contiguous() && t.device().is_cpu(), kOp, name,
              " must be a contiguous 1-D int64 CPU tensor, got ", t.scalar_type(), " of shape ", t.sizes());
}

// offsets: n + 1 nondecreasing int64 from 0 to at most tokens.numel(), and every token they cover
// in [0, vocab).
void check_csr(const at::Tensor& tokens, const at::Tensor& offsets, int64_t n, int64_t vocab, const char* name) {
  check_1d_int64(tokens, name);
  check_1d_int64(offsets, "offsets");
  TORCH_CHECK(offsets.numel() == n + 1, kOp, name, " offsets must have ", n + 1, " entries, got ", offsets.numel());
  const int64_t* o = offsets.const_data_ptr<int64_t>();
  TORCH_CHECK(o[0] == 0 && o[n] <= tokens.numel(), kOp, name, " offsets must run from 0 to at most ",
              tokens.numel(), ", got ", o[0], " .. ", o[n]);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(o[i] <= o[i + 1], kOp, name, " offsets must be nondecreasing, got ", o[i], " then ", o[i + 1]);
  }
  const int64_t* t = tokens.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < o[n]; ++i) {
    TORCH_CHECK(t[i] >= 0 && t[i] < vocab, kOp, name, " token ", t[i], " is outside the vocabulary [0, ", vocab, ")");
  }
}

SamplerBatch make_batch(const at::Tensor& logits, const at::Tensor& fparams, const at::Tensor& iparams,
                        const at::Tensor& history, const at::Tensor& history_offsets, const at::Tensor& banned,
                        const at::Tensor& banned_offsets, const std::optional<at::Tensor>& allowed) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.device().is_cpu(), kOp,
              "logits must be a 2-D float32 CPU tensor, got ", logits.scalar_type(), " of shape ", logits.sizes());
  TORCH_CHECK(logits.size(1) == 1 || logits.stride(1) == 1, kOp, "logits rows must be contiguous");
  const int64_t N = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0 && V <= std::numeric_limits<int32_t>::max(), kOp, "vocab size must be in [1, 2^31), got ", V);
  TORCH_CHECK(fparams.scalar_type() == at::kFloat && fparams.is_contiguous() && fparams.dim() == 2 &&
                  fparams.size(0) == N && fparams.size(1) == kNumFloat,
              kOp, "fparams must be a contiguous float32 [", N, ", ", int64_t(kNumFloat), "] tensor, got ",
              fparams.scalar_type(), " of shape ", fparams.sizes());
  TORCH_CHECK(iparams.scalar_type() == at::kLong && iparams.is_contiguous() && iparams.dim() == 2 &&
                  iparams.size(0) == N && iparams.size(1) == kNumInt,
              kOp, "iparams must be a contiguous int64 [", N, ", ", int64_t(kNumInt), "] tensor, got ",
              iparams.scalar_type(), " of shape ", iparams.sizes());
  check_csr(history, history_offsets, 2 * N, V, "history");
  check_csr(banned, banned_offsets, N, V, "banned");
  const float* fp = fparams.const_data_ptr<float>();
  for (int64_t r = 0; r < N; ++r) {
    const float t = fp[r * kNumFloat + kTemperature], p = fp[r * kNumFloat + kTopP], m = fp[r * kNumFloat + kMinP];
    TORCH_CHECK(iparams.const_data_ptr<int64_t>()[r * kNumInt + kGreedy] || t > 0.f, kOp, "row ", r,
                ": a sampled row needs temperature > 0, got ", t);
    TORCH_CHECK(p > 0.f && p <= 1.f && m >= 0.f && m <= 1.f, kOp, "row ", r,
                ": top_p must be in (0, 1] and min_p in [0, 1], got ", p, " and ", m);
  }
  SamplerBatch b{};
  b.logits = logits.const_data_ptr<float>();
  b.num_rows = N;
  b.vocab = V;
  b.row_stride = logits.stride(0);
  b.fparams = fp;
  b.iparams = iparams.const_data_ptr<int64_t>();
  b.history = history.const_data_ptr<int64_t>();
  b.history_offsets = history_offsets.const_data_ptr<int64_t>();
  b.banned = banned.const_data_ptr<int64_t>();
  b.banned_offsets = banned_offsets.const_data_ptr<int64_t>();
  if (allowed.has_value()) {
    const int64_t words = (V + 31) / 32;
    TORCH_CHECK(allowed->scalar_type() == at::kInt && allowed->is_contiguous() && allowed->dim() == 2 &&
                    allowed->size(0) == N && allowed->size(1) == words,
                kOp, "allowed must be a contiguous int32 [", N, ", ", words, "] bitmask, got ", allowed->scalar_type(),
                " of shape ", allowed->sizes());
    b.allowed = allowed->const_data_ptr<int32_t>();
    b.allowed_words = words;
  }
  return b;
}

template <typename T>
void grow(std::vector<T>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);  // new counts / marks are zero
}

void run(const SamplerBatch& b) {
  const SampleRowsFn k = kernel();
  // ATen's grain (32768 elements per task): a few small rows are not worth waking a thread for.
  const int64_t grain = std::max<int64_t>(1, 32768 / b.vocab);
  kiln::pool::parallel_for(0, b.num_rows, grain, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> masked, values, spare;
    thread_local std::vector<int32_t> index, counts;
    thread_local std::vector<SamplerEntry> entries;
    thread_local std::vector<uint8_t> marks;
    if (b.allowed != nullptr) grow(masked, b.vocab);
    grow(values, b.vocab);
    grow(spare, b.vocab);
    grow(index, b.vocab);
    grow(entries, b.vocab);
    grow(counts, b.vocab);
    grow(marks, b.vocab);
    k(b, begin, end, {masked.data(), values.data(), spare.data(), index.data(), entries.data(), counts.data(),
                      marks.data()});
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> sample_cpu(
    const at::Tensor& logits, const at::Tensor& fparams, const at::Tensor& iparams, const at::Tensor& history,
    const at::Tensor& history_offsets, const at::Tensor& banned, const at::Tensor& banned_offsets,
    int64_t max_logprobs, const std::optional<at::Tensor>& allowed) {
  SamplerBatch b = make_batch(logits, fparams, iparams, history, history_offsets, banned, banned_offsets, allowed);
  TORCH_CHECK(max_logprobs >= 0, kOp, "max_logprobs must be >= 0, got ", max_logprobs);
  for (int64_t r = 0; r < b.num_rows; ++r) {
    const int64_t n = b.iparams[r * kNumInt + kNumLogprobs];
    TORCH_CHECK(n <= max_logprobs, kOp, "row ", r, " asks for ", n, " logprobs, more than max_logprobs ", max_logprobs);
  }
  const int64_t N = b.num_rows, top = std::min(max_logprobs, b.vocab);
  const auto f32 = logits.options(), i64 = logits.options().dtype(at::kLong);
  at::Tensor tokens = at::empty({N}, i64), lp = at::empty({N}, f32), ranks = at::empty({N}, i64);
  at::Tensor top_ids = at::empty({N, top}, i64), top_lp = at::empty({N, top}, f32);
  b.tokens = tokens.mutable_data_ptr<int64_t>();
  b.chosen_logprob = lp.mutable_data_ptr<float>();
  b.rank = ranks.mutable_data_ptr<int64_t>();
  b.top_ids = top_ids.mutable_data_ptr<int64_t>();
  b.top_logprobs = top_lp.mutable_data_ptr<float>();
  b.max_logprobs = top;
  run(b);
  return {tokens, lp, ranks, top_ids, top_lp};
}

at::Tensor process_logits_cpu(const at::Tensor& logits, const at::Tensor& fparams, const at::Tensor& iparams,
                              const at::Tensor& history, const at::Tensor& history_offsets, const at::Tensor& banned,
                              const at::Tensor& banned_offsets, const std::optional<at::Tensor>& allowed) {
  SamplerBatch b = make_batch(logits, fparams, iparams, history, history_offsets, banned, banned_offsets, allowed);
  at::Tensor out = at::empty({b.num_rows, b.vocab}, logits.options());
  b.processed = out.mutable_data_ptr<float>();
  run(b);
  return out;
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("sample(Tensor logits, Tensor fparams, Tensor iparams, Tensor history, Tensor history_offsets, "
        "Tensor banned, Tensor banned_offsets, int max_logprobs, Tensor? allowed=None) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("process_logits(Tensor logits, Tensor fparams, Tensor iparams, Tensor history, Tensor history_offsets, "
        "Tensor banned, Tensor banned_offsets, Tensor? allowed=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) {
  m.impl("sample", &kiln::sample_cpu);
  m.impl("process_logits", &kiln::process_logits_cpu);
}
