// Turning CLI-level choices into engine parts: the backend for a device name, the base model from a
// directory or a preset, and adapters from PEFT directories or generated (--dummy-loras).
// Who calls: apps/ (generate, inspect; later serve and bench).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace lmx::engine {

// "cpu" or "cuda" (the latter only when built with LORAMUX_CUDA); error names the device otherwise.
Result<std::unique_ptr<ops::Backend>> make_backend(const std::string& device);

// `preset:NAME` (generated weights, seeded) or a Hugging Face model directory. `preset_vocab_size` > 0
// sizes a preset's vocabulary (to fit an attached tokenizer, see make_preset_model); directories ignore it,
// their vocabulary is the checkpoint's.
Result<model::ModelWeights> load_base_model(const std::string& model, uint64_t seed, int preset_vocab_size = 0);

// "NAME=DIR" as given to --lora; error names the malformed argument.
Status parse_lora_argument(const std::string& arg, std::string* name, std::string* dir);

// --lora NAME=DIR adapters (loaded and validated) and --dummy-loras N generated adapters lora0..lora{N-1}
// (seeded from weight_seed exactly as `generate` seeds them, so serve and generate agree), added to `engine`.
Status add_cli_adapters(Engine& engine, const std::vector<std::string>& loras, int dummy_loras, int dummy_lora_rank,
                        uint64_t weight_seed);

}  // namespace lmx::engine
