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

// An adapter laid out exactly as one slot of a SlotTable: per (layer, target) the A and B blocks in the
// table's LoRA dtype, padded with zeros to the slot capacity, on the host. SlotTable::prepare builds it on
// any thread (the adapter loader's worker); SlotTable::load then only copies it into a slot.
struct SlotImage {
  struct Block {
    OwnedTensor a, b;  // [E, R, in] / [E, out, R] or [R, in] / [out, R]; undefined: no LoRA on this target
    int32_t rank = 0;
  };
  std::vector<std::array<Block, ops::kNumLoraTargets>> layers;
  size_t bytes() const;
};

class SlotTable {
 public:
  // Allocates stacks for every target the model has. Capacity per target: max_rank, except the MoE
  // gate_up whose capacity is 2 * max_rank (per-expert gate/up adapters merge block-diagonally).
  SlotTable(ops::Backend& backend, const BaseModelShapes& base, int num_slots, int max_rank);
  // Device bytes such a table allocates in `dtype` (the engine checks them against free memory first).
  static uint64_t device_bytes(const BaseModelShapes& base, int num_slots, int max_rank, DType dtype);

  int num_slots() const { return num_slots_; }
  // Validate `adapter` against the table (targets, shapes, rank within the capacity) and lay it out as a
  // slot image. Reads only what never changes after construction, so any thread may call it.
  Result<SlotImage> prepare(const Adapter& adapter) const;
  // Copy a prepared image into `slot` (replacing what was there): host-to-device copies only.
  Status load(int slot, const SlotImage& image);
  // prepare + load.
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
};

}  // namespace lmx::lora
