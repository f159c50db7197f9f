// Paged attention for CPU: reads K/V straight through the block tables, no contiguous copy.
//
// One task = (sequence, kv head, a tile of query rows). The query vectors of a task are every
// query head of the kv head's group for every row of the tile, so each cached K/V row is read
// from memory once per task and used by all of them (GQA). Two passes over the context:
// scores (Q.K), softmax in fp32, then the weighted sum of V. Tasks are handed out dynamically
// (longest first) to torch's intra-op threads.
//
// The query of sequence i is the last query_len[i] positions of its seq_len[i]-token context;
// query row r sits at position seq_len - query_len + r and sees keys 0 .. that position.
// Sequences whose query_len exceeds `max_query_len` are skipped (left to the caller).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// How many blocks ahead of the one being read to prefetch.
constexpr int64_t PREFETCH_AHEAD = 2;

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
};

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// exp(x) for x <= 0 (softmax after subtracting the max): range reduction to [-ln2/2, ln2/2],
// a degree-6 polynomial (error ~1e-7), and scalef for 2^n (underflows cleanly to 0).
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693359375f);
  const __m512 ln2_lo = _mm512_set1_ps(-2.12194440e-4f);
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// Blocks sit at random addresses, so the hardware prefetcher stops at every block edge:
// ask for the rows of a block ahead of time.
template <typename T, int NC>
inline void prefetch_rows(const T* first_row, int64_t stride, int64_t n) {
  constexpr int64_t lines = (NC * 16 * static_cast<int64_t>(sizeof(T)) + 63) / 64;
  const char* p = reinterpret_cast<const char*>(first_row);
  const int64_t step = stride * static_cast<int64_t>(sizeof(T));
  for (int64_t o = 0; o < n; ++o)
    for (int64_t l = 0; l < lines; ++l) _mm_prefetch(p + o * step + l * 64, _MM_HINT_T0);
}

// softmax over row[0:n] in place, zeros in row[n:width].
inline void softmax_row(float* row, int64_t n, int64_t width) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row + t));
  float mx = _mm512_reduce_max_ps(vmax);
  for (; t < n; ++t) mx = std::max(mx, row[t]);
  const __m512 vmx = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  t = 0;
  for (; t + 16 <= n; t += 16) {
    __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(row + t), vmx));
    _mm512_storeu_ps(row + t, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  if (t < n) {
    __mmask16 m = static_cast<__mmask16>((1u << (n - t)) - 1u);
    __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, row + t), vmx));
    e = _mm512_maskz_mov_ps(m, e);
    _mm512_mask_storeu_ps(row + t, m, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(vsum));
  t = 0;
  for (; t + 16 <= n; t += 16) _mm512_storeu_ps(row + t, _mm512_mul_ps(_mm512_loadu_ps(row + t), inv));
  if (t < n) {
    __mmask16 m = static_cast<__mmask16>((1u << (n - t)) - 1u);
    _mm512_mask_storeu_ps(row + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, row + t), inv));
  }
  for (int64_t z = n; z < width; ++z) row[z] = 0.0f;
}

// NC = head_dim / 16. The context is walked block by block through the block table.
template <typename T, int NC>
void attend_vec(const Args<T>& a, const Task& task, std::vector<float>& scores, std::vector<float>& qbuf,
                std::vector<float>& acc) {
  constexpr int D = NC * 16;
  const int64_t s = task.seq;
  const int64_t q0 = a.query_start_loc[s];
  const int64_t query_len = a.query_start_loc[s + 1] - q0;
  const int64_t seq_len = a.seq_lens[s];
  const int64_t first_pos = seq_len - query_len;
  const int64_t rows = task.row_end - task.row_begin;
  const int64_t M = rows * a.group;
  const int64_t kmax = first_pos + task.row_end;  // keys the last row of the tile sees
  const int32_t* table = a.block_tables + s * a.bt_stride;
  const int64_t head0 = task.kv_head * a.group;

  qbuf.resize(M * D);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t h = 0; h < a.group; ++h) {
      const T* q = a.query + (q0 + task.row_begin + r) * a.q_stride_token + (head0 + h) * a.q_stride_head;
      float* dst = qbuf.data() + (r * a.group + h) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_float(q[d]) * a.scale;
    }
  }
  scores.resize(M * kmax);
  float* sc = scores.data();

  // Pass 1: scores.
  const int64_t kv_off = task.kv_head * D;
  for (int64_t i = 0; i < PREFETCH_AHEAD && i * a.block_size < kmax; ++i)
    prefetch_rows<T, NC>(a.k_cache + table[i] * a.cache_stride_block + kv_off, a.cache_stride_token,
                         std::min(a.block_size, kmax - i * a.block_size));
  for (int64_t b0 = 0, bi = 0; b0 < kmax; b0 += a.block_size, ++bi) {
    const int64_t block = table[bi];
    const int64_t n_in_block = std::min(a.block_size, kmax - b0);
    const T* kblock = a.k_cache + block * a.cache_stride_block + kv_off;
    if (b0 + PREFETCH_AHEAD * a.block_size < kmax) {
      const int64_t ahead = table[bi + PREFETCH_AHEAD];
      prefetch_rows<T, NC>(a.k_cache + ahead * a.cache_stride_block + kv_off, a.cache_stride_token,
                           std::min(a.block_size, kmax - b0 - PREFETCH_AHEAD * a.block_size));
    }
    for (int64_t o = 0; o < n_in_block; ++o) {
      const T* krow = kblock + o * a.cache_stride_token;
      __m512 k[NC];
      for (int c = 0; c < NC; ++c) k[c] = load16(krow + c * 16);
      const int64_t t = b0 + o;
      for (int64_t m = 0; m < M; ++m) {
        const float* q = qbuf.data() + m * D;
        __m512 s0 = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
        for (int c = 1; c < NC; ++c) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(q + c * 16), k[c], s0);
        sc[m * kmax + t] = _mm512_reduce_add_ps(s0);
      }
    }
  }
  for (int64_t i = 0; i < PREFETCH_AHEAD && i * a.block_size < kmax; ++i)
    prefetch_rows<T, NC>(a.v_cache + table[i] * a.cache_stride_block + kv_off, a.cache_stride_token,
                         std::min(a.block_size, kmax - i * a.block_size));
  // Softmax per query vector over the keys its row may see.
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = task.row_begin + m / a.group;
    softmax_row(sc + m * kmax, first_pos + r + 1, kmax);
  }
  // Pass 2: weighted sum of V, MB query vectors at a time held in registers.
  constexpr int MB = NC <= 4 ? 4 : (NC <= 8 ? 2 : 1);
  acc.resize(M * D);
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min<int64_t>(MB, M - m0);
    __m512 o_acc[MB][NC];
    for (int i = 0; i < MB; ++i)
      for (int c = 0; c < NC; ++c) o_acc[i][c] = _mm512_setzero_ps();
    for (int64_t b0 = 0, bi = 0; b0 < kmax; b0 += a.block_size, ++bi) {
      const int64_t block = table[bi];
      const int64_t n_in_block = std::min(a.block_size, kmax - b0);
      const T* vblock = a.v_cache + block * a.cache_stride_block + kv_off;
      if (m0 == 0 && b0 + PREFETCH_AHEAD * a.block_size < kmax) {
        const int64_t ahead = table[bi + PREFETCH_AHEAD];
        prefetch_rows<T, NC>(a.v_cache + ahead * a.cache_stride_block + kv_off, a.cache_stride_token,
                             std::min(a.block_size, kmax - b0 - PREFETCH_AHEAD * a.block_size));
      }
      for (int64_t o = 0; o < n_in_block; ++o) {
        const T* vrow = vblock + o * a.cache_stride_token;
        __m512 v[NC];
        for (int c = 0; c < NC; ++c) v[c] = load16(vrow + c * 16);
        const int64_t t = b0 + o;
        for (int i = 0; i < MB; ++i) {
          if (i < mb) {
            const __m512 p = _mm512_set1_ps(sc[(m0 + i) * kmax + t]);
            for (int c = 0; c < NC; ++c) o_acc[i][c] = _mm512_fmadd_ps(p, v[c], o_acc[i][c]);
          }
        }
      }
    }
    for (int i = 0; i < mb; ++i)
      for (int c = 0; c < NC; ++c) _mm512_storeu_ps(acc.data() + (m0 + i) * D + c * 16, o_acc[i][c]);
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = task.row_begin + m / a.group;
    const int64_t h = head0 + m % a.group;
    T* dst = a.out + (q0 + r) * a.out_stride_token + h * D;
    const float* src = acc.data() + m * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d]);
  }
}
#endif

// Portable path for any head_dim (and machines without AVX-512).
template <typename T>
void attend_scalar(const Args<T>& a, const Task& task, std::vector<float>& scores, std::vector<float>& qbuf,
                   std::vector<float>& acc) {
  const int64_t D = a.head_dim;
  const int64_t s = task.seq;
  const int64_t q0 = a.query_start_loc[s];
  const int64_t query_len = a.query_start_loc[s + 1] - q0;
  const int64_t seq_len = a.seq_lens[s];
  const int64_t first_pos = seq_len - query_len;
  const int64_t rows = task.row_end - task.row_begin;
  const int64_t M = rows * a.group;
  const int64_t kmax = first_pos + task.row_end;
  const int32_t* table = a.block_tables + s * a.bt_stride;
  const int64_t head0 = task.kv_head * a.group;
  const int64_t kv_off = task.kv_head * D;

  qbuf.resize(M * D);
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = task.row_begin + m / a.group;
    const T* q = a.query + (q0 + r) * a.q_stride_token + (head0 + m % a.group) * a.q_stride_head;
    for (int64_t d = 0; d < D; ++d) qbuf[m * D + d] = to_float(q[d]) * a.scale;
  }
  scores.resize(M * kmax);
  for (int64_t t = 0; t < kmax; ++t) {
    const T* krow = a.k_cache + table[t / a.block_size] * a.cache_stride_block +
                    (t % a.block_size) * a.cache_stride_token + kv_off;
    for (int64_t m = 0; m < M; ++m) {
      float dot = 0.0f;
      for (int64_t d = 0; d < D; ++d) dot += qbuf[m * D + d] * to_float(krow[d]);
      scores[m * kmax + t] = dot;
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    float* row = scores.data() + m * kmax;
    const int64_t n = first_pos + task.row_begin + m / a.group + 1;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, row[t]);
    float sum = 0.0f;
    for (int64_t t = 0; t < n; ++t) sum += (row[t] = std::exp(row[t] - mx));
    for (int64_t t = 0; t < n; ++t) row[t] /= sum;
    for (int64_t t = n; t < kmax; ++t) row[t] = 0.0f;
  }
  acc.assign(M * D, 0.0f);
  for (int64_t t = 0; t < kmax; ++t) {
    const T* vrow = a.v_cache + table[t / a.block_size] * a.cache_stride_block +
                    (t % a.block_size) * a.cache_stride_token + kv_off;
    for (int64_t m = 0; m < M; ++m) {
      const float p = scores[m * kmax + t];
      for (int64_t d = 0; d < D; ++d) acc[m * D + d] += p * to_float(vrow[d]);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const int64_t r = task.row_begin + m / a.group;
    T* dst = a.out + (q0 + r) * a.out_stride_token + (head0 + m % a.group) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[m * D + d]);
  }
}

std::vector<Task> make_tasks(const int32_t* seq_lens, const int32_t* query_start_loc, int64_t num_seqs,
                             int64_t num_kv_heads, int64_t max_query_len, int64_t rows_per_task) {
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t query_len = query_start_loc[s + 1] - query_start_loc[s];
    if (query_len == 0 || query_len > max_query_len) continue;
    const int64_t first_pos = seq_lens[s] - query_len;
    for (int64_t r0 = 0; r0 < query_len; r0 += rows_per_task) {
      const int64_t r1 = std::min(query_len, r0 + rows_per_task);
      for (int64_t g = 0; g < num_kv_heads; ++g) tasks.push_back({s, g, r0, r1, (first_pos + r1) * (r1 - r0)});
    }
  }
  // Longest first, then dynamic hand-out: keeps both cores busy with uneven lengths.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& x, const Task& y) { return x.cost > y.cost; });
  return tasks;
}

template <typename T>
void run_tasks(const Args<T>& a, const std::vector<Task>& tasks) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(tasks.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> scores, qbuf, acc;
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) {
#if defined(__AVX512F__)
      if (a.head_dim == 64) {
        attend_vec<T, 4>(a, tasks[i], scores, qbuf, acc);
        continue;
      }
      if (a.head_dim == 128) {
        attend_vec<T, 8>(a, tasks[i], scores, qbuf, acc);
        continue;
      }
      if (a.head_dim == 32) {
        attend_vec<T, 2>(a, tasks[i], scores, qbuf, acc);
        continue;
      }
#endif
      attend_scalar<T>(a, tasks[i], scores, qbuf, acc);
    }
  });
}

// out: [num_tokens, num_heads, head_dim], written only for the rows of sequences handled here.
void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                     double scale, int64_t max_query_len, int64_t rows_per_task) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [T, H, D] with unit last stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == query.scalar_type() && v_cache.scalar_type() == query.scalar_type(),
              "query and caches must share a dtype");
  TORCH_CHECK(out.scalar_type() == query.scalar_type() && out.is_contiguous(), "out must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1, "block_tables int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous(), "query_start_loc int32");
  const int64_t num_heads = query.size(1);
  const int64_t head_dim = query.size(2);
  const int64_t num_kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == head_dim && num_heads % num_kv_heads == 0, "head shapes disagree");
  const int64_t num_seqs = seq_lens.size(0);
  auto tasks = make_tasks(seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(), num_seqs, num_kv_heads,
                          max_query_len, std::max<int64_t>(1, rows_per_task));
  if (tasks.empty()) return;

  auto fill = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    Args<T> a;
    a.query = reinterpret_cast<const T*>(query.data_ptr());
    a.q_stride_token = query.stride(0);
    a.q_stride_head = query.stride(1);
    a.k_cache = reinterpret_cast<const T*>(k_cache.data_ptr());
    a.v_cache = reinterpret_cast<const T*>(v_cache.data_ptr());
    a.cache_stride_block = k_cache.stride(0);
    a.cache_stride_token = k_cache.stride(1);
    a.block_size = k_cache.size(1);
    a.block_tables = block_tables.data_ptr<int32_t>();
    a.bt_stride = block_tables.stride(0);
    a.seq_lens = seq_lens.data_ptr<int32_t>();
    a.query_start_loc = query_start_loc.data_ptr<int32_t>();
    a.out = reinterpret_cast<T*>(out.data_ptr());
    a.out_stride_token = out.stride(0);
    a.num_heads = num_heads;
    a.group = num_heads / num_kv_heads;
    a.head_dim = head_dim;
    a.scale = static_cast<float>(scale);
    run_tasks<T>(a, tasks);
  };
  if (query.scalar_type() == at::kBFloat16) {
    fill(static_cast<c10::BFloat16*>(nullptr));
  } else if (query.scalar_type() == at::kFloat) {
    fill(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(false, "paged_attention supports float32 and bfloat16");
  }
}

}  // namespace

TORCH_LIBRARY(pagedllm, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, float scale, int max_query_len, int rows_per_task) -> ()");
}

TORCH_LIBRARY_IMPL(pagedllm, CPU, m) { m.impl("paged_attention", &paged_attention); }
