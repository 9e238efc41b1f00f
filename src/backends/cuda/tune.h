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
// PRECOND: knobs passed check_moe_lora_knobs.
void apply_moe_lora_knobs(const ops::KernelKnobs* knobs, MoeBlockConfig* config);

// Every moe_lora entry of `configs` against the knobs the launchers take: path 0 (direct per-pair) or 1 (tiled
// shrink + expand); pdl and order 0 or 1; split_k 0 (by size) to 64; expand_block_n 64 or 128; expand_chunks
// 0 (by size) to 1024; expand_bulk and expand_persistent 0 or 1. An unknown knob or
// a value out of range fails with the shape, the bucket, the knob, the value found and what was expected —
// before a launcher could refuse it mid-request. Host code (runs without a GPU).
Status check_moe_lora_knobs(const ops::KernelConfigs& configs);

}  // namespace lmx::cuda
