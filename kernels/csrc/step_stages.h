// The stages of one compiled decode step (decode_step_cpu.cpp), their units handed out to the
// team's threads as each comes for one, instead of split in fixed shares between barriers.
//
// Why not barriers: on a 2-core machine the team shares its cores with the rest of the server
// (the router, a prefill worker, Ray). A barrier waits for every thread to arrive, so a thread
// the kernel has taken off its core holds every other one for a time slice, up to ~270 times
// a step. Here a thread waits only for the units in progress: one that is off its core holds
// no unit (or one), the others take its share, and it joins at whatever stage the step has
// reached when it comes back. A thread waiting spins briefly, then yields its core.
//
// Every thread calls `run` for the same stages in the same order (what the step does depends
// on shared state only); stage k begins once every unit of stage k - 1 is done.
#pragma once

#include <sched.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace tandem_cpu {

class StepStages {
 public:
  explicit StepStages(int64_t max_stages) : next_(max_stages, 0), done_(max_stages, 0) {}

  // Each thread's place in the step.
  struct Cursor {
    int64_t stage = 0;
    int64_t last_units = 0;  // units of the stage before
  };

  // Units [0, num_units) of the cursor's stage, each to the first thread that takes it:
  // work(unit) for those this thread takes. Returns once this thread finds none left (others
  // may still be working on theirs: the next call waits for them).
  template <class Work> void run(Cursor& c, int64_t num_units, const Work& work) {
    if (c.stage > 0) wait_done(c.stage - 1, c.last_units);
    for (;;) {
      const int64_t unit = __atomic_fetch_add(&next_[c.stage], 1, __ATOMIC_RELAXED);
      if (unit >= num_units) break;
      work(unit);
      __atomic_fetch_add(&done_[c.stage], 1, __ATOMIC_RELEASE);  // its writes seen by whoever sees the count
    }
    c.last_units = num_units;
    ++c.stage;
  }

  // Waits for the last stage run (before leaving the step).
  void finish(const Cursor& c) {
    if (c.stage > 0) wait_done(c.stage - 1, c.last_units);
  }

 private:
  void wait_done(int64_t stage, int64_t units) {
    for (int spins = 0; __atomic_load_n(&done_[stage], __ATOMIC_ACQUIRE) < units; ++spins) {
      if (spins < 2000) {
#if defined(__x86_64__)
        __builtin_ia32_pause();
#endif
      } else {
        sched_yield();  // the thread we wait for may need this core
      }
    }
  }

  std::vector<int64_t> next_, done_;  // per stage: units handed out, units done
};

// Units of about `per_unit` consecutive blocks of 16 output channels over `num_blocks`, and a
// unit's range: two a thread, so a late thread still finds some left. Not more: each unit costs
// two atomics on lines both threads write and a cold start of the hardware prefetcher on its
// weights; at batch 1, where the products wait on memory, eight a thread made the step 1.16-1.25x
// slower (5 alternating rounds, same process: 6.86 against 5.49 ms), at batch 8 no different.
struct BlockUnits {
  int64_t num_blocks, per_unit;
  BlockUnits(int64_t blocks, int threads)
      : num_blocks(blocks), per_unit(std::max<int64_t>(1, blocks / (2 * threads))) {}
  int64_t count() const { return (num_blocks + per_unit - 1) / per_unit; }
  int64_t first(int64_t unit) const { return unit * per_unit; }
  int64_t end(int64_t unit) const { return std::min(num_blocks, (unit + 1) * per_unit); }
};

}  // namespace tandem_cpu
