// lora_target_name: the names of the LoRA targets of ops/lora.h as logs and error messages print them
// (PEFT's module names where one exists). Called by the adapter loader and the slot table.
#include "ops/lora.h"

namespace lmx::ops {

std::string_view lora_target_name(LoraTarget target) {
  switch (target) {
    case LoraTarget::kQ: return "q_proj";
    case LoraTarget::kK: return "k_proj";
    case LoraTarget::kV: return "v_proj";
    case LoraTarget::kO: return "o_proj";
    case LoraTarget::kGate: return "gate_proj";
    case LoraTarget::kUp: return "up_proj";
    case LoraTarget::kDown: return "down_proj";
    case LoraTarget::kMoeGateUp: return "experts.gate_up";
    case LoraTarget::kMoeDown: return "experts.down";
    case LoraTarget::kCount: break;
  }
  return "?";
}

}  // namespace lmx::ops
