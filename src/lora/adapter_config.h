// AdapterConfig: the fields of a PEFT adapter_config.json that decide how loramux reads the weights, and
// PEFT's rules for matching module names against target_modules, rank_pattern and alpha_pattern.
// Does not read tensors (lora/adapter.cpp does). Who calls: load_adapter, the config fuzz target.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/status.h"

namespace lmx::lora {

struct AdapterConfig {
  std::string source;  // the file, named in every error
  int r = 8;
  double lora_alpha = 8.0;
  bool use_rslora = false;
  // target_modules: a list (a module matches when its name equals an entry or ends with "." + entry) or one
  // regex string (a module matches when the regex matches its whole name). Empty list + no regex = none.
  std::vector<std::string> target_modules;
  std::optional<std::string> target_modules_regex;
  std::vector<std::string> exclude_modules;  // same rules as target_modules
  std::optional<std::string> exclude_modules_regex;
  // target_parameters: names of (3D) nn.Parameters, e.g. "mlp.experts.gate_up_proj"; a parameter key matches
  // when it equals an entry or ends with "." + entry.
  std::vector<std::string> target_parameters;
  // Per-module overrides, in file order (PEFT takes the first key that matches).
  std::vector<std::pair<std::string, int>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;
  std::vector<int> layers_to_transform;  // empty = every layer
  std::vector<std::string> layers_pattern;
  std::string base_model_name_or_path;
  std::string peft_version;  // "" when absent: written only since PEFT 0.18.0
  // loramux extension for adapters whose fused-expert layout cannot be told from shapes or peft_version:
  // which dim (1 or 2) of the [E, d1, d2] parameter PEFT treated as in_features (the width of lora_A).
  std::optional<int> fused_lora_a_dim;
};

// Parse adapter_config.json text. `source` names the file in errors. Rejects what loramux cannot serve
// exactly: peft_type other than LORA, bias != "none", DoRA, lora_bias, fan_in_fan_out, modules_to_save,
// trainable tokens, layer replication, aLoRA, LoRA variants and inits that modify the base weights.
Status parse_adapter_config(std::string_view json, const std::string& source, AdapterConfig* out);

// The rank and alpha PEFT gives the module (or parameter) named `key`, e.g.
// "model.layers.3.self_attn.q_proj" or "model.layers.3.mlp.experts.gate_up_proj" (no "base_model.model.").
// PEFT's get_pattern_key: the first pattern P with re.match("(.*\.)?(P)$", key) wins. Fails only on a
// pattern std::regex cannot compile, naming the field and the pattern.
Result<int> rank_for(const AdapterConfig& config, const std::string& key);
Result<double> alpha_for(const AdapterConfig& config, const std::string& key);

// Whether PEFT's target_modules / exclude_modules / layers_to_transform select module `key`.
Result<bool> targets_module(const AdapterConfig& config, const std::string& key);
// Whether target_parameters lists parameter `key` (e.g. "model.layers.0.mlp.experts.down_proj").
bool targets_parameter(const AdapterConfig& config, const std::string& key);

// "0.19.1.dev0@abc" -> {0, 19, 1}; false when `version` does not start with a number.
bool parse_peft_version(const std::string& version, int out[3]);

}  // namespace lmx::lora
