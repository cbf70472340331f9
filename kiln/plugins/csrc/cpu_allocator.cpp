// kiln_cpp::use_caching_allocator: a caching allocator for the process's CPU tensors.
//
// A decode step allocates a few hundred small tensors (AOTInductor's buffers, the plugins' outputs)
// and frees them again. c10's CPU allocator asks glibc for each with posix_memalign(64), which
// glibc serves from the locked arena, never its per-thread cache, splitting and coalescing chunks
// (and trimming the heap) every time: 5-6% of the step's thread at batch 1 on a mixture of experts
// (perf). This one keeps freed blocks of up to 32 MiB in size classes (4 per power of two) and
// hands them out again; larger ones (weights, the KV pool) go to the allocator it replaced. Cached
// blocks are bounded: past 256 MiB, returning one releases them all to the system first.
//
// Fresh blocks of a few huge pages or more are advised to take them (MADV_HUGEPAGE) when asked:
// decode streams the KV pool and an eager engine's weights every step, and on 4 KiB pages takes a TLB
// miss for each (kiln/engine/huge_pages.py does the same for an aoti engine's weights).
//
// Each block holds its size class in a 64-byte header before the data, so the data stays 64-byte
// aligned and is its own context (a "simple" data pointer, as c10's own are).

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <torch/library.h>

#include <pthread.h>
#include <sys/mman.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <new>
#include <vector>

namespace kiln {
namespace {

constexpr size_t kHeader = 64;
constexpr size_t kLargest = size_t{32} << 20;
constexpr size_t kCacheBytes = size_t{256} << 20;
constexpr size_t kHugePage = size_t{2} << 20;
constexpr int kSmall = 16;                           // classes of 64, 128, .. 1024 bytes
constexpr int kClasses = kSmall + 4 * (25 - 10 + 1);  // then 4 per power of two up to 2^25

// The class of an n-byte block (0 < n <= kLargest) and its size.
int class_of(size_t n) {
  if (n <= 1024) return static_cast<int>((n + 63) / 64) - 1;
  const int k = 63 - __builtin_clzll(n - 1);  // 2^k < n <= 2^(k+1)
  const size_t step = size_t{1} << (k - 2);
  return kSmall + 4 * (k - 10) + static_cast<int>((n - 1 - (size_t{1} << k)) / step);
}

size_t size_of(int c) {
  if (c < kSmall) return 64 * static_cast<size_t>(c + 1);
  const int k = 10 + (c - kSmall) / 4, i = (c - kSmall) % 4;
  return (size_t{1} << k) + (i + 1) * (size_t{1} << (k - 2));
}

class CachingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t n) override {
    if (n == 0 || n > kLargest) {
      c10::DataPtr p = fallback->allocate(n);
      advise(p.get(), n);
      return p;
    }
    const int c = class_of(n);
    void* base = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!free_[c].empty()) {
        base = free_[c].back();
        free_[c].pop_back();
        cached_ -= size_of(c);
      }
    }
    if (base == nullptr) {
      if (posix_memalign(&base, kHeader, kHeader + size_of(c)) != 0) throw std::bad_alloc();
      advise(base, kHeader + size_of(c));
    }
    *static_cast<int*>(base) = c;
    void* data = static_cast<char*>(base) + kHeader;
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &release; }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  c10::Allocator* fallback = nullptr;  // the allocator this one replaced
  bool huge_pages = false;

  void advise(void* p, size_t n) const {
    const uintptr_t at = reinterpret_cast<uintptr_t>(p);
    const uintptr_t begin = (at + kHugePage - 1) & ~(kHugePage - 1), end = (at + n) & ~(kHugePage - 1);
    if (huge_pages && end >= begin + 2 * kHugePage) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
  }

 private:
  static void release(void* data) {
    if (data == nullptr) return;
    void* base = static_cast<char*>(data) - kHeader;
    instance().put(base, *static_cast<int*>(base));
  }

  void put(void* base, int c) {
    std::vector<void*> spill;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (cached_ + size_of(c) > kCacheBytes) {  // a workload whose sizes moved on: start over
        for (auto& blocks : free_) spill.insert(spill.end(), blocks.begin(), blocks.end()), blocks.clear();
        cached_ = 0;
      }
      free_[c].push_back(base);
      cached_ += size_of(c);
    }
    for (void* p : spill) std::free(p);
  }

 public:
  static CachingAllocator& instance() {
    static auto* a = [] {
      auto* made = new CachingAllocator();  // never destroyed: tensors may outlive static destructors
      // A fork while another thread holds the lock would leave the child's copy locked forever.
      pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                     [] { instance().mutex_.unlock(); });
      return made;
    }();
    return *a;
  }

 private:
  std::mutex mutex_;
  std::vector<void*> free_[kClasses];
  size_t cached_ = 0;
};

// Installs (or, enable=false, removes) the caching allocator as c10's CPU allocator, its large blocks
// on huge pages if huge_pages; returns whether it was installed before. Tensors keep the deleter of
// the allocator that made them, so either order of allocation and release is safe.
bool use_caching_allocator(bool enable, bool huge_pages) {
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  CachingAllocator& caching = CachingAllocator::instance();
  c10::Allocator* current = c10::GetCPUAllocator();
  const bool was = current == &caching;
  caching.huge_pages = huge_pages;
  if (enable && !was) {
    caching.fallback = current;
    c10::SetCPUAllocator(&caching, /*priority=*/0);
  } else if (!enable && was) {
    c10::SetCPUAllocator(caching.fallback, /*priority=*/0);
  }
  return was;
}

}  // namespace
}  // namespace kiln

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("use_caching_allocator(bool enable=True, bool huge_pages=False) -> bool", &kiln::use_caching_allocator);
}
