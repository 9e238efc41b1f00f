// libFuzzer target: arbitrary bytes as adapter_config.json through parse_adapter_config, then PEFT's
// name matching (rank/alpha patterns, target_modules, layers_to_transform) on a few real module names.
// Any crash, sanitizer report or hang is a bug; an error Status is the expected outcome for junk.
// Built only with -DLORAMUX_FUZZ=ON and clang (see fuzz/README.md).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "lora/adapter_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  lmx::lora::AdapterConfig config;
  std::string_view text(reinterpret_cast<const char*>(data), size);
  lmx::Status status = lmx::lora::parse_adapter_config(text, "fuzz-input", &config);
  if (!status.ok()) return 0;
  // Invariants a successful parse promises to the loader.
  if (config.r < 1) __builtin_trap();
  for (const auto& [pattern, rank] : config.rank_pattern)
    if (rank < 1) __builtin_trap();
  static const char* kKeys[] = {"model.layers.0.self_attn.q_proj", "model.layers.12.mlp.experts.3.gate_proj",
                                "model.layers.1.mlp.experts.gate_up_proj", "model.layers.7.block_sparse_moe.experts.0.w2"};
  for (const char* key : kKeys) {
    auto rank = lmx::lora::rank_for(config, key);
    if (rank.ok() && *rank < 1) __builtin_trap();
    (void)lmx::lora::alpha_for(config, key);
    (void)lmx::lora::targets_module(config, key);
    (void)lmx::lora::targets_parameter(config, key);
  }
  int version[3];
  (void)lmx::lora::parse_peft_version(config.peft_version, version);
  return 0;
}
