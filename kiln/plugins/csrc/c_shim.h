// C shims: an AOTInductor engine calls each kiln_cpp op through a C function of its own,
// `aoti_torch_cpu_<op>`, as it calls ATen's ops, instead of through its proxy executor.
//
// The proxy executor boxes every argument into a stack of IValues, copies the op's schema and
// calls the op through the dispatcher: a few microseconds a call, and at batch-1 decode far more,
// since every call runs after a GEMV has streamed megabytes of weights through the core's L2 and
// all that code runs from cold caches. A shim converts the handles and calls the op's CPU kernel.
//
// KILN_C_SHIM(op, (params)) defines the shim and records its declaration, the one string that
// kiln/plugins/c_shims.py hands AOTInductor to declare it in the engine's code: the engine and the
// library agree by construction, and an engine built against other declarations is refused at
// load. The parameters follow AOTInductor's convention for the op's schema, in order: Tensor ->
// AtenTensorHandle; Tensor? -> AtenTensorHandle* (null for None); int -> int64_t; float -> double;
// bool -> int32_t; str -> const char*; ScalarType -> int32_t; int[] and Tensor[] -> a pointer and
// an int64_t length; then one AtenTensorHandle* per returned tensor.
#pragma once

#include <ATen/record_function.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <string>
#include <vector>

namespace kiln::shim {

struct Declare {
  explicit Declare(const char* declaration);
};

inline const at::Tensor& tensor(AtenTensorHandle h) { return *torch::aot_inductor::tensor_handle_to_tensor_pointer(h); }

inline std::optional<at::Tensor> optional(AtenTensorHandle* h) {
  return torch::aot_inductor::pointer_to_optional<at::Tensor>(h);
}

inline std::vector<at::Tensor> tensors(const AtenTensorHandle* data, int64_t len) {
  return torch::aot_inductor::pointer_to_list<at::Tensor>(data, len);
}

inline c10::IntArrayRef ints(const int64_t* data, int64_t len) { return {data, static_cast<size_t>(len)}; }

inline AtenTensorHandle handle(at::Tensor t) { return torch::aot_inductor::new_tensor_handle(std::move(t)); }

}  // namespace kiln::shim

#define KILN_C_SHIM(op, params)                                                                   \
  static const ::kiln::shim::Declare kiln_c_shim_##op("AOTITorchError aoti_torch_cpu_" #op #params); \
  extern "C" AOTITorchError aoti_torch_cpu_##op params

// The shim's body: a profiler range named as the op's (torch.profiler still sees it), and an
// exception as AOTInductor expects it, an error code with its message kept.
#define KILN_C_SHIM_BODY(op, ...)                   \
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({       \
    RECORD_FUNCTION("kiln_cpp::" #op, c10::ArrayRef<const c10::IValue>{}); \
    __VA_ARGS__;                                     \
  })
