// One instantiation per element type for the kernels that take float32 and bf16 tensors:
// f(tag) with tag a null pointer of the tensor's type (float or c10::BFloat16); any other
// dtype is an error naming the op. And one per count for register blocks whose size is a
// template argument (dispatch_count).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <type_traits>

namespace pagedllm_dispatch {

template <typename F>
void dispatch_float_types(const at::Tensor& t, const char* name, F&& f) {
  if (t.scalar_type() == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else if (t.scalar_type() == at::kBFloat16) {
    f(static_cast<c10::BFloat16*>(nullptr));
  } else {
    TORCH_CHECK(false, name, " supports float32 and bfloat16");
  }
}

// f(std::integral_constant<int, k>{}) with k = n clamped to [K, MAX]: a register block of
// n <= MAX rows run by the instantiation for exactly n.
template <int MAX, int K = 1, typename F>
inline void dispatch_count(int64_t n, const F& f) {
  if constexpr (K >= MAX) {
    f(std::integral_constant<int, MAX>{});
  } else {
    if (n <= K) return f(std::integral_constant<int, K>{});
    dispatch_count<MAX, K + 1>(n, f);
  }
}

}  // namespace pagedllm_dispatch
