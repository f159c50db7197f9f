// small_gemm on the tile matrix unit (AMX): bf16 linears for decode-sized batches and prompt
// chunks. Each weight is laid out as the tiles the unit consumes, in the order it consumes
// them, so every thread reads one contiguous range front to back (software prefetch ahead);
// from 64 rows on the kernel multiplies blocks of 2 x 2 tiles over chunks of the weights kept
// in L2 (see docs/performance.md for the measurements behind the block and chunk sizes).

#include <algorithm>
#include <cstdint>

#include "amx.h"
#include "small_gemm.h"

namespace pagedllm_gemm {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
namespace {

// Weights multiplied by a block of rows before the next ones are read: a quarter of a core's
// L2, leaving room for the rows.
constexpr int64_t CHUNK_BYTES = 512 << 10;
// Rows multiplied by one chunk before the next (more rows: blocks of them, each over all the
// weights), so that x stays in L2 too.
constexpr int64_t BLOCK_ROWS = 256;
// Tile steps (1 KB each) between the one being multiplied and the one being prefetched.
constexpr int64_t PREFETCH_TILES = 8;

// One register block: C tile 2i + j (i < RT, j < GT) = rows [16i, 16i + 16) of x (row stride
// `lda` elements) times column group j of `wg` (GT consecutive groups, k / 32 B tiles each);
// row tile i's A in tile 4 + 2i, group j's B in tile 5 + 2j. With RT = GT = 2 each loaded
// tile feeds two multiplies, and the four loads of a step go to four registers (tiles are
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

}  // namespace

bool amx_built() { return true; }
bool amx_permitted() { return pagedllm_amx::permitted(); }

void amx_groups(const Bf16Gemm& p, int64_t g0, int64_t g1, Emit& emit) {
  const uint16_t* xa = p.rows();
  const int64_t lda = p.row_stride();
  const uint16_t* w = p.w;
  const c10::BFloat16* b = p.bias;
  pagedllm_amx::TileScope tiles;
  alignas(64) float c[4 * 256];
  // Weights in chunks of about CHUNK_BYTES (an even number of groups), each multiplied by
  // up to BLOCK_ROWS rows: two row tiles at a time against every pair of column groups of
  // the chunk, the chunk staying in L2 after the first pass (prefetched then), and so do the
  // rows. Each row still meets the groups in increasing order.
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
            for (int j = 0; j < gt; ++j) emit(r0 + r, g + j, _mm512_add_ps(_mm512_load_ps(cr + 256 * j), bias16[j]));
          }
        }
      }
    }
  }
}

#else

bool amx_built() { return false; }
bool amx_permitted() { return false; }
#if defined(__AVX512F__)
void amx_groups(const Bf16Gemm&, int64_t, int64_t, Emit&) { TORCH_CHECK(false, "small_gemm: built without AMX"); }
#endif

#endif

}  // namespace pagedllm_gemm
