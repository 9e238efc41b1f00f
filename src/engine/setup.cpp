// CLI-level construction helpers (see setup.h).
#include "engine/setup.h"

#include "backends/cpu/cpu_backend.h"
#include "model/presets.h"
#ifdef LORAMUX_HAVE_CUDA
#include "backends/cuda/cuda_backend.h"
#endif

namespace lmx::engine {

Result<std::unique_ptr<ops::Backend>> make_backend(const std::string& device) {
  if (device == "cpu") return std::unique_ptr<ops::Backend>(std::make_unique<cpu::CpuBackend>());
#ifdef LORAMUX_HAVE_CUDA
  if (device == "cuda") return cuda::make_cuda_backend();
#endif
  if (device == "cuda") return unsupported("device 'cuda': this build has no CUDA backend (configure with -DLORAMUX_CUDA=ON)");
  return invalid_argument("unknown device '" + device + "' (expected cpu or cuda)");
}

Result<model::ModelWeights> load_base_model(const std::string& model, uint64_t seed) {
  const std::string prefix = "preset:";
  if (model.rfind(prefix, 0) == 0) return model::make_preset_model(model.substr(prefix.size()), seed);
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

}  // namespace lmx::engine
