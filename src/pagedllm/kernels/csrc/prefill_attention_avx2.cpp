// Prompt attention on AVX2 + FMA in fp32, over fp32 caches or bf16 caches widened as they are
// read (flash attention: an online softmax over blocks of keys, no row of scores of the whole
// context). paged_attention_avx2.cpp's two passes keep such a row per query vector: past ~1k
// keys the rows of a 16-row task outgrow L2 and SDPA was faster.
//
// A task is a range of query rows of one sequence and every query head of one kv head (GQA):
// M = rows x group query vectors, each attending to the keys its position sees through the
// block table. Lanes are query vectors throughout: the task's queries are transposed once
// into [head_dim][M] (scaled), the outputs accumulate in [head_dim][M], and a tile is up to 3
// slices of 8 query vectors (one ymm register each). K and V are read in place, one
// broadcast element at a time, so nothing is re-laid out per block. For each block of KB keys
// and each tile that sees some of it:
//   1. scores: for each dim, the tile's query slices loaded once and every key's element
//      broadcast into them (4 keys x 3 slices = 12 sums in registers);
//   2. online softmax per lane, all vertical (no horizontal sums): mask (causal, window),
//      soft-cap, running max, exp, running sum, earlier outputs rescaled where the max moved;
//   3. outputs += P V: for each key, its probabilities (the tile's slices) loaded once and 4 of
//      V's elements broadcast into them (4 dims x 3 slices).
// Keys before a task's first visible key (a sliding window's start) are never read; a tile
// skips the blocks none of its query vectors sees. The output is acc / sum per query vector.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "paged_attention.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_avx2.h"

namespace pagedllm_attn {
namespace {

using pagedllm_vec::exp256;
using pagedllm_vec::load_reg;
using pagedllm_vec::softcap256;

// Keys per block: each tile's probabilities for them ([KB][24] floats) stay in L1.
constexpr int64_t KB = 64;
// Room past a block's last key: score tiles run up to 8 keys past it (pointing at its last
// row, masked out).
constexpr int64_t KEY_PAD = 8;
// Query vectors per tile at most: 3 slices of 8.
constexpr int64_t TILE_LANES = 24;

// Slices in the next tile, of r left: 3 where it can (12 sums in registers), 2 for 4 and 2
// left (2 + 2 beats 3 + 1, whose 1-slice tile loads a vector per 8 FMAs), 1 for the last one.
inline int tile_slices(int64_t r) {
  if (r == 4 || r == 2) return 2;
  return r == 1 ? 1 : 3;
}

// The cache lines of the next block's K and V rows, prefetched a line at a time from the
// loop over the current block's V (its keys' rows sit at scattered addresses and come from
// L3: a task's context outgrows L2). All of a block's lines at once (512 for 64 keys of 64
// dims) would fill L1's miss buffers and stall the loads behind them.
struct NextRows {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* off = nullptr;  // element offsets of the rows, scaled by `elem` bytes
  int64_t elem = 4;
  int64_t lines = 1;  // lines per row
  int64_t row = 0, end = 0, line = 0;

  void step() {
    if (row >= end) return;
    const int64_t at = off[row] * elem + 64 * line;
    _mm_prefetch(k + at, _MM_HINT_T0);
    _mm_prefetch(v + at, _MM_HINT_T0);
    if (++line == lines) {
      line = 0;
      ++row;
    }
  }
  // Rows [t0, t1) next; whatever is left of the current ones, now.
  void next(int64_t t0, int64_t t1) {
    while (row < end) step();
    row = t0;
    end = t1;
    line = 0;
  }
};

// s[t][j] = q_j . k_t for keys t < KT and slices j < NS: queries qt ([dim][ld] floats,
// the tile's lanes at column 0), the tile's scores with a stride of 8 NS floats per key.
template <int NS, int KT, int D>
inline void score_tile(const float* qt, int64_t ld, const float* const* k, float* s) {
  __m256 acc[KT][NS];
  for (int t = 0; t < KT; ++t)
    for (int j = 0; j < NS; ++j) acc[t][j] = _mm256_setzero_ps();
  for (int d = 0; d < D; ++d) {
    __m256 q[NS];
    for (int j = 0; j < NS; ++j) q[j] = load_reg(qt + d * ld + 8 * j);
    for (int t = 0; t < KT; ++t) {
      const __m256 b = _mm256_broadcast_ss(k[t] + d);
      for (int j = 0; j < NS; ++j) acc[t][j] = _mm256_fmadd_ps(b, q[j], acc[t][j]);
    }
  }
  for (int t = 0; t < KT; ++t)
    for (int j = 0; j < NS; ++j) _mm256_store_ps(s + t * 8 * NS + 8 * j, acc[t][j]);
}

// acc[d][j] += sum_t p[t][j] v_t[d] over keys [kb, ke), DT dims at a time: acc rows of ld
// floats (the tile's lanes at column 0), p with a stride of 8 NS floats per key.
template <int NS, int DT, int D>
inline void value_tile(const float* p, const float* const* v, int64_t kb, int64_t ke, float* acc, int64_t ld,
                       NextRows& pf) {
  for (int d0 = 0; d0 < D; d0 += DT) {
    __m256 o[DT][NS];
    for (int i = 0; i < DT; ++i)
      for (int j = 0; j < NS; ++j) o[i][j] = _mm256_load_ps(acc + (d0 + i) * ld + 8 * j);
    for (int64_t t = kb; t < ke; ++t) {
      pf.step();
      const float* vt = v[t] + d0;
      __m256 pj[NS];
      for (int j = 0; j < NS; ++j) pj[j] = load_reg(p + t * 8 * NS + 8 * j);
      for (int i = 0; i < DT; ++i) {
        const __m256 b = _mm256_broadcast_ss(vt + i);
        for (int j = 0; j < NS; ++j) o[i][j] = _mm256_fmadd_ps(b, pj[j], o[i][j]);
      }
    }
    for (int i = 0; i < DT; ++i)
      for (int j = 0; j < NS; ++j) _mm256_store_ps(acc + (d0 + i) * ld + 8 * j, o[i][j]);
  }
}

// The lanes' visible keys and the softmax's state for one slice of 8 query vectors.
struct Slice {
  __m256i lo;  // first key each lane sees (relative to the task's first key)
  __m256i hi;  // past the last
  float* row_max;
  float* row_sum;
};

// The online-softmax step of one slice over keys [kb, ke) of the n-key block whose first key
// is `key0`: s (stride ls) holds their scores and gets exp(score - max), 0 where masked (and
// for keys past n: copies of the last row); the running max and sum are updated. Returns the
// factor that rescales the slice's outputs.
inline __m256 softmax_step(float* s, int64_t ls, int64_t kb, int64_t ke, int64_t n, int64_t key0, const Slice& sl,
                           bool masked, float softcap) {
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 mx = neg_inf;
  for (int64_t t = kb; t < ke; ++t) {
    __m256 x = _mm256_load_ps(s + t * ls);
    if (softcap > 0.0f) x = softcap256(x, softcap);
    if (t >= n) {
      x = neg_inf;
    } else if (masked) {
      const __m256i key = _mm256_set1_epi32(static_cast<int>(key0 + t));
      const __m256i seen = _mm256_andnot_si256(_mm256_cmpgt_epi32(sl.lo, key), _mm256_cmpgt_epi32(sl.hi, key));
      x = _mm256_blendv_ps(neg_inf, x, _mm256_castsi256_ps(seen));
    }
    _mm256_store_ps(s + t * ls, x);
    mx = _mm256_max_ps(mx, x);
  }
  const __m256 old_max = _mm256_load_ps(sl.row_max);
  const __m256 new_max = _mm256_max_ps(old_max, mx);
  // Lanes that have seen no key yet subtract 0, not -inf (no NaN): their terms are all masked.
  const __m256 sub = _mm256_blendv_ps(new_max, _mm256_setzero_ps(), _mm256_cmp_ps(new_max, neg_inf, _CMP_EQ_OQ));
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = kb; t < ke; ++t) {
    const __m256 x = _mm256_load_ps(s + t * ls);
    __m256 e = exp256(_mm256_sub_ps(x, sub));
    // exp256 clamps: a masked term would be 2^-126, not 0.
    if (masked) e = _mm256_and_ps(e, _mm256_cmp_ps(x, neg_inf, _CMP_NEQ_OQ));
    _mm256_store_ps(s + t * ls, e);
    sum = _mm256_add_ps(sum, e);
  }
  // exp(0) is exactly 1 (lanes whose max stayed); a lane's first keys rescale its zeros.
  const __m256 alpha = exp256(_mm256_sub_ps(old_max, sub));
  _mm256_store_ps(sl.row_max, new_max);
  _mm256_store_ps(sl.row_sum, _mm256_fmadd_ps(_mm256_load_ps(sl.row_sum), alpha, sum));
  return alpha;
}

// acc[d][0:8] *= alpha for every dim, unless every lane's factor is 1.
template <int D>
inline void rescale(float* acc, int64_t ld, __m256 alpha) {
  if (_mm256_movemask_ps(_mm256_cmp_ps(alpha, _mm256_set1_ps(1.0f), _CMP_NEQ_UQ)) == 0) return;
  for (int d = 0; d < D; ++d) _mm256_store_ps(acc + d * ld, _mm256_mul_ps(_mm256_load_ps(acc + d * ld), alpha));
}

// Pointers to the fp32 rows of keys [t0, t0 + n) (p[0, n)), then p[n, n + KEY_PAD) at the
// last of them: a fp32 cache's rows in place, a bf16 cache's widened into `scratch`.
template <typename T, int D>
void block_rows(const T* cache, const int64_t* off, int64_t t0, int64_t n, float* scratch, const float** p) {
  for (int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) {
      p[i] = cache + off[t0 + i];
    } else {
      const uint16_t* src = reinterpret_cast<const uint16_t*>(cache + off[t0 + i]);
      float* dst = scratch + i * D;
      for (int c = 0; c < D; c += 8) {
        const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
        _mm256_store_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
      }
      p[i] = dst;
    }
  }
  for (int64_t i = n; i < n + KEY_PAD; ++i) p[i] = p[n - 1];
}

// One tile (NS slices: lanes [c0, c0 + 8 NS) of the task) over keys [kb, ke) of the n-key
// block whose first key is key0 (kb, ke relative to it): scores, softmax step, outputs.
template <int NS, int D>
void tile_block(FlashScratch& s, int64_t ld, int64_t c0, const float* const* k, const float* const* v, int64_t kb,
                int64_t ke, int64_t n, int64_t key0, float softcap, NextRows& pf) {
  constexpr int KT = NS == 3 ? 4 : (NS == 2 ? 6 : 8);  // keys per score tile: 12, 12, 8 sums
  constexpr int DT = NS == 1 ? 8 : 4;                  // dims per output tile: 12, 8, 8 sums
  // Whole score tiles: the keys past the block's end point at its last row (block_rows).
  kb = kb / KT * KT;
  ke = kb + (ke - kb + KT - 1) / KT * KT;
  // Lanes' visible keys grow with their row: unmasked when the first lane sees up to ke and
  // the last from kb, and no key is past the block's end (a copy of its last row).
  const bool masked = s.lo[c0 + 8 * NS - 1] > key0 + kb || s.hi[c0] < key0 + ke || ke > n;
  float* probs = s.probs.data();
  for (int64_t t = kb; t < ke; t += KT) score_tile<NS, KT, D>(s.query.data() + c0, ld, k + t, probs + t * 8 * NS);
  for (int j = 0; j < NS; ++j) {
    const int64_t lane = c0 + 8 * j;
    const Slice sl{_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.lo.data() + lane)),
                   _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s.hi.data() + lane)), s.row_max.data() + lane,
                   s.row_sum.data() + lane};
    rescale<D>(s.acc.data() + lane, ld, softmax_step(probs + 8 * j, 8 * NS, kb, ke, n, key0, sl, masked, softcap));
  }
  value_tile<NS, DT, D>(probs, v, kb, ke, s.acc.data() + c0, ld, pf);
}

template <typename T, int D>
void attend_flash(const Args<T>& a, const Task& task, FlashScratch& s) {
  const int64_t seq = task.seq;
  const int64_t q0 = a.query_start_loc[seq];
  const int64_t first_pos = a.seq_lens[seq] - (a.query_start_loc[seq + 1] - q0);
  const int64_t M = (task.row_end - task.row_begin) * a.group;
  const int64_t ld = (M + 7) / 8 * 8;  // lanes, padded to whole slices
  const int64_t kmax = first_pos + task.row_end;                          // keys the last row sees
  const int64_t kmin = first_key(a.window, first_pos + task.row_begin);  // the first row's first
  const int64_t nk = kmax - kmin;  // key t below is context position kmin + t
  const int64_t* off =
      row_offsets(a, a.block_tables + seq * a.bt_stride, task.kv_head * D, kmin, kmax, s.offsets);
  const int64_t head0 = task.kv_head * a.group;

  // Lane m: row m / group, query head head0 + m % group; padding lanes repeat the last one.
  s.query.assign(D * ld, 0.0f);
  s.lo.resize(ld);
  s.hi.resize(ld);
  for (int64_t m = 0; m < ld; ++m) {
    const int64_t mm = std::min(m, M - 1);
    const Visible vis = visible(a, first_pos, task.row_begin + mm / a.group, kmin);
    s.lo[m] = static_cast<int32_t>(vis.lo);
    s.hi[m] = static_cast<int32_t>(vis.hi);
    if (m >= M) continue;
    const T* q = a.query + (q0 + task.row_begin + m / a.group) * a.q_stride_token + (head0 + m % a.group) * a.q_stride_head;
    for (int64_t d = 0; d < D; ++d) s.query[d * ld + m] = pagedllm_vec::to_float(q[d]) * a.scale;
  }
  s.acc.assign(D * ld, 0.0f);
  s.row_max.assign(ld, -std::numeric_limits<float>::infinity());
  s.row_sum.assign(ld, 0.0f);
  s.probs.resize((KB + KEY_PAD) * TILE_LANES);
  s.key_rows.resize(2 * (KB + KEY_PAD));
  if constexpr (!std::is_same_v<T, float>) s.rows.resize(2 * KB * D);
  const float** k = s.key_rows.data();
  const float** v = k + KB + KEY_PAD;
  const int64_t slices = ld / 8;

  NextRows pf{reinterpret_cast<const char*>(a.k_cache), reinterpret_cast<const char*>(a.v_cache), off,
              static_cast<int64_t>(sizeof(T)), (D * static_cast<int64_t>(sizeof(T)) + 63) / 64};
  pf.next(0, std::min(KB, nk));
  for (int64_t b0 = 0; b0 < nk; b0 += KB) {
    const int64_t n = std::min(KB, nk - b0);
    pf.next(std::min(nk, b0 + KB), std::min(nk, b0 + 2 * KB));
    block_rows<T, D>(a.k_cache, off, b0, n, s.rows.data(), k);
    block_rows<T, D>(a.v_cache, off, b0, n, s.rows.data() + KB * D, v);
    for (int64_t c = 0, ns; c < slices; c += ns) {
      ns = tile_slices(slices - c);
      const int64_t first = 8 * c, last = 8 * (c + ns) - 1;  // lanes' keys grow with their row
      const int64_t kb = std::max<int64_t>(0, s.lo[first] - b0);
      const int64_t ke = std::min<int64_t>(n, s.hi[last] - b0);
      if (kb >= ke) continue;  // no lane of the tile sees this block
      if (ns == 3) {
        tile_block<3, D>(s, ld, first, k, v, kb, ke, n, b0, a.softcap, pf);
      } else if (ns == 2) {
        tile_block<2, D>(s, ld, first, k, v, kb, ke, n, b0, a.softcap, pf);
      } else {
        tile_block<1, D>(s, ld, first, k, v, kb, ke, n, b0, a.softcap, pf);
      }
    }
  }

  for (int64_t m = 0; m < M; ++m) {
    T* dst = a.out + (q0 + task.row_begin + m / a.group) * a.out_stride_token + (head0 + m % a.group) * D;
    const float inv = 1.0f / s.row_sum[m];
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(s.acc[d * ld + m] * inv);
  }
}

}  // namespace

template <typename T>
bool attend_flash_avx2(const Args<T>& a, const Task& task, FlashScratch& scratch) {
  switch (a.head_dim) {
    case 32:
      attend_flash<T, 32>(a, task, scratch);
      return true;
    case 64:
      attend_flash<T, 64>(a, task, scratch);
      return true;
    case 128:
      attend_flash<T, 128>(a, task, scratch);
      return true;
    case 256:
      attend_flash<T, 256>(a, task, scratch);
      return true;
    default:
      return false;
  }
}

}  // namespace pagedllm_attn

#else  // no AVX2 + FMA: the scalar path takes every task

namespace pagedllm_attn {

template <typename T>
bool attend_flash_avx2(const Args<T>&, const Task&, FlashScratch&) {
  return false;
}

}  // namespace pagedllm_attn

#endif

namespace pagedllm_attn {
template bool attend_flash_avx2<float>(const Args<float>&, const Task&, FlashScratch&);
template bool attend_flash_avx2<c10::BFloat16>(const Args<c10::BFloat16>&, const Task&, FlashScratch&);
}  // namespace pagedllm_attn
