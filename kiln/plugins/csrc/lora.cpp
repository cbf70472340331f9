// kiln_cpp::lora: one linear's output plus each token's LoRA updates (kiln/models/lora.py).
//
//   lora(base [T, N], x [T, in], lora_slots [T], lora_ranks [slots], pools, offsets) -> [T, N]
//
// pools: one layer's adapter pool per module the linear holds, [slots, max_rank, in + out_p] (row r
// of a slot: A's row r, then B's column r, alpha / r folded in), its outputs at column offsets[p] of
// base (the q, k and v of a fused qkv output; the two halves of gate_up). A token of slot s >= 0 adds
// B_s (A_s x) over the first lora_ranks[s] rows only, so an adapter of rank 8 in an engine built for
// 64 costs rank 8; tokens of slot -1 (the base model) cost a copy. Segmented as punica and S-LoRA
// are: only a token's own adapter is read and computed, and the tokens run sorted by slot, so each
// adapter's rows are read from memory once per step and from cache for its other tokens.

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "c_shim.h"
#include "gemm.h"
#include "lora.h"
#include "op_dtype.h"
#include "paged_attention_x86.h"
#include "thread_pool.h"

namespace kiln {
namespace {

constexpr const char* kOp = "kiln_cpp::lora: ";

using Kernel = void (*)(const LoraParams&, int64_t, int64_t);

Kernel select_kernel() {
  const std::string capability = at::get_cpu_capability();
#if KILN_X86_KERNELS
  if (capability == "AVX512") return &AVX512::lora_rows;
  if (capability == "AVX2") return &AVX2::lora_rows;
#endif
  return &DEFAULT::lora_rows;
}

at::Tensor lora_cpu(const at::Tensor& base, const at::Tensor& x, const at::Tensor& lora_slots,
                    const at::Tensor& lora_ranks, at::TensorList pools, c10::IntArrayRef offsets) {
  TORCH_CHECK(base.dim() == 2 && x.dim() == 2 && x.size(0) == base.size(0), kOp,
              "base and x must be [T, N] and [T, in], got ", base.sizes(), " and ", x.sizes());
  const int64_t T = base.size(0), N = base.size(1), in = x.size(1);
  TORCH_CHECK(x.scalar_type() == base.scalar_type() && x.stride(1) == 1, kOp,
              "x must be base's dtype with contiguous rows, got ", x.scalar_type(), " strides ", x.strides());
  TORCH_CHECK(lora_slots.dim() == 1 && lora_slots.size(0) == T && lora_slots.scalar_type() == at::kLong, kOp,
              "lora_slots must be [T] int64, got ", lora_slots.sizes(), " ", lora_slots.scalar_type());
  TORCH_CHECK(pools.size() == offsets.size() && !pools.empty(), kOp, "one offset per pool, got ", pools.size(),
              " pools and ", offsets.size(), " offsets");
  const int64_t slots = pools[0].size(0), max_rank = pools[0].size(1);
  TORCH_CHECK(lora_ranks.dim() == 1 && lora_ranks.size(0) == slots && lora_ranks.scalar_type() == at::kLong, kOp,
              "lora_ranks must be [slots] = [", slots, "] int64, got ", lora_ranks.sizes());
  std::vector<const void*> data;
  std::vector<int64_t> outs;
  for (size_t m = 0; m < pools.size(); ++m) {
    const at::Tensor& p = pools[m];
    TORCH_CHECK(p.dim() == 3 && p.size(0) == slots && p.size(1) == max_rank && p.size(2) > in &&
                    p.scalar_type() == base.scalar_type() && p.is_contiguous(), kOp,
                "pool ", m, " must be a contiguous [", slots, ", ", max_rank, ", ", in, " + out] tensor of base's "
                "dtype, got ", p.sizes(), " ", p.scalar_type());
    outs.push_back(p.size(2) - in);
    TORCH_CHECK(offsets[m] >= 0 && offsets[m] + outs.back() <= N, kOp, "pool ", m, "'s ", outs.back(),
                " outputs at column ", offsets[m], " do not fit base's ", N);
    data.push_back(p.const_data_ptr());
  }
  const at::Tensor slot = lora_slots.contiguous(), rank = lora_ranks.contiguous();
  const int64_t* s = slot.const_data_ptr<int64_t>();
  const int64_t* r = rank.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < slots; ++i)
    TORCH_CHECK(r[i] >= 0 && r[i] <= max_rank, kOp, "slot ", i, " has rank ", r[i], ", the pools hold ", max_rank);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(s[t] >= -1 && s[t] < slots, kOp, "token ", t, " has slot ", s[t], "; the pools hold ", slots);
  const at::Tensor b = base.contiguous();
  at::Tensor out = at::empty({T, N}, base.options());
  if (std::none_of(s, s + T, [&](int64_t slot) { return slot >= 0 && r[slot] > 0; })) {
    std::memcpy(out.mutable_data_ptr(), b.const_data_ptr(), T * N * base.element_size());  // no pool wake-up
    return out;
  }
  std::vector<int64_t> order(T);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] < s[b]; });
  std::vector<int64_t> tiles{0};
  for (int64_t i = 1; i <= T; ++i)
    if (i == T || s[order[i]] != s[order[i - 1]] || i - tiles.back() == kLoraTile) tiles.push_back(i);
  const int64_t num_tiles = static_cast<int64_t>(tiles.size()) - 1;
  const LoraParams p{float_dtype_of(base, kOp, "base"), x.const_data_ptr(), b.const_data_ptr(),
                     out.mutable_data_ptr(), order.data(), tiles.data(), s, r, in, T > 1 ? x.stride(0) : in, N,
                     max_rank, static_cast<int64_t>(pools.size()), data.data(), outs.data(), offsets.data()};
  // A tile's work: up to kLoraTile tokens' rank dot products of `in` and rank rows of out_p, per pool.
  int64_t per_tile = 0;
  for (int64_t o : outs) per_tile += kLoraTile * max_rank * (in + o);
  static const Kernel generic = select_kernel();
  const Kernel kernel =
      (cpu_features() & kAvx512Bf16) && avx512::lora_bf16_fits(p) ? &avx512::lora_rows_bf16 : generic;
  kiln::pool::parallel_for(0, num_tiles, std::max<int64_t>(1, 65536 / std::max<int64_t>(1, per_tile)),
                           [&](int64_t begin, int64_t end) { kernel(p, begin, end); });
  return out;
}

at::Tensor lora_meta(const at::Tensor& base, const at::Tensor& x, const at::Tensor& lora_slots,
                     const at::Tensor& lora_ranks, at::TensorList pools, c10::IntArrayRef offsets) {
  return at::empty_symint(base.sym_sizes(), base.options());
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("lora(Tensor base, Tensor x, Tensor lora_slots, Tensor lora_ranks, Tensor[] pools, int[] offsets) -> Tensor",
        {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) { m.impl("lora", &kiln::lora_cpu); }

TORCH_LIBRARY_IMPL(kiln_cpp, Meta, m) { m.impl("lora", &kiln::lora_meta); }

namespace ks = kiln::shim;

KILN_C_SHIM(lora, (AtenTensorHandle base, AtenTensorHandle x, AtenTensorHandle lora_slots, AtenTensorHandle lora_ranks,
                   const AtenTensorHandle* pools, int64_t pools_len, const int64_t* offsets, int64_t offsets_len,
                   AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(lora, *out = ks::handle(kiln::lora_cpu(ks::tensor(base), ks::tensor(x), ks::tensor(lora_slots),
                                                          ks::tensor(lora_ranks), ks::tensors(pools, pools_len),
                                                          ks::ints(offsets, offsets_len))));
}
