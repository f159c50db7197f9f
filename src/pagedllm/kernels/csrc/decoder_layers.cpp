// Every decoder layer of one step in one call: the Python loop of llama.fused_layer, with the
// same ops in the same order, so the results are the same bit for bit. What it removes is
// Python: about a dozen op calls a layer, each 3-6 us through torch.ops, which cost 1-2 ms of
// a decode step (of 5-20 ms). It takes only steps the per-layer path would give entirely to
// pagedllm's kernels (every linear on small_gemm, every sequence on paged_attention, the C++
// K/V write); the caller checks that and keeps the Python loop for the rest.
//
// The ops are called through the dispatcher (unboxed, ~0.1 us), so this file needs nothing
// from the files that define them.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <optional>

#include "layer_groups.h"

namespace {

using OptTensor = std::optional<at::Tensor>;
using OptTensors = c10::List<OptTensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// The ops' C++ signatures (as registered by the files that define them).
using RmsNorm = at::Tensor(const at::Tensor&, const at::Tensor&, double);
using AddRmsNorm = at::Tensor(const at::Tensor&, at::Tensor, const at::Tensor&, double);
using SmallGemm = at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&);
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

template <typename List>
void check_layers(size_t n, const List& list, const char* name) {
  TORCH_CHECK(list.size() == n, "decoder_layers: ", name, " has ", list.size(), " entries for ", n, " layers");
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
// layer's group (empty: one group). Returns the final-normed hidden states of the rows that
// go on.
at::Tensor decoder_layers(const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
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
                          at::IntArrayRef layer_groups) {
  const size_t n = norm1.size();
  TORCH_CHECK(n > 0, "decoder_layers: no layers");
  check_layers(n, qkv, "qkv");
  check_layers(n, qkv_bias, "qkv_bias");
  check_layers(n, o, "o");
  check_layers(n, o_bias, "o_bias");
  check_layers(n, norm2, "norm2");
  check_layers(n, gate_up, "gate_up");
  check_layers(n, gate_up_bias, "gate_up_bias");
  check_layers(n, down, "down");
  check_layers(n, down_bias, "down_bias");
  check_layers(n, k_caches, "k_caches");
  check_layers(n, v_caches, "v_caches");
  if (!sliding_windows.empty()) check_layers(n, sliding_windows, "sliding_windows");
  if (!softcaps.empty()) check_layers(n, softcaps, "softcaps");
  const pagedllm_groups::Groups groups(block_tables, slot_mapping, group_block_tables, group_slot_mappings,
                                       layer_groups, n);
  TORCH_CHECK(hidden.dim() == 2, "decoder_layers: hidden must be [T, hidden]");
  const Ops& f = ops();
  const int64_t tokens = hidden.size(0);
  const int64_t q_width = num_heads * head_dim, kv_width = num_kv_heads * head_dim;
  at::Tensor x = f.rms_norm.call(hidden, norm1[0], eps);
  at::Tensor residual = hidden;
  at::Tensor out_of_layer;
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) x = f.add_rms_norm.call(out_of_layer, residual, norm1[i], eps);
    const at::Tensor qkv_out = f.small_gemm.call(x, qkv[i], qkv_bias.get(i));
    TORCH_CHECK(qkv_out.size(1) == q_width + 2 * kv_width, "decoder_layers: qkv width disagrees with the heads");
    // One view and one split, as llama.split_heads.
    const auto heads =
        qkv_out.view({tokens, num_heads + 2 * num_kv_heads, head_dim}).split_with_sizes({num_heads, num_kv_heads, num_kv_heads}, 1);
    f.rope.call(heads[0], heads[1], cos, sin);
    f.write_kv.call(k_caches[i], v_caches[i], heads[1], heads[2], groups.slots(i));
    at::Tensor attn = at::empty(heads[0].sizes(), heads[0].options());
    f.attention.call(attn, heads[0], k_caches[i], v_caches[i], groups.tables(i), seq_lens, query_start_loc, handled,
                     scale, rows_per_task, fast_bf16, use_amx, sliding_windows.empty() ? 0 : sliding_windows[i],
                     softcaps.empty() ? 0.0 : softcaps[i]);
    if (i + 1 == n && output_rows.has_value()) {
      attn = attn.index_select(0, *output_rows);
      residual = residual.index_select(0, *output_rows);
    }
    const at::Tensor projected = f.small_gemm.call(attn.view({attn.size(0), q_width}), o[i], o_bias.get(i));
    x = f.add_rms_norm.call(projected, residual, norm2[i], eps);
    const at::Tensor act = f.silu_mul.call(f.small_gemm.call(x, gate_up[i], gate_up_bias.get(i)));
    out_of_layer = f.small_gemm.call(act, down[i], down_bias.get(i));
  }
  return f.add_rms_norm.call(out_of_layer, residual, final_norm, eps);
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
      "Tensor[] group_block_tables, Tensor[] group_slot_mappings, int[] layer_groups) -> Tensor");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("decoder_layers", &decoder_layers); }
