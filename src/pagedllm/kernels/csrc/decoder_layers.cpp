// Every decoder layer of one step in one call: the Python loop of llama.fused_layer, with the
// same ops in the same order, so the results are the same bit for bit. What it removes is
// Python: about a dozen torch.ops calls a layer, a real share of a small decode step. It
// takes only steps the per-layer path would give entirely to pagedllm's kernels (every linear
// on small_gemm, or on quant_gemm where its weight is kept quantized, every sequence on
// paged_attention, the C++ K/V write); the caller checks that
// and keeps the Python loop for the rest.
//
// quant_decoder_layers is the same loop over a quantized cache: each layer's K/V go through
// quant_write (windows, seals, staging) and its attention through quant_attention, as
// CpuAttention.forward runs them layer by layer.
//
// The ops are called through the dispatcher (unboxed, cheap), so this file needs nothing
// from the files that define them.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <tuple>
#include <vector>

#include "layer_groups.h"
#include "step_head.h"

namespace {

using OptTensor = std::optional<at::Tensor>;
using OptTensors = c10::List<OptTensor>;

using pagedllm_step::op;  // an op's typed handle, looked up by name

// The ops' C++ signatures (as registered by the files that define them).
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNorm = at::Tensor(const at::Tensor&, at::Tensor, const at::Tensor&, double);
using SmallGemm = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&);
using QuantGemm = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&);
using Rope = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&);
using WriteKv = void(at::Tensor, at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using SiluMul = at::Tensor(const at::Tensor&);
using PagedAttention = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, double, int64_t, bool, bool,
                            int64_t, double);

struct Ops {
  c10::TypedOperatorHandle<RmsNorm> rms_norm = op<RmsNorm>("pagedllm::rms_norm");
  c10::TypedOperatorHandle<AddRmsNorm> add_rms_norm = op<AddRmsNorm>("pagedllm::add_rms_norm");
  c10::TypedOperatorHandle<SmallGemm> small_gemm = op<SmallGemm>("pagedllm::small_gemm");
  c10::TypedOperatorHandle<QuantGemm> quant_gemm = op<QuantGemm>("pagedllm::quant_gemm");
  c10::TypedOperatorHandle<Rope> rope = op<Rope>("pagedllm::rope_");
  c10::TypedOperatorHandle<WriteKv> write_kv = op<WriteKv>("pagedllm::write_kv_");
  c10::TypedOperatorHandle<SiluMul> silu_mul = op<SiluMul>("pagedllm::silu_mul");
  c10::TypedOperatorHandle<PagedAttention> attention = op<PagedAttention>("pagedllm::paged_attention");
};

// Looked up once, on the first call (after every file of the library has registered).
const Ops& ops() {
  static const Ops handles;
  return handles;
}

using QuantWrite = std::tuple<at::Tensor, at::Tensor>(
    const at::Tensor&, const at::Tensor&, at::Tensor, const OptTensor&, const OptTensor&, at::Tensor, int64_t,
    at::Tensor, const OptTensor&, const OptTensor&, at::Tensor, int64_t, int64_t, const at::Tensor&, const at::Tensor&,
    const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&);
using QuantAttention = void(at::Tensor&, const at::Tensor&, const at::Tensor&, const OptTensor&, const OptTensor&,
                            int64_t, const at::Tensor&, const OptTensor&, const OptTensor&, int64_t, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool);

struct QuantOps {
  c10::TypedOperatorHandle<QuantWrite> write = op<QuantWrite>("pagedllm::quant_write");
  c10::TypedOperatorHandle<QuantAttention> attention = op<QuantAttention>("pagedllm::quant_attention");
};

const QuantOps& quant_ops() {
  static const QuantOps handles;
  return handles;
}

// x @ w.T (+ bias) on the weight's kernel: quant_gemm for a block-quantized weight (format:
// its GGML type, kernels/quant.py's layout), small_gemm for format 0.
at::Tensor linear(const Ops& f, const at::Tensor& x, const at::Tensor& w, int64_t format, const OptTensor& bias) {
  return format != 0 ? f.quant_gemm.call(x, w, format, bias) : f.small_gemm.call(x, w, bias);
}

template <typename List>
void check_layers(size_t n, const List& list, const char* name) {
  TORCH_CHECK(list.size() == n, "decoder_layers: ", name, " has ", list.size(), " entries for ", n, " layers");
}

// Every layer's weights: the norms', the four linears' weights (small_gemm-packed, or
// block-quantized for quant_gemm) and optional biases, and the final norm. qkv (and
// qkv_bias) hold one fused weight a layer, or three, q, k and v, where some layer keeps them
// apart (stored in different formats: fast_path.qkv_arguments).
struct Weights {
  at::TensorList norm1, qkv;
  const OptTensors& qkv_bias;
  at::TensorList o;
  const OptTensors& o_bias;
  at::TensorList norm2, gate_up;
  const OptTensors& gate_up_bias;
  at::TensorList down;
  const OptTensors& down_bias;
  const at::Tensor& final_norm;
  double eps;
  // Per layer the formats of its q/k/v weights (one or three), o, gate_up and down (0:
  // small_gemm-packed; empty: all).
  at::IntArrayRef formats;

  size_t qkv_parts() const { return qkv.size() / norm1.size(); }

  // which: the layer's q/k/v weights from 0, then o, gate_up, down.
  int64_t format(size_t layer, size_t which) const {
    return formats.empty() ? 0 : formats[(qkv_parts() + 3) * layer + which];
  }

  size_t layers() const {
    const size_t n = norm1.size();
    TORCH_CHECK(n > 0, "decoder_layers: no layers");
    TORCH_CHECK(qkv.size() == n || qkv.size() == 3 * n, "decoder_layers: qkv needs 1 or 3 weights a layer");
    check_layers(qkv.size(), qkv_bias, "qkv_bias");
    check_layers(n, o, "o");
    check_layers(n, o_bias, "o_bias");
    check_layers(n, norm2, "norm2");
    check_layers(n, gate_up, "gate_up");
    check_layers(n, gate_up_bias, "gate_up_bias");
    check_layers(n, down, "down");
    check_layers(n, down_bias, "down_bias");
    TORCH_CHECK(formats.empty() || formats.size() == (qkv_parts() + 3) * n,
                "decoder_layers: weight_formats needs one a weight");
    TORCH_CHECK(qkv_parts() == 1 || !formats.empty(), "decoder_layers: q/k/v apart are quantized weights");
    return n;
  }
};

// Layer i's q, k and v [T, heads, head_dim]: views of its fused product (one view and one
// split, as llama.split_heads), or three products where q/k/v are kept apart.
std::vector<at::Tensor> project_qkv(const Ops& f, const Weights& w, size_t i, const at::Tensor& x, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t head_dim) {
  const int64_t tokens = x.size(0);
  if (w.qkv_parts() == 1) {
    const at::Tensor qkv_out = linear(f, x, w.qkv[i], w.format(i, 0), w.qkv_bias.get(i));
    TORCH_CHECK(qkv_out.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
                "decoder_layers: qkv width disagrees with the heads");
    return qkv_out.view({tokens, num_heads + 2 * num_kv_heads, head_dim})
        .split_with_sizes({num_heads, num_kv_heads, num_kv_heads}, 1);
  }
  std::vector<at::Tensor> heads;
  const int64_t counts[3] = {num_heads, num_kv_heads, num_kv_heads};
  for (size_t p = 0; p < 3; ++p) {
    const at::Tensor out = linear(f, x, w.qkv[3 * i + p], w.format(i, p), w.qkv_bias.get(3 * i + p));
    heads.push_back(out.view({tokens, counts[p], head_dim}));
  }
  return heads;
}

// The loop of fused_layer over n layers plus the final norm; attend(i, q, k, v) writes layer
// i's K/V and returns its attention output [T, num_heads, head_dim] (q and k already rotated).
// hidden becomes the residual stream and is updated in place; output_rows: only these rows go
// on after the last layer's attention.
template <typename Attend>
at::Tensor layer_loop(const Weights& w, size_t n, const at::Tensor& hidden, const at::Tensor& cos,
                      const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      const OptTensor& output_rows, const Attend& attend) {
  const Ops& f = ops();
  const int64_t q_width = num_heads * head_dim;
  const size_t o_at = w.qkv_parts();  // o's, gate_up's and down's formats follow q/k/v's
  at::Tensor x = f.rms_norm.call(hidden, w.norm1[0], w.eps);
  at::Tensor residual = hidden;
  at::Tensor out_of_layer;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) x = f.add_rms_norm.call(out_of_layer, residual, w.norm1[i], w.eps);
    const auto heads = project_qkv(f, w, i, x, num_heads, num_kv_heads, head_dim);
    f.rope.call(heads[0], heads[1], cos, sin);
    at::Tensor attn = attend(i, heads[0], heads[1], heads[2]);
    if (i + 1 == n && output_rows.has_value()) {
      attn = attn.index_select(0, *output_rows);
      residual = residual.index_select(0, *output_rows);
    }
    const at::Tensor projected =
        linear(f, attn.view({attn.size(0), q_width}), w.o[i], w.format(i, o_at), w.o_bias.get(i));
    x = f.add_rms_norm.call(projected, residual, w.norm2[i], w.eps);
    const at::Tensor act = f.silu_mul.call(linear(f, x, w.gate_up[i], w.format(i, o_at + 1), w.gate_up_bias.get(i)));
    out_of_layer = linear(f, act, w.down[i], w.format(i, o_at + 2), w.down_bias.get(i));
  }
  return f.add_rms_norm.call(out_of_layer, residual, w.final_norm, w.eps);
}

// layer_loop, then the head where one is given (step_head.h), in a step team where every
// linear and the head are on quant_gemm (their products and the attention's tasks go to the
// team; the small ops run on one thread).
template <typename Attend>
pagedllm_step::Step run_layers(const Weights& w, size_t n, const at::Tensor& hidden, const at::Tensor& cos,
                               const at::Tensor& sin, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                               const OptTensor& output_rows, const pagedllm_step::Head& head, const Attend& attend) {
  TORCH_CHECK(hidden.dim() == 2, "decoder_layers: hidden must be [T, hidden]");
  pagedllm_step::check_head(head, "decoder_layers");
  auto loop = [&] {
    return layer_loop(w, n, hidden, cos, sin, num_heads, num_kv_heads, head_dim, output_rows, attend);
  };
  return pagedllm_step::run_step(w.formats, head, hidden.size(0), loop);
}

// hidden: the embedded tokens [T, hidden], which become the residual stream and are updated
// in place (as in the loop, where the first add_rms_norm adds into them); cos, sin:
// [T, head_dim]. Per layer: the norms' weights, the four linears' small_gemm-packed weights
// and optional biases, and the layer's K/V caches. The attention arguments are
// paged_attention's. output_rows: only these rows go on after the last layer's attention
// (every row's K/V is still written). sliding_windows, softcaps: each layer's attention kind
// (paged_attention's arguments; empty: none in any layer). A model whose layers are grouped by
// attention kind has one block table and slot mapping per group: block_tables/slot_mapping
// are group 0's, group_block_tables/group_slot_mappings groups 1.., layer_groups each
// layer's group (empty: one group). head, head_format, head_bias, head_argmax: the LM head to
// run after the final norm (step_head.h; absent: none). Returns the final-normed hidden states
// of the rows that go on, the head's logits and each row's argmax (step_head.h's Step).
pagedllm_step::Step decoder_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                          at::TensorList norm1, at::TensorList qkv, const OptTensors& qkv_bias, at::TensorList o,
                          const OptTensors& o_bias, at::TensorList norm2, at::TensorList gate_up,
                          const OptTensors& gate_up_bias, at::TensorList down, const OptTensors& down_bias,
                          const at::Tensor& final_norm, double eps, at::TensorList k_caches, at::TensorList v_caches,
                          const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, const at::Tensor& handled, int64_t num_heads,
                          int64_t num_kv_heads, int64_t head_dim, double scale, int64_t rows_per_task,
                          bool fast_bf16, bool use_amx, const OptTensor& output_rows,
                          at::IntArrayRef sliding_windows, at::ArrayRef<double> softcaps,
                          at::TensorList group_block_tables, at::TensorList group_slot_mappings,
                          at::IntArrayRef layer_groups, at::IntArrayRef weight_formats,
                          const OptTensor& head, int64_t head_format, const OptTensor& head_bias,
                          bool head_argmax) {
  const Weights w{norm1,   qkv,  qkv_bias,     o,    o_bias,    norm2,     gate_up,
                  gate_up_bias, down, down_bias, final_norm, eps, weight_formats};
  const size_t n = w.layers();
  check_layers(n, k_caches, "k_caches");
  check_layers(n, v_caches, "v_caches");
  if (!sliding_windows.empty()) check_layers(n, sliding_windows, "sliding_windows");
  if (!softcaps.empty()) check_layers(n, softcaps, "softcaps");
  const pagedllm_groups::Groups groups(block_tables, slot_mapping, group_block_tables, group_slot_mappings,
                                       layer_groups, n);
  const Ops& f = ops();
  auto attend = [&](size_t i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    f.write_kv.call(k_caches[i], v_caches[i], k, v, groups.slots(i));
    at::Tensor attn = at::empty(q.sizes(), q.options());
    f.attention.call(attn, q, k_caches[i], v_caches[i], groups.tables(i), seq_lens, query_start_loc, handled, scale,
                     rows_per_task, fast_bf16, use_amx, sliding_windows.empty() ? 0 : sliding_windows[i],
                     softcaps.empty() ? 0.0 : softcaps[i]);
    return attn;
  };
  const pagedllm_step::Head step_head{head, head_format, head_bias, head_argmax};
  return run_layers(w, n, hidden, cos, sin, num_heads, num_kv_heads, head_dim, output_rows, step_head, attend);
}

// decoder_layers over a quantized cache (attention/quant.py): each layer writes its K/V with
// quant_write (windows, seals, staging) and attends with quant_attention, as the per-layer
// path's CpuAttention.forward does. Per layer: each side's data, scale, minimum and staging
// (QuantizedCache); k_kind, v_kind: the formats (BlockCodec.code, the same in every layer). The
// write plan is the step's QuantStep (quant_write's arguments), then quant_attention's step;
// the head and the result are decoder_layers'.
pagedllm_step::Step quant_decoder_layers(
    const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin, at::TensorList norm1, at::TensorList qkv,
    const OptTensors& qkv_bias, at::TensorList o, const OptTensors& o_bias, at::TensorList norm2,
    at::TensorList gate_up, const OptTensors& gate_up_bias, at::TensorList down, const OptTensors& down_bias,
    const at::Tensor& final_norm, double eps, at::TensorList k_data, const OptTensors& k_scale,
    const OptTensors& k_min, at::TensorList k_stage, int64_t k_kind, at::TensorList v_data, const OptTensors& v_scale,
    const OptTensors& v_min, at::TensorList v_stage, int64_t v_kind, int64_t num_window_blocks,
    const at::Tensor& load_window, const at::Tensor& load_slots, const at::Tensor& row_slots,
    const at::Tensor& seal_window, const at::Tensor& seal_blocks, const at::Tensor& keep_window,
    const at::Tensor& keep_slots, const at::Tensor& window_start, const at::Tensor& first_slots,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double scale, const OptTensor& output_rows,
    at::IntArrayRef weight_formats, const OptTensor& head, int64_t head_format, const OptTensor& head_bias,
    bool head_argmax) {
  const Weights w{norm1,   qkv,  qkv_bias,     o,    o_bias,    norm2,     gate_up,
                  gate_up_bias, down, down_bias, final_norm, eps, weight_formats};
  const size_t n = w.layers();
  check_layers(n, k_data, "k_data");
  check_layers(n, k_scale, "k_scale");
  check_layers(n, k_min, "k_min");
  check_layers(n, k_stage, "k_stage");
  check_layers(n, v_data, "v_data");
  check_layers(n, v_scale, "v_scale");
  check_layers(n, v_min, "v_min");
  check_layers(n, v_stage, "v_stage");
  const QuantOps& f = quant_ops();
  auto attend = [&](size_t i, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    const auto [k_window, v_window] =
        f.write.call(k, v, k_data[i], k_scale.get(i), k_min.get(i), k_stage[i], k_kind, v_data[i], v_scale.get(i),
                     v_min.get(i), v_stage[i], v_kind, num_window_blocks, load_window, load_slots, row_slots,
                     seal_window, seal_blocks, keep_window, keep_slots);
    at::Tensor attn = at::empty(q.sizes(), q.options());
    f.attention.call(attn, q, k_data[i], k_scale.get(i), k_min.get(i), k_kind, v_data[i], v_scale.get(i),
                     v_min.get(i), v_kind, k_window, v_window, block_tables, seq_lens, query_start_loc, window_start,
                     k_stage[i], v_stage[i], first_slots, scale, false);
    return attn;
  };
  const pagedllm_step::Head step_head{head, head_format, head_bias, head_argmax};
  return run_layers(w, n, hidden, cos, sin, num_heads, num_kv_heads, head_dim, output_rows, step_head, attend);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pagedllm, m) {
  m.def(
      "decoder_layers(Tensor(c!) hidden, Tensor cos, Tensor sin, Tensor[] norm1, Tensor[] qkv, Tensor?[] qkv_bias, "
      "Tensor[] o, Tensor?[] o_bias, Tensor[] norm2, Tensor[] gate_up, Tensor?[] gate_up_bias, Tensor[] down, "
      "Tensor?[] down_bias, Tensor final_norm, float eps, Tensor(a!)[] k_caches, Tensor(b!)[] v_caches, "
      "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor handled, "
      "int num_heads, int num_kv_heads, int head_dim, float scale, int rows_per_task, bool fast_bf16, "
      "bool use_amx, Tensor? output_rows, int[] sliding_windows, float[] softcaps, "
      "Tensor[] group_block_tables, Tensor[] group_slot_mappings, int[] layer_groups, "
      "int[] weight_formats=[], Tensor? head=None, int head_format=0, Tensor? head_bias=None, "
      "bool head_argmax=False) -> (Tensor, Tensor, Tensor)");
  m.def(
      "quant_decoder_layers(Tensor(c!) hidden, Tensor cos, Tensor sin, Tensor[] norm1, Tensor[] qkv, "
      "Tensor?[] qkv_bias, Tensor[] o, Tensor?[] o_bias, Tensor[] norm2, Tensor[] gate_up, Tensor?[] gate_up_bias, "
      "Tensor[] down, Tensor?[] down_bias, Tensor final_norm, float eps, Tensor(a!)[] k_data, Tensor?[] k_scale, "
      "Tensor?[] k_min, Tensor(d!)[] k_stage, int k_kind, Tensor(e!)[] v_data, Tensor?[] v_scale, Tensor?[] v_min, "
      "Tensor(h!)[] v_stage, int v_kind, int num_window_blocks, Tensor load_window, Tensor load_slots, "
      "Tensor row_slots, Tensor seal_window, Tensor seal_blocks, Tensor keep_window, Tensor keep_slots, "
      "Tensor window_start, Tensor first_slots, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "int num_heads, int num_kv_heads, int head_dim, float scale, Tensor? output_rows, "
      "int[] weight_formats=[], Tensor? head=None, int head_format=0, Tensor? head_bias=None, "
      "bool head_argmax=False) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) {
  m.impl("decoder_layers", &decoder_layers);
  m.impl("quant_decoder_layers", &quant_decoder_layers);
}
