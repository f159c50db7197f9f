// The block table and slot mapping each layer of a one-call decoder op attends with: a model
// whose layers are grouped by attention kind (full, each window) keeps one block table per
// group (core/kv_groups.py). Group 0's come as the op's block_tables / slot_mapping, groups
// 1.. as lists, and layer_groups names each layer's group; empty lists: one group.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace pagedllm_groups {

class Groups {
 public:
  Groups(const at::Tensor& tables, const at::Tensor& slots, at::TensorList group_tables, at::TensorList group_slots,
         at::IntArrayRef layer_groups, size_t num_layers)
      : tables_(tables), slots_(slots), group_tables_(group_tables), group_slots_(group_slots),
        layer_groups_(layer_groups) {
    TORCH_CHECK(group_tables.size() == group_slots.size(), "one slot mapping per group's block table");
    TORCH_CHECK(layer_groups.empty() || layer_groups.size() == num_layers, "layer_groups needs one entry per layer");
    for (int64_t g : layer_groups)
      TORCH_CHECK(g >= 0 && g <= static_cast<int64_t>(group_tables.size()), "layer group ", g, " out of range");
  }
  const at::Tensor& tables(size_t layer) const {
    const int64_t g = group(layer);
    return g == 0 ? tables_ : group_tables_[g - 1];
  }
  const at::Tensor& slots(size_t layer) const {
    const int64_t g = group(layer);
    return g == 0 ? slots_ : group_slots_[g - 1];
  }

 private:
  int64_t group(size_t layer) const { return layer_groups_.empty() ? 0 : layer_groups_[layer]; }
  const at::Tensor& tables_;
  const at::Tensor& slots_;
  at::TensorList group_tables_;
  at::TensorList group_slots_;
  at::IntArrayRef layer_groups_;
};

}  // namespace pagedllm_groups
