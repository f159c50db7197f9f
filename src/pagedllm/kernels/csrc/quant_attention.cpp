// Paged attention over a quantized KV cache (pagedllm/attention/quant.py), dequantization fused.
//
// A query at position p reads the sealed blocks before its own block through the block table,
// dequantized as they are read, and its own block's rows up to p in full precision from the
// step's window. One task = (sequence, kv head, one query block): every query head of the kv
// head's group for every row of the sequence that falls in that block, so each sealed block is
// dequantized once per task and used by all of them. Online softmax in fp32, blocks in table
// order then the own block: a query's result does not depend on which other rows share its
// step (a prefix-cache hit gives the bits a recomputation gives).
//
// Formats (BlockCodec in attention/quant.py): 0 int8 with one fp16 scale per token and head;
// 1 int4 with fp16 scale and minimum per channel over the block (K); 2 int4 with fp16 scale and
// minimum per token for each group of channels (V); 3 fp8 e4m3 and 4 fp8 e5m2 without scale. int4 packs two values a
// byte, the even channel in the low nibble.
//
// int8 K and V with AVX-512 VNNI (attend_int8_block): sealed blocks are never widened to fp32.
// Each query is rounded once per task to int16 with one scale (relative error 2^-16, far
// below the cache's own 2^-8), K rows widen to int16 in registers and `vpdpwssd` gives exact
// integer dot products that the query's and the token's scales turn into scores. The
// probabilities times V's per-token scales are rounded to int16 per 16 keys (again 2^-16 of
// their maximum) and multiply V's int8 rows, two keys per instruction. The plain path
// (dequantize into fp32 rows, then fp32 dots) serves every other format, machines without
// VNNI, and the own block; the Python dequantize-then-attend path is the ground truth.
//
// A cache that keeps first blocks unquantized passes `first_slots` (one per sequence, else
// empty): block 0 of the table is then read in full precision from that staging slot, after
// the sealed blocks on the int8 path (it keeps its states fresh), in table order otherwise.
//
// Without AVX-512 (AVX2 + FMA + F16C, head_dim a multiple of 8; `plain` turns it off) every
// format reads its sealed blocks in place, the codes widened to fp32 in registers as the
// dot products and the weighted sum use them (attend_sealed_avx2), and the own block takes
// the same fp32 tiles.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_AVX2 1
#endif

#include "kv_formats.h"
#include "parallel.h"
#include "vec.h"
#include "vec_avx2.h"

namespace {

using namespace pagedllm_kv;
using pagedllm_vec::to_float;

struct Side {
  int64_t kind;
  const uint8_t* data;  // [blocks, B, H, D or D/2] bytes
  const c10::Half* scale;
  const c10::Half* minimum;
  int64_t data_block, data_token, data_head;  // strides in bytes
  int64_t scale_block, scale_a, scale_b, scale_c;  // [blocks, B, H], [blocks, H, D], [blocks, B, H, G]
  int64_t group;                                    // int4 V: channels per scale
};

template <typename T>
struct Args {
  const T* query;
  int64_t q_token, q_head;
  T* out;
  int64_t out_token, out_head;
  Side k, v;
  const T* k_window;
  const T* v_window;
  int64_t win_block, win_token, win_head;
  const int32_t* tables;
  int64_t table_stride;
  const int32_t* seq_lens;
  const int32_t* query_start;
  const int32_t* window_start;
  const T* k_stage;  // [slots, B, H, D]: unquantized first blocks
  const T* v_stage;
  int64_t stage_slot, stage_token, stage_head;
  const int32_t* first_slots;  // null: block 0 is sealed like the others
  int64_t block_size, head_dim, group;
  float scale;
  bool int8_fast;  // int8 K and V through attend_int8_block (`plain` turns it off)
  bool avx2;       // the AVX2 path (attend_sealed_avx2; `plain` turns it off)
};

// kv heads [kv_head, kv_head + heads) of one query block of one sequence.
struct Task {
  int64_t seq, kv_head, heads, block, cost;
};

std::array<float, 256> fp8_table(bool e4m3) {
  std::array<float, 256> table{};
  for (int i = 0; i < 256; ++i) {
    const auto bits = static_cast<uint8_t>(i);
    table[i] = e4m3 ? static_cast<float>(c10::Float8_e4m3fn(bits, c10::Float8_e4m3fn::from_bits()))
                    : static_cast<float>(c10::Float8_e5m2(bits, c10::Float8_e5m2::from_bits()));
  }
  return table;
}

const std::array<float, 256>& fp8_lut(int64_t kind) {
  static const std::array<float, 256> e4m3 = fp8_table(true);
  static const std::array<float, 256> e5m2 = fp8_table(false);
  return kind == FP8_E4M3 ? e4m3 : e5m2;
}

// Rows [0, n) of one head of sealed block `block` as floats, row-major [n][D].
void dequantize(const Side& s, int64_t block, int64_t head, int64_t n, int64_t dim, float* out) {
  const uint8_t* base = s.data + block * s.data_block + head * s.data_head;
  if (s.kind == INT8) {
    for (int64_t t = 0; t < n; ++t) {
      const auto* q = reinterpret_cast<const int8_t*>(base + t * s.data_token);
      const float sc = static_cast<float>(s.scale[block * s.scale_block + t * s.scale_a + head * s.scale_b]);
      float* row = out + t * dim;
      int64_t d = 0;
#if defined(__AVX512F__)
      const __m512 vs = _mm512_set1_ps(sc);
      for (; d + 16 <= dim; d += 16) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + d));
        _mm512_storeu_ps(row + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), vs));
      }
#endif
      for (; d < dim; ++d) row[d] = static_cast<float>(q[d]) * sc;
    }
  } else if (s.kind == INT4_CHANNEL || s.kind == INT4_TOKEN) {
    const bool per_channel = s.kind == INT4_CHANNEL;
    const c10::Half* sc_base = s.scale + block * s.scale_block + head * (per_channel ? s.scale_a : s.scale_b);
    const c10::Half* mn_base = s.minimum + block * s.scale_block + head * (per_channel ? s.scale_a : s.scale_b);
    float ch_scale[512], ch_min[512];
    if (per_channel)
      for (int64_t d = 0; d < dim; ++d) {
        ch_scale[d] = static_cast<float>(sc_base[d * s.scale_b]);
        ch_min[d] = static_cast<float>(mn_base[d * s.scale_b]);
      }
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* q = base + t * s.data_token;
      float* row = out + t * dim;
      if (per_channel) {
        for (int64_t d = 0; d < dim; d += 2) {
          row[d] = static_cast<float>(q[d / 2] & 0xF) * ch_scale[d] + ch_min[d];
          row[d + 1] = static_cast<float>(q[d / 2] >> 4) * ch_scale[d + 1] + ch_min[d + 1];
        }
      } else {
        for (int64_t g0 = 0; g0 < dim; g0 += s.group) {
          const int64_t at = t * s.scale_a + (g0 / s.group) * s.scale_c;
          const float sc = static_cast<float>(sc_base[at]);
          const float mn = static_cast<float>(mn_base[at]);
          for (int64_t d = g0; d < g0 + s.group; d += 2) {
            row[d] = static_cast<float>(q[d / 2] & 0xF) * sc + mn;
            row[d + 1] = static_cast<float>(q[d / 2] >> 4) * sc + mn;
          }
        }
      }
    }
  } else {
    const auto& lut = fp8_lut(s.kind);
    for (int64_t t = 0; t < n; ++t) {
      const uint8_t* q = base + t * s.data_token;
      for (int64_t d = 0; d < dim; ++d) out[t * dim + d] = lut[q[d]];
    }
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  int64_t d = 0;
  for (; d + 16 <= n; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  if (d < n) {
    const __mmask16 m = pagedllm_vec::tail_mask(n - d);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + d), _mm512_maskz_loadu_ps(m, b + d), acc);
  }
  return _mm512_reduce_add_ps(acc);
#else
  float acc = 0.0f;
  for (int64_t d = 0; d < n; ++d) acc += a[d] * b[d];
  return acc;
#endif
}

// acc = acc * c + sum_t p[t] * v[t]  (v row-major [n][dim]).
inline void rescale_add(float* acc, float c, const float* p, const float* v, int64_t n, int64_t dim) {
#if defined(__AVX512F__)
  const __m512 vc = _mm512_set1_ps(c);
  int64_t d = 0;
  for (; d < dim; d += 16) {
    const __mmask16 m = pagedllm_vec::tail_mask(dim - d);
    __m512 a = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + d), vc);
    for (int64_t t = 0; t < n; ++t)
      a = _mm512_fmadd_ps(_mm512_set1_ps(p[t]), _mm512_maskz_loadu_ps(m, v + t * dim + d), a);
    _mm512_mask_storeu_ps(acc + d, m, a);
  }
#else
  for (int64_t d = 0; d < dim; ++d) {
    float a = acc[d] * c;
    for (int64_t t = 0; t < n; ++t) a += p[t] * v[t * dim + d];
    acc[d] = a;
  }
#endif
}

// Online softmax state of the task's queries.
struct State {
  std::vector<float> q, acc, max, sum, probs;
  // The int8 path (attend_int8_sealed): queries as int16 and their scales, scores and then
  // probabilities [nq][rows], V's row scales, probabilities as int16 and their steps, and
  // the weighted sums in int32.
  pagedllm_vec::LineVector<int16_t> q16;
  std::vector<float> q16_scale, scores, v_scale, p_scale;
  std::vector<int16_t> p16;
  std::vector<int32_t> acc_i;
  // The AVX2 path (attend_sealed_avx2): scores and probabilities [nq][width] (width: the
  // block size rounded up to 8), each query's rescale factor for the block, int4 K's scaled
  // queries [nq][D] and constants, K's row or channel scales, the value coefficients
  // [nq][groups][width] and constants [nq][groups].
  int64_t width = 0;
  std::vector<float> rescale, kq, q_bias, k_scale, coef, v_bias;
};

#if defined(__AVX512F__)
template <bool INT>
inline __m512 add16(__m512 a, __m512 b) {
  if constexpr (INT)
    return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a), _mm512_castps_si512(b)));
  else
    return _mm512_add_ps(a, b);
}

// Lane i of the result = the sum of v[i]'s 16 lanes (a 16 x 16 transpose-and-add); INT: the
// lanes hold int32 (moved as raw bits, added as integers).
template <bool INT = false>
inline __m512 reduce16(const __m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = add16<INT>(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                      _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int j = 0; j < 4; ++j)
    x[j] = add16<INT>(_mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0x88),
                      _mm512_shuffle_f32x4(w[2 * j], w[2 * j + 1], 0xDD));
  for (int k = 0; k < 2; ++k)
    y[k] = add16<INT>(_mm512_unpacklo_ps(x[2 * k], x[2 * k + 1]), _mm512_unpackhi_ps(x[2 * k], x[2 * k + 1]));
  const __m512 z = add16<INT>(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  // z lane 4q holds vector q, 4q+1 vector 8+q, 4q+2 vector 4+q, 4q+3 vector 12+q.
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, z);
}

// Scores of one query against up to 16 key rows [n][dim] (lanes past n: -inf).
inline __m512 scores16(const float* q, const float* keys, int64_t n, int64_t dim) {
  __m512 part[16];
  for (int64_t t = 0; t < 16; ++t) part[t] = _mm512_setzero_ps();
  for (int64_t d = 0; d < dim; d += 16) {
    const __mmask16 m = pagedllm_vec::tail_mask(dim - d);
    const __m512 qv = _mm512_maskz_loadu_ps(m, q + d);
    for (int64_t t = 0; t < n; ++t)
      part[t] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(m, keys + t * dim + d), part[t]);
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  return _mm512_mask_blend_ps(pagedllm_vec::tail_mask(n), neg_inf, reduce16(part));
}
#endif

// Every query of the task over keys/values [0, limit[qi]) of one block (floats [n][dim]).
void attend_block(State& st, const float* keys, const float* values, const int64_t* limit, int64_t nq,
                  int64_t dim) {
  float* p = st.probs.data();
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t n = limit[qi];
    if (n <= 0) continue;
    const float* q = st.q.data() + qi * dim;
    const float old = st.max[qi];
    float mx = old, total = 0.0f, c = 0.0f;
#if defined(__AVX512F__)
    if (n <= 16) {
      const __m512 s = scores16(q, keys, n, dim);
      mx = std::max(old, _mm512_reduce_max_ps(s));
      const __m512 e = _mm512_maskz_mov_ps(pagedllm_vec::tail_mask(n),
                                           pagedllm_vec::exp512(_mm512_sub_ps(s, _mm512_set1_ps(mx))));
      _mm512_storeu_ps(p, e);
      total = _mm512_reduce_add_ps(e);
    } else
#endif
    {
      for (int64_t t = 0; t < n; ++t) {
        p[t] = dot(q, keys + t * dim, dim);
        mx = std::max(mx, p[t]);
      }
      for (int64_t t = 0; t < n; ++t) {
        p[t] = std::exp(p[t] - mx);
        total += p[t];
      }
    }
    c = old == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(old - mx);
    st.sum[qi] = st.sum[qi] * c + total;
    st.max[qi] = mx;
    rescale_add(st.acc.data() + qi * dim, c, p, values, n, dim);
  }
}

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int64_t INT8_MAX_CHUNKS = 8;  // head_dim / 32 (head_dim <= 256 keeps int32 sums exact)
constexpr int64_t INT8_AHEAD = 8;       // blocks prefetched ahead of the one being read

inline bool int8_fast(const Side& k, const Side& v, int64_t dim) {
  return k.kind == INT8 && v.kind == INT8 && dim % 32 == 0 && dim / 32 <= INT8_MAX_CHUNKS;
}

// The task's fp32 queries (st.q) as int16 with one scale per query.
void quantize_queries(State& st, int64_t nq, int64_t dim) {
  st.q16.resize(nq * dim);
  st.q16_scale.resize(nq);
  for (int64_t qi = 0; qi < nq; ++qi) {
    const float* q = st.q.data() + qi * dim;
    float amax = 0.0f;
    for (int64_t d = 0; d < dim; ++d) amax = std::max(amax, std::fabs(q[d]));
    const float scale = amax / 32767.0f;
    const float inv = amax > 0.0f ? 1.0f / scale : 0.0f;
    st.q16_scale[qi] = scale;
    for (int64_t d = 0; d < dim; ++d) st.q16[qi * dim + d] = static_cast<int16_t>(std::nearbyint(q[d] * inv));
  }
}

// Lanes [0, n) of a 32-lane mask.
inline __mmask32 mask32(int64_t n) {
  return n >= 32 ? 0xFFFFFFFFu : (n <= 0 ? 0u : static_cast<__mmask32>((1u << n) - 1u));
}

// Scales of rows [t0, t0 + n) of one head of a sealed int8 block as 16 floats (0 past n).
// Rows up to 4 scales apart (4 kv heads or fewer) span at most 61 halves: two masked loads
// and one permute pick them, instead of 16 two-byte stores read back as one vector (a failed
// store-to-load forward per block and head).
inline __m512 int8_scales(const Side& s, int64_t block, int64_t head, int64_t t0, int64_t n) {
  const c10::Half* base = s.scale + block * s.scale_block + head * s.scale_b + t0 * s.scale_a;
  const int64_t step = s.scale_a;
  if (step >= 1 && step <= 4 && n > 0) {
    const int64_t span = (n - 1) * step + 1;
    const __m512i lo = _mm512_maskz_loadu_epi16(mask32(span), base);
    const __m512i hi =
        span > 32 ? _mm512_maskz_loadu_epi16(mask32(span - 32), base + 32) : _mm512_setzero_si512();
    const __m512i index =
        _mm512_mullo_epi16(_mm512_zextsi256_si512(_mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)),
                           _mm512_set1_epi16(static_cast<int16_t>(step)));
    const __m512i picked = _mm512_maskz_permutex2var_epi16(static_cast<__mmask32>(pagedllm_vec::tail_mask(n)), lo,
                                                           index, hi);
    return _mm512_cvtph_ps(_mm512_castsi512_si256(picked));
  }
  alignas(32) uint16_t bits[16] = {};
  for (int64_t t = 0; t < n; ++t) bits[t] = base[t * step].x;
  return _mm512_cvtph_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(bits)));
}

// Rows [t0, t0 + n) of one head of a sealed int8 block widened to int16, 32 channels a vector.
// Each row read asks for the same row of block `ahead` (if >= 0): blocks sit at random
// addresses, so the hardware prefetcher stops at every block edge, and prefetching a whole
// block at once fills the miss buffers and stalls; one line per row read does neither.
inline void widen_rows(const Side& s, int64_t block, int64_t head, int64_t t0, int64_t n, int64_t chunks,
                       int64_t ahead, __m512i (*rows)[INT8_MAX_CHUNKS]) {
  const uint8_t* base = s.data + block * s.data_block + head * s.data_head;
  const uint8_t* next = s.data + ahead * s.data_block + head * s.data_head;
  for (int64_t t = 0; t < 16; ++t) {
    if (t < n && ahead >= 0)
      for (int64_t l = 0; l < s.data_head; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + (t0 + t) * s.data_token + l), _MM_HINT_T0);
    for (int64_t c = 0; c < chunks; ++c)
      rows[t][c] = t < n ? _mm512_cvtepi8_epi16(
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(base + (t0 + t) * s.data_token) + c))
                         : _mm512_setzero_si512();
  }
}

// Blocks sit at random addresses: ask for a block's rows of heads [head, head + heads)
// ahead of use (contiguous within each row).
inline void prefetch_int8_block(const Side& s, int64_t block, int64_t head, int64_t heads, int64_t rows) {
  const char* base = reinterpret_cast<const char*>(s.data + block * s.data_block + head * s.data_head);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t l = 0; l < heads * s.data_head; l += 64) _mm_prefetch(base + t * s.data_token + l, _MM_HINT_T0);
}

// The same for the block's scales (rows x heads halves, contiguous).
inline void prefetch_int8_scales(const Side& s, int64_t block, int64_t rows) {
  const char* base = reinterpret_cast<const char*>(s.scale + block * s.scale_block);
  const int64_t bytes = rows * s.scale_a * static_cast<int64_t>(sizeof(c10::Half));
  for (int64_t l = 0; l < bytes + 63; l += 64) _mm_prefetch(base + std::min(l, bytes - 1), _MM_HINT_T0);
}

// Pass 1: the scores of every query against rows [0, B) of each of the first `nblocks`
// blocks of the table (st.scores, [nq][nblocks * B]) and V's scale of each row (st.v_scale).
void int8_scores(State* states, const Side& ks, const Side& vs, const int32_t* table, int64_t nblocks,
                 int64_t head0, int64_t heads, int64_t B, int64_t nq, int64_t dim) {
  const int64_t chunks = dim / 32, ctx = nblocks * B;
  alignas(64) __m512i k16[16][INT8_MAX_CHUNKS];
  for (int64_t j = 0; j < nblocks; ++j) {
    if (j + INT8_AHEAD < nblocks) {
      prefetch_int8_scales(ks, table[j + INT8_AHEAD], B);
      prefetch_int8_scales(vs, table[j + INT8_AHEAD], B);
    }
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t0 = 0; t0 < B; t0 += 16) {
        State& st = states[h];
        const int64_t head = head0 + h;
        const int64_t n = std::min<int64_t>(16, B - t0);
        widen_rows(ks, table[j], head, t0, n, chunks, j + INT8_AHEAD < nblocks ? table[j + INT8_AHEAD] : -1, k16);
        const __m512 k_scale = int8_scales(ks, table[j], head, t0, n);
        const __mmask16 valid = pagedllm_vec::tail_mask(n);
        _mm512_mask_storeu_ps(st.v_scale.data() + j * B + t0, valid, int8_scales(vs, table[j], head, t0, n));
        for (int64_t qi = 0; qi < nq; ++qi) {
          const __m512i* q = reinterpret_cast<const __m512i*>(st.q16.data() + qi * dim);
          __m512i part[16];
          for (int64_t t = 0; t < 16; ++t) {
            __m512i acc = _mm512_setzero_si512();
            for (int64_t c = 0; c < chunks; ++c) acc = _mm512_dpwssd_epi32(acc, _mm512_load_si512(q + c), k16[t][c]);
            part[t] = acc;
          }
          const __m512i dots = _mm512_castps_si512(reduce16<true>(reinterpret_cast<const __m512*>(part)));
          const __m512 scale = _mm512_mul_ps(k_scale, _mm512_set1_ps(st.q16_scale[qi]));
          _mm512_mask_storeu_ps(st.scores.data() + qi * ctx + j * B + t0, valid,
                                _mm512_mul_ps(_mm512_cvtepi32_ps(dots), scale));
        }
      }
    }
  }
}

// Softmax numerators exp(s - max) times V's row scales, as int16 relative to their maximum
// (st.p16, rows padded to an even length), the max and sum into the online state (which
// starts here), and the int16 step of each query (st.p_scale).
void int8_probabilities(State& st, int64_t ctx, int64_t nq) {
  const int64_t width = (ctx + 1) & ~int64_t{1};
  st.p16.assign(nq * width, 0);
  st.p_scale.resize(nq);
  for (int64_t qi = 0; qi < nq; ++qi) {
    float* row = st.scores.data() + qi * ctx;
    __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int64_t t = 0; t < ctx; t += 16)
      vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, pagedllm_vec::tail_mask(ctx - t), row + t));
    const float mx = _mm512_reduce_max_ps(vmax);
    __m512 vsum = _mm512_setzero_ps(), pmax = _mm512_setzero_ps();
    for (int64_t t = 0; t < ctx; t += 16) {
      const __mmask16 m = pagedllm_vec::tail_mask(ctx - t);
      const __m512 e =
          _mm512_maskz_mov_ps(m, pagedllm_vec::exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), _mm512_set1_ps(mx))));
      vsum = _mm512_add_ps(vsum, e);
      const __m512 pv = _mm512_mul_ps(e, _mm512_maskz_loadu_ps(m, st.v_scale.data() + t));
      pmax = _mm512_max_ps(pmax, pv);
      _mm512_mask_storeu_ps(row + t, m, pv);
    }
    st.max[qi] = mx;
    st.sum[qi] = _mm512_reduce_add_ps(vsum);
    const float top = _mm512_reduce_max_ps(pmax);
    st.p_scale[qi] = top / 32767.0f;
    const __m512 inv = _mm512_set1_ps(top > 0.0f ? 32767.0f / top : 0.0f);
    int16_t* dst = st.p16.data() + qi * width;
    for (int64_t t = 0; t < ctx; t += 16) {
      const __mmask16 m = pagedllm_vec::tail_mask(ctx - t);
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + t), inv));
      _mm256_mask_storeu_epi16(dst + t, m, _mm512_cvtepi32_epi16(q));
    }
  }
}

// int32 sums of one query (lo/hi pair lanes, see int8_values) into its fp32 accumulator.
inline void flush_int8(const int32_t* sums, float p_scale, int64_t chunks, float* acc) {
  const __m512i PAIR_LO = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i PAIR_HI = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 vp = _mm512_set1_ps(p_scale);
  for (int64_t c = 0; c < chunks; ++c) {
    const __m512 l = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + 32 * c));
    const __m512 h = _mm512_cvtepi32_ps(_mm512_loadu_si512(sums + 32 * c + 16));
    float* a = acc + 32 * c;
    _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_permutex2var_ps(l, PAIR_LO, h), vp, _mm512_loadu_ps(a)));
    _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(_mm512_permutex2var_ps(l, PAIR_HI, h), vp, _mm512_loadu_ps(a + 16)));
  }
}

// Pass 2: acc += sum_t p16[t] * v[t] * p_scale over the sealed rows, two rows per vpdpwssd:
// V as (row 2i, row 2i+1) int16 pairs per int32 lane. unpacklo/hi work within 128-bit lanes,
// so lo lane i is channel (i/4)*8 + i%4 of its 32 and hi lane i channel (i/4)*8 + 4 + i%4
// (flush_int8 puts them back in order). int32 sums are flushed every FLUSH rows: up to
// 2 * 32767 * 128 * FLUSH / 2 stays below 2^31.
void int8_values(State* states, const Side& vs, const int32_t* table, int64_t nblocks, int64_t head0,
                 int64_t heads, int64_t B, int64_t nq, int64_t dim) {
  constexpr int64_t FLUSH = 256;
  const int64_t chunks = dim / 32, ctx = nblocks * B, width = (ctx + 1) & ~int64_t{1};
  for (int64_t h = 0; h < heads; ++h) states[h].acc_i.assign(nq * dim, 0);
  alignas(64) __m512i v16[16][INT8_MAX_CHUNKS];
  alignas(64) __m512i vlo[8][INT8_MAX_CHUNKS], vhi[8][INT8_MAX_CHUNKS];
  int64_t since_flush = 0;
  for (int64_t j = 0; j < std::min(nblocks, INT8_AHEAD); ++j) prefetch_int8_block(vs, table[j], head0, heads, B);
  for (int64_t j = 0; j < nblocks; ++j) {
    for (int64_t t0 = 0; t0 < B; t0 += 16) {
      for (int64_t h = 0; h < heads; ++h) {
        State& st = states[h];
        const int64_t head = head0 + h;
        const int64_t n = std::min<int64_t>(16, B - t0), pairs = (n + 1) / 2;
        widen_rows(vs, table[j], head, t0, n, chunks, j + INT8_AHEAD < nblocks ? table[j + INT8_AHEAD] : -1, v16);
        for (int64_t i = 0; i < pairs; ++i)
          for (int64_t c = 0; c < chunks; ++c) {
            vlo[i][c] = _mm512_unpacklo_epi16(v16[2 * i][c], v16[2 * i + 1][c]);
            vhi[i][c] = _mm512_unpackhi_epi16(v16[2 * i][c], v16[2 * i + 1][c]);
          }
        const int64_t r0 = j * B + t0;
        for (int64_t qi = 0; qi < nq; ++qi) {
          const int16_t* p16 = st.p16.data() + qi * width + r0;
          __m512i* sums = reinterpret_cast<__m512i*>(st.acc_i.data() + qi * dim);
          __m512i lo[INT8_MAX_CHUNKS], hi[INT8_MAX_CHUNKS];
          for (int64_t c = 0; c < chunks; ++c) {
            lo[c] = _mm512_loadu_si512(sums + 2 * c);
            hi[c] = _mm512_loadu_si512(sums + 2 * c + 1);
          }
          for (int64_t i = 0; i < pairs; ++i) {
            int32_t pair;
            std::memcpy(&pair, p16 + 2 * i, sizeof(pair));  // a row past n has a zero V row
            const __m512i p = _mm512_set1_epi32(pair);
            for (int64_t c = 0; c < chunks; ++c) {
              lo[c] = _mm512_dpwssd_epi32(lo[c], p, vlo[i][c]);
              hi[c] = _mm512_dpwssd_epi32(hi[c], p, vhi[i][c]);
            }
          }
          for (int64_t c = 0; c < chunks; ++c) {
            _mm512_storeu_si512(sums + 2 * c, lo[c]);
            _mm512_storeu_si512(sums + 2 * c + 1, hi[c]);
          }
        }
      }
      since_flush += std::min<int64_t>(16, B - t0);
      if (since_flush >= FLUSH || (j + 1 == nblocks && t0 + 16 >= B)) {
        for (int64_t h = 0; h < heads; ++h) {
          State& st = states[h];
          for (int64_t qi = 0; qi < nq; ++qi)
            flush_int8(st.acc_i.data() + qi * dim, st.p_scale[qi], chunks, st.acc.data() + qi * dim);
          std::fill(st.acc_i.begin(), st.acc_i.end(), 0);
        }
        since_flush = 0;
      }
    }
  }
}

// Every query of the task over the first `nblocks` sealed int8 blocks of the table, heads
// [head0, head0 + heads) side by side (their rows share cache lines): each head's online
// state (fresh) then holds their max, sum and weighted sum.
void attend_int8_sealed(State* states, const Side& ks, const Side& vs, const int32_t* table, int64_t nblocks,
                        int64_t head0, int64_t heads, int64_t B, int64_t nq, int64_t dim) {
  const int64_t ctx = nblocks * B;
  for (int64_t h = 0; h < heads; ++h) {
    quantize_queries(states[h], nq, dim);
    states[h].scores.resize(nq * ctx);
    states[h].v_scale.resize(ctx);
  }
  for (int64_t j = 0; j < std::min(nblocks, INT8_AHEAD); ++j) {
    prefetch_int8_block(ks, table[j], head0, heads, B);
    prefetch_int8_scales(ks, table[j], B);
    prefetch_int8_scales(vs, table[j], B);
  }
  int8_scores(states, ks, vs, table, nblocks, head0, heads, B, nq, dim);
  for (int64_t h = 0; h < heads; ++h) int8_probabilities(states[h], ctx, nq);
  int8_values(states, vs, table, nblocks, head0, heads, B, nq, dim);
}
#endif

#if defined(QUANT_AVX2)
// ---- AVX2 + FMA (machines without AVX-512): sealed blocks read in place.
//
// Each row's codes are widened to fp32 8 channels at a time as the dot products and the
// weighted sum read them (exactly: int8, nibbles and fp8 are all floats), and the format's
// scales enter once per row, group or channel rather than once per element:
//   int8 K   s[t] = scale[t] * (q . k8[t])
//   int4 K   s[t] = (q * scale) . k4[t] + q . minimum            (per channel over the block)
//   int8 V   acc += sum_t (p[t] scale[t]) v8[t]
//   int4 V   acc_g += sum_t (p[t] scale[t][g]) v4[t]_g + sum_t p[t] minimum[t][g]   (group g)
//   fp8      e5m2 is the upper byte of an fp16; e4m3 moved into an fp16 is 2^-8 of itself.
// A task with many query vectors (a prompt chunk) would widen each row once per query tile;
// it widens each block once into a buffer instead: the same codes, the same arithmetic, the
// same bits. Tiles: up to 3 query vectors x 4 keys of dot products (12 of AVX2's 16
// registers hold the sums), 3 query vectors x 16 channels of the weighted sum.

constexpr int64_t QUERY_TILE = 3;
constexpr int64_t KEY_TILE = 4;
constexpr int64_t STREAM_MAX_QUERIES = 2 * QUERY_TILE;  // more: widen each block once
constexpr int64_t AVX2_AHEAD = 2;                       // sealed blocks prefetched ahead

using pagedllm_vec::exp256;
using pagedllm_vec::hmax;
using pagedllm_vec::hsum;
using pagedllm_vec::hsum4;
using pagedllm_vec::lanes;

// Each XRows gives channels [8c, 8c + 8) of row t of one head of one block as 8 floats, and
// ask(t) asks for row t of the same head of a block to be read later (if any): one line per
// row read, as widen_rows does.
struct FloatRows {
  const float* base;
  int64_t stride;  // floats
  __m256 operator()(int64_t t, int64_t c) const { return _mm256_loadu_ps(base + t * stride + 8 * c); }
  void ask(int64_t) const {}
};

struct ByteRows {
  const uint8_t* base;
  int64_t stride;       // bytes
  const uint8_t* next;  // the head's rows in the block read AVX2_AHEAD blocks later, or null
  int64_t row_bytes;
  void ask(int64_t t) const {
    if (next)
      for (int64_t l = 0; l < row_bytes; l += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next + t * stride + l), _MM_HINT_T0);
  }
};

struct Int8Rows : ByteRows {
  __m256 operator()(int64_t t, int64_t c) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(base + t * stride + 8 * c));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
  }
};

// Byte i holds channels 2i (low nibble) and 2i + 1: lane j of 4 bytes read as an int32 is
// that int shifted right by 4j.
struct Int4Rows : ByteRows {
  __m256 operator()(int64_t t, int64_t c) const {
    int32_t bits;
    std::memcpy(&bits, base + t * stride + 4 * c, sizeof(bits));
    const __m256i shifted = _mm256_srlv_epi32(_mm256_set1_epi32(bits), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28));
    return _mm256_cvtepi32_ps(_mm256_and_si256(shifted, _mm256_set1_epi32(0xF)));
  }
};

struct E5m2Rows : ByteRows {
  __m256 operator()(int64_t t, int64_t c) const {
    const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(base + t * stride + 8 * c));
    return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
  }
};

// Sign to bit 15, exponent and mantissa to bits 13..7: an fp16 (subnormals included) of
// 2^-8 times the value. 0x7F and 0xFF (e4m3's NaNs) would read as +-480; the codec
// saturates and never writes them.
struct E4m3Rows : ByteRows {
  __m256 operator()(int64_t t, int64_t c) const {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(base + t * stride + 8 * c)));
    const __m128i sign = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8);
    const __m128i rest = _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7);
    return _mm256_mul_ps(_mm256_cvtph_ps(_mm_or_si128(sign, rest)), _mm256_set1_ps(256.0f));
  }
};

// n fp16 values `stride` apart as floats in out[0, n), zeros in out[n, padded) (padded: a
// multiple of 8). The halves are gathered in a register: built in memory, 16 bits at a time,
// the vector read back waits for every store.
inline void halves(const c10::Half* p, int64_t stride, int64_t n, int64_t padded, float* out) {
  for (int64_t i = 0; i < padded; i += 8) {
    const int64_t m = n - i;
    const c10::Half* at = p + std::min(i, n) * stride;
    __m128i bits;
    if (stride == 1 && m >= 8) {
      bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
    } else {
      bits = _mm_setzero_si128();
      if (m > 0) bits = _mm_insert_epi16(bits, at[0].x, 0);
      if (m > 1) bits = _mm_insert_epi16(bits, at[stride].x, 1);
      if (m > 2) bits = _mm_insert_epi16(bits, at[2 * stride].x, 2);
      if (m > 3) bits = _mm_insert_epi16(bits, at[3 * stride].x, 3);
      if (m > 4) bits = _mm_insert_epi16(bits, at[4 * stride].x, 4);
      if (m > 5) bits = _mm_insert_epi16(bits, at[5 * stride].x, 5);
      if (m > 6) bits = _mm_insert_epi16(bits, at[6 * stride].x, 6);
      if (m > 7) bits = _mm_insert_epi16(bits, at[7 * stride].x, 7);
    }
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(bits));
  }
}

// The terms of a block's scores: s[t] = (q[qi] . rows[t]) * row_scale[t] + q_bias[qi]
// (null: no such term); q: [nq][dim].
struct KeyTerms {
  const float* q;
  const float* row_scale;
  const float* q_bias;
};

// The terms of a block's weighted sum, per group of `group` channels: coefficients
// p[t] * row_scale[g][t] and the constant sum_t p[t] row_min[g][t] (null: none).
struct ValueTerms {
  const float* row_scale;
  const float* row_min;
  int64_t groups, group;
};

// The scores of NQ query vectors (`dim` apart) against keys [t0, t0 + 4) into out (rows
// `width` apart). A key at or past n reads row t0 instead, its sums unused: every key's
// sum is the same whichever tile took it.
template <int NQ, class Rows>
inline void score_tile(const Rows& rows, const float* q, int64_t dim, int64_t t0, int64_t n, float* out,
                       int64_t width, bool ask) {
  __m256 acc[KEY_TILE][NQ];
  int64_t t[KEY_TILE];
  for (int64_t i = 0; i < KEY_TILE; ++i) {
    t[i] = t0 + i < n ? t0 + i : t0;
    if (ask && t0 + i < n) rows.ask(t0 + i);
    for (int j = 0; j < NQ; ++j) acc[i][j] = _mm256_setzero_ps();
  }
  for (int64_t c = 0; c < dim / 8; ++c) {
    __m256 qv[NQ];
    for (int j = 0; j < NQ; ++j) qv[j] = _mm256_loadu_ps(q + j * dim + 8 * c);
    for (int64_t i = 0; i < KEY_TILE; ++i) {
      const __m256 k = rows(t[i], c);
      for (int j = 0; j < NQ; ++j) acc[i][j] = _mm256_fmadd_ps(qv[j], k, acc[i][j]);
    }
  }
  for (int j = 0; j < NQ; ++j) {
    const __m256 sums[KEY_TILE] = {acc[0][j], acc[1][j], acc[2][j], acc[3][j]};
    _mm_storeu_ps(out + j * width + t0, hsum4(sums));
  }
}

// The dot products of every query with keys [0, limit[qi]) (rows of st.scores).
template <class Rows>
void score_rows(const Rows& rows, const float* q, State& st, const int64_t* limit, int64_t nq, int64_t dim) {
  const int64_t width = st.width;
  for (int64_t q0 = 0; q0 < nq; q0 += QUERY_TILE) {
    const int64_t m = std::min(QUERY_TILE, nq - q0);
    const int64_t n = *std::max_element(limit + q0, limit + q0 + m);
    float* out = st.scores.data() + q0 * width;
    const float* qt = q + q0 * dim;
    for (int64_t t0 = 0; t0 < n; t0 += KEY_TILE) {
      if (m == 3)
        score_tile<3>(rows, qt, dim, t0, n, out, width, q0 == 0);
      else if (m == 2)
        score_tile<2>(rows, qt, dim, t0, n, out, width, q0 == 0);
      else
        score_tile<1>(rows, qt, dim, t0, n, out, width, q0 == 0);
    }
  }
}

// Scores to the block's terms, then the online softmax of each query over keys [0,
// limit[qi]): st.probs holds exp(s - max) there and zeros up to width, st.rescale the factor
// its earlier sums take.
void softmax_rows(State& st, const KeyTerms& kt, const int64_t* limit, int64_t nq) {
  const int64_t width = st.width;
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t qi = 0; qi < nq; ++qi) {
    const int64_t n = std::max<int64_t>(limit[qi], 0);
    float* s = st.scores.data() + qi * width;
    float* p = st.probs.data() + qi * width;
    const __m256 bias = _mm256_set1_ps(kt.q_bias ? kt.q_bias[qi] : 0.0f);
    __m256 vmax = neg_inf;
    for (int64_t t = 0; t < n; t += 8) {
      const __m256i m = lanes(n - t);
      __m256 x = _mm256_maskload_ps(s + t, m);
      if (kt.row_scale) x = _mm256_mul_ps(x, _mm256_loadu_ps(kt.row_scale + t));
      if (kt.q_bias) x = _mm256_add_ps(x, bias);
      x = _mm256_blendv_ps(neg_inf, x, _mm256_castsi256_ps(m));
      _mm256_storeu_ps(s + t, x);
      vmax = _mm256_max_ps(vmax, x);
    }
    const float old = st.max[qi];
    const float mx = std::max(old, hmax(vmax));
    const __m256 vmx = _mm256_set1_ps(mx);
    __m256 vsum = _mm256_setzero_ps();
    for (int64_t t = 0; t < width; t += 8) {
      const __m256 live = _mm256_castsi256_ps(lanes(n - t));
      const __m256 e = t < n ? _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_loadu_ps(s + t), vmx)), live)
                             : _mm256_setzero_ps();
      _mm256_storeu_ps(p + t, e);
      vsum = _mm256_add_ps(vsum, e);
    }
    const float c = old == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp(old - mx);
    st.sum[qi] = st.sum[qi] * c + hsum(vsum);
    st.max[qi] = n > 0 ? mx : old;
    st.rescale[qi] = n > 0 ? c : 1.0f;
  }
}

// acc[j] (channels [8 c0, 8 c0 + 8 NC)) = acc[j] * c[j] + sum_{t < n} coef[j][t] rows[t]
// (+ bias[j]).
template <int NQ, int NC, class Rows>
inline void value_tile(const Rows& rows, const float* const* coef, const float* c, const float* bias, int64_t n,
                       int64_t c0, float* const* acc, bool ask) {
  __m256 a[NQ][NC];
  for (int j = 0; j < NQ; ++j)
    for (int k = 0; k < NC; ++k) a[j][k] = _mm256_mul_ps(_mm256_loadu_ps(acc[j] + 8 * (c0 + k)), _mm256_set1_ps(c[j]));
  for (int64_t t = 0; t < n; ++t) {
    if (ask) rows.ask(t);
    __m256 v[NC];
    for (int k = 0; k < NC; ++k) v[k] = rows(t, c0 + k);
    for (int j = 0; j < NQ; ++j) {
      const __m256 w = _mm256_broadcast_ss(coef[j] + t);
      for (int k = 0; k < NC; ++k) a[j][k] = _mm256_fmadd_ps(w, v[k], a[j][k]);
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int k = 0; k < NC; ++k) {
      if (bias) a[j][k] = _mm256_add_ps(a[j][k], _mm256_set1_ps(bias[j]));
      _mm256_storeu_ps(acc[j] + 8 * (c0 + k), a[j][k]);
    }
}

// `ask`: the group's first tile asks for the rows ahead.
template <int NQ, class Rows>
void value_group(const Rows& rows, const float* const* coef, const float* c, const float* bias, int64_t n,
                 int64_t first, int64_t last, float* const* acc, bool ask) {
  int64_t ch = first;
  for (; ch + 2 <= last; ch += 2) value_tile<NQ, 2>(rows, coef, c, bias, n, ch, acc, ask && ch == first);
  if (ch < last) value_tile<NQ, 1>(rows, coef, c, bias, n, ch, acc, ask && ch == first);
}

// The probabilities' coefficients and constants for the value terms (st.coef [nq][groups]
// [width], st.v_bias [nq][groups]), then acc = acc * rescale + the block's weighted rows.
template <class Rows>
void value_rows(const Rows& rows, const ValueTerms& vt, State& st, const int64_t* limit, int64_t nq,
                int64_t dim) {
  const int64_t width = st.width, G = vt.groups;
  if (vt.row_scale) {
    st.coef.resize(nq * G * width);
    for (int64_t qi = 0; qi < nq; ++qi)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t t = 0; t < width; t += 8)
          _mm256_storeu_ps(st.coef.data() + (qi * G + g) * width + t,
                           _mm256_mul_ps(_mm256_loadu_ps(st.probs.data() + qi * width + t),
                                         _mm256_loadu_ps(vt.row_scale + g * width + t)));
  }
  if (vt.row_min) {
    st.v_bias.resize(nq * G);
    for (int64_t qi = 0; qi < nq; ++qi)
      for (int64_t g = 0; g < G; ++g) {
        __m256 b = _mm256_setzero_ps();
        for (int64_t t = 0; t < width; t += 8)
          b = _mm256_fmadd_ps(_mm256_loadu_ps(st.probs.data() + qi * width + t),
                              _mm256_loadu_ps(vt.row_min + g * width + t), b);
        st.v_bias[qi * G + g] = hsum(b);
      }
  }
  for (int64_t q0 = 0; q0 < nq; q0 += QUERY_TILE) {
    const int64_t m = std::min(QUERY_TILE, nq - q0);
    const int64_t n = *std::max_element(limit + q0, limit + q0 + m);
    if (n <= 0) continue;
    for (int64_t g = 0; g < G; ++g) {
      const float* coef[QUERY_TILE];
      float* acc[QUERY_TILE];
      float bias[QUERY_TILE];
      for (int64_t j = 0; j < m; ++j) {
        const int64_t qi = q0 + j;
        coef[j] = vt.row_scale ? st.coef.data() + (qi * G + g) * width : st.probs.data() + qi * width;
        acc[j] = st.acc.data() + qi * dim;
        bias[j] = vt.row_min ? st.v_bias[qi * G + g] : 0.0f;
      }
      const float* c = st.rescale.data() + q0;
      const float* b = vt.row_min ? bias : nullptr;
      const int64_t first = g * vt.group / 8, last = (g + 1) * vt.group / 8;
      const bool ask = q0 == 0 && g == 0;
      if (m == 3)
        value_group<3>(rows, coef, c, b, n, first, last, acc, ask);
      else if (m == 2)
        value_group<2>(rows, coef, c, b, n, first, last, acc, ask);
      else
        value_group<1>(rows, coef, c, b, n, first, last, acc, ask);
    }
  }
}

// Calls f with rows of one head of sealed block `block` of side s: read in place, or
// widened into `buffer` first ([B][dim] floats) when `widen`. Each row read asks for the
// same row of block `next` (if >= 0).
template <class F>
void with_rows(const Side& s, int64_t block, int64_t next, int64_t head, int64_t B, int64_t dim, bool widen,
               float* buffer, F&& f) {
  const ByteRows bytes{s.data + block * s.data_block + head * s.data_head, s.data_token,
                       next >= 0 ? s.data + next * s.data_block + head * s.data_head : nullptr,
                       s.kind == INT4_CHANNEL || s.kind == INT4_TOKEN ? dim / 2 : dim};
  auto go = [&](const auto& rows) {
    if (!widen) return f(rows);
    for (int64_t t = 0; t < B; ++t) {
      rows.ask(t);
      for (int64_t c = 0; c < dim / 8; ++c) _mm256_storeu_ps(buffer + t * dim + 8 * c, rows(t, c));
    }
    f(FloatRows{buffer, dim});
  };
  if (s.kind == INT8)
    go(Int8Rows{bytes});
  else if (s.kind == INT4_CHANNEL || s.kind == INT4_TOKEN)
    go(Int4Rows{bytes});
  else if (s.kind == FP8_E4M3)
    go(E4m3Rows{bytes});
  else
    go(E5m2Rows{bytes});
}

// The formats the fused path reads (K: int8, int4 per channel, fp8; V: int8, int4 per
// token, fp8); another pairing is dequantized into fp32 rows first.
inline bool fused_k(int64_t kind) { return kind != INT4_TOKEN; }
inline bool fused_v(int64_t kind) { return kind != INT4_CHANNEL; }

// Key terms of one head of sealed block `block` (int8's row scales; int4's scaled queries
// and constants in st.kq and st.q_bias).
KeyTerms key_terms(const Side& s, int64_t block, int64_t head, int64_t B, State& st, int64_t nq, int64_t dim) {
  if (s.kind == INT8) {
    st.k_scale.resize(st.width);
    halves(s.scale + block * s.scale_block + head * s.scale_b, s.scale_a, B, st.width, st.k_scale.data());
    return {st.q.data(), st.k_scale.data(), nullptr};
  }
  if (s.kind != INT4_CHANNEL) return {st.q.data(), nullptr, nullptr};
  st.k_scale.resize(2 * dim);
  float* scale = st.k_scale.data();
  float* minimum = scale + dim;
  halves(s.scale + block * s.scale_block + head * s.scale_a, s.scale_b, dim, dim, scale);
  halves(s.minimum + block * s.scale_block + head * s.scale_a, s.scale_b, dim, dim, minimum);
  st.kq.resize(nq * dim);
  st.q_bias.resize(nq);
  for (int64_t qi = 0; qi < nq; ++qi) {
    const float* q = st.q.data() + qi * dim;
    __m256 b = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      _mm256_storeu_ps(st.kq.data() + qi * dim + d, _mm256_mul_ps(qv, _mm256_loadu_ps(scale + d)));
      b = _mm256_fmadd_ps(qv, _mm256_loadu_ps(minimum + d), b);
    }
    st.q_bias[qi] = hsum(b);
  }
  return {st.kq.data(), nullptr, st.q_bias.data()};
}

// Value terms of one head of sealed block `block` (int8's row scales; int4's scales and
// minimums per token and group), [groups][width] with zeros past B.
ValueTerms value_terms(const Side& s, int64_t block, int64_t head, int64_t B, State& st, int64_t dim) {
  const int64_t width = st.width;
  if (s.kind == INT8) {
    st.v_scale.resize(width);
    halves(s.scale + block * s.scale_block + head * s.scale_b, s.scale_a, B, width, st.v_scale.data());
    return {st.v_scale.data(), nullptr, 1, dim};
  }
  if (s.kind != INT4_TOKEN) return {nullptr, nullptr, 1, dim};
  const int64_t groups = dim / s.group;
  st.v_scale.resize(2 * groups * width);
  float* scale = st.v_scale.data();
  float* minimum = scale + groups * width;
  const int64_t at = block * s.scale_block + head * s.scale_b;
  for (int64_t g = 0; g < groups; ++g) {
    halves(s.scale + at + g * s.scale_c, s.scale_a, B, width, scale + g * width);
    halves(s.minimum + at + g * s.scale_c, s.scale_a, B, width, minimum + g * width);
  }
  return {scale, minimum, groups, s.group};
}

// Blocks sit at random addresses, so the hardware prefetcher stops at every block edge: the
// rows of a block to be read are asked for as rows are read (ByteRows::ask), its scales (a
// few lines for all heads) here.
inline void prefetch_scales(const Side& s, int64_t block) {
  for (const c10::Half* part : {s.scale, s.minimum}) {
    if (!part) continue;
    const char* at = reinterpret_cast<const char*>(part + block * s.scale_block);
    const int64_t bytes = s.scale_block * static_cast<int64_t>(sizeof(c10::Half));
    for (int64_t l = 0; l < bytes + 63; l += 64) _mm_prefetch(at + std::min(l, bytes - 1), _MM_HINT_T0);
  }
}

// Every query of the state (all of a block's B keys each) over one head of sealed block
// `block`; kf and vf: [B][dim] floats of scratch.
void attend_sealed_avx2(State& st, const Side& ks, const Side& vs, int64_t block, int64_t next, int64_t head,
                        int64_t B, int64_t nq, int64_t dim, const int64_t* limit, float* kf, float* vf) {
  st.width = (B + 7) / 8 * 8;
  st.scores.resize(nq * st.width);
  st.probs.resize(nq * st.width);
  st.rescale.resize(nq);
  const bool widen = nq > STREAM_MAX_QUERIES;
  if (fused_k(ks.kind)) {
    const KeyTerms kt = key_terms(ks, block, head, B, st, nq, dim);
    with_rows(ks, block, next, head, B, dim, widen, kf,
              [&](const auto& rows) { score_rows(rows, kt.q, st, limit, nq, dim); });
    softmax_rows(st, kt, limit, nq);
  } else {
    dequantize(ks, block, head, B, dim, kf);
    score_rows(FloatRows{kf, dim}, st.q.data(), st, limit, nq, dim);
    softmax_rows(st, {st.q.data(), nullptr, nullptr}, limit, nq);
  }
  if (fused_v(vs.kind)) {
    const ValueTerms vt = value_terms(vs, block, head, B, st, dim);
    with_rows(vs, block, next, head, B, dim, widen, vf,
              [&](const auto& rows) { value_rows(rows, vt, st, limit, nq, dim); });
  } else {
    dequantize(vs, block, head, B, dim, vf);
    value_rows(FloatRows{vf, dim}, {nullptr, nullptr, 1, dim}, st, limit, nq, dim);
  }
}

// Every query over keys/values [0, limit[qi]) of fp32 rows [n][dim] (the own block).
void attend_floats_avx2(State& st, const float* keys, const float* values, const int64_t* limit, int64_t B,
                        int64_t nq, int64_t dim) {
  st.width = (B + 7) / 8 * 8;
  st.scores.resize(nq * st.width);
  st.probs.resize(nq * st.width);
  st.rescale.resize(nq);
  score_rows(FloatRows{keys, dim}, st.q.data(), st, limit, nq, dim);
  softmax_rows(st, {st.q.data(), nullptr, nullptr}, limit, nq);
  value_rows(FloatRows{values, dim}, {nullptr, nullptr, 1, dim}, st, limit, nq, dim);
}
#endif

// The geometry of a task's queries: positions [lo, hi) of its sequence, nq query vectors.
struct Rows {
  int64_t q0, first, lo, hi, nq;
};

template <typename T>
Rows task_rows(const Args<T>& a, const Task& task) {
  const int64_t seq_len = a.seq_lens[task.seq];
  const int64_t q0 = a.query_start[task.seq];
  const int64_t first = seq_len - (a.query_start[task.seq + 1] - q0);
  const int64_t lo = std::max(first, task.block * a.block_size);
  const int64_t hi = std::min(seq_len, (task.block + 1) * a.block_size);
  return {q0, first, lo, hi, (hi - lo) * a.group};
}

// A fresh online state for kv head `head`'s queries (scaled, as fp32).
template <typename T>
void start_state(const Args<T>& a, const Rows& r, int64_t head, State& st) {
  const int64_t D = a.head_dim, G = a.group;
  st.q.resize(r.nq * D);
  st.acc.assign(r.nq * D, 0.0f);
  st.max.assign(r.nq, -std::numeric_limits<float>::infinity());
  st.sum.assign(r.nq, 0.0f);
  st.probs.resize(std::max<int64_t>(a.block_size, 16));
  for (int64_t p = r.lo; p < r.hi; ++p)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = (p - r.lo) * G + g;
      const T* src = a.query + (r.q0 + p - r.first) * a.q_token + (head * G + g) * a.q_head;
      for (int64_t d = 0; d < D; ++d) st.q[qi * D + d] = to_float(src[d]) * a.scale;
    }
}

// The own block (full precision from the window, each query up to its own position), then
// the normalized output of kv head `head`'s queries.
template <typename T>
void finish_state(const Args<T>& a, const Task& task, const Rows& r, int64_t head, State& st, float* kf,
                  float* vf, std::vector<int64_t>& limit) {
  const int64_t B = a.block_size, D = a.head_dim, G = a.group;
  const int64_t w = a.window_start[task.seq] + task.block - r.first / B;
  const int64_t own = r.hi - task.block * B;
  for (int64_t t = 0; t < own; ++t) {
    const int64_t off = w * a.win_block + t * a.win_token + head * a.win_head;
    for (int64_t d = 0; d < D; ++d) {
      kf[t * D + d] = to_float(a.k_window[off + d]);
      vf[t * D + d] = to_float(a.v_window[off + d]);
    }
  }
  limit.resize(r.nq);
  for (int64_t p = r.lo; p < r.hi; ++p)
    for (int64_t g = 0; g < G; ++g) limit[(p - r.lo) * G + g] = p - task.block * B + 1;
#if defined(QUANT_AVX2)
  if (a.avx2)
    attend_floats_avx2(st, kf, vf, limit.data(), B, r.nq, D);
  else
#endif
    attend_block(st, kf, vf, limit.data(), r.nq, D);
  for (int64_t p = r.lo; p < r.hi; ++p)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t qi = (p - r.lo) * G + g;
      T* dst = a.out + (r.q0 + p - r.first) * a.out_token + (head * G + g) * a.out_head;
      const float inv = 1.0f / st.sum[qi];
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(st.acc[qi * D + d] * inv);
    }
}

// Every query of the task over the sequence's unquantized first block (its staging slot).
template <typename T>
void attend_first_block(const Args<T>& a, const Task& task, State* states, float* kf, float* vf,
                        const int64_t* limit, int64_t nq) {
  const int64_t B = a.block_size, D = a.head_dim;
  const int64_t slot = a.first_slots[task.seq];
  for (int64_t h = 0; h < task.heads; ++h) {
    for (int64_t t = 0; t < B; ++t) {
      const int64_t off = slot * a.stage_slot + t * a.stage_token + (task.kv_head + h) * a.stage_head;
      for (int64_t d = 0; d < D; ++d) {
        kf[t * D + d] = to_float(a.k_stage[off + d]);
        vf[t * D + d] = to_float(a.v_stage[off + d]);
      }
    }
    attend_block(states[h], kf, vf, limit, nq, D);
  }
}

template <typename T>
void run_task(const Args<T>& a, const Task& task, std::vector<State>& states, std::vector<float>& kf,
              std::vector<float>& vf) {
  const int64_t B = a.block_size, D = a.head_dim;
  const Rows r = task_rows(a, task);
  states.resize(std::max<size_t>(states.size(), task.heads));
  for (int64_t h = 0; h < task.heads; ++h) start_state(a, r, task.kv_head + h, states[h]);
  const int32_t* table = a.tables + task.seq * a.table_stride;
  std::vector<int64_t> limit(r.nq, B);
  // Blocks [sealed0, task.block) of the table are sealed; block 0 may be unquantized.
  const bool first_staged = a.first_slots != nullptr && task.block > 0;
  const int64_t sealed0 = first_staged ? 1 : 0;
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  if (a.int8_fast && task.block > sealed0) {
    attend_int8_sealed(states.data(), a.k, a.v, table + sealed0, task.block - sealed0, task.kv_head, task.heads, B,
                       r.nq, D);
    if (first_staged) attend_first_block(a, task, states.data(), kf.data(), vf.data(), limit.data(), r.nq);
  } else
#endif
  {
    if (first_staged) attend_first_block(a, task, states.data(), kf.data(), vf.data(), limit.data(), r.nq);
#if defined(QUANT_AVX2)
    if (a.avx2) {
      // Block by block, the task's heads side by side: their rows share cache lines. Block j's
      // reads ask for block j + AHEAD's rows (the first AHEAD blocks are read cold).
      for (int64_t j = sealed0; j < task.block; ++j) {
        const int64_t next = j + AVX2_AHEAD < task.block ? table[j + AVX2_AHEAD] : -1;
        if (next >= 0) {
          prefetch_scales(a.k, next);
          prefetch_scales(a.v, next);
        }
        for (int64_t h = 0; h < task.heads; ++h)
          attend_sealed_avx2(states[h], a.k, a.v, table[j], next, task.kv_head + h, B, r.nq, D, limit.data(),
                             kf.data(), vf.data());
      }
    } else
#endif
      for (int64_t h = 0; h < task.heads; ++h)
        for (int64_t j = sealed0; j < task.block; ++j) {
          dequantize(a.k, table[j], task.kv_head + h, B, D, kf.data());
          dequantize(a.v, table[j], task.kv_head + h, B, D, vf.data());
          attend_block(states[h], kf.data(), vf.data(), limit.data(), r.nq, D);
        }
  }
  for (int64_t h = 0; h < task.heads; ++h)
    finish_state(a, task, r, task.kv_head + h, states[h], kf.data(), vf.data(), limit);
}

template <typename T>
void run(const Args<T>& a, int64_t num_seqs, int64_t num_kv_heads) {
  std::vector<Task> tasks;
  const int64_t B = a.block_size, threads = at::get_num_threads();
  int64_t query_blocks = 0;
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t seq_len = a.seq_lens[i];
    const int64_t first = seq_len - (a.query_start[i + 1] - a.query_start[i]);
    if (seq_len > first) query_blocks += (seq_len - 1) / B - first / B + 1;
  }
  // The int8 and AVX2 paths read a block's rows of all the task's heads together (they share
  // cache lines and pages): as many heads a task as still leaves a task per thread.
  int64_t heads = 1;
  if (a.int8_fast || a.avx2) {
    const int64_t splits = std::min(num_kv_heads, std::max<int64_t>(1, (threads + query_blocks - 1) / query_blocks));
    heads = (num_kv_heads + splits - 1) / splits;
  }
  for (int64_t i = 0; i < num_seqs; ++i) {
    const int64_t seq_len = a.seq_lens[i];
    const int64_t first = seq_len - (a.query_start[i + 1] - a.query_start[i]);
    if (seq_len <= first) continue;
    for (int64_t b = first / B; b <= (seq_len - 1) / B; ++b)
      for (int64_t h = 0; h < num_kv_heads; h += heads)
        tasks.push_back({i, h, std::min(heads, num_kv_heads - h), b, (b + 1) * std::min(heads, num_kv_heads - h)});
  }
  // Longest first, handed out dynamically.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(threads, static_cast<int64_t>(tasks.size()));
  // In chunks (parallel.h): inside a decode step's team, the helpers take part when free.
  pagedllm_parallel::parallel_chunks(std::max<int64_t>(workers, 1), 1, [&](int64_t, int64_t) {
    std::vector<State> states;
    std::vector<float> kf(B * a.head_dim), vf(B * a.head_dim);
    for (int64_t t = next++; t < static_cast<int64_t>(tasks.size()); t = next++) run_task(a, tasks[t], states, kf, vf);
  });
}

Side make_side(const at::Tensor& data, const std::optional<at::Tensor>& scale,
               const std::optional<at::Tensor>& minimum, int64_t kind) {
  TORCH_CHECK(data.dim() == 4 && data.element_size() == 1, "quantized data must be 4-D bytes");
  TORCH_CHECK(kind >= INT8 && kind <= FP8_E5M2, "unknown quantized format ", kind);
  const bool scaled = kind <= INT4_TOKEN;
  TORCH_CHECK(!scaled || (scale.has_value() && scale->scalar_type() == at::kHalf &&
                           scale->dim() == (kind == INT4_TOKEN ? 4 : 3)),
              "this format needs fp16 scales");
  TORCH_CHECK(kind != INT4_TOKEN || (data.size(3) * 2) % scale->size(3) == 0, "bad int4 groups");
  TORCH_CHECK(kind == INT8 || !scaled || (minimum.has_value() && minimum->sizes() == scale->sizes() &&
                                           minimum->strides() == scale->strides()),
              "int4 needs fp16 minimums shaped like its scales");
  TORCH_CHECK(data.stride(3) == 1, "quantized rows must be contiguous");
  Side s{kind, reinterpret_cast<const uint8_t*>(data.data_ptr()), nullptr, nullptr,
         data.stride(0), data.stride(1), data.stride(2), 0, 0, 0, 0, 1};
  if (scaled) {
    s.scale = scale->data_ptr<c10::Half>();
    s.scale_block = scale->stride(0);
    s.scale_a = scale->stride(1);
    s.scale_b = scale->stride(2);
    if (kind == INT4_TOKEN) {
      s.scale_c = scale->stride(3);
      s.group = data.size(3) * 2 / scale->size(3);
    }
    if (kind != INT8) s.minimum = minimum->data_ptr<c10::Half>();
  }
  return s;
}

void quant_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& k_data,
                     const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& k_min,
                     int64_t k_kind, const at::Tensor& v_data, const std::optional<at::Tensor>& v_scale,
                     const std::optional<at::Tensor>& v_min, int64_t v_kind, const at::Tensor& k_window,
                     const at::Tensor& v_window, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const at::Tensor& window_start, const at::Tensor& k_stage,
                     const at::Tensor& v_stage, const at::Tensor& first_slots, double scale, bool plain) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [T, H, D] alike");
  TORCH_CHECK(query.scalar_type() == out.scalar_type() && query.scalar_type() == k_window.scalar_type() &&
                  k_window.scalar_type() == v_window.scalar_type(),
              "query, out and windows must share a dtype");
  TORCH_CHECK(query.scalar_type() == at::kFloat || query.scalar_type() == at::kBFloat16,
              "float32 or bfloat16 only");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_window.dim() == 4 && k_window.sizes() == v_window.sizes() && k_window.is_contiguous() &&
                  v_window.is_contiguous(),
              "windows must be contiguous [W, B, H, D]");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc, &window_start})
    TORCH_CHECK(t->scalar_type() == at::kInt && t->stride(-1) == 1, "metadata must be int32, unit stride");
  const int64_t num_heads = query.size(1), head_dim = query.size(2), num_kv_heads = k_window.size(2);
  TORCH_CHECK(head_dim == k_window.size(3) && head_dim <= 512 && head_dim % 2 == 0, "bad head_dim");
  const bool staged_first = first_slots.numel() > 0;
  if (staged_first) {
    TORCH_CHECK(first_slots.scalar_type() == at::kInt && first_slots.dim() == 1 &&
                    first_slots.size(0) == seq_lens.size(0) && first_slots.is_contiguous(),
                "first_slots must be int32, one per sequence");
    TORCH_CHECK(k_stage.dim() == 4 && k_stage.sizes() == v_stage.sizes() && k_stage.strides() == v_stage.strides() &&
                    k_stage.scalar_type() == query.scalar_type() && v_stage.scalar_type() == query.scalar_type() &&
                    k_stage.size(1) == k_window.size(1) && k_stage.size(2) == num_kv_heads &&
                    k_stage.size(3) == head_dim && k_stage.stride(3) == 1,
                "stages must be [slots, B, H, D] in the query's dtype, rows contiguous");
    const int32_t* slots = first_slots.data_ptr<int32_t>();
    for (int64_t i = 0; i < first_slots.size(0); ++i)
      TORCH_CHECK(slots[i] >= 0 && slots[i] < k_stage.size(0), "first slot out of range");
  }
  TORCH_CHECK(num_heads % num_kv_heads == 0, "query heads must be a multiple of kv heads");
  auto dispatch = [&](auto tag) {
    using T = decltype(tag);
    Args<T> a{};
    a.query = query.data_ptr<T>();
    a.q_token = query.stride(0);
    a.q_head = query.stride(1);
    a.out = out.data_ptr<T>();
    a.out_token = out.stride(0);
    a.out_head = out.stride(1);
    a.k = make_side(k_data, k_scale, k_min, k_kind);
    a.v = make_side(v_data, v_scale, v_min, v_kind);
    a.k_window = k_window.data_ptr<T>();
    a.v_window = v_window.data_ptr<T>();
    a.win_block = k_window.stride(0);
    a.win_token = k_window.stride(1);
    a.win_head = k_window.stride(2);
    a.tables = block_tables.data_ptr<int32_t>();
    a.table_stride = block_tables.stride(0);
    a.seq_lens = seq_lens.data_ptr<int32_t>();
    a.query_start = query_start_loc.data_ptr<int32_t>();
    a.window_start = window_start.data_ptr<int32_t>();
    if (staged_first) {
      a.k_stage = k_stage.data_ptr<T>();
      a.v_stage = v_stage.data_ptr<T>();
      a.stage_slot = k_stage.stride(0);
      a.stage_token = k_stage.stride(1);
      a.stage_head = k_stage.stride(2);
      a.first_slots = first_slots.data_ptr<int32_t>();
    }
    a.block_size = k_window.size(1);
    a.head_dim = head_dim;
    a.group = num_heads / num_kv_heads;
    a.scale = static_cast<float>(scale);
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
    a.int8_fast = !plain && int8_fast(a.k, a.v, head_dim);
#elif defined(QUANT_AVX2)
    a.avx2 = !plain && head_dim % 8 == 0;
#else
    (void)plain;  // no vector path to turn off
#endif
    run(a, seq_lens.size(0), num_kv_heads);
  };
  if (query.scalar_type() == at::kFloat)
    dispatch(float{});
  else
    dispatch(c10::BFloat16{});
}

// The vector path of this build (for the route's wording): "avx512_vnni" (int8 K and V on
// integer dot products, fp32 tiles for the rest), "avx512", "avx2" (AVX2 + FMA + F16C,
// head_dim a multiple of 8) or "scalar".
std::string quant_attention_isa() {
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(QUANT_AVX2)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "quant_attention(Tensor(a!) out, Tensor query, Tensor k_data, Tensor? k_scale, Tensor? k_min, "
      "int k_kind, Tensor v_data, Tensor? v_scale, Tensor? v_min, int v_kind, Tensor k_window, "
      "Tensor v_window, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "Tensor window_start, Tensor k_stage, Tensor v_stage, Tensor first_slots, float scale, "
      "bool plain=False) -> ()");
  m.def("quant_attention_isa() -> str", &quant_attention_isa);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("quant_attention", &quant_attention); }
