// kiln_cpp::moe: a mixture-of-experts MLP over a step's tokens, on kiln_cpp::gemm's kernels.
//
//   moe(x [T, H], topk_ids [T, k], topk_weights [T, k], fc, fc_scale?, proj, proj_scale?, expert_start,
//       inter, group_size, fc_tactics, proj_tactics) -> [T, H] in x's dtype
//
// fc and proj stack one packed weight per expert this rank holds (experts expert_start ..
// expert_start + E - 1; kiln/plugins/gemm.py packs each): fc [E, <panels of [2 * inter, H]>] with an
// expert's up rows before its gate rows (TensorRT-LLM's layout), proj [E, <panels of [H, inter]>];
// the scales stack the same way. Tokens are grouped by expert, so each expert's weights are read once
// per step and only the experts some token chose are read at all: a batch-1 decode reads k experts.
// Each expert runs silu(x W_gate) * (x W_up) then W_down over its tokens only, as one GEMM each over
// those rows with the kernel its tactics pick for that row count; the outputs are weighted by the
// routing weights and summed per token in float32. Ids of experts another rank holds (expert
// parallelism) are skipped: the caller's all-reduce adds those ranks' parts.

#include <ATen/Functions.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <vector>

#include "gemm_op.h"

namespace kiln {
namespace {

constexpr const char* kOp = "kiln_cpp::moe: ";

std::optional<at::Tensor> expert_of(const std::optional<at::Tensor>& t, int64_t e) {
  return t.has_value() ? std::optional<at::Tensor>(t->select(0, e)) : std::nullopt;
}

at::Tensor moe_cpu(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                   const at::Tensor& fc, const std::optional<at::Tensor>& fc_scale, const at::Tensor& proj,
                   const std::optional<at::Tensor>& proj_scale, int64_t expert_start, int64_t inter,
                   int64_t group_size, c10::IntArrayRef fc_tactics, c10::IntArrayRef proj_tactics) {
  TORCH_CHECK(x.dim() == 2, kOp, "x must be [tokens, hidden], got ", x.sizes());
  const int64_t T = x.size(0), H = x.size(1), E = fc.size(0);
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T && topk_weights.sizes() == topk_ids.sizes(), kOp,
              "topk_ids and topk_weights must both be [tokens, k] = [", T, ", k], got ", topk_ids.sizes(), " and ",
              topk_weights.sizes());
  TORCH_CHECK(proj.size(0) == E && fc.dim() == 4 && proj.dim() == 4, kOp,
              "fc and proj must stack the same experts' packed weights, got ", fc.sizes(), " and ", proj.sizes());
  const int64_t k = topk_ids.size(1);
  const at::Tensor ids = topk_ids.to(at::kLong).contiguous(), weights = topk_weights.to(at::kFloat).contiguous();
  const int64_t* id = ids.const_data_ptr<int64_t>();
  const float* w = weights.const_data_ptr<float>();
  std::vector<std::vector<int64_t>> rows(E);
  std::vector<std::vector<float>> scales(E);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = id[t * k + j] - expert_start;
      if (e < 0 || e >= E) continue;
      rows[e].push_back(t);
      scales[e].push_back(w[t * k + j]);
    }
  at::Tensor out = at::zeros({T, H}, x.options().dtype(at::kFloat));
  const at::Tensor xc = x.contiguous();
  for (int64_t e = 0; e < E; ++e) {
    if (rows[e].empty()) continue;
    const int64_t m = static_cast<int64_t>(rows[e].size());
    const at::Tensor index = at::from_blob(rows[e].data(), {m}, at::kLong);
    const at::Tensor xe = m == T ? xc : xc.index_select(0, index);
    const at::Tensor h = gemm(xe, fc.select(0, e), expert_of(fc_scale, e), std::nullopt, 2 * inter, group_size, false,
                              fc_tactics);
    const at::Tensor act = at::silu(h.narrow(1, inter, inter)) * h.narrow(1, 0, inter);
    const at::Tensor y = gemm(act, proj.select(0, e), expert_of(proj_scale, e), std::nullopt, H, group_size, true,
                              proj_tactics);
    out.index_add_(0, index, y * at::from_blob(scales[e].data(), {m, 1}, at::kFloat));
  }
  return out.to(x.scalar_type());
}

at::Tensor moe_meta(const at::Tensor& x, const at::Tensor& topk_ids, const at::Tensor& topk_weights,
                    const at::Tensor& fc, const std::optional<at::Tensor>& fc_scale, const at::Tensor& proj,
                    const std::optional<at::Tensor>& proj_scale, int64_t expert_start, int64_t inter,
                    int64_t group_size, c10::IntArrayRef fc_tactics, c10::IntArrayRef proj_tactics) {
  return at::empty_symint(x.sym_sizes(), x.options());
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("moe(Tensor x, Tensor topk_ids, Tensor topk_weights, Tensor fc, Tensor? fc_scale, Tensor proj, "
        "Tensor? proj_scale, int expert_start, int inter, int group_size=0, int[] fc_tactics=[], "
        "int[] proj_tactics=[]) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) { m.impl("moe", &kiln::moe_cpu); }

TORCH_LIBRARY_IMPL(kiln_cpp, Meta, m) { m.impl("moe", &kiln::moe_meta); }
