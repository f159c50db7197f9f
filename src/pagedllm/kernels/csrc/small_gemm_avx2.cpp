// small_gemm in float32 with AVX2 and FMA, for CPUs without AVX-512 (AMD Zen 2/3, Intel
// Haswell to Alder Lake): the AVX-512 kernel's arithmetic on 256-bit registers.
//
// Layout [N / 16][K][16] (small_gemm.h): the 16 weights of one column group at one k are one
// 64-byte line, two __m256. Every output element is the sum over k = 0, 1, ... of
// x[r][k] * w[n][k], one FMA per term starting from 0.0, then + bias: the same operations in
// the same order as small_gemm_avx512.cpp, so both give the same bits, and a row's result
// depends on neither m, the register blocking nor the thread count.
//
// A register block of RB rows x GB groups keeps 2 * RB * GB sums in 16 ymm registers: each
// k step loads 2 * GB weight vectors and broadcasts one x value per row.

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include "parallel.h"
#include "small_gemm.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace pagedllm_gemm {

#if defined(__AVX2__) && defined(__FMA__)
namespace {

// Weight lines between the one being multiplied and the one being prefetched (as AVX-512).
constexpr int64_t AHEAD = 16;

// out[r][16j + c] (+ bias) for rows [0, RB) of x and groups [0, GB) of wg (a group is k
// lines); out has row stride n and starts at the block's first group.
template <int RB, int GB>
void block(const float* x, int64_t lda, int64_t k, const float* wg, const float* bias, float* out, int64_t n) {
  __m256 acc[RB][2 * GB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < 2 * GB; ++j) acc[r][j] = _mm256_setzero_ps();
  const int64_t gstride = k * COLS;
  for (int64_t t = 0; t < k; ++t) {
    __m256 b[2 * GB];
    for (int j = 0; j < GB; ++j) {
      const float* line = wg + j * gstride + t * COLS;
      _mm_prefetch(reinterpret_cast<const char*>(line + AHEAD * COLS), _MM_HINT_T0);
      b[2 * j] = _mm256_loadu_ps(line);
      b[2 * j + 1] = _mm256_loadu_ps(line + 8);
    }
    for (int r = 0; r < RB; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * lda + t);
      for (int j = 0; j < 2 * GB; ++j) acc[r][j] = _mm256_fmadd_ps(a, b[j], acc[r][j]);
    }
  }
  // + bias, or + 0.0 as the AVX-512 kernel does (the same bits in every case). Unrolled
  // explicitly: where GCC unrolls these loops itself it does so too late and keeps the
  // sums on the stack, storing all of them at every k step.
#pragma GCC unroll 16
  for (int j = 0; j < 2 * GB; ++j) {
    const __m256 add = bias != nullptr ? _mm256_loadu_ps(bias + 8 * j) : _mm256_setzero_ps();
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) _mm256_storeu_ps(out + r * n + 8 * j, _mm256_add_ps(acc[r][j], add));
  }
}

using Block = void (*)(const float*, int64_t, int64_t, const float*, const float*, float*, int64_t);

// block<rb, GB> for rb <= RB; null for a larger rb.
template <int RB, int GB>
Block rows_of(int rb) {
  if constexpr (RB == 0) {
    return nullptr;
  } else {
    return rb == RB ? &block<RB, GB> : rows_of<RB - 1, GB>(rb);
  }
}

// The block of exactly rb rows x gb groups, for the shapes that fit the registers
// (rb * gb <= 6: at most 12 sums, 2 * gb weights and one broadcast); else null.
Block block_of(int rb, int gb) {
  switch (gb) {
    case 1: return rows_of<6, 1>(rb);
    case 2: return rows_of<3, 2>(rb);
    case 3: return rows_of<2, 3>(rb);
    case 4: return rows_of<1, 4>(rb);
    default: return nullptr;
  }
}

struct Blocking {
  int rows;
  int groups;
};

// Measured on Zen 3 (docs/performance.md): one row takes 4 groups, 8 independent sums to
// cover the FMA latency while the weights stream from memory; a few rows 2 x 3 groups;
// from 16 rows 6 rows x 1 group, each weight vector used by 6 rows.
Blocking blocking_for(int64_t m) {
  if (m == 1) return {1, 4};
  if (m < 16) return {2, 3};
  return {6, 1};
}

}  // namespace

bool avx2_f32_built() { return true; }

// Column groups in chunks to whichever thread is free (parallel.h); within a chunk, each
// block of groups meets all rows before the next (its weights stay in L1/L2 between the row
// blocks).
void avx2_f32_gemm(const float* x, int64_t lda, int64_t m, int64_t k, const float* w, int64_t n, const float* bias,
                   float* out) {
  const int64_t groups = n / COLS;
  const Blocking blocking = blocking_for(m);
  pagedllm_parallel::parallel_chunks(groups, blocking.groups, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g += blocking.groups) {
      const int gb = static_cast<int>(std::min<int64_t>(blocking.groups, g1 - g));
      const float* wg = w + g * k * COLS;
      const float* bg = bias != nullptr ? bias + g * COLS : nullptr;
      for (int64_t r0 = 0; r0 < m; r0 += blocking.rows) {
        const int rb = static_cast<int>(std::min<int64_t>(blocking.rows, m - r0));
        const Block run = block_of(rb, gb);
        TORCH_INTERNAL_ASSERT(run != nullptr, "small_gemm: no ", rb, " x ", gb, " block");
        run(x + r0 * lda, lda, k, wg, bg, out + r0 * n + g * COLS, n);
      }
    }
  });
}

#else

bool avx2_f32_built() { return false; }
void avx2_f32_gemm(const float*, int64_t, int64_t, int64_t, const float*, int64_t, const float*, float*) {
  TORCH_CHECK(false, "small_gemm: built without AVX2 and FMA");
}

#endif

}  // namespace pagedllm_gemm
