// Work handed to the threads in chunks as they come free (at::parallel_for gives each thread
// one fixed range). On a shared host one of two threads often runs slower than the other (a
// neighbour on its core, a lower clock), and with a fixed split the faster one waits at the
// barrier (docs/performance.md). Every index is still run exactly once, by one call of fn
// over consecutive indices, so a result never depends on which thread ran it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace pagedllm_parallel {

// About this many chunks per thread: small enough pieces that a slow thread's last one costs
// little, large enough that each keeps a long front-to-back stream of weights.
constexpr int64_t CHUNKS_PER_THREAD = 16;

// Chunk size for `total` indices taken `unit` at a time (a chunk is a whole number of units).
inline int64_t chunk_size(int64_t total, int64_t unit, int64_t threads) {
  unit = std::max<int64_t>(unit, 1);
  const int64_t units = std::max<int64_t>(1, total / (unit * std::max<int64_t>(threads, 1) * CHUNKS_PER_THREAD));
  return units * unit;
}

// fn(begin, end) over [0, total), in chunks of whole units, each chunk taken by the next
// free thread. Serial (one call) on one thread or inside a parallel region.
template <typename F>
void parallel_chunks(int64_t total, int64_t unit, const F& fn) {
  if (total <= 0) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t chunk = chunk_size(total, unit, threads);
  const int64_t chunks = (total + chunk - 1) / chunk;
  const int64_t workers = std::min(threads, chunks);
  if (workers <= 1) {
    fn(int64_t{0}, total);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1, std::memory_order_relaxed); c < chunks;
         c = next.fetch_add(1, std::memory_order_relaxed))
      fn(c * chunk, std::min(total, (c + 1) * chunk));
  });
}

}  // namespace pagedllm_parallel
