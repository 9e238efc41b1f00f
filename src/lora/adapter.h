// Adapter: a PEFT LoRA adapter parsed, validated against the base model and converted to loramux's
// canonical per-(layer, target) A/B pairs (fp32 on the host, scaling folded into B). Does not place
// anything on a device: SlotTable (lora/slots.h) does. Who calls: the engine's adapter store, `inspect`.
#pragma once
#include <array>
#include <optional>
#include <string>
#include <vector>

#include "core/status.h"
#include "core/tensor.h"
#include "ops/lora.h"

namespace lmx::lora {

// What an adapter is validated against, built from the base model's config by the engine.
struct BaseModelShapes {
  std::string family;      // model::family_name(): "gpt_oss", "qwen3_moe", "mixtral", "qwen3", "llama"
  int num_layers = 0;
  int num_experts = 0;     // 0 for dense models
  int hidden_size = 0;     // H
  int moe_intermediate_size = 0;  // I per expert
  bool gate_up_interleaved = false;  // GPT-OSS: gate_up rows alternate gate/up
  // in/out features of each target; 0 where the model has no such module (e.g. dense MLP in a MoE model).
  std::array<int, ops::kNumLoraTargets> in_features{};
  std::array<int, ops::kNumLoraTargets> out_features{};
};

// One target of one layer. For MoE targets a/b carry a leading expert dim.
struct LoraPair {
  OwnedTensor a;  // [R, in] or [E, R, in] f32
  OwnedTensor b;  // [out, R] or [E, out, R] f32, already multiplied by `scaling`
  int rank = 0;
  float scaling = 0.0f;  // alpha/r or alpha/sqrt(r) (rsLoRA), as folded into b
};

enum class AdapterFormat {
  kModules,           // target_modules only (attention / dense MLP / per-expert Linear modules)
  kFusedParameters,   // target_parameters on fused 3D expert tensors (maybe with target_modules too)
};

struct Adapter {
  std::string name;
  std::string dir;
  std::string content_hash;  // hex digest of adapter_config.json + adapter_model.safetensors bytes
  AdapterFormat format = AdapterFormat::kModules;
  std::string base_model_name;  // adapter_config's base_model_name_or_path, informational
  int max_rank = 0;             // largest rank over all pairs (a merged per-expert gate_up counts 2r)
  size_t file_bytes = 0;        // size of adapter_model.safetensors
  // layers[l][target]: empty where the adapter does not touch that target.
  std::vector<std::array<std::optional<LoraPair>, ops::kNumLoraTargets>> layers;
};

struct AdapterLimits {
  int max_rank = 64;  // --max-lora-rank: the largest r accepted (a merged gate_up may reach 2*max_rank)
};

// Load adapter_config.json + adapter_model.safetensors from `dir`. Every problem is an error naming the
// file, tensor or field with expected vs found: unknown target, wrong shape, rank above the limit,
// NaN/Inf, truncated file, adapter for another architecture, ambiguous fused layout.
Result<Adapter> load_adapter(const std::string& dir, const std::string& name, const BaseModelShapes& base,
                             const AdapterLimits& limits);

// Which targets a dummy adapter carries: attention (q, k, v, o), the MLP (all experts, or the dense MLP's
// gate, up, down), or both (the default).
enum class DummyTargets { kAll, kAttention, kMlp };
// A seeded random adapter on those targets, for benchmarks (bench_decode_step's rows that split the
// adapters' cost by target) and tests.
Adapter make_dummy_adapter(const std::string& name, const BaseModelShapes& base, int rank, uint64_t seed,
                           DummyTargets targets = DummyTargets::kAll);

// Human-readable description for `loramux inspect`: format, targets per layer, ranks, scaling, bytes.
std::string describe_adapter(const Adapter& adapter);

}  // namespace lmx::lora
