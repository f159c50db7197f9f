// Gemma 2 / Gemma 3 decoder layers of one step in one call: the module loop of
// model/decoder.py (GeneralDecoderLayer with Gemma's norms) with the same roundings, for the
// steps the per-layer path would give entirely to pagedllm's kernels (every linear on
// small_gemm or, kept quantized, quant_gemm; every sequence on paged_attention). What differs from decoder_layers.cpp
// (the Llama family's loop) is Gemma's layer: norms scaled by (1 + weight) in float32, q/k
// norms (Gemma 3), "sandwich" norms after attention and around the MLP, GELU (tanh) gating,
// a local rope table for the sliding layers, per-layer windows and soft-capping.
//
// offset_rms_norm is the norm as an op: out = to_T(float(x) * rsqrt(mean(float(x)^2) + eps)
// * weight), weight being the float32 (1 + w), one rounding at the end as the torch module.
// The other ops are called through the dispatcher: pagedllm's (gelu_tanh_mul: the module
// loop's gelu(gate, "tanh") * up, tanh by exp, within ~2e-7 of ATen's) and ATen's add. The
// norms and the GELU hand their rows to a step team (parallel_rows), so a small step runs in
// one (step_head.h).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "dispatch.h"
#include "layer_groups.h"
#include "parallel.h"
#include "step_head.h"
#include "vec.h"
#include "vec_avx2.h"

namespace {

using OptTensor = std::optional<at::Tensor>;
using OptTensors = c10::List<OptTensor>;
using pagedllm_vec::to_float;

// One row of offset_rms_norm: dst[0:n] = to_T(x * inv * w), inv from the fp32 sum of squares.
template <typename T>
void offset_norm_row(const T* x, const float* w, T* dst, int64_t n, float eps) {
  float ss = 0.0f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = pagedllm_vec::tail_mask(n - i);
    __m512 v;
    if constexpr (std::is_same_v<T, float>) {
      v = _mm512_maskz_loadu_ps(m, x + i);
    } else {
      v = pagedllm_vec::from_bf16(_mm256_maskz_loadu_epi16(m, x + i));
    }
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  int64_t i = 0;
  if constexpr (std::is_same_v<T, float>) {
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), acc);
    ss = pagedllm_vec::hsum(acc);
  }
  for (; i < n; ++i) ss += to_float(x[i]) * to_float(x[i]);
#else
  for (int64_t i = 0; i < n; ++i) ss += to_float(x[i]) * to_float(x[i]);
#endif
  const float inv = 1.0f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>((to_float(x[i]) * inv) * w[i]);
}

// x: [rows, n] or [tokens, heads, n], last stride 1 (other strides free: q and k are views
// of the qkv product); weight: float32 [n]. Returns a contiguous tensor shaped like x.
at::Tensor offset_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, "offset_rms_norm: x must be 2-D or 3-D, unit last stride");
  const int64_t n = x.size(-1);
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous() && weight.numel() == n,
              "offset_rms_norm: weight must be float32 [", n, "] (1 + the model's weight)");
  const int64_t inner = x.dim() == 3 ? x.size(1) : 1;
  const int64_t rows = x.size(0) * inner;
  const int64_t outer_stride = x.stride(0), inner_stride = x.dim() == 3 ? x.stride(1) : 0;
  at::Tensor out = at::empty(x.sizes(), x.options());
  auto run = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    const T* src = reinterpret_cast<const T*>(x.data_ptr());
    T* dst = reinterpret_cast<T*>(out.data_ptr());
    const float* w = weight.data_ptr<float>();
    pagedllm_parallel::parallel_rows(rows, n, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        offset_norm_row<T>(src + (r / inner) * outer_stride + (r % inner) * inner_stride, w, dst + r * n, n,
                           static_cast<float>(eps));
    });
  };
  pagedllm_dispatch::dispatch_float_types(x, "offset_rms_norm", run);
  return out;
}

using pagedllm_step::op;  // an op's typed handle, looked up by name

using SmallGemm = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&);
using QuantGemm = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&);
using Rope = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&);
using WriteKv = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using GeluTanhMul = at::Tensor(const at::Tensor&);
using PagedAttention = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, bool, bool,
                            int64_t, double);

struct Ops {
  c10::TypedOperatorHandle<SmallGemm> small_gemm = op<SmallGemm>("pagedllm::small_gemm");
  c10::TypedOperatorHandle<QuantGemm> quant_gemm = op<QuantGemm>("pagedllm::quant_gemm");
  c10::TypedOperatorHandle<Rope> rope = op<Rope>("pagedllm::rope_");
  c10::TypedOperatorHandle<WriteKv> write_kv = op<WriteKv>("pagedllm::write_kv_");
  c10::TypedOperatorHandle<GeluTanhMul> gelu_tanh_mul = op<GeluTanhMul>("pagedllm::gelu_tanh_mul");
  c10::TypedOperatorHandle<PagedAttention> attention = op<PagedAttention>("pagedllm::paged_attention");
};

const Ops& ops() {
  static const Ops handles;
  return handles;
}

// x @ w.T (+ bias) on the weight's kernel: quant_gemm for a block-quantized weight (format:
// its GGML type, kernels/quant.py's layout), small_gemm for format 0.
at::Tensor linear(const Ops& f, const at::Tensor& x, const at::Tensor& w, int64_t format, const OptTensor& bias) {
  return format != 0 ? f.quant_gemm.call(x, w, format, bias) : f.small_gemm.call(x, w, bias);
}

// Per layer i: norms (float32, 1 + weight): in_norm, q_norm / k_norm (absent: none),
// post_attn_norm, pre_ff_norm, post_ff_norm; linears qkv, o, gate_up, down (small_gemm-packed,
// or block-quantized for quant_gemm: weight_formats, a layer's q/k/v weights' then o's,
// gate_up's and down's, their GGML types, 0 small_gemm, empty all small_gemm) with optional
// biases, qkv (and qkv_bias) one fused weight a layer or, where some layer keeps them apart
// (stored in different formats: fast_path.qkv_arguments), three: q, k and v; K/V caches; sliding_windows[i] (0: full attention; the sliding layers
// take the local cos/sin) and softcaps[i] (0: none). hidden: the scaled embeddings [T, hidden];
// cos/sin: [T, head_dim] of the full and of the sliding layers. The attention arguments are
// paged_attention's; with several KV cache groups, each layer's block table and slots are its
// group's (layer_groups.h). output_rows: only these rows go on after the last layer's
// attention. head, head_format, head_bias, head_argmax: the LM head to run after the final
// norm (step_head.h; absent: none; the caller soft-caps no logits here). Returns the
// final-normed hidden states of the rows that go on, the head's logits and each row's argmax
// (step_head.h's Step). A small step whose linears and head are all block-quantized runs in
// one step team, as decoder_layers does.
pagedllm_step::Step gemma_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& local_cos, const at::Tensor& local_sin, at::TensorList in_norm,
                        const OptTensors& q_norm, const OptTensors& k_norm, at::TensorList qkv,
                        const OptTensors& qkv_bias, at::TensorList o, const OptTensors& o_bias,
                        at::TensorList post_attn_norm, at::TensorList pre_ff_norm, at::TensorList gate_up,
                        const OptTensors& gate_up_bias, at::TensorList down, const OptTensors& down_bias,
                        at::TensorList post_ff_norm, const at::Tensor& final_norm, double eps,
                        at::TensorList k_caches, at::TensorList v_caches, const at::Tensor& slot_mapping,
                        const at::Tensor& block_tables, const at::Tensor& seq_lens,
                        const at::Tensor& query_start_loc, const at::Tensor& handled, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, double scale, int64_t rows_per_task,
                        bool fast_bf16, bool use_amx, const OptTensor& output_rows, at::IntArrayRef sliding_windows,
                        at::ArrayRef<double> softcaps, at::TensorList group_block_tables,
                        at::TensorList group_slot_mappings, at::IntArrayRef layer_groups,
                        at::IntArrayRef weight_formats, const OptTensor& head, int64_t head_format,
                        const OptTensor& head_bias, bool head_argmax) {
  const size_t n = in_norm.size();
  TORCH_CHECK(n > 0, "gemma_layers: no layers");
  TORCH_CHECK(qkv.size() == n || qkv.size() == 3 * n, "gemma_layers: qkv needs 1 or 3 weights a layer");
  TORCH_CHECK(qkv_bias.size() == qkv.size(), "gemma_layers: qkv_bias needs one entry a qkv weight");
  const size_t parts = qkv.size() / n;  // q/k/v weights a layer
  for (size_t size : {q_norm.size(), k_norm.size(), o.size(), o_bias.size(),
                      post_attn_norm.size(), pre_ff_norm.size(), gate_up.size(), gate_up_bias.size(), down.size(),
                      down_bias.size(), post_ff_norm.size(), k_caches.size(), v_caches.size(),
                      sliding_windows.size(), softcaps.size()})
    TORCH_CHECK(size == n, "gemma_layers: every per-layer list needs ", n, " entries");
  TORCH_CHECK(hidden.dim() == 2, "gemma_layers: hidden must be [T, hidden]");
  TORCH_CHECK(weight_formats.empty() || weight_formats.size() == (parts + 3) * n,
              "gemma_layers: weight_formats needs one entry a weight (q/k/v, o, gate_up, down)");
  TORCH_CHECK(parts == 1 || !weight_formats.empty(), "gemma_layers: q/k/v apart are quantized weights");
  // which: the layer's q/k/v weights from 0, then o, gate_up, down.
  auto format = [&](size_t layer, size_t which) -> int64_t {
    return weight_formats.empty() ? 0 : weight_formats[(parts + 3) * layer + which];
  };
  const pagedllm_groups::Groups groups(block_tables, slot_mapping, group_block_tables, group_slot_mappings,
                                       layer_groups, n);
  const pagedllm_step::Head step_head{head, head_format, head_bias, head_argmax};
  pagedllm_step::check_head(step_head, "gemma_layers");
  const Ops& f = ops();
  const int64_t tokens = hidden.size(0);
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  const int64_t counts[3] = {num_heads, num_kv_heads, num_kv_heads};
  auto loop = [&] {
    at::Tensor h = hidden;
    for (size_t i = 0; i < n; ++i) {
      const at::Tensor x = offset_rms_norm(h, in_norm[i], eps);
      std::vector<at::Tensor> heads;
      if (parts == 1) {
        const at::Tensor qkv_out = linear(f, x, qkv[i], format(i, 0), qkv_bias.get(i));
        TORCH_CHECK(qkv_out.size(1) == q_width + 2 * kv_width, "gemma_layers: qkv width disagrees with the heads");
        heads = qkv_out.view({tokens, num_heads + 2 * num_kv_heads, head_dim})
                    .split_with_sizes({num_heads, num_kv_heads, num_kv_heads}, 1);
      } else {  // q, k and v kept apart: three products
        for (size_t p = 0; p < 3; ++p)
          heads.push_back(linear(f, x, qkv[3 * i + p], format(i, p), qkv_bias.get(3 * i + p))
                              .view({tokens, counts[p], head_dim}));
      }
      at::Tensor q = heads[0], k = heads[1];
      const OptTensor qn = q_norm.get(i), kn = k_norm.get(i);
      if (qn.has_value()) q = offset_rms_norm(q, *qn, eps);
      if (kn.has_value()) k = offset_rms_norm(k, *kn, eps);
      const bool local = sliding_windows[i] > 0;
      f.rope.call(q, k, local ? local_cos : cos, local ? local_sin : sin);
      f.write_kv.call(k_caches[i], v_caches[i], k, heads[2], groups.slots(i));
      at::Tensor attn = at::empty(q.sizes(), q.options());
      f.attention.call(attn, q, k_caches[i], v_caches[i], groups.tables(i), seq_lens, query_start_loc, handled, scale,
                       rows_per_task, fast_bf16, use_amx, sliding_windows[i], softcaps[i]);
      if (i + 1 == n && output_rows.has_value()) {
        attn = attn.index_select(0, *output_rows);
        h = h.index_select(0, *output_rows);
      }
      const at::Tensor projected =
          linear(f, attn.view({attn.size(0), q_width}), o[i], format(i, parts), o_bias.get(i));
      h = at::add(h, offset_rms_norm(projected, post_attn_norm[i], eps));
      const at::Tensor gu =
          linear(f, offset_rms_norm(h, pre_ff_norm[i], eps), gate_up[i], format(i, parts + 1), gate_up_bias.get(i));
      const at::Tensor mlp = linear(f, f.gelu_tanh_mul.call(gu), down[i], format(i, parts + 2), down_bias.get(i));
      h = at::add(h, offset_rms_norm(mlp, post_ff_norm[i], eps));
    }
    return offset_rms_norm(h, final_norm, eps);
  };
  return pagedllm_step::run_step(weight_formats, step_head, tokens, loop);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def("offset_rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "gemma_layers(Tensor hidden, Tensor cos, Tensor sin, Tensor local_cos, Tensor local_sin, Tensor[] in_norm, "
      "Tensor?[] q_norm, Tensor?[] k_norm, Tensor[] qkv, Tensor?[] qkv_bias, Tensor[] o, Tensor?[] o_bias, "
      "Tensor[] post_attn_norm, Tensor[] pre_ff_norm, Tensor[] gate_up, Tensor?[] gate_up_bias, Tensor[] down, "
      "Tensor?[] down_bias, Tensor[] post_ff_norm, Tensor final_norm, float eps, Tensor(a!)[] k_caches, "
      "Tensor(b!)[] v_caches, Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "Tensor handled, int num_heads, int num_kv_heads, int head_dim, float scale, int rows_per_task, "
      "bool fast_bf16, bool use_amx, Tensor? output_rows, int[] sliding_windows, float[] softcaps, "
      "Tensor[] group_block_tables, Tensor[] group_slot_mappings, int[] layer_groups, int[] weight_formats, "
      "Tensor? head=None, int head_format=0, Tensor? head_bias=None, bool head_argmax=False) "
      "-> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("offset_rms_norm", &offset_rms_norm);
  m.impl("gemma_layers", &gemma_layers);
}
