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
// `kernel_configs`: a `loramux tune` folder for the CUDA backend ("" = the committed configs/kernels, if any).
Result<std::unique_ptr<ops::Backend>> make_backend(const std::string& device, const std::string& kernel_configs = "");

// `preset:NAME` (generated weights, seeded) or a Hugging Face model directory. `preset_vocab_size` > 0
// sizes a preset's vocabulary (to fit an attached tokenizer, see make_preset_model); directories ignore it,
// their vocabulary is the checkpoint's.
// With a GPU `backend`, a preset's weights are generated in its memory (seconds for 21B, no host copy).
// mxfp4 (--mxfp4-experts / --no-mxfp4-experts, GPT-OSS): whether to keep the experts' MXFP4 copies for the
// CUDA decode GEMMs (a checkpoint's own; a preset's generated as MXFP4 on the host, ~15 s more for 21B), see
// make_preset_model. Prefill keeps reading their exact bf16 dequantization, so results do not change.
enum class Mxfp4Experts {
  kAuto,  // on where `backend` is a GPU one and the model is GPT-OSS with MXFP4 experts (a gpt-oss preset, or a
          // checkpoint whose config.json says quant_method mxfp4: GPT-OSS's own format, as vLLM serves it) whose
          // hidden and expert sizes fit the decode layout (multiples of 64)
  kOn,    // on; an error where the model has no MXFP4 experts
  kOff,
};
// Whether kAuto / kOn / kOff keeps the MXFP4 copies of `model` (a preset name or directory) on `backend`.
Result<bool> resolve_mxfp4_experts(Mxfp4Experts mode, const std::string& model, const ops::Backend* backend);
Result<model::ModelWeights> load_base_model(const std::string& model, uint64_t seed, int preset_vocab_size = 0,
                                            ops::Backend* backend = nullptr, Mxfp4Experts mxfp4 = Mxfp4Experts::kOff);
// The CLI's choice: --mxfp4-experts (on), --no-mxfp4-experts (off; the two exclude each other), neither (kAuto).
inline Mxfp4Experts mxfp4_mode(bool on, bool off) {
  return on ? Mxfp4Experts::kOn : off ? Mxfp4Experts::kOff : Mxfp4Experts::kAuto;
}
// Whether load_base_model kept MXFP4 copies of the experts (the start-up summary's line).
bool has_mxfp4_experts(const model::ModelWeights& weights);

// The built-in default model (models/default: a small trained Qwen3-MoE with a tokenizer and adapters, made
// by tools/train_default.py), used when --model is not given. Searched in order: $LORAMUX_DEFAULT_MODEL
// (when set, the only place), <binary's folder>/models/default, <binary's folder>/../models/default, and
// the source tree the binary was built from. The error lists every place tried.
Result<std::string> find_default_model_dir();

// When `*model` is empty: sets it to find_default_model_dir() and puts one "NAME=DIR" per folder under
// its adapters/ (sorted by name) before `*loras`, and returns true; otherwise changes nothing, returns false.
Result<bool> use_default_model_if_unset(std::string* model, std::vector<std::string>* loras);

// "NAME=DIR" as given to --lora; error names the malformed argument.
Status parse_lora_argument(const std::string& arg, std::string* name, std::string* dir);

// --lora NAME=DIR adapters (loaded and validated) and --dummy-loras N generated adapters lora0..lora{N-1}
// (seeded from weight_seed exactly as `generate` seeds them, so serve and generate agree), added to `engine`.
// Each stays re-readable (its directory, or its dummy recipe) once the host tier drops it. `pinned` names
// (--pin-lora) must be among them; they keep their slot and host copy for the engine's life.
Status add_cli_adapters(Engine& engine, const std::vector<std::string>& loras, int dummy_loras, int dummy_lora_rank,
                        uint64_t weight_seed, const std::vector<std::string>& pinned = {});

// --max-cpu-loras when not given (0): max(--max-loras, number of start-up adapters), as documented.
inline int default_max_cpu_loras(int max_loras, int num_startup_adapters) {
  return num_startup_adapters > max_loras ? num_startup_adapters : max_loras;
}

}  // namespace lmx::engine
