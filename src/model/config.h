// ModelConfig: the one validated description of a base model, parsed from a Hugging Face config.json
// (transformers v4 `rope_scaling`/`rope_theta` and v5 `rope_parameters` styles) or built from a preset.
// Who calls: the weight loader, presets, the forward pass, adapter validation (via lora_shapes()).
#pragma once
#include <string>
#include <vector>

#include "core/status.h"
#include "ops/moe.h"
#include "ops/rope.h"
#include "ops/routing.h"

namespace lmx::model {

enum class Family { kGptOss, kQwen3Moe, kMixtral, kQwen3, kLlama };
std::string_view family_name(Family family);  // "gpt_oss", "qwen3_moe", "mixtral", "qwen3", "llama"

struct ModelConfig {
  Family family = Family::kLlama;
  std::string architecture;  // e.g. "GptOssForCausalLM"
  int vocab_size = 0;        // V
  int hidden_size = 0;       // H
  int num_layers = 0;
  int num_heads = 0;         // Hq
  int num_kv_heads = 0;      // Hkv
  int head_dim = 0;          // D
  int intermediate_size = 0; // dense MLP I (dense families)
  // MoE (num_experts == 0 for dense families)
  int num_experts = 0;             // E
  int experts_per_token = 0;       // K
  int moe_intermediate_size = 0;   // I of one expert
  ops::RoutingRule routing = ops::RoutingRule::kSoftmaxThenTopK;
  bool norm_topk_prob = true;
  ops::MoeActivation moe_activation = ops::MoeActivation::kSiluGated;
  ops::GateUpLayout gate_up_layout = ops::GateUpLayout::kHalves;
  float swiglu_alpha = 1.702f;
  float swiglu_limit = 7.0f;
  bool router_bias = false;   // GPT-OSS
  bool expert_bias = false;   // GPT-OSS
  // attention
  bool attention_bias = false;      // q/k/v/o biases (GPT-OSS: true)
  bool qk_norm = false;             // Qwen3 / Qwen3-MoE per-head RMSNorm of q and k
  bool attention_sinks = false;     // GPT-OSS
  int sliding_window = 0;           // 0 = none
  std::vector<bool> layer_sliding;  // [num_layers]: layer uses the sliding window
  ops::RopeScaling rope;
  float rms_norm_eps = 1e-5f;
  int max_position_embeddings = 0;
  bool tie_word_embeddings = false;
  std::vector<int> eos_token_ids;
  int bos_token_id = -1;

  // config.json's quantization_config is GPT-OSS's mxfp4: the checkpoint's experts are MXFP4 blocks.
  bool mxfp4_checkpoint = false;
  bool is_moe() const { return num_experts > 0; }
  int q_dim() const { return num_heads * head_dim; }
  int kv_dim() const { return num_kv_heads * head_dim; }
};

// Parse config.json text; `source` names the file in errors. Fails with the field name on missing or
// inconsistent values and names unsupported architectures.
Result<ModelConfig> parse_model_config(const std::string& json_text, const std::string& source);
Result<ModelConfig> load_model_config(const std::string& model_dir);
// A config.json text describing `config` (used to write tiny models for tests and by `inspect`).
std::string model_config_to_json(const ModelConfig& config);

}  // namespace lmx::model
