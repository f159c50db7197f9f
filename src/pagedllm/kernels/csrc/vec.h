// Scalar and AVX-512 helpers shared by the kernels: bf16 <-> fp32, exp, and buffers on
// cache lines (AVX2 ones: vec_avx2.h).
#pragma once

#include <c10/util/BFloat16.h>

#include <cstddef>
#include <cstdint>
#include <new>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace pagedllm_vec {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Memory on 64-byte boundaries. A tile row or vector that straddles two cache lines costs
// two reads, and a std::vector's data is only 16-byte aligned: the kernels' scratch for the
// tile unit (small_gemm's padded rows; attention's probabilities and V tiles) lives in
// LineVectors.
template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{64})); }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
};

template <typename T>
using LineVector = std::vector<T, LineAllocator<T>>;

inline bool on_line(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 64 == 0; }

#if defined(__SSE__)
// Ask for a cached K/V line ahead of use, into L2 (T1), not L1 (T0). A decode step reads
// every context block by block from memory, and T0 prefetches need L1's few miss buffers:
// asked far enough ahead to cover the latency they found them full (the distance made no
// difference), while L2 keeps many more misses in flight (docs/performance.md).
inline void prefetch_kv(const void* p) { _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); }
#endif

}  // namespace pagedllm_vec

#if defined(__AVX512F__)
#include <immintrin.h>

namespace pagedllm_vec {

// 16 bf16 values (raw bits) as fp32: a bf16 is the upper half of its fp32.
inline __m512 from_bf16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// Lanes [0, n) of a 16-lane vector (all for n >= 16, none for n <= 0).
inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? 0xFFFF : (n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1u));
}

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  return from_bf16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// exp(x): range reduction to [-ln2/2, ln2/2], a degree-6 polynomial (error ~1e-7), and
// scalef for 2^n. x is clamped to [-104, 100]: 0 below (softmax after subtracting the max),
// +inf above.
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(100.0f)), _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16x16 transpose of 32-bit elements: r[i] lane j  ->  r[j] lane i. Always inlined: out of line
// (GCC's choice for its size) the 16 registers go through memory around every call.
__attribute__((always_inline)) inline void transpose16(__m512i* r) {
  __m512 t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(_mm512_castsi512_ps(r[2 * i]), _mm512_castsi512_ps(r[2 * i + 1]));
    t[2 * i + 1] = _mm512_unpackhi_ps(_mm512_castsi512_ps(r[2 * i]), _mm512_castsi512_ps(r[2 * i + 1]));
  }
  for (int g = 0; g < 4; ++g) {
    __m512* tt = t + 4 * g;
    __m512* uu = u + 4 * g;
    uu[0] = _mm512_shuffle_ps(tt[0], tt[2], _MM_SHUFFLE(1, 0, 1, 0));
    uu[1] = _mm512_shuffle_ps(tt[0], tt[2], _MM_SHUFFLE(3, 2, 3, 2));
    uu[2] = _mm512_shuffle_ps(tt[1], tt[3], _MM_SHUFFLE(1, 0, 1, 0));
    uu[3] = _mm512_shuffle_ps(tt[1], tt[3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int k = 0; k < 4; ++k) {
    t[k] = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
    t[4 + k] = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xdd);
    t[8 + k] = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    t[12 + k] = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xdd);
  }
  for (int k = 0; k < 4; ++k) {
    r[k] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[k], t[8 + k], 0x88));
    r[4 + k] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0x88));
    r[8 + k] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[k], t[8 + k], 0xdd));
    r[12 + k] = _mm512_castps_si512(_mm512_shuffle_f32x4(t[4 + k], t[12 + k], 0xdd));
  }
}

// cap * tanh(x / cap) (Gemma 2's soft-capping of scores); tanh(y) = sign(y) (1 - 2 / (e^2|y| + 1)).
inline __m512 softcap512(__m512 x, float cap) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp512(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(2.0f / cap)));
  const __m512 th = _mm512_sub_ps(one, _mm512_div_ps(_mm512_set1_ps(2.0f), _mm512_add_ps(e, one)));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(static_cast<int>(0x80000000u)));
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(th), sign)), _mm512_set1_ps(cap));
}

#if defined(__AVX512BF16__)
// 16 fp32 values rounded to bf16 (nearest even), as raw bits.
inline __m256i to_bf16(__m512 v) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)); }
#endif

}  // namespace pagedllm_vec
#endif
