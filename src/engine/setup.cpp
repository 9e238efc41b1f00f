// CLI-level construction helpers (see setup.h).
#include "engine/setup.h"

#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "backends/cpu/cpu_backend.h"
#ifdef LORAMUX_HAVE_CUDA
#include "backends/cuda/make_backend.h"
#include "backends/cuda/tune.h"
#endif
#include "lora/adapter.h"
#include "model/config.h"
#include "model/presets.h"
#include "ops/mxfp4.h"

namespace lmx::engine {

Result<std::unique_ptr<ops::Backend>> make_backend(const std::string& device, const std::string& kernel_configs) {
  if (device == "cpu") return std::unique_ptr<ops::Backend>(std::make_unique<cpu::CpuBackend>());
  if (device == "cuda") {
#ifdef LORAMUX_HAVE_CUDA
    // Tuned launch knobs: the folder given, else the built-in defaults committed in configs/kernels.
    std::string dir = kernel_configs;
    if (dir.empty() && std::filesystem::is_directory(std::string(LORAMUX_SOURCE_DIR) + "/configs/kernels")) {
      dir = std::string(LORAMUX_SOURCE_DIR) + "/configs/kernels";
    }
    ops::KernelConfigs configs;
    if (!dir.empty()) {
      Result<ops::KernelConfigs> loaded = ops::KernelConfigs::load_dir(dir);
      if (!loaded.ok()) return loaded.status().with_context("--kernel-configs");
      configs = std::move(loaded).value();
      if (Status s = cuda::check_moe_lora_knobs(configs); !s.ok()) return s.with_context("--kernel-configs " + dir);
    }
    return cuda::make_cuda_backend(configs);
#else
    (void)kernel_configs;
    return unsupported("device 'cuda': this build has no CUDA backend (configure with -DLORAMUX_CUDA=ON, which "
                       "scripts/setup does when nvcc is found); use --device cpu");
#endif
  }
  return invalid_argument("unknown device '" + device + "' (expected cpu or cuda)");
}

Result<bool> resolve_mxfp4_experts(Mxfp4Experts mode, const std::string& model, const ops::Backend* backend) {
  if (mode != Mxfp4Experts::kAuto) return mode == Mxfp4Experts::kOn;
  if (backend == nullptr || backend->device() != Device::kCuda) return false;
  const std::string prefix = "preset:";
  Result<model::ModelConfig> config = model.rfind(prefix, 0) == 0 ? model::preset_config(model.substr(prefix.size()))
                                                                  : model::load_model_config(model);
  if (!config.ok()) return config.status();
  const bool preset = model.rfind(prefix, 0) == 0;
  const bool fits = config->hidden_size % ops::mxfp4::kTileK == 0 && config->moe_intermediate_size % ops::mxfp4::kTileK == 0;
  return config->family == model::Family::kGptOss && (preset || config->mxfp4_checkpoint) && fits;
}

bool has_mxfp4_experts(const model::ModelWeights& weights) {
  return !weights.layers.empty() && weights.layers.front().gate_up_mxfp4.defined();
}

Result<model::ModelWeights> load_base_model(const std::string& model, uint64_t seed, int preset_vocab_size,
                                            ops::Backend* backend, Mxfp4Experts mxfp4) {
  LMX_ASSIGN_OR_RETURN(const bool mxfp4_experts, resolve_mxfp4_experts(mxfp4, model, backend));
  const std::string prefix = "preset:";
  Result<model::ModelWeights> weights =
      model.rfind(prefix, 0) == 0
          ? model::make_preset_model(model.substr(prefix.size()), seed, preset_vocab_size, backend, mxfp4_experts)
          : model::load_model(model, mxfp4_experts, backend);
  if (!weights.ok() && mxfp4 == Mxfp4Experts::kAuto && mxfp4_experts) {
    return weights.status().with_context("MXFP4 experts are on by default for GPT-OSS on cuda; --no-mxfp4-experts "
                                         "serves the bf16 experts only");
  }
  return weights;
}

Result<std::string> find_default_model_dir() {
  namespace fs = std::filesystem;
  std::error_code ec;
  auto is_model_dir = [&](const fs::path& dir) { return fs::exists(dir / "config.json", ec); };
  if (const char* env = std::getenv("LORAMUX_DEFAULT_MODEL"); env != nullptr && *env != '\0') {
    if (is_model_dir(env)) return std::string(env);
    return not_found("LORAMUX_DEFAULT_MODEL='" + std::string(env) + "' holds no config.json (expected the folder "
                     "tools/train_default.py writes, e.g. models/default)");
  }
  std::vector<fs::path> candidates;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(exe.parent_path() / "models" / "default");
    candidates.push_back(exe.parent_path().parent_path() / "models" / "default");
  }
#ifdef LORAMUX_DEFAULT_MODEL_DIR
  candidates.push_back(LORAMUX_DEFAULT_MODEL_DIR);
#endif
  std::string tried;
  for (const fs::path& dir : candidates) {
    if (is_model_dir(dir)) return fs::weakly_canonical(dir, ec).string();
    tried += (tried.empty() ? "" : ", ") + dir.string();
  }
  return not_found("no --model given and the built-in default model was not found (tried " + tried +
                   "); pass --model DIR or preset:NAME, or set LORAMUX_DEFAULT_MODEL to a models/default folder");
}

Result<bool> use_default_model_if_unset(std::string* model, std::vector<std::string>* loras) {
  namespace fs = std::filesystem;
  if (!model->empty()) return false;
  LMX_ASSIGN_OR_RETURN(std::string dir, find_default_model_dir());
  std::vector<std::string> names;
  std::error_code ec;
  const fs::path adapters = fs::path(dir) / "adapters";
  if (fs::is_directory(adapters, ec)) {
    for (const fs::directory_entry& entry : fs::directory_iterator(adapters, ec))
      if (entry.is_directory(ec)) names.push_back(entry.path().filename().string());
    if (ec) return io_error("cannot list " + adapters.string() + ": " + ec.message());
  }
  std::sort(names.begin(), names.end());
  std::vector<std::string> defaults;
  for (const std::string& name : names) defaults.push_back(name + "=" + (adapters / name).string());
  loras->insert(loras->begin(), defaults.begin(), defaults.end());
  *model = dir;
  return true;
}

Status parse_lora_argument(const std::string& arg, std::string* name, std::string* dir) {
  size_t eq = arg.find('=');
  if (eq == std::string::npos || eq == 0 || eq + 1 == arg.size())
    return invalid_argument("--lora expects NAME=DIR, got '" + arg + "'");
  *name = arg.substr(0, eq);
  *dir = arg.substr(eq + 1);
  return Status::Ok();
}

Status add_cli_adapters(Engine& engine, const std::vector<std::string>& loras, int dummy_loras, int dummy_lora_rank,
                        uint64_t weight_seed, const std::vector<std::string>& pinned) {
  const lora::BaseModelShapes shapes = lora_shapes(engine.model().config());
  const lora::AdapterLimits limits{.max_rank = engine.config().max_lora_rank};
  std::vector<std::string> names;
  for (const std::string& arg : loras) {
    std::string name, dir;
    LMX_RETURN_IF_ERROR(parse_lora_argument(arg, &name, &dir));
    names.push_back(name);
  }
  for (int i = 0; i < dummy_loras; ++i) names.push_back("lora" + std::to_string(i));
  for (const std::string& pin : pinned)
    if (std::find(names.begin(), names.end(), pin) == names.end())
      return invalid_argument("--pin-lora '" + pin + "' names no --lora or --dummy-loras adapter");
  auto is_pinned = [&](const std::string& name) { return std::find(pinned.begin(), pinned.end(), name) != pinned.end(); };
  // Pinned adapters first, so the host tier's LRU never has to make room for them.
  for (int pass = 0; pass < 2; ++pass) {
    for (const std::string& arg : loras) {
      std::string name, dir;
      LMX_RETURN_IF_ERROR(parse_lora_argument(arg, &name, &dir));
      if (is_pinned(name) != (pass == 0)) continue;
      Result<lora::Adapter> adapter = lora::load_adapter(dir, name, shapes, limits);
      if (!adapter.ok()) return adapter.status();
      LMX_RETURN_IF_ERROR(
          engine.add_adapter(std::move(adapter).value(), {.pinned = is_pinned(name), .source = AdapterSource{.dir = dir}}));
    }
    for (int i = 0; i < dummy_loras; ++i) {
      const std::string name = "lora" + std::to_string(i);
      if (is_pinned(name) != (pass == 0)) continue;
      const AdapterSource source{.dummy_rank = dummy_lora_rank, .dummy_seed = weight_seed + 1000 + uint64_t(i)};
      LMX_RETURN_IF_ERROR(engine.add_adapter(lora::make_dummy_adapter(name, shapes, source.dummy_rank, source.dummy_seed),
                                             {.pinned = is_pinned(name), .source = source}));
    }
  }
  return Status::Ok();
}

}  // namespace lmx::engine
