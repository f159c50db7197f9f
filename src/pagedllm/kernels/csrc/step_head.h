// The end of a decode step inside the one-call layer loops (decoder_layers.cpp,
// gemma_layers.cpp): after the final norm, the LM head and, for greedy batches, each row's
// argmax, in the same step team as the layers (parallel.h). Run from Python, the head of a
// small model is a quarter of its step (SmolLM2's tied 49152 x 576 Q8_0 table) and Gemma 3's
// 262k-row table most of it; there it costs a fork and join of its own, its logits go back to
// Python and come in again for the argmax. Here its rows are handed out in chunks as every
// product of the layers is, and a greedy step returns only its tokens.
//
// The head is quant_gemm on a block-quantized weight, the ops the Python path calls, so the
// logits are those of compute_logits(hidden, float32=False) bit for bit; a greedy step's
// tokens come from quant_gemm_argmax, the argmax of those logits without writing them.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "parallel.h"
#include "small_gemm.h"

namespace pagedllm_step {

using OptTensor = std::optional<at::Tensor>;

// What a layer loop returns: the final-normed hidden states, the head's logits (in the
// hidden states' dtype; empty when not asked for or when the argmax was) and each row's
// argmax (int64; empty unless asked for).
using Step = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// Up to this many tokens a step whose linears are all block-quantized runs in one step team:
// its products are matrix-vector sized, a fork and join each cost a real share of one, and a
// busy neighbour's core stalls every join. 16 where the integer kernel takes 16 rows (no tile
// unit): the loops' elementwise ops hand their rows to the team too (parallel_rows;
// Qwen2.5-Coder's 16-sequence steps 1.07-1.09x in a team on Zen 4, Gemma-3-270M's 1.06x on
// its AVX2 kernels once its norms and GELU took part, 0.91-0.96x while they were ATen's,
// which inside a team run on one thread); else 8.
inline int64_t team_max_tokens() {
  return pagedllm_gemm::bf16_route() != pagedllm_gemm::Isa::amx ? 16 : 8;
}

// The LM head to run after the final norm (weight absent: none): its block-quantized weight
// and GGML type (quant_gemm's arguments), optional bias; argmax: return each row's argmax
// instead of the logits.
struct Head {
  const OptTensor& weight;
  int64_t format;
  const OptTensor& bias;
  bool argmax;
};

inline void check_head(const Head& head, const char* op) {
  TORCH_CHECK(!head.weight.has_value() || head.format != 0, op,
              ": head must be block-quantized (head_format is its GGML type)");
  TORCH_CHECK(head.weight.has_value() || !head.argmax, op, ": head_argmax needs a head");
}

// An op's typed handle (through the dispatcher: the layer loops need nothing from the files
// that define the ops they call).
template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using QuantGemm = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, const OptTensor&);

inline Step apply_head(const at::Tensor& hidden, const Head& head) {
  const at::Tensor none = at::empty({0}, hidden.options());
  if (!head.weight.has_value()) return {hidden, none, none};
  // Looked up on the first call (after every file of the library has registered).
  static const auto quant_gemm = op<QuantGemm>("pagedllm::quant_gemm");
  static const auto quant_gemm_argmax = op<QuantGemm>("pagedllm::quant_gemm_argmax");
  if (head.argmax) return {hidden, none, quant_gemm_argmax.call(hidden, *head.weight, head.format, head.bias)};
  return {hidden, quant_gemm.call(hidden, *head.weight, head.format, head.bias), none};
}

// body() (the layers, returning the final-normed hidden states) and the head, in a step team
// where every linear and the head are block-quantized and the step is small (formats: per
// layer the four linears' GGML types, 0 for small_gemm, empty for all small_gemm; small_gemm
// parallelises with at::parallel_for, which inside a team would run on one thread).
template <typename Body>
Step run_step(at::IntArrayRef formats, const Head& head, int64_t tokens, const Body& body) {
  auto step = [&] { return apply_head(body(), head); };
  const bool all_quantized =
      !formats.empty() && std::all_of(formats.begin(), formats.end(), [](int64_t f) { return f != 0; });
  if (all_quantized && tokens <= team_max_tokens()) return pagedllm_parallel::with_team(step);
  return step();
}

}  // namespace pagedllm_step
