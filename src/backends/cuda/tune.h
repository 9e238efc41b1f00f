// `loramux tune`: sweeps the launch knobs of the CUDA MoE-LoRA on the current GPU per token bucket and
// returns the fastest as KernelConfigs data (ops/kernel_configs.h); and the lookup the backend does with
// that data. CUDA-free header: apps/tune.cpp and the backend include it. The sweep allocates its own
// random data on the device (never zeros), times each candidate as a captured CUDA graph (median of
// replays) and checks nothing numerically — the parity tests own correctness for every knob value.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/status.h"
#include "ops/kernel_configs.h"

namespace lmx::cuda {

struct MoeBlockConfig;

// The op and shape key of the MoE-LoRA entries: "moe_lora", "H=..,I=..,E=..,K=..,S=..,R=..".
inline constexpr const char* kMoeLoraOp = "moe_lora";
std::string moe_lora_shape_key(int64_t hidden, int64_t inter, int64_t experts, int64_t top_k, int64_t slots,
                               int64_t rank);

struct TuneMoeLoraOptions {
  int64_t hidden = 0, inter = 0, experts = 0, top_k = 0;  // H, I, E, K of the model
  int64_t slots = 8, rank = 32;                           // --max-loras, --max-lora-rank
  std::vector<int64_t> buckets = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096};
  std::function<void(const std::string&)> log;            // one line per bucket (may be empty)
};

// Fails (no device, too little memory) with a message; otherwise one entry per bucket.
Result<ops::KernelConfigs> tune_moe_lora(const TuneMoeLoraOptions& options);

// The MoE block's LoRA choices for `tokens` from tuned data (built-in defaults where there is none).
void apply_moe_lora_knobs(const ops::KernelKnobs* knobs, MoeBlockConfig* config);

}  // namespace lmx::cuda
