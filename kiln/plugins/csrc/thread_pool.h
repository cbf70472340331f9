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

// An engine step has ended: the idle threads spin for the next one's loops 8x spin_us instead of
// spin_us, over the host's work between steps (a few hundred microseconds at batch 1), so that the
// next step does not start by waiting for a futex wake-up.
void step_ends();

// How long an idle thread spins for the next loop before it sleeps, in microseconds.
void set_spin_us(int us);
int spin_us();

// Batch-1 decode alternates GEMVs, which stream their weights from memory on every thread, with
// serial work (norms, rotary, attention, each op's dispatch, the host between steps) while the
// pool's threads wait and the memory idles. An op that streams a weight calls weight_begins before
// it (the weight, its bytes, and the equal parts its loop's items split them into: gemm_swiglu's
// gate and up halves make 2) and weight_ends after. The calling thread learns from these which
// weight follows which; at weight_ends each waiting thread prefetches, until the next loop starts,
// the shares of the next weights (up to 4 of them, up to prefetch_bytes in all) that it will take
// (parallel_for gives thread t the t-th share of a loop first), so that its part of those GEMVs
// starts from its own cache. An op whose weights are not known ahead (a mixture of experts'
// routed experts) passes bytes 0: the fetching ahead stops there.
void weight_begins(const void* weight, int64_t bytes, int parts);
void weight_ends(const void* weight);
// The bytes each thread prefetches at a weight_ends (0: none); KILN_PREFETCH_KB sets the default, 2 MiB.
void set_prefetch_bytes(int64_t bytes);
int64_t prefetch_bytes();

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
