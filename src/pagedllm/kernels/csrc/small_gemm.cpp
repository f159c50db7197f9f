// bf16 linear layers for decode-sized batches on the tile matrix unit (AMX).
//
// A decode step multiplies a few rows (one per running sequence) by every weight of the
// model, so it is bound by how fast the weights stream from memory, not by arithmetic.
// oneDNN's blocked layout streamed them at 6-9 GB/s here; this kernel lays each weight out
// as the tiles the unit consumes, in the order it consumes them, so every thread reads one
// contiguous range front to back (with software prefetch ahead), and measured 1.3-2x faster
// for 1-64 rows. From 64 rows on it is bound by the tile unit: blocks of 2 x 2 tiles over
// chunks of the weights kept in L2 (block, bf16_groups) ran 1.3-1.5x the former loop (one B
// tile, every A tile reloaded into one register), about 1 TFLOP/s a core: oneDNN's rate at
// 512-2048 rows.
//
// Packed layout of w [N, K]: [N / 16][K / 32][16][32] bf16 — for each group of 16 output
// columns, for each 32-wide slice of K, one B tile whose row p holds, for each column n,
// the pair (w[n][32s + 2p], w[n][32s + 2p + 1]).
//
// out = x @ w.T (+ bias): fp32 sums of bf16 products, rounded once to bf16 (as oneDNN).
//
// float32 has no tile unit; its decode steps are bound by the FMA units at 64 rows and by
// memory below. The fp32 layout is [N / 16][K][16] (16 output columns' weights for each k),
// multiplied with AVX-512 FMAs, 8 rows x 32 columns per register block: MKL's sgemm ran
// these shapes at about half the FMA units' peak.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include <optional>

#include "amx.h"
#include "vec.h"

namespace {

constexpr int64_t COLS = 16;   // output columns per B tile
constexpr int64_t DEPTH = 32;  // K per tile step
constexpr int64_t ROWS = 16;   // x rows per A/C tile
// Weights multiplied by a block of rows before the next ones are read: a quarter of a core's
// L2 (2 MB), leaving room for the rows. 256 KB measured the same.
constexpr int64_t CHUNK_BYTES = 512 << 10;
// Rows multiplied by one chunk before the next (more rows: blocks of them, each over all the
// weights), so that x stays in L2 too (256 x 1536 bf16 = 768 KB).
constexpr int64_t BLOCK_ROWS = 256;
// Tile steps (1 KB each) between the one being multiplied and the one being prefetched.
constexpr int64_t PREFETCH_TILES = 8;

bool shape_ok(int64_t n, int64_t k) { return n > 0 && k > 0 && n % COLS == 0 && k % DEPTH == 0; }

// bf16 needs the tile unit, float32 AVX-512.
bool available(bool bf16) {
  if (!bf16) {
#if defined(__AVX512F__)
    return true;
#else
    return false;
#endif
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return pagedllm_amx::permitted();
#else
  return false;
#endif
}

at::Tensor pack_f32(const at::Tensor& w) {
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(n > 0 && k > 0 && n % COLS == 0, "pack_small_gemm: rows must be a multiple of 16");
  at::Tensor src = w.contiguous();
  at::Tensor out = at::empty({n / COLS, k, COLS}, w.options());
  const float* s = src.data_ptr<float>();
  float* d = out.data_ptr<float>();
  at::parallel_for(0, n / COLS, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t c = 0; c < COLS; ++c)
        for (int64_t j = 0; j < k; ++j) d[(g * k + j) * COLS + c] = s[(g * COLS + c) * k + j];
  });
  return out;
}

at::Tensor pack_small_gemm(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "pack_small_gemm: w must be 2-D bf16 or float32");
  if (w.scalar_type() == at::kFloat) return pack_f32(w);
  const int64_t n = w.size(0), k = w.size(1);
  TORCH_CHECK(shape_ok(n, k), "pack_small_gemm: rows must be a multiple of 16 and columns of 32");
  at::Tensor src = w.contiguous();
  at::Tensor out = at::empty({n / COLS, k / DEPTH, 16, 32}, w.options());
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src.data_ptr());
  uint32_t* d = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, n / COLS, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t t = 0; t < k / DEPTH; ++t)
        for (int64_t p = 0; p < 16; ++p)
          for (int64_t c = 0; c < COLS; ++c) {
            const uint16_t* pair = s + (g * COLS + c) * k + t * DEPTH + 2 * p;
            d[((g * (k / DEPTH) + t) * 16 + p) * COLS + c] = uint32_t(pair[0]) | (uint32_t(pair[1]) << 16);
          }
  });
  return out;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// One register block: C tile 2i + j (i < RT, j < GT) = rows [16i, 16i + 16) of x (row stride
// `lda` elements) times column group j of `wg` (GT consecutive groups, k / 32 B tiles each);
// row tile i's A in tile 4 + 2i, group j's B in tile 5 + 2j. With RT = GT = 2 each loaded
// tile feeds two multiplies, and the four loads of a step go to four registers: one A
// register reloaded per multiply made each load wait for the multiply before it (tiles are
// not renamed). Each C tile sums its K steps in order from zero, so the result does not
// depend on the blocking. `prefetch`: fetch the weights ahead into L2 (the first pass over
// them). c: [4][16][16], tile 2i + j at c + 256 (2i + j).
template <int RT, int GT>
void block(const uint16_t* x, int64_t lda, int64_t k, const uint16_t* wg, bool prefetch, float* c) {
  _tile_zero(0);
  if constexpr (GT > 1) _tile_zero(1);
  if constexpr (RT > 1) _tile_zero(2);
  if constexpr (RT > 1 && GT > 1) _tile_zero(3);
  const int64_t steps = k / DEPTH;
  const int64_t stride = lda * 2;
  const uint16_t* wg1 = wg + k * COLS;
  for (int64_t t = 0; t < steps; ++t) {
    if (prefetch) {
      // Beyond this block's last step: the next block's group j, GT groups on.
      const int64_t t_ahead = t + PREFETCH_TILES;
      const uint16_t* w_ahead = wg + t_ahead * 512 + (t_ahead < steps ? 0 : (GT - 1) * k * COLS);
      for (int j = 0; j < GT; ++j) {
        const char* ahead = reinterpret_cast<const char*>(w_ahead + j * k * COLS);
        for (int l = 0; l < 16; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T2);
      }
    }
    const uint16_t* a = x + t * DEPTH;
    _tile_loadd(4, a, stride);
    _tile_loadd(5, wg + t * 512, 64);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (GT > 1) {
      _tile_loadd(7, wg1 + t * 512, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if constexpr (RT > 1) {
      _tile_loadd(6, a + ROWS * lda, stride);
      _tile_dpbf16ps(2, 6, 5);
      if constexpr (GT > 1) _tile_dpbf16ps(3, 6, 7);
    }
  }
  _tile_stored(0, c, 64);
  if constexpr (GT > 1) _tile_stored(1, c + 256, 64);
  if constexpr (RT > 1) _tile_stored(2, c + 512, 64);
  if constexpr (RT > 1 && GT > 1) _tile_stored(3, c + 768, 64);
}

void run_block(int rt, int gt, const uint16_t* x, int64_t lda, int64_t k, const uint16_t* wg, bool prefetch,
               float* c) {
  if (rt > 1) {
    return gt > 1 ? block<2, 2>(x, lda, k, wg, prefetch, c) : block<2, 1>(x, lda, k, wg, prefetch, c);
  }
  return gt > 1 ? block<1, 2>(x, lda, k, wg, prefetch, c) : block<1, 1>(x, lda, k, wg, prefetch, c);
}
#endif

#if defined(__AVX512F__)
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
#endif

// float32: pairs of column groups per thread task, 8 rows per register block.
at::Tensor small_gemm_f32(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == COLS,
              "small_gemm: packed must come from pack_small_gemm");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * COLS;
  TORCH_CHECK(packed.size(1) == k, "small_gemm: x has ", k, " columns, the weight ", packed.size(1));
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                "small_gemm: bias must be float32 [N]");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
#if defined(__AVX512F__)
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  const float* b = bias_c.defined() ? bias_c.data_ptr<float>() : nullptr;
  const float* xa = x.data_ptr<float>();
  const int64_t lda = x.stride(0);
  const float* w = packed.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t groups = n / COLS;
  at::parallel_for(0, (groups + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t g = 2 * p;
      for (int64_t r0 = 0; r0 < m; r0 += 8) {
        const int64_t rows = std::min<int64_t>(8, m - r0);
        if (g + 1 < groups) {
          f32_rows<2>(rows, xa + r0 * lda, lda, k, w, g, b, o + r0 * n, n);
        } else {
          f32_rows<1>(rows, xa + r0 * lda, lda, k, w, g, b, o + r0 * n, n);
        }
      }
    }
  });
#endif
  return out;
}

// A bf16 problem after the checks: x padded to whole 16-row tiles, pointers in place.
struct Bf16Gemm {
  const uint16_t* x = nullptr;   // x's rows, lda elements apart (unless padded)
  int64_t lda = 0;
  // x in whole 16-row tiles (rows m.. zero), when x cannot be read in place (m not a
  // multiple of 16, or rows off cache lines); else empty.
  pagedllm_vec::LineVector<uint16_t> padded;
  at::Tensor bias;  // contiguous, or undefined
  int64_t m = 0, k = 0, n = 0;

  const uint16_t* rows() const { return padded.empty() ? x : padded.data(); }
  int64_t row_stride() const { return padded.empty() ? lda : k; }
};

Bf16Gemm prepare_bf16(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(available(true), "small_gemm needs the AMX tile unit");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "small_gemm: x must be 2-D bf16 with unit column stride");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.size(2) == 16 && packed.size(3) == 32,
              "small_gemm: packed must come from pack_small_gemm");
  Bf16Gemm p;
  p.m = x.size(0);
  p.k = x.size(1);
  p.n = packed.size(0) * COLS;
  TORCH_CHECK(packed.size(1) * DEPTH == p.k, "small_gemm: x has ", p.k, " columns, the weight ",
              packed.size(1) * DEPTH);
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == p.n && bias->scalar_type() == at::kBFloat16,
                "small_gemm: bias must be bf16 [N]");
    p.bias = bias->contiguous();
  }
  // Whole 16-row tiles only: pad x with zero rows when m is not a multiple of 16. A plain
  // copy, not a padded tensor: at::zeros + narrow + copy_ cost about 6 us a call, a tenth
  // of a small model's decode linear. x's rows are read in place only when they start on
  // cache lines (as the copy does: a LineVector).
  p.x = reinterpret_cast<const uint16_t*>(x.data_ptr());
  p.lda = x.stride(0);
  const int64_t padded_m = (p.m + ROWS - 1) / ROWS * ROWS;
  const bool aligned = pagedllm_vec::on_line(p.x) && (p.lda * 2) % 64 == 0;
  if (padded_m != p.m || p.lda < p.k || !aligned) {
    p.padded.assign(padded_m * p.k, 0);
    for (int64_t r = 0; r < p.m; ++r) std::copy_n(p.x + r * p.lda, p.k, p.padded.data() + r * p.k);
  }
  return p;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// For column groups [g0, g1) (one thread's contiguous stream of weights), calls
// emit(row, group, v) with v = the 16 fp32 sums of that row and group, bias added.
template <typename Emit>
void bf16_groups(const Bf16Gemm& p, const at::Tensor& packed, int64_t g0, int64_t g1, Emit&& emit) {
  const uint16_t* xa = p.rows();
  const int64_t lda = p.row_stride();
  const uint16_t* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const c10::BFloat16* b = p.bias.defined() ? p.bias.data_ptr<c10::BFloat16>() : nullptr;
  pagedllm_amx::TileScope tiles;
  alignas(64) float c[4 * 256];
  // Weights in chunks of about CHUNK_BYTES (an even number of groups), each multiplied by
  // up to BLOCK_ROWS rows: two row tiles (32 rows x k, in L1 for k <= 512) at a time against
  // every pair of column groups of the chunk, the chunk staying in L2 after the first pass
  // (prefetched then), and so do the rows. Each row still meets the groups in increasing
  // order (emit relies on it).
  const int64_t chunk = std::max<int64_t>(2, CHUNK_BYTES / (p.k * COLS * 2) / 2 * 2);
  for (int64_t rb = 0; rb < p.m; rb += BLOCK_ROWS) {
    const int64_t rb1 = std::min(p.m, rb + BLOCK_ROWS);
    for (int64_t gc = g0; gc < g1; gc += chunk) {
      const int64_t gc1 = std::min(g1, gc + chunk);
      for (int64_t r0 = rb; r0 < rb1; r0 += 2 * ROWS) {
        const int rt = rb1 - r0 > ROWS ? 2 : 1;
        for (int64_t g = gc; g < gc1; g += 2) {
          const int gt = gc1 - g > 1 ? 2 : 1;
          run_block(rt, gt, xa + r0 * lda, lda, p.k, w + g * p.k * COLS, r0 == rb, c);
          __m512 bias16[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
          for (int j = 0; b != nullptr && j < gt; ++j) bias16[j] = pagedllm_vec::load16(b + (g + j) * COLS);
          const int64_t rows = std::min<int64_t>(rt * ROWS, rb1 - r0);
          for (int64_t r = 0; r < rows; ++r) {
            const float* cr = c + (r / ROWS) * 512 + (r % ROWS) * 16;
            for (int j = 0; j < gt; ++j) {
              emit(r0 + r, g + j, _mm512_add_ps(_mm512_load_ps(cr + 256 * j), bias16[j]));
            }
          }
        }
      }
    }
  }
}

using pagedllm_vec::to_bf16;
#endif

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "small_gemm: x must be 2-D with unit column stride");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "small_gemm: x and the packed weight must share a dtype");
  if (x.scalar_type() == at::kFloat) {
    TORCH_CHECK(available(false), "small_gemm in float32 needs AVX-512");
    return small_gemm_f32(x, packed, bias);
  }
  const Bf16Gemm p = prepare_bf16(x, packed, bias);
  at::Tensor out = at::empty({p.m, p.n}, x.options());
  if (p.m == 0) return out;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  // Each thread takes one contiguous range of column groups: one front-to-back stream.
  at::parallel_for(0, p.n / COLS, 1, [&](int64_t g0, int64_t g1) {
    bf16_groups(p, packed, g0, g1, [&](int64_t r, int64_t g, __m512 v) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + r * p.n + g * COLS), to_bf16(v));
    });
  });
#endif
  return out;
}

// The first index of the largest value, NaN winning over numbers (as torch.argmax).
struct Best {
  float value;
  int64_t index;
};

inline bool beats(float value, float best) {
  return std::isnan(best) ? false : (std::isnan(value) || value > best);
}

// argmax over each row of the bf16 logits small_gemm would return — the same roundings —
// without writing them: for greedy sampling straight from the LM head.
at::Tensor small_gemm_argmax(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const Bf16Gemm p = prepare_bf16(x, packed, bias);
  at::Tensor out = at::empty({p.m}, x.options().dtype(at::kLong));
  if (p.m == 0) return out;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  const int64_t groups = p.n / COLS;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  // One contiguous column range per part, so a part's winner is its first best column and
  // the parts merge in column order.
  std::vector<Best> found(parts * p.m);
  at::parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g0 = t * groups / parts, g1 = (t + 1) * groups / parts;
      // Per row, per lane: the lane's best value (rounded to bf16) and its column.
      std::vector<__m512> value(p.m);
      std::vector<__m512i> index(p.m);
      const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      bf16_groups(p, packed, g0, g1, [&](int64_t r, int64_t g, __m512 v) {
        v = pagedllm_vec::from_bf16(to_bf16(v));
        const __m512i columns = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(g * COLS)), lanes);
        if (g == g0) {
          value[r] = v;
          index[r] = columns;
          return;
        }
        const __mmask16 best_nan = _mm512_cmp_ps_mask(value[r], value[r], _CMP_UNORD_Q);
        const __mmask16 take = _mm512_kandn(
            best_nan, _mm512_kor(_mm512_cmp_ps_mask(v, value[r], _CMP_GT_OQ), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)));
        value[r] = _mm512_mask_mov_ps(value[r], take, v);
        index[r] = _mm512_mask_mov_epi32(index[r], take, columns);
      });
      for (int64_t r = 0; r < p.m; ++r) {
        alignas(64) float vals[16];
        alignas(64) int32_t cols[16];
        _mm512_store_ps(vals, value[r]);
        _mm512_store_si512(cols, index[r]);
        Best best{vals[0], cols[0]};
        for (int j = 1; j < 16; ++j) {
          const bool same = vals[j] == best.value || (std::isnan(vals[j]) && std::isnan(best.value));
          if (beats(vals[j], best.value) || (same && cols[j] < best.index)) best = {vals[j], cols[j]};
        }
        found[t * p.m + r] = best;
      }
    }
  });
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t r = 0; r < p.m; ++r) {
    Best best = found[r];
    for (int64_t t = 1; t < parts; ++t)
      if (beats(found[t * p.m + r].value, best.value)) best = found[t * p.m + r];
    o[r] = best.index;
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("small_gemm_available(bool bf16=True) -> bool", &available);
  m.def("pack_small_gemm(Tensor w) -> Tensor");
  m.def("small_gemm(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("small_gemm_argmax(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("pack_small_gemm", &pack_small_gemm);
  m.impl("small_gemm", &small_gemm);
  m.impl("small_gemm_argmax", &small_gemm_argmax);
}
