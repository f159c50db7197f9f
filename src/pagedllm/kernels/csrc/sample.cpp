// sample_rows: one draw per row from softmax(logits * inv_temperature), by the inverse CDF
// of one uniform number per row, reading the logits (float32 or bf16) where they lie.
//
// The plain torch pipeline (worker/sampler.py: divide by the temperature, softmax, then the
// blocked inverse CDF) writes a float32 copy and a probability row and walks each several
// times; here a row is read once for its maximum and once for its block sums (exp computed in
// registers, never stored), then one block of BLOCK tokens again to find the token. The
// probabilities are not normalised: the target is u times the row's sum, as in inverse_cdf.
// Block sums and the walk inside the chosen block are float64, so a token of tiny probability
// keeps its share and a zero-probability token (exp underflowing, or a -inf logit) is never
// chosen. A row whose maximum is not finite (NaN, +inf, every logit -inf) returns -1: the
// caller runs the reference for it. A row's result never depends on the thread count.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "dispatch.h"
#include "vec.h"
#include "vec_avx2.h"

namespace {

using pagedllm_vec::to_float;

constexpr int64_t BLOCK = 256;

// e^((x - max) * scale) for one logit; 0 for a -inf logit.
inline float scaled_exp(float x, float max, float scale) {
  return x == -std::numeric_limits<float>::infinity() ? 0.0f : std::exp((x - max) * scale);
}

#if defined(__AVX512F__)
using pagedllm_vec::exp512;
using pagedllm_vec::from_bf16;
using pagedllm_vec::tail_mask;

inline __m512 load_masked(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_masked(const c10::BFloat16* p, __mmask16 m) {
  return from_bf16(_mm256_maskz_loadu_epi16(m, p));
}

// The row's maximum, or NaN when any logit is NaN.
template <typename T>
float row_max(const T* row, int64_t n) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = neg_inf;
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = _mm512_mask_mov_ps(neg_inf, m, load_masked(row + i, m));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    best = _mm512_max_ps(best, v);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(best);
}

// Sum of the scaled exps of row[begin, end), as float32 lanes added at the end.
template <typename T>
double exp_sum(const T* row, int64_t begin, int64_t end, float max, float scale) {
  const __m512 vmax = _mm512_set1_ps(max), vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = tail_mask(end - i);
    const __m512 v = load_masked(row + i, m);
    const __mmask16 live = m & _mm512_cmp_ps_mask(v, neg_inf, _CMP_NEQ_OQ);
    const __m512 e = exp512(_mm512_mul_ps(_mm512_sub_ps(v, vmax), vscale));
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(live, e));
  }
  return static_cast<double>(_mm512_reduce_add_ps(sum));
}

// The scaled exps of row[begin, end) into out (end - begin <= BLOCK).
template <typename T>
void exps(const T* row, int64_t begin, int64_t end, float max, float scale, float* out) {
  const __m512 vmax = _mm512_set1_ps(max), vscale = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = begin; i < end; i += 16) {
    const __mmask16 m = tail_mask(end - i);
    const __m512 v = load_masked(row + i, m);
    const __mmask16 live = m & _mm512_cmp_ps_mask(v, neg_inf, _CMP_NEQ_OQ);
    const __m512 e = exp512(_mm512_mul_ps(_mm512_sub_ps(v, vmax), vscale));
    _mm512_mask_storeu_ps(out + (i - begin), m, _mm512_maskz_mov_ps(live, e));
  }
}

constexpr const char* ISA = "avx512";

#elif defined(__AVX2__) && defined(__FMA__)
using pagedllm_vec::exp256;
using pagedllm_vec::hmax;
using pagedllm_vec::hsum;

// 8 logits as float32 (bf16: widened to the upper halves).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

template <typename T>
float row_max(const T* row, int64_t n) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = load8(row + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    best = _mm256_max_ps(best, v);
  }
  float result = hmax(best);
  bool any_nan = _mm256_movemask_ps(nan) != 0;
  for (; i < n; ++i) {
    const float v = to_float(row[i]);
    any_nan |= std::isnan(v);
    result = v > result ? v : result;
  }
  return any_nan ? std::numeric_limits<float>::quiet_NaN() : result;
}

template <typename T>
double exp_sum(const T* row, int64_t begin, int64_t end, float max, float scale) {
  const __m256 vmax = _mm256_set1_ps(max), vscale = _mm256_set1_ps(scale);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 sum = _mm256_setzero_ps();
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 v = load8(row + i);
    const __m256 e = exp256(_mm256_mul_ps(_mm256_sub_ps(v, vmax), vscale));
    sum = _mm256_add_ps(sum, _mm256_and_ps(e, _mm256_cmp_ps(v, neg_inf, _CMP_NEQ_OQ)));
  }
  float tail = 0.0f;
  for (; i < end; ++i) tail += scaled_exp(to_float(row[i]), max, scale);
  return static_cast<double>(hsum(sum) + tail);
}

template <typename T>
void exps(const T* row, int64_t begin, int64_t end, float max, float scale, float* out) {
  const __m256 vmax = _mm256_set1_ps(max), vscale = _mm256_set1_ps(scale);
  const __m256 neg_inf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 v = load8(row + i);
    const __m256 e = exp256(_mm256_mul_ps(_mm256_sub_ps(v, vmax), vscale));
    _mm256_storeu_ps(out + (i - begin), _mm256_and_ps(e, _mm256_cmp_ps(v, neg_inf, _CMP_NEQ_OQ)));
  }
  for (; i < end; ++i) out[i - begin] = scaled_exp(to_float(row[i]), max, scale);
}

constexpr const char* ISA = "avx2";

#else
template <typename T>
float row_max(const T* row, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(row[i]);
    if (std::isnan(v)) return v;
    best = v > best ? v : best;
  }
  return best;
}

template <typename T>
double exp_sum(const T* row, int64_t begin, int64_t end, float max, float scale) {
  float sum = 0.0f;
  for (int64_t i = begin; i < end; ++i) sum += scaled_exp(to_float(row[i]), max, scale);
  return static_cast<double>(sum);
}

template <typename T>
void exps(const T* row, int64_t begin, int64_t end, float max, float scale, float* out) {
  for (int64_t i = begin; i < end; ++i) out[i - begin] = scaled_exp(to_float(row[i]), max, scale);
}

constexpr const char* ISA = "scalar";
#endif

// The token drawn from one row for the uniform number u in [0, 1); -1 when the row's maximum
// is not finite.
template <typename T>
int64_t sample_row(const T* row, int64_t n, float scale, float u, std::vector<double>& cumulative) {
  const float max = row_max(row, n);
  if (!std::isfinite(max)) return -1;
  const int64_t blocks = (n + BLOCK - 1) / BLOCK;
  cumulative.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    total += exp_sum(row, b * BLOCK, std::min(n, (b + 1) * BLOCK), max, scale);
    cumulative[b] = total;
  }
  const double target = static_cast<double>(u) * total;
  // The first block whose cumulative sum passes the target (the last one if rounding leaves
  // the target at the very end).
  int64_t found = 0;
  while (found < blocks - 1 && !(cumulative[found] > target)) ++found;
  double before = found ? cumulative[found - 1] : 0.0;
  const int64_t begin = found * BLOCK, end = std::min(n, begin + BLOCK);
  alignas(64) float e[BLOCK];
  exps(row, begin, end, max, scale, e);
  int64_t last = -1;
  for (int64_t i = 0; i < end - begin; ++i) {
    if (e[i] > 0.0f) {
      before += static_cast<double>(e[i]);
      last = i;
      if (before > target) return begin + i;
    }
  }
  // Rounding left the target past the block's own sum: its last nonzero token.
  return last >= 0 ? begin + last : -1;
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& inv_temperature, const at::Tensor& uniform) {
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "sample_rows expects [rows, vocab] with unit last stride");
  const int64_t rows = logits.size(0), n = logits.size(1), stride = logits.stride(0);
  TORCH_CHECK(n > 0, "sample_rows: empty rows");
  TORCH_CHECK(inv_temperature.scalar_type() == at::kFloat && inv_temperature.is_contiguous() &&
                  inv_temperature.numel() == rows,
              "sample_rows: inv_temperature must be float32 [rows]");
  TORCH_CHECK(uniform.scalar_type() == at::kFloat && uniform.is_contiguous() && uniform.numel() == rows,
              "sample_rows: uniform must be float32 [rows]");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  const float* scale = inv_temperature.data_ptr<float>();
  const float* u = uniform.data_ptr<float>();
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* src = reinterpret_cast<const T*>(logits.data_ptr());
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      std::vector<double> cumulative;
      for (int64_t r = begin; r < end; ++r) dst[r] = sample_row(src + r * stride, n, scale[r], u[r], cumulative);
    });
  };
  pagedllm_dispatch::dispatch_float_types(logits, "sample_rows", run);
  return out;
}

std::string sample_rows_isa() { return ISA; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("sample_rows(Tensor logits, Tensor inv_temperature, Tensor uniform) -> Tensor");
  m.def("sample_rows_isa() -> str", &sample_rows_isa);
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("sample_rows", &sample_rows); }
