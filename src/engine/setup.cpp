// CLI-level construction helpers (see setup.h).
#include "engine/setup.h"

#include "backends/cpu/cpu_backend.h"
#include "lora/adapter.h"
#include "model/presets.h"

namespace lmx::engine {

Result<std::unique_ptr<ops::Backend>> make_backend(const std::string& device) {
  if (device == "cpu") return std::unique_ptr<ops::Backend>(std::make_unique<cpu::CpuBackend>());
  // The CUDA kernels so far (src/backends/cuda) cover the dense elementwise ops only; a Backend that ran
  // half the model would be a stub, so whole models run on the cpu until the CUDA backend is complete.
  if (device == "cuda")
    return unsupported("device 'cuda': the CUDA backend cannot run whole models yet (kernels exist only for the "
                       "dense elementwise ops); use --device cpu");
  return invalid_argument("unknown device '" + device + "' (expected cpu or cuda)");
}

Result<model::ModelWeights> load_base_model(const std::string& model, uint64_t seed, int preset_vocab_size) {
  const std::string prefix = "preset:";
  if (model.rfind(prefix, 0) == 0) return model::make_preset_model(model.substr(prefix.size()), seed, preset_vocab_size);
  return model::load_model(model);
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
                        uint64_t weight_seed) {
  const lora::BaseModelShapes shapes = lora_shapes(engine.model().config());
  const lora::AdapterLimits limits{.max_rank = engine.config().max_lora_rank};
  for (const std::string& arg : loras) {
    std::string name, dir;
    LMX_RETURN_IF_ERROR(parse_lora_argument(arg, &name, &dir));
    Result<lora::Adapter> adapter = lora::load_adapter(dir, name, shapes, limits);
    if (!adapter.ok()) return adapter.status();
    LMX_RETURN_IF_ERROR(engine.add_adapter(std::move(adapter).value()));
  }
  for (int i = 0; i < dummy_loras; ++i)
    LMX_RETURN_IF_ERROR(engine.add_adapter(lora::make_dummy_adapter("lora" + std::to_string(i), shapes, dummy_lora_rank,
                                                                    weight_seed + 1000 + uint64_t(i))));
  return Status::Ok();
}

}  // namespace lmx::engine
