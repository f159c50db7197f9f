// The paged-attention kernel's step arguments and tasks, for every translation unit that
// runs its tasks. A named namespace: all of them must see the same types.
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

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

}  // namespace pagedllm_attn
