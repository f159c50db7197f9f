// Paged attention on AVX2 + FMA, for machines without AVX-512: paged_attention.cpp's tasks in
// fp32 arithmetic over fp32 caches, or bf16 caches widened to fp32 as they are read; head_dim
// 32, 64, 128 or 256. Windows and soft-capping as in paged_attention.cpp.
//
// One call takes a run of tasks that differ only in their kv head (task_groups' runs: one
// sequence and range of query rows) and reads each token's K/V rows for all those heads
// together: a block's rows are then one contiguous stretch of memory, read once (read one
// head at a time, a piece of each token row, the same blocks arrive more slowly).
//
// Two passes over the keys, as attend_vec: scores (every query vector of the run against each
// K row), softmax in fp32 over the keys each row sees, then the sum of V weighted by the
// unnormalised exponentials (divided by their sum at the end). AVX2 has 16 vector registers,
// so tiles are of up to 3 query vectors, and every loaded K/V vector serves all of them (the
// loads, two per cycle, bound this code before the FMAs do):
//  - scores: 4 keys x 3 (or 2) query vectors of 8-lane dot products in registers, summed
//    across lanes in one go: 8 sums packed into one vector by a tree of hadds, a ninth of a
//    full horizontal sum each;
//  - the weighted sum takes keys in chunks whose V rows (all the run's heads) stay in L1 while
//    every tile of query vectors passes over them, a tile being 3 (or 2) query vectors x 32
//    dims.
//
// The rows of a score per query vector and key outgrow L2 for long prompts: tasks of prompt
// rows (FLASH_MIN_VECTORS query vectors or more) go to prefill_attention_avx2.cpp's online
// softmax instead. exp, soft-capping, lane masks and horizontal sums: vec_avx2.h.

#include "paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#include "vec_avx2.h"

namespace pagedllm_attn {
namespace {

using pagedllm_vec::exp256;
using pagedllm_vec::hmax;
using pagedllm_vec::hsum;
using pagedllm_vec::hsum4;
using pagedllm_vec::lanes;
using pagedllm_vec::load_reg;
using pagedllm_vec::softcap256;

// Tasks of at least this many query vectors (rows x group: prompt rows) go to the flash
// prompt path (prefill_attention_avx2.cpp), one task at a time; smaller ones (decode, short
// chunks) to the two passes here.
constexpr int64_t FLASH_MIN_VECTORS = 16;

// Keys per scores group: 2 tiles of 4.
constexpr int64_t KEY_GROUP = 8;

// How far ahead of the key being read its K rows are prefetched (scores pass), in bytes of
// rows: half of L1. Blocks sit at random addresses, so the hardware prefetcher stops at
// every block edge.
constexpr int64_t PREFETCH_BYTES = 16384;
// The weighted sum's chunks of keys: this many bytes of fp32 V rows (all heads of the run),
// which stay in L1 while every query tile passes over them, the next chunk's prefetched.
constexpr int64_t CHUNK_ROW_BYTES = 16384;

// The run's geometry: its kv heads' element offsets within a token row, the span of the row
// they cover, and how many keys the prefetches and V chunks take.
struct Heads {
  const int64_t* offset;  // [n]: kv_head * D
  int64_t n;
  int64_t lines;          // cache lines from offset[0] to the end of the last head's row
  int64_t ahead;          // keys ahead of the one being read whose K rows are prefetched
  int64_t chunk;          // keys per V chunk: a multiple of KEY_GROUP
};

template <typename T, int D>
Heads run_heads(const Task* tasks, int64_t n, std::vector<int64_t>& offsets) {
  offsets.resize(n);
  for (int64_t h = 0; h < n; ++h) offsets[h] = tasks[h].kv_head * D;
  const int64_t span = (offsets[n - 1] - offsets[0] + D) * static_cast<int64_t>(sizeof(T));
  const int64_t row_bytes = n * D * static_cast<int64_t>(sizeof(float));
  const int64_t ahead = std::max<int64_t>(KEY_GROUP, PREFETCH_BYTES / span);
  const int64_t chunk = std::max<int64_t>(1, CHUNK_ROW_BYTES / row_bytes / KEY_GROUP) * KEY_GROUP;
  return {offsets.data(), n, (span + 63) / 64, ahead, chunk};
}

// ---- Vector math (exp256, lanes, hsum4, hmax, hsum: vec.h).

// The sums of the 8 lanes of each of a[0..7], as the 8 lanes of one vector in that order.
inline __m256 hsum8(const __m256* a) {
  const __m256 h01 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 h23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 h45 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 h67 = _mm256_hadd_ps(a[6], a[7]);
  // Each 128-bit half: the sums of a0..a3 (a4..a7) over that half's lanes.
  const __m256 h0123 = _mm256_hadd_ps(h01, h23);
  const __m256 h4567 = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(h0123, h4567, 0x20), _mm256_permute2f128_ps(h0123, h4567, 0x31));
}


// ---- Context rows.

// The cache lines of context rows, prefetched a few at a time between the loads of the rows
// being read (`step` in the tiles' inner loops). A key group's lines at once (96 for 3 kv
// heads of 64 dims) outnumber L1's miss buffers and hold up the loads behind them until they
// drain; spread out, memory and arithmetic overlap instead of taking turns.
template <typename T>
struct Prefetcher {
  const T* cache;
  const int64_t* off;
  int64_t lines;     // lines per row
  int64_t row = 0;   // the next line to prefetch: row `row`, line `line`
  int64_t line = 0;
  int64_t end = 0;   // rows before `end` may be prefetched
  int64_t per_step = 1;

  // Rows up to `row_end` may be prefetched, `n` lines per step from here on.
  void until(int64_t row_end, int64_t n) {
    end = std::max(end, row_end);
    per_step = n;
  }
  void step() {
    for (int64_t i = 0; i < per_step && row < end; ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(cache + off[row]) + 64 * line, _MM_HINT_T0);
      if (++line == lines) {
        line = 0;
        ++row;
      }
    }
  }
  void drain() {
    while (row < end) step();
  }
};

// fp32 pointers to context rows t0..t0+n-1 (p[0..n)): a fp32 cache's rows in place.
template <int D>
inline void fp32_rows(const float* cache, const int64_t* off, int64_t t0, int64_t n, float*, const float** p) {
  for (int64_t i = 0; i < n; ++i) p[i] = cache + off[t0 + i];
}

// A bf16 cache's rows widened into `scratch` (n x D floats; a bf16 is the top half of its
// fp32): once per row, not once per query vector that reads it.
template <int D>
inline void fp32_rows(const c10::BFloat16* cache, const int64_t* off, int64_t t0, int64_t n, float* scratch,
                      const float** p) {
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t* src = reinterpret_cast<const uint16_t*>(cache + off[t0 + i]);
    float* dst = scratch + i * D;
    for (int c = 0; c < D; c += 8) {
      const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c));
      _mm256_store_ps(dst + c, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16)));
    }
    p[i] = dst;
  }
}

// ---- Tiles of query vectors.

// How many of the r query vectors left the next tile takes: 3 where it can (the fewest loads
// per FMA that fit AVX2's 16 registers), 2 for 4 and 2 left (two 2-tiles beat 3 + 1: a
// 1-tile loads one vector per FMA), 1 for the last one.
inline int64_t tile_vectors(int64_t r) {
  if (r == 4 || r == 2) return 2;
  return r == 1 ? 1 : 3;
}

// ---- Pass 1: scores.

// out0[0..4) = q0 . k[0..4), out1[0..4) = q1 . k[0..4).
template <int D, typename P>
inline void dots_4x2(const float* q0, const float* q1, const float* const* k, float* out0, float* out1, P& pf) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 8) {
    pf.step();
    const __m256 a = load_reg(q0 + c);
    const __m256 b = load_reg(q1 + c);
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = load_reg(k[i] + c);
      acc[i] = _mm256_fmadd_ps(a, kv, acc[i]);
      acc[4 + i] = _mm256_fmadd_ps(b, kv, acc[4 + i]);
    }
  }
  const __m256 s = hsum8(acc);
  _mm_storeu_ps(out0, _mm256_castps256_ps128(s));
  _mm_storeu_ps(out1, _mm256_extractf128_ps(s, 1));
}

// out_j[0..4) = q_j . k[0..4) for three query vectors: 12 accumulators, 4 loads per 12 FMAs.
template <int D, typename P>
inline void dots_4x3(const float* q0, const float* q1, const float* q2, const float* const* k, float* out0,
                     float* out1, float* out2, P& pf) {
  __m256 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 8) {
    pf.step();
    const __m256 a = load_reg(q0 + c);
    const __m256 b = load_reg(q1 + c);
    const __m256 e = load_reg(q2 + c);
    for (int i = 0; i < 4; ++i) {
      const __m256 kv = load_reg(k[i] + c);
      acc[i] = _mm256_fmadd_ps(a, kv, acc[i]);
      acc[4 + i] = _mm256_fmadd_ps(b, kv, acc[4 + i]);
      acc[8 + i] = _mm256_fmadd_ps(e, kv, acc[8 + i]);
    }
  }
  const __m256 s = hsum8(acc);
  _mm_storeu_ps(out0, _mm256_castps256_ps128(s));
  _mm_storeu_ps(out1, _mm256_extractf128_ps(s, 1));
  _mm_storeu_ps(out2, hsum4(acc + 8));
}

// out[0..8) = q . k[0..8) (a task's odd last query vector).
template <int D, typename P>
inline void dots_8x1(const float* q, const float* const* k, float* out, P& pf) {
  __m256 acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
  for (int c = 0; c < D; c += 8) {
    pf.step();
    const __m256 a = load_reg(q + c);
    for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(a, _mm256_loadu_ps(k[i] + c), acc[i]);
  }
  _mm256_storeu_ps(out, hsum8(acc));
}

// sc[m * width + t] = q_m . k_t for the nk keys (and whatever in the padding up to width);
// query vectors [h * Mh, (h + 1) * Mh) are head h's.
template <typename T, int D>
void scores_pass(const T* k_cache, const int64_t* off, int64_t nk, const Heads& heads, const float* q, int64_t Mh,
                 float* sc, int64_t width, float* scratch) {
  const float* k[KEY_GROUP];
  Prefetcher<T> pf{k_cache + heads.offset[0], off, heads.lines};
  pf.until(std::min(nk, heads.ahead), 1);
  pf.drain();
  // Inner steps per key group: D / 8 per tile call, two calls of 4 keys for a 3- or 2-tile.
  int64_t steps = 0;
  for (int64_t m = 0, mb; m < Mh; m += mb) steps += (mb = tile_vectors(Mh - m)) == 1 ? D / 8 : D / 4;
  steps *= heads.n;
  const int64_t per_step = (KEY_GROUP * heads.lines + steps - 1) / steps;
  for (int64_t t0 = 0; t0 < nk; t0 += KEY_GROUP) {
    const int64_t n = std::min(KEY_GROUP, nk - t0);
    pf.until(std::min(nk, t0 + heads.ahead + KEY_GROUP), per_step);
    for (int64_t h = 0; h < heads.n; ++h) {
      fp32_rows<D>(k_cache + heads.offset[h], off, t0, n, scratch, k);
      for (int64_t i = n; i < KEY_GROUP; ++i) k[i] = k[n - 1];  // past the end: scores land in the padding
      const float* qh = q + h * Mh * D;
      float* sh = sc + h * Mh * width + t0;
      for (int64_t m = 0, mb; m < Mh; m += mb) {
        mb = tile_vectors(Mh - m);
        const float* q0 = qh + m * D;
        float* s0 = sh + m * width;
        if (mb == 3) {
          for (int i = 0; i < KEY_GROUP; i += 4)
            dots_4x3<D>(q0, q0 + D, q0 + 2 * D, k + i, s0 + i, s0 + width + i, s0 + 2 * width + i, pf);
        } else if (mb == 2) {
          for (int i = 0; i < KEY_GROUP; i += 4) dots_4x2<D>(q0, q0 + D, k + i, s0 + i, s0 + width + i, pf);
        } else {
          dots_8x1<D>(q0, k, s0, pf);
        }
      }
    }
  }
}

// ---- Softmax.

// row[lo:hi] = cap * tanh(row / cap) in place.
inline void softcap_row(float* row, int64_t lo, int64_t hi, float cap) {
  int64_t t = lo;
  for (; t + 8 <= hi; t += 8) _mm256_storeu_ps(row + t, softcap256(_mm256_loadu_ps(row + t), cap));
  if (t < hi) {
    const __m256i m = lanes(hi - t);
    _mm256_maskstore_ps(row + t, m, softcap256(_mm256_maskload_ps(row + t, m), cap));
  }
}

// row[lo:hi] = exp(row - max), zeros in row[0:lo] and row[hi:nk]; returns 1 / the sum.
inline float exp_row(float* row, int64_t lo, int64_t hi, int64_t nk) {
  std::fill(row, row + lo, 0.0f);
  std::fill(row + hi, row + nk, 0.0f);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = lo;
  for (; t + 8 <= hi; t += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row + t));
  float mx = hmax(vmax);
  for (; t < hi; ++t) mx = std::max(mx, row[t]);
  const __m256 vmx = _mm256_set1_ps(mx);
  __m256 vsum = _mm256_setzero_ps();
  for (t = lo; t + 8 <= hi; t += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + t), vmx));
    _mm256_storeu_ps(row + t, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  if (t < hi) {
    const __m256i m = lanes(hi - t);
    const __m256 e = _mm256_and_ps(exp256(_mm256_sub_ps(_mm256_maskload_ps(row + t, m), vmx)), _mm256_castsi256_ps(m));
    _mm256_maskstore_ps(row + t, m, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  return 1.0f / hsum(vsum);
}

// ---- Pass 2: weighted sum of V.

// acc[i][0:D] += sum_t w[i][t] v_t for MB query vectors (weights rows `w`, stride ldw) and the
// n keys of a chunk, CW registers (8 CW dims) per query vector at a time. MB x CW = 8
// accumulators: enough to cover the FMA latency, few enough for AVX2's 16 registers.
template <int MB, int CW, int D, typename P>
inline void weighted_sum_tile(const float* w, int64_t ldw, const float* const* v, int64_t n, float* acc, P& pf) {
  for (int c0 = 0; c0 < D; c0 += 8 * CW) {
    __m256 o[MB][CW];
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < CW; ++j) o[i][j] = _mm256_load_ps(acc + i * D + c0 + 8 * j);
    for (int64_t t = 0; t < n; ++t) {
      pf.step();
      __m256 p[MB];
      for (int i = 0; i < MB; ++i) p[i] = _mm256_broadcast_ss(w + i * ldw + t);
      for (int j = 0; j < CW; ++j) {
        const __m256 x = MB > 1 ? load_reg(v[t] + c0 + 8 * j) : _mm256_loadu_ps(v[t] + c0 + 8 * j);
        for (int i = 0; i < MB; ++i) o[i][j] = _mm256_fmadd_ps(p[i], x, o[i][j]);
      }
    }
    for (int i = 0; i < MB; ++i)
      for (int j = 0; j < CW; ++j) _mm256_store_ps(acc + i * D + c0 + 8 * j, o[i][j]);
  }
}

// acc[m][0:D] = sum_t w[m][t] v_t for the run's query vectors (head h's: [h * Mh, (h + 1) * Mh));
// v: room for a chunk's row pointers.
template <typename T, int D>
void weighted_sum_pass(const T* v_cache, const int64_t* off, int64_t nk, const Heads& heads, const float* w,
                       int64_t Mh, int64_t width, float* acc, float* scratch, const float** v, Prefetcher<T>& pf) {
  constexpr int CW1 = std::min(8, D / 8);  // a 1-tile's registers per query vector
  const int64_t KC = heads.chunk;
  // Inner steps per key of a chunk: D / 32 per 3- or 2-tile, D / (8 CW1) per 1-tile.
  int64_t steps = 0;
  for (int64_t m = 0, mb; m < Mh; m += mb) steps += (mb = tile_vectors(Mh - m)) == 1 ? D / (8 * CW1) : D / 32;
  steps *= heads.n;
  const int64_t per_step = (heads.lines + steps - 1) / steps;
  std::fill(acc, acc + heads.n * Mh * D, 0.0f);
  for (int64_t t0 = 0; t0 < nk; t0 += KC) {
    const int64_t n = std::min(KC, nk - t0);
    pf.until(std::min(nk, t0 + 2 * KC), per_step);  // the next chunk
    for (int64_t h = 0; h < heads.n; ++h) {
      fp32_rows<D>(v_cache + heads.offset[h], off, t0, n, scratch, v);
      const float* wh = w + h * Mh * width + t0;
      float* ah = acc + h * Mh * D;
      for (int64_t m = 0, mb; m < Mh; m += mb) {
        mb = tile_vectors(Mh - m);
        if (mb == 3) {
          weighted_sum_tile<3, 4, D>(wh + m * width, width, v, n, ah + m * D, pf);
        } else if (mb == 2) {
          weighted_sum_tile<2, 4, D>(wh + m * width, width, v, n, ah + m * D, pf);
        } else {
          weighted_sum_tile<1, CW1, D>(wh + m * width, width, v, n, ah + m * D, pf);
        }
      }
    }
  }
}

// ---- One run of tasks.

template <typename T, int D>
void attend(const Args<T>& a, const Task* tasks, int64_t n, Avx2Scratch& s) {
  const Task& task = tasks[0];  // the run's sequence and rows
  const int64_t seq = task.seq;
  const int64_t q0 = a.query_start_loc[seq];
  const int64_t first_pos = a.seq_lens[seq] - (a.query_start_loc[seq + 1] - q0);
  const int64_t Mh = (task.row_end - task.row_begin) * a.group;  // query vectors per kv head
  const int64_t M = n * Mh;
  const int64_t kmax = first_pos + task.row_end;  // keys the last row sees
  const int64_t kmin = first_key(a.window, first_pos + task.row_begin);  // the first row's first
  const int64_t nk = kmax - kmin;  // key t below is context position kmin + t
  const Heads heads = run_heads<T, D>(tasks, n, s.head_offsets);
  const int64_t* off = row_offsets(a, a.block_tables + seq * a.bt_stride, 0, kmin, kmax, s.offsets);
  // Query vector h * Mh + m: row m / group, query head kv_head * group + m % group.
  auto head_of = [&](int64_t m) { return tasks[m / Mh].kv_head * a.group + (m % Mh) % a.group; };
  auto row_of = [&](int64_t m) { return task.row_begin + (m % Mh) / a.group; };

  s.query.resize(M * D);
  for (int64_t m = 0; m < M; ++m) {
    const T* q = a.query + (q0 + row_of(m)) * a.q_stride_token + head_of(m) * a.q_stride_head;
    for (int64_t d = 0; d < D; ++d) s.query[m * D + d] = pagedllm_vec::to_float(q[d]) * a.scale;
  }
  const int64_t width = (nk + KEY_GROUP - 1) / KEY_GROUP * KEY_GROUP;
  s.scores.resize(M * width);
  if constexpr (std::is_same_v<T, c10::BFloat16>) s.rows.resize(std::max(KEY_GROUP, heads.chunk) * D);
  scores_pass<T, D>(a.k_cache, off, nk, heads, s.query.data(), Mh, s.scores.data(), width, s.rows.data());

  // The first V rows are on their way while the softmax runs.
  Prefetcher<T> pf{a.v_cache + heads.offset[0], off, heads.lines};
  pf.until(std::min(nk, heads.chunk), 1);
  pf.drain();
  s.inv_sum.resize(M);
  for (int64_t m = 0; m < M; ++m) {
    const Visible v = visible(a, first_pos, row_of(m), kmin);
    float* row = s.scores.data() + m * width;
    if (a.softcap > 0.0f) softcap_row(row, v.lo, v.hi, a.softcap);
    s.inv_sum[m] = exp_row(row, v.lo, v.hi, nk);
  }
  s.acc.resize(M * D);
  s.row_ptrs.resize(heads.chunk);
  weighted_sum_pass<T, D>(a.v_cache, off, nk, heads, s.scores.data(), Mh, width, s.acc.data(), s.rows.data(),
                          s.row_ptrs.data(), pf);

  for (int64_t m = 0; m < M; ++m) {
    T* dst = a.out + (q0 + row_of(m)) * a.out_stride_token + head_of(m) * D;
    const float* src = s.acc.data() + m * D;
    const __m256 inv = _mm256_set1_ps(s.inv_sum[m]);
    if constexpr (std::is_same_v<T, float>) {
      for (int c = 0; c < D; c += 8) _mm256_storeu_ps(dst + c, _mm256_mul_ps(_mm256_load_ps(src + c), inv));
    } else {
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d] * s.inv_sum[m]);
    }
  }
}

}  // namespace

bool avx2_built() { return true; }

template <typename T>
bool attend_avx2(const Args<T>& a, const Task* tasks, int64_t n, Avx2Scratch& scratch) {
  if ((tasks[0].row_end - tasks[0].row_begin) * a.group >= FLASH_MIN_VECTORS) {
    for (int64_t i = 0; i < n; ++i)
      if (!attend_flash_avx2(a, tasks[i], scratch.flash)) return false;  // all or none: head_dim
    return true;
  }
  switch (a.head_dim) {
    case 32:
      attend<T, 32>(a, tasks, n, scratch);
      return true;
    case 64:
      attend<T, 64>(a, tasks, n, scratch);
      return true;
    case 128:
      attend<T, 128>(a, tasks, n, scratch);
      return true;
    case 256:
      attend<T, 256>(a, tasks, n, scratch);
      return true;
    default:
      return false;
  }
}

}  // namespace pagedllm_attn

#else  // no AVX2 + FMA: every task stays on the scalar path

namespace pagedllm_attn {

bool avx2_built() { return false; }

template <typename T>
bool attend_avx2(const Args<T>&, const Task*, int64_t, Avx2Scratch&) {
  return false;
}

}  // namespace pagedllm_attn

#endif

namespace pagedllm_attn {
template bool attend_avx2<float>(const Args<float>&, const Task*, int64_t, Avx2Scratch&);
template bool attend_avx2<c10::BFloat16>(const Args<c10::BFloat16>&, const Task*, int64_t, Avx2Scratch&);
}  // namespace pagedllm_attn
