// kiln_cpp::paged_attention: the C++ CPU paged-attention plugin.
//
// Same semantics as kiln/plugins/reference.py's paged_attention (the spec), over one engine step
// (DESIGN.md, "The engine format"): q [T, H, D]; kv_cache [L, 2, blocks, block_size, KH, D];
// context requests ctx_token_index [Sc, Qmax] (-1 padded), ctx_block_tables [Sc, MBc],
// ctx_context_lens [Sc] (cached + new tokens); generation requests gen_token_index [Sg],
// gen_block_tables [Sg, MBg], gen_context_lens [Sg]; kv_scale, an 8-bit (int8, fp8 e4m3) pool's
// static scale for this layer (a K/V value is its stored element times kv_scale). Returns [T, H, D]
// in q's dtype; tokens in neither phase are left zero.
//
// This file validates the step, turns it into work items (context chunks tiled over query tokens
// per KV head; generation tokens over all KV heads, long ones split into partitions of pages when
// threads would idle), schedules them over ATen's intra-op threads (largest first, handed out
// dynamically) and runs the kernel ATen's CPU-capability dispatch would pick
// (paged_attention_kernel.h, built once per capability). Registered as a TORCH_LIBRARY op with a
// Meta kernel, so torch.export traces it and an AOTInductor package calls it through the
// dispatcher, without Python.

#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/enum_tag.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "c_shim.h"
#include "gemm.h"
#include "op_dtype.h"
#include "paged_attention.h"
#include "paged_attention_op.h"
#include "paged_attention_x86.h"
#include "thread_pool.h"

namespace kiln {
namespace {

constexpr const char* kOp = "kiln_cpp::paged_attention: ";

struct Kernel {
  const char* name;
  ScratchSizeFn scratch_size;
  AttendFn attend;
};

Kernel select_kernel() {
  // ATen's choice for this CPU (ATEN_CPU_CAPABILITY overrides it, for ATen's ops and for this one).
  const std::string capability = at::get_cpu_capability();
#if KILN_X86_KERNELS
  if (capability == "AVX512") return {"AVX512", &AVX512::scratch_size, &AVX512::attend};
  if (capability == "AVX2") return {"AVX2", &AVX2::scratch_size, &AVX2::attend};
#endif
  return {"DEFAULT", &DEFAULT::scratch_size, &DEFAULT::attend};
}

const Kernel& kernel() {
  static const Kernel k = select_kernel();
  return k;
}

bool is_8bit(DType t) { return t == DType::Int8 || t == DType::Float8E4M3; }

DType kv_dtype_of(const at::Tensor& kv_cache) {
  switch (kv_cache.scalar_type()) {
    case at::kChar: return DType::Int8;
    case at::kFloat8_e4m3fn: return DType::Float8E4M3;
    case at::kFloat:
    case at::kBFloat16:
    case at::kHalf: return float_dtype_of(kv_cache, kOp, "kv_cache");
    default:
      TORCH_CHECK(false, kOp, "kv_cache must be float32, bfloat16, float16, int8 or float8_e4m3fn, got ",
                  kv_cache.scalar_type());
  }
}

// The K/V scale of this call: kv_scale's value, 1 without one; an 8-bit pool must come with one.
float kv_scale_of(const std::optional<at::Tensor>& kv_scale, DType kv_dtype) {
  if (!kv_scale.has_value()) {
    TORCH_CHECK(!is_8bit(kv_dtype), kOp, "an int8 or float8_e4m3fn kv_cache needs kv_scale, the layer's static "
                "scale (its elements are the K/V values divided by it)");
    return 1.f;
  }
  TORCH_CHECK(kv_scale->numel() == 1 && at::isFloatingType(kv_scale->scalar_type()), kOp,
              "kv_scale must be one floating-point value, got ", kv_scale->scalar_type(), " of shape ",
              kv_scale->sizes());
  const float value = kv_scale->item<float>();
  TORCH_CHECK(std::isfinite(value) && value > 0.f, kOp, "kv_scale must be positive and finite, got ", value);
  return value;
}

void check_dim(const at::Tensor& t, int64_t dim, const char* name, const char* shape) {
  TORCH_CHECK(t.dim() == dim, kOp, name, " must be ", shape, ", got shape ", t.sizes());
}

// t's values as Out (int64_t or int32_t): its data when it already is Out and contiguous, else a
// copy in `copy`.
template <typename Out>
const Out* index_data(const at::Tensor& t, const char* name, std::vector<Out>& copy) {
  const at::ScalarType type = t.scalar_type();
  TORCH_CHECK(type == at::kInt || type == at::kLong, kOp, name, " must be int32 or int64, got ", type);
  if (type == c10::CppTypeToScalarType<Out>::value && t.is_contiguous()) return t.const_data_ptr<Out>();
  const at::Tensor c = t.contiguous();
  copy.resize(c.numel());
  if (type == at::kInt) {
    std::copy(c.const_data_ptr<int32_t>(), c.const_data_ptr<int32_t>() + c.numel(), copy.begin());
  } else {
    std::copy(c.const_data_ptr<int64_t>(), c.const_data_ptr<int64_t>() + c.numel(), copy.begin());
  }
  return copy.data();
}

// Generation sequences shorter than two partitions are never split.
constexpr int64_t kMinPartitionKeys = 512;

// The partitions of one generation token, consecutive in the partial buffer.
struct Combine {
  int64_t token;
  const float* first;
  int64_t parts;
};

template <typename T>
void combine_rows(const AttentionParams& p, const Combine& c, T* out) {
  const int64_t H = p.num_heads, D = p.head_dim, stride = H * (D + 2);
  std::vector<float> acc(D);
  for (int64_t h = 0; h < H; ++h) {
    const float* row = c.first + h * (D + 2);
    float M = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < c.parts; ++k) M = std::max(M, row[k * stride + D]);
    float L = 0.f;
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t k = 0; k < c.parts; ++k) {
      const float* part = row + k * stride;
      const float w = std::exp(part[D] - M);
      L += part[D + 1] * w;
      for (int64_t d = 0; d < D; ++d) acc[d] += part[d] * w;
    }
    T* dst = out + (c.token * H + h) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d] / L);
  }
}

void combine(const AttentionParams& p, const Combine& c) {
  switch (p.q_dtype) {
    case DType::Float: return combine_rows(p, c, static_cast<float*>(p.out));
    case DType::BFloat16: return combine_rows(p, c, static_cast<c10::BFloat16*>(p.out));
    case DType::Half: return combine_rows(p, c, static_cast<c10::Half*>(p.out));
  }
}

}  // namespace

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                               const at::Tensor& ctx_token_index, const at::Tensor& ctx_block_tables,
                               const at::Tensor& ctx_context_lens, const at::Tensor& gen_token_index,
                               const at::Tensor& gen_block_tables, const at::Tensor& gen_context_lens,
                               double scale, const std::optional<at::Tensor>& kv_scale, int64_t window,
                               double softcap) {
  check_dim(q, 3, "q", "[num_tokens, num_heads, head_dim]");
  check_dim(kv_cache, 6, "kv_cache", "[layers, 2, blocks, block_size, kv_heads, head_dim]");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t L = kv_cache.size(0), NB = kv_cache.size(2), bs = kv_cache.size(3), KH = kv_cache.size(4);
  TORCH_CHECK(kv_cache.size(1) == 2 && kv_cache.size(5) == D && bs >= 1, kOp,
              "kv_cache must be [layers, 2, blocks, block_size, kv_heads, head_dim=", D, "], got shape ",
              kv_cache.sizes());
  TORCH_CHECK(KH >= 1 && H % KH == 0, kOp, "num_heads (", H, ") must be a multiple of kv_heads (", KH, ")");
  TORCH_CHECK(layer >= 0 && layer < L, kOp, "layer ", layer, " is outside the cache's ", L, " layers");
  TORCH_CHECK(kv_cache.stride(5) == 1, kOp, "kv_cache's head_dim must be contiguous (it is read in place)");
  const DType q_dtype = float_dtype_of(q, kOp, "q");
  const DType kv_dtype = kv_dtype_of(kv_cache);
  TORCH_CHECK(window >= 0, kOp, "window must be >= 0 (0: no sliding window), got ", window);
  TORCH_CHECK(softcap >= 0, kOp, "softcap must be >= 0 (0: scores not capped), got ", softcap);
  // The first key a query at `pos` sees, rounded down to its page: where the item's pages start.
  const auto first_page_key = [&](int64_t pos) {
    return window == 0 ? int64_t{0} : std::max<int64_t>(0, pos - window + 1) / bs * bs;
  };
  const float kv_mul = kv_scale_of(kv_scale, kv_dtype);
  check_dim(ctx_token_index, 2, "ctx_token_index", "[num_ctx, max_ctx_tokens]");
  check_dim(ctx_block_tables, 2, "ctx_block_tables", "[num_ctx, max_blocks]");
  check_dim(ctx_context_lens, 1, "ctx_context_lens", "[num_ctx]");
  check_dim(gen_token_index, 1, "gen_token_index", "[num_gen]");
  check_dim(gen_block_tables, 2, "gen_block_tables", "[num_gen, max_blocks]");
  check_dim(gen_context_lens, 1, "gen_context_lens", "[num_gen]");
  const int64_t Sc = ctx_token_index.size(0), Qmax = ctx_token_index.size(1), Sg = gen_token_index.size(0);
  TORCH_CHECK(ctx_block_tables.size(0) == Sc && ctx_context_lens.size(0) == Sc, kOp,
              "ctx_token_index, ctx_block_tables and ctx_context_lens disagree on the number of context "
              "requests: ", Sc, ", ", ctx_block_tables.size(0), ", ", ctx_context_lens.size(0));
  TORCH_CHECK(gen_block_tables.size(0) == Sg && gen_context_lens.size(0) == Sg, kOp,
              "gen_token_index, gen_block_tables and gen_context_lens disagree on the number of generation "
              "requests: ", Sg, ", ", gen_block_tables.size(0), ", ", gen_context_lens.size(0));

  // The step's metadata, read in place when it comes as the kernel reads it (int64 indices and
  // lengths, int32 block tables), as the runtime passes it: no ATen op per tensor per layer.
  std::vector<int64_t> ci_copy, cl_copy, gi_copy, gl_copy;
  std::vector<int32_t> ct_copy, gt_copy;
  const int64_t* ci = index_data(ctx_token_index, "ctx_token_index", ci_copy);
  const int64_t* cl = index_data(ctx_context_lens, "ctx_context_lens", cl_copy);
  const int32_t* ct = index_data(ctx_block_tables, "ctx_block_tables", ct_copy);
  const int64_t* gi = index_data(gen_token_index, "gen_token_index", gi_copy);
  const int64_t* gl = index_data(gen_context_lens, "gen_context_lens", gl_copy);
  const int32_t* gt = index_data(gen_block_tables, "gen_block_tables", gt_copy);
  const int64_t ct_width = ctx_block_tables.size(1), gt_width = gen_block_tables.size(1);
  const at::Tensor qc = q.stride(2) == 1 ? q : q.contiguous();
  // Contiguous; the rows of tokens in neither phase are zeroed below.
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (T == 0 || H == 0 || D == 0) return out;
  std::vector<char> covered(T, 0);

  auto check_pages = [&](const int32_t* table, int64_t width, int64_t from, int64_t length, const char* phase,
                         int64_t i) {
    const int64_t pages = (length + bs - 1) / bs;
    TORCH_CHECK(pages <= width, kOp, phase, " request ", i, ": context length ", length, " needs ", pages,
                " blocks of ", bs, " tokens, but its block table has ", width);
    for (int64_t b = from / bs; b < pages; ++b) {
      TORCH_CHECK(table[b] >= 0 && table[b] < NB, kOp, phase, " request ", i, ": block table entry ", b,
                  " is ", table[b], ", outside the pool's ", NB, " blocks");
    }
  };

  const int64_t G = H / KH;
  // Query tokens per context-phase work item: about 64 query rows, enough to amortize widening a
  // bf16 page, small enough that a single long prefill still spreads over the threads.
  const int64_t tile = std::max<int64_t>(1, 64 / G);
  std::vector<int64_t> ctx_tokens;
  ctx_tokens.reserve(Sc * Qmax);  // never reallocated below: items point into it
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < Sc; ++i) {
    const int64_t first = static_cast<int64_t>(ctx_tokens.size());
    for (int64_t j = 0; j < Qmax; ++j) {
      const int64_t token = ci[i * Qmax + j];
      if (token < 0) continue;  // padding
      TORCH_CHECK(token < T, kOp, "ctx_token_index[", i, ", ", j, "] = ", token, " is outside the step's ", T,
                  " tokens");
      ctx_tokens.push_back(token);
      covered[token] = 1;
    }
    const int64_t q_len = static_cast<int64_t>(ctx_tokens.size()) - first, length = cl[i];
    if (q_len == 0) continue;
    TORCH_CHECK(q_len <= length, kOp, "context request ", i, " has ", q_len, " new tokens but context length ",
                length, " (cached + new)");
    const int32_t* table = ct + i * ct_width;
    check_pages(table, ct_width, first_page_key(length - q_len), length, "context", i);
    for (int64_t t0 = 0; t0 < q_len; t0 += tile) {
      const int64_t n = std::min(tile, q_len - t0), first_pos = length - q_len + t0, from = first_page_key(first_pos);
      const int64_t cost = n * G * (first_pos - from + (n + 1) / 2) + first_pos - from + n;
      for (int64_t kh = 0; kh < KH; ++kh) {
        items.push_back({ctx_tokens.data() + first + t0, n, first_pos, table, kh, kh + 1, from, first_pos + n,
                         nullptr, cost});
      }
    }
  }
  int64_t total_cost = 0, gen_parts = 0;
  for (const WorkItem& it : items) total_cost += it.cost;
  for (int64_t i = 0; i < Sg; ++i) {
    TORCH_CHECK(gi[i] >= 0 && gi[i] < T, kOp, "gen_token_index[", i, "] = ", gi[i], " is outside the step's ", T,
                " tokens");
    TORCH_CHECK(gl[i] >= 1, kOp, "generation request ", i, " has context length ", gl[i], "; expected >= 1");
    check_pages(gt + i * gt_width, gt_width, first_page_key(gl[i] - 1), gl[i], "generation", i);
    covered[gi[i]] = 1;
    total_cost += (G + 1) * KH * (gl[i] - first_page_key(gl[i] - 1));
  }
  // A generation token is one work item over all KV heads: its pages are read once, whole. When a
  // few long sequences would leave threads idle (a small decode batch at long context), each is
  // split into partitions of whole pages, attended in parallel and combined after (flash-decoding).
  // Partitions stay long enough that the combine pass costs little.
  const int64_t threads = kiln::pool::num_threads();
  const int64_t target = std::max(total_cost / (4 * threads), (G + 1) * kMinPartitionKeys);
  std::vector<int64_t> part_len(Sg, 0);
  for (int64_t i = 0; i < Sg; ++i) {
    const int64_t length = gl[i] - first_page_key(gl[i] - 1);  // the keys read
    const int64_t parts = threads > 1 ? std::min((G + 1) * KH * length / target, length / kMinPartitionKeys) : 1;
    if (parts > 1) {
      part_len[i] = ((length + parts - 1) / parts + bs - 1) / bs * bs;
      gen_parts += (length + part_len[i] - 1) / part_len[i];
    }
  }
  std::vector<float> partial(gen_parts * H * (D + 2));
  std::vector<Combine> combines;
  float* next_partial = partial.data();
  // Fewer tokens than threads (a batch-1 decode): one item per KV head, so that every thread works.
  const bool split_heads = static_cast<int64_t>(items.size()) + Sg < threads;
  for (int64_t i = 0; i < Sg; ++i) {
    const int64_t length = gl[i], from = first_page_key(length - 1);
    const int32_t* table = gt + i * gt_width;
    if (part_len[i] == 0) {
      for (int64_t kh = 0; kh < KH; kh += split_heads ? 1 : KH) {
        const int64_t end = split_heads ? kh + 1 : KH;
        items.push_back({gi + i, 1, length - 1, table, kh, end, from, length, nullptr,
                         (G + 1) * (end - kh) * (length - from)});
      }
      continue;
    }
    combines.push_back({gi[i], next_partial, 0});
    for (int64_t k0 = from; k0 < length; k0 += part_len[i]) {
      const int64_t k1 = std::min(length, k0 + part_len[i]);
      items.push_back({gi + i, 1, length - 1, table, 0, KH, k0, k1, next_partial, (G + 1) * KH * (k1 - k0)});
      next_partial += H * (D + 2);
      ++combines.back().parts;
    }
  }
  const int64_t row = H * D * static_cast<int64_t>(out.element_size());
  for (int64_t t = 0; t < T; ++t) {
    if (!covered[t]) std::memset(static_cast<char*>(out.mutable_data_ptr()) + t * row, 0, row);
  }
  if (items.empty()) return out;

  // Largest first, handed out dynamically: a long prefill tile and many short decodes balance.
  std::stable_sort(items.begin(), items.end(), [](const WorkItem& a, const WorkItem& b) { return a.cost > b.cost; });

  const auto& k = kernel();  // the attention kernel (kiln::Kernel names a GEMM one)
  AttentionParams p;
  p.q = qc.const_data_ptr();
  p.q_dtype = q_dtype;
  p.q_token_stride = qc.stride(0);
  p.q_head_stride = qc.stride(1);
  p.out = out.mutable_data_ptr();
  const char* pool = static_cast<const char*>(kv_cache.const_data_ptr()) +
                     layer * kv_cache.stride(0) * static_cast<int64_t>(kv_cache.element_size());
  p.k = pool;
  p.v = pool + kv_cache.stride(1) * static_cast<int64_t>(kv_cache.element_size());
  p.kv_dtype = kv_dtype;
  p.kv_scale = kv_mul;
  p.block_stride = kv_cache.stride(2);
  p.token_stride = kv_cache.stride(3);
  p.head_stride = kv_cache.stride(4);
  p.num_heads = H;
  p.num_kv_heads = KH;
  p.head_dim = D;
  p.block_size = bs;
  p.scale = static_cast<float>(scale);
  p.window = window;
  p.softcap = static_cast<float>(softcap);

  // Context tiles over a bf16 pool take the bf16 dot-product kernel where the CPU has one.
  const bool bf16 = (cpu_features() & kAvx512Bf16) != 0, amx = (cpu_features() & kAmxBf16) != 0;
  std::vector<char> on_bf16(items.size());
  int64_t scratch = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const WorkItem& it = items[i];
    on_bf16[i] = bf16 && avx512::context_bf16_fits(p, it);
    scratch = std::max(scratch, on_bf16[i] ? avx512::context_bf16_scratch(p, it.n_q)
                                           : k.scratch_size(p, it.n_q, it.kv_head_end - it.kv_head_begin));
  }
  const int64_t n_items = static_cast<int64_t>(items.size());
  kiln::pool::parallel_chunks(0, n_items, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;  // grows only: no zeroing per call
    if (static_cast<int64_t>(buffer.size()) < scratch) buffer.resize(scratch);
    for (int64_t i = begin; i < end; ++i) {
      if (on_bf16[i]) {
        avx512::attend_context_bf16(p, items[i], buffer.data(), amx);
      } else {
        k.attend(p, items[i], buffer.data());
      }
    }
  });
  if (!combines.empty()) {
    const int64_t n = static_cast<int64_t>(combines.size());
    kiln::pool::parallel_for(0, n, std::max<int64_t>(1, 4096 / (H * D)), [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) combine(p, combines[c]);
    });
  }
  return out;
}

namespace {

at::Tensor paged_attention_meta(const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                                const at::Tensor& ctx_token_index, const at::Tensor& ctx_block_tables,
                                const at::Tensor& ctx_context_lens, const at::Tensor& gen_token_index,
                                const at::Tensor& gen_block_tables, const at::Tensor& gen_context_lens,
                                double scale, const std::optional<at::Tensor>& kv_scale, int64_t window,
                               double softcap) {
  return at::empty_like(q, at::MemoryFormat::Contiguous);
}

std::string kernel_capability() { return kernel().name; }

}  // namespace
}  // namespace kiln

TORCH_LIBRARY(kiln_cpp, m) {
  m.def("paged_attention(Tensor q, Tensor kv_cache, int layer, Tensor ctx_token_index, "
        "Tensor ctx_block_tables, Tensor ctx_context_lens, Tensor gen_token_index, "
        "Tensor gen_block_tables, Tensor gen_context_lens, float scale, Tensor? kv_scale=None, int window=0, float softcap=0.0) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  // Which build of the kernel runs on this CPU: "AVX512", "AVX2" or "DEFAULT".
  m.def("kernel_capability() -> str", &kiln::kernel_capability);
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) { m.impl("paged_attention", &kiln::paged_attention_cpu); }

TORCH_LIBRARY_IMPL(kiln_cpp, Meta, m) { m.impl("paged_attention", &kiln::paged_attention_meta); }

namespace ks = kiln::shim;

KILN_C_SHIM(paged_attention, (AtenTensorHandle q, AtenTensorHandle kv_cache, int64_t layer,
                              AtenTensorHandle ctx_token_index, AtenTensorHandle ctx_block_tables,
                              AtenTensorHandle ctx_context_lens, AtenTensorHandle gen_token_index,
                              AtenTensorHandle gen_block_tables, AtenTensorHandle gen_context_lens, double scale,
                              AtenTensorHandle* kv_scale, int64_t window, double softcap, AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(paged_attention, *out = ks::handle(kiln::paged_attention_cpu(
                                        ks::tensor(q), ks::tensor(kv_cache), layer, ks::tensor(ctx_token_index),
                                        ks::tensor(ctx_block_tables), ks::tensor(ctx_context_lens),
                                        ks::tensor(gen_token_index), ks::tensor(gen_block_tables),
                                        ks::tensor(gen_context_lens), scale, ks::optional(kv_scale), window, softcap)));
}
