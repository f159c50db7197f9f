// Paged attention for CPU: reads K/V straight through the block tables, no contiguous copy.
//
// One task = (sequence, kv head, a range of query rows). The query vectors of a task are every
// query head of the kv head's group for every row of the range, so each cached K/V row is read
// from memory once per task and used by all of them (GQA); the tile-unit path walks the range
// in tiles of 16 query vectors that share the task's re-laid-out V. Two passes over the context:
// scores (Q.K), softmax in fp32, then the weighted sum of V. Tasks are handed out dynamically
// (longest first) to torch's intra-op threads.
//
// The query of sequence i is the last query_len[i] positions of its seq_len[i]-token context;
// query row r sits at position seq_len - query_len + r and sees keys 0 .. that position, or
// with a sliding window W only the last W of them (p - W < k <= p, transformers' rule): the
// blocks before a task's first visible key are never read. Soft-capping (Gemma 2) passes
// the scaled scores through cap * tanh(s / cap) before the softmax.
// Only the sequences marked in `handled` are computed; the caller routes the others.
// The vector paths here are AVX-512 (and the tile unit); a build without AVX-512 runs fp32
// math on AVX2 + FMA (paged_attention_avx2.cpp) where it can, else the scalar path.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "amx.h"
#include "dispatch.h"
#include "paged_attention.h"
#include "parallel.h"
#include "prefill_attention.h"
#include "vec.h"

namespace {

// How many blocks ahead of the one being read to prefetch.
constexpr int64_t PREFETCH_AHEAD = 2;

using pagedllm_attn::Args;
using pagedllm_attn::first_key;
using pagedllm_attn::row_offsets;
using pagedllm_attn::Task;
using pagedllm_attn::visible;
using pagedllm_attn::Visible;
using pagedllm_vec::to_float;

// row[lo:hi] = cap * tanh(row / cap) (scalar: the portable path).
inline void softcap_row_scalar(float* row, int64_t lo, int64_t hi, float cap) {
  for (int64_t t = lo; t < hi; ++t) row[t] = cap * std::tanh(row[t] / cap);
}

#if defined(__AVX512F__)
using pagedllm_vec::exp512;
using pagedllm_vec::load16;
using pagedllm_vec::prefetch_kv;
using pagedllm_vec::tail_mask;
using pagedllm_vec::transpose16;
#if defined(__AVX512BF16__)
using pagedllm_vec::to_bf16;
#endif

// Blocks sit at random addresses, so the hardware prefetcher stops at every block edge:
// ask for the rows of a block ahead of time.
template <typename T, int NC>
inline void prefetch_rows(const T* first_row, int64_t stride, int64_t n) {
  constexpr int64_t lines = (NC * 16 * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const char* p = reinterpret_cast<const char*>(first_row);
  const int64_t step = stride * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < n; ++o)
    for (int64_t l = 0; l < lines; ++l) prefetch_kv(p + o * step + l * 64);
}

// Prefetch the rows of block `bi` of a context of `kmax` keys (nothing past its end).
template <typename T, int NC>
inline void prefetch_block(const Args<T>& a, const T* cache, const int32_t* table, int64_t bi,
                           int64_t kmax, int64_t kv_off) {
  const int64_t b0 = bi * a.block_size;
  if (b0 < kmax)
    prefetch_rows<T, NC>(cache + table[bi] * a.cache_stride_block + kv_off, a.cache_stride_token,
                         std::min(a.block_size, kmax - b0));
}

// row[lo:hi] = cap * tanh(row / cap) in place.
inline void softcap_row(float* row, int64_t lo, int64_t hi, float cap) {
  for (int64_t t = lo; t < hi; t += 16) {
    const __mmask16 m = tail_mask(hi - t);
    _mm512_mask_storeu_ps(row + t, m, pagedllm_vec::softcap512(_mm512_maskz_loadu_ps(m, row + t), cap));
  }
}

// row[lo:hi] = exp(row - max) in place, zeros in row[0:lo] and row[hi:width]; returns 1 /
// sum of the row.
inline float softmax_exp_row(float* row, int64_t lo, int64_t n, int64_t width) {
  for (int64_t z = 0; z < lo; ++z) row[z] = 0.0f;
  row += lo;
  n -= lo;
  width -= lo;
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + t));
  float mx = _mm512_reduce_max_ps(vmax);
  for (; t < n; ++t) mx = std::max(mx, row[t]);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  t = 0;
  for (; t + 16 <= n; t += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), vmx));
    _mm512_storeu_ps(row + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (t < n) {
    const __mmask16 m = tail_mask(n - t);
    __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), vmx));
    e = _mm512_maskz_mov_ps(m, e);
    _mm512_mask_storeu_ps(row + t, m, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  for (int64_t z = n; z < width; ++z) row[z] = 0.0f;
  return 1.0f / _mm512_reduce_add_ps(vsum);
}

// softmax over row[lo:n] in place, zeros elsewhere in row[0:width].
inline void softmax_row(float* row, int64_t lo, int64_t n, int64_t width) {
  const __m512 inv = _mm512_set1_ps(softmax_exp_row(row, lo, n, width));
  int64_t t = lo;
  for (; t + 16 <= n; t += 16) _mm512_storeu_ps(row + t, _mm512_mul_ps(_mm512_loadu_ps(row + t), inv));
  if (t < n) {
    const __mmask16 m = tail_mask(n - t);
    _mm512_mask_storeu_ps(row + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + t), inv));
  }
}

// NC = head_dim / 16. The context is walked block by block through the block table.
template <typename T, int NC>
void attend_vec(const Args<T>& a, const Task& task, std::vector<float>& scores, std::vector<float>& qbuf,
                std::vector<float>& acc) {
  constexpr int D = NC * 16;
  const int64_t s = task.seq;
  const int64_t q0 = a.query_start_loc[s];
  const int64_t query_len = a.query_start_loc[s + 1] - q0;
  const int64_t seq_len = a.seq_lens[s];
  const int64_t first_pos = seq_len - query_len;
  const int64_t rows = task.row_end - task.row_begin;
  const int64_t M = rows * a.group;
  const int64_t kmax = first_pos + task.row_end;  // keys the last row of the tile sees
  const int64_t kmin = first_key(a.window, first_pos + task.row_begin);  // the first row's first
  const int64_t nk = kmax - kmin;
  const int32_t* table = a.block_tables + s * a.bt_stride;
  const int64_t head0 = task.kv_head * a.group;

  qbuf.resize(M * D);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < a.group; ++h) {
      const T* q = a.query + (q0 + task.row_begin + r) * a.q_stride_token + (head0 + h) * a.q_stride_head;
      float* dst = qbuf.data() + (r * a.group + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_float(q[d]) * a.scale;
    }
  }
  scores.resize(M * nk);
  float* sc = scores.data();

  // Pass 1: scores, from the block of the first visible key on.
  const int64_t kv_off = task.kv_head * D;
  const int64_t bfirst = kmin / a.block_size;
  for (int64_t i = 0; i < PREFETCH_AHEAD; ++i)
    prefetch_block<T, NC>(a, a.k_cache, table, bfirst + i, kmax, kv_off);
  for (int64_t bi = bfirst, b0 = bfirst * a.block_size; b0 < kmax; b0 += a.block_size, ++bi) {
    const int64_t block = table[bi];
    const int64_t n_in_block = std::min(a.block_size, kmax - b0);
    const T* kblock = a.k_cache + block * a.cache_stride_block + kv_off;
    prefetch_block<T, NC>(a, a.k_cache, table, bi + PREFETCH_AHEAD, kmax, kv_off);
    for (int64_t o = std::max<int64_t>(0, kmin - b0); o < n_in_block; ++o) {
      const T* krow = kblock + o * a.cache_stride_token;
      __m512 k[NC];
      for (int c = 0; c < NC; ++c) k[c] = load16(krow + c * 16);
      const int64_t t = b0 + o - kmin;
      for (int64_t m = 0; m < M; ++m) {
        const float* q = qbuf.data() + m * D;
        __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
        for (int c = 1; c < NC; ++c) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * 16), k[c], s0);
        sc[m * nk + t] = _mm512_reduce_add_ps(s0);
      }
    }
  }
  for (int64_t i = 0; i < PREFETCH_AHEAD; ++i)
    prefetch_block<T, NC>(a, a.v_cache, table, bfirst + i, kmax, kv_off);
  // Softmax per query vector over the keys its row may see.
  for (int64_t m = 0; m < M; ++m) {
    const Visible v = visible(a, first_pos, task.row_begin + m / a.group, kmin);
    if (a.softcap > 0.0f) softcap_row(sc + m * nk, v.lo, v.hi, a.softcap);
    softmax_row(sc + m * nk, v.lo, v.hi, nk);
  }
  // Pass 2: weighted sum of V, MB query vectors at a time held in registers.
  constexpr int MB = NC <= 4 ? 4 : (NC <= 8 ? 2 : 1);
  acc.resize(M * D);
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min<int64_t>(MB, M - m0);
    __m512 o_acc[MB][NC];
    for (int i = 0; i < MB; ++i)
      for (int c = 0; c < NC; ++c) o_acc[i][c] = _mm512_setzero_ps();
    for (int64_t bi = bfirst, b0 = bfirst * a.block_size; b0 < kmax; b0 += a.block_size, ++bi) {
      const int64_t block = table[bi];
      const int64_t n_in_block = std::min(a.block_size, kmax - b0);
      const T* vblock = a.v_cache + block * a.cache_stride_block + kv_off;
      if (m0 == 0) prefetch_block<T, NC>(a, a.v_cache, table, bi + PREFETCH_AHEAD, kmax, kv_off);
      for (int64_t o = std::max<int64_t>(0, kmin - b0); o < n_in_block; ++o) {
        const T* vrow = vblock + o * a.cache_stride_token;
        __m512 v[NC];
        for (int c = 0; c < NC; ++c) v[c] = load16(vrow + c * 16);
        const int64_t t = b0 + o - kmin;
        for (int i = 0; i < MB; ++i) {
          if (i < mb) {
            const __m512 p = _mm512_set1_ps(sc[(m0 + i) * nk + t]);
            for (int c = 0; c < NC; ++c) o_acc[i][c] = _mm512_fmadd_ps(p, v[c], o_acc[i][c]);
          }
        }
      }
    }
    for (int i = 0; i < mb; ++i)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc.data() + (m0 + i) * D + c * 16, o_acc[i][c]);
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = task.row_begin + m / a.group;
    const int64_t h = head0 + m % a.group;
    T* dst = a.out + (q0 + r) * a.out_stride_token + h * D;
    const float* src = acc.data() + m * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d]);
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- AMX (tile matrix unit) for the scores pass.
// On these CPUs the tile unit multiplies bf16 far faster than the AVX-512 units, so
// the scores of 16 keys x up to 16 query vectors are two tile multiplies (head_dim 64):
// A = 16 K rows (read in place when they sit in one block), B = the task's query vectors
// in the pair-interleaved layout the unit wants, C = 16 x 16 fp32 scores.

// Keys ahead of the current group whose K/V rows are prefetched.
constexpr int64_t AMX_AHEAD = 64;

using pagedllm_amx::TileScope;
inline bool amx_permitted() { return pagedllm_amx::permitted(); }

// Scores for one task with head_dim 64 and M <= 16 query vectors:
// sc[m * kmax + t] = scale * q_m . k_t for t < kmax.
// row_max[m]: the largest score query vector m may see (keys up to its row's position).
inline void scores_amx64(const Args<c10::BFloat16>& a, const Task& task, const int64_t* off, int64_t kmax,
                         int64_t M, float* sc, float* row_max, uint16_t* scratch_rows, float* scratch_c,
                         uint32_t* qt) {
  const int64_t s = task.seq;
  const int64_t q0 = a.query_start_loc[s];
  // Keys visible to the task's first row.
  const int64_t visible0 = a.seq_lens[s] - (a.query_start_loc[s + 1] - q0) + task.row_begin + 1;
  __m512 vmax[16];
  for (int m = 0; m < 16; ++m) vmax[m] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t head0 = task.kv_head * a.group;
  // B tiles: qt[c][p][n] = (q_n[32c + 2p], q_n[32c + 2p + 1]) for chunk c of 32 dims: the
  // query vectors' dim pairs transposed in registers (rows M..15 zero).
  for (int c = 0; c < 2; ++c) {
    __m512i r[16];
    for (int64_t m = 0; m < 16; ++m) {
      r[m] = _mm512_setzero_si512();
      if (m < M) {
        const int64_t row = task.row_begin + m / a.group;
        const c10::BFloat16* qp = a.query + (q0 + row) * a.q_stride_token + (head0 + m % a.group) * a.q_stride_head;
        r[m] = _mm512_loadu_si512(qp + 32 * c);
      }
    }
    transpose16(r);
    for (int p = 0; p < 16; ++p) _mm512_store_si512(qt + (c * 16 + p) * 16, r[p]);
  }
  _tile_loadd(2, qt, 64);
  _tile_loadd(3, qt + 256, 64);
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(a.k_cache);
  const int64_t row_bytes = a.cache_stride_token * 2;
  // Two groups of 16 keys per round in separate tiles (C: 0 and 4; A: 1, 5, 6, 7): a tile
  // multiply has a long latency and tiles are not renamed, so one chain would stall.
  auto rows_of = [&](int64_t t0, uint16_t* scratch, int64_t& stride) -> const uint16_t* {
    const int64_t n = std::min<int64_t>(16, kmax - t0);
    if (n == 16 && t0 / a.block_size == (t0 + 15) / a.block_size) {
      stride = row_bytes;  // 16 rows of one block: read in place
      return kc + off[t0];
    }
    for (int64_t i = 0; i < 16; ++i) {
      if (i < n) {
        std::memcpy(scratch + i * 64, kc + off[t0 + i], 128);
      } else {
        std::memset(scratch + i * 64, 0, 128);
      }
    }
    stride = 128;
    return scratch;
  };
  // C holds [key][query vector]; transposed in registers into sc's [query vector][key].
  const __m512 vscale = _mm512_set1_ps(a.scale);
  auto extract = [&](int64_t t0, const float* c) {
    const int64_t n = std::min<int64_t>(16, kmax - t0);
    const __mmask16 valid = tail_mask(n);
    __m512i r[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_load_si512(c + i * 16);
    transpose16(r);
    if (t0 + 16 <= visible0) {  // every row sees all 16 keys (and they all exist)
      for (int64_t m = 0; m < M; ++m) {
        const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(r[m]), vscale);
        _mm512_storeu_ps(sc + m * kmax + t0, v);
        vmax[m] = _mm512_max_ps(vmax[m], v);
      }
      return;
    }
    for (int64_t m = 0; m < M; ++m) {
      const __m512 v = _mm512_mul_ps(_mm512_castsi512_ps(r[m]), vscale);
      _mm512_mask_storeu_ps(sc + m * kmax + t0, valid, v);
      const __mmask16 mine = tail_mask(visible0 + m / a.group - t0);
      vmax[m] = _mm512_mask_max_ps(vmax[m], valid & mine, vmax[m], v);
    }
  };
  for (int64_t t0 = 0; t0 < kmax; t0 += 32) {
    for (int64_t i = t0 + AMX_AHEAD; i < std::min(kmax, t0 + AMX_AHEAD + 32); ++i) {
      _mm_prefetch(reinterpret_cast<const char*>(kc + off[i]), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(kc + off[i]) + 64, _MM_HINT_T0);
    }
    const bool second = t0 + 16 < kmax;
    int64_t stride0 = 0, stride1 = 0;
    const uint16_t* r0 = rows_of(t0, scratch_rows, stride0);
    const uint16_t* r1 = second ? rows_of(t0 + 16, scratch_rows + 16 * 64, stride1) : nullptr;
    _tile_zero(0);
    _tile_loadd(1, r0, stride0);
    _tile_loadd(5, r0 + 32, stride0);
    if (second) {
      _tile_zero(4);
      _tile_loadd(6, r1, stride1);
      _tile_loadd(7, r1 + 32, stride1);
    }
    _tile_dpbf16ps(0, 1, 2);
    if (second) _tile_dpbf16ps(4, 6, 2);
    _tile_dpbf16ps(0, 5, 3);
    if (second) _tile_dpbf16ps(4, 7, 3);
    _tile_stored(0, scratch_c, 64);
    if (second) _tile_stored(4, scratch_c + 256, 64);
    extract(t0, scratch_c);
    if (second) extract(t0 + 16, scratch_c + 256);
  }
  for (int64_t m = 0; m < M; ++m) row_max[m] = _mm512_reduce_max_ps(vmax[m]);
}

// V rows of keys t0..t0+31 pair-interleaved into the 4 B tiles (16 x 16 pairs each, 4 KiB)
// of the weighted sum: tile j, row p pairs keys t0 + 2p and t0 + 2p + 1. unpacklo/hi
// interleave within 128-bit lanes, so tile column i of tile j holds dim
// 32 * (j / 2) + (i / 4) * 8 + 4 * (j % 2) + i % 4. Keys past kmax repeat the last row (any
// finite row: their probability is 0).
inline void interleave_v64(const Args<c10::BFloat16>& a, const int64_t* off, int64_t t0, int64_t kmax,
                           uint32_t* b) {
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(a.v_cache);
  for (int64_t i = t0 + AMX_AHEAD; i < std::min(kmax, t0 + AMX_AHEAD + 32); ++i)
    _mm_prefetch(reinterpret_cast<const char*>(vc + off[i]), _MM_HINT_T0),
        _mm_prefetch(reinterpret_cast<const char*>(vc + off[i]) + 64, _MM_HINT_T0);
  for (int64_t p = 0; p < 16; ++p) {
    const uint16_t* x = vc + off[std::min(t0 + 2 * p, kmax - 1)];
    const uint16_t* y = vc + off[std::min(t0 + 2 * p + 1, kmax - 1)];
    const __m512i x0 = _mm512_loadu_si512(x), y0 = _mm512_loadu_si512(y);
    const __m512i x1 = _mm512_loadu_si512(x + 32), y1 = _mm512_loadu_si512(y + 32);
    _mm512_storeu_si512(b + (0 * 16 + p) * 16, _mm512_unpacklo_epi16(x0, y0));
    _mm512_storeu_si512(b + (1 * 16 + p) * 16, _mm512_unpackhi_epi16(x0, y0));
    _mm512_storeu_si512(b + (2 * 16 + p) * 16, _mm512_unpacklo_epi16(x1, y1));
    _mm512_storeu_si512(b + (3 * 16 + p) * 16, _mm512_unpackhi_epi16(x1, y1));
  }
}

// ctile (4 C tiles) = sum_t p[m][t] v_t for head_dim 64, M <= 16, read out by store_row64.
// probs: [16][width] bf16, zero
// beyond M rows and kmax columns, width a multiple of 32. 32 keys per step: A = 16 x 32
// probabilities, B = 4 tiles of interleave_v64's layout, C = 4 tiles. `shared` holds the
// interleaved V of every step (built once for several row tiles); without it each step's
// tiles are built in `scratch` as they are needed (one row tile: no second use to pay for).
inline void weighted_sum_amx64(const Args<c10::BFloat16>& a, const int64_t* off, const uint32_t* shared,
                               uint32_t* scratch, int64_t kmax, const uint16_t* probs, int64_t width,
                               float* ctile) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t t0 = 0; t0 < kmax; t0 += 32) {
    const uint32_t* b = shared ? shared + (t0 / 32) * 4 * 256 : scratch;
    if (!shared) interleave_v64(a, off, t0, kmax, scratch);
    // B in tiles 1, 2, 3 (then 1 again): tiles are not renamed, so a load into the tile a
    // multiply still reads waits for it; three tiles keep three multiplies in flight. (Tiles
    // 2 and 3 held the scores pass's queries; it loads them again for every row tile.)
    _tile_loadd(0, probs + t0, width * 2);
    _tile_loadd(1, b + 0 * 256, 64);
    _tile_loadd(2, b + 1 * 256, 64);
    _tile_loadd(3, b + 2 * 256, 64);
    _tile_dpbf16ps(4, 0, 1);
    _tile_dpbf16ps(5, 0, 2);
    _tile_dpbf16ps(6, 0, 3);
    _tile_loadd(1, b + 3 * 256, 64);
    _tile_dpbf16ps(7, 0, 1);
  }
  _tile_stored(4, ctile + 0 * 256, 64);
  _tile_stored(5, ctile + 1 * 256, 64);
  _tile_stored(6, ctile + 2 * 256, 64);
  _tile_stored(7, ctile + 3 * 256, 64);
}

// Row m of weighted_sum_amx64's C tiles, times `scale`, as 64 bf16 at dst. Tile j holds, for
// column i, dim 32 (j / 2) + (i / 4) 8 + 4 (j % 2) + i % 4 (interleave_v64's layout): each
// half of the head is two tiles' rows merged four columns at a time.
inline void store_row64(const float* ctile, int64_t m, float scale, c10::BFloat16* dst) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int half = 0; half < 2; ++half) {
    const __m512 x = _mm512_loadu_ps(ctile + (2 * half) * 256 + m * 16);
    const __m512 y = _mm512_loadu_ps(ctile + (2 * half + 1) * 256 + m * 16);
    for (int q = 0; q < 2; ++q) {
      const __m512 v = _mm512_mul_ps(_mm512_permutex2var_ps(x, q == 0 ? first : second, y), vscale);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * half + 16 * q),
                          to_bf16(v));
    }
  }
}
#endif

#if defined(__AVX512BF16__)
inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

struct Bf16Buffers {
  std::vector<int64_t> offsets;  // element offset of each context row (same for K and V)
  pagedllm_vec::LineVector<float> scores;
  pagedllm_vec::LineVector<uint16_t> probs;  // softmax as bf16, rows padded to an even length
  std::vector<float> acc;
  pagedllm_vec::LineVector<uint32_t> vtiles;  // a task's V in the tile layout (interleave_v64)
  bool use_amx = false;  // set per thread when the tile unit is configured
  alignas(64) uint16_t amx_rows[2 * 16 * 64];
  alignas(64) float amx_c[2 * 16 * 16];
  alignas(64) uint32_t amx_qt[2 * 16 * 16];
  alignas(64) uint32_t amx_b[4 * 16 * 16];
  alignas(64) float amx_out[4 * 16 * 16];
};

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// dst[t] = bf16(exp(row[t] - mx)) for the n keys a row sees, 0 for the rest of [0, kmax);
// returns 1 / the fp32 sum of the exponentials.
inline float exp_row_bf16(const float* row, int64_t n, int64_t kmax, float mx, uint16_t* dst) {
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {  // keys the row sees (n <= kmax): no masks
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), vmx));
    vsum = _mm512_add_ps(vsum, e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t), to_bf16(e));
  }
  for (; t < kmax; t += 16) {
    const __mmask16 mine = tail_mask(n - t);
    const __mmask16 valid = tail_mask(kmax - t);
    __m512 e = _mm512_setzero_ps();
    if (mine) e = _mm512_maskz_mov_ps(mine, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(mine, row + t), vmx)));
    vsum = _mm512_add_ps(vsum, e);
    _mm256_mask_storeu_epi16(dst + t, valid, to_bf16(e));
  }
  return 1.0f / _mm512_reduce_add_ps(vsum);
}

// Tile-unit path (bf16, head_dim 64, group <= 16). The task's query rows are taken in tiles
// of 16 / group rows (16 query vectors: one tile's height). With several row tiles, V is
// interleaved into the tile layout once per task and shared by all of them instead of once
// per row tile; the K rows the tiles share stay hot in L2.
void attend_amx64(const Args<c10::BFloat16>& a, const Task& task, Bf16Buffers& buf) {
  constexpr int D = 64;
  const int64_t s = task.seq;
  const int64_t q0 = a.query_start_loc[s];
  const int64_t first_pos = a.seq_lens[s] - (a.query_start_loc[s + 1] - q0);
  const int64_t head0 = task.kv_head * a.group;
  const int64_t* off = row_offsets(a, a.block_tables + s * a.bt_stride, task.kv_head * D, 0,
                                   first_pos + task.row_end, buf.offsets);
  const int64_t tile_rows = 16 / a.group;
  const int64_t kmax_task = first_pos + task.row_end;
  const bool share_v = task.row_end - task.row_begin > tile_rows;
  if (share_v) {
    buf.vtiles.resize(((kmax_task + 31) / 32) * 4 * 256);
    for (int64_t t0 = 0; t0 < kmax_task; t0 += 32)
      interleave_v64(a, off, t0, kmax_task, buf.vtiles.data() + (t0 / 32) * 4 * 256);
  }
  for (int64_t r0 = task.row_begin; r0 < task.row_end; r0 += tile_rows) {
    const Task tile{s, task.kv_head, r0, std::min(task.row_end, r0 + tile_rows), 0};
    const int64_t M = (tile.row_end - r0) * a.group;
    const int64_t kmax = first_pos + tile.row_end;
    buf.scores.resize(M * kmax);
    float* sc = buf.scores.data();
    alignas(64) float row_max[16], inv_sum[16];
    scores_amx64(a, tile, off, kmax, M, sc, row_max, buf.amx_rows, buf.amx_c, buf.amx_qt);
    // Softmax numerators exp(s - max) go to the tile unit as bf16 (rows M..15 and keys a row
    // may not see: 0); the fp32 sum divides the output at the end, as SDPA's flash kernel
    // does. One pass over the scores: the maxima came with them.
    const int64_t width = (kmax + 31) & ~int64_t{31};
    buf.probs.resize(16 * width);
    for (int64_t m = 0; m < 16; ++m) {
      uint16_t* dst = buf.probs.data() + m * width;
      if (m < M) inv_sum[m] = exp_row_bf16(sc + m * kmax, first_pos + r0 + m / a.group + 1, kmax, row_max[m], dst);
      std::fill(dst + (m < M ? kmax : 0), dst + width, uint16_t{0});
    }
    weighted_sum_amx64(a, off, share_v ? buf.vtiles.data() : nullptr, buf.amx_b, kmax, buf.probs.data(), width,
                       buf.amx_out);
    for (int64_t m = 0; m < M; ++m) {
      const int64_t r = r0 + m / a.group;
      store_row64(buf.amx_out, m, inv_sum[m], a.out + (q0 + r) * a.out_stride_token + (head0 + m % a.group) * D);
    }
  }
}
#endif

// Query vectors whose scores are summed together over one group of 16 keys.
constexpr int SCORE_VECTORS = 4;

// dst[i * stride + t] = scale * q_i . k_t for the MB query vectors qp[i] (bf16 pairs) and the
// 16 keys in kt (transposed pairs: kt[p] lane t = pair p of key t), lanes in `valid`. The MB
// vectors go through each pair together: each sum is two chains of dependent dot products
// (even and odd pairs), and one vector at a time left them waiting on each other's latency.
template <int NP, int MB>
inline void scores16(const uint32_t* const* qp, const __m512i* kt, float scale, float* dst, int64_t stride,
                     __mmask16 valid) {
  constexpr int PAIRS = NP * 16;
  __m512 acc0[MB], acc1[MB];
  for (int i = 0; i < MB; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
  for (int p = 0; p < PAIRS; p += 2) {
    const __m512bh k0 = as_bh(kt[p]), k1 = as_bh(kt[p + 1]);
    for (int i = 0; i < MB; ++i) {
      acc0[i] = _mm512_dpbf16_ps(acc0[i], as_bh(_mm512_set1_epi32(static_cast<int>(qp[i][p]))), k0);
      acc1[i] = _mm512_dpbf16_ps(acc1[i], as_bh(_mm512_set1_epi32(static_cast<int>(qp[i][p + 1]))), k1);
    }
  }
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int i = 0; i < MB; ++i)
    _mm512_mask_storeu_ps(dst + i * stride, valid, _mm512_mul_ps(_mm512_add_ps(acc0[i], acc1[i]), vscale));
}

// Keys ahead of the one being read whose K/V rows are prefetched (into L2: prefetch_kv).
constexpr int64_t BF16_AHEAD = 32;

// acc[i * D + d] = sum_t probs[i * width + t] * v_t[d] for MB query vectors, over the nk keys
// whose V rows sit at vc + off[t]: two keys per instruction, interleaved so that each lane
// pairs (v_t, v_t+1) with a broadcast pair of probabilities (bf16). `prefetch`: ask for the
// rows ahead (the first of the task's vector blocks; the later ones find them in cache).
template <int NP, int MB>
void weighted_sum2(const uint16_t* vc, const int64_t* off, int64_t nk, const uint16_t* probs, int64_t width,
                   bool prefetch, float* acc_out) {
  constexpr int D = NP * 32;
  constexpr int LINES = D * 2 / 64;
  __m512 acc[MB][2 * NP];
  for (int i = 0; i < MB; ++i)
    for (int c = 0; c < 2 * NP; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t t = 0; t < nk; t += 2) {
    if (prefetch && t + BF16_AHEAD < nk)
      for (int l = 0; l < LINES; ++l) {
        prefetch_kv(reinterpret_cast<const char*>(vc + off[t + BF16_AHEAD]) + 64 * l);
        if (t + BF16_AHEAD + 1 < nk) prefetch_kv(reinterpret_cast<const char*>(vc + off[t + BF16_AHEAD + 1]) + 64 * l);
      }
    const uint16_t* v0 = vc + off[t];
    const uint16_t* v1 = t + 1 < nk ? vc + off[t + 1] : v0;  // its probability is 0
    __m512i lo[NP], hi[NP];
    for (int c = 0; c < NP; ++c) {
      const __m512i x = _mm512_loadu_si512(v0 + 32 * c);
      const __m512i y = _mm512_loadu_si512(v1 + 32 * c);
      lo[c] = _mm512_unpacklo_epi16(x, y);
      hi[c] = _mm512_unpackhi_epi16(x, y);
    }
    for (int i = 0; i < MB; ++i) {
      uint32_t pp;
      std::memcpy(&pp, probs + i * width + t, sizeof(pp));
      const __m512bh p = as_bh(_mm512_set1_epi32(static_cast<int>(pp)));
      for (int c = 0; c < NP; ++c) {
        acc[i][2 * c] = _mm512_dpbf16_ps(acc[i][2 * c], p, as_bh(lo[c]));
        acc[i][2 * c + 1] = _mm512_dpbf16_ps(acc[i][2 * c + 1], p, as_bh(hi[c]));
      }
    }
  }
  // unpacklo/hi interleave within 128-bit lanes: lane j of `lo` is dim (j/4)*8 + j%4,
  // of `hi` dim (j/4)*8 + 4 + j%4 (within each 32-dim chunk).
  for (int i = 0; i < MB; ++i) {
    float* dst = acc_out + i * D;
    for (int c = 0; c < NP; ++c) {
      alignas(64) float l[16], h[16];
      _mm512_store_ps(l, acc[i][2 * c]);
      _mm512_store_ps(h, acc[i][2 * c + 1]);
      for (int j = 0; j < 16; ++j) {
        dst[32 * c + (j / 4) * 8 + j % 4] = l[j];
        dst[32 * c + (j / 4) * 8 + 4 + j % 4] = h[j];
      }
    }
  }
}

// bf16 path (head_dim = 32 * NP): dot products with AVX512-BF16 `vdpbf16ps`, fp32 sums.
// Scores take 16 keys at a time: their rows are transposed so that each lane holds one key
// and every instruction multiplies one (broadcast) pair of query dims: no horizontal sums.
// The weighted sum of V takes keys in pairs, interleaved so each lane pairs (v_t, v_t+1).
template <int NP>
void attend_bf16(const Args<c10::BFloat16>& a, const Task& task, Bf16Buffers& buf) {
  constexpr int D = NP * 32;
  constexpr int PAIRS = D / 2;
  const int64_t s = task.seq;
  const int64_t q0 = a.query_start_loc[s];
  const int64_t query_len = a.query_start_loc[s + 1] - q0;
  const int64_t first_pos = a.seq_lens[s] - query_len;
  const int64_t rows = task.row_end - task.row_begin;
  const int64_t M = rows * a.group;
  const int64_t kmax = first_pos + task.row_end;
  const int64_t kmin = first_key(a.window, first_pos + task.row_begin);
  const int32_t* table = a.block_tables + s * a.bt_stride;
  const int64_t head0 = task.kv_head * a.group;
  const int64_t kv_off = task.kv_head * D;
  const uint16_t* kc = reinterpret_cast<const uint16_t*>(a.k_cache);
  const uint16_t* vc = reinterpret_cast<const uint16_t*>(a.v_cache);

  // Keys from here on are relative to kmin: key t is context position kmin + t.
  const int64_t* off = row_offsets(a, table, kv_off, kmin, kmax, buf.offsets);
  const int64_t nk = kmax - kmin;
  constexpr int LINES = D * 2 / 64;

  // Pass 1: scores.
  buf.scores.resize(M * nk);
  float* sc = buf.scores.data();
  alignas(64) __m512i kt[PAIRS];
  for (int64_t t0 = 0; t0 < nk; t0 += 16) {
    const int64_t n = std::min<int64_t>(16, nk - t0);
    for (int64_t i = t0 + BF16_AHEAD; i < std::min(nk, t0 + BF16_AHEAD + 16); ++i)
      for (int l = 0; l < LINES; ++l) prefetch_kv(reinterpret_cast<const char*>(kc + off[i]) + 64 * l);
    for (int c = 0; c < NP; ++c) {
      __m512i* r = kt + 16 * c;
      for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(kc + off[t0 + (i < n ? i : 0)] + 32 * c);
      transpose16(r);
    }
    const __mmask16 valid = tail_mask(n);
    for (int64_t m0 = 0; m0 < M; m0 += SCORE_VECTORS) {
      const int mb = static_cast<int>(std::min<int64_t>(SCORE_VECTORS, M - m0));
      const uint32_t* qp[SCORE_VECTORS];
      for (int i = 0; i < mb; ++i) {
        const int64_t m = m0 + i;
        qp[i] = reinterpret_cast<const uint32_t*>(a.query + (q0 + task.row_begin + m / a.group) * a.q_stride_token +
                                                  (head0 + m % a.group) * a.q_stride_head);
      }
      float* dst = sc + m0 * nk + t0;
      pagedllm_dispatch::dispatch_count<SCORE_VECTORS>(
          mb, [&](auto k) { scores16<NP, decltype(k)::value>(qp, kt, a.scale, dst, nk, valid); });
    }
  }
  // Softmax (fp32), then probabilities as bf16 pairs for vdpbf16ps.
  const int64_t width = (nk + 1) & ~int64_t{1};
  buf.probs.assign(M * width, 0);
  for (int64_t m = 0; m < M; ++m) {
    const Visible v = visible(a, first_pos, task.row_begin + m / a.group, kmin);
    float* row = sc + m * nk;
    if (a.softcap > 0.0f) softcap_row(row, v.lo, v.hi, a.softcap);
    // Normalised while rounded to bf16 (one pass less; the same fp32 product as softmax_row).
    const float inv = softmax_exp_row(row, v.lo, v.hi, nk);
    const __m512 vinv = _mm512_set1_ps(inv);
    uint16_t* dst = buf.probs.data() + m * width;
    int64_t t = 0;
    for (; t + 16 <= nk; t += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + t),
                          to_bf16(_mm512_mul_ps(_mm512_loadu_ps(row + t), vinv)));
    for (; t < nk; ++t) dst[t] = c10::BFloat16(row[t] * inv).x;
  }
  // Pass 2: sum of p_t * v_t, two keys per instruction.
  constexpr int MB = NP <= 2 ? 4 : (NP <= 4 ? 2 : 1);
  buf.acc.resize(M * D);
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const uint16_t* probs = buf.probs.data() + m0 * width;
    float* acc = buf.acc.data() + m0 * D;
    const bool prefetch = m0 == 0;  // later blocks find V in cache
    pagedllm_dispatch::dispatch_count<MB>(M - m0, [&](auto k) {
      weighted_sum2<NP, decltype(k)::value>(vc, off, nk, probs, width, prefetch, acc);
    });
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = task.row_begin + m / a.group;
    c10::BFloat16* dst = a.out + (q0 + r) * a.out_stride_token + (head0 + m % a.group) * D;
    const float* src = buf.acc.data() + m * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<c10::BFloat16>(src[d]);
  }
}
#endif

// Portable path for any head_dim (and machines without AVX-512).
template <typename T>
void attend_scalar(const Args<T>& a, const Task& task, std::vector<float>& scores, std::vector<float>& qbuf,
                   std::vector<float>& acc) {
  const int64_t D = a.head_dim;
  const int64_t s = task.seq;
  const int64_t q0 = a.query_start_loc[s];
  const int64_t query_len = a.query_start_loc[s + 1] - q0;
  const int64_t seq_len = a.seq_lens[s];
  const int64_t first_pos = seq_len - query_len;
  const int64_t rows = task.row_end - task.row_begin;
  const int64_t M = rows * a.group;
  const int64_t kmax = first_pos + task.row_end;
  const int64_t kmin = first_key(a.window, first_pos + task.row_begin);
  const int64_t nk = kmax - kmin;  // key t below is context position kmin + t
  const int32_t* table = a.block_tables + s * a.bt_stride;
  const int64_t head0 = task.kv_head * a.group;
  const int64_t kv_off = task.kv_head * D;
  auto row_at = [&](const T* cache, int64_t t) {
    const int64_t pos = kmin + t;
    return cache + table[pos / a.block_size] * a.cache_stride_block + (pos % a.block_size) * a.cache_stride_token +
           kv_off;
  };

  qbuf.resize(M * D);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = task.row_begin + m / a.group;
    const T* q = a.query + (q0 + r) * a.q_stride_token + (head0 + m % a.group) * a.q_stride_head;
    for (int64_t d = 0; d < D; ++d) qbuf[m * D + d] = to_float(q[d]) * a.scale;
  }
  scores.resize(M * nk);
  for (int64_t t = 0; t < nk; ++t) {
    const T* krow = row_at(a.k_cache, t);
    for (int64_t m = 0; m < M; ++m) {
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += qbuf[m * D + d] * to_float(krow[d]);
      scores[m * nk + t] = dot;
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    float* row = scores.data() + m * nk;
    const Visible v = visible(a, first_pos, task.row_begin + m / a.group, kmin);
    if (a.softcap > 0.0f) softcap_row_scalar(row, v.lo, v.hi, a.softcap);
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = v.lo; t < v.hi; ++t) mx = std::max(mx, row[t]);
    float sum = 0.0f;
    for (int64_t t = v.lo; t < v.hi; ++t) sum += (row[t] = std::exp(row[t] - mx));
    for (int64_t t = v.lo; t < v.hi; ++t) row[t] /= sum;
    for (int64_t t = 0; t < v.lo; ++t) row[t] = 0.0f;
    for (int64_t t = v.hi; t < nk; ++t) row[t] = 0.0f;
  }
  acc.assign(M * D, 0.0f);
  for (int64_t t = 0; t < nk; ++t) {
    const T* vrow = row_at(a.v_cache, t);
    for (int64_t m = 0; m < M; ++m) {
      const float p = scores[m * nk + t];
      for (int64_t d = 0; d < D; ++d) acc[m * D + d] += p * to_float(vrow[d]);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = task.row_begin + m / a.group;
    T* dst = a.out + (q0 + r) * a.out_stride_token + (head0 + m % a.group) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[m * D + d]);
  }
}

std::vector<Task> make_tasks(const int32_t* seq_lens, const int32_t* query_start_loc, const bool* handled,
                             int64_t num_seqs, int64_t num_kv_heads, int64_t rows_per_task, int64_t window) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (!handled[s]) continue;
    const int64_t query_len = query_start_loc[s + 1] - query_start_loc[s];
    const int64_t first_pos = seq_lens[s] - query_len;
    for (int64_t r0 = 0; r0 < query_len; r0 += rows_per_task) {
      const int64_t r1 = std::min(query_len, r0 + rows_per_task);
      const int64_t keys = first_pos + r1 - first_key(window, first_pos + r0);
      for (int64_t g = 0; g < num_kv_heads; ++g) tasks.push_back({s, g, r0, r1, keys * (r1 - r0)});
    }
  }
  // Dynamic hand-out, sequences with the most work first (keeps both cores busy with uneven
  // lengths), all of one sequence's tasks together: both cores then read the same context,
  // which stays in cache across its row tasks. Interleaving sequences task by task (as a
  // plain longest-task-first order does when lengths tie) makes every task fetch a different
  // context. Within a sequence, longest rows first; the kv heads of one (sequence, rows) stay
  // adjacent: `task_groups` hands them out together.
  std::vector<int64_t> seq_cost(num_seqs, 0);
  for (const Task& t : tasks) seq_cost[t.seq] += t.cost;
  std::sort(tasks.begin(), tasks.end(), [&](const Task& x, const Task& y) {
    if (x.seq != y.seq) {
      if (seq_cost[x.seq] != seq_cost[y.seq]) return seq_cost[x.seq] > seq_cost[y.seq];
      return x.seq < y.seq;
    }
    if (x.cost != y.cost) return x.cost > y.cost;
    if (x.row_begin != y.row_begin) return x.row_begin < y.row_begin;
    return x.kv_head < y.kv_head;
  });
  return tasks;
}

// Start index of each run of tasks with the same (sequence, rows), plus the end. One thread
// runs a whole run: the kv heads' K/V rows interleave within the same cache pages, so the
// first head's reads bring the next head's rows into this core's cache; spread over two
// cores, both would fetch every page from memory. With fewer runs than threads (one
// sequence decoding) each task is its own run: the other threads would otherwise wait out
// the whole attention of a layer while one thread does it.
std::vector<int64_t> task_groups(const std::vector<Task>& tasks, int64_t threads) {
  std::vector<int64_t> starts;
  for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()); ++i)
    if (i == 0 || tasks[i].seq != tasks[i - 1].seq || tasks[i].row_begin != tasks[i - 1].row_begin)
      starts.push_back(i);
  if (static_cast<int64_t>(starts.size()) < threads) {
    starts.resize(tasks.size());
    for (int64_t i = 0; i < static_cast<int64_t>(tasks.size()); ++i) starts[i] = i;
  }
  starts.push_back(static_cast<int64_t>(tasks.size()));
  return starts;
}

#if defined(__AVX512BF16__)
// Tasks with at least this many query vectors (rows x group) go to the flash prompt kernel
// (prefill_attention.cpp) when there is no tile unit; smaller ones (decode) to attend_bf16.
constexpr int64_t PREFILL_MIN_VECTORS = 16;

pagedllm_prefill::PrefillArgs prefill_args(const Args<c10::BFloat16>& a) {
  return {reinterpret_cast<const uint16_t*>(a.query),
          a.q_stride_token,
          a.q_stride_head,
          reinterpret_cast<const uint16_t*>(a.k_cache),
          reinterpret_cast<const uint16_t*>(a.v_cache),
          a.cache_stride_block,
          a.cache_stride_token,
          a.block_size,
          reinterpret_cast<uint16_t*>(a.out),
          a.out_stride_token,
          a.group,
          a.head_dim,
          a.scale,
          a.window,
          a.softcap};
}

pagedllm_prefill::PrefillTask prefill_task(const Args<c10::BFloat16>& a, const Task& t) {
  const int64_t q0 = a.query_start_loc[t.seq];
  const int64_t first_pos = a.seq_lens[t.seq] - (a.query_start_loc[t.seq + 1] - q0);
  return {a.block_tables + t.seq * a.bt_stride, q0, first_pos, t.kv_head, t.row_begin, t.row_end};
}

bool use_prefill(const Args<c10::BFloat16>& a, const Task& t) {
  return a.use_bf16_dot && (t.row_end - t.row_begin) * a.group >= PREFILL_MIN_VECTORS &&
         pagedllm_prefill::prefill_applies(a.head_dim);
}
#endif

// Pieces to cut each task's query heads into: with fewer tasks than threads (one sequence
// decoding over one or few kv heads: Gemma-3-270M has one), the threads share a task's
// query heads, each reading the task's keys and values (from the shared cache) for its own.
int64_t head_pieces(int64_t tasks, int64_t group, int64_t threads) {
  if (tasks >= threads) return 1;
  return std::min(group, (threads + tasks - 1) / tasks);
}

// The arguments for piece `piece` of `pieces` of kv head `kv_head`'s query heads, as a task
// over a smaller group: the kernels address query head kv_head * group + h, so the query and
// output pointers move to where that lands on the piece's first head.
template <typename T>
Args<T> head_slice(const Args<T>& a, int64_t kv_head, int64_t piece, int64_t pieces) {
  const int64_t first = a.group * piece / pieces, count = a.group * (piece + 1) / pieces - first;
  const int64_t shift = kv_head * a.group + first - kv_head * count;
  Args<T> s = a;
  s.query = a.query + shift * a.q_stride_head;
  s.out = a.out + shift * a.head_dim;
  s.group = count;
  return s;
}

template <typename T>
void run_tasks(const Args<T>& a, const std::vector<Task>& tasks) {
  std::atomic<int64_t> next{0};
  const std::vector<int64_t> groups = task_groups(tasks, at::get_num_threads());
  const int64_t n = static_cast<int64_t>(groups.size()) - 1;
  const int64_t pieces = head_pieces(static_cast<int64_t>(tasks.size()), a.group, at::get_num_threads());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n * pieces));
  // In chunks (parallel.h): inside a decode step's team, a helper that is not on its core
  // leaves its worker's tasks to the others.
  pagedllm_parallel::parallel_chunks(workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scores, qbuf, acc;
#if !defined(__AVX512F__)
    pagedllm_attn::Avx2Scratch avx2_scratch;
#endif
#if defined(__AVX512BF16__)
    Bf16Buffers bf16_buffers;
    pagedllm_prefill::PrefillScratch prefill_scratch;
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    std::optional<TileScope> tiles;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (a.use_bf16_dot && a.use_amx && a.head_dim == 64 && amx_permitted()) {
        tiles.emplace();
        bf16_buffers.use_amx = true;
      }
    }
#endif
    for (int64_t u = next.fetch_add(1); u < n * pieces; u = next.fetch_add(1)) {
      const int64_t j = u / pieces;
      const Args<T> s = pieces > 1 ? head_slice(a, tasks[groups[j]].kv_head, u % pieces, pieces) : a;
      for (int64_t i = groups[j]; i < groups[j + 1]; ++i) {
#if !defined(__AVX512F__)
        // Without AVX-512: the whole run (its kv heads read together) on AVX2 + FMA, where the
        // build has them and the head_dim is one of theirs.
        if (i == groups[j] && pagedllm_attn::attend_avx2(s, tasks.data() + i, groups[j + 1] - i, avx2_scratch)) break;
#endif
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
          // The tile path has no windows or soft-capping: those layers take the dot products.
          if (bf16_buffers.use_amx && s.group <= 16 && s.window == 0 && s.softcap == 0.0f) {
            attend_amx64(s, tasks[i], bf16_buffers);
            continue;
          }
#endif
          if (use_prefill(s, tasks[i])) {
            pagedllm_prefill::attend_prefill(prefill_args(s), prefill_task(s, tasks[i]), prefill_scratch);
            continue;
          }
          if (s.use_bf16_dot && s.head_dim == 64) {
            attend_bf16<2>(s, tasks[i], bf16_buffers);
            continue;
          }
          if (s.use_bf16_dot && s.head_dim == 128) {
            attend_bf16<4>(s, tasks[i], bf16_buffers);
            continue;
          }
          if (s.use_bf16_dot && s.head_dim == 32) {
            attend_bf16<1>(s, tasks[i], bf16_buffers);
            continue;
          }
          if (s.use_bf16_dot && s.head_dim == 256) {
            attend_bf16<8>(s, tasks[i], bf16_buffers);
            continue;
          }
        }
#endif
#if defined(__AVX512F__)
        if (s.head_dim == 64) {
          attend_vec<T, 4>(s, tasks[i], scores, qbuf, acc);
          continue;
        }
        if (s.head_dim == 128) {
          attend_vec<T, 8>(s, tasks[i], scores, qbuf, acc);
          continue;
        }
        if (s.head_dim == 32) {
          attend_vec<T, 2>(s, tasks[i], scores, qbuf, acc);
          continue;
        }
        if (s.head_dim == 256) {
          attend_vec<T, 16>(s, tasks[i], scores, qbuf, acc);
          continue;
        }
#endif
        attend_scalar<T>(s, tasks[i], scores, qbuf, acc);
      }
    }
  });
}

// out: [num_tokens, num_heads, head_dim], written only for the rows of sequences handled here.
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     const at::Tensor& handled, double scale, int64_t rows_per_task, bool fast_bf16,
                     bool use_amx, int64_t sliding_window, double softcap) {
  TORCH_CHECK(sliding_window >= 0 && softcap >= 0.0, "sliding_window and softcap must be >= 0 (0: none)");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, H, D] with unit last stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && out.is_contiguous(), "out must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous(), "query_start_loc int32");
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(handled.scalar_type() == at::kBool && handled.is_contiguous() && handled.numel() == num_seqs,
              "handled must be a bool tensor with one entry per sequence");
  auto tasks = make_tasks(seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(), handled.data_ptr<bool>(),
                          num_seqs, num_kv_heads, std::max<int64_t>(1, rows_per_task), sliding_window);
  if (tasks.empty()) return;

  auto fill = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Args<T> a;
    a.query = reinterpret_cast<const T*>(query.data_ptr());
    a.q_stride_token = query.stride(0);
    a.q_stride_head = query.stride(1);
    a.k_cache = reinterpret_cast<const T*>(k_cache.data_ptr());
    a.v_cache = reinterpret_cast<const T*>(v_cache.data_ptr());
    a.cache_stride_block = k_cache.stride(0);
    a.cache_stride_token = k_cache.stride(1);
    a.block_size = k_cache.size(1);
    a.block_tables = block_tables.data_ptr<int32_t>();
    a.bt_stride = block_tables.stride(0);
    a.seq_lens = seq_lens.data_ptr<int32_t>();
    a.query_start_loc = query_start_loc.data_ptr<int32_t>();
    a.out = reinterpret_cast<T*>(out.data_ptr());
    a.out_stride_token = out.stride(0);
    a.num_heads = num_heads;
    a.group = num_heads / num_kv_heads;
    a.head_dim = head_dim;
    a.scale = static_cast<float>(scale);
    a.window = sliding_window;
    a.softcap = static_cast<float>(softcap);
    a.use_bf16_dot = query.stride(2) == 1 && k_cache.stride(3) == 1 && fast_bf16;
    a.use_amx = a.use_bf16_dot && use_amx;
    run_tasks<T>(a, tasks);
  };
  pagedllm_dispatch::dispatch_float_types(query, "paged_attention", fill);
}

// Two attention results of the same queries over disjoint key sets (a cached prefix and the
// new chunk), merged into the softmax over their union:
//   out = (e^l1 o1 + e^l2 o2) / (e^l1 + e^l2) = o2 + (o1 - o2) * w,  w = 1 / (1 + e^(l2 - l1)),
// with l = log-sum-exp of each part's scores. fp32 arithmetic, one rounding into out.
// out, o1, o2: [T, H, D] (D contiguous); lse1, lse2: [T, H] float32.
template <typename T>
void merge_rows(const at::Tensor& out, const at::Tensor& o1, const at::Tensor& lse1, const at::Tensor& o2,
                const at::Tensor& lse2) {
  const int64_t num_tokens = out.size(0), num_heads = out.size(1), D = out.size(2);
  T* po = reinterpret_cast<T*>(out.data_ptr());
  const T* p1 = reinterpret_cast<const T*>(o1.data_ptr());
  const T* p2 = reinterpret_cast<const T*>(o2.data_ptr());
  const float* l1 = lse1.data_ptr<float>();
  const float* l2 = lse2.data_ptr<float>();
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t h = 0; h < num_heads; ++h) {
        const float w = 1.0f / (1.0f + std::exp(l2[t * lse2.stride(0) + h * lse2.stride(1)] -
                                                l1[t * lse1.stride(0) + h * lse1.stride(1)]));
        T* dst = po + t * out.stride(0) + h * out.stride(1);
        const T* x = p1 + t * o1.stride(0) + h * o1.stride(1);
        const T* y = p2 + t * o2.stride(0) + h * o2.stride(1);
        int64_t d = 0;
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          const __m512 vw = _mm512_set1_ps(w);
          for (; d + 16 <= D; d += 16) {
            const __m512 b = load16(y + d);
            const __m512 r = _mm512_add_ps(b, _mm512_mul_ps(_mm512_sub_ps(load16(x + d), b), vw));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d), to_bf16(r));
          }
        }
#endif
        for (; d < D; ++d) {
          const float b = to_float(y[d]);
          dst[d] = static_cast<T>(b + (to_float(x[d]) - b) * w);
        }
      }
    }
  });
}

void merge_attention(at::Tensor out, const at::Tensor& o1, const at::Tensor& lse1, const at::Tensor& o2,
                     const at::Tensor& lse2) {
  TORCH_CHECK(out.dim() == 3 && o1.sizes() == out.sizes() && o2.sizes() == out.sizes(), "outputs must be [T, H, D]");
  TORCH_CHECK(out.stride(2) == 1 && o1.stride(2) == 1 && o2.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(o1.scalar_type() == out.scalar_type() && o2.scalar_type() == out.scalar_type(), "dtypes differ");
  TORCH_CHECK(lse1.scalar_type() == at::kFloat && lse2.scalar_type() == at::kFloat, "lse must be float32");
  TORCH_CHECK(lse1.dim() == 2 && lse2.dim() == 2 && lse1.size(0) == out.size(0) && lse1.size(1) == out.size(1) &&
                  lse2.sizes() == lse1.sizes(),
              "lse must be [T, H]");
  if (out.scalar_type() == at::kBFloat16) {
    merge_rows<c10::BFloat16>(out, o1, lse1, o2, lse2);
  } else if (out.scalar_type() == at::kFloat) {
    merge_rows<float>(out, o1, lse1, o2, lse2);
  } else {
    TORCH_CHECK(false, "merge_attention supports float32 and bfloat16");
  }
}

// The vector unit of the kernel's fp32 path in this build (for the route's wording): "avx512",
// "avx2" (AVX2 + FMA, head_dim 32/64/128/256) or "scalar".
std::string paged_attention_isa() {
#if defined(__AVX512F__)
  return "avx512";
#else
  return pagedllm_attn::avx2_built() ? "avx2" : "scalar";
#endif
}

// Whether bf16 head_dim-64 work may use the tile unit (built with AMX and allowed by the OS).
bool amx_available() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(pagedllm, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, Tensor handled, float scale, int rows_per_task, "
      "bool fast_bf16=True, bool use_amx=True, int sliding_window=0, float softcap=0.0) -> ()");
  m.def("amx_available() -> bool", &amx_available);
  m.def("paged_attention_isa() -> str", &paged_attention_isa);
  m.def("merge_attention(Tensor(a!) out, Tensor o1, Tensor lse1, Tensor o2, Tensor lse2) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("merge_attention", &merge_attention);
}
