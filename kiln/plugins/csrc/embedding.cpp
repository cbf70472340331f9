// Rows of a packed table, the layouts kiln_cpp::gemm reads (gemm.cpp's header): a tied embedding
// reads the lm_head's packed copy, so an engine holds that table once.
//
//   embedding(packed, ids [...], n, k) -> [..., k]: rows of a bf16 / fp16 / float32 table
//   embedding_dequant(packed, scale, ids [...], n, k, group_size, dtype) -> [..., k]: rows of an
//     int8 / int4 table (a quantized lm_head), dequantized

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "c_shim.h"
#include "gemm_op.h"
#include "thread_pool.h"

namespace kiln {
namespace {

// Rows `ids` of a packed [n, k] table (a tied embedding reads the lm_head's packed copy): element k
// of row i is at panel i / 16, stored row k / kk, position (i % 16) * kk + k % kk, for the layout's
// kk k per row. An op of its own so that the compiler materializes the embedding once; as indexing
// it fused the strided gather into every consumer of the residual. T only fixes the element width:
// rows are copied bit for bit.
template <typename T>
void gather_rows(const void* packed, const int64_t* ids, void* rows, int64_t count, int64_t K, int64_t panel_rows,
                 int64_t kk) {
  const T* table = static_cast<const T*>(packed);
  T* out = static_cast<T*>(rows);
  kiln::pool::parallel_for(0, count, std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1)), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* column = table + (ids[i] / kPanel) * panel_rows * kPanel * kk + (ids[i] % kPanel) * kk;
      for (int64_t k = 0; k < K; ++k) out[i * K + k] = column[k / kk * kPanel * kk + k % kk];
    }
  });
}

// ids as a contiguous int64 tensor, each a row of an n-row table.
at::Tensor checked_ids(const at::Tensor& ids, int64_t n, const char* op) {
  TORCH_CHECK(ids.scalar_type() == at::kLong, op, "ids must be int64, got ", ids.scalar_type());
  at::Tensor idc = ids.contiguous();
  const int64_t* id = idc.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < idc.numel(); ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < n, op, "token id ", id[i], " is outside the vocabulary [0, ", n, ")");
  }
  return idc;
}

std::vector<int64_t> rows_shape(const at::Tensor& ids, int64_t k) {
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  return shape;
}

at::Tensor embedding_cpu(const at::Tensor& packed, const at::Tensor& ids, int64_t n, int64_t k) {
  constexpr const char* op = "kiln_cpp::embedding: ";
  TORCH_CHECK(packed.element_size() == 2 || packed.element_size() == 4, op,
              "table must be float32, bfloat16 or float16, got ", packed.scalar_type());
  const Layout layout = layout_of(format_of(packed));
  check_packed(packed, op, "table", layout.width);
  const int64_t K = k > 0 ? k : packed.size(1) * layout.k_per_row;
  TORCH_CHECK(packed.size(1) == panel_rows_for(format_of(packed), K), op, "k = ", K, " does not match the table ",
              packed.sizes());
  TORCH_CHECK(n > 0 && n <= packed.size(0) * kPanel, op, "n = ", n, " rows do not fit ", packed.size(0), " panels");
  const at::Tensor idc = checked_ids(ids, n, op);
  const int64_t count = idc.numel();
  const int64_t* id = idc.const_data_ptr<int64_t>();
  at::Tensor out = at::empty(rows_shape(ids, K), packed.options());
  if (packed.element_size() == 2) {
    gather_rows<uint16_t>(packed.const_data_ptr(), id, out.mutable_data_ptr(), count, K, packed.size(1), layout.k_per_row);
  } else {
    gather_rows<uint32_t>(packed.const_data_ptr(), id, out.mutable_data_ptr(), count, K, packed.size(1), layout.k_per_row);
  }
  return out;
}

// Rows `ids` of a quantized packed [n, k] table, dequantized into dtype: an int8 one
// (w = q * scale[row]) or an int4 one (w = q * scale[k / group_size, row]), the layouts gemm()
// reads. A tied embedding so shares a quantized lm_head's copy.
template <typename Out, typename Scale>
void dequant_rows(const at::Tensor& packed, const Scale* scale, const int64_t* ids, Out* out, int64_t count,
                  int64_t K, int64_t group_size) {
  const int64_t panel_rows = packed.size(1), padded = packed.size(0) * kPanel;
  const bool int4 = packed.scalar_type() == at::kByte;
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1));
  kiln::pool::parallel_for(0, count, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = ids[i], at = (row / kPanel) * panel_rows * 4 * kPanel + (row % kPanel) * 4;
      Out* dst = out + i * K;
      if (int4) {
        const uint8_t* bytes = packed.const_data_ptr<uint8_t>() + at;
        for (int64_t k = 0; k < K; ++k) {
          const uint8_t b = bytes[k / 8 * 4 * kPanel + k % 4];
          const int32_t q = (((k % 8 < 4 ? b : b >> 4) & 15) ^ 8) - 8;
          dst[k] = static_cast<Out>(static_cast<float>(q) * static_cast<float>(scale[k / group_size * padded + row]));
        }
      } else {
        const int8_t* q = packed.const_data_ptr<int8_t>() + at;
        for (int64_t k = 0; k < K; ++k) {
          dst[k] = static_cast<Out>(static_cast<float>(q[k / 4 * 4 * kPanel + k % 4]) * static_cast<float>(scale[row]));
        }
      }
    }
  });
}

at::Tensor embedding_dequant_cpu(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& ids, int64_t n,
                                 int64_t k, int64_t group_size, at::ScalarType dtype) {
  constexpr const char* op = "kiln_cpp::embedding_dequant: ";
  const WeightFormat format = format_of(packed);
  TORCH_CHECK(format == WeightFormat::Int8 || format == WeightFormat::Int4, op,
              "table must be int8 or uint8 (int4), got ", packed.scalar_type());
  check_packed(packed, op, "table", layout_of(format).width);
  TORCH_CHECK(k > 0 && packed.size(1) == panel_rows_for(format, k), op, "k = ", k, " does not match the table ",
              packed.sizes());
  const int64_t padded = packed.size(0) * kPanel;
  TORCH_CHECK(n > 0 && n <= padded, op, "n = ", n, " rows do not fit ", packed.size(0), " panels");
  // As gemm() reads them: an int4 table's group scales float16, an int8 one's float32.
  const at::Tensor sc = scale.to(format == WeightFormat::Int4 ? at::kHalf : at::kFloat).contiguous();
  if (format == WeightFormat::Int4) {
    TORCH_CHECK(group_size > 0 && k % group_size == 0 && sc.numel() == k / group_size * padded, op,
                "an int4 table needs scale [k / group_size, panels * 16] = [", group_size > 0 ? k / group_size : 0,
                ", ", padded, "], got ", sc.sizes(), " with group_size ", group_size);
  } else {
    TORCH_CHECK(sc.numel() == padded, op, "an int8 table needs scale [panels * 16] = [", padded, "], got ", sc.sizes());
  }
  const at::Tensor idc = checked_ids(ids, n, op);
  const int64_t count = idc.numel();
  const int64_t* id = idc.const_data_ptr<int64_t>();
  at::Tensor out = at::empty(rows_shape(ids, k), packed.options().dtype(dtype));
  const auto rows = [&](const auto* s) {
    switch (out_type_of(dtype)) {
      case OutType::Float: dequant_rows(packed, s, id, out.mutable_data_ptr<float>(), count, k, group_size); break;
      case OutType::BFloat16:
        dequant_rows(packed, s, id, out.mutable_data_ptr<c10::BFloat16>(), count, k, group_size);
        break;
      case OutType::Half: dequant_rows(packed, s, id, out.mutable_data_ptr<c10::Half>(), count, k, group_size); break;
    }
  };
  if (format == WeightFormat::Int4) {
    rows(sc.const_data_ptr<c10::Half>());
  } else {
    rows(sc.const_data_ptr<float>());
  }
  return out;
}

at::Tensor embedding_dequant_meta(const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& ids, int64_t n,
                                  int64_t k, int64_t group_size, at::ScalarType dtype) {
  std::vector<c10::SymInt> shape(ids.sym_sizes().begin(), ids.sym_sizes().end());
  shape.push_back(k);
  return at::empty_symint(shape, packed.options().dtype(dtype));
}

at::Tensor embedding_meta(const at::Tensor& packed, const at::Tensor& ids, int64_t n, int64_t k) {
  std::vector<c10::SymInt> shape(ids.sym_sizes().begin(), ids.sym_sizes().end());
  shape.push_back(k > 0 ? c10::SymInt(k) : packed.sym_size(1) * layout_of(format_of(packed)).k_per_row);
  return at::empty_symint(shape, packed.options());
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("embedding(Tensor packed, Tensor ids, int n, int k=0) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("embedding_dequant(Tensor packed, Tensor scale, Tensor ids, int n, int k, int group_size, ScalarType dtype) "
        "-> Tensor", {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) {
  m.impl("embedding", &kiln::embedding_cpu);
  m.impl("embedding_dequant", &kiln::embedding_dequant_cpu);
}

TORCH_LIBRARY_IMPL(kiln_cpp, Meta, m) {
  m.impl("embedding", &kiln::embedding_meta);
  m.impl("embedding_dequant", &kiln::embedding_dequant_meta);
}

namespace ks = kiln::shim;

KILN_C_SHIM(embedding, (AtenTensorHandle packed, AtenTensorHandle ids, int64_t n, int64_t k, AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(embedding, *out = ks::handle(kiln::embedding_cpu(ks::tensor(packed), ks::tensor(ids), n, k)));
}

KILN_C_SHIM(embedding_dequant, (AtenTensorHandle packed, AtenTensorHandle scale, AtenTensorHandle ids, int64_t n,
                                int64_t k, int64_t group_size, int32_t dtype, AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(embedding_dequant,
                   *out = ks::handle(kiln::embedding_dequant_cpu(ks::tensor(packed), ks::tensor(scale), ks::tensor(ids),
                                                                 n, k, group_size, static_cast<at::ScalarType>(dtype))));
}
