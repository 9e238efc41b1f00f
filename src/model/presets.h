// Built-in architecture presets (the published configs of gpt-oss-20b/120b, Qwen3-30B-A3B, Mixtral-8x7B,
// plus tiny test models) and seeded random weights for them, for benchmarks and tests where no checkpoint
// can be downloaded. Names may carry the CLI's "preset:" prefix. Who calls: engine setup, `inspect`, tests.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"
#include "model/config.h"
#include "model/weights.h"
#include "ops/backend.h"

namespace lmx::model {

// Every preset name, e.g. "gpt-oss-20b", "tiny-moe".
std::vector<std::string> preset_names();

// The architecture of a preset; an error listing the known names otherwise. Allocates nothing.
Result<ModelConfig> preset_config(std::string_view name);

// The preset's config with generated weights (see make_random_weights). Fails, before allocating, when
// the bf16 weights would not fit in the host's available memory. `vocab_size` > 0 replaces the preset's V
// (embedding and LM head rows), so a preset can serve a real tokenizer's ids (`serve --tokenizer DIR`);
// the preset's eos/bos ids that fall outside the new vocabulary are dropped. 0 keeps the preset's V.
// With a non-cpu `backend` the weights are generated in its memory (a 21B preset starts in seconds on a GPU),
// bit for bit the values the host would generate.
// mxfp4_experts (GPT-OSS presets, --mxfp4-experts): the experts are generated as MXFP4 (uniform random codes,
// exponents scaled to the same N(0, 1/fan_in) spread) in the decode layout, kept in LayerWeights::
// gate_up_mxfp4 / down_mxfp4, and gate_up / down are their exact bf16 dequantization.
Result<ModelWeights> make_preset_model(std::string_view name, uint64_t seed, int vocab_size = 0,
                                       ops::Backend* backend = nullptr, bool mxfp4_experts = false);

// Deterministic weights for any config: each tensor's values depend only on (seed, tensor name), never on
// the thread count. Linear weights ~ N(0, 1/fan_in) (≈0.02 at H=2880) so logits and router scores have
// unit scale at every size; embeddings ~ N(0, 1); norms = 1; biases ~ N(0, 0.02²); sinks ~ N(0, 1).
// Values are approximately normal (a sum of four uniforms, variance-matched), which is plenty for weights.
// mxfp4_experts: as make_preset_model's; refused unless the family is GPT-OSS (interleaved experts) and H
// and I are multiples of 64 (the decode layout's k-tile).
Result<ModelWeights> make_random_weights(const ModelConfig& config, uint64_t seed, ops::Backend* backend = nullptr,
                                         bool mxfp4_experts = false);

// Bytes of weights make_random_weights allocates for `config` (bf16, plus the MXFP4 copies with mxfp4_experts).
uint64_t weight_bytes(const ModelConfig& config, bool mxfp4_experts = false);

}  // namespace lmx::model
