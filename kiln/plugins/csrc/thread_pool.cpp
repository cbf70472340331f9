// kiln::pool (thread_pool.h): the claim protocol, the waits, and the ops that configure the pool.
//
// A loop's chunks are cut into ranges, one per thread (one in all for parallel_chunks, whose order
// matters), each a 64-bit word: [generation 32 | front 16 | back 16], its chunks front .. back
// unclaimed. A thread claims from the front of its own range, so the chunks it runs are adjacent
// and a kernel's prefetch past a chunk's end reads what the thread runs next; then from the back
// of the others' ranges, so the threads that run take the share of one that does not. A claim is a
// compare-and-swap of the whole word: a thread that read the word of a loop that has since finished
// cannot claim a chunk of the next one, and it reads the loop's function only after a successful
// claim: the loop cannot finish, nor its caller return, before that chunk is done. The caller counts
// finished chunks (`done`), not threads.
#include "thread_pool.h"

#include <ATen/Parallel.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <torch/library.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstdlib>
#include <exception>
#include <mutex>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace kiln::pool {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint64_t kField = 0xFFFF;
constexpr int64_t kMaxChunks = kField;
constexpr int64_t kChunksPerThread = 4;  // enough that a late thread's share spreads over the others
constexpr int kStepLinger = 8;  // after step_ends, idle threads spin this many times spin_us

void futex_wait(std::atomic<uint32_t>* word, uint32_t expected) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, nullptr, nullptr, 0);
}

void futex_wake(std::atomic<uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until pred() or `us` microseconds have passed; whether pred() came true.
template <typename Pred>
bool spin_until(Pred pred, int us) {
  if (pred()) return true;
  if (us <= 0) return false;
  const auto deadline = Clock::now() + std::chrono::microseconds(us);
  for (int i = 1;; ++i) {
    if (pred()) return true;
    cpu_relax();
    if ((i & 63) == 0 && Clock::now() > deadline) return pred();
  }
}

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return (end != v && *end == '\0' && n >= 0) ? static_cast<int>(n) : fallback;
}

thread_local bool in_loop = false;

struct alignas(64) Range {  // a cache line each: threads claim from their own without contention
  std::atomic<uint64_t> word{0};
  int64_t first = 0;  // the range's chunk 0, as a chunk of the loop
};

struct Pool {
  std::mutex busy;  // one loop at a time; a second caller runs its loop inline
  std::unique_ptr<Range[]> ranges{new Range[1]};
  int capacity = 1;                // ranges allocated: the threads, the caller included
  std::atomic<int> num_ranges{1};  // the current loop's
  std::atomic<uint32_t> generation{0};  // futex the idle threads sleep on: bumped per loop
  std::atomic<uint32_t> done{0};        // futex the caller sleeps on: chunks finished
  std::atomic<int> sleepers{0};
  std::atomic<bool> caller_sleeping{false};
  std::atomic<bool> stop{false};
  std::atomic<bool> failed{false};
  std::exception_ptr error;
  // The loop, written before its word is published.
  const std::function<void(int64_t, int64_t)>* fn = nullptr;
  int64_t begin = 0, end = 0, chunk = 1;
  uint64_t chunks = 0;
  bool one_each = false;  // the static schedule: each thread takes at most one chunk
  std::vector<std::thread> threads;
  std::atomic<int> target{0};  // 0: follow torch's intra-op threads (at::get_num_threads())
  std::atomic<int> spin{env_int("KILN_SPIN_US", 50)};
  // The request weight_ends posts: the next weights (each in equal parts), new when prefetch_gen
  // moves. A thread may read fields of two requests: a prefetch never faults, and the cap bounds it.
  static constexpr int kAhead = 4;
  std::atomic<uint32_t> prefetch_gen{0};
  std::atomic<int> prefetch_count{0};
  std::atomic<const char*> prefetch_data[kAhead] = {};
  std::atomic<int64_t> prefetch_size[kAhead] = {};
  std::atomic<int> prefetch_parts[kAhead] = {};
  std::atomic<int64_t> prefetch_cap{int64_t{env_int("KILN_PREFETCH_KB", 2048)} * 1024};
  std::atomic<int> workers{0};
  // Until when (Clock ticks) idle threads spin for the next engine step (step_ends).
  std::atomic<int64_t> linger_until{0};
  std::atomic<bool> static_schedule{std::getenv("KILN_PARALLEL_SCHEDULE") != nullptr &&
                                    std::string(std::getenv("KILN_PARALLEL_SCHEDULE")) == "static"};

  // Claims and runs chunks of the current loop until none is left (or, one_each, after one); self:
  // the thread's index (the caller 0), whose range it takes first.
  void participate(int self, uint32_t& last_gen) {
    const uint32_t gen = generation.load(std::memory_order_acquire);
    if (gen == last_gen) return;
    const int home = self % std::max(1, num_ranges.load(std::memory_order_acquire));
    for (int i = 0; i < capacity; ++i) {
      const int at = (home + i) % capacity;
      Range& r = ranges[at];
      uint64_t w = r.word.load(std::memory_order_acquire);
      for (;;) {
        const uint64_t front = (w >> 16) & kField, back = w & kField;
        if (static_cast<uint32_t>(w >> 32) != gen || front >= back) break;
        const bool own = at == home;
        if (!r.word.compare_exchange_weak(w, own ? w + (1u << 16) : w - 1, std::memory_order_acq_rel,
                                          std::memory_order_acquire))
          continue;
        const int64_t b = begin + (r.first + static_cast<int64_t>(own ? front : back - 1)) * chunk, e = std::min(end, b + chunk);
        const uint64_t n = chunks;
        const bool once = one_each;  // read while the loop cannot have finished
        try {
          (*fn)(b, e);
        } catch (...) {
          if (!failed.exchange(true)) error = std::current_exception();
        }
        if (done.fetch_add(1) + 1 == n && caller_sleeping.load()) futex_wake(&done);
        if (once) {
          last_gen = gen;
          return;
        }
        w = r.word.load(std::memory_order_acquire);
      }
    }
  }

  // A thread's shares of the current prefetch request, fetched 4 KiB at a time.
  struct Prefetch {
    uint32_t gen = 0;
    int count = 0, next = 0;
    const char* at[2 * kAhead] = {};
    const char* stop[2 * kAhead] = {};

    bool step() {  // false once nothing is left
      while (next < count && at[next] >= stop[next]) ++next;
      if (next >= count) return false;
      const char* e = std::min(at[next] + 4096, stop[next]);
      for (const char* p = at[next]; p < e; p += 64) __builtin_prefetch(p, 0, 2);
      at[next] = e;
      return true;
    }
  };

  void take_prefetch(int self, Prefetch& f) {
    const uint32_t gen = prefetch_gen.load(std::memory_order_acquire);
    if (gen == f.gen) return;
    f.gen = gen;
    f.count = f.next = 0;
    int64_t budget = prefetch_cap.load();
    const int64_t n = capacity;
    for (int w = 0; w < std::clamp(prefetch_count.load(), 0, kAhead) && budget > 0; ++w) {
      const char* data = prefetch_data[w].load();
      const int parts = std::clamp(prefetch_parts[w].load(), 1, 2);
      const int64_t part = prefetch_size[w].load() / parts;
      for (int p = 0; p < parts; ++p) {
        const int64_t first = part * self / n, bytes = std::min(budget, part * (self + 1) / n - first);
        f.at[f.count] = data + p * part + first;
        f.stop[f.count++] = data + p * part + first + bytes;
        budget -= bytes;
      }
    }
  }

  void worker(int self, uint32_t seen) {  // seen: the generation before the thread's first loop
    in_loop = true;  // a loop inside a chunk runs inline
    uint32_t last_gen = 0;
    Prefetch fetch;
    fetch.gen = prefetch_gen.load();
    for (;;) {
      // Spins for the next loop, fetching the next weight meanwhile, then sleeps.
      const int us = spin.load();
      auto deadline = Clock::now() + std::chrono::microseconds(us);
      bool started = generation.load(std::memory_order_acquire) != seen;
      for (int i = 1; !started && us > 0; ++i) {
        take_prefetch(self, fetch);
        if (!fetch.step()) {
          cpu_relax();
          if ((i & 63) == 0 && Clock::now() > deadline) {
            deadline = std::max(deadline, Clock::time_point(Clock::duration(linger_until.load())));
            if (Clock::now() > deadline) break;
          }
        }
        started = generation.load(std::memory_order_acquire) != seen;
      }
      if (!started) {
        sleepers.fetch_add(1);
        if (generation.load() == seen) futex_wait(&generation, seen);
        sleepers.fetch_sub(1);
        continue;
      }
      seen = generation.load(std::memory_order_acquire);
      if (stop.load()) return;
      fetch.gen = prefetch_gen.load();  // the loop reads what is left itself, and any request before it
      fetch.count = 0;
      participate(self, last_gen);
    }
  }

  void resize(int n) {  // under `busy`
    if (static_cast<int>(threads.size()) == n - 1) return;
    stop.store(true);
    generation.fetch_add(1);
    futex_wake(&generation);
    for (auto& t : threads) t.join();
    threads.clear();
    stop.store(false);
    ranges.reset(new Range[n]);
    capacity = n;
    const uint32_t seen = generation.load();
    for (int i = 1; i < n; ++i) threads.emplace_back([this, i, seen] { worker(i, seen); });
    workers.store(n - 1);
  }

  void run(int64_t b, int64_t e, int64_t grain, bool exact, int n, const std::function<void(int64_t, int64_t)>& f) {
    resize(n);
    const int64_t items = e - b;
    one_each = static_schedule.load();
    chunk = one_each ? (items + n - 1) / n
            : exact  ? grain
                     : (items + n * kChunksPerThread - 1) / (n * kChunksPerThread);
    chunk = std::max({chunk, grain, (items + kMaxChunks - 1) / kMaxChunks});
    chunks = (items + chunk - 1) / chunk;
    fn = &f;
    begin = b;
    end = e;
    done.store(0);
    failed.store(false);
    error = nullptr;
    const uint32_t gen = generation.load() + 1;
    const int R = exact || one_each ? 1 : n;
    for (int t = 0; t < capacity; ++t) {
      const int64_t first = std::min<int64_t>(t, R) * chunks / R, last = std::min<int64_t>(t + 1, R) * chunks / R;
      ranges[t].first = first;
      ranges[t].word.store((static_cast<uint64_t>(gen) << 32) | static_cast<uint64_t>(last - first), std::memory_order_release);
    }
    num_ranges.store(R, std::memory_order_release);
    generation.store(gen, std::memory_order_release);
    if (sleepers.load() > 0) futex_wake(&generation);
    uint32_t last_gen = 0;
    participate(0, last_gen);
    const auto finished = [&] { return done.load(std::memory_order_acquire) == chunks; };
    if (!spin_until(finished, spin.load())) {
      caller_sleeping.store(true);
      for (uint32_t d = done.load(); d != chunks; d = done.load()) futex_wait(&done, d);
      caller_sleeping.store(false);
    }
    if (failed.load()) std::rethrow_exception(error);
  }
};

Pool* pool() {
  static Pool* p = [] {
    auto* created = new Pool();  // never destroyed: its threads sleep until the process exits
    // A forked child has none of the parent's threads: it forgets them and starts its own.
    pthread_atfork(nullptr, nullptr, [] {
      Pool* q = pool();
      new (&q->busy) std::mutex();
      new (new char[sizeof(std::vector<std::thread>)]) std::vector<std::thread>(std::move(q->threads));
      q->threads = std::vector<std::thread>();
      q->sleepers.store(0);
      q->workers.store(0);
      q->caller_sleeping.store(false);
    });
    return created;
  }();
  return p;
}

}  // namespace

namespace {
thread_local int scoped_threads = 0;  // the OpenMP threads of this thread before a serial-loops scope
}

int num_threads() {
  const int n = pool()->target.load();
  if (n > 0) return n;
  return scoped_threads > 0 ? scoped_threads : std::max(1, at::get_num_threads());
}

void set_num_threads(int n) { pool()->target.store(std::max(0, n)); }
void set_schedule(Schedule s) { pool()->static_schedule.store(s == Schedule::Static); }
Schedule schedule() { return pool()->static_schedule.load() ? Schedule::Static : Schedule::Dynamic; }
void set_spin_us(int us) { pool()->spin.store(std::max(0, us)); }
int spin_us() { return pool()->spin.load(); }
void step_ends() {
  Pool* p = pool();
  const auto until = Clock::now() + std::chrono::microseconds(int64_t{kStepLinger} * p->spin.load());
  p->linger_until.store(until.time_since_epoch().count());
}

void set_prefetch_bytes(int64_t bytes) { pool()->prefetch_cap.store(std::max<int64_t>(0, bytes)); }
int64_t prefetch_bytes() { return pool()->prefetch_cap.load(); }

namespace {
struct NextWeight {
  const void* data = nullptr;
  int64_t bytes = 0;
  int parts = 1;
};
// Per calling thread: an engine's step runs on one.
thread_local std::unordered_map<const void*, NextWeight> next_weight;
thread_local const void* last_weight = nullptr;
}  // namespace

void weight_begins(const void* weight, int64_t bytes, int parts) {
  if (last_weight != nullptr && last_weight != weight) {
    if (next_weight.size() >= 65536) next_weight.clear();  // engines come and go: forget theirs
    next_weight[last_weight] = {weight, bytes, parts};
  }
  last_weight = weight;
}

void weight_ends(const void* weight) {
  Pool* p = pool();
  if (p->workers.load() == 0 || p->prefetch_cap.load() == 0) return;
  int count = 0;
  for (auto it = next_weight.find(weight); count < Pool::kAhead && it != next_weight.end() && it->second.bytes > 0;
       it = next_weight.find(it->second.data), ++count) {
    p->prefetch_data[count].store(static_cast<const char*>(it->second.data));
    p->prefetch_size[count].store(it->second.bytes);
    p->prefetch_parts[count].store(it->second.parts);
  }
  if (count == 0) return;
  p->prefetch_count.store(count);
  p->prefetch_gen.fetch_add(1, std::memory_order_release);
}

namespace {

void run_loop(int64_t begin, int64_t end, int64_t grain, bool exact, const std::function<void(int64_t, int64_t)>& fn) {
  if (end <= begin) return;
  grain = std::max<int64_t>(1, grain);
  const int n = num_threads();
  if (n <= 1 || end - begin <= grain || in_loop) return fn(begin, end);
  Pool* p = pool();
  std::unique_lock<std::mutex> lock(p->busy, std::try_to_lock);
  if (!lock.owns_lock()) return fn(begin, end);
  in_loop = true;
  try {
    p->run(begin, end, grain, exact, n, fn);
  } catch (...) {
    in_loop = false;
    throw;
  }
  in_loop = false;
}

}  // namespace

void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  run_loop(begin, end, grain, false, fn);
}

void parallel_chunks(int64_t begin, int64_t end, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn) {
  run_loop(begin, end, chunk, true, fn);
}

OmpThreadsScope::OmpThreadsScope() : previous_(omp_get_max_threads()) { omp_set_num_threads(num_threads()); }
OmpThreadsScope::~OmpThreadsScope() { omp_set_num_threads(previous_); }

namespace {

void set_threads_op(int64_t n) { set_num_threads(static_cast<int>(n)); }

int64_t num_threads_op() { return num_threads(); }

void set_parallel_options_op(std::string schedule_name, int64_t spin, int64_t prefetch_kb) {
  TORCH_CHECK(schedule_name == "dynamic" || schedule_name == "static",
              "kiln_cpp::set_parallel_options: schedule must be 'dynamic' or 'static', got '", schedule_name, "'");
  set_schedule(schedule_name == "static" ? Schedule::Static : Schedule::Dynamic);
  if (spin >= 0) set_spin_us(static_cast<int>(spin));
  if (prefetch_kb >= 0) set_prefetch_bytes(prefetch_kb * 1024);
}

std::string parallel_options_op() {
  return std::string(schedule() == Schedule::Static ? "static" : "dynamic") + " spin_us=" + std::to_string(spin_us()) +
         " prefetch_kb=" + std::to_string(prefetch_bytes() / 1024);
}

// The weight that followed `weight` on this thread last time, as (address, bytes, parts); (0, 0, 0)
// if none is known (tests).
std::vector<int64_t> next_weight_op(const at::Tensor& weight) {
  const auto it = next_weight.find(weight.const_data_ptr());
  if (it == next_weight.end()) return {0, 0, 0};
  return {reinterpret_cast<int64_t>(it->second.data), it->second.bytes, it->second.parts};
}

// An engine step's scope (kiln/engine/loader.py): the compiled graph's OpenMP loops run on the
// calling thread alone, the pool keeps the thread count the caller had. Returns that count.
int64_t serial_loops_begin_op() {
  const int previous = omp_get_max_threads();
  scoped_threads = previous;
  omp_set_num_threads(1);
  return previous;
}

void serial_loops_end_op(int64_t previous) {
  step_ends();
  scoped_threads = 0;
  omp_set_num_threads(static_cast<int>(std::max<int64_t>(1, previous)));
}

}  // namespace
}  // namespace kiln::pool

TORCH_LIBRARY_FRAGMENT(kiln_cpp, m) {
  m.def("set_num_threads(int n) -> ()", &kiln::pool::set_threads_op);
  m.def("num_threads() -> int", &kiln::pool::num_threads_op);
  m.def("set_parallel_options(str schedule, int spin_us=-1, int prefetch_kb=-1) -> ()",
        &kiln::pool::set_parallel_options_op);
  m.def("next_weight(Tensor weight) -> int[]", &kiln::pool::next_weight_op);
  m.def("parallel_options() -> str", &kiln::pool::parallel_options_op);
  m.def("serial_loops_begin() -> int", &kiln::pool::serial_loops_begin_op);
  m.def("serial_loops_end(int previous) -> ()", &kiln::pool::serial_loops_end_op);
}
