// The paged-attention kernel's step arguments and tasks, for every translation unit that
// runs its tasks. A named namespace: all of them must see the same types.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec.h"

namespace pagedllm_attn {

struct Task {
  int64_t seq;
  int64_t kv_head;
  int64_t row_begin;
  int64_t row_end;
  int64_t cost;
};

template <typename T>
struct Args {
  const T* query;
  int64_t q_stride_token;
  int64_t q_stride_head;
  const T* k_cache;
  const T* v_cache;
  int64_t cache_stride_block;  // elements between blocks
  int64_t cache_stride_token;  // elements between tokens of a block
  int64_t block_size;
  const int32_t* block_tables;
  int64_t bt_stride;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  T* out;
  int64_t out_stride_token;
  int64_t num_heads;
  int64_t group;  // query heads per kv head
  int64_t head_dim;
  float scale;
  int64_t window;  // sliding window in keys; 0: none
  float softcap;   // 0: none
  bool use_bf16_dot;  // query rows contiguous in head_dim, so pairs can be read in place
  bool use_amx;       // scores on the tile unit (bf16, head_dim 64)
};

// The first key position that query position `pos` sees: 0 without a window.
inline int64_t first_key(int64_t window, int64_t pos) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// The keys query row `row` of a task sees, as [lo, hi) relative to the task's first key
// `kmin` (the first key its first row sees).
struct Visible {
  int64_t lo;
  int64_t hi;
};
template <typename T>
inline Visible visible(const Args<T>& a, int64_t first_pos, int64_t row, int64_t kmin) {
  return {first_key(a.window, first_pos + row) - kmin, first_pos + row + 1 - kmin};
}

// ---- AVX2 + FMA path (paged_attention_avx2.cpp).

// A thread's scratch for the AVX2 prompt path (prefill_attention_avx2.cpp), reused across
// its tasks. Lanes are the task's query vectors, padded to a multiple of 8.
struct FlashScratch {
  pagedllm_vec::LineVector<float> query;    // [head_dim][lanes]: the queries, scaled, fp32
  pagedllm_vec::LineVector<float> acc;      // [head_dim][lanes]: unnormalised outputs
  pagedllm_vec::LineVector<float> probs;    // [key][a tile's lanes]: scores, then exp(score - max)
  pagedllm_vec::LineVector<float> row_max;  // [lanes]: running max of the scores
  pagedllm_vec::LineVector<float> row_sum;  // [lanes]: running sum of the exps
  pagedllm_vec::LineVector<float> rows;     // a block of bf16 K and V rows widened to fp32
  std::vector<int32_t> lo, hi;              // [lanes]: the keys each lane sees, [lo, hi)
  std::vector<int64_t> offsets;             // element offset of each context row of the kv head
  std::vector<const float*> key_rows;       // fp32 K, then V, rows of a block
};

// A thread's scratch for the AVX2 path, reused across its tasks.
struct Avx2Scratch {
  pagedllm_vec::LineVector<float> query;   // the task's query vectors, scaled, fp32
  pagedllm_vec::LineVector<float> scores;  // [query vector][key], rows padded to 8 keys
  pagedllm_vec::LineVector<float> acc;     // [query vector][head_dim]: sums over V
  pagedllm_vec::LineVector<float> rows;    // bf16 K/V rows converted to fp32
  pagedllm_vec::LineVector<float> inv_sum;  // 1 / softmax denominator per query vector
  std::vector<int64_t> offsets;            // element offset of each context row (token)
  std::vector<int64_t> head_offsets;       // element offset of each kv head within a row
  std::vector<const float*> row_ptrs;      // fp32 rows of a chunk of V
  FlashScratch flash;                      // for prompt tasks
};

// Element offset of context rows kmin..kmax-1 of one kv head (same for K and V), at
// [0, kmax - kmin): the table entries before kmin's block are never read.
template <typename T>
const int64_t* row_offsets(const Args<T>& a, const int32_t* table, int64_t kv_off, int64_t kmin, int64_t kmax,
                           std::vector<int64_t>& offsets) {
  offsets.resize(kmax - kmin);
  const int64_t bfirst = kmin / a.block_size;
  for (int64_t bi = bfirst, b0 = bfirst * a.block_size; b0 < kmax; b0 += a.block_size, ++bi) {
    const int64_t base = table[bi] * a.cache_stride_block + kv_off;
    const int64_t n = std::min(a.block_size, kmax - b0);
    for (int64_t o = std::max<int64_t>(0, kmin - b0); o < n; ++o) offsets[b0 + o - kmin] = base + o * a.cache_stride_token;
  }
  return offsets.data();
}

// Whether this build has the AVX2 path (compiled with AVX2 and FMA).
bool avx2_built();

// tasks[0, n) on the AVX2 path: tasks of one sequence and range of query rows, in increasing
// kv head order (a run of task_groups). False (nothing written) where the path does not
// apply: a build without AVX2/FMA, or a head_dim other than 32, 64, 128, 256.
template <typename T>
bool attend_avx2(const Args<T>& a, const Task* tasks, int64_t n, Avx2Scratch& scratch);

// One task on the AVX2 prompt path (an online softmax over blocks of keys); false (nothing
// written) where it does not apply: a build without AVX2/FMA, or a head_dim other than 32,
// 64, 128, 256. attend_avx2 sends it the tasks of prompt rows.
template <typename T>
bool attend_flash_avx2(const Args<T>& a, const Task& task, FlashScratch& scratch);

}  // namespace pagedllm_attn
