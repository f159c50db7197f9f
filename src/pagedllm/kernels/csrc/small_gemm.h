// small_gemm's shared definitions: the packed weight layout, a bf16 problem after its checks,
// and the ISA variants behind small_gemm.cpp's one dispatch (small_gemm_amx.cpp: the tile
// unit; small_gemm_avx512.cpp: AVX-512-bf16 dot products and the float32 AVX-512 kernel;
// small_gemm_avx2.cpp: the float32 AVX2 + FMA kernel).
//
// Packed bf16 layout of w [N, K]: [N / 16][K / 32][16][32] bf16 — for each group of 16
// output columns, for each 32-wide slice of K, one tile whose row p holds, for each column
// n, the pair (w[n][32s + 2p], w[n][32s + 2p + 1]). Read as 32-bit words, a group is
// [K / 2][16]: pair j of all 16 columns side by side, which is also what vdpbf16ps takes.
// float32 layout: [N / 16][K][16].
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

#include "vec.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagedllm_gemm {

constexpr int64_t COLS = 16;   // output columns per group
constexpr int64_t DEPTH = 32;  // K per tile step
constexpr int64_t ROWS = 16;   // x rows per A/C tile

// The bf16 routes, best first; a route is used only where it is built and the CPU has it.
enum class Isa { amx = 0, avx512_bf16 = 1, none = 2 };

// A bf16 problem after the checks: x padded to whole 16-row tiles where the tile unit
// needs it, pointers in place.
struct Bf16Gemm {
  const uint16_t* x = nullptr;  // x's rows, lda elements apart (unless padded)
  int64_t lda = 0;
  // x in whole 16-row tiles (rows m.. zero), when the tile unit cannot read x in place
  // (m not a multiple of 16, or rows off cache lines); else empty.
  pagedllm_vec::LineVector<uint16_t> padded;
  const c10::BFloat16* bias = nullptr;  // [n], or null
  const uint16_t* w = nullptr;          // the packed weight
  int64_t m = 0, k = 0, n = 0;

  const uint16_t* rows() const { return padded.empty() ? x : padded.data(); }
  int64_t row_stride() const { return padded.empty() ? lda : k; }
};

#if defined(__AVX512F__)
// Receives v = the 16 fp32 sums (bias added) of one row and one group of 16 output columns.
// Within one call of a *_groups function, each row meets its groups in increasing order.
class Emit {
 public:
  virtual void operator()(int64_t row, int64_t group, __m512 v) = 0;
  // A register block at once: rows [row0, row0 + rows) x groups [group0, group0 + groups),
  // row r's sums for group j at sums[r * stride + j], bias[j] not yet added. One virtual call
  // a block rather than one per 16 sums.
  virtual void block(int64_t row0, int rows, int64_t group0, int groups, const __m512* sums, int stride,
                     const __m512* bias) = 0;

 protected:
  ~Emit() = default;
};

// An emitter whose blocks reach Self's operator() by direct calls (Self is final): rows in
// order, each row's groups in increasing order.
template <typename Self>
class BlockEmit : public Emit {
 public:
  void block(int64_t row0, int rows, int64_t group0, int groups, const __m512* sums, int stride,
             const __m512* bias) override {
    Self& self = static_cast<Self&>(*this);
    for (int r = 0; r < rows; ++r)
      for (int j = 0; j < groups; ++j) self(row0 + r, group0 + j, _mm512_add_ps(sums[r * stride + j], bias[j]));
  }

 protected:
  ~BlockEmit() = default;
};

// Column groups [g0, g1) of the problem: one thread's contiguous stream of weights.
void amx_groups(const Bf16Gemm& p, int64_t g0, int64_t g1, Emit& emit);
void avx512_bf16_groups(const Bf16Gemm& p, int64_t g0, int64_t g1, Emit& emit);
#endif

bool amx_built();
bool avx512_bf16_built();
bool amx_permitted();

// The bf16 route small_gemm runs now (set_small_gemm_isa's cap applied), and x's rows as a
// problem for it (padded to whole tiles where the tile unit needs that; w, n, bias unset):
// for kernels that feed small_gemm weights of their own (quant_tiles.cpp).
Isa bf16_route();
Bf16Gemm bf16_rows(Isa isa, const uint16_t* x, int64_t lda, int64_t m, int64_t k);
#if defined(__AVX512F__)
// Column groups [g0, g1) of p on `isa` (amx or avx512_bf16).
void bf16_groups(Isa isa, const Bf16Gemm& p, int64_t g0, int64_t g1, Emit& emit);
#endif

// float32: out = x @ w.T + bias (w packed [N / 16][K][16]); x [m, k] with row stride lda,
// out [m, n] contiguous. One variant per ISA, the same bits from each: AVX-512
// (small_gemm_avx512.cpp) and AVX2 + FMA (small_gemm_avx2.cpp).
bool avx512_f32_built();
void avx512_f32_gemm(const float* x, int64_t lda, int64_t m, int64_t k, const float* w, int64_t n,
                     const float* bias, float* out);
bool avx2_f32_built();
void avx2_f32_gemm(const float* x, int64_t lda, int64_t m, int64_t k, const float* w, int64_t n, const float* bias,
                   float* out);
// float32 on the route small_gemm runs now (set_small_gemm_f32_isa's cap applied); false
// where it has none.
bool f32_route_gemm(const float* x, int64_t lda, int64_t m, int64_t k, const float* w, int64_t n, const float* bias,
                    float* out);

}  // namespace pagedllm_gemm
