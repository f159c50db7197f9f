// Small CPU kernels around the model step.
//
// write_kv_: this step's K/V rows into their cache slots, a row copy per token: index_copy_
// sends its strided source through TensorIterator, dear at decode sizes.
//
// argmax_rows: greedy sampling, each row's argmax as torch.argmax gives it (argmax.h's scan).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "argmax.h"
#include "dispatch.h"
#include "parallel.h"
#include "vec.h"
#include "vec_avx2.h"

namespace {

using pagedllm_dispatch::dispatch_float_types;

using pagedllm_vec::to_float;
#if defined(__AVX512F__)
using pagedllm_vec::exp512;
using pagedllm_vec::from_bf16;
using pagedllm_vec::tail_mask;
#endif
#if defined(__AVX512BF16__)
using pagedllm_vec::to_bf16;
#endif
// AVX2 machines without AVX-512: float32 rows get 8-lane vectors, bf16 the scalar code.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define PAGEDLLM_OPS_AVX2 1
using pagedllm_vec::exp256;
using pagedllm_vec::hsum;
using pagedllm_vec::lanes;
#endif

using pagedllm_argmax::argmax_row;

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "argmax_rows expects [rows, n] with unit last stride");
  TORCH_CHECK(x.size(1) > 0, "argmax_rows: empty rows");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* dst = out.data_ptr<int64_t>();
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* src = reinterpret_cast<const T*>(x.data_ptr());
    pagedllm_parallel::parallel_rows(rows, n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) dst[r] = argmax_row(src + r * stride, n);
    });
  };
  dispatch_float_types(x, "argmax_rows", run);
  return out;
}

// ---------------------------------------------------------------------------------------
// Fused element-wise layer ops. Each replaces 3-12 small ATen ops (each a dispatch and a
// pass over memory) and rounds exactly where the unfused torch code rounds, so results match
// it: products and sums are rounded to the tensor dtype at the same points.

#if defined(__AVX512F__)
inline void store16(float* p, __m512 v, __mmask16 m = 0xFFFF) { _mm512_mask_storeu_ps(p, m, v); }
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m = 0xFFFF) {
#if defined(__AVX512BF16__)
  _mm256_mask_storeu_epi16(p, m, to_bf16(v));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i)
    if (m & (1u << i)) p[i] = c10::BFloat16(tmp[i]);
#endif
}
inline __m512 load16m(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16m(const c10::BFloat16* p, __mmask16 m) { return from_bf16(_mm256_maskz_loadu_epi16(m, p)); }
// Round to T and back: where torch stores an intermediate in T.
inline __m512 round_to(__m512 v, float*) { return v; }
inline __m512 round_to(__m512 v, c10::BFloat16*) {
#if defined(__AVX512BF16__)
  return from_bf16(to_bf16(v));
#else
  alignas(64) float tmp[16];
  _mm512_store_ps(tmp, v);
  for (int i = 0; i < 16; ++i) tmp[i] = static_cast<float>(c10::BFloat16(tmp[i]));
  return _mm512_load_ps(tmp);
#endif
}

#endif

template <typename T>
T* ptr(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// An element of silu_mul or gelu_tanh_mul in parallel_rows' units: an exp and a division,
// against a norm's multiply-add.
constexpr int64_t EXP_UNITS = 8;


#if defined(PAGEDLLM_OPS_AVX2)
// Whole 8-lane vectors with plain loads and stores, the tail with masked ones (a masked store
// is microcoded on AMD Zen, too slow to take for every vector).
// f(i, m, whole) handles lanes [i, i + 8) under mask m (all lanes, and whole, but at the tail).
template <typename F>
inline void for_lanes(int64_t n, F&& f) {
  const __m256i all = _mm256_set1_epi32(-1);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) f(i, all, true);
  if (i < n) f(i, lanes(n - i), false);
}

inline __m256 load8(const float* p, __m256i m, bool whole) {
  return whole ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, m);
}

inline void store8(float* p, __m256 v, __m256i m, bool whole) {
  if (whole) {
    _mm256_storeu_ps(p, v);
  } else {
    _mm256_maskstore_ps(p, m, v);
  }
}

// One float32 row of rms_norm_rows on 8-lane vectors.
inline void rms_norm_row_avx2(const float* x, float* residual, const float* weight, float* out, int64_t hidden,
                              float eps) {
  __m256 ss = _mm256_setzero_ps();
  for_lanes(hidden, [&](int64_t i, __m256i m, bool whole) {
    __m256 v = load8(x + i, m, whole);
    if (residual) {
      v = _mm256_add_ps(v, load8(residual + i, m, whole));
      store8(residual + i, v, m, whole);
    }
    ss = _mm256_fmadd_ps(v, v, ss);
  });
  const __m256 inv = _mm256_set1_ps(1.0f / std::sqrt(hsum(ss) / static_cast<float>(hidden) + eps));
  const float* read = residual ? residual : x;
  for_lanes(hidden, [&](int64_t i, __m256i m, bool whole) {
    const __m256 y = _mm256_mul_ps(load8(read + i, m, whole), inv);
    store8(out + i, _mm256_mul_ps(load8(weight + i, m, whole), y), m, whole);
  });
}

// One head of rope_one in float32: each product and the sum rounded as the torch expression.
inline void rope_head_avx2(float* v, const float* c, const float* s, int64_t half) {
  for_lanes(half, [&](int64_t i, __m256i m, bool whole) {
    const __m256 x1 = load8(v + i, m, whole), x2 = load8(v + half + i, m, whole);
    const __m256 a1 = _mm256_mul_ps(x1, load8(c + i, m, whole));
    const __m256 b1 = _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), load8(s + i, m, whole));
    const __m256 a2 = _mm256_mul_ps(x2, load8(c + half + i, m, whole));
    const __m256 b2 = _mm256_mul_ps(x1, load8(s + half + i, m, whole));
    store8(v + i, _mm256_add_ps(a1, b1), m, whole);
    store8(v + half + i, _mm256_add_ps(a2, b2), m, whole);
  });
}

#endif

// out = weight * to_T(x * rsqrt(mean(x^2) + eps)); with `residual`: first residual += x
// (rounded to T) and the norm reads the new residual. x, residual, out: [rows, hidden].
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t hidden,
                   int64_t x_stride, float eps) {
  pagedllm_parallel::parallel_rows(rows, hidden, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_stride;
      T* src = residual ? residual + r * hidden : nullptr;
      T* dst = out + r * hidden;
#if defined(__AVX512F__)
      __m512 ss = _mm512_setzero_ps();
      for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = tail_mask(hidden - i);
        __m512 v = load16m(xr + i, m);
        if (src) {
          v = round_to(_mm512_add_ps(v, load16m(src + i, m)), static_cast<T*>(nullptr));
          store16(src + i, v, m);
        }
        ss = _mm512_fmadd_ps(v, v, ss);
      }
      const float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(hidden) + eps);
      const __m512 vinv = _mm512_set1_ps(inv);
      const T* read = src ? src : xr;
      for (int64_t i = 0; i < hidden; i += 16) {
        const __mmask16 m = tail_mask(hidden - i);
        const __m512 y = round_to(_mm512_mul_ps(load16m(read + i, m), vinv), static_cast<T*>(nullptr));
        store16(dst + i, _mm512_mul_ps(load16m(weight + i, m), y), m);
      }
#else
#if defined(PAGEDLLM_OPS_AVX2)
      if constexpr (std::is_same_v<T, float>) {
        rms_norm_row_avx2(xr, src, weight, dst, hidden, eps);
        continue;
      }
#endif
      float ss = 0.0f;
      for (int64_t i = 0; i < hidden; ++i) {
        float v = to_float(xr[i]);
        if (src) {
          v = to_float(static_cast<T>(v + to_float(src[i])));
          src[i] = static_cast<T>(v);
        }
        ss += v * v;
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + eps);
      const T* read = src ? src : xr;
      for (int64_t i = 0; i < hidden; ++i) {
        const float y = to_float(static_cast<T>(to_float(read[i]) * inv));
        dst[i] = static_cast<T>(to_float(weight[i]) * y);
      }
#endif
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be 2-D with unit last stride");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "rms_norm: weight must be contiguous [hidden] in x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch_float_types(x, "rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(ptr<T>(x), nullptr, ptr<T>(weight), ptr<T>(out), x.size(0), x.size(1), x.stride(0),
                     static_cast<float>(eps));
  });
  return out;
}

// residual += x; returns rms_norm(residual). residual is updated in place.
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor residual, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must be contiguous, shaped and typed like x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be contiguous [hidden] in x's dtype");
  at::Tensor out = at::empty({x.size(0), x.size(1)}, x.options());
  dispatch_float_types(x, "add_rms_norm", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rms_norm_rows<T>(ptr<T>(x), ptr<T>(residual), ptr<T>(weight), ptr<T>(out), x.size(0), x.size(1), x.stride(0),
                     static_cast<float>(eps));
  });
  return out;
}

// In place, for x in (q, k): x = x * cos + rotate_half(x) * sin, each product and the sum
// rounded to T as the unfused torch expression does. x: [tokens, heads, head_dim] (any
// token/head strides); cos, sin: [tokens, head_dim] contiguous.
template <typename T>
void rope_one(at::Tensor& x, const T* cos, const T* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  const int64_t st = x.stride(0), sh = x.stride(1);
  T* base = ptr<T>(x);
  pagedllm_parallel::parallel_rows(tokens, heads * dim, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = base + t * st + h * sh;
#if defined(__AVX512F__)
        for (int64_t i = 0; i < half; i += 16) {
          const __mmask16 m = tail_mask(half - i);
          const __m512 x1 = load16m(v + i, m), x2 = load16m(v + half + i, m);
          const __m512 a1 = round_to(_mm512_mul_ps(x1, load16m(c + i, m)), static_cast<T*>(nullptr));
          const __m512 b1 = round_to(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load16m(s + i, m)),
                                     static_cast<T*>(nullptr));
          const __m512 a2 = round_to(_mm512_mul_ps(x2, load16m(c + half + i, m)), static_cast<T*>(nullptr));
          const __m512 b2 = round_to(_mm512_mul_ps(x1, load16m(s + half + i, m)), static_cast<T*>(nullptr));
          store16(v + i, _mm512_add_ps(a1, b1), m);
          store16(v + half + i, _mm512_add_ps(a2, b2), m);
        }
#else
#if defined(PAGEDLLM_OPS_AVX2)
        if constexpr (std::is_same_v<T, float>) {
          rope_head_avx2(v, c, s, half);
          continue;
        }
#endif
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = to_float(v[i]), x2 = to_float(v[half + i]);
          const float a1 = to_float(static_cast<T>(x1 * to_float(c[i])));
          const float b1 = to_float(static_cast<T>(-x2 * to_float(s[i])));
          const float a2 = to_float(static_cast<T>(x2 * to_float(c[half + i])));
          const float b2 = to_float(static_cast<T>(x1 * to_float(s[half + i])));
          v[i] = static_cast<T>(a1 + b1);
          v[half + i] = static_cast<T>(a2 + b2);
        }
#endif
      }
    }
  });
}

void rope_(at::Tensor q, at::Tensor k, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1, "rope_: q, k [T, H, D]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.dim() == 2 && cos.size(1) == q.size(2) &&
                  cos.size(0) == q.size(0) && sin.sizes() == cos.sizes() && k.size(2) == q.size(2) &&
                  k.size(0) == q.size(0) && q.size(2) % 2 == 0,
              "rope_: cos/sin must be contiguous [T, head_dim]");
  TORCH_CHECK(cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type() &&
                  k.scalar_type() == q.scalar_type(),
              "rope_: one dtype for q, k, cos, sin");
  dispatch_float_types(q, "rope_", [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    rope_one<T>(q, ptr<T>(cos), ptr<T>(sin));
    rope_one<T>(k, ptr<T>(cos), ptr<T>(sin));
  });
}

// The gating activations: act(gate) on a float and on 16 or 8 lanes (AVX-512; float32 rows on
// AVX2), each on one exp and one division.
// silu(g) = g / (1 + e^-g).
struct Silu {
  static float on(float g) { return g / (1.0f + std::exp(-g)); }
#if defined(__AVX512F__)
  static __m512 on(__m512 g) {
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  }
#elif defined(PAGEDLLM_OPS_AVX2)
  static __m256 on(__m256 g) {
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_sub_ps(_mm256_setzero_ps(), g))));
  }
#endif
};

// GELU's tanh approximation, 0.5 g (1 + tanh(u)) with u = beta (g + kappa g^3), as
// g / (1 + e^-2u): the same function (1 + tanh(u) = 2 / (1 + e^-2u)) with no cancellation
// where tanh(u) nears -1. ATen's form through Sleef's tanh took ~10 ns an element, the whole
// of a Gemma decode step's GELU, and loses ~1e-3 of the value there in float32.
struct GeluTanh {
  static constexpr float beta = 0.7978845608028654f;  // sqrt(2 / pi)
  static constexpr float kappa = 0.044715f;
  static float on(float g) { return g / (1.0f + std::exp(-2.0f * beta * (g + kappa * (g * g * g)))); }
#if defined(__AVX512F__)
  static __m512 on(__m512 g) {
    const __m512 u = _mm512_fmadd_ps(_mm512_set1_ps(kappa), _mm512_mul_ps(_mm512_mul_ps(g, g), g), g);
    return _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(_mm512_mul_ps(_mm512_set1_ps(-2.0f * beta), u))));
  }
#elif defined(PAGEDLLM_OPS_AVX2)
  static __m256 on(__m256 g) {
    const __m256 u = _mm256_fmadd_ps(_mm256_set1_ps(kappa), _mm256_mul_ps(_mm256_mul_ps(g, g), g), g);
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp256(_mm256_mul_ps(_mm256_set1_ps(-2.0f * beta), u))));
  }
#endif
};

// x: [T, 2 * inter] = [gate | up]  ->  to_T(Act(gate)) * up, rounded to T.
template <typename Act>
at::Tensor gated(const at::Tensor& x, const char* name) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, name, ": last dim must be even");
  const int64_t rows = x.size(0), inter = x.size(1) / 2, stride = x.stride(0);
  at::Tensor out = at::empty({rows, inter}, x.options());
  dispatch_float_types(x, name, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* src = ptr<T>(x);
    T* dst = ptr<T>(out);
    pagedllm_parallel::parallel_rows(rows, inter * EXP_UNITS, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T* g = src + r * stride;
        const T* u = g + inter;
        T* o = dst + r * inter;
#if defined(__AVX512F__)
        for (int64_t i = 0; i < inter; i += 16) {
          const __mmask16 m = tail_mask(inter - i);
          const __m512 act = round_to(Act::on(load16m(g + i, m)), static_cast<T*>(nullptr));
          store16(o + i, _mm512_mul_ps(act, load16m(u + i, m)), m);
        }
#else
#if defined(PAGEDLLM_OPS_AVX2)
        if constexpr (std::is_same_v<T, float>) {
          for_lanes(inter, [&](int64_t i, __m256i m, bool whole) {
            store8(o + i, _mm256_mul_ps(Act::on(load8(g + i, m, whole)), load8(u + i, m, whole)), m, whole);
          });
          continue;
        }
#endif
        for (int64_t i = 0; i < inter; ++i)
          o[i] = static_cast<T>(to_float(static_cast<T>(Act::on(to_float(g[i])))) * to_float(u[i]));
#endif
      }
    });
  });
  return out;
}

// Llama's gating: silu(gate) * up.
at::Tensor silu_mul(const at::Tensor& x) { return gated<Silu>(x, "silu_mul"); }

// Gemma's: gelu(gate, "tanh") * up (within ~2e-7 of the function in float32; ATen's form
// is further off where the gate is below about -3).
at::Tensor gelu_tanh_mul(const at::Tensor& x) { return gated<GeluTanh>(x, "gelu_tanh_mul"); }

// k_cache/v_cache [blocks, block_size, kv_heads, head_dim] (contiguous); key/value [T, kv_heads,
// head_dim] with whole rows contiguous; slot_mapping [T] int64: row t goes to flat slot
// slot_mapping[t] (block * block_size + offset). Layouts and dtypes it does not take are
// refused with NotImplementedError (the caller then uses the reference write), bad slots with
// RuntimeError; either way before anything is written.
void write_kv_(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& key, const at::Tensor& value,
               const at::Tensor& slot_mapping) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
      "write_kv_: caches must be contiguous [blocks, block_size, kv_heads, head_dim] and of one shape");
  TORCH_CHECK_NOT_IMPLEMENTED(
      key.scalar_type() == k_cache.scalar_type() && value.scalar_type() == k_cache.scalar_type() &&
          v_cache.scalar_type() == k_cache.scalar_type(),
      "write_kv_: key, value and caches must share a dtype");
  const int64_t heads = k_cache.size(2), dim = k_cache.size(3), row = heads * dim;
  TORCH_CHECK_NOT_IMPLEMENTED(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
                                  slot_mapping.is_contiguous(),
                              "write_kv_: slot_mapping must be a 1-D int64 tensor");
  const int64_t num_tokens = slot_mapping.size(0);
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK_NOT_IMPLEMENTED(t->dim() == 3 && t->size(0) == num_tokens && t->size(1) == heads &&
                                    t->size(2) == dim && t->stride(2) == 1 && t->stride(1) == dim,
                                "write_kv_: key and value must be [T, kv_heads, head_dim] with contiguous rows");
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "write_kv_: slot ", slots[t], " out of range [0, ",
                num_slots, ")");
  const int64_t bytes = row * static_cast<int64_t>(k_cache.element_size());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* kp = static_cast<const char*>(key.data_ptr());
  const char* vp = static_cast<const char*>(value.data_ptr());
  const int64_t k_stride = key.stride(0) * key.element_size(), v_stride = value.stride(0) * value.element_size();
  at::parallel_for(0, num_tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      std::memcpy(kc + slots[t] * bytes, kp + t * k_stride, bytes);
      std::memcpy(vc + slots[t] * bytes, vp + t * v_stride, bytes);
    }
  });
}

// `jobs` jobs of 1..max_total indices posted one after another to a step team, each index
// counting its runs in the job's own vector: the number of indices not run exactly once
// (0 expected). A check of the team's hand-off (tests): most of these jobs are small enough
// for the poster to finish alone before the helper arrives, the case that once let a late
// helper claim indices of the next job under the last one's epoch.
int64_t team_selftest(int64_t jobs, int64_t max_total) {
  TORCH_CHECK(jobs >= 0 && max_total >= 1, "team_selftest: jobs >= 0, max_total >= 1");
  return pagedllm_parallel::with_team([&] {
    int64_t wrong = 0;
    for (int64_t j = 0; j < jobs; ++j) {
      std::vector<std::atomic<int32_t>> runs(1 + (j * 7919) % max_total);  // zeros
      const int64_t total = static_cast<int64_t>(runs.size());
      pagedllm_parallel::parallel_chunks(total, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) runs[i].fetch_add(1);
      });
      for (const auto& r : runs) wrong += r.load() != 1;
    }
    return wrong;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("team_selftest(int jobs, int max_total) -> int", &team_selftest);
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("gelu_tanh_mul(Tensor x) -> Tensor");
  m.def("write_kv_(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("argmax_rows", &argmax_rows);
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("write_kv_", &write_kv_);
}
