// kiln::shim (c_shim.h): the shims' declarations, for the engine build.
#include "c_shim.h"

#include <torch/library.h>

namespace kiln::shim {
namespace {

std::vector<std::string>& registry() {
  static std::vector<std::string> declared;  // filled by the shims' static initializers
  return declared;
}

std::vector<std::string> declarations_op() { return registry(); }

}  // namespace

Declare::Declare(const char* declaration) { registry().emplace_back(declaration); }

}  // namespace kiln::shim

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  // "AOTITorchError aoti_torch_cpu_<op>(<params>)", one for each op an engine calls by its shim.
  m.def("c_shims() -> str[]", &kiln::shim::declarations_op);
}
