// Presets are config.json texts (the published ones for the real models) run through parse_model_config,
// so a preset is exactly what loading that model's directory would give. Weights are generated in
// parallel chunks whose seeds derive from (seed, tensor name, chunk), so they never depend on thread count.
#include "model/presets.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <tuple>
#include <utility>

#include "core/rng.h"
#include "core/host_parallel.h"
#include "model/mxfp4.h"
#include "ops/mxfp4.h"

namespace lmx::model {
namespace {

// config.json of openai/gpt-oss-20b (quantization_config left out: preset experts are bf16).
constexpr const char* kGptOss20b = R"({
  "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
  "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
  "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8,
  "num_local_experts": 32, "num_experts_per_tok": 4, "experts_per_token": 4,
  "attention_bias": true, "hidden_act": "silu", "swiglu_limit": 7.0, "rms_norm_eps": 1e-05,
  "max_position_embeddings": 131072, "initial_context_length": 4096, "sliding_window": 128,
  "layer_types": "ALTERNATE",
  "rope_theta": 150000,
  "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                   "original_max_position_embeddings": 4096, "truncate": false},
  "tie_word_embeddings": false, "eos_token_id": 200002, "pad_token_id": 199999
})";

// config.json of Qwen/Qwen3-30B-A3B.
constexpr const char* kQwen3_30bA3b = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
  "head_dim": 128, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
  "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true, "decoder_sparse_step": 1,
  "mlp_only_layers": [], "attention_bias": false, "hidden_act": "silu", "rms_norm_eps": 1e-06,
  "max_position_embeddings": 40960, "max_window_layers": 48, "use_sliding_window": false,
  "sliding_window": null, "rope_scaling": null, "rope_theta": 1000000.0, "tie_word_embeddings": false,
  "bos_token_id": 151643, "eos_token_id": 151645
})";

// config.json of mistralai/Mixtral-8x7B-v0.1.
constexpr const char* kMixtral8x7b = R"({
  "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
  "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
  "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
  "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu", "rms_norm_eps": 1e-05,
  "max_position_embeddings": 32768, "sliding_window": null, "rope_theta": 1000000.0,
  "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2
})";

// A GPT-OSS-shaped toy: every GPT-OSS feature (sinks, biases, interleaved clamped experts, top-k-then-
// softmax routing, YaRN, alternating sliding window) at a size the CPU backend runs in milliseconds.
// The window (16) is short so that ordinary test prompts cross it.
constexpr const char* kTinyMoe = R"({
  "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
  "vocab_size": 256, "hidden_size": 64, "intermediate_size": 32, "head_dim": 16,
  "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "num_local_experts": 8, "num_experts_per_tok": 2, "attention_bias": true, "swiglu_limit": 7.0,
  "rms_norm_eps": 1e-05, "max_position_embeddings": 1024, "sliding_window": 16,
  "layer_types": ["sliding_attention", "full_attention"],
  "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "original_max_position_embeddings": 256, "truncate": false},
  "tie_word_embeddings": false
})";

// Qwen3-MoE-shaped toy: q/k norms, softmax-then-top-k with renormalization, halves layout, no biases.
constexpr const char* kTinyQwen3Moe = R"({
  "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
  "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
  "head_dim": 16, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
  "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true, "rms_norm_eps": 1e-06,
  "max_position_embeddings": 4096, "rope_theta": 1000000.0, "tie_word_embeddings": false
})";

// Dense Llama-3-shaped toy with Llama-3 RoPE scaling and tied embeddings.
constexpr const char* kTinyLlama = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama",
  "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
  "max_position_embeddings": 4096,
  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 512},
  "rope_theta": 500000.0, "tie_word_embeddings": true
})";

struct Preset {
  const char* name;
  const char* json;
  int gpt_oss_layers = 0;   // > 0: a gpt-oss variant with this many layers ...
  int gpt_oss_experts = 0;  // ... and experts (gpt-oss-120b differs from 20b only here)
};

constexpr Preset kPresets[] = {
    {"gpt-oss-20b", kGptOss20b, 24, 32},
    {"gpt-oss-120b", kGptOss20b, 36, 128},
    {"qwen3-30b-a3b", kQwen3_30bA3b},
    {"mixtral-8x7b", kMixtral8x7b},
    {"tiny-moe", kTinyMoe},
    {"tiny-qwen3-moe", kTinyQwen3Moe},
    {"tiny-llama", kTinyLlama},
};

std::string_view strip_prefix(std::string_view name) {
  constexpr std::string_view kPrefix = "preset:";
  if (name.substr(0, kPrefix.size()) == kPrefix) name.remove_prefix(kPrefix.size());
  return name;
}

// GPT-OSS configs list layer_types explicitly; build the alternating list for the layer count.
std::string gpt_oss_text(const Preset& p) {
  std::string text = p.json;
  std::string types = "[";
  for (int i = 0; i < p.gpt_oss_layers; ++i)
    types += std::string(i ? ", " : "") + (i % 2 == 0 ? "\"sliding_attention\"" : "\"full_attention\"");
  types += "]";
  auto replace = [&](const std::string& from, const std::string& to) {
    size_t at = text.find(from);
    if (at != std::string::npos) text.replace(at, from.size(), to);
  };
  replace("\"ALTERNATE\"", types);
  replace("\"num_hidden_layers\": 24", "\"num_hidden_layers\": " + std::to_string(p.gpt_oss_layers));
  replace("\"num_local_experts\": 32", "\"num_local_experts\": " + std::to_string(p.gpt_oss_experts));
  return text;
}

uint64_t name_hash(std::string_view name) {  // FNV-1a
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : name) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

// Bytes the kernel says can be allocated without swapping (MemAvailable), or 0 when unknown.
uint64_t available_host_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit)
    if (key == "MemAvailable:") return kib * 1024;
  long pages = sysconf(_SC_AVPHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : 0;
}

// Makes the named bf16 tensors of one model; everything it allocates goes to `keep_alive`.
class WeightGenerator {
 public:
  // backend null or cpu: host tensors; otherwise the backend's memory, filled in place by its generator.
  WeightGenerator(uint64_t seed, std::vector<std::shared_ptr<void>>* keep_alive, ops::Backend* backend)
      : seed_(seed), keep_alive_(keep_alive), backend_(backend && backend->device() != Device::kCpu ? backend : nullptr) {}

  Tensor normal(const std::string& name, std::initializer_list<int64_t> dims, float stddev) {
    return fill_normal(name, allocate(dims), stddev);
  }

  // Tensors of the given row counts (and common trailing dims), generated by name as `normal` would, laid out
  // back to back in one allocation (q, k, v: the model fuses them into one product without a copy).
  std::vector<Tensor> normal_adjacent(const std::vector<std::string>& names, const std::vector<int64_t>& rows,
                                      int64_t cols, float stddev) {
    int64_t total = 0;
    for (int64_t r : rows) total += r;
    Tensor all = cols > 0 ? allocate({total, cols}) : allocate({total});
    std::vector<Tensor> parts;
    int64_t first = 0;
    for (size_t i = 0; i < rows.size(); ++i) {
      parts.push_back(fill_normal(names[i], all.rows(first, first + rows[i]), stddev));
      first += rows[i];
    }
    return parts;
  }

  Tensor fill_normal(const std::string& name, Tensor t, float stddev) {
    const uint64_t tensor_seed = mix64(seed_ ^ name_hash(name));
    if (backend_) {
      backend_->fill_generated(t, tensor_seed, stddev);
      return t;
    }
    // Chunks of the stream are fixed (kGeneratedChunk), so values do not depend on how chunks meet threads.
    const int64_t n = t.numel();
    uint16_t* out = t.ptr<uint16_t>();
    parallel_for((n + kGeneratedChunk - 1) / kGeneratedChunk, 8, [&](int64_t begin, int64_t end) {
      generate_weights_bf16(out, begin * kGeneratedChunk, std::min(n, end * kGeneratedChunk), tensor_seed, stddev);
    });
    return t;
  }

  // A host tensor's values in the generator's memory: kept as they are on the host, else copied to the device.
  Tensor place(const OwnedTensor& host) {
    if (!backend_) {
      keep_alive_->push_back(std::make_shared<Buffer>(host.buffer));
      return host.view;
    }
    OwnedTensor o = backend_->upload(host.view);
    keep_alive_->push_back(std::make_shared<Buffer>(o.buffer));
    return o.view;
  }

  // Experts [E, rows, k] as MXFP4 (make_preset_model's mxfp4_experts): the decode-layout copy and its bf16
  // dequantization, generated by the backend in place (a GPU generates GPT-OSS-20B's in well under a second)
  // or, without one, on the host; the same bytes either way (ops::GeneratedMxfp4Params).
  std::pair<Tensor, ops::Mxfp4Weight> mxfp4_experts(const std::string& name, int64_t experts, int64_t rows, int64_t k,
                                                     float stddev) {
    // Uniform E2M1 codes have an rms of ~2.93: exponents around 127 + log2(stddev / 2.93), spread over three.
    const int centre = 127 + int(std::lround(std::log2(stddev / 2.93f)));
    const int scale_lo = std::clamp(centre - 1, 0, ops::mxfp4::kMaxDecodeScale - 2);
    const uint64_t seed = mix64(seed_ ^ name_hash(name + "_blocks"));
    if (backend_) {
      const int64_t tiles = k / ops::mxfp4::kTileK;
      const ops::GeneratedMxfp4Params p{
          .weight = {.blocks = allocate(DType::U8, {experts, tiles, rows, ops::mxfp4::kTileBytes}),
                     .scales = allocate(DType::U8, {experts, tiles, rows, 2})},
          .values = allocate(DType::BF16, {experts, rows, k}),
          .seed = seed,
          .scale_lo = scale_lo};
      backend_->fill_generated_mxfp4(p);
      return {p.values, p.weight};
    }
    Mxfp4Decode q = generate_mxfp4_decode(experts, rows, k, seed, scale_lo);
    Result<OwnedTensor> values = dequantize_mxfp4_decode(q.blocks, q.scales, name);
    LMX_CHECK(values.ok());
    const Tensor bf16 = place(*values);
    return {bf16, ops::Mxfp4Weight{.blocks = place(q.blocks), .scales = place(q.scales)}};
  }

  Tensor ones(std::initializer_list<int64_t> dims) {
    OwnedTensor host = OwnedTensor::host(DType::BF16, dims);
    const uint16_t one = f32_to_bf16(1.0f).bits;
    std::fill(host.view.ptr<uint16_t>(), host.view.ptr<uint16_t>() + host.view.numel(), one);
    if (!backend_) {
      keep_alive_->push_back(std::make_shared<Buffer>(host.buffer));
      return host.view;
    }
    Tensor t = allocate(dims);
    backend_->copy(t, host.view);
    return t;
  }

 private:
  Tensor allocate(std::initializer_list<int64_t> dims) { return allocate(DType::BF16, dims); }
  Tensor allocate(DType dtype, std::initializer_list<int64_t> dims) {
    OwnedTensor o = backend_ ? backend_->empty(dtype, dims) : OwnedTensor::host(dtype, dims);
    keep_alive_->push_back(std::make_shared<Buffer>(o.buffer));
    return o.view;
  }
  uint64_t seed_;
  std::vector<std::shared_ptr<void>>* keep_alive_;
  ops::Backend* backend_;
};

}  // namespace

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const auto& p : kPresets) names.emplace_back(p.name);
  return names;
}

Result<ModelConfig> preset_config(std::string_view name) {
  const std::string_view bare = strip_prefix(name);
  for (const auto& p : kPresets) {
    if (bare != p.name) continue;
    const std::string text = p.gpt_oss_layers > 0 ? gpt_oss_text(p) : std::string(p.json);
    return parse_model_config(text, "preset:" + std::string(p.name));
  }
  std::string known;
  for (const auto& p : kPresets) known += (known.empty() ? "" : ", ") + std::string(p.name);
  return not_found("unknown preset '" + std::string(name) + "' (known: " + known + ")");
}

uint64_t weight_bytes(const ModelConfig& c, bool mxfp4_experts) {
  const uint64_t V = uint64_t(c.vocab_size), H = uint64_t(c.hidden_size), D = uint64_t(c.head_dim);
  const uint64_t Hq = uint64_t(c.num_heads), Hkv = uint64_t(c.num_kv_heads), E = uint64_t(c.num_experts);
  uint64_t per_layer = 2 * H + 2 * Hq * D * H + 2 * Hkv * D * H;
  if (c.attention_bias) per_layer += Hq * D + 2 * Hkv * D + H;
  if (c.qk_norm) per_layer += 2 * D;
  if (c.attention_sinks) per_layer += Hq;
  if (c.is_moe()) {
    const uint64_t I = uint64_t(c.moe_intermediate_size);
    per_layer += E * H + 3 * E * I * H;
    if (c.router_bias) per_layer += E;
    if (c.expert_bias) per_layer += E * (2 * I + H);
  } else {
    per_layer += 3 * uint64_t(c.intermediate_size) * H;
  }
  const uint64_t elements = V * H * (c.tie_word_embeddings ? 1 : 2) + H + per_layer * uint64_t(c.num_layers);
  uint64_t bytes = elements * 2;
  if (mxfp4_experts && c.is_moe()) {  // 17 bytes per 32 values: codes and one exponent per group
    bytes += 3 * E * uint64_t(c.moe_intermediate_size) * H / 32 * 17 * uint64_t(c.num_layers);
  }
  return bytes;
}

Result<ModelWeights> make_random_weights(const ModelConfig& c, uint64_t seed, ops::Backend* backend, bool mxfp4_experts) {
  if (mxfp4_experts) {
    if (c.family != Family::kGptOss) {
      return invalid_argument("--mxfp4-experts: only GPT-OSS models have MXFP4 experts, this is " +
                              std::string(family_name(c.family)));
    }
    if (c.hidden_size % ops::mxfp4::kTileK != 0 || c.moe_intermediate_size % ops::mxfp4::kTileK != 0) {
      return invalid_argument("--mxfp4-experts: the MXFP4 decode layout needs hidden_size and intermediate_size "
                              "multiples of 64, found " + std::to_string(c.hidden_size) + " and " +
                              std::to_string(c.moe_intermediate_size));
    }
  }
  const bool on_device = backend && backend->device() != Device::kCpu;
  const uint64_t need = weight_bytes(c, mxfp4_experts);
  const uint64_t have = on_device ? backend->available_bytes() : available_host_bytes();
  if (have > 0 && need > have)
    return out_of_range("generated weights for this " + std::string(family_name(c.family)) + " model need " +
                        std::to_string(need >> 20) + " MiB of " + (on_device ? "device" : "host") + " memory, " +
                        std::to_string(have >> 20) + " MiB available");
  ModelWeights w;
  w.config = c;
  WeightGenerator gen(seed, &w.keep_alive, backend);
  const int64_t V = c.vocab_size, H = c.hidden_size, D = c.head_dim, Hq = c.num_heads, Hkv = c.num_kv_heads;
  const int64_t E = c.num_experts;
  const float bias_std = 0.02f;
  auto fan_in = [](int64_t n) { return 1.0f / std::sqrt(float(n)); };

  w.embed = gen.normal("model.embed_tokens.weight", {V, H}, 1.0f);
  w.final_norm = gen.ones({H});
  w.lm_head = c.tie_word_embeddings ? w.embed : gen.normal("lm_head.weight", {V, H}, fan_in(H));
  w.layers.resize(size_t(c.num_layers));
  for (int layer = 0; layer < c.num_layers; ++layer) {
    LayerWeights& l = w.layers[size_t(layer)];
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    l.input_norm = gen.ones({H});
    l.post_attention_norm = gen.ones({H});
    const std::vector<Tensor> qkv = gen.normal_adjacent(
        {p + "self_attn.q_proj.weight", p + "self_attn.k_proj.weight", p + "self_attn.v_proj.weight"},
        {Hq * D, Hkv * D, Hkv * D}, H, fan_in(H));
    l.q = qkv[0], l.k = qkv[1], l.v = qkv[2];
    l.o = gen.normal(p + "self_attn.o_proj.weight", {H, Hq * D}, fan_in(Hq * D));
    if (c.attention_bias) {
      const std::vector<Tensor> qkv_bias = gen.normal_adjacent(
          {p + "self_attn.q_proj.bias", p + "self_attn.k_proj.bias", p + "self_attn.v_proj.bias"},
          {Hq * D, Hkv * D, Hkv * D}, 0, bias_std);
      l.q_bias = qkv_bias[0], l.k_bias = qkv_bias[1], l.v_bias = qkv_bias[2];
      l.o_bias = gen.normal(p + "self_attn.o_proj.bias", {H}, bias_std);
    }
    if (c.qk_norm) {
      l.q_norm = gen.ones({D});
      l.k_norm = gen.ones({D});
    }
    if (c.attention_sinks) l.sinks = gen.normal(p + "self_attn.sinks", {Hq}, 1.0f);
    if (c.is_moe()) {
      const int64_t I = c.moe_intermediate_size;
      l.router = gen.normal(p + "mlp.router.weight", {E, H}, fan_in(H));
      if (c.router_bias) l.router_bias = gen.normal(p + "mlp.router.bias", {E}, bias_std);
      if (mxfp4_experts) {
        std::tie(l.gate_up, l.gate_up_mxfp4) = gen.mxfp4_experts(p + "mlp.experts.gate_up_proj", E, 2 * I, H, fan_in(H));
        std::tie(l.down, l.down_mxfp4) = gen.mxfp4_experts(p + "mlp.experts.down_proj", E, H, I, fan_in(I));
      } else {
        l.gate_up = gen.normal(p + "mlp.experts.gate_up_proj", {E, 2 * I, H}, fan_in(H));
        l.down = gen.normal(p + "mlp.experts.down_proj", {E, H, I}, fan_in(I));
      }
      if (c.expert_bias) {
        l.gate_up_bias = gen.normal(p + "mlp.experts.gate_up_proj_bias", {E, 2 * I}, bias_std);
        l.down_bias = gen.normal(p + "mlp.experts.down_proj_bias", {E, H}, bias_std);
      }
    } else {
      const int64_t I = c.intermediate_size;
      l.mlp_gate = gen.normal(p + "mlp.gate_proj.weight", {I, H}, fan_in(H));
      l.mlp_up = gen.normal(p + "mlp.up_proj.weight", {I, H}, fan_in(H));
      l.mlp_down = gen.normal(p + "mlp.down_proj.weight", {H, I}, fan_in(I));
    }
  }
  return w;
}

Result<ModelWeights> make_preset_model(std::string_view name, uint64_t seed, int vocab_size, ops::Backend* backend,
                                       bool mxfp4_experts) {
  LMX_ASSIGN_OR_RETURN(ModelConfig config, preset_config(name));
  if (vocab_size < 0)
    return invalid_argument("preset '" + std::string(strip_prefix(name)) + "': vocab_size must be positive, got " +
                            std::to_string(vocab_size));
  if (vocab_size > 0) {
    config.vocab_size = vocab_size;
    std::erase_if(config.eos_token_ids, [&](int id) { return id >= vocab_size; });
    if (config.bos_token_id >= vocab_size) config.bos_token_id = -1;
  }
  auto weights = make_random_weights(config, seed, backend, mxfp4_experts);
  if (!weights.ok()) return weights.status().with_context("preset '" + std::string(strip_prefix(name)) + "'");
  return weights;
}

}  // namespace lmx::model
