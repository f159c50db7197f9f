// Prompt attention on AVX-512-bf16 without a tile unit (prefill_attention.cpp): one task is a
// range of query rows of one sequence and every query head of one kv head (GQA), attended to
// the keys each row's position sees (all up to it, or the last `window` of them) through the
// block table, in blocks of keys with an online softmax (flash attention): no score row of
// the whole context is kept.
#pragma once

#include <cstdint>
#include <vector>

#include "vec.h"

namespace pagedllm_prefill {

// The step's tensors, bf16 as raw bits.
struct PrefillArgs {
  const uint16_t* query;  // [T, H, D], D contiguous
  int64_t q_stride_token;
  int64_t q_stride_head;
  const uint16_t* k_cache;  // [blocks, block_size, KV, D], contiguous
  const uint16_t* v_cache;
  int64_t cache_stride_block;
  int64_t cache_stride_token;
  int64_t block_size;
  uint16_t* out;  // [T, H, D]
  int64_t out_stride_token;
  int64_t group;  // query heads per kv head
  int64_t head_dim;
  float scale;
  int64_t window;  // sliding window in keys (p - window < k <= p); 0: none
  float softcap;   // scores become softcap * tanh(score / softcap); 0: none
};

// Query rows [row_begin, row_end) of one sequence: its first query token is row
// `first_token` of the step's batch, and query row r sits at position first_pos + r.
struct PrefillTask {
  const int32_t* block_table;
  int64_t first_token;
  int64_t first_pos;
  int64_t kv_head;
  int64_t row_begin;
  int64_t row_end;
};

// Per-thread scratch, reused across tasks.
struct PrefillScratch {
  std::vector<int64_t> offsets;            // element offset of each context row of the kv head
  std::vector<const uint16_t*> queries;    // each query vector of the task
  pagedllm_vec::LineVector<uint32_t> keys;    // a block of K, pair-transposed
  pagedllm_vec::LineVector<uint32_t> values;  // a block of V, key pairs interleaved
  pagedllm_vec::LineVector<uint16_t> probs;   // exp(score - running max) as bf16
  pagedllm_vec::LineVector<float> acc;        // unnormalised outputs, fp32
  std::vector<float> row_max;                   // running max of each query vector's scores (log2)
  pagedllm_vec::LineVector<float> row_sum;      // running sums, 16 lanes per query vector
};

// Whether this build has the kernel for this head size (AVX-512-bf16; head_dim 64 or 128).
bool prefill_applies(int64_t head_dim);

// Writes the task's output rows (every query head of its kv head).
void attend_prefill(const PrefillArgs& a, const PrefillTask& task, PrefillScratch& scratch);

}  // namespace pagedllm_prefill
