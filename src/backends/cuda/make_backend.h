// Construction of the CUDA backend for code that must not see CUDA headers (engine/setup): a plain C++
// entry point. Fails with a message when no CUDA device is visible.
#pragma once
#include <memory>

#include "core/status.h"
#include "ops/backend.h"
#include "ops/kernel_configs.h"

namespace lmx::cuda {

// `kernel_configs`: tuned launch knobs (`loramux tune`); shapes and buckets it lacks use built-in defaults. Knobs
// the launchers do not take (check_moe_lora_knobs) fail here, before any device work.
Result<std::unique_ptr<ops::Backend>> make_cuda_backend(const ops::KernelConfigs& kernel_configs = {});

}  // namespace lmx::cuda
