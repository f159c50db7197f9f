// quant_gemm: linears on GGUF block-quantized weights kept as stored (one copy, no float
// weight), for decode-sized row counts; quant_dequantize expands rows of such a weight for
// the float GEMM that prompts use (kernels/quant.py chooses).
//
// Weight w [N, K], K a multiple of 32, as one tensor with a row per weight row: the row's
// quants as GGUF stores them, then its blocks' fp16 scales d, then (q4) their minimums m. The
// tensor's dtype names the layout, so that it passes for a weight wherever decoder_layers
// takes one (a small_gemm weight is float32 or bf16):
//   q8 (Q8_0), int8 [N, K + 2 K/32]:          q int8, w = d q
//   q4 (Q4_0, Q4_1), uint8 [N, K/2 + 4 K/32]:  q in 0..15, w = d q + m; byte j of block b's 16
//                                              holds q of element j (low nibble) and j + 16
//                                              (high), as GGUF stores it; Q4_0 is m = -8 d
// Activations are quantised per 32-block on the fly: xq = round(x * 127 / max|x|) in int8,
// dx = max|x| / 127, sx = dx * sum(xq). Then
//   y[r][n] = sum_b d[n][b] dx[r][b] dot(q[n][b], xq[r][b]) + m[n][b] sx[r][b]  (+ bias)
// with integer dot products and the block scales applied in float. The routes differ only in
// how a block's 32 u8 x s8 products are summed into eight int32 lanes: AVX2 maddubs + madd,
// or one dpbusd (AVX-512-VNNI on 256-bit registers, or AVX-VNNI); they give the same sums.
// Q8_0's signed weights take the sign trick (|q| times x with q's sign), so every route
// multiplies unsigned weights by signed activations.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "parallel.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_AVX2 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t BLOCK = 32;
// Activation rows that share one pass over a weight row (register block).
constexpr int ROW_BLOCK = 4;

enum class Format : int64_t { q8 = 0, q4 = 1 };

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

// A weight after the checks.
struct Weight {
  Format format;
  const uint8_t* data = nullptr;
  int64_t n = 0, k = 0, stride = 0;

  int64_t blocks() const { return k / BLOCK; }
  int64_t quant_bytes() const { return format == Format::q8 ? k : k / 2; }
  const uint8_t* row(int64_t i) const { return data + i * stride; }
  // Row i's fp16 scales (d) and minimums (m, q4), blocks() of each.
  const uint16_t* d(int64_t i) const { return reinterpret_cast<const uint16_t*>(row(i) + quant_bytes()); }
  const uint16_t* m(int64_t i) const { return d(i) + blocks(); }
};

Weight check_weight(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && (w.scalar_type() == at::kChar || w.scalar_type() == at::kByte),
              "quant_gemm: the weight must be a 2-D contiguous int8 (q8) or uint8 (q4) tensor");
  Weight q;
  q.format = w.scalar_type() == at::kChar ? Format::q8 : Format::q4;
  q.n = w.size(0);
  q.stride = w.size(1);
  // A row of k weights: q8 k + k/16 bytes (17 per 16 weights), q4 k/2 + k/8 (5 per 8).
  q.k = q.format == Format::q8 ? q.stride / 17 * 16 : q.stride / 5 * 8;
  const int64_t expected = q.format == Format::q8 ? q.k / 16 * 17 : q.k / 8 * 5;
  TORCH_CHECK(q.k % BLOCK == 0 && expected == q.stride, "quant_gemm: a weight row of ", q.stride,
              " bytes is no whole number of 32-blocks");
  q.data = static_cast<const uint8_t*>(w.data_ptr());
  return q;
}

// x [rows, k] (float32 or bf16) quantised per block: xq int8 [rows, k], dx and sx [rows, k / 32].
// One set per thread, reused from call to call (a decode step makes a few hundred calls).
struct Activations {
  std::vector<int8_t> xq;
  std::vector<float> dx, sx, row;
};

template <typename T>
void quantize_block(const T* v, float* tmp, int8_t* xq, float& dx, float& sx) {
  float amax = 0.f;
  for (int j = 0; j < BLOCK; ++j) {
    tmp[j] = static_cast<float>(v[j]);
    amax = std::max(amax, std::fabs(tmp[j]));
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int sum = 0;
  for (int j = 0; j < BLOCK; ++j) {
    const int q = static_cast<int>(std::nearbyint(tmp[j] * inv));  // to nearest, ties to even
    xq[j] = static_cast<int8_t>(q);
    sum += q;
  }
  dx = amax / 127.f;
  sx = dx * static_cast<float>(sum);
}

const Activations& quantize_rows(const at::Tensor& x) {
  thread_local Activations a;
  const at::Tensor xc = x.contiguous();
  const int64_t rows = xc.size(0), k = xc.size(1), blocks = k / BLOCK;
  a.xq.resize(rows * k);
  a.dx.resize(rows * blocks);
  a.sx.resize(rows * blocks);
  a.row.resize(BLOCK);
  for (int64_t i = 0; i < rows * blocks; ++i) {
    if (xc.scalar_type() == at::kFloat) {
      quantize_block(xc.data_ptr<float>() + i * BLOCK, a.row.data(), a.xq.data() + i * BLOCK, a.dx[i], a.sx[i]);
    } else {
      quantize_block(xc.data_ptr<c10::BFloat16>() + i * BLOCK, a.row.data(), a.xq.data() + i * BLOCK, a.dx[i],
                     a.sx[i]);
    }
  }
  return a;
}

#if defined(QUANT_AVX2)
// Eight int32 sums of four u8 x s8 products each.
template <Route R>
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  if constexpr (R == Route::avx512_vnni) return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#endif
#if defined(__AVXVNNI__)
  if constexpr (R == Route::avx_vnni) return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#endif
  // maddubs's int16 pair sums cannot saturate: |q| <= 128 (q8) or 15 (q4), |xq| <= 127.
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
}

// Block b of weight row `row`: its 32 weights as bytes (q4: unpacked nibbles 0..15).
template <Format F>
inline __m256i load_block(const uint8_t* row, int64_t b) {
  if constexpr (F == Format::q8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * BLOCK));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * BLOCK / 2));
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
  }
}

// dot(q, xq) of one block as eight int32 lanes.
template <Route R, Format F>
inline __m256i block_dot(__m256i w, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  if constexpr (F == Format::q8) return dot_u8s8<R>(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
  return dot_u8s8<R>(w, x);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum over blocks of m[b] sx[b] (q4's minimums against the activations' block sums).
inline float min_term(const uint16_t* m, const float* sx, int64_t blocks) {
  __m256 acc = _mm256_setzero_ps();
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {
    const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b)));
    acc = _mm256_fmadd_ps(mw, _mm256_loadu_ps(sx + b), acc);
  }
  float sum = hsum(acc);
  for (; b < blocks; ++b) sum += _cvtsh_ss(m[b]) * sx[b];
  return sum;
}

// Eight blocks' int32 sums (eight lanes each) as one vector of eight totals, block j's in lane j.
inline __m256i totals8(const __m256i s[8]) {
  const __m256i t0 = _mm256_hadd_epi32(s[0], s[1]), t1 = _mm256_hadd_epi32(s[2], s[3]);
  const __m256i t2 = _mm256_hadd_epi32(s[4], s[5]), t3 = _mm256_hadd_epi32(s[6], s[7]);
  // u0's low lane: blocks 0-3 over their elements' low halves; its high lane: the high halves.
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// out[r][n] for activation rows [r0, r0 + RB) and weight rows [n0, n1), as float sums
// (bias not yet added): each weight block is loaded once for the RB rows. Blocks go eight
// at a time: their integer sums reduced to eight totals, scaled by eight d dx at once (a
// total is exact in float: at most 32 x 128 x 127); the blocks past the last eight one by one.
template <Route R, Format F, int RB>
void row_block(const Weight& w, const Activations& a, int64_t r0, int64_t n0, int64_t n1, float* out) {
  const int64_t blocks = w.blocks(), k = w.k, whole = blocks / 8 * 8;
  const int8_t* xq = a.xq.data() + r0 * k;
  const float* dx = a.dx.data() + r0 * blocks;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w.row(n);
    const uint16_t* d = w.d(n);
    __m256 acc[RB];
    for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < whole; b += 8) {
      __m256i q[8];
      for (int j = 0; j < 8; ++j) q[j] = load_block<F>(row, b + j);
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b)));
      for (int r = 0; r < RB; ++r) {
        __m256i s[8];
        for (int j = 0; j < 8; ++j) s[j] = block_dot<R, F>(q[j], xq + r * k + (b + j) * BLOCK);
        const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(dx + r * blocks + b));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(totals8(s)), scale, acc[r]);
      }
    }
    float tail[RB] = {};
    for (int64_t b = whole; b < blocks; ++b) {
      const __m256i q = load_block<F>(row, b);
      const float dw = _cvtsh_ss(d[b]);
      for (int r = 0; r < RB; ++r) {
        const __m256i s = block_dot<R, F>(q, xq + r * k + b * BLOCK);
        tail[r] += dw * dx[r * blocks + b] * hsum(_mm256_cvtepi32_ps(s));
      }
    }
    for (int r = 0; r < RB; ++r) {
      float y = hsum(acc[r]) + tail[r];
      if constexpr (F == Format::q4) y += min_term(w.m(n), a.sx.data() + (r0 + r) * blocks, blocks);
      out[(r0 + r) * w.n + n] = y;
    }
  }
}

template <Route R, Format F>
void weight_rows(const Weight& w, const Activations& a, int64_t rows, int64_t n0, int64_t n1, float* out) {
  int64_t r0 = 0;
  for (; r0 + ROW_BLOCK <= rows; r0 += ROW_BLOCK) row_block<R, F, ROW_BLOCK>(w, a, r0, n0, n1, out);
  switch (rows - r0) {
    case 3: return row_block<R, F, 3>(w, a, r0, n0, n1, out);
    case 2: return row_block<R, F, 2>(w, a, r0, n0, n1, out);
    case 1: return row_block<R, F, 1>(w, a, r0, n0, n1, out);
    default: return;
  }
}

template <Route R>
void run_route(const Weight& w, const Activations& a, int64_t rows, int64_t n0, int64_t n1, float* out) {
  if (w.format == Format::q8) return weight_rows<R, Format::q8>(w, a, rows, n0, n1, out);
  return weight_rows<R, Format::q4>(w, a, rows, n0, n1, out);
}

void run(Route route, const Weight& w, const Activations& a, int64_t rows, int64_t n0, int64_t n1, float* out) {
  switch (route) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    case Route::avx512_vnni: return run_route<Route::avx512_vnni>(w, a, rows, n0, n1, out);
#endif
#if defined(__AVXVNNI__)
    case Route::avx_vnni: return run_route<Route::avx_vnni>(w, a, rows, n0, n1, out);
#endif
    default: return run_route<Route::avx2>(w, a, rows, n0, n1, out);
  }
}
#endif

// out = x @ w.T (+ bias) in x's dtype (float32 or bf16), x [rows, K].
at::Tensor quant_gemm(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const Weight w = check_weight(weight);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == w.k, "quant_gemm: x must be [rows, ", w.k, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "quant_gemm: x must be float32 or bf16");
  const Route route = current_route();
  TORCH_CHECK(route != Route::none, "quant_gemm needs AVX2 with FMA and F16C");
  const int64_t rows = x.size(0);
  at::Tensor out = at::empty({rows, w.n}, x.options().dtype(at::kFloat));
  if (rows == 0) return out.to(x.scalar_type());
#if defined(QUANT_AVX2)
  const Activations& a = quantize_rows(x);
  float* o = out.data_ptr<float>();
  pagedllm_parallel::parallel_chunks(w.n, 8, [&](int64_t n0, int64_t n1) { run(route, w, a, rows, n0, n1, o); });
#endif
  if (bias.has_value()) out.add_(bias->to(at::kFloat));
  return x.scalar_type() == at::kFloat ? out : out.to(x.scalar_type());
}

#if defined(QUANT_AVX2)
// Block b of row `row` as 32 floats: d q (+ m), the products exact (an fp16 scale times a
// quant of at most 8 bits), so a fused multiply-add rounds where d * q + m does.
template <Format F>
inline void dequantize_block(const uint8_t* row, int64_t b, float dw, float mw, __m256 out[4]) {
  const __m256i q = load_block<F>(row, b);
  const __m128i halves[2] = {_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1)};
  for (int i = 0; i < 4; ++i) {
    const __m128i part = i % 2 == 0 ? halves[i / 2] : _mm_srli_si128(halves[i / 2], 8);
    const __m256i wide = F == Format::q8 ? _mm256_cvtepi8_epi32(part) : _mm256_cvtepu8_epi32(part);
    out[i] = _mm256_fmadd_ps(_mm256_set1_ps(dw), _mm256_cvtepi32_ps(wide), _mm256_set1_ps(mw));
  }
}

// Eight floats to bf16, rounded to nearest even (no NaN among dequantised weights).
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i packed = _mm256_packus_epi32(rounded, rounded);  // per 128-bit lane
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
}

// Row n of w in float32 or bf16 (T: float or uint16_t bf16 bits).
template <Format F, typename T>
void dequantize_row(const Weight& w, int64_t n, T* out) {
  const int64_t blocks = w.blocks();
  const uint8_t* row = w.row(n);
  for (int64_t b = 0; b < blocks; ++b) {
    const float dw = _cvtsh_ss(w.d(n)[b]);
    const float mw = F == Format::q4 ? _cvtsh_ss(w.m(n)[b]) : 0.f;
    __m256 v[4];
    dequantize_block<F>(row, b, dw, mw, v);
    for (int i = 0; i < 4; ++i) {
      T* o = out + b * BLOCK + 8 * i;
      if constexpr (sizeof(T) == 4) {
        _mm256_storeu_ps(o, v[i]);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(o), to_bf16(v[i]));
      }
    }
  }
}

template <typename T>
void dequantize_rows(const Weight& w, T* out) {
  at::parallel_for(0, w.n, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      if (w.format == Format::q8) {
        dequantize_row<Format::q8>(w, n, out + n * w.k);
      } else {
        dequantize_row<Format::q4>(w, n, out + n * w.k);
      }
    }
  });
}
#endif

// The weight's rows as a [N, K] tensor of `dtype` (float32 or bf16): w = d q (+ m), in float.
at::Tensor quant_dequantize(const at::Tensor& weight, at::ScalarType dtype) {
  const Weight w = check_weight(weight);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_dequantize: dtype must be float32 or bf16");
  TORCH_CHECK(current_route() != Route::none, "quant_dequantize needs AVX2 with FMA and F16C");
  at::Tensor out = at::empty({w.n, w.k}, weight.options().dtype(dtype));
#if defined(QUANT_AVX2)
  if (dtype == at::kFloat) {
    dequantize_rows(w, out.data_ptr<float>());
  } else {
    dequantize_rows(w, reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>()));
  }
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("quant_gemm_isa() -> str", &quant_gemm_isa);
  m.def("set_quant_gemm_isa(str isa) -> str", &set_quant_gemm_isa);
  m.def("quant_gemm(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("quant_dequantize(Tensor weight, ScalarType dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("quant_gemm", &quant_gemm);
  m.impl("quant_dequantize", &quant_dequantize);
}
