// Kiln's own thread pool: every parallel loop of the kiln_cpp kernels (GEMM panels, attention work
// items, sampler rows) runs on it instead of OpenMP.
//
// An OpenMP parallel region splits its loop statically and ends in a barrier, so a step of a few
// hundred regions runs at the pace of its slowest thread at every one: on a shared machine a thread
// descheduled for a time slice stalls them all, while the others spin and burn the CPU it needs.
// Here a loop is cut into chunks that the caller and the pool's threads claim one at a time, each
// first from a contiguous range of its own, then from the others', so the threads that run take the
// share of one that does not, and the caller waits only for chunks already claimed, never for a
// thread to arrive. Waiters spin a bounded time
// (a few tens of microseconds: the next loop of the same step starts that soon), then sleep on a
// futex, giving the CPU to whoever needs it.
#pragma once

#include <cstdint>
#include <functional>

namespace kiln::pool {

// The number of threads a loop runs on, the caller included: torch's intra-op threads
// (at::get_num_threads()) unless set_num_threads overrides them. The pool keeps n - 1 threads of
// its own, started or stopped at the next loop when n changes.
int num_threads();
void set_num_threads(int n);  // n <= 0: follow torch again

// How a loop's chunks are handed out: claimed (the default) or statically, participant t taking
// the t-th contiguous share, as OpenMP's static schedule does (for tests and A/B measurements).
enum class Schedule { Dynamic, Static };
void set_schedule(Schedule s);
Schedule schedule();

// How long an idle thread spins for the next loop before it sleeps, in microseconds.
void set_spin_us(int us);
int spin_us();

// fn(b, e) over [begin, end) in chunks of at least `grain` items, as at::parallel_for. Runs inline
// when the range is one chunk, when called from inside a loop, or while another thread's loop
// holds the pool.
void parallel_for(int64_t begin, int64_t end, int64_t grain, const std::function<void(int64_t, int64_t)>& fn);
// The same, claimed exactly `chunk` items at a time (items sorted longest first, one per claim).
void parallel_chunks(int64_t begin, int64_t end, int64_t chunk, const std::function<void(int64_t, int64_t)>& fn);

// For its lifetime, the calling thread's OpenMP regions (ATen's ops: the GEMM's ATen tactic) run on
// num_threads() threads, whatever the thread's own setting: an engine step runs its compiled loops
// on one (kiln/engine/loader.py).
class OmpThreadsScope {
 public:
  OmpThreadsScope();
  ~OmpThreadsScope();
  OmpThreadsScope(const OmpThreadsScope&) = delete;
  OmpThreadsScope& operator=(const OmpThreadsScope&) = delete;

 private:
  int previous_;
};

}  // namespace kiln::pool
