// kiln_cpp::paged_attention's CPU implementation (paged_attention.cpp), for ops that end in it
// (attention.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

namespace kiln {

at::Tensor paged_attention_cpu(const at::Tensor& q, const at::Tensor& kv_cache, int64_t layer,
                               const at::Tensor& ctx_token_index, const at::Tensor& ctx_block_tables,
                               const at::Tensor& ctx_context_lens, const at::Tensor& gen_token_index,
                               const at::Tensor& gen_block_tables, const at::Tensor& gen_context_lens,
                               double scale, const std::optional<at::Tensor>& kv_scale, int64_t window,
                               double softcap);

}  // namespace kiln
