// Splitting a kernel's work between the calling thread and XLA:CPU's thread pool.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>

#include "xla/ffi/api/ffi.h"

namespace infer_cpu {

// Splits the units into chunks that the calling thread and XLA's pool threads claim from a
// shared counter. The caller claims chunks too and waits only for chunks another thread has
// claimed and is running, so it never waits on a task still queued behind busy pool threads
// (two such products running at once on a two-thread pool would otherwise each wait for the
// other's queued half). A task that starts after every chunk is claimed returns at once; the
// shared state outlives the call for such late tasks.
struct Chunks {
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  int64_t count = 0;
  std::function<void(int64_t)> run;

  void drain() {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < count;
         c = next.fetch_add(1, std::memory_order_relaxed)) {
      run(c);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Runs run_units(first, last) over [0, units) in `chunks` chunks of consecutive units, on the
// calling thread and the pool's, and returns when all have run. With one chunk, on the caller.
inline void run_in_chunks(xla::ffi::ThreadPool& pool, int64_t units, int64_t chunks,
                          const std::function<void(int64_t, int64_t)>& run_units) {
  const int64_t helpers = std::max<int64_t>(pool.num_threads() - 1, 0);
  chunks = std::max<int64_t>(std::min(chunks, units), 1);
  if (helpers == 0 || chunks < 2) {
    run_units(0, units);
    return;
  }
  auto shared = std::make_shared<Chunks>();
  const int64_t per_chunk = (units + chunks - 1) / chunks;
  shared->count = (units + per_chunk - 1) / per_chunk;
  shared->run = [=](int64_t c) { run_units(c * per_chunk, std::min(units, (c + 1) * per_chunk)); };
  for (int64_t t = 0; t < std::min(helpers, shared->count - 1); ++t)
    pool.Schedule([shared] { shared->drain(); });
  shared->drain();
  while (shared->done.load(std::memory_order_acquire) < shared->count) _mm_pause();
}

}  // namespace infer_cpu
