// SlotTable: the device-resident, slot-stacked LoRA weights of design.md §5. For every (layer, target) one
// LoraStack: A[S][E][R][in], B[S][E][out][R] and rank[S]; a slot with no LoRA on a target has rank 0.
// Kernels loop over each slot's true rank, so padding to R costs memory only. Who calls: the engine,
// which decides which adapter sits in which slot (LRU eviction lives there, not here).
#pragma once
#include <array>
#include <vector>

#include "lora/adapter.h"
#include "ops/backend.h"

namespace lmx::lora {

class SlotTable {
 public:
  // Allocates stacks for every target the model has. Capacity per target: max_rank, except the MoE
  // gate_up whose capacity is 2 * max_rank (per-expert gate/up adapters merge block-diagonally).
  SlotTable(ops::Backend& backend, const BaseModelShapes& base, int num_slots, int max_rank);

  int num_slots() const { return num_slots_; }
  // Copy the adapter into `slot` (replacing what was there). Fails if a rank exceeds the capacity.
  Status load(int slot, const Adapter& adapter);
  // Mark `slot` empty (rank 0 on every target).
  void clear(int slot);
  // The stack for (layer, target), with .a undefined when no resident slot uses this target, so the
  // forward pass launches nothing for it.
  ops::LoraStack stack(int layer, ops::LoraTarget target) const;

 private:
  struct Target {
    OwnedTensor a, b, rank;           // device stacks
    std::vector<int32_t> host_rank;   // [S] mirror of `rank`
    int capacity = 0;
  };
  ops::Backend& backend_;
  BaseModelShapes base_;
  int num_slots_;
  std::vector<std::array<Target, ops::kNumLoraTargets>> layers_;
  // Host staging of one slot block in the slot's dtype (padding included), reused across targets and loads.
  std::vector<float> staging_f32_[2];
  std::vector<bf16> staging_bf16_[2];
};

}  // namespace lmx::lora
