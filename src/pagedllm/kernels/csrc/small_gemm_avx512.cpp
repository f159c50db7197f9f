// small_gemm with AVX-512: bf16 linears with the AVX-512-bf16 dot product (vdpbf16ps: two
// bf16 products summed into each fp32 lane), for CPUs without the tile unit (AMD EPYC Zen 4
// and later, Intel Cooper Lake); and float32 linears with FMAs.
//
// bf16: the weight is the tile unit's layout (small_gemm.h), read as 32-bit pairs: for each
// pair j of K, the 16 columns of a group side by side, one 64-byte line — exactly one
// vdpbf16ps operand. A register block of RB rows x GB groups keeps RB * GB fp32 sums; each
// step loads GB weight lines and broadcasts one pair of each row. Every sum runs over K in
// order from zero, so the result does not depend on the blocking or the thread count.
//
// float32: layout [N / 16][K][16], 8 rows x 32 columns per register block; the same bits as
// the AVX2 kernel (small_gemm_avx2.cpp).

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "parallel.h"
#include "small_gemm.h"

namespace pagedllm_gemm {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

constexpr int MAX_RB = 6;  // rows per register block
constexpr int MAX_GB = 4;  // column groups per register block
// Rows multiplied by one group block before the next rows: x's rows stay in L2.
constexpr int64_t BLOCK_ROWS = 256;
// Weight lines (one pair step of one group each) between the one being multiplied and the
// one being prefetched, on the first pass over a group block.
constexpr int64_t AHEAD = 16;

inline __m512i pair_of(const uint16_t* row, int64_t j) {
  int32_t bits;
  std::memcpy(&bits, row + 2 * j, sizeof(bits));
  return _mm512_set1_epi32(bits);
}

// Lines of the weight stream still to be prefetched into L2 while the current block is
// multiplied: `per_step` lines every pair step until `next` reaches `end`.
struct Ahead {
  const char* next = nullptr;
  const char* end = nullptr;
  int per_step = 0;
};

// acc[r][g] = rows [0, RB) of x times groups [0, GB) of wg (each `gstride` words apart).
template <int RB, int GB>
void dp_block(const uint16_t* x, int64_t lda, int64_t pairs, const uint32_t* wg, int64_t gstride, bool prefetch,
              Ahead& ahead, __m512* out) {
  __m512 acc[RB][GB];
  for (int r = 0; r < RB; ++r)
    for (int g = 0; g < GB; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i b[GB];
    for (int g = 0; g < GB; ++g) {
      const uint32_t* line = wg + g * gstride + j * COLS;
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(line + AHEAD * COLS), _MM_HINT_T0);
      b[g] = _mm512_load_si512(line);
    }
    for (int q = 0; q < ahead.per_step && ahead.next < ahead.end; ++q, ahead.next += 64)
      _mm_prefetch(ahead.next, _MM_HINT_T1);
    for (int r = 0; r < RB; ++r) {
      const __m512i a = pair_of(x + r * lda, j);
      for (int g = 0; g < GB; ++g) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], (__m512bh)a, (__m512bh)b[g]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int g = 0; g < GB; ++g) out[r * MAX_GB + g] = acc[r][g];
}

template <int GB>
void dp_rows(int rb, const uint16_t* x, int64_t lda, int64_t pairs, const uint32_t* wg, int64_t gstride, bool prefetch,
             Ahead& ahead, __m512* out) {
  switch (rb) {
    case 1: return dp_block<1, GB>(x, lda, pairs, wg, gstride, prefetch, ahead, out);
    case 2: return dp_block<2, GB>(x, lda, pairs, wg, gstride, prefetch, ahead, out);
    case 3: return dp_block<3, GB>(x, lda, pairs, wg, gstride, prefetch, ahead, out);
    case 4: return dp_block<4, GB>(x, lda, pairs, wg, gstride, prefetch, ahead, out);
    case 5: return dp_block<5, GB>(x, lda, pairs, wg, gstride, prefetch, ahead, out);
    default: return dp_block<6, GB>(x, lda, pairs, wg, gstride, prefetch, ahead, out);
  }
}

void dp(int rb, int gb, const uint16_t* x, int64_t lda, int64_t pairs, const uint32_t* wg, int64_t gstride,
        bool prefetch, Ahead& ahead, __m512* out) {
  switch (gb) {
    case 1: return dp_rows<1>(rb, x, lda, pairs, wg, gstride, prefetch, ahead, out);
    case 2: return dp_rows<2>(rb, x, lda, pairs, wg, gstride, prefetch, ahead, out);
    case 3: return dp_rows<3>(rb, x, lda, pairs, wg, gstride, prefetch, ahead, out);
    default: return dp_rows<4>(rb, x, lda, pairs, wg, gstride, prefetch, ahead, out);
  }
}

}  // namespace

bool avx512_bf16_built() { return true; }

void avx512_bf16_groups(const Bf16Gemm& p, int64_t g0, int64_t g1, Emit& emit) {
  const uint16_t* xa = p.rows();
  const int64_t lda = p.row_stride();
  const int64_t pairs = p.k / 2;
  const int64_t gstride = pairs * COLS;  // 32-bit words per group
  const uint32_t* w = reinterpret_cast<const uint32_t*>(p.w);
  __m512 sums[MAX_RB * MAX_GB];
  for (int64_t rb = 0; rb < p.m; rb += BLOCK_ROWS) {
    const int64_t rb1 = std::min(p.m, rb + BLOCK_ROWS);
    const int64_t passes = (rb1 - rb + MAX_RB - 1) / MAX_RB;
    for (int64_t g = g0; g < g1; g += MAX_GB) {
      const int gb = static_cast<int>(std::min<int64_t>(MAX_GB, g1 - g));
      __m512 bias16[MAX_GB];
      for (int j = 0; j < gb; ++j)
        bias16[j] = p.bias != nullptr ? pagedllm_vec::load16(p.bias + (g + j) * COLS) : _mm512_setzero_ps();
      // With several passes over a group block (one per MAX_RB rows), the next block of
      // this thread's range streams into L2 during all of them, spread evenly: the memory
      // stays busy while the later passes compute from cache. (A single pass streams each
      // block as it reads it, with the short prefetch.)
      const int64_t next_gb = passes > 1 ? std::min<int64_t>(MAX_GB, g1 - g - gb) : 0;
      Ahead ahead;
      if (next_gb > 0) {
        ahead.next = reinterpret_cast<const char*>(w + (g + gb) * gstride);
        ahead.end = ahead.next + next_gb * gstride * 4;
        ahead.per_step = static_cast<int>((next_gb + passes - 1) / passes);
      }
      for (int64_t r0 = rb; r0 < rb1; r0 += MAX_RB) {
        const int rows = static_cast<int>(std::min<int64_t>(MAX_RB, rb1 - r0));
        // The range's first block was not streamed ahead: prefetch it as it is read.
        const bool first = r0 == rb && (g == g0 || rb > 0 || passes == 1);
        dp(rows, gb, xa + r0 * lda, lda, pairs, w + g * gstride, gstride, first, ahead, sums);
        emit.block(r0, rows, g, gb, sums, MAX_GB, bias16);
      }
    }
  }
}

#else

bool avx512_bf16_built() { return false; }
#if defined(__AVX512F__)
void avx512_bf16_groups(const Bf16Gemm&, int64_t, int64_t, Emit&) {
  TORCH_CHECK(false, "small_gemm: built without AVX-512-bf16");
}
#endif

#endif

#if defined(__AVX512F__)
namespace {

// out[r][16g + c] for rows r0 .. r0 + RB and column groups g .. g + GB (GB <= 2), RB <= 8.
template <int RB, int GB>
void f32_block(const float* x, int64_t lda, int64_t k, const float* w, int64_t g, const float* bias, float* out,
               int64_t n) {
  __m512 acc[RB][GB];
  for (int r = 0; r < RB; ++r)
    for (int j = 0; j < GB; ++j) acc[r][j] = _mm512_setzero_ps();
  const float* w0 = w + g * k * COLS;
  const float* w1 = w0 + k * COLS;
  for (int64_t t = 0; t < k; ++t) {
    _mm_prefetch(reinterpret_cast<const char*>(w0 + (t + 16) * COLS), _MM_HINT_T0);
    const __m512 b0 = _mm512_loadu_ps(w0 + t * COLS);
    __m512 b1 = b0;
    if constexpr (GB > 1) {
      _mm_prefetch(reinterpret_cast<const char*>(w1 + (t + 16) * COLS), _MM_HINT_T0);
      b1 = _mm512_loadu_ps(w1 + t * COLS);
    }
    for (int r = 0; r < RB; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * lda + t]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      if constexpr (GB > 1) acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
    }
  }
  for (int j = 0; j < GB; ++j) {
    const __m512 b = bias != nullptr ? _mm512_loadu_ps(bias + (g + j) * COLS) : _mm512_setzero_ps();
    for (int r = 0; r < RB; ++r) _mm512_storeu_ps(out + r * n + (g + j) * COLS, _mm512_add_ps(acc[r][j], b));
  }
}

template <int GB>
void f32_rows(int64_t rows, const float* x, int64_t lda, int64_t k, const float* w, int64_t g, const float* bias,
              float* out, int64_t n) {
  switch (rows) {
    case 1: return f32_block<1, GB>(x, lda, k, w, g, bias, out, n);
    case 2: return f32_block<2, GB>(x, lda, k, w, g, bias, out, n);
    case 3: return f32_block<3, GB>(x, lda, k, w, g, bias, out, n);
    case 4: return f32_block<4, GB>(x, lda, k, w, g, bias, out, n);
    case 5: return f32_block<5, GB>(x, lda, k, w, g, bias, out, n);
    case 6: return f32_block<6, GB>(x, lda, k, w, g, bias, out, n);
    case 7: return f32_block<7, GB>(x, lda, k, w, g, bias, out, n);
    default: return f32_block<8, GB>(x, lda, k, w, g, bias, out, n);
  }
}

}  // namespace

bool avx512_f32_built() { return true; }

// Pairs of column groups in chunks to whichever thread is free (parallel.h), 8 rows per
// register block.
void avx512_f32_gemm(const float* x, int64_t lda, int64_t m, int64_t k, const float* w, int64_t n, const float* bias,
                     float* out) {
  const int64_t groups = n / COLS;
  pagedllm_parallel::parallel_chunks((groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g = 2 * p;
      for (int64_t r0 = 0; r0 < m; r0 += 8) {
        const int64_t rows = std::min<int64_t>(8, m - r0);
        if (g + 1 < groups) {
          f32_rows<2>(rows, x + r0 * lda, lda, k, w, g, bias, out + r0 * n, n);
        } else {
          f32_rows<1>(rows, x + r0 * lda, lda, k, w, g, bias, out + r0 * n, n);
        }
      }
    }
  });
}

#else

bool avx512_f32_built() { return false; }
void avx512_f32_gemm(const float*, int64_t, int64_t, int64_t, const float*, int64_t, const float*, float*) {
  TORCH_CHECK(false, "small_gemm: built without AVX-512");
}

#endif

}  // namespace pagedllm_gemm
