// quant_gemm: linears on GGUF block-quantized weights kept as stored (one copy, no float
// weight; the formats: quant_formats.h). Up to int_max_rows() rows (decode steps; and
// prompts, where that has no limit) the products are integer: activations quantised per
// 32-block on the fly, xq = round(x * 127 / max|x|) in
// int8, dx = max|x| / 127; then per weight row n and block b
//   sum_i w[i] x[i] ~ dx scale_b (dot(q, xq) - offset_b sum(xq)) + min_b dx sum(xq)
// with the dot products in int32 and the scales applied in float, eight blocks (one group,
// a K-quant super-block) at a time. Q8_0 weights take int16 activations instead (wide_gemm
// below: int8 ones were the whole of Q8_0's error), unless their code carries
// INT8_ACTIVATIONS (a Q8_0 tensor among lower-bit ones: kernels/quant.py's
// int8_for_q8_0). More rows go to quant_tiles.cpp: tiles of the weight dequantised into
// small_gemm's layout and multiplied there (int_max_rows: bf16 on the tile unit or without
// AVX-512-VNNI, and Q8_0's int16 activations).
//
// The routes differ only in how a block's 32 u8 x s8 products are summed into eight int32
// lanes (lane l: elements 4l..4l+3): AVX2 maddubs + madd, or one dpbusd (AVX-512-VNNI on
// 256-bit registers, or AVX-VNNI); they give the same sums, so the same bits. Q8_0's signed
// weights take the sign trick (|q| times x with q's sign), in the VNNI tiles q + 128 less 128
// sum(x) (q8_0_offset), in the AVX2 lane kernel |x| times q with x's sign (StoredQ8_0Tile), so
// that every route multiplies unsigned bytes by signed ones.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "argmax.h"
#include "dispatch.h"
#include "parallel.h"
#include "quant_formats.h"
#include "small_gemm.h"

namespace pagedllm_quant {
namespace {

// Activation rows that share one pass over a weight row (register block).
constexpr int ROW_BLOCK = 4;
// How far ahead of a weight row its bytes' lines are prefetched (into L1) while the row is
// multiplied: a decode step streams every weight from memory once, and the hardware
// prefetcher alone left the integer work waiting on it. A distance in bytes, not rows: four
// rows ahead (the first choice) was 1.4 KB for SmolLM2's rows but 3.8 KB for its down
// projection's and 16 KB for Qwen's. One thread on a busy machine measured 1-1.5 KB best;
// two threads on a quiet one (the decode step) 2 KB: 2-8% faster per linear than 1 KB, 3-4
// KB slower again (docs/performance.md, quantized weights); 4 KB level with 2 KB on Qwen's
// decode step. The row kernels, the tiles' staging and the int16 kernels all prefetch so.
constexpr int64_t PREFETCH_BYTES = 2048;

// The routes, best first; a route runs only where it is built (-march=native: the CPU has it).
enum class Route { avx512_vnni = 0, avx_vnni = 1, avx2 = 2, none = 3 };

const char* route_name(Route route) {
  switch (route) {
    case Route::avx512_vnni: return "avx512_vnni";
    case Route::avx_vnni: return "avx_vnni";
    case Route::avx2: return "avx2";
    default: return "none";
  }
}

bool built(Route route) {
  switch (route) {
#if defined(QUANT_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case Route::avx512_vnni: return true;
#endif
#if defined(QUANT_AVX2) && defined(__AVXVNNI__)
    case Route::avx_vnni: return true;
#endif
#if defined(QUANT_AVX2)
    case Route::avx2: return true;
#endif
    default: return false;
  }
}

// The best route allowed: tests lower the cap to run a slower route on a CPU with a faster one.
std::atomic<int>& route_cap() {
  static std::atomic<int> cap{0};
  return cap;
}

Route current_route() {
  for (int i = route_cap().load(); i < static_cast<int>(Route::none); ++i)
    if (built(static_cast<Route>(i))) return static_cast<Route>(i);
  return Route::none;
}

std::string quant_gemm_isa() { return route_name(current_route()); }

// Caps the route at `isa` ("avx512_vnni", "avx_vnni", "avx2" or "none"); returns the previous cap.
std::string set_quant_gemm_isa(const std::string& isa) {
  for (int i = 0; i <= static_cast<int>(Route::none); ++i)
    if (isa == route_name(static_cast<Route>(i))) return route_name(static_cast<Route>(route_cap().exchange(i)));
  TORCH_CHECK(false, "set_quant_gemm_isa: unknown ISA '", isa, "' (avx512_vnni, avx_vnni, avx2, none)");
}

// Activations quantised per block: xq (Q: int8, or int16 for Q8_0 weights); per block dx,
// and for int8 sx = dx sum(xq), the sum of xq and that of its first 16. Row by row
// (quantize_rows: xq [rows, k], the per-block values rows * blocks then GROUP zeros, so that
// a last partial group reads whole vectors) or rows in lanes (quantize_lanes, below). One set per
// thread and layout, reused from call to call.
template <typename Q>
struct QuantizedRows {
  static constexpr bool narrow = std::is_same_v<Q, int8_t>;  // sx, sum and first16 kept
  std::vector<Q> xq;
  std::vector<float> dx, sx;
  std::vector<int32_t> sum, first16;

  // Sized for `blocks` blocks (xq unfilled) and n >= blocks per-block values, those from
  // `blocks` on zero: every block's are written after, so they are not filled first.
  void size(int64_t blocks, int64_t n) {
    xq.resize(blocks * BLOCK);
    zero_past(dx, blocks, n);
    if constexpr (narrow) {
      zero_past(sx, blocks, n);
      zero_past(sum, blocks, n);
      zero_past(first16, blocks, n);
    }
  }

  // Block i's per-block values those of a block of zeros.
  void clear(int64_t i) {
    dx[i] = 0.f;
    if constexpr (narrow) {
      sx[i] = 0.f;
      sum[i] = 0;
      first16[i] = 0;
    }
  }

 private:
  template <typename V>
  static void zero_past(V& v, int64_t used, int64_t n) {
    v.resize(n);
    std::fill(v.begin() + used, v.end(), typename V::value_type{});
  }
};
using Activations = QuantizedRows<int8_t>;

#if defined(QUANT_AVX2)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// One block's 32 values as floats in f, and the largest magnitude among them.
template <typename T>
float load_block(const T* v, __m256 f[4]) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 amax = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    f[j] = load8(v + 8 * j);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[j]));
  }
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// One block: xq rounded to nearest even (cvtps under the default rounding mode), as
// nearbyint would.
template <typename T>
void quantize_block(const T* v, int8_t* xq, Activations& a, int64_t i) {
  __m256 f[4];
  const float top = load_block(v, f);
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
  __m256i q[4];
  for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(f[j], inv));
  const int32_t first = hsum_epi32(_mm256_add_epi32(q[0], q[1]));
  const int32_t sum = first + hsum_epi32(_mm256_add_epi32(q[2], q[3]));
  // packs work within 128-bit lanes: put the 4-byte pieces back in element order.
  const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq),
                      _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  a.dx[i] = top / 127.f;
  a.sx[i] = a.dx[i] * static_cast<float>(sum);
  a.sum[i] = sum;
  a.first16[i] = first;
}
#endif

// An activation value's quantisation (or its move into lanes) in parallel_rows' units: a
// prompt's rows on one thread left the other waiting ~5% of a Gemma-3-270M prompt step.
constexpr int64_t QUANTIZE_UNITS = 2;

// fn(begin, end) over x's blocks, whole rows of them at a time, in parallel (parallel_rows).
template <typename F>
void row_blocks(const at::Tensor& x, const F& fn) {
  const int64_t blocks = x.size(1) / BLOCK;
  pagedllm_parallel::parallel_rows(x.size(0), x.size(1) * QUANTIZE_UNITS,
                                   [&](int64_t r0, int64_t r1) { fn(r0 * blocks, r1 * blocks); });
}

// Where the sums go: [rows, n] in x's dtype, the bias (float32) added in float32 and the sum
// then rounded once to bf16, as out.add_(bias) and out.to(bf16) on a float32 result would
// (without that result's allocation and copy, a real share of a decode step's small products).
// data holds columns [col0, col0 + n) (quant_gemm_argmax: a run of a head's columns).
struct Output {
  void* data;
  bool bf16;
  const float* bias;  // nullptr: none
  int64_t n;
  int64_t col0 = 0;

  int64_t at(int64_t r, int64_t col) const { return r * n + col - col0; }
  void store(int64_t r, int64_t col, float v) const {
    if (bias != nullptr) v += bias[col];
    if (bf16) {
      static_cast<c10::BFloat16*>(data)[at(r, col)] = c10::BFloat16(v);
    } else {
      static_cast<float*>(data)[at(r, col)] = v;
    }
  }
};


#if defined(QUANT_AVX2)
// acc + eight int32 sums of four u8 x s8 products each.
template <Route R>
inline __m256i dot_u8s8(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (R == Route::avx512_vnni) return _mm256_dpbusd_epi32(acc, u, s);
#endif
#if defined(__AVXVNNI__)
  if constexpr (R == Route::avx_vnni) return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
  // maddubs's int16 pair sums cannot saturate: q <= 128 (|Q8_0|) or 63, |xq| <= 127.
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// How many dwords of products the AVX2 kernels add in int16 before one madd widens them (1: a
// madd each, as dot_u8s8; the lane kernel adds dwords of rows in lanes, halves8 pairs of a
// block's). A dword's maddubs pair sums are at most 2 * qmax * 127: four fit in int16 for
// weights up to 31 (Q4_*, Q5_*: 31,496), two for Q6_K's 63 (32,004), one for Q8_0's 128. The
// same int32 sums, so the same bits; VNNI's dpbusd needs none of this.
template <Route R, Format F>
constexpr int int16_chain() {
  if (R != Route::avx2 || F == Format::q8_0) return 1;
  return F == Format::q6_k ? 2 : 4;
}

// One block's 32 products with xq as lane sums: eight int32 sums of four products
// (dot_u8s8), or on AVX2 where int16_chain() > 1 maddubs's sixteen int16 pair sums, which
// halves8 adds further in int16 before it widens them.
template <Route R, Format F>
inline __m256i block_dot(__m256i w, const int8_t* xq) {
  __m256i u = w, x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  if constexpr (F == Format::q8_0) {
    x = _mm256_sign_epi8(x, w);
    u = _mm256_sign_epi8(w, w);
  }
  if constexpr (int16_chain<R, F>() > 1) return _mm256_maddubs_epi16(u, x);
  return dot_u8s8<R>(_mm256_setzero_si256(), u, x);
}

// hadd_epi32(a, b) for lane sums that fit in int16 (|sum| <= 4 * 63 * 127 but for Q8_0's):
// packed to int16 and pair-summed by madd, one shuffle where hadd takes two (the shuffle port
// is what the eight-block reduction waits on). Not on the AVX2 route: there maddubs + madd
// already load the multiply ports that madd would take (576-wide Q4_1 measured 7-11% slower).
inline __m256i hadd_small(__m256i a, __m256i b) {
  return _mm256_madd_epi16(_mm256_packs_epi32(a, b), _mm256_set1_epi16(1));
}

// Eight blocks' lane sums (block j's in s[j], as block_dot gives them) as two vectors: the
// sums over each block's first 16 elements (block j in lane j) and over its last 16. On AVX2
// the pair sums are added in int16 as far as int16_chain() allows (a chain of four: two
// hadd16 and a madd where eight madd and four more hadd32 were).
template <Route R, Format F>
inline void halves8(const __m256i s[GROUP], __m256i& first, __m256i& last) {
  constexpr int chain = int16_chain<R, F>();
  const __m256i ones = _mm256_set1_epi16(1);
  auto pairs = [&](__m256i a, __m256i b) {
    if constexpr (chain == 2) return _mm256_madd_epi16(_mm256_hadd_epi16(a, b), ones);
    // Q8_0: |q| up to 128, no int16.
    if constexpr (F == Format::q8_0 || R == Route::avx2) return _mm256_hadd_epi32(a, b);
    return hadd_small(a, b);
  };
  auto quads = [&](int j) {
    if constexpr (chain == 4) {
      const __m256i t0 = _mm256_hadd_epi16(s[j], s[j + 1]), t1 = _mm256_hadd_epi16(s[j + 2], s[j + 3]);
      return _mm256_madd_epi16(_mm256_hadd_epi16(t0, t1), ones);
    }
    return _mm256_hadd_epi32(pairs(s[j], s[j + 1]), pairs(s[j + 2], s[j + 3]));
  };
  // u0's low 128 bits: blocks 0-3 over their first 16 elements; its high 128 bits: the last 16.
  const __m256i u0 = quads(0), u1 = quads(4);
  first = _mm256_permute2x128_si256(u0, u1, 0x20);
  last = _mm256_permute2x128_si256(u0, u1, 0x31);
}

inline __m256 half8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }

// A group's weight-side scales, eight lanes (lane j: block j; lanes past `count` zero):
// d (the block scale; Q6_K: of the first 16 weights) and m (Q4_1's minimum, a K-quant's
// dmin mn; Q6_K: the scale of the last 16 weights).
struct GroupScales {
  __m256 d, m;
};

template <Format F>
inline GroupScales group_scales(const Layout& l, const uint8_t* row, int64_t g, int count) {
  if constexpr (F == Format::q4_k || F == Format::q5_k) {
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + l.sc + 8 * g))));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + l.mn + 8 * g))));
    return {_mm256_mul_ps(_mm256_set1_ps(half(row + l.d + 2 * g)), sc),
            _mm256_mul_ps(_mm256_set1_ps(half(row + l.dmin + 2 * g)), mn)};
  } else if constexpr (F == Format::q6_k) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + l.sc + 16 * g));
    const __m256 d = _mm256_set1_ps(half(row + l.d + 2 * g));
    return {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
            _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))))};
  } else {
    if (count == GROUP) {
      const __m256 d = half8(row + l.d + 16 * g);
      return {d, F == Format::q4_1 ? half8(row + l.m + 16 * g) : _mm256_setzero_ps()};
    }
    if (l.blocks() >= GROUP) {
      // A last group of `count` blocks: the row's last eight scales moved down to lanes
      // 0..count-1, the lanes past them zero.
      const int64_t last = l.blocks() - GROUP;
      const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
      const __m256i from = _mm256_add_epi32(lane, _mm256_set1_epi32(GROUP - count));
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(count), lane));
      const __m256 d = _mm256_and_ps(_mm256_permutevar8x32_ps(half8(row + l.d + 2 * last), from), keep);
      if constexpr (F != Format::q4_1) return {d, _mm256_setzero_ps()};
      return {d, _mm256_and_ps(_mm256_permutevar8x32_ps(half8(row + l.m + 2 * last), from), keep)};
    }
    alignas(32) float d[GROUP] = {}, m[GROUP] = {};
    for (int j = 0; j < count; ++j) {
      d[j] = half(row + l.d + 2 * (g * GROUP + j));
      if constexpr (F == Format::q4_1) m[j] = half(row + l.m + 2 * (g * GROUP + j));
    }
    return {_mm256_load_ps(d), _mm256_load_ps(m)};
  }
}

// acc + the float terms of eight (row, block) products, lane by lane: first and last their
// int32 sums over the block's first and last 16 values (any split of the sum but for Q6_K,
// whose halves have scales of their own), d and m the weight's scales (GroupScales), the
// activations' per-block values the eight entries of `a` from `at` (Q8_0 reads dx only). The
// row kernels (a lane: one of a group's blocks) and the lane kernels (a lane: one of eight
// rows) both end here, so a product's float work is the same whichever kernel ran it.
// Staged: Q8_0's bytes were multiplied as q + 128 (q8_0_offset, the int8 tiles).
template <Format F, bool Staged = false>
constexpr int offset_shift() {
  return F == Format::q4_0 ? 3 : F == Format::q5_0 ? 4 : F == Format::q8_0 && Staged ? 7 : 0;
}

// The term of eight blocks' int32 sums (at `at`) for weights stored unsigned as q + 2^shift:
// less 2^shift times the block's activation sum (zero for the other formats).
template <Format F, bool Staged = false, typename Q>
inline __m256i block_offset(const QuantizedRows<Q>& a, int64_t at) {
  constexpr int shift = offset_shift<F, Staged>();
  if constexpr (shift == 0) {
    return _mm256_setzero_si256();
  } else {
    const __m256i sum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sum.data() + at));
    return _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(sum, shift));
  }
}

// acc + the float terms of eight blocks' whole int32 sums `total` (offset included), lane by
// lane; not Q6_K (add_block_terms).
template <Format F, typename Q>
inline __m256 add_block_total(__m256 acc, __m256i total, __m256 d, __m256 m, const QuantizedRows<Q>& a, int64_t at) {
  static_assert(F != Format::q6_k, "Q6_K's halves take scales of their own");
  const __m256 dx = _mm256_loadu_ps(a.dx.data() + at);
  acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), _mm256_mul_ps(d, dx), acc);
  if constexpr (F == Format::q4_1) acc = _mm256_fmadd_ps(m, _mm256_loadu_ps(a.sx.data() + at), acc);
  if constexpr (F == Format::q4_k || F == Format::q5_k) acc = _mm256_fnmadd_ps(m, _mm256_loadu_ps(a.sx.data() + at), acc);
  return acc;
}

template <Format F, bool Staged = false, typename Q>
inline __m256 add_block_terms(__m256 acc, __m256i first, __m256i last, __m256 d, __m256 m,
                              const QuantizedRows<Q>& a, int64_t at) {
  if constexpr (F == Format::q6_k) {
    auto load_int = [](const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
    const __m256 dx = _mm256_loadu_ps(a.dx.data() + at);
    // q - 32 in each half: subtract 32 times the half's activation sum.
    const __m256i sum = load_int(a.sum.data() + at), first16 = load_int(a.first16.data() + at);
    first = _mm256_sub_epi32(first, _mm256_slli_epi32(first16, 5));
    last = _mm256_sub_epi32(last, _mm256_slli_epi32(_mm256_sub_epi32(sum, first16), 5));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), _mm256_mul_ps(d, dx), acc);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(last), _mm256_mul_ps(m, dx), acc);
  } else {
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(first, last), block_offset<F, Staged>(a, at));
    return add_block_total<F>(acc, total, d, m, a, at);
  }
}

// acc += one activation row's products with a group (s: its blocks' lane sums; i: the
// group's first block in the activations).
template <Route R, Format F>
inline __m256 accumulate(__m256 acc, const __m256i s[GROUP], const GroupScales& w, const Activations& a, int64_t i) {
  __m256i first, last;
  halves8<R, F>(s, first, last);
  return add_block_terms<F>(acc, first, last, w.d, w.m, a, i);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc[r] += activation row r0 + r's products with group g of weight row `row` (`count`
// blocks: a constant 8 in the loop over whole groups, so that it unrolls).
template <Route R, Format F, int RB>
__attribute__((always_inline)) inline void group_step(const Layout& l, const uint8_t* row, int64_t g, int count,
                                                      const Activations& a, int64_t r0, __m256 acc[RB]) {
  const int64_t blocks = l.blocks();
  __m256i q[GROUP];
  load_group<F>(l, row, g, count, q);
  const GroupScales scales = group_scales<F>(l, row, g, count);
  const int8_t* xq = a.xq.data() + r0 * l.k + g * GROUP * BLOCK;
  for (int r = 0; r < RB; ++r) {
    __m256i s[GROUP];
    for (int j = 0; j < GROUP; ++j)
      s[j] = j < count ? block_dot<R, F>(q[j], xq + r * l.k + j * BLOCK) : _mm256_setzero_si256();
    acc[r] = accumulate<R, F>(acc[r], s, scales, a, (r0 + r) * blocks + g * GROUP);
  }
}

// The lines PREFETCH_BYTES past the start of weight row n (none past the weight's end).
// Always inlined, as RowsPrefetch::part (below), or GCC may drop its calls.
__attribute__((always_inline)) inline void prefetch_ahead(const Weight& w, int64_t n) {
  const int64_t ahead = n * w.lay.bytes + PREFETCH_BYTES, end = w.n * w.lay.bytes;
  for (int64_t i = 0; i < std::min(w.lay.bytes, end - ahead); i += 64)
    _mm_prefetch(reinterpret_cast<const char*>(w.data + ahead + i), _MM_HINT_T0);
}

// Weight row n a group of blocks at a time: step(row, g, count) for the whole groups, then the
// tail, after prefetching the lines PREFETCH_BYTES ahead.
template <typename Step>
__attribute__((always_inline)) inline void row_groups(const Weight& w, int64_t n, Step step) {
  const int64_t blocks = w.lay.blocks(), whole = blocks / GROUP;
  const int tail = static_cast<int>(blocks % GROUP);
  const uint8_t* row = w.row(n);
  prefetch_ahead(w, n);
  for (int64_t g = 0; g < whole; ++g) step(row, g, GROUP);
  if (tail > 0) step(row, whole, tail);
}

// out[r][n] for activation rows [r0, r0 + RB) and weight rows [n0, n1): each group of a
// weight row is loaded once for the RB rows.
template <Route R, Format F, int RB>
void row_block(const Weight& w, const Activations& a, int64_t r0, int64_t n0, int64_t n1, const Output& out) {
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    // Every format prefetches: a decode step streams its weights from memory, where Qwen's
    // (Q5_0 and Q6_K rows) ran 15-17% faster so (Zen 4, 2 threads, AVX2 and AVX-512) and
    // Gemma's head 5.45 -> 4.80 ms a row. On a weight already in L3 the prefetches cost
    // 10-14% (Q5_0 4864 x 896, one row), but no real model's weights stay there.
    row_groups(w, n, [&](const uint8_t* row, int64_t g, int count) __attribute__((always_inline)) {
      group_step<R, F, RB>(w.lay, row, g, count, a, r0, acc);
    });
    for (int r = 0; r < RB; ++r) out.store(r0 + r, n, hsum(acc[r]));
  }
}

template <Route R, Format F>
void weight_rows(const Weight& w, const Activations& a, int64_t rows, int64_t n0, int64_t n1, const Output& out) {
  int64_t r0 = 0;
  for (; r0 + ROW_BLOCK <= rows; r0 += ROW_BLOCK) row_block<R, F, ROW_BLOCK>(w, a, r0, n0, n1, out);
  for (; r0 + 2 <= rows; r0 += 2) row_block<R, F, 2>(w, a, r0, n0, n1, out);
  if (r0 < rows) row_block<R, F, 1>(w, a, r0, n0, n1, out);
}

// ---- Q8_0 weights on int16 activations (wide_gemm). 8-bit weights leave the activations'
// int8 rounding as the whole error (~0.7% a product on SmolLM2, compounding over its 30
// layers to 96.8% top-1 agreement with the float model; docs/performance.md, quality). Per
// 32-block xq = round(x * 32767 / max|x|) in int16, dx = max|x| / 32767; a block's product
// is the int32 sum of q (sign-extended to int16) times xq: madd (AVX2) or dpwssd (VNNI),
// the same sums on every route. |q| <= 128 and |xq| <= 32767: a block's sum stays below
// 2^28. The weight bytes read are those of the int8 route; the integer work doubles.
using WideActivations = QuantizedRows<int16_t>;  // xq and dx only

template <typename T>
void quantize_block(const T* v, int16_t* xq, WideActivations& a, int64_t i) {
  __m256 f[4];
  const float top = load_block(v, f);
  const __m256 inv = _mm256_set1_ps(top > 0.f ? 32767.f / top : 0.f);
  for (int j = 0; j < 4; j += 2) {
    const __m256i q0 = _mm256_cvtps_epi32(_mm256_mul_ps(f[j], inv));
    const __m256i q1 = _mm256_cvtps_epi32(_mm256_mul_ps(f[j + 1], inv));
    // packs works within 128-bit lanes: 64-bit pieces back in element order.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(q0, q1), _MM_SHUFFLE(3, 1, 2, 0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + 8 * j), packed);
  }
  a.dx[i] = top / 32767.f;
}


// acc + the eight int32 sums of two int16 pairs each.
template <Route R>
inline __m256i dot_s16(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (R == Route::avx512_vnni) return _mm256_dpwssd_epi32(acc, w, x);
#endif
#if defined(__AVXVNNI__)
  if constexpr (R == Route::avx_vnni) return _mm256_dpwssd_avx_epi32(acc, w, x);
#endif
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
}

template <Route R, int RB>
__attribute__((always_inline)) inline void wide_group_step(const Layout& l, const uint8_t* row, int64_t g, int count,
                                                           const WideActivations& a, int64_t r0, __m256 acc[RB]) {
  const int64_t blocks = l.blocks();
  __m256i q[2 * GROUP];
  for (int j = 0; j < count; ++j) {
    const uint8_t* p = row + (g * GROUP + j) * BLOCK;
    q[2 * j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    q[2 * j + 1] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  }
  const __m256 d = group_scales<Format::q8_0>(l, row, g, count).d;
  for (int r = 0; r < RB; ++r) {
    const int16_t* xq = a.xq.data() + (r0 + r) * l.k + g * GROUP * BLOCK;
    __m256i s[GROUP];
    for (int j = 0; j < GROUP; ++j) {
      s[j] = _mm256_setzero_si256();
      if (j >= count) continue;
      const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * BLOCK));
      const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + j * BLOCK + 16));
      s[j] = dot_s16<R>(dot_s16<R>(s[j], q[2 * j], x0), q[2 * j + 1], x1);
    }
    __m256i first, last;
    halves8<R, Format::q8_0>(s, first, last);  // 32-bit pair sums: a block's reach 2^28
    acc[r] = add_block_terms<Format::q8_0>(acc[r], first, last, d, _mm256_setzero_ps(), a, (r0 + r) * blocks + g * GROUP);
  }
}

template <Route R, int RB>
void wide_row_block(const Weight& w, const WideActivations& a, int64_t r0, int64_t n0, int64_t n1, const Output& out) {
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    row_groups(w, n, [&](const uint8_t* row, int64_t g, int count) __attribute__((always_inline)) {
      wide_group_step<R, RB>(w.lay, row, g, count, a, r0, acc);
    });
    for (int r = 0; r < RB; ++r) out.store(r0 + r, n, hsum(acc[r]));
  }
}

template <Route R>
void wide_rows(const Weight& w, const WideActivations& a, int64_t rows, int64_t n0, int64_t n1, const Output& out) {
  int64_t r0 = 0;
  for (; r0 + ROW_BLOCK <= rows; r0 += ROW_BLOCK) wide_row_block<R, ROW_BLOCK>(w, a, r0, n0, n1, out);
  for (; r0 + 2 <= rows; r0 += 2) wide_row_block<R, 2>(w, a, r0, n0, n1, out);
  if (r0 < rows) wide_row_block<R, 1>(w, a, r0, n0, n1, out);
}

// ---- Eight rows or more: rows in lanes. The row kernels above end each (row, block) product
// in eight int32 lanes that must be summed across (halves8), per activation row: at 16 rows
// that reduction is most of the work. Here eight activation rows share a vector instead, lane
// r holding row r's dword (four int8 or two int16 values) at one place of a block: a weight
// dword broadcast to every lane multiplies eight rows at once, and each lane's sum is its own
// row's, with nothing to sum across. The float work is the row kernels' operations per (row,
// block) in their order (block j of a group in accumulator j, the last sum in hsum's order),
// so a row gets the same bits whichever rows share its call.
//
// int8 activations: a block's (eight vectors a row group) are held in registers while
// LANE_TILE staged weight rows pass them (lane_tiles). Loaded anew for every dot product (a
// weight row at a time) the loads, not the dot products, bounded the loop (Zen 4: 3.5 of the
// 6.9 dpbusd a ns a core that dot_peak.py measures, ~2.2 where the activations outgrew L1, as
// at K = 4864). int16 ones (Q8_0's wide route) still go a weight row at a time
// (wide_lane_rows): their block is sixteen vectors a row group, every register for two, and
// staged with a block's halves in turn they measured faster only on weights in L3, not on the
// heads a step streams from memory (docs/performance.md).
constexpr int LANES = 8;
#if defined(__AVX512F__)
constexpr int LANE_VECTORS = 2;  // 32 vector registers: two int8 row groups share each broadcast
#else
constexpr int LANE_VECTORS = 1;
#endif
// Weight rows multiplied by one block's activations before the next block.
constexpr int LANE_TILE = 16;

// Whether a call's activations are laid in lanes (quantize_lanes), not row by row.
constexpr bool in_lanes(int64_t rows) { return rows >= LANES; }

// x [rows, k] quantised into rows-in-lanes activations t, padded with zero rows to whole
// groups of LANES: xq [row group][block][dword][lane], the per-block values [row
// group][block][lane]. quantize(r, b, q, at) quantises row r's block b into q (L1) and its
// per-block values into t at `at`; a group's block is then stored as an 8 x 8 transpose of
// its rows' dwords (two for int16). Quantised row by row into memory, then moved to the lanes
// a dword at a time after a zero fill, the two passes took 11.5% of Gemma-3-270M's prompt
// samples (native), 2.9% so.
template <typename Q, typename Quantize>
void quantize_in_lanes(const at::Tensor& x, QuantizedRows<Q>& t, const Quantize& quantize) {
  constexpr int squares = BLOCK * sizeof(Q) / (4 * LANES);  // 8 x 8 dword squares a block
  const int64_t rows = x.size(0), k = x.size(1), blocks = k / BLOCK;
  const int64_t groups = (rows + LANES - 1) / LANES, slots = groups * blocks * LANES;
  t.size(slots, slots);  // every slot is written below
  pagedllm_parallel::parallel_rows(groups, LANES * k * QUANTIZE_UNITS, [&](int64_t g0, int64_t g1) {
    alignas(32) Q q[LANES][BLOCK];
    for (int64_t g = g0; g < g1; ++g) {
      const int real = static_cast<int>(std::min<int64_t>(LANES, rows - g * LANES));
      for (int l = real; l < LANES; ++l) std::memset(q[l], 0, sizeof(q[l]));  // a row of zeros
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t slot = (g * blocks + b) * LANES;
        for (int l = 0; l < real; ++l) quantize(g * LANES + l, b, q[l], slot + l);
        for (int l = real; l < LANES; ++l) t.clear(slot + l);
        auto* to = reinterpret_cast<__m256i*>(t.xq.data() + slot * BLOCK);
        for (int h = 0; h < squares; ++h) {
          __m256 v[LANES];
          for (int l = 0; l < LANES; ++l) v[l] = _mm256_load_ps(reinterpret_cast<const float*>(q[l]) + 8 * h);
          transpose8(v);
          for (int d = 0; d < LANES; ++d) _mm256_storeu_si256(to + h * LANES + d, _mm256_castps_si256(v[d]));
        }
      }
    }
  });
}

// fn(v) with x's values v as their element type (float or bf16): one switch a call.
template <typename F>
void with_values(const at::Tensor& x, const F& fn) {
  pagedllm_dispatch::dispatch_float_types(x, "quant_gemm", [&](auto* tag) {
    fn(reinterpret_cast<const std::remove_pointer_t<decltype(tag)>*>(x.data_ptr()));
  });
}

// x's activations (Q: int8, or int16 for a wide weight) row by row, quantize_block's.
template <typename Q>
const QuantizedRows<Q>& quantize_rows(const at::Tensor& x) {
  // A reference: inside the lambdas below, a thread_local's name is the running thread's own.
  thread_local QuantizedRows<Q> storage;
  QuantizedRows<Q>& a = storage;
  const at::Tensor xc = x.contiguous();
  const int64_t total = xc.size(0) * (xc.size(1) / BLOCK);
  a.size(total, total + GROUP);
  with_values(xc, [&](const auto* v) {
    row_blocks(xc, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) quantize_block(v + i * BLOCK, a.xq.data() + i * BLOCK, a, i);
    });
  });
  return a;
}

// x's activations in lanes (quantize_in_lanes), quantize_block's as quantize_rows quantises them.
template <typename Q>
const QuantizedRows<Q>& quantize_lanes(const at::Tensor& x) {
  thread_local QuantizedRows<Q> storage;
  QuantizedRows<Q>& t = storage;  // (quantize_rows)
  const at::Tensor xc = x.contiguous();
  const int64_t k = xc.size(1);
  with_values(xc, [&](const auto* v) {
    quantize_in_lanes(xc, t, [&](int64_t r, int64_t b, Q* q, int64_t at) {
      quantize_block(v + r * k + b * BLOCK, q, t, at);
    });
  });
  return t;
}

// The weights of group g of a row as the lane kernels multiply them: qb[j] block j's values
// (bytes, or Q8_0's sign-extended to int16 for int16 activations; Offset: Q8_0's bytes as
// q + 128), d and m its scales.
template <Format F, typename Q, bool Offset = false>
__attribute__((always_inline)) inline void stage_group(const Layout& l, const uint8_t* row, int64_t g, int count,
                                                       Q qb[GROUP][BLOCK], float d[GROUP], float m[GROUP]) {
  if constexpr (std::is_same_v<Q, int16_t>) {
    for (int j = 0; j < count; ++j)
      for (int half = 0; half < 2; ++half) {
        const uint8_t* p = row + (g * GROUP + j) * BLOCK + 16 * half;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb[j] + 16 * half),
                            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
      }
  } else {
    auto stored = [](__m256i v) { return Offset ? _mm256_xor_si256(v, _mm256_set1_epi8(-128)) : v; };
    __m256i q[GROUP];
    if (count == GROUP) {
      // The count known at compile time: q stays in registers.
      load_group<F>(l, row, g, GROUP, q);
      for (int j = 0; j < GROUP; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb[j]), stored(q[j]));
    } else {
      load_group<F>(l, row, g, count, q);
      for (int j = 0; j < count; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb[j]), stored(q[j]));
    }
  }
  const GroupScales scales = group_scales<F>(l, row, g, count);
  _mm256_storeu_ps(d, scales.d);
  _mm256_storeu_ps(m, scales.m);
}

// A weight row's sums for the eight rows of row group v (lane r: row r): the sum over
// acc[.][v] in hsum's order ((0 + 4) + (2 + 6)) + ((1 + 5) + (3 + 7)).
template <int V>
inline __m256 lane_sums(const __m256 acc[GROUP][V], int v) {
  const __m256 t0 = _mm256_add_ps(acc[0][v], acc[4][v]), t1 = _mm256_add_ps(acc[1][v], acc[5][v]);
  const __m256 t2 = _mm256_add_ps(acc[2][v], acc[6][v]), t3 = _mm256_add_ps(acc[3][v], acc[7][v]);
  return _mm256_add_ps(_mm256_add_ps(t0, t2), _mm256_add_ps(t1, t3));
}

// out[r][n] for the rows of row group `group` (of `rows` in all), lane_sums' sums.
template <int V>
inline void store_lanes(const __m256 acc[GROUP][V], int v, int64_t group, int64_t rows, int64_t n, const Output& out) {
  alignas(32) float sums[LANES];
  _mm256_store_ps(sums, lane_sums<V>(acc, v));
  for (int64_t r = 0; r < std::min<int64_t>(LANES, rows - group * LANES); ++r) out.store(group * LANES + r, n, sums[r]);
}

// out.store(r, col + i, v[i]) for the eight columns col..col + 7, in one store.
inline void store_columns(const Output& out, int64_t r, int64_t col, __m256 v) {
  if (out.bias != nullptr) v = _mm256_add_ps(v, _mm256_loadu_ps(out.bias + col));
  if (out.bf16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<c10::BFloat16*>(out.data) + out.at(r, col)), to_bf16(v));
  } else {
    _mm256_storeu_ps(static_cast<float*>(out.data) + out.at(r, col), v);
  }
}

// out[r][n0 + i] for the rows of row group `group` and a tile's `tile` weight rows: each
// weight row's lane_sums, eight weight rows at a time turned into each activation row's run
// of eight columns (transpose8), rounded (to_bf16) and stored whole; a last part of fewer than eight as
// store_lanes. Storing a (row, column) at a time was a third of the Q8_0 head's time at 16
// rows (Gemma-3-270M, K = 640).
template <int V>
inline void store_tile(const __m256 acc[][GROUP][V], int tile, int v, int64_t group, int64_t rows, int64_t n0,
                       const Output& out) {
  const int64_t live = std::min<int64_t>(LANES, rows - group * LANES);
  int r0 = 0;
  for (; r0 + LANES <= tile; r0 += LANES) {
    __m256 s[LANES];
    for (int i = 0; i < LANES; ++i) s[i] = lane_sums<V>(acc[r0 + i], v);
    transpose8(s);
    for (int64_t l = 0; l < live; ++l) store_columns(out, group * LANES + l, n0 + r0, s[l]);
  }
  for (; r0 < tile; ++r0) store_lanes<V>(acc[r0], v, group, rows, n0 + r0, out);
}

// Whether the tiles stage Q8_0's signed bytes as q + 128 (the sign bit flipped), unsigned as
// every other format's: dpbusd then multiplies them without the sign trick's two vpsignb a
// dot product, and add_block_terms takes 128 sum(xq) back off (the same int32 sum, so the
// same bits). Not on AVX2: maddubs's int16 pair sums would saturate past q = 128.
template <Route R, Format F>
constexpr bool q8_0_offset() {
  return F == Format::q8_0 && R != Route::avx2;
}

// A tile's weight rows as lane_tiles multiplies them: row r's block b (bytes) at
// q[(r * padded + b) * BLOCK], its scales d and m at r * padded + b, padded the row's blocks
// rounded up to whole groups.
struct StagedTile {
  std::vector<int8_t> q;
  std::vector<float> d, m;
  int64_t padded = 0;

  static constexpr bool flip = false, sign_trick = false;  // staged Q8_0 bytes are q + 128 already
  const int8_t* block(int r, int64_t b) const { return q.data() + (r * padded + b) * BLOCK; }
  __m256 d_of(int r, int64_t b) const { return _mm256_set1_ps(d[r * padded + b]); }
  __m256 m_of(int r, int64_t b) const { return _mm256_set1_ps(m[r * padded + b]); }
};

// Q8_0 weight rows n0.. read where they are stored: the bytes the tiles stage (Flip: less the
// sign flip, applied to each broadcast dword instead; on AVX2 the signed bytes themselves), with
// the block's scale (block_d). A single pass over a tile (up to LANES * LANE_VECTORS rows: a
// decode step's) gains nothing from staging, which was a third of the Q8_0 head's time
// (Gemma-3-270M, 16 rows, Zen 4; docs/performance.md).
//
// On AVX2 maddubs multiplies unsigned bytes by signed ones: each broadcast dword of q is
// multiplied as |x| times q with x's sign, |x| the block's (shared by the tile's rows), one
// vpsignb a dword where the sign trick (|q| times x with q's sign) took two, on the two pipes
// that also take maddubs and madd. Where a byte is -128 (Weight::minus_128) q with
// x's sign can be +128, which int8 lacks, and the sign trick stays (SignTrick).
template <bool Flip, bool SignTrick = false>
struct StoredQ8_0Tile {
  const uint8_t* first;  // row n0
  int64_t bytes;         // a row's
  Layout lay;

  StoredQ8_0Tile(const Weight& w, int64_t n0) : first(w.row(n0)), bytes(w.lay.bytes), lay(w.lay) {}
  static constexpr bool flip = Flip, sign_trick = SignTrick;
  const int8_t* block(int r, int64_t b) const { return reinterpret_cast<const int8_t*>(first + r * bytes) + b * BLOCK; }
  // block_d's, not block_scales: its switch on the format per (row, block) cost 4-7% here;
  // converted in the vector (one broadcast load, no insert and broadcast after it).
  __m256 d_of(int r, int64_t b) const {
    int16_t bits;
    std::memcpy(&bits, block_d_at(lay, first + r * bytes, b), 2);
    return _mm256_cvtph_ps(_mm_set1_epi16(bits));
  }
  __m256 m_of(int, int64_t) const { return _mm256_setzero_ps(); }
};

// Row group `group`'s dword i of block b in rows-in-lanes activations t (quantize_in_lanes' layout).
template <typename Q>
inline const __m256i* lane_dwords(const QuantizedRows<Q>& t, int64_t group, int64_t blocks, int64_t b, int i) {
  return reinterpret_cast<const __m256i*>(t.xq.data() + (group * blocks + b) * LANES * BLOCK + i * LANES * 4 / sizeof(Q));
}

// pass(g, V) for the row groups [0, groups): LANE_VECTORS at a time, then the rest one at a
// time (V a std::integral_constant, for the kernels' template argument).
template <typename Pass>
__attribute__((always_inline)) inline void row_group_passes(int64_t groups, Pass pass) {
  int64_t g = 0;
  for (; g + LANE_VECTORS <= groups; g += LANE_VECTORS) pass(g, std::integral_constant<int, LANE_VECTORS>{});
  for (; g < groups; ++g) pass(g, std::integral_constant<int, 1>{});
}

// acc[r][b % GROUP][v] += row group g0 + v's products with block b of the tile's row r, for
// its `tile` rows (First: the first group's blocks, acc taken as zero, not read). The int32
// sums start from the block's offset term (block_offset), so that they end at its whole sum;
// Q6_K's halves, which have scales of their own, apart. On AVX2 the products are added in
// int16 int16_chain() dwords at a time first. Rows in turn keep enough in flight.
template <Route R, Format F, int V, bool First, typename Tile>
__attribute__((always_inline)) inline void lane_block_step(int64_t blocks, int64_t b, int tile, const Tile& st,
                                                           const Activations& t, int64_t g0, __m256 acc[][GROUP][V]) {
  constexpr int dwords = BLOCK / 4, chain = int16_chain<R, F>();
  constexpr bool halves = F == Format::q6_k, staged = q8_0_offset<R, F>();
  const int j = static_cast<int>(b % GROUP);
  __m256i x[V][dwords], abs_x[V][dwords], start[V];
  for (int v = 0; v < V; ++v) {
    for (int i = 0; i < dwords; ++i) {
      x[v][i] = _mm256_loadu_si256(lane_dwords(t, g0 + v, blocks, b, i));
      if constexpr (F == Format::q8_0 && !staged && !Tile::sign_trick) abs_x[v][i] = _mm256_abs_epi8(x[v][i]);
    }
    start[v] = halves ? _mm256_setzero_si256() : block_offset<F, staged>(t, ((g0 + v) * blocks + b) * LANES);
  }
  for (int r = 0; r < tile; ++r) {
    const int8_t* qb = st.block(r, b);
    __m256i s[2][V], part[V];
    for (int v = 0; v < V; ++v) {
      s[0][v] = start[v];
      s[1][v] = _mm256_setzero_si256();
    }
    for (int i = 0; i < dwords; ++i) {
      int32_t bits;
      std::memcpy(&bits, qb + 4 * i, 4);
      // The flip on the vector: a scalar xor would broadcast from a register, not from memory.
      const __m256i wv = Tile::flip ? _mm256_xor_si256(_mm256_set1_epi32(bits), _mm256_set1_epi8(-128))
                                    : _mm256_set1_epi32(bits);
      const int h = i < dwords / 2 ? 0 : 1;
      for (int v = 0; v < V; ++v) {
        if constexpr (F == Format::q8_0 && !staged && !Tile::sign_trick) {
          s[h][v] = dot_u8s8<R>(s[h][v], abs_x[v][i], _mm256_sign_epi8(wv, x[v][i]));
        } else if constexpr (F == Format::q8_0 && !staged) {
          s[h][v] = dot_u8s8<R>(s[h][v], _mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x[v][i], wv));
        } else if constexpr (chain > 1) {
          // maddubs's pair sums added in int16 `chain` dwords at a time, then one madd.
          const __m256i pairs = _mm256_maddubs_epi16(wv, x[v][i]);
          part[v] = i % chain == 0 ? pairs : _mm256_add_epi16(part[v], pairs);
          if (i % chain == chain - 1)
            s[h][v] = _mm256_add_epi32(s[h][v], _mm256_madd_epi16(part[v], _mm256_set1_epi16(1)));
        } else {
          s[h][v] = dot_u8s8<R>(s[h][v], wv, x[v][i]);
        }
      }
    }
    const __m256 d = st.d_of(r, b), m = st.m_of(r, b);
    for (int v = 0; v < V; ++v) {
      const int64_t at = ((g0 + v) * blocks + b) * LANES;
      const __m256 before = First ? _mm256_setzero_ps() : acc[r][j][v];
      if constexpr (halves) {
        acc[r][j][v] = add_block_terms<F>(before, s[0][v], s[1][v], d, m, t, at);
      } else {
        acc[r][j][v] = add_block_total<F>(before, _mm256_add_epi32(s[0][v], s[1][v]), d, m, t, at);
      }
    }
  }
}

// Weight rows [n0, n1)'s lines brought into L1 in `parts` parts (part(p): the p-th run of
// `per` lines), so that a tile's pass spreads its successor's over its blocks. The runs are
// counted once: two divisions per part (the first version) were 5% of the Q8_0 head's time.
// part is always inlined: GCC took the out-of-line function, which only prefetches, for one
// without effects and dropped its calls (the staged tiles' prefetch into L2, ed302de on,
// never ran).
struct RowsPrefetch {
  const char* first = nullptr;  // the line holding row n0's first byte
  int64_t lines = 0, per = 0;

  RowsPrefetch(const Weight& w, int64_t n0, int64_t n1, int64_t parts) {
    if (n0 >= std::min(n1, w.n)) return;
    const int64_t start = n0 * w.lay.bytes, end = std::min(n1, w.n) * w.lay.bytes;
    first = reinterpret_cast<const char*>(w.data + (start & ~int64_t{63}));
    lines = (end - (start & ~int64_t{63}) + 63) / 64;
    per = (lines + parts - 1) / parts;
  }
  __attribute__((always_inline)) void part(int64_t p) const {
    for (int64_t i = p * per; i < std::min(lines, (p + 1) * per); ++i) _mm_prefetch(first + 64 * i, _MM_HINT_T0);
  }
};

// Weight rows [n0, n1), n1 - n0 <= LANE_TILE, into st: row after row as the row kernels read
// them (the hardware prefetcher follows that, and prefetch_ahead: a group of each row in turn
// measured no faster than a row at a time on weights streamed from memory).
template <Format F, bool Offset>
void stage_tile(const Weight& w, int64_t n0, int64_t n1, StagedTile& st) {
  const Layout& l = w.lay;
  const int64_t blocks = l.blocks(), groups = (blocks + GROUP - 1) / GROUP;
  st.padded = groups * GROUP;
  st.q.resize(LANE_TILE * st.padded * BLOCK);
  st.d.resize(LANE_TILE * st.padded);
  st.m.resize(LANE_TILE * st.padded);
  for (int64_t r = 0; r < n1 - n0; ++r) {
    prefetch_ahead(w, n0 + r);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = r * st.padded + g * GROUP;
      stage_group<F, int8_t, Offset>(l, w.row(n0 + r), g, static_cast<int>(std::min<int64_t>(GROUP, blocks - g * GROUP)),
                     reinterpret_cast<int8_t(*)[BLOCK]>(st.q.data() + at * BLOCK), st.d.data() + at, st.m.data() + at);
    }
  }
}

// out[r][n] for row groups [g0, g0 + V) and the tile st of weight rows [n0, n1), int8
// activations; with prefetch, the LANE_TILE rows after them are brought into L1 meanwhile.
template <Route R, Format F, int V, typename Tile>
void tile_pass(const Weight& w, const Tile& st, const Activations& t, int64_t g0, int64_t rows, int64_t n0,
               int64_t n1, bool prefetch, const Output& out) {
  const int64_t blocks = w.lay.blocks();
  const int tile = static_cast<int>(n1 - n0);
  __m256 acc[LANE_TILE][GROUP][V];
  if (blocks < GROUP) {  // accumulators no block of the first group sets
    for (int r = 0; r < tile; ++r)
      for (int j = static_cast<int>(blocks); j < GROUP; ++j)
        for (int v = 0; v < V; ++v) acc[r][j][v] = _mm256_setzero_ps();
  }
  const RowsPrefetch next(w, n1, prefetch ? n1 + LANE_TILE : n1, blocks);
  int64_t b = 0;
  for (; b < std::min<int64_t>(GROUP, blocks); ++b) {
    next.part(b);
    lane_block_step<R, F, V, true, Tile>(blocks, b, tile, st, t, g0, acc);
  }
  for (; b < blocks; ++b) {
    next.part(b);
    lane_block_step<R, F, V, false, Tile>(blocks, b, tile, st, t, g0, acc);
  }
  for (int v = 0; v < V; ++v) store_tile<V>(acc, tile, v, g0 + v, rows, n0, out);
}

// out[r][n] for every row (in lanes) and weight rows [n0, n1), int8 activations: LANE_TILE
// weight rows staged at a time, then multiplied by every row group, LANE_VECTORS at a time,
// so that a prompt's many rows share one staging (the unpacking of the weights); Q8_0's rows
// in one pass are read as stored (StoredQ8_0Tile).
template <Route R, Format F>
void lane_tiles(const Weight& w, const Activations& t, int64_t rows, int64_t n0, int64_t n1, const Output& out) {
  thread_local StagedTile st;
  const int64_t groups = (rows + LANES - 1) / LANES;
  // On AVX2 staging Q8_0 only copies its bytes (no flip): every pass reads them in place.
  const bool stored = F == Format::q8_0 && (groups <= LANE_VECTORS || !q8_0_offset<R, F>());
  for (int64_t n = n0; n < n1; n += LANE_TILE) {
    const int64_t end = std::min(n + LANE_TILE, n1);
    if (!stored) stage_tile<F, q8_0_offset<R, F>()>(w, n, end, st);
    // A tile read in place prefetches the rows after it in its first pass, past n1 too (limiting
    // it to [n0, n1) measured no faster); staged ones are read from memory as the row kernels
    // read them, and prefetching the next meanwhile, into L1 or L2, measured level (Q5_0,
    // Q4_K) to 10% slower (Q6_K).
    const bool prefetch = stored && end < w.n;
    row_group_passes(groups, [&](int64_t g, auto v) __attribute__((always_inline)) {
      constexpr int V = decltype(v)::value;
      if (stored) {
        constexpr bool flip = q8_0_offset<R, F>();
        auto pass = [&](const auto& in_place) __attribute__((always_inline)) {
          tile_pass<R, F, V>(w, in_place, t, g, rows, n, end, prefetch && g == 0, out);
        };
        if (!flip && w.minus_128) return pass(StoredQ8_0Tile<flip, true>(w, n));
        return pass(StoredQ8_0Tile<flip>(w, n));
      }
      tile_pass<R, F, V>(w, st, t, g, rows, n, end, false, out);
    });
  }
}

// acc[j][v] += row group g0 + v's products with group g of weight row `row`, int16 activations
// against Q8_0 weights sign-extended (dpwssd; a block: 16 dwords). Four chains of dependent
// dot products per row group, not one: each a quarter of a block's dwords.
template <Route R, int V>
__attribute__((always_inline)) inline void wide_lane_group(const Layout& l, const uint8_t* row, int64_t g, int count,
                                                           const WideActivations& t, int64_t g0, __m256 acc[GROUP][V]) {
  constexpr int dwords = BLOCK / 2;
  const int64_t blocks = l.blocks();
  alignas(32) int16_t qb[GROUP][BLOCK];
  alignas(32) float d[GROUP], m[GROUP];
  stage_group<Format::q8_0>(l, row, g, count, qb, d, m);
  for (int j = 0; j < count; ++j) {
    const int64_t b = g * GROUP + j;
    __m256i s[4][V];
    for (int h = 0; h < 4; ++h)
      for (int v = 0; v < V; ++v) s[h][v] = _mm256_setzero_si256();
    for (int i = 0; i < dwords; ++i) {
      int32_t bits;
      std::memcpy(&bits, qb[j] + 2 * i, 4);
      const __m256i wv = _mm256_set1_epi32(bits);
      for (int v = 0; v < V; ++v)
        s[i % 4][v] = dot_s16<R>(s[i % 4][v], wv, _mm256_loadu_si256(lane_dwords(t, g0 + v, blocks, b, i)));
    }
    for (int v = 0; v < V; ++v)
      acc[j][v] = add_block_terms<Format::q8_0>(acc[j][v], _mm256_add_epi32(s[0][v], s[1][v]),
                                                _mm256_add_epi32(s[2][v], s[3][v]), _mm256_set1_ps(d[j]),
                                                _mm256_set1_ps(m[j]), t, ((g0 + v) * blocks + b) * LANES);
  }
}

// out[r][n] for row groups [g0, g0 + V) and weight rows [n0, n1), int16 activations: a weight
// row at a time.
template <Route R, int V>
void wide_lane_rows(const Weight& w, const WideActivations& t, int64_t g0, int64_t rows, int64_t n0, int64_t n1,
                    const Output& out) {
  for (int64_t n = n0; n < n1; ++n) {
    __m256 acc[GROUP][V];
    for (int j = 0; j < GROUP; ++j)
      for (int v = 0; v < V; ++v) acc[j][v] = _mm256_setzero_ps();
    row_groups(w, n, [&](const uint8_t* row, int64_t g, int count) __attribute__((always_inline)) {
      wide_lane_group<R, V>(w.lay, row, g, count, t, g0, acc);
    });
    for (int v = 0; v < V; ++v) store_lanes<V>(acc, v, g0 + v, rows, n, out);
  }
}

// Every row (in lanes) against weight rows [n0, n1): int8 activations LANE_TILE weight rows
// at a time, int16 a weight row at a time for LANE_VECTORS row groups.
template <Route R, Format F, typename Q>
void lane_rows(const Weight& w, const QuantizedRows<Q>& t, int64_t rows, int64_t n0, int64_t n1, const Output& out) {
  if constexpr (std::is_same_v<Q, int8_t>) {
    lane_tiles<R, F>(w, t, rows, n0, n1, out);
  } else {
    row_group_passes((rows + LANES - 1) / LANES, [&](int64_t g, auto v) __attribute__((always_inline)) {
      wide_lane_rows<R, decltype(v)::value>(w, t, g, rows, n0, n1, out);
    });
  }
}

// One call's products on route R, format F: rows in lanes where a holds them so (in_lanes),
// else the row kernels.
template <Route R, Format F>
void products(const Weight& w, const Activations& a, int64_t rows, int64_t n0, int64_t n1, const Output& out) {
  if (in_lanes(rows)) return lane_rows<R, F>(w, a, rows, n0, n1, out);
  weight_rows<R, F>(w, a, rows, n0, n1, out);
}

template <Route R>
void products_on(const Weight& w, const Activations& a, int64_t rows, int64_t n0, int64_t n1, const Output& out) {
  switch (w.lay.format) {
    case Format::q8_0: return products<R, Format::q8_0>(w, a, rows, n0, n1, out);
    case Format::q4_0: return products<R, Format::q4_0>(w, a, rows, n0, n1, out);
    case Format::q4_1: return products<R, Format::q4_1>(w, a, rows, n0, n1, out);
    case Format::q5_0: return products<R, Format::q5_0>(w, a, rows, n0, n1, out);
    case Format::q4_k: return products<R, Format::q4_k>(w, a, rows, n0, n1, out);
    case Format::q5_k: return products<R, Format::q5_k>(w, a, rows, n0, n1, out);
    case Format::q6_k: return products<R, Format::q6_k>(w, a, rows, n0, n1, out);
  }
}

// A wide (int16-activation) weight is Q8_0.
template <Route R>
void products_on(const Weight& w, const WideActivations& a, int64_t rows, int64_t n0, int64_t n1, const Output& out) {
  if (in_lanes(rows)) return lane_rows<R, Format::q8_0>(w, a, rows, n0, n1, out);
  wide_rows<R>(w, a, rows, n0, n1, out);
}

// products_on the route `route` names.
template <typename Q>
void run(Route route, const Weight& w, const QuantizedRows<Q>& a, int64_t rows, int64_t n0, int64_t n1,
         const Output& out) {
  switch (route) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case Route::avx512_vnni: return products_on<Route::avx512_vnni>(w, a, rows, n0, n1, out);
#endif
#if defined(__AVXVNNI__)
    case Route::avx_vnni: return products_on<Route::avx_vnni>(w, a, rows, n0, n1, out);
#endif
    default: return products_on<Route::avx2>(w, a, rows, n0, n1, out);
  }
}

#endif

// Rows the integer kernel takes at a time: a prompt's int8 activations (K bytes a row, and
// the per-block values) stay in L2 while every weight tile passes them; all 2,048 rows of a
// prompt at once ran no faster than dequantised tiles (Zen 4, K = 640: 25.3 against 25.2 ms).
constexpr int64_t INT_CHUNK_ROWS = 512;

#if defined(QUANT_AVX2)
// integer_pieces on Q activations.
template <typename Q, typename Piece>
void pieces_on(Route route, const at::Tensor& x, const Weight& w, const Piece& piece) {
  const int64_t rows = x.size(0);
  const QuantizedRows<Q>& a = in_lanes(rows) ? quantize_lanes<Q>(x) : quantize_rows<Q>(x);
  pagedllm_parallel::parallel_chunks(w.n, 8, [&](int64_t n0, int64_t n1) {
    piece(n0, n1, [&](int64_t c0, int64_t c1, const Output& o) { run(route, w, a, rows, c0, c1, o); });
  });
}

// x quantised once (int8, or int16 for a wide weight; in lanes from LANES rows), then each
// piece [n0, n1) of w's rows as parallel_chunks hands them out: piece(n0, n1, products), where
// products(c0, c1, out) writes the products of columns [c0, c1) within it to out.
template <typename Piece>
void integer_pieces(Route route, const at::Tensor& x, const Weight& w, const Piece& piece) {
  if (w.wide) return pieces_on<int16_t>(route, x, w, piece);
  pieces_on<int8_t>(route, x, w, piece);
}
#endif

// out = x @ w.T (+ bias b) on `route` (out: x's rows of the result).
void integer_rows(Route route, const at::Tensor& x, const Weight& w, const float* b, const at::Tensor& out) {
#if defined(QUANT_AVX2)
  const Output o{out.data_ptr(), x.scalar_type() == at::kBFloat16, b, w.n};
  integer_pieces(route, x, w, [&](int64_t n0, int64_t n1, const auto& products) { products(n0, n1, o); });
#endif
}

// The bias as the kernels add it: float32, contiguous (undefined: none).
at::Tensor float_bias(const std::optional<at::Tensor>& bias, const Weight& w, const char* op) {
  if (!bias.has_value()) return {};
  TORCH_CHECK(bias->numel() == w.n, op, ": the bias must have ", w.n, " entries");
  return bias->to(at::kFloat).contiguous();
}

// out = x @ w.T (+ bias) in x's dtype on the integer kernel, x [rows, K], INT_CHUNK_ROWS rows
// at a time.
at::Tensor integer_gemm(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& bias) {
  const Route route = current_route();
  TORCH_CHECK(route != Route::none, "quant_gemm needs AVX2 with FMA and F16C");
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, w.n}, x.options());
  const at::Tensor bias_f = float_bias(bias, w, "quant_gemm");
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const at::Tensor xc = x.contiguous();
  if (rows <= INT_CHUNK_ROWS) {  // a decode step's: no views made
    integer_rows(route, xc, w, b, out);
    return out;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += INT_CHUNK_ROWS) {
    const int64_t count = std::min(INT_CHUNK_ROWS, rows - r0);
    integer_rows(route, xc.narrow(0, r0, count), w, b, out.narrow(0, r0, count));
  }
  return out;
}

// Any number of rows (int_max_rows).
constexpr int64_t ANY_ROWS = std::numeric_limits<int64_t>::max();

// Up to this many rows the integer kernel is faster than dequantised tiles on small_gemm
// (docs/performance.md, quantized weights). int8 activations: bf16 tiles on the tile unit
// overtake it from 8 rows; against bf16 tiles on AVX-512-bf16 dot products, on AVX-512-VNNI,
// and against float32 tiles on FMAs anywhere it is faster at every count measured (Zen 4,
// 33 to 2,048 rows: 0.67-1.0 the bf16 tiles' time, 0.38-0.64 the float32 ones', 0.57-0.83
// with both capped to AVX2). Q8_0's int16 ones lose from 16 rows on bf16 tiles (1.7-2.2x),
// from 32 on float32 ones (1.1-1.2x at 64).
int64_t int_max_rows(at::ScalarType dtype, bool wide) {
  const bool bf16 = dtype == at::kBFloat16;
  if (bf16 && pagedllm_gemm::bf16_route() == pagedllm_gemm::Isa::amx) return 8;
  if (wide) return bf16 ? 16 : 32;
  return !bf16 || current_route() == Route::avx512_vnni ? ANY_ROWS : 16;
}

// int_max_rows of a weight of format `code` (-1: any number).
int64_t quant_gemm_int_rows(at::ScalarType dtype, int64_t code) {
  format_of(code);  // a known code, or the error naming it
  const int64_t rows = int_max_rows(dtype, wide_activations(code));
  return rows == ANY_ROWS ? -1 : rows;
}

void check_x(const at::Tensor& x, const Weight& w, const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.lay.k, op, ": x must be [rows, ", w.lay.k, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be float32 or bf16");
}

// out = x @ w.T (+ bias) in x's dtype (float32 or bf16): on the integer kernel up to
// int_max_rows rows, else on dequantised tiles (quant_tiles.cpp).
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& weight, int64_t format,
                      const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "quant_gemm: x must be 2-D");
  const Weight w = check_weight(weight, format, x.size(1));
  check_x(x, w, "quant_gemm");
  if (x.size(0) > int_max_rows(x.scalar_type(), w.wide)) return tiled_gemm(x, w, bias);
  return integer_gemm(x, w, bias);
}

// quant_gemm on the integer kernel, whatever the row count (tests, benchmarks).
at::Tensor quant_gemm_integer(const at::Tensor& x, const at::Tensor& weight, int64_t format,
                              const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "quant_gemm_integer: x must be 2-D");
  const Weight w = check_weight(weight, format, x.size(1));
  check_x(x, w, "quant_gemm_integer");
  return integer_gemm(x, w, bias);
}

// Columns a run of quant_gemm_argmax multiplies at a time: their products (16 float32 rows:
// 32 KB) stay in L1 / L2 while each row's argmax reads them.
constexpr int64_t ARGMAX_COLUMNS = 512;

// A row's best (value, index) so far, offered candidates in any order (beats: torch.argmax's).
struct Best {
  float value = 0.f;
  int64_t at = -1;  // none yet

  void offer(float v, int64_t i) {
    if (at < 0 || pagedllm_argmax::beats(v, i, value, at)) {
      value = v;
      at = i;
    }
  }
};

// Row r's argmax of logits (rows x n in T) into `at`.
template <typename T>
void argmax_of(const T* logits, int64_t rows, int64_t n, int64_t* at) {
  for (int64_t r = 0; r < rows; ++r) at[r] = pagedllm_argmax::argmax_row(logits + r * n, n);
}

// Each row's argmax of x @ w.T (+ bias) in x's dtype: argmax_rows(quant_gemm(...)), the same
// index, without the logits. A greedy step's head wrote its logits (Gemma 3: 16 x 262,144
// floats, 16 MB) only for the argmax to read them back; here each thread's piece of the columns
// is multiplied ARGMAX_COLUMNS at a time into a buffer, each row's argmax of those columns
// taken (argmax.h) and merged (beats: torch's order, so the order of the runs makes no
// difference). Rows past the integer kernel's go through the logits.
at::Tensor quant_gemm_argmax(const at::Tensor& x, const at::Tensor& weight, int64_t format,
                             const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "quant_gemm_argmax: x must be 2-D");
  const Weight w = check_weight(weight, format, x.size(1));
  check_x(x, w, "quant_gemm_argmax");
  TORCH_CHECK(w.n > 0, "quant_gemm_argmax: the weight has no rows");
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  if (rows == 0) return out;
  int64_t* best_at = out.data_ptr<int64_t>();
  const Route route = current_route();
  if (route == Route::none || rows > std::min(INT_CHUNK_ROWS, int_max_rows(x.scalar_type(), w.wide))) {
    const at::Tensor logits = quant_gemm(x, weight, format, bias);
    pagedllm_dispatch::dispatch_float_types(logits, "quant_gemm_argmax", [&](auto* tag) {
      argmax_of(reinterpret_cast<const std::remove_pointer_t<decltype(tag)>*>(logits.data_ptr()), rows, w.n, best_at);
    });
    return out;
  }
#if defined(QUANT_AVX2)
  const at::Tensor bias_f = float_bias(bias, w, "quant_gemm_argmax");
  const float* b = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  std::vector<Best> best(rows);
  std::mutex merge;
  pagedllm_dispatch::dispatch_float_types(x, "quant_gemm_argmax", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    integer_pieces(route, x.contiguous(), w, [&](int64_t n0, int64_t n1, const auto& products) {
      // The running thread's own buffer (a thread_local named here is the running thread's).
      thread_local std::vector<float> buffer;
      buffer.resize(rows * ARGMAX_COLUMNS);
      const T* logits = reinterpret_cast<const T*>(buffer.data());
      thread_local std::vector<Best> piece;  // (buffer) each step's: no allocation a piece
      piece.assign(rows, Best{});
      for (int64_t c0 = n0; c0 < n1; c0 += ARGMAX_COLUMNS) {
        const int64_t width = std::min(ARGMAX_COLUMNS, n1 - c0);
        products(c0, c0 + width, Output{buffer.data(), std::is_same_v<T, c10::BFloat16>, b, width, c0});
        for (int64_t r = 0; r < rows; ++r) {
          const T* row = logits + r * width;
          const int64_t j = pagedllm_argmax::argmax_row(row, width);
          piece[r].offer(static_cast<float>(row[j]), c0 + j);
        }
      }
      const std::lock_guard<std::mutex> hold(merge);
      for (int64_t r = 0; r < rows; ++r) best[r].offer(piece[r].value, piece[r].at);
    });
  });
  for (int64_t r = 0; r < rows; ++r) best_at[r] = best[r].at;
#endif
  return out;
}

// Every byte of rows [n0, n1) of w read once (32 at a time, xor-ed together): what streaming
// the weight costs without multiplying it.
uint8_t read_rows(const Weight& w, int64_t n0, int64_t n1) {
  const uint8_t* p = w.row(n0);
  const int64_t bytes = (n1 - n0) * w.lay.bytes;
  uint64_t acc = 0;
#if defined(QUANT_AVX2)
  __m256i v = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= bytes; i += 32) v = _mm256_xor_si256(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
  acc = static_cast<uint64_t>(_mm256_extract_epi64(v, 0) ^ _mm256_extract_epi64(v, 3));
  for (; i < bytes; ++i) acc ^= p[i];
#else
  for (int64_t i = 0; i < bytes; ++i) acc ^= p[i];
#endif
  return static_cast<uint8_t>(acc);
}

double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// The seconds each of `passes` passes took, wall-clock then the calling thread's CPU time
// (2 numbers per pass; on a shared host a thread off its core counts only in the first). A
// pass is x through every weight in turn on the integer kernel, as a decode step runs its
// products (on more than one thread: in one step team); read_only: a pass only reads each
// weight's bytes (the memory's ceiling). For benchmarks/quant_matvec.py.
std::vector<double> quant_gemm_bench(const at::Tensor& x, at::TensorList weights, int64_t format, int64_t passes,
                                     bool read_only) {
  TORCH_CHECK(x.dim() == 2 && passes > 0 && !weights.empty(), "quant_gemm_bench: x [rows, K], passes > 0, weights");
  std::vector<Weight> ws;
  for (const at::Tensor& t : weights) {
    ws.push_back(check_weight(t, format, x.size(1)));
    check_x(x, ws.back(), "quant_gemm_bench");
  }
  std::atomic<uint8_t> sink{0};
  auto body = [&] {
    std::vector<double> seconds;
    for (int64_t p = 0; p < passes; ++p) {
      const auto start = std::chrono::steady_clock::now();
      const double cpu_start = thread_seconds();
      for (const Weight& w : ws) {
        if (read_only) {
          pagedllm_parallel::parallel_chunks(w.n, 8, [&](int64_t n0, int64_t n1) { sink ^= read_rows(w, n0, n1); });
        } else {
          integer_gemm(x, w, std::nullopt);
        }
      }
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      seconds.push_back(thread_seconds() - cpu_start);
    }
    return seconds;
  };
  return pagedllm_parallel::with_team(body);
}

// quant_gemm on dequantised tiles, whatever the row count (tests, benchmarks).
at::Tensor quant_gemm_tiled(const at::Tensor& x, const at::Tensor& weight, int64_t format,
                            const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "quant_gemm_tiled: x must be 2-D");
  const Weight w = check_weight(weight, format, x.size(1));
  check_x(x, w, "quant_gemm_tiled");
  return tiled_gemm(x, w, bias);
}

}  // namespace
}  // namespace pagedllm_quant

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("quant_gemm_isa() -> str", &pagedllm_quant::quant_gemm_isa);
  m.def("set_quant_gemm_isa(str isa) -> str", &pagedllm_quant::set_quant_gemm_isa);
  m.def("quant_gemm_int_rows(ScalarType dtype, int format) -> int", &pagedllm_quant::quant_gemm_int_rows);
  m.def("quant_gemm(Tensor x, Tensor weight, int format, Tensor? bias=None) -> Tensor");
  m.def("quant_gemm_integer(Tensor x, Tensor weight, int format, Tensor? bias=None) -> Tensor");
  m.def("quant_gemm_tiled(Tensor x, Tensor weight, int format, Tensor? bias=None) -> Tensor");
  m.def("quant_gemm_argmax(Tensor x, Tensor weight, int format, Tensor? bias=None) -> Tensor");
  m.def("quant_gemm_bench(Tensor x, Tensor[] weights, int format, int passes, bool read_only) -> float[]",
        &pagedllm_quant::quant_gemm_bench);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("quant_gemm", &pagedllm_quant::quant_gemm);
  m.impl("quant_gemm_integer", &pagedllm_quant::quant_gemm_integer);
  m.impl("quant_gemm_tiled", &pagedllm_quant::quant_gemm_tiled);
  m.impl("quant_gemm_argmax", &pagedllm_quant::quant_gemm_argmax);
}
