// small_gemm: linear layers for decode-sized batches and prompt chunks, on weights re-laid in
// the order the kernel consumes them (small_gemm.h), so every thread streams one contiguous
// range front to back. This file packs the weights, checks the arguments and dispatches to
// one ISA variant: bf16 on the tile unit (small_gemm_amx.cpp) or with AVX-512-bf16 dot
// products (small_gemm_avx512.cpp), float32 with FMAs on AVX-512 (small_gemm_avx512.cpp) or
// AVX2 (small_gemm_avx2.cpp), which give the same bits.
//
// out = x @ w.T (+ bias): fp32 sums of bf16 products, rounded once to bf16 (as oneDNN).

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

#include "small_gemm.h"

namespace {

using pagedllm_gemm::Bf16Gemm;
using pagedllm_gemm::COLS;
using pagedllm_gemm::DEPTH;
using pagedllm_gemm::Isa;
using pagedllm_gemm::ROWS;

bool shape_ok(int64_t n, int64_t k) { return n > 0 && k > 0 && n % COLS == 0 && k % DEPTH == 0; }

bool isa_ready(Isa isa) {
  switch (isa) {
    case Isa::amx: return pagedllm_gemm::amx_built() && pagedllm_gemm::amx_permitted();
    case Isa::avx512_bf16: return pagedllm_gemm::avx512_bf16_built();
    default: return false;
  }
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::amx: return "amx";
    case Isa::avx512_bf16: return "avx512_bf16";
    default: return "none";
  }
}

// The best bf16 route allowed: tests and benchmarks lower the cap to run a slower variant on
// a CPU that has a faster one (set_small_gemm_isa).
std::atomic<int>& isa_cap() {
  static std::atomic<int> cap{static_cast<int>(Isa::amx)};
  return cap;
}

Isa bf16_isa() {
  for (int i = isa_cap().load(); i < static_cast<int>(Isa::none); ++i)
    if (isa_ready(static_cast<Isa>(i))) return static_cast<Isa>(i);
  return Isa::none;
}

std::string small_gemm_isa() { return isa_name(bf16_isa()); }

// Caps the bf16 route at `isa` ("amx", "avx512_bf16" or "none"); returns the previous cap.
std::string set_small_gemm_isa(const std::string& isa) {
  for (int i = 0; i <= static_cast<int>(Isa::none); ++i) {
    if (isa == isa_name(static_cast<Isa>(i))) return isa_name(static_cast<Isa>(isa_cap().exchange(i)));
  }
  TORCH_CHECK(false, "set_small_gemm_isa: unknown ISA '", isa, "' (amx, avx512_bf16, none)");
}

// The float32 routes, best first, as for bf16; both give the same bits.
enum class F32Isa { avx512 = 0, avx2 = 1, none = 2 };

bool f32_ready(F32Isa isa) {
  switch (isa) {
    case F32Isa::avx512: return pagedllm_gemm::avx512_f32_built();
    case F32Isa::avx2: return pagedllm_gemm::avx2_f32_built();
    default: return false;
  }
}

const char* f32_name(F32Isa isa) {
  switch (isa) {
    case F32Isa::avx512: return "avx512";
    case F32Isa::avx2: return "avx2";
    default: return "none";
  }
}

// The best float32 route allowed (set_small_gemm_f32_isa): tests run AVX2 on an AVX-512 CPU
// to compare the two.
std::atomic<int>& f32_cap() {
  static std::atomic<int> cap{static_cast<int>(F32Isa::avx512)};
  return cap;
}

F32Isa f32_isa() {
  for (int i = f32_cap().load(); i < static_cast<int>(F32Isa::none); ++i)
    if (f32_ready(static_cast<F32Isa>(i))) return static_cast<F32Isa>(i);
  return F32Isa::none;
}

// bf16 needs the tile unit or AVX-512-bf16, float32 AVX-512 or AVX2 + FMA.
bool available(bool bf16) { return bf16 ? bf16_isa() != Isa::none : f32_isa() != F32Isa::none; }

std::string small_gemm_f32_isa() { return f32_name(f32_isa()); }

// Caps the float32 route at `isa` ("avx512", "avx2" or "none"); returns the previous cap.
std::string set_small_gemm_f32_isa(const std::string& isa) {
  for (int i = 0; i <= static_cast<int>(F32Isa::none); ++i) {
    if (isa == f32_name(static_cast<F32Isa>(i))) return f32_name(static_cast<F32Isa>(f32_cap().exchange(i)));
  }
  TORCH_CHECK(false, "set_small_gemm_f32_isa: unknown ISA '", isa, "' (avx512, avx2, none)");
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

// The float32 kernel of `isa` (not none).
void f32_gemm(F32Isa isa, const float* x, int64_t lda, int64_t m, int64_t k, const float* w, int64_t n,
              const float* bias, float* out) {
  if (isa == F32Isa::avx512) return pagedllm_gemm::avx512_f32_gemm(x, lda, m, k, w, n, bias, out);
  return pagedllm_gemm::avx2_f32_gemm(x, lda, m, k, w, n, bias, out);
}

// float32: the AVX-512 kernel, else the AVX2 one.
at::Tensor small_gemm_f32(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const F32Isa isa = f32_isa();
  TORCH_CHECK(isa != F32Isa::none, "small_gemm in float32 needs AVX-512 or AVX2 with FMA");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.size(2) == COLS,
              "small_gemm: packed must come from pack_small_gemm");
  const int64_t m = x.size(0), k = x.size(1), n = packed.size(0) * COLS;
  TORCH_CHECK(packed.size(1) == k, "small_gemm: x has ", k, " columns, the weight ", packed.size(1));
  if (bias.has_value())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kFloat,
                "small_gemm: bias must be float32 [N]");
  at::Tensor out = at::empty({m, n}, x.options());
  if (m == 0) return out;
  const at::Tensor bias_c = bias.has_value() ? bias->contiguous() : at::Tensor();
  f32_gemm(isa, x.data_ptr<float>(), x.stride(0), m, k, packed.data_ptr<float>(), n,
           bias_c.defined() ? bias_c.data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out;
}

// p's rows: x in place, or (the tile unit reads whole 16-row tiles only) padded with zero
// rows when m is not a multiple of 16. A plain copy, not a padded tensor (three torch ops a
// call are dear at decode sizes). x's rows are read in place only when they start on cache
// lines.
void pad_rows(Isa isa, const uint16_t* x, int64_t lda, Bf16Gemm& p) {
  p.x = x;
  p.lda = lda;
  if (isa != Isa::amx) return;
  const int64_t padded_m = (p.m + ROWS - 1) / ROWS * ROWS;
  const bool aligned = pagedllm_vec::on_line(p.x) && (p.lda * 2) % 64 == 0;
  if (padded_m != p.m || p.lda < p.k || !aligned) {
    p.padded.assign(padded_m * p.k, 0);
    for (int64_t r = 0; r < p.m; ++r) std::copy_n(p.x + r * p.lda, p.k, p.padded.data() + r * p.k);
  }
}

// A checked bf16 problem and the route that will run it; `bias_c` keeps a contiguous bias alive.
Bf16Gemm prepare_bf16(Isa isa, const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                      at::Tensor& bias_c) {
  TORCH_CHECK(isa != Isa::none, "small_gemm in bf16 needs the AMX tile unit or AVX-512-bf16");
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
    bias_c = bias->contiguous();
    p.bias = bias_c.data_ptr<c10::BFloat16>();
  }
  p.w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  pad_rows(isa, reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), p);
  return p;
}

#if defined(__AVX512BF16__)
void run_groups(Isa isa, const Bf16Gemm& p, int64_t g0, int64_t g1, pagedllm_gemm::Emit& emit) {
  if (isa == Isa::amx) return pagedllm_gemm::amx_groups(p, g0, g1, emit);
  return pagedllm_gemm::avx512_bf16_groups(p, g0, g1, emit);
}

// Each sum rounded to bf16 and stored.
class Store final : public pagedllm_gemm::BlockEmit<Store> {
 public:
  Store(c10::BFloat16* out, int64_t n) : out_(out), n_(n) {}
  void operator()(int64_t r, int64_t g, __m512 v) override {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out_ + r * n_ + g * COLS), pagedllm_vec::to_bf16(v));
  }

 private:
  c10::BFloat16* out_;
  int64_t n_;
};
#endif

at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "small_gemm: x must be 2-D with unit column stride");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(), "small_gemm: x and the packed weight must share a dtype");
  if (x.scalar_type() == at::kFloat) return small_gemm_f32(x, packed, bias);
  const Isa isa = bf16_isa();
  at::Tensor bias_c;
  const Bf16Gemm p = prepare_bf16(isa, x, packed, bias, bias_c);
  at::Tensor out = at::empty({p.m, p.n}, x.options());
  if (p.m == 0) return out;
#if defined(__AVX512BF16__)
  c10::BFloat16* o = out.data_ptr<c10::BFloat16>();
  // Each thread takes one contiguous range of column groups: one front-to-back stream.
  at::parallel_for(0, p.n / COLS, 1, [&](int64_t g0, int64_t g1) {
    Store store(o, p.n);
    run_groups(isa, p, g0, g1, store);
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

#if defined(__AVX512BF16__)
// Per row, per lane: the lane's best value (rounded to bf16) and its column, over groups
// [g0, ...) met in increasing order.
class ArgmaxLanes final : public pagedllm_gemm::BlockEmit<ArgmaxLanes> {
 public:
  ArgmaxLanes(int64_t m, int64_t g0) : value(m), index(m), g0_(g0) {}
  void operator()(int64_t r, int64_t g, __m512 v) override {
    v = pagedllm_vec::from_bf16(pagedllm_vec::to_bf16(v));
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i columns = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(g * COLS)), lanes);
    if (g == g0_) {
      value[r] = v;
      index[r] = columns;
      return;
    }
    const __mmask16 best_nan = _mm512_cmp_ps_mask(value[r], value[r], _CMP_UNORD_Q);
    const __mmask16 take = _mm512_kandn(
        best_nan, _mm512_kor(_mm512_cmp_ps_mask(v, value[r], _CMP_GT_OQ), _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q)));
    value[r] = _mm512_mask_mov_ps(value[r], take, v);
    index[r] = _mm512_mask_mov_epi32(index[r], take, columns);
  }

  // Row r's best over its 16 lanes: the lowest column among equal values.
  Best best(int64_t r) const {
    alignas(64) float vals[16];
    alignas(64) int32_t cols[16];
    _mm512_store_ps(vals, value[r]);
    _mm512_store_si512(cols, index[r]);
    Best b{vals[0], cols[0]};
    for (int j = 1; j < 16; ++j) {
      const bool same = vals[j] == b.value || (std::isnan(vals[j]) && std::isnan(b.value));
      if (beats(vals[j], b.value) || (same && cols[j] < b.index)) b = {vals[j], cols[j]};
    }
    return b;
  }

 private:
  std::vector<__m512> value;
  std::vector<__m512i> index;
  int64_t g0_;
};
#endif

// argmax over each row of the bf16 logits small_gemm would return — the same roundings —
// without writing them: for greedy sampling straight from the LM head.
at::Tensor small_gemm_argmax(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  const Isa isa = bf16_isa();
  at::Tensor bias_c;
  const Bf16Gemm p = prepare_bf16(isa, x, packed, bias, bias_c);
  at::Tensor out = at::empty({p.m}, x.options().dtype(at::kLong));
  if (p.m == 0) return out;
#if defined(__AVX512BF16__)
  const int64_t groups = p.n / COLS;
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  // One contiguous column range per part, so a part's winner is its first best column and
  // the parts merge in column order.
  std::vector<Best> found(parts * p.m);
  at::parallel_for(0, parts, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t g0 = t * groups / parts, g1 = (t + 1) * groups / parts;
      ArgmaxLanes lanes(p.m, g0);
      run_groups(isa, p, g0, g1, lanes);
      for (int64_t r = 0; r < p.m; ++r) found[t * p.m + r] = lanes.best(r);
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

namespace pagedllm_gemm {

Isa bf16_route() { return bf16_isa(); }

Bf16Gemm bf16_rows(Isa isa, const uint16_t* x, int64_t lda, int64_t m, int64_t k) {
  Bf16Gemm p;
  p.m = m;
  p.k = k;
  pad_rows(isa, x, lda, p);
  return p;
}

#if defined(__AVX512F__)
void bf16_groups(Isa isa, const Bf16Gemm& p, int64_t g0, int64_t g1, Emit& emit) {
#if defined(__AVX512BF16__)
  run_groups(isa, p, g0, g1, emit);
#else
  TORCH_CHECK(false, "small_gemm: built without AVX-512-bf16");
#endif
}
#endif

bool f32_route_gemm(const float* x, int64_t lda, int64_t m, int64_t k, const float* w, int64_t n, const float* bias,
                    float* out) {
  const F32Isa isa = f32_isa();
  if (isa == F32Isa::none) return false;
  f32_gemm(isa, x, lda, m, k, w, n, bias, out);
  return true;
}

}  // namespace pagedllm_gemm

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("small_gemm_available(bool bf16=True) -> bool", &available);
  m.def("small_gemm_isa() -> str", &small_gemm_isa);
  m.def("set_small_gemm_isa(str isa) -> str", &set_small_gemm_isa);
  m.def("small_gemm_f32_isa() -> str", &small_gemm_f32_isa);
  m.def("set_small_gemm_f32_isa(str isa) -> str", &set_small_gemm_f32_isa);
  m.def("pack_small_gemm(Tensor w) -> Tensor");
  m.def("small_gemm(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
  m.def("small_gemm_argmax(Tensor x, Tensor packed, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("pack_small_gemm", &pack_small_gemm);
  m.impl("small_gemm", &small_gemm);
  m.impl("small_gemm_argmax", &small_gemm_argmax);
}
