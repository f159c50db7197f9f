// A row's argmax as torch.argmax gives it (the first index of the largest value; a NaN above
// every number, the first NaN): a vectorised scan with a running max and index per lane
// (AVX-512; float32 rows on AVX2), where ATen's argmax walks a row one element at a time.
// argmax_rows (cpu_ops.cpp) runs it over logits; quant_gemm_argmax over runs of a head's
// columns, merged with `beats`.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "vec.h"

namespace pagedllm_argmax {

using pagedllm_vec::to_float;

// Whether value v at index i goes before (best, at) in torch.argmax's order: a NaN before any
// number, then the larger, then the lower index: the one rule of every scan below, and of
// quant_gemm_argmax's merge (where the order of the runs merged makes no difference).
inline bool beats(float v, int64_t i, float best, int64_t at) {
  if (std::isnan(v) || std::isnan(best)) return std::isnan(v) && (!std::isnan(best) || i < at);
  return v > best || (v == best && i < at);
}

template <typename T>
int64_t argmax_scalar(const T* row, int64_t begin, int64_t n, float& best) {
  int64_t index = -1;
  for (int64_t i = begin; i < n; ++i) {
    const float v = to_float(row[i]);
    if (index < 0 || beats(v, i, best, index)) {
      best = v;
      index = i;
    }
  }
  return index;
}

// The lowest index holding the largest of `count` lanes' running maxima (bests, their indices
// idxs), into best.
inline int64_t best_lane(const float* bests, const int32_t* idxs, int count, float& best) {
  best = bests[0];
  int64_t index = idxs[0];
  for (int l = 1; l < count; ++l) {
    if (beats(bests[l], idxs[l], best, index)) {
      best = bests[l];
      index = idxs[l];
    }
  }
  return index;
}

// The argmax of row[0, n) from the vector loop's (best, index) over row[0, i): the tail
// scanned, a NaN handed to the scalar scan (torch's NaN rule).
template <typename T>
int64_t finish_row(const T* row, int64_t i, int64_t n, float best, int64_t index) {
  for (; i < n; ++i) {
    const float v = to_float(row[i]);
    if (v > best || std::isnan(v)) {
      if (std::isnan(v)) return argmax_scalar(row, 0, n, best);
      best = v;
      index = i;
    }
  }
  return index;
}

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// float32 rows on AVX2: two running (max, index) sets of 8 lanes, for alternate runs of 8
// values (each set's compare-and-blend waits on its last; two keep twice as many in flight).
// The scalar scan ran Gemma 3's 16 x 262,144 logits in 2 ms, a 30th of its decode step.
inline int64_t argmax_avx2(const float* row, int64_t n) {
  __m256 vbest[2] = {_mm256_loadu_ps(row), _mm256_loadu_ps(row + 8)};
  __m256i vidx[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
  __m256i cur[2] = {vidx[0], vidx[1]};
  const __m256i step = _mm256_set1_epi32(16);
  __m256 nan_seen = _mm256_or_ps(_mm256_cmp_ps(vbest[0], vbest[0], _CMP_UNORD_Q),
                                 _mm256_cmp_ps(vbest[1], vbest[1], _CMP_UNORD_Q));
  int64_t i = 16;
  for (; i + 16 <= n; i += 16) {
    for (int h = 0; h < 2; ++h) {
      cur[h] = _mm256_add_epi32(cur[h], step);
      const __m256 v = _mm256_loadu_ps(row + i + 8 * h);
      nan_seen = _mm256_or_ps(nan_seen, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      const __m256 gt = _mm256_cmp_ps(v, vbest[h], _CMP_GT_OQ);
      vbest[h] = _mm256_blendv_ps(vbest[h], v, gt);
      vidx[h] = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(vidx[h]), _mm256_castsi256_ps(cur[h]), gt));
    }
  }
  if (_mm256_movemask_ps(nan_seen)) {  // rare: let the scalar scan apply torch's NaN rule
    float best = 0.0f;
    return argmax_scalar(row, 0, n, best);
  }
  alignas(32) float bests[16];
  alignas(32) int32_t idxs[16];
  for (int h = 0; h < 2; ++h) {
    _mm256_store_ps(bests + 8 * h, vbest[h]);
    _mm256_store_si256(reinterpret_cast<__m256i*>(idxs + 8 * h), vidx[h]);
  }
  float best = 0.0f;
  const int64_t index = best_lane(bests, idxs, 16, best);
  return finish_row(row, i, n, best, index);
}
#endif

template <typename T>
int64_t argmax_row(const T* row, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16) {
    __m512 vbest = pagedllm_vec::load16(row);
    __m512i vidx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i cur = vidx;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan_seen = _mm512_cmp_ps_mask(vbest, vbest, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      cur = _mm512_add_epi32(cur, step);
      const __m512 v = pagedllm_vec::load16(row + i);
      nan_seen |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
      vbest = _mm512_mask_mov_ps(vbest, gt, v);
      vidx = _mm512_mask_mov_epi32(vidx, gt, cur);
    }
    if (nan_seen) {  // rare: let the scalar scan apply torch's NaN rule
      float best = 0.0f;
      return argmax_scalar(row, 0, n, best);
    }
    alignas(64) float bests[16];
    alignas(64) int32_t idxs[16];
    _mm512_store_ps(bests, vbest);
    _mm512_store_si512(reinterpret_cast<__m512i*>(idxs), vidx);
    float best = 0.0f;
    const int64_t index = best_lane(bests, idxs, 16, best);
    return finish_row(row, i, n, best, index);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<T, float>) {
    if (n >= 16) return argmax_avx2(row, n);
  }
#endif
  float best = 0.0f;
  return argmax_scalar(row, 0, n, best);
}

}  // namespace pagedllm_argmax
