// kiln_cpp::all_reduce / kiln_cpp::all_gather: the collectives of a tensor-parallel engine step.
//
//   all_reduce(x, group) -> the sum of x over the group's ranks (x's dtype: float32, bf16, fp16)
//   all_gather(x [n, ...], world_size, group) -> [world_size * n, ...], rank r's x at rows r * n
//
// `group` names the ranks' group, as torch.distributed names process groups. Where the runtime has
// attached a shared-memory communicator under that name (shm_attach: every rank of the group on one
// machine), the op goes through it; otherwise it calls torch's functional collective
// (_c10d_functional::all_reduce / all_gather_into_tensor + wait_tensor) on the c10d process group
// registered under that name (gloo across machines, NCCL on GPUs). So one engine runs either way,
// and an AOTInductor package calls the op through the dispatcher, without Python.
//
// The shared-memory path (vLLM's and DeepSpeed's CPU backends do the same): one file under
// /dev/shm mapped by every rank; per round each rank copies its tensor into its slot, publishes
// the round's number in its own cache line, waits for every rank's number and sums all slots in
// rank order, so every rank computes bitwise the same result. Slots alternate between two banks by
// round parity: a rank can only start round s + 2 (overwriting bank s % 2) after every rank
// announced round s + 1, which each does only after reading round s. One barrier per call.
// Waiting spins briefly, then yields the core (the machine may have fewer cores than threads), and
// checks now and then that the ranks it waits for are alive, so that a dead rank is an error here
// instead of a hang.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "c_shim.h"
#include "thread_pool.h"

namespace kiln {
namespace {

constexpr int kMaxRanks = 64;

struct alignas(64) Arrival {
  std::atomic<uint64_t> round;
};

struct Control {
  Arrival arrived[kMaxRanks];
  int64_t pid[kMaxRanks];
};

constexpr size_t kDataOffset = (sizeof(Control) + 4095) / 4096 * 4096;

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Linux: a process is gone once /proc/<pid> is, or a zombie waiting to be reaped.
bool process_alive(int64_t pid) {
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = std::fopen(path, "r");
  if (f == nullptr) return false;
  char buf[512];
  size_t n = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  buf[n] = 0;
  const char* paren = std::strrchr(buf, ')');
  if (paren == nullptr || paren[1] == 0) return true;
  char state = paren[2];
  return state != 'Z' && state != 'X';
}

class ShmComm {
 public:
  ShmComm(std::string group, const std::string& path, int rank, int world, int64_t slot_bytes)
      : group_(std::move(group)), rank_(rank), world_(world), slot_bytes_(slot_bytes) {
    TORCH_CHECK(world >= 1 && world <= kMaxRanks, "kiln_cpp::shm_attach: world_size must be in [1, ", kMaxRanks,
                "], got ", world);
    TORCH_CHECK(rank >= 0 && rank < world, "kiln_cpp::shm_attach: rank ", rank, " is outside [0, ", world, ")");
    TORCH_CHECK(slot_bytes > 0 && slot_bytes % 64 == 0, "kiln_cpp::shm_attach: slot_bytes must be a positive "
                "multiple of 64, got ", slot_bytes);
    size_ = kDataOffset + 2 * static_cast<size_t>(world) * slot_bytes;
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    TORCH_CHECK(fd >= 0, "kiln_cpp::shm_attach: cannot open ", path, ": ", std::strerror(errno));
    struct stat st;
    if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < size_) {
      // Every rank truncates to the same size; the kernel zero-fills, and a later truncate to the
      // same size changes nothing another rank wrote.
      if (::ftruncate(fd, static_cast<off_t>(size_)) != 0) {
        int err = errno;
        ::close(fd);
        TORCH_CHECK(false, "kiln_cpp::shm_attach: cannot size ", path, " to ", size_, " bytes: ", std::strerror(err));
      }
    }
    void* base = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    ::close(fd);
    TORCH_CHECK(base != MAP_FAILED, "kiln_cpp::shm_attach: cannot map ", path, ": ", std::strerror(err));
    base_ = static_cast<char*>(base);
    control_ = reinterpret_cast<Control*>(base_);
    round_ = control_->arrived[rank_].round.load(std::memory_order_acquire);
    control_->pid[rank_] = static_cast<int64_t>(::getpid());
  }

  ~ShmComm() { ::munmap(base_, size_); }

  at::Tensor all_reduce(const at::Tensor& input) {
    at::Tensor x = input.contiguous();
    at::Tensor out = at::empty_like(x);
    const int64_t elem = x.element_size();
    const int64_t per_round = slot_bytes_ / elem;
    const int64_t n = x.numel();
    for (int64_t start = 0; start < n; start += per_round) {  // every rank has the same n
      const int64_t count = std::min(per_round, n - start);
      char* bank = publish(static_cast<const char*>(x.data_ptr()) + start * elem, count * elem);
      reduce(x.scalar_type(), bank, static_cast<char*>(out.data_ptr()) + start * elem, count);
    }
    return out;
  }

  at::Tensor all_gather(const at::Tensor& input) {
    at::Tensor x = input.contiguous();
    std::vector<int64_t> shape = x.sizes().vec();
    TORCH_CHECK(!shape.empty(), "kiln_cpp::all_gather: x must have at least one dimension");
    shape[0] *= world_;
    at::Tensor out = at::empty(shape, x.options());
    const int64_t bytes = x.numel() * x.element_size();
    char* dst = static_cast<char*>(out.data_ptr());
    for (int64_t start = 0; start < bytes; start += slot_bytes_) {
      const int64_t count = std::min(slot_bytes_, bytes - start);
      char* bank = publish(static_cast<const char*>(x.data_ptr()) + start, count);
      for (int r = 0; r < world_; ++r) {
        std::memcpy(dst + r * bytes + start, bank + r * slot_bytes_, count);
      }
    }
    return out;
  }

 private:
  // One round: this rank's bytes into its slot of the round's bank, then wait for every rank's.
  char* publish(const char* src, int64_t bytes) {
    const uint64_t round = ++round_;
    char* bank = base_ + kDataOffset + static_cast<size_t>(round & 1) * world_ * slot_bytes_;
    std::memcpy(bank + rank_ * slot_bytes_, src, bytes);
    control_->arrived[rank_].round.store(round, std::memory_order_release);
    for (int r = 0; r < world_; ++r) {
      if (r != rank_) wait_for(r, round);
    }
    return bank;
  }

  void wait_for(int r, uint64_t round) {
    auto& flag = control_->arrived[r].round;
    for (int i = 0; i < 4096; ++i) {
      if (flag.load(std::memory_order_acquire) >= round) return;
      cpu_relax();
    }
    auto last_check = std::chrono::steady_clock::now();
    while (flag.load(std::memory_order_acquire) < round) {
      sched_yield();
      auto now = std::chrono::steady_clock::now();
      if (now - last_check > std::chrono::milliseconds(20)) {
        last_check = now;
        const int64_t pid = control_->pid[r];
        TORCH_CHECK(pid == 0 || process_alive(pid), "kiln_cpp collective on group ", group_, ": rank ", r,
                    " (pid ", pid, ") exited while rank ", rank_, " waited for it");
      }
    }
  }

  void reduce(at::ScalarType dtype, const char* bank, char* out, int64_t count) {
    switch (dtype) {
      case at::kFloat: return sum<float>(bank, out, count);
      case at::kBFloat16: return sum<c10::BFloat16>(bank, out, count);
      case at::kHalf: return sum<c10::Half>(bank, out, count);
      default: TORCH_CHECK(false, "kiln_cpp::all_reduce: x must be float32, bfloat16 or float16, got ", dtype);
    }
  }

  // Every rank adds the slots in rank order, in float32: the same bits on every rank.
  template <typename T>
  void sum(const char* bank, char* out_bytes, int64_t count) {
    T* out = reinterpret_cast<T*>(out_bytes);
    const int world = world_;
    const int64_t slot = slot_bytes_;
    kiln::pool::parallel_for(0, count, 16384, [&](int64_t begin, int64_t end) {
      constexpr int64_t kTile = 512;
      float acc[kTile];
      for (int64_t t = begin; t < end; t += kTile) {
        const int64_t m = std::min(kTile, end - t);
        const T* first = reinterpret_cast<const T*>(bank) + t;
        for (int64_t i = 0; i < m; ++i) acc[i] = static_cast<float>(first[i]);
        for (int r = 1; r < world; ++r) {
          const T* part = reinterpret_cast<const T*>(bank + r * slot) + t;
          for (int64_t i = 0; i < m; ++i) acc[i] += static_cast<float>(part[i]);
        }
        for (int64_t i = 0; i < m; ++i) out[t + i] = static_cast<T>(acc[i]);
      }
    });
  }

  std::string group_;
  int rank_;
  int world_;
  int64_t slot_bytes_;
  size_t size_ = 0;
  char* base_ = nullptr;
  Control* control_ = nullptr;
  uint64_t round_ = 0;
};

std::mutex registry_mutex;
std::unordered_map<std::string, std::shared_ptr<ShmComm>>& registry() {
  static auto* map = new std::unordered_map<std::string, std::shared_ptr<ShmComm>>();
  return *map;
}

std::shared_ptr<ShmComm> find(const std::string& group) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry().find(group);
  return it == registry().end() ? nullptr : it->second;
}

at::Tensor call_functional(const char* name, c10::Stack stack) {
  // The c10d process group registered under the group's name answers (torch.distributed).
  const auto& op = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  op.callBoxed(&stack);
  static const auto wait = c10::Dispatcher::singleton().findSchemaOrThrow("_c10d_functional::wait_tensor", "");
  c10::Stack waited{stack[0]};
  wait.callBoxed(&waited);
  return waited[0].toTensor();
}

at::Tensor all_reduce_cpu(const at::Tensor& x, c10::string_view group) {
  const std::string name(group);
  if (auto comm = find(name)) return comm->all_reduce(x);
  return call_functional("_c10d_functional::all_reduce", {x.contiguous(), std::string("sum"), name});
}

at::Tensor all_gather_cpu(const at::Tensor& x, int64_t world_size, c10::string_view group) {
  const std::string name(group);
  if (auto comm = find(name)) return comm->all_gather(x);
  return call_functional("_c10d_functional::all_gather_into_tensor", {x.contiguous(), world_size, name});
}

at::Tensor all_reduce_meta(const at::Tensor& x, c10::string_view group) { return at::empty_like(x); }

at::Tensor all_gather_meta(const at::Tensor& x, int64_t world_size, c10::string_view group) {
  std::vector<c10::SymInt> shape(x.sym_sizes().begin(), x.sym_sizes().end());
  shape[0] = shape[0] * world_size;
  return at::empty_symint(shape, x.options());
}

void shm_attach(c10::string_view group, c10::string_view path, int64_t rank, int64_t world_size,
                int64_t slot_bytes) {
  auto comm = std::make_shared<ShmComm>(std::string(group), std::string(path), static_cast<int>(rank),
                                        static_cast<int>(world_size), slot_bytes);
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry()[std::string(group)] = std::move(comm);
}

void shm_detach(c10::string_view group) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  registry().erase(std::string(group));
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("all_reduce(Tensor x, str group) -> Tensor", {at::Tag::pt2_compliant_tag});
  m.def("all_gather(Tensor x, int world_size, str group) -> Tensor", {at::Tag::pt2_compliant_tag});
  // Attach this process, as `rank` of `world_size`, to the shared-memory communicator in file
  // `path` (made on first attach) for group `group`; slot_bytes: the most bytes a rank sends per round.
  m.def("shm_attach(str group, str path, int rank, int world_size, int slot_bytes) -> ()", &kiln::shm_attach);
  m.def("shm_detach(str group) -> ()", &kiln::shm_detach);
}

TORCH_LIBRARY_IMPL(kiln_cpp, CPU, m) {
  m.impl("all_reduce", &kiln::all_reduce_cpu);
  m.impl("all_gather", &kiln::all_gather_cpu);
}

TORCH_LIBRARY_IMPL(kiln_cpp, Meta, m) {
  m.impl("all_reduce", &kiln::all_reduce_meta);
  m.impl("all_gather", &kiln::all_gather_meta);
}

namespace ks = kiln::shim;

KILN_C_SHIM(all_reduce, (AtenTensorHandle x, const char* group, AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(all_reduce, *out = ks::handle(kiln::all_reduce_cpu(ks::tensor(x), group)));
}

KILN_C_SHIM(all_gather, (AtenTensorHandle x, int64_t world_size, const char* group, AtenTensorHandle* out)) {
  KILN_C_SHIM_BODY(all_gather, *out = ks::handle(kiln::all_gather_cpu(ks::tensor(x), world_size, group)));
}
