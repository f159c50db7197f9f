// AVX2 + FMA helpers shared by the kernels' paths for CPUs without AVX-512
// (paged_attention_avx2.cpp, prefill_attention_avx2.cpp, cpu_ops.cpp): exp, soft-capping,
// lane masks, horizontal sums, a load kept in a register.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include <cstdint>

namespace pagedllm_vec {

// exp(x), Cephes' expf: x = n ln2 + r with |r| <= ln2/2 (ln2 in two parts, so r is exact),
// e^r by its degree-7 minimax polynomial, 2^n through the exponent bits. Within 1 ulp of the
// correctly rounded e^x for x in [-87.3, 88] (every 64th float there), as std::exp; x is
// clamped to that range (below it, e^x < 2^-126: a softmax term after subtracting the
// maximum that cannot change its sum).
inline __m256 exp256(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
  p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

// cap * tanh(x / cap) (Gemma 2's soft-capping); tanh(y) = sign(y) (1 - 2 / (e^2|y| + 1)).
inline __m256 softcap256(__m256 x, float cap) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 e = exp256(_mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(2.0f / cap)));
  const __m256 th = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
  return _mm256_mul_ps(_mm256_or_ps(th, _mm256_and_ps(x, sign)), _mm256_set1_ps(cap));
}

// A load kept in a register. Without the empty asm GCC folds the load into every FMA that
// uses the value (once per query vector): AVX2 code here is bound by loads (two per cycle at
// best), and the folded copies slow the dot products down.
inline __m256 load_reg(const float* p) {
  __m256 x = _mm256_loadu_ps(p);
  __asm__("" : "+x"(x));
  return x;
}

// The sums of the 8 lanes of each of a[0..3], as the 4 lanes of one vector.
inline __m128 hsum4(const __m256* a) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// Lanes [0, n) of 8 as a maskload/maskstore mask.
inline __m256i lanes(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace pagedllm_vec

#endif
