// One instantiation per element type for the kernels that take float32 and bf16 tensors:
// f(tag) with tag a null pointer of the tensor's type (float or c10::BFloat16); any other
// dtype is an error naming the op.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

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

}  // namespace pagedllm_dispatch
