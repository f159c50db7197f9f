// quant_write: one step's K/V into a quantized paged cache, as attention/quant.py's write_step
// (the reference) does it, bit for bit: build each sequence's window of touched blocks (the open
// block's earlier rows from staging, zeros elsewhere, the step's rows on top), seal the window
// blocks that are full (quantized into the pool with their scales) and stage the ones still
// open. Returns the K and V windows that quant_attention reads each query's own block from.
//
// write_step is about ten small torch ops a side and layer; this is one call, and the
// one-call decoder loop over a quantized cache (quant_decoder_layers) calls it through the
// dispatcher.
//
// Encoding follows BlockCodec.encode step by step in fp32, with the roundings torch makes:
// the scale rounded to fp16 first and the values divided by that stored scale, halves rounded
// to even, NaN propagated through the max/min as torch's amax/amin do.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "kv_formats.h"
#include "vec.h"

namespace {

using namespace pagedllm_kv;
using pagedllm_vec::to_float;
using OptTensor = std::optional<at::Tensor>;

constexpr float INT8_LEVELS = 127.f;
constexpr float INT4_LEVELS = 15.f;
constexpr float FP16_MAX = 65504.f;

// torch.clamp's arithmetic: NaN passes through.
inline float clamp_max(float x, float hi) { return x > hi ? hi : x; }
inline float clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
// amax / amin: a NaN anywhere is the result.
inline float max_nan(float m, float x) { return (std::isnan(x) || x > m) ? x : m; }
inline float min_nan(float m, float x) { return (std::isnan(x) || x < m) ? x : m; }
inline float fp16(float x) { return static_cast<float>(c10::Half(x)); }
// x / divisor where the divisor is positive, else 0 (torch.where(divisor > 0, ...)), rounded
// half to even.
inline float level(float x, float divisor) { return std::nearbyint(divisor > 0 ? x / divisor : 0.f); }

// One side's pool and staging, as pointers into contiguous tensors.
template <typename T>
struct Side {
  int64_t kind;
  uint8_t* data;       // [blocks, B, H, D] bytes (D/2 for int4)
  c10::Half* scale;    // int8 [blocks, B, H]; int4_channel [blocks, H, D]; int4_token [blocks, B, H, G]
  c10::Half* minimum;  // int4 only, shaped as scale
  T* stage;            // [slots, B, H, D]
  const T* rows;       // the step's [tokens, H, D] rows, contiguous
  T* window;           // [W, B, H, D]
  int64_t num_blocks, num_slots;
};

struct Shape {
  int64_t B, H, D, group;
  int64_t block() const { return B * H * D; }
};

template <typename T>
void encode_int8(const T* x, const Shape& s, int8_t* data, c10::Half* scale) {
  for (int64_t r = 0; r < s.B * s.H; ++r, x += s.D, data += s.D) {
    float m = std::fabs(to_float(x[0]));
    for (int64_t d = 1; d < s.D; ++d) m = max_nan(m, std::fabs(to_float(x[d])));
    scale[r] = c10::Half(clamp_max(m / INT8_LEVELS, FP16_MAX));
    const float divisor = static_cast<float>(scale[r]);
    for (int64_t d = 0; d < s.D; ++d)
      data[d] = static_cast<int8_t>(clamp(level(to_float(x[d]), divisor), -INT8_LEVELS, INT8_LEVELS));
  }
}

// Asymmetric 4-bit over `n` values `step` apart: minimum and scale in fp16, codes 0..15.
template <typename T>
void int4_stats(const T* x, int64_t n, int64_t step, c10::Half& scale, c10::Half& minimum) {
  float lo = to_float(x[0]), hi = lo;
  for (int64_t i = 1; i < n; ++i) {
    lo = min_nan(lo, to_float(x[i * step]));
    hi = max_nan(hi, to_float(x[i * step]));
  }
  minimum = c10::Half(clamp(lo, -FP16_MAX, FP16_MAX));
  scale = c10::Half(clamp_max((hi - static_cast<float>(minimum)) / INT4_LEVELS, FP16_MAX));
}

inline uint8_t int4_code(float x, float minimum, float divisor) {
  return static_cast<uint8_t>(clamp(level(x - minimum, divisor), 0.f, INT4_LEVELS));
}

// Per channel over the block's tokens (K): scale and minimum [H, D].
template <typename T>
void encode_int4_channel(const T* x, const Shape& s, uint8_t* data, c10::Half* scale, c10::Half* minimum) {
  const int64_t token = s.H * s.D;
  for (int64_t c = 0; c < token; ++c) int4_stats(x + c, s.B, token, scale[c], minimum[c]);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t c = 0; c < token; c += 2) {
      const T* v = x + b * token + c;
      const uint8_t lo = int4_code(to_float(v[0]), static_cast<float>(minimum[c]), static_cast<float>(scale[c]));
      const uint8_t hi =
          int4_code(to_float(v[1]), static_cast<float>(minimum[c + 1]), static_cast<float>(scale[c + 1]));
      data[(b * token + c) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
}

// Per token over each group of channels (V): scale and minimum [B, H, D / group].
template <typename T>
void encode_int4_token(const T* x, const Shape& s, uint8_t* data, c10::Half* scale, c10::Half* minimum) {
  const int64_t groups = s.B * s.H * s.D / s.group;
  for (int64_t g = 0; g < groups; ++g) {
    const T* v = x + g * s.group;
    int4_stats(v, s.group, 1, scale[g], minimum[g]);
    const float lo_value = static_cast<float>(minimum[g]), divisor = static_cast<float>(scale[g]);
    for (int64_t c = 0; c < s.group; c += 2) {
      const uint8_t lo = int4_code(to_float(v[c]), lo_value, divisor);
      const uint8_t hi = int4_code(to_float(v[c + 1]), lo_value, divisor);
      data[(g * s.group + c) / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
}

template <typename F8, typename T>
void encode_fp8(const T* x, int64_t n, uint8_t* data) {
  const float limit = static_cast<float>(std::numeric_limits<F8>::max());
  for (int64_t i = 0; i < n; ++i) data[i] = F8(clamp(to_float(x[i]), -limit, limit)).x;
}

// Window block `src` quantized into pool block `block`.
template <typename T>
void seal(const Side<T>& side, const Shape& s, const T* src, int64_t block) {
  const int64_t n = s.block();
  switch (side.kind) {
    case INT8:
      encode_int8(src, s, reinterpret_cast<int8_t*>(side.data) + block * n, side.scale + block * s.B * s.H);
      break;
    case INT4_CHANNEL:
      encode_int4_channel(src, s, side.data + block * n / 2, side.scale + block * s.H * s.D,
                          side.minimum + block * s.H * s.D);
      break;
    case INT4_TOKEN:
      encode_int4_token(src, s, side.data + block * n / 2, side.scale + block * n / s.group,
                        side.minimum + block * n / s.group);
      break;
    case FP8_E4M3:
      encode_fp8<c10::Float8_e4m3fn>(src, n, side.data + block * n);
      break;
    default:
      encode_fp8<c10::Float8_e5m2>(src, n, side.data + block * n);
  }
}

// The step's plan (QuantStep), as raw indices.
struct Plan {
  int64_t num_window;
  std::vector<int64_t> load_slot;  // per window block: its staging slot, or -1 (zeros)
  // Per window block: the first and one past the last row this step writes in it.
  std::vector<int64_t> row_begin, row_end;
  const int64_t* row_slots;
  int64_t num_rows;
  const int64_t *seal_window, *seal_blocks, *keep_window, *keep_slots;
  int64_t num_seal, num_keep;
};

template <typename T>
void write_sides(const std::array<Side<T>, 2>& sides, const Shape& s, const Plan& p) {
  const int64_t n = s.block(), row = s.H * s.D;
  // Windows first (every staged row is read before any slot is written back: a block's slot
  // is usually the one it goes back to).
  at::parallel_for(0, 2 * p.num_window, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Side<T>& side = sides[i % 2];
      const int64_t w = i / 2, slot = p.load_slot[w];
      T* dst = side.window + w * n;
      if (slot >= 0)
        std::memcpy(dst, side.stage + slot * n, n * sizeof(T));
      else
        std::memset(static_cast<void*>(dst), 0, n * sizeof(T));
    }
  });
  at::parallel_for(0, p.num_rows, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (const Side<T>& side : sides)
        std::memcpy(side.window + p.row_slots[t] * row, side.rows + t * row, row * sizeof(T));
  });
  const int64_t jobs = p.num_seal + p.num_keep;
  at::parallel_for(0, 2 * jobs, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Side<T>& side = sides[i % 2];
      const int64_t j = i / 2;
      if (j < p.num_seal) {
        seal(side, s, side.window + p.seal_window[j] * n, p.seal_blocks[j]);
      } else {
        const int64_t k = j - p.num_seal, w = p.keep_window[k], slot = p.keep_slots[k];
        // A block staged back where it was loaded from differs there only in this step's
        // rows (a decode step: one row, not the whole block).
        const bool same = p.load_slot[w] == slot && p.row_begin[w] < p.row_end[w];
        const int64_t first = same ? p.row_begin[w] : 0, count = same ? p.row_end[w] - first : s.B;
        std::memcpy(side.stage + slot * n + first * row, side.window + w * n + first * row,
                    count * row * sizeof(T));
      }
    }
  });
}

const int64_t* indices(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.dim() == 1 && t.is_contiguous(), "quant_write: ", name,
              " must be a 1-D int64 tensor");
  return t.data_ptr<int64_t>();
}

void check_range(const at::Tensor& t, const char* name, int64_t limit) {
  const int64_t* p = indices(t, name);
  for (int64_t i = 0; i < t.numel(); ++i)
    TORCH_CHECK(p[i] >= 0 && p[i] < limit, "quant_write: ", name, " ", p[i], " out of range [0, ", limit, ")");
}

void check_side(const at::Tensor& data, const OptTensor& scale, const OptTensor& minimum, const at::Tensor& stage,
                int64_t kind, const Shape& s) {
  TORCH_CHECK(kind >= INT8 && kind <= FP8_E5M2, "quant_write: unknown format ", kind);
  TORCH_CHECK(stage.dim() == 4 && stage.is_contiguous() && stage.size(1) == s.B && stage.size(2) == s.H &&
                  stage.size(3) == s.D,
              "quant_write: the stages must be contiguous [slots, B, H, D] alike");
  const bool packed = kind == INT4_CHANNEL || kind == INT4_TOKEN;
  TORCH_CHECK(data.dim() == 4 && data.is_contiguous() && data.element_size() == 1 && data.size(1) == s.B &&
                  data.size(2) == s.H && data.size(3) == (packed ? s.D / 2 : s.D),
              "quant_write: data must be contiguous bytes [blocks, B, H, D] (D/2 packed)");
  const int64_t blocks = data.size(0);
  std::vector<int64_t> shape;
  if (kind == INT8) shape = {blocks, s.B, s.H};
  if (kind == INT4_CHANNEL) shape = {blocks, s.H, s.D};
  if (kind == INT4_TOKEN) shape = {blocks, s.B, s.H, s.D / s.group};
  for (const OptTensor* t : {&scale, &minimum}) {
    const bool wanted = t == &scale ? !shape.empty() : packed;
    TORCH_CHECK(t->has_value() == wanted, "quant_write: scale/minimum given where the format has none or missing");
    if (wanted)
      TORCH_CHECK((*t)->scalar_type() == at::kHalf && (*t)->is_contiguous() && (*t)->sizes() == at::IntArrayRef(shape),
                  "quant_write: scales must be contiguous fp16 of the format's shape");
  }
}

// int4 per-token groups: channels per scale, read off the scales' shape as quant_attention
// does (the rule that picks it lives in attention/quant.py's int4_v_group); the whole head
// where no side is int4_token.
int64_t int4_token_group(int64_t k_kind, const OptTensor& k_scale, int64_t v_kind, const OptTensor& v_scale,
                         int64_t head_dim) {
  const OptTensor& scale = v_kind == INT4_TOKEN ? v_scale : k_scale;
  if ((v_kind != INT4_TOKEN && k_kind != INT4_TOKEN) || !scale.has_value() || scale->dim() != 4) return head_dim;
  const int64_t groups = scale->size(3);
  TORCH_CHECK(groups > 0 && head_dim % groups == 0 && (head_dim / groups) % 2 == 0,
              "quant_write: int4 scales must split head_dim into even groups");
  return head_dim / groups;
}

template <typename T>
Side<T> make_side(int64_t kind, at::Tensor& data, const OptTensor& scale, const OptTensor& minimum,
                  at::Tensor& stage, const at::Tensor& rows, at::Tensor& window) {
  Side<T> side{};
  side.kind = kind;
  side.data = static_cast<uint8_t*>(data.data_ptr());
  side.scale = scale.has_value() ? scale->data_ptr<c10::Half>() : nullptr;
  side.minimum = minimum.has_value() ? minimum->data_ptr<c10::Half>() : nullptr;
  side.stage = stage.data_ptr<T>();
  side.rows = rows.data_ptr<T>();
  side.window = window.data_ptr<T>();
  side.num_blocks = data.size(0);
  side.num_slots = stage.size(0);
  return side;
}

// key, value: the step's [T, H, D] rows; the caches' data/scale/minimum/stage as QuantizedCache
// holds them, the format as BlockCodec.code; the rest QuantStep's fields.
std::tuple<at::Tensor, at::Tensor> quant_write(const at::Tensor& key, const at::Tensor& value, at::Tensor k_data,
                                               const OptTensor& k_scale, const OptTensor& k_min, at::Tensor k_stage,
                                               int64_t k_kind, at::Tensor v_data, const OptTensor& v_scale,
                                               const OptTensor& v_min, at::Tensor v_stage, int64_t v_kind,
                                               int64_t num_window_blocks, const at::Tensor& load_window,
                                               const at::Tensor& load_slots, const at::Tensor& row_slots,
                                               const at::Tensor& seal_window, const at::Tensor& seal_blocks,
                                               const at::Tensor& keep_window, const at::Tensor& keep_slots) {
  TORCH_CHECK(k_stage.dim() == 4, "quant_write: stages must be [slots, B, H, D]");
  const auto dtype = k_stage.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "quant_write: float32 or bfloat16 stages only");
  TORCH_CHECK(v_stage.scalar_type() == dtype, "quant_write: K and V stages must share a dtype");
  Shape s{k_stage.size(1), k_stage.size(2), k_stage.size(3), 0};
  TORCH_CHECK(s.D % 2 == 0, "quant_write: head_dim must be even");
  s.group = int4_token_group(k_kind, k_scale, v_kind, v_scale, s.D);
  check_side(k_data, k_scale, k_min, k_stage, k_kind, s);
  check_side(v_data, v_scale, v_min, v_stage, v_kind, s);
  TORCH_CHECK(k_data.size(0) == v_data.size(0) && k_stage.size(0) == v_stage.size(0),
              "quant_write: K and V must have as many blocks and slots");
  // The step's rows in the stages' dtype, rows contiguous (rows.to(cache.dtype)).
  const at::Tensor k_rows = key.to(dtype).contiguous(), v_rows = value.to(dtype).contiguous();
  const int64_t tokens = row_slots.numel();
  for (const at::Tensor* t : {&k_rows, &v_rows})
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == s.H && t->size(2) == s.D,
                "quant_write: key and value must be [tokens, kv_heads, head_dim], one row a row slot");
  TORCH_CHECK(num_window_blocks >= 0, "quant_write: negative window");
  TORCH_CHECK(load_window.numel() == load_slots.numel() && seal_window.numel() == seal_blocks.numel() &&
                  keep_window.numel() == keep_slots.numel(),
              "quant_write: window and slot lists must pair up");
  // Every index checked before anything is written.
  check_range(load_window, "load_window", num_window_blocks);
  check_range(load_slots, "load_slots", k_stage.size(0));
  check_range(row_slots, "row_slots", num_window_blocks * s.B);
  check_range(seal_window, "seal_window", num_window_blocks);
  check_range(seal_blocks, "seal_blocks", k_data.size(0));
  check_range(keep_window, "keep_window", num_window_blocks);
  check_range(keep_slots, "keep_slots", k_stage.size(0));
  Plan p{};
  p.num_window = num_window_blocks;
  p.load_slot.assign(num_window_blocks, -1);
  const int64_t* lw = load_window.data_ptr<int64_t>();
  const int64_t* ls = load_slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < load_window.numel(); ++i) p.load_slot[lw[i]] = ls[i];
  p.row_slots = row_slots.data_ptr<int64_t>();
  p.row_begin.assign(num_window_blocks, s.B);
  p.row_end.assign(num_window_blocks, 0);
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t w = p.row_slots[t] / s.B, r = p.row_slots[t] % s.B;
    p.row_begin[w] = std::min(p.row_begin[w], r);
    p.row_end[w] = std::max(p.row_end[w], r + 1);
  }
  p.num_rows = tokens;
  p.seal_window = seal_window.data_ptr<int64_t>();
  p.seal_blocks = seal_blocks.data_ptr<int64_t>();
  p.keep_window = keep_window.data_ptr<int64_t>();
  p.keep_slots = keep_slots.data_ptr<int64_t>();
  p.num_seal = seal_window.numel();
  p.num_keep = keep_window.numel();
  at::Tensor k_window = at::empty({num_window_blocks, s.B, s.H, s.D}, k_stage.options());
  at::Tensor v_window = at::empty({num_window_blocks, s.B, s.H, s.D}, v_stage.options());
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const std::array<Side<T>, 2> sides{make_side<T>(k_kind, k_data, k_scale, k_min, k_stage, k_rows, k_window),
                                       make_side<T>(v_kind, v_data, v_scale, v_min, v_stage, v_rows, v_window)};
    write_sides(sides, s, p);
  };
  if (dtype == at::kFloat)
    run(float{});
  else
    run(c10::BFloat16{});
  return {k_window, v_window};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "quant_write(Tensor key, Tensor value, Tensor(a!) k_data, Tensor(b!)? k_scale, Tensor(c!)? k_min, "
      "Tensor(d!) k_stage, int k_kind, Tensor(e!) v_data, Tensor(f!)? v_scale, Tensor(g!)? v_min, "
      "Tensor(h!) v_stage, int v_kind, int num_window_blocks, Tensor load_window, Tensor load_slots, "
      "Tensor row_slots, Tensor seal_window, Tensor seal_blocks, Tensor keep_window, Tensor keep_slots) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("quant_write", &quant_write); }
