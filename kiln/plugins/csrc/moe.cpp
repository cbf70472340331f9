// kiln_cpp::moe: a mixture-of-experts MLP over a step's tokens, on kiln_cpp::gemm's kernels.
//
//   moe(x [T, H], topk_ids [T, k], topk_weights [T, k], fc, fc_scale?, proj, proj_scale?, expert_start,
//       inter, group_size, fc_tactics, proj_tactics, proj_act_scale?) -> [T, H] in x's dtype
//
// FP8 experts (fp8 weights, per-tensor activation scales) take x already on the fp8 grid (x / scale
// rounded to fp8, in x's dtype, as PackedLinear rounds it) and proj_act_scale, by which the SiLU-and-
// multiply output is rounded onto its grid likewise; their scales fold the activation scales in.
//
// fc and proj stack one packed weight per expert this rank holds (experts expert_start ..
// expert_start + E - 1; kiln/models/moe.py packs each): fc [E, <panels of [2 * inter, H]>] with an
// expert's gate rows before its up rows, proj [E, <panels of [H, inter]>]; the scales stack the same
// way. The step's (token, expert) pairs are sorted by expert and each chosen expert runs once over
// its rows: silu(x W_gate) * (x W_up), then W_down, each one GEMM with the kernel its tactics pick
// for that row count. So each expert's weights are read once per step, and only the experts some
// token chose are read at all: a batch-1 decode reads k of them. A token's output is the sum of its
// experts' rows times its routing weights, in float32. Ids of experts another rank holds (expert
// parallelism) are skipped: the caller's all-reduce adds those ranks' parts.
//
// moe_routed takes the router's logits [T, num_experts] in x's dtype instead of topk_ids and
// topk_weights and routes as HF's MoE blocks do: a float32 softmax over all experts, the top_k
// largest (ties, which torch.topk orders as it happens to, to the lower id), renormalized to sum
// to one if asked, rounded to x's dtype. The graph's own softmax, top-k and cast were five ops and
// their buffers per layer, on the serial path between a decode step's GEMVs.
//
// moe_gated takes the router's packed weight (unquantized, [num_experts, H]) and its tactics instead
// of the logits and runs the router GEMM itself, as kiln_cpp::gemm would: one call less per layer
// on a decode step's serial path.
//
// Few experts (a decode step of few tokens) run their up projections (gate and up, with the
// activation) in one loop over the thread pool, then their down projections in another; many (a
// batch, a prefill, 128-expert models) run side by side, one expert per thread at a time, claimed
// largest first, their GEMMs single-threaded: a loop per expert and GEMM would cost a pool wake-up
// each. The bf16 kernels apply the activation in their epilogue, as kiln_cpp::gemm_swiglu does.

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "c_shim.h"
#include "elementwise.h"
#include "gemm_op.h"
#include "op_dtype.h"
#include "thread_pool.h"

namespace kiln {
namespace {

constexpr const char* kOp = "kiln_cpp::moe: ";

// Row `row` of a contiguous 2-d t, and expert e's part of a stack, as raw memory.
void* at_row(const at::Tensor& t, int64_t row) {
  return static_cast<char*>(const_cast<void*>(t.const_data_ptr())) + row * t.size(1) * t.element_size();
}

const void* at_expert(const at::Tensor& t, int64_t e) {
  return static_cast<const char*>(t.const_data_ptr()) + e * (t.numel() / t.size(0)) * t.element_size();
}

const void* at_expert(const std::optional<at::Tensor>& t, int64_t e) {
  return t.has_value() ? at_expert(*t, e) : nullptr;
}

// t[e] over the same memory: from_blob skips the dispatcher and the view bookkeeping select pays.
std::optional<at::Tensor> expert_of(const std::optional<at::Tensor>& t, int64_t e) {
  if (!t.has_value()) return std::nullopt;
  return at::from_blob(const_cast<void*>(at_expert(*t, e)), t->sizes().slice(1), t->options());
}

// A stack's scales in the dtype its format's kernels read (engines from before int4's float16 scales
// hold float32 ones): converted once per call, not once per expert.
std::optional<at::Tensor> in_scale_type(const at::Tensor& w, const std::optional<at::Tensor>& scale) {
  if (!scale.has_value()) return scale;
  const at::ScalarType type = scale_type(format_of(w));
  return scale->scalar_type() == type ? scale : std::optional<at::Tensor>(scale->to(type).contiguous());
}

// FP8 experts' activation onto its fp8 grid, in place: x / scale, clamped, rounded to e4m3, in x's
// dtype (as kiln/plugins/quant.py rounds it).
template <typename T>
void to_fp8_grid(T* a, int64_t count, float scale) {
  for (int64_t i = 0; i < count; ++i) {
    const float v = std::min(448.0f, std::max(-448.0f, static_cast<float>(a[i]) / scale));
    a[i] = static_cast<T>(static_cast<float>(c10::Float8_e4m3fn(v)));
  }
}

void to_fp8_grid(DType dtype, void* a, int64_t count, float scale) {
  switch (dtype) {
    case DType::Float: return to_fp8_grid(static_cast<float*>(a), count, scale);
    case DType::BFloat16: return to_fp8_grid(static_cast<c10::BFloat16*>(a), count, scale);
    default: return to_fp8_grid(static_cast<c10::Half*>(a), count, scale);
  }
}

template <typename T>
void combine_rows(const float* ys, const int64_t* slot, const float* w, int64_t k, int64_t H, int64_t begin,
                  int64_t end, T* out) {
  std::vector<float> acc(H);
  for (int64_t t = begin; t < end; ++t) {
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t j = 0; j < k; ++j) {
      const int64_t s = slot[t * k + j];
      if (s < 0) continue;
      const float* y = ys + s * H;
      const float wt = w[t * k + j];
      for (int64_t h = 0; h < H; ++h) acc[h] += wt * y[h];
    }
    for (int64_t h = 0; h < H; ++h) out[t * H + h] = static_cast<T>(acc[h]);
  }
}

// Plans' items as one parallel loop: one pool wake-up for all of them, and no thread waits at the end
// of one expert's GEMM while another has work left.
void run_together(const std::vector<GemmPlan>& plans) {
  std::vector<int64_t> start(plans.size() + 1, 0);
  for (size_t i = 0; i < plans.size(); ++i) start[i + 1] = start[i] + plans[i].items();
  kiln::pool::parallel_for(0, start.back(), 1, [&](int64_t begin, int64_t end) {
    for (size_t i = 0; i < plans.size(); ++i) {
      const int64_t lo = std::max(begin, start[i]), hi = std::min(end, start[i + 1]);
      if (lo < hi) plans[i].run(lo - start[i], hi - start[i]);
    }
  });
}

void check_experts(const at::Tensor& x, const at::Tensor& fc, const std::optional<at::Tensor>& fc_scale,
                   const at::Tensor& proj, const std::optional<at::Tensor>& proj_scale) {
  TORCH_CHECK(x.dim() == 2, kOp, "x must be [tokens, hidden], got ", x.sizes());
  const int64_t E = fc.size(0);
  TORCH_CHECK(proj.size(0) == E && fc.dim() == 4 && proj.dim() == 4, kOp,
              "fc and proj must stack the same experts' packed weights, got ", fc.sizes(), " and ", proj.sizes());
  for (const auto* t : {&fc, &proj, fc_scale ? &*fc_scale : nullptr, proj_scale ? &*proj_scale : nullptr})
    TORCH_CHECK(t == nullptr || (t->is_contiguous() && t->size(0) == E), kOp,
                "the stacked experts' weights and scales must be contiguous, one per expert");
}

// The experts over the step's (token, expert) pairs: id[t * k + j] and w[t * k + j] (float32) are
// token t's j-th expert and its routing weight.
at::Tensor run_experts(const at::Tensor& x, const int64_t* id, const float* w, int64_t k, const at::Tensor& fc,
                       const std::optional<at::Tensor>& fc_scale, const at::Tensor& proj,
                       const std::optional<at::Tensor>& proj_scale, int64_t expert_start, int64_t inter,
                       int64_t group_size, c10::IntArrayRef fc_tactics, c10::IntArrayRef proj_tactics,
                       const std::optional<at::Tensor>& proj_act_scale) {
  const int64_t T = x.size(0), H = x.size(1), E = fc.size(0);
  const DType dtype = float_dtype_of(x, kOp, "x");
  // Which experts come is known only here: a decode step's experts take their place in the weights'
  // order (they end a serial stretch, and the next layer's weights follow them) with nothing to
  // fetch ahead themselves (kiln::pool::weight_begins).
  const bool streams = T <= kPrefetchRows;
  if (streams) kiln::pool::weight_begins(fc.const_data_ptr(), 0, 1);
  const int64_t elem = x.element_size();
  const at::Tensor xc = x.contiguous();

  // The (token, slot) pairs of this rank's experts, sorted by expert: slot[t * k + j] is the row of
  // pair (t, j) in the sorted order, -1 for another rank's expert.
  std::vector<int64_t> count(E + 1, 0), slot(T * k, -1);
  for (int64_t a = 0; a < T * k; ++a) {
    const int64_t e = id[a] - expert_start;
    TORCH_CHECK(id[a] >= 0, kOp, "negative expert id ", id[a]);
    if (e >= 0 && e < E) ++count[e + 1];
  }
  std::partial_sum(count.begin(), count.end(), count.begin());  // count[e]: expert e's first row
  const int64_t rows = count[E];
  at::Tensor xs = at::empty({rows, H}, x.options());
  {
    std::vector<int64_t> next(count.begin(), count.end() - 1);
    auto* dst = static_cast<char*>(xs.mutable_data_ptr());
    const auto* src = static_cast<const char*>(xc.const_data_ptr());
    for (int64_t a = 0; a < T * k; ++a) {
      const int64_t e = id[a] - expert_start;
      if (e < 0 || e >= E) continue;
      slot[a] = next[e]++;
      std::memcpy(dst + slot[a] * H * elem, src + (a / k) * H * elem, H * elem);
    }
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (count[e + 1] > count[e]) active.push_back(e);
  std::stable_sort(active.begin(), active.end(),
                   [&](int64_t a, int64_t b) { return count[a + 1] - count[a] > count[b + 1] - count[b]; });

  // Plans on the first expert check the stacks once; each expert's GEMMs copy them onto its own
  // weights and rows, with no tensor made (a decode step's experts take 10-15 us each, and planning
  // them as kiln_cpp::gemm does took a third of that).
  const std::optional<at::Tensor> fcs = in_scale_type(fc, fc_scale), ps = in_scale_type(proj, proj_scale);
  GemmBuffers checked;
  const GemmPlan up_like(at::empty({0, H}, x.options()), *expert_of(fc, 0), expert_of(fcs, 0), std::nullopt, 2 * inter,
                         group_size, false, fc_tactics, true, checked);
  const GemmPlan down_like(at::empty({0, inter}, x.options()), *expert_of(proj, 0), expert_of(ps, 0), std::nullopt, H,
                           group_size, true, proj_tactics, false, checked);
  // h: the up projections' rows (gate and up, or the activation where the kernel applied it); act:
  // the activation otherwise; ys: the down projections' rows, float32.
  at::Tensor h = at::empty({rows, 2 * inter}, x.options()), act = at::empty({rows, inter}, x.options());
  at::Tensor ys = at::empty({rows, H}, x.options().dtype(at::kFloat));
  const float act_scale = proj_act_scale.has_value() ? proj_act_scale->item<float>() : 0.0f;
  auto up = [&](int64_t e, GemmBuffers& buffers) {
    return GemmPlan(up_like, at_row(xs, count[e]), count[e + 1] - count[e], at_expert(fc, e), at_expert(fcs, e),
                    at_row(h, count[e]), fc_tactics, buffers);
  };
  auto down = [&](int64_t e, const GemmPlan& up_done, GemmBuffers& buffers) {
    const int64_t first = count[e], m = count[e + 1] - count[e];
    void* a = up_done.fused() ? at_row(h, first) : at_row(act, first);
    if (!up_done.fused()) silu_and_mul({dtype, at_row(h, first), a, inter, 2 * inter}, 0, m);
    if (proj_act_scale.has_value()) to_fp8_grid(dtype, a, m * inter, act_scale);
    return GemmPlan(down_like, a, m, at_expert(proj, e), at_expert(ps, e), ys.mutable_data_ptr<float>() + first * H,
                    proj_tactics, buffers);
  };
  const int64_t n = static_cast<int64_t>(active.size());
  if (n >= 2 * kiln::pool::num_threads()) {
    kiln::pool::parallel_chunks(0, n, 1, [&](int64_t begin, int64_t end) {
      at::AutoDispatchBelowADInplaceOrView below_autograd_here;
      thread_local GemmBuffers buffers;
      for (int64_t i = begin; i < end; ++i) {
        const GemmPlan u = up(active[i], buffers);
        u.run(0, u.items());
        const GemmPlan d = down(active[i], u, buffers);
        d.run(0, d.items());
      }
    });
  } else if (n > 0) {
    thread_local std::vector<GemmBuffers> buffers;
    if (static_cast<int64_t>(buffers.size()) < n) buffers.resize(n);
    std::vector<GemmPlan> ups, downs;
    ups.reserve(n);
    downs.reserve(n);
    for (int64_t i = 0; i < n; ++i) ups.push_back(up(active[i], buffers[i]));
    run_together(ups);
    for (int64_t i = 0; i < n; ++i) downs.push_back(down(active[i], ups[i], buffers[i]));
    run_together(downs);
  }

  at::Tensor out = at::empty({T, H}, x.options());
  kiln::pool::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(1, H * k)), [&](int64_t b, int64_t e) {
    const float* y = ys.const_data_ptr<float>();
    switch (dtype) {
      case DType::Float: return combine_rows(y, slot.data(), w, k, H, b, e, out.mutable_data_ptr<float>());
      case DType::BFloat16: return combine_rows(y, slot.data(), w, k, H, b, e, out.mutable_data_ptr<c10::BFloat16>());
      default: return combine_rows(y, slot.data(), w, k, H, b, e, out.mutable_data_ptr<c10::Half>());
    }
  });
  if (streams) kiln::pool::weight_ends(fc.const_data_ptr());
  return out;
}

at::Tensor moe_cpu(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& fc, const std::optional<at::Tensor>& fc_scale, const at::Tensor& proj,
                   const std::optional<at::Tensor>& proj_scale, int64_t expert_start, int64_t inter,
                   int64_t group_size, c10::IntArrayRef fc_tactics, c10::IntArrayRef proj_tactics,
                   const std::optional<at::Tensor>& proj_act_scale) {
  // The views and buffers below never reach autograd: its dispatch keys skipped (here and in each
  // thread that plans experts) save a microsecond or more per expert and step.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_experts(x, fc, fc_scale, proj, proj_scale);
  const int64_t T = x.size(0);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_weights.sizes() == topk_ids.sizes(), kOp,
              "topk_ids and topk_weights must both be [tokens, k] = [", T, ", k], got ", topk_ids.sizes(), " and ",
              topk_weights.sizes());
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous(), weights = topk_weights.to(at::kFloat).contiguous();
  return run_experts(x, ids.const_data_ptr<int64_t>(), weights.const_data_ptr<float>(), topk_ids.size(1), fc,
                     fc_scale, proj, proj_scale, expert_start, inter, group_size, fc_tactics, proj_tactics,
                     proj_act_scale);
}

// A token's experts from its router logits, as HF's MoE blocks pick them: softmax in float32 over
// all experts, the top k (sorted, ties to the lower id), optionally renormalized, rounded to T.
template <typename T>
void route_rows(const T* logits, int64_t rows, int64_t experts, int64_t k, bool renormalize, int64_t* id,
                float* w) {
  std::vector<float> p(experts);
  std::vector<int64_t> order(experts);
  for (int64_t t = 0; t < rows; ++t) {
    const T* l = logits + t * experts;
    float top = -std::numeric_limits<float>::infinity(), sum = 0.0f;
    for (int64_t e = 0; e < experts; ++e) top = std::max(top, static_cast<float>(l[e]));
    for (int64_t e = 0; e < experts; ++e) sum += p[e] = std::exp(static_cast<float>(l[e]) - top);
    for (int64_t e = 0; e < experts; ++e) p[e] /= sum;
    std::iota(order.begin(), order.end(), 0);
    for (int64_t e = 0; e < experts; ++e)  // NaN ranks first, as torch.topk ranks it (and sorts without UB)
      if (std::isnan(p[e])) p[e] = std::numeric_limits<float>::infinity();
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int64_t a, int64_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    float chosen = 0.0f;
    for (int64_t j = 0; j < k; ++j) chosen += p[order[j]];
    for (int64_t j = 0; j < k; ++j) {
      id[t * k + j] = order[j];
      w[t * k + j] = static_cast<float>(static_cast<T>(renormalize ? p[order[j]] / chosen : p[order[j]]));
    }
  }
}

at::Tensor moe_routed_cpu(const at::Tensor& x, const at::Tensor& router_logits, int64_t top_k, bool renormalize,
                          const at::Tensor& fc, const std::optional<at::Tensor>& fc_scale, const at::Tensor& proj,
                          const std::optional<at::Tensor>& proj_scale, int64_t expert_start, int64_t inter,
                          int64_t group_size, c10::IntArrayRef fc_tactics, c10::IntArrayRef proj_tactics,
                          const std::optional<at::Tensor>& proj_act_scale) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_experts(x, fc, fc_scale, proj, proj_scale);
  const int64_t T = x.size(0);
  TORCH_CHECK(router_logits.dim() == 2 && router_logits.size(0) == T &&
                  router_logits.scalar_type() == x.scalar_type(), kOp,
              "router_logits must be [tokens, experts] = [", T, ", experts] in x's dtype ", x.scalar_type(), ", got ",
              router_logits.sizes(), " ", router_logits.scalar_type());
  const int64_t experts = router_logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= experts, kOp, "top_k must be in [1, ", experts, "], got ", top_k);
  std::vector<int64_t> ids(T * top_k);
  std::vector<float> weights(T * top_k);
  const at::Tensor logits = router_logits.contiguous();
  switch (float_dtype_of(x, kOp, "x")) {
    case DType::Float:
      route_rows(logits.const_data_ptr<float>(), T, experts, top_k, renormalize, ids.data(), weights.data());
      break;
    case DType::BFloat16:
      route_rows(logits.const_data_ptr<c10::BFloat16>(), T, experts, top_k, renormalize, ids.data(), weights.data());
      break;
    default:
      route_rows(logits.const_data_ptr<c10::Half>(), T, experts, top_k, renormalize, ids.data(), weights.data());
  }
  return run_experts(x, ids.data(), weights.data(), top_k, fc, fc_scale, proj, proj_scale, expert_start, inter,
                     group_size, fc_tactics, proj_tactics, proj_act_scale);
}

at::Tensor moe_gated_cpu(const at::Tensor& x, const at::Tensor& router, int64_t num_experts,
                         c10::IntArrayRef router_tactics, int64_t top_k, bool renormalize, const at::Tensor& fc,
                         const std::optional<at::Tensor>& fc_scale, const at::Tensor& proj,
                         const std::optional<at::Tensor>& proj_scale, int64_t expert_start, int64_t inter,
                         int64_t group_size, c10::IntArrayRef fc_tactics, c10::IntArrayRef proj_tactics,
                         const std::optional<at::Tensor>& proj_act_scale) {
  TORCH_CHECK(x.dim() == 2, kOp, "x must be [tokens, hidden], got ", x.sizes());
  const at::Tensor logits =
      run_gemm(x, router, std::nullopt, std::nullopt, num_experts, 0, false, router_tactics, false);
  return moe_routed_cpu(x, logits, top_k, renormalize, fc, fc_scale, proj, proj_scale, expert_start, inter,
                        group_size, fc_tactics, proj_tactics, proj_act_scale);
}

at::Tensor moe_meta(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                    const at::Tensor& fc, const std::optional<at::Tensor>& fc_scale, const at::Tensor& proj,
                    const std::optional<at::Tensor>& proj_scale, int64_t expert_start, int64_t inter,
                    int64_t group_size, c10::IntArrayRef fc_tactics, c10::IntArrayRef proj_tactics,
                    const std::optional<at::Tensor>& proj_act_scale) {
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor moe_routed_meta(const at::Tensor& x, const at::Tensor& router_logits, int64_t top_k, bool renormalize,
                           const at::Tensor& fc, const std::optional<at::Tensor>& fc_scale, const at::Tensor& proj,
                           const std::optional<at::Tensor>& proj_scale, int64_t expert_start, int64_t inter,
                           int64_t group_size, c10::IntArrayRef fc_tactics, c10::IntArrayRef proj_tactics,
                           const std::optional<at::Tensor>& proj_act_scale) {
  return at::empty_symint(x.sym_sizes(), x.options());
}

at::Tensor moe_gated_meta(const at::Tensor& x, const at::Tensor& router, int64_t num_experts,
                          c10::IntArrayRef router_tactics, int64_t top_k, bool renormalize, const at::Tensor& fc,
                          const std::optional<at::Tensor>& fc_scale, const at::Tensor& proj,
                          const std::optional<at::Tensor>& proj_scale, int64_t expert_start, int64_t inter,
                          int64_t group_size, c10::IntArrayRef fc_tactics, c10::IntArrayRef proj_tactics,
                          const std::optional<at::Tensor>& proj_act_scale) {
  return at::empty_symint(x.sym_sizes(), x.options());
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor fc, Tensor? fc_scale, Tensor proj, "
        "Tensor? proj_scale, int expert_start, int inter, int group_size=0, int[] fc_tactics=[], "
        "int[] proj_tactics=[], Tensor? proj_act_scale=None) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("moe_routed(Tensor x, Tensor router_logits, int top_k, bool renormalize, Tensor fc, Tensor? fc_scale, "
        "Tensor proj, Tensor? proj_scale, int expert_start, int inter, int group_size=0, int[] fc_tactics=[], "
        "int[] proj_tactics=[], Tensor? proj_act_scale=None) -> Tensor",
        {at::Tag::pt2_compliant_tag});
  m.def("moe_gated(Tensor x, Tensor router, int num_experts, int[] router_tactics, int top_k, bool renormalize, "
        "Tensor fc, Tensor? fc_scale, Tensor proj, Tensor? proj_scale, int expert_start, int inter, "
        "int group_size=0, int[] fc_tactics=[], int[] proj_tactics=[], Tensor? proj_act_scale=None) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) {
  m.impl("moe", &kiln::moe_cpu);
  m.impl("moe_routed", &kiln::moe_routed_cpu);
  m.impl("moe_gated", &kiln::moe_gated_cpu);
}

TORCH_LIBRARY_IMPL(kiln_cpp, Meta, m) {
  m.impl("moe", &kiln::moe_meta);
  m.impl("moe_routed", &kiln::moe_routed_meta);
  m.impl("moe_gated", &kiln::moe_gated_meta);
}

namespace ks = kiln::shim;

KILN_C_SHIM(moe, (AtenTensorHandle x, AtenTensorHandle topk_ids, AtenTensorHandle topk_weights, AtenTensorHandle fc,
                  AtenTensorHandle* fc_scale, AtenTensorHandle proj, AtenTensorHandle* proj_scale, int64_t expert_start,
                  int64_t inter, int64_t group_size, const int64_t* fc_tactics, int64_t fc_tactics_len,
                  const int64_t* proj_tactics, int64_t proj_tactics_len, AtenTensorHandle* proj_act_scale,
                  AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(moe, *out = ks::handle(kiln::moe_cpu(
                            ks::tensor(x), ks::tensor(topk_ids), ks::tensor(topk_weights), ks::tensor(fc),
                            ks::optional(fc_scale), ks::tensor(proj), ks::optional(proj_scale), expert_start, inter,
                            group_size, ks::ints(fc_tactics, fc_tactics_len), ks::ints(proj_tactics, proj_tactics_len),
                            ks::optional(proj_act_scale))));
}

KILN_C_SHIM(moe_routed, (AtenTensorHandle x, AtenTensorHandle router_logits, int64_t top_k, int32_t renormalize,
                         AtenTensorHandle fc, AtenTensorHandle* fc_scale, AtenTensorHandle proj,
                         AtenTensorHandle* proj_scale, int64_t expert_start, int64_t inter, int64_t group_size,
                         const int64_t* fc_tactics, int64_t fc_tactics_len, const int64_t* proj_tactics,
                         int64_t proj_tactics_len, AtenTensorHandle* proj_act_scale, AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(moe_routed, *out = ks::handle(kiln::moe_routed_cpu(
                                   ks::tensor(x), ks::tensor(router_logits), top_k, renormalize != 0, ks::tensor(fc),
                                   ks::optional(fc_scale), ks::tensor(proj), ks::optional(proj_scale), expert_start,
                                   inter, group_size, ks::ints(fc_tactics, fc_tactics_len),
                                   ks::ints(proj_tactics, proj_tactics_len), ks::optional(proj_act_scale))));
}

KILN_C_SHIM(moe_gated, (AtenTensorHandle x, AtenTensorHandle router, int64_t num_experts, const int64_t* router_tactics,
                        int64_t router_tactics_len, int64_t top_k, int32_t renormalize, AtenTensorHandle fc,
                        AtenTensorHandle* fc_scale, AtenTensorHandle proj, AtenTensorHandle* proj_scale,
                        int64_t expert_start, int64_t inter, int64_t group_size, const int64_t* fc_tactics,
                        int64_t fc_tactics_len, const int64_t* proj_tactics, int64_t proj_tactics_len,
                        AtenTensorHandle* proj_act_scale, AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(moe_gated, *out = ks::handle(kiln::moe_gated_cpu(
                                  ks::tensor(x), ks::tensor(router), num_experts,
                                  ks::ints(router_tactics, router_tactics_len), top_k, renormalize != 0,
                                  ks::tensor(fc), ks::optional(fc_scale), ks::tensor(proj), ks::optional(proj_scale),
                                  expert_start, inter, group_size, ks::ints(fc_tactics, fc_tactics_len),
                                  ks::ints(proj_tactics, proj_tactics_len), ks::optional(proj_act_scale))));
}
