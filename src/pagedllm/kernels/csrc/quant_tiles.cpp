// Block-quantized weights (quant_formats.h) back to floats: whole rows (quant_dequantize: the
// embedding's lookups, references) and, for the activation rows past quant_gemm's
// int_max_rows (bf16 prompts on the tile unit or without AVX-512-VNNI, Q8_0's int16
// activations), tiles of the
// weight dequantised into small_gemm's packed layout just before small_gemm's own kernels
// multiply them (tiled_gemm): bf16 on the tile unit or AVX-512-bf16, float32 on AVX-512 or
// AVX2 FMAs. Each thread dequantises a chunk of column groups (about CHUNK_BYTES of packed
// weights, which stay in its L2) and multiplies every row by it before the next chunk, so a
// prompt reads the quantized bytes once and never holds the whole float weight.
//
// Dequantised values equal GGUF's (the gguf package's dequantisers) bit for bit in float32:
// w = scale q + offset with one rounding (quant_formats.h, BlockScales); bf16 rounds those to
// nearest even.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <vector>

#include "parallel.h"
#include "quant_formats.h"
#include "small_gemm.h"

namespace pagedllm_quant {
namespace {

using pagedllm_gemm::COLS;

// Packed weights dequantised per chunk: a share of a core's L2 (small_gemm's AMX kernel
// works through its weights in chunks of the same size).
constexpr int64_t CHUNK_BYTES = 512 << 10;

// A thread's scratch of at least `count` elements, kept from call to call: a prompt makes a
// few hundred calls, and a fresh half-MiB each time is a fresh mapping to fault in.
template <typename T>
T* scratch(int64_t count) {
  thread_local pagedllm_vec::LineVector<uint8_t> bytes;
  const size_t size = static_cast<size_t>(count) * sizeof(T);
  if (bytes.size() < size) bytes.resize(size);
  return reinterpret_cast<T*>(bytes.data());
}

#if defined(QUANT_AVX2)
// Block of 32 stored integers q (bytes; Q8_0 signed) as 32 floats: four vectors of eight.
inline void block_floats(Format f, __m256i q, const BlockScales& s, __m256 out[4]) {
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int i = 0; i < 4; ++i) {
    const __m128i part = i % 2 == 0 ? halves[i / 2] : _mm_srli_si128(halves[i / 2], 8);
    const __m256i wide = f == Format::q8_0 ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
    out[i] = _mm256_fmadd_ps(_mm256_set1_ps(s.scale[i / 2]), _mm256_cvtepi32_ps(wide), _mm256_set1_ps(s.offset[i / 2]));
  }
}

// Group g of a row (`count` blocks) as floats: out[0, 32 count).
void dequantize_group(const Layout& l, const uint8_t* row, int64_t g, int count, float* out) {
  __m256i q[GROUP];
  load_group(l, row, g, count, q);
  for (int j = 0; j < count; ++j) {
    __m256 v[4];
    block_floats(l.format, q[j], block_scales(l, row, g * GROUP + j), v);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + j * BLOCK + 8 * i, v[i]);
  }
}

// Row n of w as float32 or bf16 (T: float, or uint16_t holding bf16 bits).
template <typename T>
void dequantize_row(const Weight& w, int64_t n, T* out) {
  const Layout& l = w.lay;
  const int64_t blocks = l.blocks();
  alignas(32) float group[GROUP * BLOCK];
  for (int64_t g = 0; g * GROUP < blocks; ++g) {
    const int count = static_cast<int>(std::min<int64_t>(GROUP, blocks - g * GROUP));
    T* o = out + g * GROUP * BLOCK;
    if constexpr (sizeof(T) == 4) {
      dequantize_group(l, w.row(n), g, count, o);
    } else {
      dequantize_group(l, w.row(n), g, count, group);
      for (int i = 0; i < count * BLOCK; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o + i), to_bf16(_mm256_loadu_ps(group + i)));
    }
  }
}

#if !(defined(__AVX512F__) && defined(__AVX512BF16__))
// Weight rows [16 cg, 16 cg + 16) of group g (256 weights of K; rows past n zero) as floats,
// stage[c][0, 32 count).
int stage_rows(const Weight& w, int64_t cg, int64_t g, float stage[COLS][GROUP * BLOCK]) {
  const int count = static_cast<int>(std::min<int64_t>(GROUP, w.lay.blocks() - g * GROUP));
  for (int64_t c = 0; c < COLS; ++c) {
    const int64_t n = cg * COLS + c;
    if (n < w.n) {
      dequantize_group(w.lay, w.row(n), g, count, stage[c]);
    } else {
      std::fill_n(stage[c], count * BLOCK, 0.f);
    }
  }
  return count;
}

// Column group cg in small_gemm's float32 layout [K][16] (out: K lines of 16 floats).
void pack_group_f32(const Weight& w, int64_t cg, float* out) {
  alignas(32) float stage[COLS][GROUP * BLOCK];
  for (int64_t g = 0; g * GROUP < w.lay.blocks(); ++g) {
    const int count = stage_rows(w, cg, g, stage);
    float* o = out + g * GROUP * BLOCK * COLS;
    for (int64_t k0 = 0; k0 < count * BLOCK; k0 += 8) {
      for (int64_t c0 = 0; c0 < COLS; c0 += 8) {
        __m256 r[8];
        for (int i = 0; i < 8; ++i) r[i] = _mm256_load_ps(stage[c0 + i] + k0);
        transpose8(r);
        for (int i = 0; i < 8; ++i) _mm256_storeu_ps(o + (k0 + i) * COLS + c0, r[i]);
      }
    }
  }
}
#endif  // the AVX2 packer
#endif

#if defined(QUANT_AVX2) && defined(__AVX512F__) && defined(__AVX512BF16__)
// Block j of one weight row (its bytes q, Q8_0 signed) as two vectors of 16 floats: its
// first 16 weights and its last 16.
template <Format F>
__attribute__((always_inline)) inline void block_halves(__m256i q, const float s[2][GROUP], const float o[2][GROUP],
                                                        int j, __m512& first, __m512& last) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  const __m512i a = F == Format::q8_0 ? _mm512_cvtepi8_epi32(lo) : _mm512_cvtepu8_epi32(lo);
  const __m512i b = F == Format::q8_0 ? _mm512_cvtepi8_epi32(hi) : _mm512_cvtepu8_epi32(hi);
  first = _mm512_fmadd_ps(_mm512_set1_ps(s[0][j]), _mm512_cvtepi32_ps(a), _mm512_set1_ps(o[0][j]));
  last = _mm512_fmadd_ps(_mm512_set1_ps(s[1][j]), _mm512_cvtepi32_ps(b), _mm512_set1_ps(o[1][j]));
}

// Every block's (scale, offset) of group g of a row (quant_formats.h's BlockScales, eight
// blocks at once): s[0] the scales of the blocks' first 16 weights, s[1] of their last 16,
// o[0] and o[1] the offsets; `count` blocks (a last partial group: one at a time).
template <Format F>
__attribute__((always_inline)) inline void group_block_scales(const Layout& l, const uint8_t* row, int64_t g,
                                                              int count, float s[2][GROUP], float o[2][GROUP]) {
  if (count < GROUP) {
    for (int j = 0; j < count; ++j) {
      const BlockScales b = block_scales(l, row, g * GROUP + j);
      for (int h = 0; h < 2; ++h) s[h][j] = b.scale[h], o[h][j] = b.offset[h];
    }
    return;
  }
  auto half8 = [&](int64_t at) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + at))); };
  auto bytes8 = [&](int64_t at) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + at))));
  };
  __m256 scale[2], offset[2];
  if constexpr (F == Format::q4_k || F == Format::q5_k) {
    scale[0] = _mm256_mul_ps(_mm256_set1_ps(half(row + l.d + 2 * g)), bytes8(l.sc + 8 * g));
    offset[0] = _mm256_mul_ps(_mm256_set1_ps(-half(row + l.dmin + 2 * g)), bytes8(l.mn + 8 * g));
    scale[1] = scale[0], offset[1] = offset[0];
  } else if constexpr (F == Format::q6_k) {
    const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + l.sc + 16 * g));
    const __m256 d = _mm256_set1_ps(half(row + l.d + 2 * g));
    scale[0] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
    scale[1] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
    offset[0] = _mm256_mul_ps(_mm256_set1_ps(-32.f), scale[0]);
    offset[1] = _mm256_mul_ps(_mm256_set1_ps(-32.f), scale[1]);
  } else {
    scale[0] = scale[1] = half8(l.d + 16 * g);
    if constexpr (F == Format::q4_1) {
      offset[0] = offset[1] = half8(l.m + 16 * g);
    } else {
      const float shift = F == Format::q4_0 ? -8.f : (F == Format::q5_0 ? -16.f : 0.f);
      offset[0] = offset[1] = _mm256_mul_ps(_mm256_set1_ps(shift), scale[0]);
    }
  }
  for (int h = 0; h < 2; ++h) {
    _mm256_storeu_ps(s[h], scale[h]);
    _mm256_storeu_ps(o[h], offset[h]);
  }
}

// Column group cg (weight rows [16 cg, 16 cg + 16); rows past n zero) dequantised straight
// into small_gemm's packed layout: bf16 [K / 32][16][32] (per 32-wide slice of K, row p
// holds the pairs (w[c][2p], w[c][2p + 1]) of the 16 columns side by side), or float32
// [K][16]. Per group of eight blocks each row's blocks are converted in registers, then
// every block's 16 rows are transposed into place.
template <Format F, bool BF16>
void pack_group(const Weight& w, int64_t cg, void* out) {
  const Layout& l = w.lay;
  const int64_t blocks = l.blocks();
  __m512i stage[GROUP][2][16];  // block, half (float32; bf16 uses [0]), row
  for (int64_t g = 0; g * GROUP < blocks; ++g) {
    const int count = static_cast<int>(std::min<int64_t>(GROUP, blocks - g * GROUP));
    for (int c = 0; c < 16; ++c) {
      const int64_t n = cg * COLS + c;
      if (n >= w.n) {
        for (int j = 0; j < count; ++j) stage[j][0][c] = stage[j][1][c] = _mm512_setzero_si512();
        continue;
      }
      const uint8_t* row = w.row(n);
      __m256i q[GROUP];
      load_group<F>(l, row, g, count, q);
      alignas(32) float s[2][GROUP], o[2][GROUP];
      group_block_scales<F>(l, row, g, count, s, o);
      for (int j = 0; j < count; ++j) {
        __m512 first, last;
        block_halves<F>(q[j], s, o, j, first, last);
        if constexpr (BF16) {
          stage[j][0][c] = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(last, first));
        } else {
          stage[j][0][c] = _mm512_castps_si512(first);
          stage[j][1][c] = _mm512_castps_si512(last);
        }
      }
    }
    for (int j = 0; j < count; ++j) {
      const int64_t b = g * GROUP + j;
      if constexpr (BF16) {
        pagedllm_vec::transpose16(stage[j][0]);
        uint32_t* tile = static_cast<uint32_t*>(out) + b * 16 * COLS;
        for (int p = 0; p < 16; ++p) _mm512_storeu_si512(tile + p * COLS, stage[j][0][p]);
      } else {
        for (int h = 0; h < 2; ++h) {
          pagedllm_vec::transpose16(stage[j][h]);
          float* lines = static_cast<float*>(out) + (b * BLOCK + 16 * h) * COLS;
          for (int p = 0; p < 16; ++p) _mm512_storeu_si512(lines + p * COLS, stage[j][h][p]);
        }
      }
    }
  }
}

template <bool BF16>
void pack_group_any(const Weight& w, int64_t cg, void* out) {
  switch (w.lay.format) {
    case Format::q8_0: return pack_group<Format::q8_0, BF16>(w, cg, out);
    case Format::q4_0: return pack_group<Format::q4_0, BF16>(w, cg, out);
    case Format::q4_1: return pack_group<Format::q4_1, BF16>(w, cg, out);
    case Format::q5_0: return pack_group<Format::q5_0, BF16>(w, cg, out);
    case Format::q4_k: return pack_group<Format::q4_k, BF16>(w, cg, out);
    case Format::q5_k: return pack_group<Format::q5_k, BF16>(w, cg, out);
    case Format::q6_k: return pack_group<Format::q6_k, BF16>(w, cg, out);
  }
}

void pack_group_bf16(const Weight& w, int64_t cg, uint32_t* out) { pack_group_any<true>(w, cg, out); }

// Each sum rounded to bf16 and stored at its column of out (a chunk's group g is group
// g0 + g of out; columns past n are dropped).
class StoreColumns final : public pagedllm_gemm::BlockEmit<StoreColumns> {
 public:
  StoreColumns(c10::BFloat16* out, int64_t n, int64_t g0) : out_(out), n_(n), g0_(g0) {}
  void operator()(int64_t r, int64_t g, __m512 v) override {
    const int64_t col = (g0_ + g) * COLS;
    const __mmask16 mask = pagedllm_vec::tail_mask(n_ - col);
    _mm256_mask_storeu_epi16(out_ + r * n_ + col, mask, pagedllm_vec::to_bf16(v));
  }

 private:
  c10::BFloat16* out_;
  int64_t n_, g0_;
};

void bf16_tiles(const at::Tensor& x, const Weight& w, const c10::BFloat16* bias, at::Tensor& out) {
  const pagedllm_gemm::Isa isa = pagedllm_gemm::bf16_route();
  TORCH_CHECK(isa != pagedllm_gemm::Isa::none, "quant_gemm in bf16 needs the AMX tile unit or AVX-512-bf16");
  const int64_t k = w.lay.k, groups = (w.n + COLS - 1) / COLS;
  const pagedllm_gemm::Bf16Gemm rows =
      pagedllm_gemm::bf16_rows(isa, reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), x.size(0), k);
  const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / (k * COLS * 2));
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  pagedllm_parallel::parallel_chunks(groups, chunk, [&](int64_t g0, int64_t g1) {
    uint32_t* tiles = scratch<uint32_t>(chunk * k * COLS / 2);
    for (int64_t gc = g0; gc < g1; gc += chunk) {
      const int64_t count = std::min(chunk, g1 - gc);
      for (int64_t g = 0; g < count; ++g) pack_group_bf16(w, gc + g, tiles + g * k * COLS / 2);
      pagedllm_gemm::Bf16Gemm p;
      p.x = rows.rows();
      p.lda = rows.row_stride();
      p.m = rows.m;
      p.k = k;
      p.n = count * COLS;
      p.w = reinterpret_cast<const uint16_t*>(tiles);
      p.bias = bias == nullptr ? nullptr : bias + gc * COLS;
      StoreColumns store(o, w.n, gc);
      pagedllm_gemm::bf16_groups(isa, p, 0, count, store);
    }
  });
}
#endif

#if defined(QUANT_AVX2)
void f32_tiles(const at::Tensor& x, const Weight& w, const float* bias, at::Tensor& out) {
  const int64_t m = x.size(0), k = w.lay.k, groups = (w.n + COLS - 1) / COLS;
  const int64_t chunk = std::max<int64_t>(1, CHUNK_BYTES / (k * COLS * 4));
  float* o = out.data_ptr<float>();
  std::atomic<bool> ran{true};
  pagedllm_parallel::parallel_chunks(groups, chunk, [&](int64_t g0, int64_t g1) {
    float* packed = scratch<float>(chunk * k * COLS + m * chunk * COLS);
    float* part = packed + chunk * k * COLS;
    for (int64_t gc = g0; gc < g1; gc += chunk) {
      const int64_t count = std::min(chunk, g1 - gc);
      for (int64_t g = 0; g < count; ++g) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        pack_group_any<false>(w, gc + g, packed + g * k * COLS);
#else
        pack_group_f32(w, gc + g, packed + g * k * COLS);
#endif
      }
      const float* b = bias == nullptr ? nullptr : bias + gc * COLS;
      if (!pagedllm_gemm::f32_route_gemm(x.data_ptr<float>(), x.stride(0), m, k, packed, count * COLS, b, part)) {
        ran = false;
        return;
      }
      const int64_t cols = std::min(count * COLS, w.n - gc * COLS);
      for (int64_t r = 0; r < m; ++r)
        std::copy_n(part + r * count * COLS, cols, o + r * w.n + gc * COLS);
    }
  });
  TORCH_CHECK(ran, "quant_gemm in float32 needs AVX-512 or AVX2 with FMA");
}
#endif

}  // namespace

at::Tensor tiled_gemm(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& bias) {
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), w.n}, x.options());
  if (x.size(0) == 0 || w.n == 0) return out;
  // The bias padded to whole column groups, in x's dtype (small_gemm's kernels read 16 at a time).
  const int64_t padded = (w.n + COLS - 1) / COLS * COLS;
  at::Tensor b;
  if (bias.has_value()) {
    b = at::zeros({padded}, x.options());
    b.narrow(0, 0, w.n).copy_(*bias);
  }
#if defined(QUANT_AVX2) && defined(__AVX512F__) && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16 && pagedllm_gemm::bf16_route() != pagedllm_gemm::Isa::none) {
    bf16_tiles(xc, w, b.defined() ? b.data_ptr<c10::BFloat16>() : nullptr, out);
    return out;
  }
#endif
#if defined(QUANT_AVX2)
  // float32, and bf16 where this CPU has no bf16 dot products (then in float32, as the
  // torch path would widen it).
  if (x.scalar_type() == at::kFloat) {
    f32_tiles(xc, w, b.defined() ? b.data_ptr<float>() : nullptr, out);
    return out;
  }
  at::Tensor wide = at::empty({x.size(0), w.n}, x.options().dtype(at::kFloat));
  const at::Tensor b32 = b.defined() ? b.to(at::kFloat) : at::Tensor();
  f32_tiles(xc.to(at::kFloat), w, b32.defined() ? b32.data_ptr<float>() : nullptr, wide);
  return wide.to(x.scalar_type());
#else
  TORCH_CHECK(false, "quant_gemm needs AVX2 with FMA and F16C");
#endif
}

namespace {

// The weight's rows as a [N, K] tensor of `dtype` (float32 or bf16).
at::Tensor quant_dequantize(const at::Tensor& weight, int64_t format, at::ScalarType dtype) {
  const Weight w = check_weight(weight, format);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_dequantize: dtype must be float32 or bf16");
  at::Tensor out = at::empty({w.n, w.lay.k}, weight.options().dtype(dtype));
#if defined(QUANT_AVX2)
  at::parallel_for(0, w.n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      if (dtype == at::kFloat) {
        dequantize_row(w, n, out.data_ptr<float>() + n * w.lay.k);
      } else {
        dequantize_row(w, n, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()) + n * w.lay.k);
      }
    }
  });
#else
  TORCH_CHECK(false, "quant_dequantize needs AVX2 with FMA and F16C");
#endif
  return out;
}

}  // namespace
}  // namespace pagedllm_quant

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("quant_dequantize(Tensor weight, int format, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("quant_dequantize", &pagedllm_quant::quant_dequantize); }
