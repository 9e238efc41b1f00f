// `loramux tune moe-lora --model preset:NAME|DIR --max-loras S --max-lora-rank R --kernel-configs DIR`: sweeps
// the CUDA MoE-LoRA's launch knobs per token bucket on this GPU and writes DIR/moe_lora.json (format in
// docs/kernels.md), which `serve`/`generate --kernel-configs DIR` load. Only the model's shapes are read
// (config.json or the preset), no weights. Needs a CUDA build and a GPU.
#include <iostream>
#include <sstream>

#include "apps/commands.h"
#include "model/config.h"
#include "model/presets.h"
#include "ops/kernel_configs.h"
#ifdef LORAMUX_HAVE_CUDA
#include "backends/cuda/tune.h"
#endif

namespace lmx::apps {
namespace {

struct TuneOptions {
  std::string op;
  std::string model = "preset:gpt-oss-20b";
  int max_loras = 8;
  int max_lora_rank = 32;
  std::string kernel_configs;
  std::vector<int64_t> buckets;
};

int run_tune(const TuneOptions& o) {
  auto fail = [](const Status& s) {
    std::cerr << "loramux tune: " << s.message() << "\n";
    return 1;
  };
  if (o.op != "moe-lora") return fail(invalid_argument("unknown op '" + o.op + "' (known: moe-lora)"));
  const bool is_preset = o.model.rfind("preset:", 0) == 0;
  Result<model::ModelConfig> config =
      is_preset ? model::preset_config(o.model.substr(7)) : model::load_model_config(o.model);
  if (!config.ok()) return fail(config.status());
  if (!config->is_moe()) return fail(invalid_argument("--model " + o.model + " has no experts: nothing to tune for moe-lora"));
#ifdef LORAMUX_HAVE_CUDA
  cuda::TuneMoeLoraOptions options{.hidden = config->hidden_size,
                                   .inter = config->moe_intermediate_size,
                                   .experts = config->num_experts,
                                   .top_k = config->experts_per_token,
                                   .slots = o.max_loras,
                                   .rank = o.max_lora_rank,
                                   .log = [](const std::string& line) { std::cout << line << std::endl; }};
  if (!o.buckets.empty()) options.buckets = o.buckets;
  std::cout << "loramux tune moe-lora: " << o.model << " ("
            << cuda::moe_lora_shape_key(options.hidden, options.inter, options.experts, options.top_k, options.slots,
                                        options.rank)
            << "), " << options.buckets.size() << " token buckets" << std::endl;
  Result<ops::KernelConfigs> tuned = cuda::tune_moe_lora(options);
  if (!tuned.ok()) return fail(tuned.status());
  // Merge into what the folder holds (other shapes and ops stay).
  ops::KernelConfigs merged;
  if (Result<ops::KernelConfigs> existing = ops::KernelConfigs::load_dir(o.kernel_configs); existing.ok()) {
    merged = std::move(existing).value();
  }
  std::ostringstream command;
  command << "loramux tune moe-lora --model " << o.model << " --max-loras " << o.max_loras << " --max-lora-rank "
          << o.max_lora_rank;
  tuned->set_note("command", command.str());
  merged.merge(*tuned);
  if (Status s = merged.save_dir(o.kernel_configs); !s.ok()) return fail(s);
  std::cout << "wrote " << o.kernel_configs << "/moe_lora.json (" << tuned->entries() << " entries)" << std::endl;
  return 0;
#else
  return fail(unsupported("this build has no CUDA backend (configure with -DLORAMUX_CUDA=ON); tuning needs a GPU"));
#endif
}

}  // namespace

std::function<int()> add_tune_command(CLI::App& app) {
  auto o = std::make_shared<TuneOptions>();
  CLI::App* cmd = app.add_subcommand("tune", "Sweep CUDA kernel launch configs on this GPU; write them as JSON");
  cmd->add_option("op", o->op, "Which op: moe-lora")->required();
  cmd->add_option("--model", o->model, "preset:NAME or a model directory (only its config.json is read)")
      ->capture_default_str();
  cmd->add_option("--max-loras", o->max_loras, "Adapter slots S the server will run with")->capture_default_str();
  cmd->add_option("--max-lora-rank", o->max_lora_rank, "Rank capacity R the server will run with")->capture_default_str();
  cmd->add_option("--kernel-configs", o->kernel_configs, "Folder to write <op>.json into (created)")->required();
  cmd->add_option("--buckets", o->buckets, "Token counts to tune (default 1 2 4 ... 4096)");
  return [o] { return run_tune(*o); };
}

}  // namespace lmx::apps
