// Prompt attention with AVX-512-bf16 dot products (vdpbf16ps) and no tile unit.
//
// A task (one sequence, one kv head, a range of query rows) holds M = rows x group query
// vectors. The context is walked in blocks of KB keys; for each block:
//   1. K rows are transposed into pairs of dims x keys (the layout small_gemm reads its weights
//      in), V rows interleaved into pairs of keys x dims: both once per block, for all M vectors;
//   2. scores = Q K^T in register blocks of 4 query vectors x 64 keys (each step broadcasts a
//      pair of one query's dims and multiplies it into 16 keys), scaled and masked causally;
//   3. online softmax per query vector: running max and sum in fp32 (base 2), exp(score - max) rounded
//      to bf16 (as SDPA's flash kernel rounds its probabilities), earlier sums rescaled;
//   4. acc += P V in register blocks of query vectors x head_dim (each step broadcasts a pair
//      of one query's probabilities and multiplies it into a pair of V rows).
// Causal skipping: blocks run from the first key the task's first row sees (a sliding
// window's start) to the last key its last row sees, and the query vectors of rows that see
// none of a block skip it. Soft-capping (Gemma 2) applies cap * tanh(score / cap) to the scaled
// scores. The output is acc / sum, rounded once to bf16.

#include "prefill_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedllm_prefill {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
namespace {

using pagedllm_vec::softcap512;
using pagedllm_vec::tail_mask;
using pagedllm_vec::to_bf16;
using pagedllm_vec::transpose16;

constexpr int64_t KB = 64;      // keys per block: 4 vectors of 16 lanes
constexpr int KG = KB / 16;     // key groups of 16 per block
constexpr int QK_ROWS = 4;      // query vectors per register block of the scores

// 2^x for x <= 0 (0 below -126): a degree-5 polynomial on [-1/2, 1/2] (relative error ~2e-6,
// far below the bf16 rounding of the probabilities) and scalef for 2^n.
inline __m512 exp2_neg(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

inline __m512i pair_at(const uint16_t* p, int64_t pair) {
  int32_t bits;
  std::memcpy(&bits, p + 2 * pair, sizeof(bits));
  return _mm512_set1_epi32(bits);
}

// The first key position that query position `pos` sees: 0 without a window.
inline int64_t first_key(int64_t window, int64_t pos) { return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0; }

// Element offset of context rows kmin .. kmax - 1 of the task's kv head (same for K and V),
// at [0, kmax - kmin): table entries before kmin's block are never read.
void row_offsets(const PrefillArgs& a, const PrefillTask& t, int64_t kmin, int64_t kmax, std::vector<int64_t>& off) {
  off.resize(kmax - kmin);
  const int64_t kv_off = t.kv_head * a.head_dim;
  for (int64_t bi = kmin / a.block_size, b0 = bi * a.block_size; b0 < kmax; b0 += a.block_size, ++bi) {
    const int64_t base = t.block_table[bi] * a.cache_stride_block + kv_off;
    const int64_t n = std::min(a.block_size, kmax - b0);
    for (int64_t o = std::max<int64_t>(0, kmin - b0); o < n; ++o) off[b0 + o - kmin] = base + o * a.cache_stride_token;
  }
}

// keys[p * KB + j] = dims (2p, 2p + 1) of key j of the block (n keys; zeros past them).
template <int NP>
void pack_keys(const uint16_t* kc, const int64_t* off, int64_t n, uint32_t* keys) {
  for (int g = 0; g < KG; ++g) {
    for (int c = 0; c < NP; ++c) {
      __m512i r[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t t = g * 16 + i;
        r[i] = t < n ? _mm512_loadu_si512(kc + off[t] + 32 * c) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int p = 0; p < 16; ++p) _mm512_store_si512(keys + (c * 16 + p) * KB + g * 16, r[p]);
    }
  }
}

// values[q * D + d] = (v[2q][d], v[2q + 1][d]) for the block's key pairs q < ceil(n / 2)
// (a missing odd key: zeros, never the cache's unwritten rows, whose bits may be NaN).
template <int NP>
void pack_values(const uint16_t* vc, const int64_t* off, int64_t n, uint32_t* values) {
  constexpr int D = NP * 32;
  alignas(64) static constexpr uint16_t lo_index[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                        37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                        11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t hi_index[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21,
                                                        53, 22, 54, 23, 55, 24, 56, 25, 57, 26, 58,
                                                        27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(lo_index);
  const __m512i hi = _mm512_load_si512(hi_index);
  for (int64_t q = 0; 2 * q < n; ++q) {
    const uint16_t* x = vc + off[2 * q];
    const uint16_t* y = 2 * q + 1 < n ? vc + off[2 * q + 1] : nullptr;
    for (int c = 0; c < NP; ++c) {
      const __m512i vx = _mm512_loadu_si512(x + 32 * c);
      const __m512i vy = y ? _mm512_loadu_si512(y + 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(values + q * D + 32 * c, _mm512_permutex2var_epi16(vx, lo, vy));
      _mm512_store_si512(values + q * D + 32 * c + 16, _mm512_permutex2var_epi16(vx, hi, vy));
    }
  }
}

// Prefetch the K and V rows of keys [t0, t1).
template <int NP>
void prefetch_rows(const PrefillArgs& a, const int64_t* off, int64_t t0, int64_t t1) {
  for (int64_t t = t0; t < t1; ++t)
    for (int l = 0; l < NP; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(a.k_cache + off[t]) + 64 * l, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(a.v_cache + off[t]) + 64 * l, _MM_HINT_T0);
    }
}

// Scores of MR query vectors against the block's 64 keys, then their online-softmax step:
// probabilities (bf16) into probs rows, the running max and sum updated, acc rows rescaled.
// Query vector r sees the block's keys [lo[r], hi[r]) (at least one).
template <int MR, int NP>
void scores_softmax(const uint16_t* const* q, const uint32_t* keys, const int64_t* lo, const int64_t* hi, float scale,
                    float softcap, float* row_max, float* row_sum, uint16_t* probs, float* acc) {
  constexpr int PAIRS = NP * 16;
  constexpr int D = NP * 32;
  __m512 s[MR][KG];
  for (int r = 0; r < MR; ++r)
    for (int g = 0; g < KG; ++g) s[r][g] = _mm512_setzero_ps();
  for (int p = 0; p < PAIRS; ++p) {
    __m512i b[KG];
    for (int g = 0; g < KG; ++g) b[g] = _mm512_load_si512(keys + p * KB + g * 16);
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = as_bh(pair_at(q[r], p));
      for (int g = 0; g < KG; ++g) s[r][g] = _mm512_dpbf16_ps(s[r][g], x, as_bh(b[g]));
    }
  }
  // Maxima and exponents in base 2: p = 2^(s log2(e) - max), one fused multiply-subtract.
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 to_log2 = softcap > 0.0f ? log2e : _mm512_mul_ps(vscale, log2e);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < MR; ++r) {
    __mmask16 valid[KG];
    __m512 mx = neg_inf;
    for (int g = 0; g < KG; ++g) {
      valid[g] = tail_mask(hi[r] - 16 * g) & static_cast<__mmask16>(~tail_mask(lo[r] - 16 * g));
      __m512 x = s[r][g];
      if (softcap > 0.0f) x = softcap512(_mm512_mul_ps(x, vscale), softcap);
      s[r][g] = _mm512_mask_mov_ps(neg_inf, valid[g], x);
      mx = _mm512_max_ps(mx, s[r][g]);
    }
    const float old_max = row_max[r];
    const float new_max = std::max(old_max, _mm512_reduce_max_ps(_mm512_mul_ps(mx, to_log2)));
    const __m512 vmax = _mm512_set1_ps(new_max);
    __m512 sum = _mm512_setzero_ps();
    for (int g = 0; g < KG; ++g) {
      const __m512 e = _mm512_maskz_mov_ps(valid[g], exp2_neg(_mm512_fmsub_ps(s[r][g], to_log2, vmax)));
      sum = _mm512_add_ps(sum, e);
      _mm256_store_si256(reinterpret_cast<__m256i*>(probs + r * KB + g * 16), to_bf16(e));
    }
    // The first block of a row has old_max = -inf: nothing summed yet to rescale.
    const float alpha = old_max == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp2(old_max - new_max);
    row_max[r] = new_max;
    // Sums kept per lane (16 a query vector), added up once at the end.
    float* lanes = row_sum + 16 * r;
    _mm512_store_ps(lanes, _mm512_fmadd_ps(_mm512_load_ps(lanes), _mm512_set1_ps(alpha), sum));
    if (alpha != 1.0f) {
      const __m512 va = _mm512_set1_ps(alpha);
      float* o = acc + r * D;
      for (int v = 0; v < D / 16; ++v) _mm512_store_ps(o + 16 * v, _mm512_mul_ps(_mm512_load_ps(o + 16 * v), va));
    }
  }
}

template <int NP>
void scores_softmax_rows(int mr, const uint16_t* const* q, const uint32_t* keys, const int64_t* lo, const int64_t* hi,
                         float scale, float softcap, float* row_max, float* row_sum, uint16_t* probs, float* acc) {
  switch (mr) {
    case 1: return scores_softmax<1, NP>(q, keys, lo, hi, scale, softcap, row_max, row_sum, probs, acc);
    case 2: return scores_softmax<2, NP>(q, keys, lo, hi, scale, softcap, row_max, row_sum, probs, acc);
    case 3: return scores_softmax<3, NP>(q, keys, lo, hi, scale, softcap, row_max, row_sum, probs, acc);
    default: return scores_softmax<4, NP>(q, keys, lo, hi, scale, softcap, row_max, row_sum, probs, acc);
  }
}

// acc rows [0, MR) += probs rows x the block's V, over its first `pairs` key pairs.
template <int MR, int NV>
void weighted_values(const uint16_t* probs, const uint32_t* values, int64_t pairs, float* acc) {
  constexpr int D = NV * 16;
  __m512 o[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) o[r][v] = _mm512_load_ps(acc + r * D + 16 * v);
  for (int64_t q = 0; q < pairs; ++q) {
    __m512i b[NV];
    for (int v = 0; v < NV; ++v) b[v] = _mm512_load_si512(values + q * D + 16 * v);
    for (int r = 0; r < MR; ++r) {
      const __m512bh x = as_bh(pair_at(probs + r * KB, q));
      for (int v = 0; v < NV; ++v) o[r][v] = _mm512_dpbf16_ps(o[r][v], x, as_bh(b[v]));
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_store_ps(acc + r * D + 16 * v, o[r][v]);
}

// Query vectors [m0, m0 + mr) (mr <= 4), in register blocks of 16 fp32 sums at most.
template <int NP>
void weighted_values_rows(int mr, const uint16_t* probs, const uint32_t* values, int64_t pairs, float* acc) {
  constexpr int NV = NP * 2;
  constexpr int D = NP * 32;
  constexpr int MR = 16 / NV;  // 4 rows for head_dim 64, 2 for 128
  int r = 0;
  for (; r + MR <= mr; r += MR) weighted_values<MR, NV>(probs + r * KB, values, pairs, acc + r * D);
  for (; r < mr; ++r) weighted_values<1, NV>(probs + r * KB, values, pairs, acc + r * D);
}

template <int NP>
void attend(const PrefillArgs& a, const PrefillTask& t, PrefillScratch& buf) {
  constexpr int D = NP * 32;
  const int64_t rows = t.row_end - t.row_begin;
  const int64_t M = rows * a.group;
  const int64_t kmax = t.first_pos + t.row_end;                 // past the last key its last row sees
  const int64_t kmin = first_key(a.window, t.first_pos + t.row_begin);  // the first its first row sees
  // Keys from here on are relative to kmin: key k is context position kmin + k.
  row_offsets(a, t, kmin, kmax, buf.offsets);
  const int64_t* off = buf.offsets.data();
  const int64_t nk = kmax - kmin;
  const int64_t head0 = t.kv_head * a.group;

  buf.queries.resize(M);
  for (int64_t m = 0; m < M; ++m)
    buf.queries[m] = a.query + (t.first_token + t.row_begin + m / a.group) * a.q_stride_token +
                     (head0 + m % a.group) * a.q_stride_head;
  buf.keys.resize(NP * 16 * KB);
  buf.values.resize(KB / 2 * D);
  buf.probs.resize(M * KB);
  buf.acc.assign(M * D, 0.0f);
  buf.row_max.assign(M, -std::numeric_limits<float>::infinity());
  buf.row_sum.assign(16 * M, 0.0f);

  prefetch_rows<NP>(a, off, 0, std::min(KB, nk));
  for (int64_t b0 = 0; b0 < nk; b0 += KB) {
    const int64_t n = std::min(KB, nk - b0);
    pack_keys<NP>(a.k_cache, off + b0, n, buf.keys.data());
    pack_values<NP>(a.v_cache, off + b0, n, buf.values.data());
    prefetch_rows<NP>(a, off, std::min(nk, b0 + KB), std::min(nk, b0 + 2 * KB));
    // The rows that see some of the block: from the first whose position reaches it to the
    // last whose window still does.
    const int64_t pos0 = t.first_pos + t.row_begin;  // position of the task's row 0
    const int64_t row_lo = std::max<int64_t>(0, kmin + b0 - pos0);
    const int64_t row_hi = a.window > 0 ? std::min(rows, kmin + b0 + n - 1 + a.window - pos0) : rows;
    for (int64_t m0 = row_lo * a.group; m0 < row_hi * a.group; m0 += QK_ROWS) {
      const int mr = static_cast<int>(std::min<int64_t>(QK_ROWS, row_hi * a.group - m0));
      int64_t lo[QK_ROWS], hi[QK_ROWS];
      for (int r = 0; r < mr; ++r) {
        const int64_t pos = pos0 + (m0 + r) / a.group;
        lo[r] = std::max<int64_t>(0, first_key(a.window, pos) - kmin - b0);
        hi[r] = std::min(n, pos + 1 - kmin - b0);
      }
      uint16_t* probs = buf.probs.data() + m0 * KB;
      float* acc = buf.acc.data() + m0 * D;
      scores_softmax_rows<NP>(mr, buf.queries.data() + m0, buf.keys.data(), lo, hi, a.scale, a.softcap,
                              buf.row_max.data() + m0, buf.row_sum.data() + 16 * m0, probs, acc);
      // Key pairs any of these vectors sees (the last one sees the furthest).
      const int64_t pairs = (hi[mr - 1] + 1) / 2;
      weighted_values_rows<NP>(mr, probs, buf.values.data(), pairs, acc);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(buf.row_sum.data() + 16 * m)));
    const float* src = buf.acc.data() + m * D;
    uint16_t* dst = a.out + (t.first_token + t.row_begin + m / a.group) * a.out_stride_token + (head0 + m % a.group) * D;
    for (int v = 0; v < D / 16; ++v)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * v),
                          to_bf16(_mm512_mul_ps(_mm512_load_ps(src + 16 * v), inv)));
  }
}

}  // namespace

bool prefill_applies(int64_t head_dim) { return head_dim == 64 || head_dim == 128; }

void attend_prefill(const PrefillArgs& a, const PrefillTask& task, PrefillScratch& scratch) {
  if (a.head_dim == 64) {
    attend<2>(a, task, scratch);
  } else {
    attend<4>(a, task, scratch);
  }
}

#else

bool prefill_applies(int64_t) { return false; }

void attend_prefill(const PrefillArgs&, const PrefillTask&, PrefillScratch&) {}

#endif

}  // namespace pagedllm_prefill
