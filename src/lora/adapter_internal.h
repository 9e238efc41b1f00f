// Helpers shared by the lora/ sources only (not part of the library's interface): the content hash and
// the display names of LoRA targets. Who calls: adapter.cpp, adapter_dummy.cpp, adapter_describe.cpp.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "ops/lora.h"

namespace lmx::lora::detail {

// A 128-bit non-cryptographic digest (two independent 64-bit lanes, 8 bytes per step, SplitMix64
// finalizer) over a sequence of byte ranges. Each range's length is mixed in, so ("ab", "c") and
// ("a", "bc") differ. Identity for caches, not a defence against deliberate collisions.
class ContentHasher {
 public:
  void add(const void* data, size_t size);
  std::string hex() const;  // 32 lowercase hex digits

 private:
  uint64_t lane1_ = 0x6c6f72616d757831ull;  // "loramux1"
  uint64_t lane2_ = 0x9e3779b97f4a7c15ull;
  uint64_t total_ = 0;
};

// "q_proj", ..., "mlp.gate_proj", ..., "experts.gate_up", "experts.down" (same words as ops::lora_target_name).
std::string_view target_label(ops::LoraTarget target);
bool is_moe_target(ops::LoraTarget target);

}  // namespace lmx::lora::detail
