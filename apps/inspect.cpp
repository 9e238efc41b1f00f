// `loramux inspect DIR`: says what a model or adapter directory is. Model: family, dimensions, expert
// layout and storage (fused / per-expert / MXFP4), tensor bytes. Adapter: format, targets per layer,
// ranks, scaling, size — validated against the base model given by --model (or the adapter's
// base_model_name_or_path when that is a local directory).
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "apps/commands.h"
#include "engine/setup.h"
#include "io/safetensors.h"
#include "lora/adapter.h"
#include "model/presets.h"

namespace lmx::apps {
namespace {

namespace fs = std::filesystem;

int describe_model_dir(const std::string& dir) {
  Result<model::ModelConfig> config = model::load_model_config(dir);
  if (!config.ok()) {
    std::cerr << "loramux inspect: " << config.status().message() << "\n";
    return 1;
  }
  Result<io::Checkpoint> ckpt = io::Checkpoint::open(dir);
  if (!ckpt.ok()) {
    std::cerr << "loramux inspect: " << ckpt.status().message() << "\n";
    return 1;
  }
  const model::ModelConfig& c = *config;
  size_t bytes = 0, count = 0;
  bool mxfp4 = false, per_expert = false, fused = false;
  for (const std::string& name : ckpt->names()) {
    Result<Tensor> t = ckpt->tensor(name);
    if (t.ok()) bytes += t->nbytes();
    ++count;
    if (name.find("_blocks") != std::string::npos) mxfp4 = true;
    if (name.find(".experts.0.") != std::string::npos) per_expert = true;
    if (name.find("experts.gate_up_proj") != std::string::npos) fused = true;
  }
  std::cout << "model: " << dir << "\n"
            << "  architecture: " << c.architecture << " (family " << model::family_name(c.family) << ")\n"
            << "  layers " << c.num_layers << ", hidden " << c.hidden_size << ", heads " << c.num_heads << " (kv "
            << c.num_kv_heads << ", head_dim " << c.head_dim << "), vocab " << c.vocab_size << "\n";
  if (c.is_moe())
    std::cout << "  experts " << c.num_experts << " (top-" << c.experts_per_token << ", intermediate "
              << c.moe_intermediate_size << "), stored "
              << (mxfp4 ? "MXFP4 fused" : fused ? "fused 3D" : per_expert ? "per expert" : "unknown") << "\n";
  else
    std::cout << "  dense MLP, intermediate " << c.intermediate_size << "\n";
  if (c.sliding_window > 0) std::cout << "  sliding window " << c.sliding_window << "\n";
  std::cout << "  tensors " << count << ", " << bytes << " bytes\n";
  return 0;
}

int describe_adapter_dir(const std::string& dir, std::string base) {
  if (base.empty()) {
    Result<std::string> text = io::read_text_file((fs::path(dir) / "adapter_config.json").string());
    if (text.ok()) {
      nlohmann::json j = nlohmann::json::parse(*text, nullptr, false);
      if (j.is_object() && j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string()) {
        std::string candidate = j["base_model_name_or_path"].get<std::string>();
        if (fs::exists(fs::path(candidate) / "config.json")) base = candidate;
      }
    }
  }
  if (base.empty()) {
    std::cerr << "loramux inspect: adapter " << dir
              << " is validated against its base model; pass --model DIR|preset:NAME (its base_model_name_or_path "
                 "is not a local model directory)\n";
    return 1;
  }
  Result<model::ModelConfig> config = base.rfind("preset:", 0) == 0 ? model::preset_config(base.substr(7))
                                                                    : model::load_model_config(base);
  if (!config.ok()) {
    std::cerr << "loramux inspect: " << config.status().message() << "\n";
    return 1;
  }
  Result<lora::Adapter> adapter =
      lora::load_adapter(dir, fs::path(dir).filename().string(), engine::lora_shapes(*config), lora::AdapterLimits{.max_rank = 1 << 16});
  if (!adapter.ok()) {
    std::cerr << "loramux inspect: " << adapter.status().message() << "\n";
    return 1;
  }
  std::cout << lora::describe_adapter(*adapter);
  return 0;
}

}  // namespace

std::function<int()> add_inspect_command(CLI::App& app) {
  auto dir = std::make_shared<std::string>();
  auto base = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("inspect", "Describe a model or adapter directory");
  cmd->add_option("dir", *dir, "Model or PEFT adapter directory")->required();
  cmd->add_option("--model", *base, "Base model (directory or preset:NAME) to validate an adapter against");
  return [dir, base, cmd]() {
    if (!cmd->parsed()) return 0;
    if (fs::exists(fs::path(*dir) / "adapter_config.json")) return describe_adapter_dir(*dir, *base);
    if (fs::exists(fs::path(*dir) / "config.json")) return describe_model_dir(*dir);
    std::cerr << "loramux inspect: " << *dir << " has neither adapter_config.json nor config.json\n";
    return 1;
  };
}

}  // namespace lmx::apps
