// Work handed to the threads in chunks as they come free (at::parallel_for gives each thread
// one fixed range). On a shared host one of two threads often runs slower than the other (a
// neighbour on its core, a lower clock), and with a fixed split the faster one waits at the
// barrier (docs/performance.md). Every index is still run exactly once, by one call of fn
// over consecutive indices, so a result never depends on which thread ran it.
#pragma once

#include <ATen/Parallel.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <optional>
#include <utility>

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

// A step team: the threads of one parallel region held for a whole decode step
// (decoder_layers), so that a step's ~120 small matrix-vector products cost no fork/join
// each, and so that no product waits for a thread the OS has not scheduled. The first
// thread runs the step; the others wait for work (spinning: a step's products come
// microseconds apart) and claim pieces of it as they come free. Taking part is optional: the
// running thread claims pieces too, and a product ends when every piece is claimed and done,
// so a helper that is off its core (a neighbour on it) costs the step nothing, where a
// region's closing barrier waits for it (docs/performance.md, decode threads). Inside the
// team, at::parallel_for runs serially on the calling thread (an op that does not post its
// work here runs on one thread).
inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

class Team {
 public:
  explicit Team(int64_t size) : size_(size) {}

  // The threads that may take part (the poster included).
  int64_t size() const { return size_; }

  // Posts fn(begin, end) over [0, total) in pieces of whole units and runs pieces until
  // every index is claimed, then waits for the helpers' pieces to finish.
  template <typename F>
  void run(int64_t total, int64_t unit, const F& fn) {
    // Close the last job to claims before its fields change. A helper reads a job's fields
    // after its epoch; one that read the next job's here (after a last job the poster ran
    // alone) would otherwise claim "the rest" of the last one under them: run the next fn on
    // the last one's context, past its end (a protection fault in Gemma's 16-sequence batch
    // once small jobs, a norm's or a quantisation's rows, came to the team). The fields'
    // release stores and acquire loads order this close before any claim that saw them.
    const uint64_t epoch = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(((epoch - 1) << 32) | CLOSED, std::memory_order_release);
    total_.store(total, std::memory_order_release);
    unit_.store(std::max<int64_t>(unit, 1), std::memory_order_release);
    fn_.store(&call<F>, std::memory_order_release);
    ctx_.store(&fn, std::memory_order_release);
    done_.store(0, std::memory_order_relaxed);
    state_.store(epoch << 32, std::memory_order_release);
    uint64_t s = epoch << 32;
    int64_t begin = 0, end = 0;
    while (claim(s, epoch, total, unit_.load(std::memory_order_relaxed), begin, end)) {
      fn(begin, end);
      done_.fetch_add(end - begin, std::memory_order_acq_rel);
    }
    while (done_.load(std::memory_order_acquire) < total) relax();
  }

  // A helper's loop: pieces of each posted job until stop().
  void help() {
    uint64_t seen = state_.load(std::memory_order_acquire) >> 32;
    while (!stop_.load(std::memory_order_acquire)) {
      uint64_t s = state_.load(std::memory_order_acquire);
      if ((s >> 32) == seen) {
        relax();
        continue;
      }
      // Read the job, then claim pieces of it only while its epoch is still the posted one
      // (the compare-exchange fails once the poster has moved on to a later job).
      const uint64_t epoch = s >> 32;
      const int64_t total = total_.load(std::memory_order_acquire);
      const int64_t unit = unit_.load(std::memory_order_acquire);
      void (*fn)(const void*, int64_t, int64_t) = fn_.load(std::memory_order_acquire);
      const void* ctx = ctx_.load(std::memory_order_acquire);
      int64_t begin = 0, end = 0;
      while (claim(s, epoch, total, unit, begin, end)) {
        fn(ctx, begin, end);
        done_.fetch_add(end - begin, std::memory_order_acq_rel);
        s = state_.load(std::memory_order_acquire);
      }
      seen = epoch;
    }
  }

  void stop() { stop_.store(true, std::memory_order_release); }

 private:
  template <typename F>
  static void call(const void* ctx, int64_t begin, int64_t end) {
    (*static_cast<const F*>(ctx))(begin, end);
  }

  // The next piece of job `epoch` (state s, re-read on a failed claim): a share of what is
  // left, halved as the job drains (guided: the first pieces are each thread's large share,
  // the last ones small, so a thread that runs slow or starts late leaves little for the
  // others to wait on, in a handful of claims rather than one per small chunk).
  bool claim(uint64_t& s, uint64_t epoch, int64_t total, int64_t unit, int64_t& begin, int64_t& end) {
    for (;;) {
      if ((s >> 32) != epoch) return false;
      begin = static_cast<int64_t>(s & 0xffffffffu);
      if (begin >= total) return false;
      const int64_t left = (total - begin + unit - 1) / unit;
      const int64_t take = std::max<int64_t>(1, (left + size_ - 1) / size_) * unit;
      if (state_.compare_exchange_weak(s, s + static_cast<uint64_t>(take), std::memory_order_acq_rel,
                                       std::memory_order_acquire)) {
        end = std::min(total, begin + take);
        return true;
      }
    }
  }

  // A job's state once its successor is being posted: no index left to claim.
  static constexpr uint64_t CLOSED = 0xffffffffu;

  // The posted job's epoch (high 32 bits) and its next unclaimed index (low 32 bits); the
  // indices done, on a line of their own (each side writes one, the other spins on it).
  alignas(64) std::atomic<uint64_t> state_{0};
  alignas(64) std::atomic<int64_t> done_{0};
  alignas(64) std::atomic<int64_t> total_{0}, unit_{1};
  std::atomic<void (*)(const void*, int64_t, int64_t)> fn_{nullptr};
  std::atomic<const void*> ctx_{nullptr};
  std::atomic<bool> stop_{false};
  const int64_t size_;
};

// The team the calling thread runs a step for (nullptr: none).
inline Team*& current_team() {
  static thread_local Team* team = nullptr;
  return team;
}

// body() with a step team of the ATen threads: parallel_chunks inside it posts its work to
// the team. Plain body() on one thread or inside a parallel region.
template <typename Body>
auto with_team(const Body& body) -> decltype(body()) {
  if (at::in_parallel_region() || at::get_num_threads() < 2 || current_team() != nullptr) return body();
  Team team(at::get_num_threads());
  std::optional<decltype(body())> result;
  std::exception_ptr error;
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t) {
    if (begin != 0) return team.help();
    current_team() = &team;
    try {
      result.emplace(body());
    } catch (...) {
      error = std::current_exception();
    }
    current_team() = nullptr;
    team.stop();
  });
  if (error) std::rethrow_exception(error);
  return std::move(*result);
}

// fn(begin, end) over [0, total), in chunks of whole units, each chunk taken by the next
// free thread (inside a step team: posted to the team, in its guided pieces: a decode
// step's products are too small for ~16 claims a thread, docs/performance.md). Serial (one
// call) on one thread or inside another parallel region.
template <typename F>
void parallel_chunks(int64_t total, int64_t unit, const F& fn) {
  if (total <= 0) return;
  if (Team* team = current_team()) return team->run(total, unit, fn);
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

// Elementwise work below this many units (a unit: one element's plain arithmetic) runs on
// the calling thread: a hand-off to a step team waits for the helper to come round (at 16k
// units, each linear's activations quantised on both threads made SmolLM2-135M's 16-sequence
// batch ~10% slower on AVX2), a fork and join of the ATen threads costs more still (the 16 x
// 2,048 activations of a decode step's down projection quantised by a fork of two threads
// took 0.18 -> 0.20-0.23 ms for the whole product). A decode step's GELU or SiLU rows
// (16 x 1,536-2,048 exps) and its greedy argmax go to the team, its norms and quantisation not.
constexpr int64_t MIN_TEAM_UNITS = 131072;
constexpr int64_t MIN_FORK_UNITS = 262144;

// fn(begin, end) over rows [0, rows) of `per_row` units each (an elementwise op's row: its
// width, times the cost of its element where that is an exp): on the calling thread below
// the minimum above, else in parallel_chunks' chunks, which inside a step team go to the team
// (at::parallel_for there runs on one thread: Gemma-3-270M's GELU over a decode step's 16 x
// 2,048 gate values ran on one thread while the other spun).
template <typename F>
void parallel_rows(int64_t rows, int64_t per_row, const F& fn) {
  if (rows <= 0) return;
  const int64_t least = current_team() != nullptr ? MIN_TEAM_UNITS : MIN_FORK_UNITS;
  if (rows < 2 || rows * per_row < least) return fn(int64_t{0}, rows);
  parallel_chunks(rows, 1, fn);
}

}  // namespace pagedllm_parallel
