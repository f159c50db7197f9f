// The block-quantized weight formats of quant_gemm (GGUF's, repacked once at load by
// kernels/quant.py): each row's sections, and how a block of 32 weights is read back with
// AVX2, shared by the integer kernel (quant_gemm.cpp) and the dequantising one
// (quant_tiles.cpp).
//
// A weight [N, K] is one uint8 tensor, a row per weight row, each row its sections in order
// (B = K / 32 blocks, P = ceil(B / 2) pairs of them, G = ceil(B / 8) groups of eight, S = K /
// 256 super-blocks; fp16 scales):
//   Q8_0  qs int8 [K], d [B]                               w = d q
//   Q4_0  qs [32 P], d [B]                                 w = d (q - 8),   q in 0..15
//   Q4_1  qs [32 P], d [B], m [B]                          w = d q + m
//   Q5_0  qs [32 P], qh [32 G], d [B]                      w = d (q - 16),  q in 0..31
//   Q4_K  qs [K/2], sc u8 [B], mn u8 [B], d [S], dmin [S]  w = d sc q - dmin mn
//   Q5_K  qs [K/2], qh [K/8], sc, mn, d, dmin              (as Q4_K, q in 0..31)
//   Q6_K  ql [K/2], qh [K/4], sc int8 [K/16], d [S]        w = d sc (q - 32), q in 0..63,
//                                                          sc per 16 weights
// Nibbles come in 32-byte runs, run i holding block 2i in its low nibbles and block 2i + 1 in
// its high ones (as Q4_K stores them), and fifth bits in 32 bytes per group of eight blocks,
// bit j of byte e for element e of block j (as Q5_K stores them): one load and a shift or
// two give a block's bytes. Q6_K keeps GGUF's ql in two 64-byte halves and qh in two 32-byte
// halves (block 4h + s: ql[64h + 32 (s & 1) + e] nibble s >> 1, qh[32h + e] bits 2s..2s+1).
// What the repack changes: Q4_0/Q4_1/Q5_0's nibbles (GGUF: per block, byte j holds elements
// j and j + 16) and fifth bits (per block) take that shape, padded to whole runs and groups;
// the K-quants' 6-bit sub-scales become bytes; Q6_K's 16 scales of a super-block are stored
// even ones first, then odd ones (the order in which the integer kernel's half-block sums
// come out).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_AVX2 1
#include <immintrin.h>
#endif

namespace pagedllm_quant {

constexpr int64_t BLOCK = 32;  // weights per block
constexpr int64_t GROUP = 8;   // blocks per group: a K-quant super-block

// The formats, by their GGML type numbers.
enum class Format : int64_t { q4_0 = 2, q4_1 = 3, q5_0 = 6, q8_0 = 8, q4_k = 12, q5_k = 13, q6_k = 14 };

// Added to Q8_0's code (quant_layout.py's INT8_ACTIVATIONS): its activations are quantised
// to int8, as every other format's, not to int16 (a Q8_0 tensor in a lower-bit file).
constexpr int64_t INT8_ACTIVATIONS = 256;
// Added to that code as well where some weight byte is -128 (quant_layout.py's
// HOLDS_MINUS_128): valid Q8_0, though GGUF's quantisers write -127..127, and a value whose
// negation int8 lacks (the AVX2 lane kernel's products, quant_gemm.cpp's StoredQ8_0Tile).
constexpr int64_t HOLDS_MINUS_128 = 512;

inline bool k_quant(Format f) { return f == Format::q4_k || f == Format::q5_k || f == Format::q6_k; }

// Whether a weight of format `code` takes int16 activations: Q8_0 without INT8_ACTIVATIONS.
inline bool wide_activations(int64_t code) { return code == static_cast<int64_t>(Format::q8_0); }

inline Format format_of(int64_t code) {
  constexpr int64_t int8_q8_0 = static_cast<int64_t>(Format::q8_0) + INT8_ACTIVATIONS;
  if (code == int8_q8_0 || code == int8_q8_0 + HOLDS_MINUS_128) return Format::q8_0;
  switch (code) {
    case 2: case 3: case 6: case 8: case 12: case 13: case 14: return static_cast<Format>(code);
    default: TORCH_CHECK(false, "quant_gemm: unknown weight format ", code);
  }
}

// Byte offsets of a row's sections (0 where the format has none) and the row's size.
struct Layout {
  Format format = Format::q8_0;
  int64_t k = 0, qs = 0, qh = 0, d = 0, m = 0, sc = 0, mn = 0, dmin = 0, bytes = 0;

  int64_t blocks() const { return k / BLOCK; }
};

inline Layout layout_of(Format f, int64_t k) {
  TORCH_CHECK(k > 0 && k % (k_quant(f) ? GROUP * BLOCK : BLOCK) == 0, "quant_gemm: a row of ", k,
              " weights is no whole number of ", k_quant(f) ? "256-weight super-blocks" : "32-blocks");
  const int64_t b = k / BLOCK, s = k / (GROUP * BLOCK);
  const int64_t runs = (b + 1) / 2 * 32, highs = (b + GROUP - 1) / GROUP * 32;
  Layout l;
  l.format = f;
  l.k = k;
  switch (f) {
    case Format::q8_0: l.d = k; l.bytes = k + 2 * b; break;
    case Format::q4_0: l.d = runs; l.bytes = l.d + 2 * b; break;
    case Format::q4_1: l.d = runs; l.m = l.d + 2 * b; l.bytes = l.m + 2 * b; break;
    case Format::q5_0: l.qh = runs; l.d = l.qh + highs; l.bytes = l.d + 2 * b; break;
    case Format::q4_k:
    case Format::q5_k:
      l.qh = f == Format::q5_k ? k / 2 : 0;
      l.sc = k / 2 + (f == Format::q5_k ? k / 8 : 0);
      l.mn = l.sc + b;
      l.d = l.mn + b;
      l.dmin = l.d + 2 * s;
      l.bytes = l.dmin + 2 * s;
      break;
    case Format::q6_k: l.qh = k / 2; l.sc = l.qh + k / 4; l.d = l.sc + k / 16; l.bytes = l.d + 2 * s; break;
  }
  return l;
}

// Weights from the checks: `data` rows of `layout.bytes`.
struct Weight {
  Layout lay;
  const uint8_t* data = nullptr;
  int64_t n = 0;
  bool wide = false;  // Q8_0 on int16 activations (its code without INT8_ACTIVATIONS)
  bool minus_128 = false;  // Q8_0 with a byte of -128 (HOLDS_MINUS_128)

  const uint8_t* row(int64_t i) const { return data + i * lay.bytes; }
};

// K from a row of `bytes` bytes (0 where no K fits): the layout's unpadded size per block
// bounds the count from above, and padding adds less than a group.
inline int64_t width_of(Format f, int64_t bytes) {
  const int64_t unit = k_quant(f) ? GROUP * BLOCK : BLOCK;
  const int64_t most = bytes / (layout_of(f, 64 * GROUP * BLOCK).bytes / (64 * GROUP * BLOCK / unit));
  for (int64_t units = most; units > 0 && units + GROUP > most; --units)
    if (layout_of(f, units * unit).bytes == bytes) return units * unit;
  return 0;
}

// The weight after the checks: a 2-D contiguous uint8 tensor whose rows are `code`'s layout
// of k weights (k < 0: as many as the row holds).
inline Weight check_weight(const at::Tensor& t, int64_t code, int64_t k = -1) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == at::kByte,
              "quant_gemm: the weight must be a 2-D contiguous uint8 tensor (kernels/quant.py's layout)");
  const Format f = format_of(code);
  Weight w;
  k = k < 0 ? width_of(f, t.size(1)) : k;
  TORCH_CHECK(k > 0, "quant_gemm: a weight row of ", t.size(1), " bytes holds no whole number of blocks of format ",
              code);
  w.lay = layout_of(f, k);
  TORCH_CHECK(w.lay.bytes == t.size(1), "quant_gemm: a weight row of ", t.size(1), " bytes does not hold ", w.lay.k,
              " weights of format ", code, " (", w.lay.bytes, " bytes)");
  w.data = t.data_ptr<uint8_t>();
  w.n = t.size(0);
  w.wide = wide_activations(code);
  w.minus_128 = code >= HOLDS_MINUS_128;
  return w;
}

// out = x @ w.T (+ bias) in x's dtype on tiles of the weight dequantised into small_gemm's
// layout (quant_tiles.cpp).
at::Tensor tiled_gemm(const at::Tensor& x, const Weight& w, const std::optional<at::Tensor>& bias);

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
#if defined(QUANT_AVX2)
  return _cvtsh_ss(bits);
#else
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
#endif
}

// Block b's weights as w = scale q + offset, q its stored integers (signed for Q8_0, else
// unsigned): (scale, offset) of its first 16 weights and of its last 16 (they differ in Q6_K
// only). Multiplied in float32 these give GGUF's dequantised values exactly: each scale and
// scale * q are exact, so one fused multiply-add rounds once where the reference does.
struct BlockScales {
  float scale[2], offset[2];
};

// Where block b's own fp16 scale d is in a 32-block format (Q8_0, Q4_0, Q4_1, Q5_0), and d.
inline const uint8_t* block_d_at(const Layout& l, const uint8_t* row, int64_t b) { return row + l.d + 2 * b; }
inline float block_d(const Layout& l, const uint8_t* row, int64_t b) { return half(block_d_at(l, row, b)); }

inline BlockScales block_scales(const Layout& l, const uint8_t* row, int64_t b) {
  const int64_t s = b / GROUP;
  auto both = [](float scale, float offset) { return BlockScales{{scale, scale}, {offset, offset}}; };
  switch (l.format) {
    case Format::q8_0: return both(block_d(l, row, b), 0.f);
    case Format::q4_0: { const float d = block_d(l, row, b); return both(d, -8.f * d); }
    case Format::q5_0: { const float d = block_d(l, row, b); return both(d, -16.f * d); }
    case Format::q4_1: return both(block_d(l, row, b), half(row + l.m + 2 * b));
    case Format::q4_k:
    case Format::q5_k:
      return both(half(row + l.d + 2 * s) * static_cast<float>(row[l.sc + b]),
                  -(half(row + l.dmin + 2 * s) * static_cast<float>(row[l.mn + b])));
    case Format::q6_k: {
      const float d = half(row + l.d + 2 * s);
      const int8_t* sc = reinterpret_cast<const int8_t*>(row + l.sc + 16 * s);
      const int64_t j = b % GROUP;  // this block's scales: sc[2j] (stored at j), sc[2j + 1] (at 8 + j)
      const float lo = d * static_cast<float>(sc[j]), hi = d * static_cast<float>(sc[GROUP + j]);
      return BlockScales{{lo, hi}, {-32.f * lo, -32.f * hi}};
    }
  }
  return both(0.f, 0.f);
}

#if defined(QUANT_AVX2)
// Group g's eight blocks (K-quants: its super-block) as 32 stored integers each, bytes (Q8_0:
// int8, else unsigned), block j in q[j]; `count` blocks (< 8 only in a last group of a
// 32-block format).
template <Format F>
__attribute__((always_inline)) inline void load_group(const Layout& l, const uint8_t* row, int64_t g, int count,
                                                      __m256i q[GROUP]) {
  const int64_t b0 = g * GROUP;
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  switch (F) {
    case Format::q8_0:
      for (int j = 0; j < count; ++j) q[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (b0 + j) * BLOCK));
      return;
    case Format::q4_0:
    case Format::q4_1:
    case Format::q5_0:
    case Format::q4_k:
    case Format::q5_k: {
      const uint8_t* qs = row + g * 128;
      for (int i = 0; 2 * i < count; ++i) {
        const __m256i run = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 32 * i));
        q[2 * i] = _mm256_and_si256(run, low4);
        q[2 * i + 1] = _mm256_and_si256(_mm256_srli_epi16(run, 4), low4);
      }
      if constexpr (F == Format::q5_0 || F == Format::q5_k) {
        // Bit j of each byte -> bit 4 (16-bit shifts: what crosses a byte is masked off).
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + l.qh + g * 32));
        const __m256i bit4 = _mm256_set1_epi8(0x10);
        q[0] = _mm256_or_si256(q[0], _mm256_and_si256(_mm256_slli_epi16(qh, 4), bit4));
        q[1] = _mm256_or_si256(q[1], _mm256_and_si256(_mm256_slli_epi16(qh, 3), bit4));
        q[2] = _mm256_or_si256(q[2], _mm256_and_si256(_mm256_slli_epi16(qh, 2), bit4));
        q[3] = _mm256_or_si256(q[3], _mm256_and_si256(_mm256_slli_epi16(qh, 1), bit4));
        q[4] = _mm256_or_si256(q[4], _mm256_and_si256(qh, bit4));
        q[5] = _mm256_or_si256(q[5], _mm256_and_si256(_mm256_srli_epi16(qh, 1), bit4));
        q[6] = _mm256_or_si256(q[6], _mm256_and_si256(_mm256_srli_epi16(qh, 2), bit4));
        q[7] = _mm256_or_si256(q[7], _mm256_and_si256(_mm256_srli_epi16(qh, 3), bit4));
      }
      return;
    }
    case Format::q6_k: {
      const __m256i bits45 = _mm256_set1_epi8(0x30);
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = row + g * 128 + 64 * h;
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + l.qh + g * 64 + 32 * h));
        __m256i* out = q + 4 * h;
        out[0] = _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), bits45));
        out[1] = _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), bits45));
        out[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(qh, bits45));
        out[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                 _mm256_and_si256(_mm256_srli_epi16(qh, 2), bits45));
      }
      return;
    }
  }
}

// load_group for a format known at run time.
inline void load_group(const Layout& l, const uint8_t* row, int64_t g, int count, __m256i q[GROUP]) {
  switch (l.format) {
    case Format::q8_0: return load_group<Format::q8_0>(l, row, g, count, q);
    case Format::q4_0: return load_group<Format::q4_0>(l, row, g, count, q);
    case Format::q4_1: return load_group<Format::q4_1>(l, row, g, count, q);
    case Format::q5_0: return load_group<Format::q5_0>(l, row, g, count, q);
    case Format::q4_k: return load_group<Format::q4_k>(l, row, g, count, q);
    case Format::q5_k: return load_group<Format::q5_k>(l, row, g, count, q);
    case Format::q6_k: return load_group<Format::q6_k>(l, row, g, count, q);
  }
}

// 8x8 transpose of floats: r[i] lane j -> r[j] lane i.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}

// Eight floats to bf16 as c10::BFloat16 rounds each: to nearest even, a NaN 0x7fc0.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);  // per 128-bit lane
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}
#endif

}  // namespace pagedllm_quant
