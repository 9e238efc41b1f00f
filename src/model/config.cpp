// config.json -> ModelConfig for the five supported architectures, following transformers' config classes
// (defaults per family, v4 `rope_scaling`/`rope_theta` and v5 `rope_parameters`), and the reverse
// (model_config_to_json) for test fixtures and `inspect`. Shapes are validated here; tensors are not.
#include "model/config.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <filesystem>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "io/safetensors.h"

namespace lmx::model {
namespace {

using json = nlohmann::json;

// Defaults that differ by family: transformers' config class attributes (configuration_*.py).
struct FamilyDefaults {
  double rope_theta;
  float rms_norm_eps;
  int max_position_embeddings;
  bool attention_bias;
  int head_dim;  // when config.json has no head_dim; 0 = hidden_size / num_attention_heads
  int bos_token_id, eos_token_id;  // when config.json has no such key; -1 = none
  const char* model_type;
};

FamilyDefaults defaults_for(Family family) {
  switch (family) {
    case Family::kGptOss: return {150000.0, 1e-5f, 131072, true, 64, -1, -1, "gpt_oss"};
    case Family::kQwen3Moe: return {10000.0, 1e-6f, 32768, false, 0, -1, -1, "qwen3_moe"};
    case Family::kMixtral: return {1000000.0, 1e-5f, 4096 * 32, false, 0, 1, 2, "mixtral"};
    case Family::kQwen3: return {10000.0, 1e-6f, 32768, false, 128, -1, -1, "qwen3"};
    case Family::kLlama: return {10000.0, 1e-6f, 2048, false, 0, 1, 2, "llama"};
  }
  return {10000.0, 1e-6f, 2048, false, 0, 1, 2, "llama"};
}

struct ArchitectureName {
  const char* architecture;
  const char* model_type;
  Family family;
};
constexpr ArchitectureName kArchitectures[] = {
    {"GptOssForCausalLM", "gpt_oss", Family::kGptOss},
    {"Qwen3MoeForCausalLM", "qwen3_moe", Family::kQwen3Moe},
    {"MixtralForCausalLM", "mixtral", Family::kMixtral},
    {"Qwen3ForCausalLM", "qwen3", Family::kQwen3},
    {"LlamaForCausalLM", "llama", Family::kLlama},
};

// A JSON value for an error message, bounded (dump() of a huge or deeply nested value is not).
std::string brief(const json& v) {
  if (v.is_array() && v.size() > 8) return "a list of " + std::to_string(v.size());
  if (v.is_object()) return "an object";
  std::string text = v.is_array() ? "[...]" : v.dump();
  if (v.is_array()) {
    bool flat = true;
    for (const json& e : v) flat = flat && e.is_primitive();
    if (flat) text = v.dump();
  }
  if (text.size() > 80) text = text.substr(0, 76) + "...";
  return text;
}

std::string supported_list() {
  std::string s;
  for (const auto& a : kArchitectures) s += (s.empty() ? "" : ", ") + std::string(a.architecture);
  return s;
}

// Typed access to config.json fields with errors that name the field and the file. A JSON null counts as
// absent, as it does for transformers (e.g. Mixtral's "sliding_window": null).
class Fields {
 public:
  Fields(const json& object, std::string source) : j_(object), source_(std::move(source)) {}

  const std::string& source() const { return source_; }
  bool has(const char* name) const {
    auto it = j_.find(name);
    return it != j_.end() && !it->is_null();
  }
  const json* find(const char* name) const {
    auto it = j_.find(name);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  Status error(const std::string& field, const std::string& what) const {
    return invalid_argument(source_ + ": field '" + field + "': " + what);
  }
  Status missing(const std::string& field) const {
    return invalid_argument(source_ + ": missing required field '" + field + "'");
  }

  // Integer field >= min_value; `fallback` when absent (nullopt = required).
  Result<int> integer(const char* name, std::optional<int> fallback, int min_value = 1) const {
    const json* v = find(name);
    if (v == nullptr) {
      if (!fallback) return missing(name);
      return *fallback;
    }
    return integer_value(name, *v, min_value);
  }
  Result<int> integer_value(const std::string& name, const json& v, int min_value) const {
    // Integral floats (4096.0) are accepted: some exporters write every number as a float.
    double d = 0.0;
    if (v.is_number_integer() || v.is_number_unsigned()) {
      d = v.get<double>();
    } else if (v.is_number_float() && std::floor(v.get<double>()) == v.get<double>()) {
      d = v.get<double>();
    } else {
      return error(name, "expected an integer, found " + brief(v));
    }
    if (d < double(min_value) || d > 2147483647.0)
      return error(name, "expected an integer >= " + std::to_string(min_value) + ", found " + brief(v));
    return int(d);
  }
  Result<double> number(const char* name, std::optional<double> fallback) const {
    const json* v = find(name);
    if (v == nullptr) {
      if (!fallback) return missing(name);
      return *fallback;
    }
    if (!v->is_number()) return error(name, "expected a number, found " + brief(*v));
    return v->get<double>();
  }
  Result<bool> boolean(const char* name, bool fallback) const {
    const json* v = find(name);
    if (v == nullptr) return fallback;
    if (!v->is_boolean()) return error(name, "expected true or false, found " + brief(*v));
    return v->get<bool>();
  }
  Result<std::string> string(const char* name, std::optional<std::string> fallback) const {
    const json* v = find(name);
    if (v == nullptr) {
      if (!fallback) return missing(name);
      return *fallback;
    }
    if (!v->is_string()) return error(name, "expected a string, found " + brief(*v));
    return v->get<std::string>();
  }

 private:
  const json& j_;
  std::string source_;
};

Result<Family> family_of(const Fields& f, std::string* architecture) {
  if (const json* archs = f.find("architectures")) {
    if (!archs->is_array() || archs->empty() || !(*archs)[0].is_string())
      return f.error("architectures", "expected a non-empty list of strings, found " + brief(*archs));
    *architecture = (*archs)[0].get<std::string>();
    for (const auto& a : kArchitectures)
      if (*architecture == a.architecture) return a.family;
    return unsupported(f.source() + ": architecture '" + *architecture + "' is not supported (supported: " +
                       supported_list() + ")");
  }
  // No `architectures` (some hand-written configs): fall back to model_type.
  if (const json* type = f.find("model_type")) {
    if (type->is_string()) {
      for (const auto& a : kArchitectures) {
        if (type->get<std::string>() == a.model_type) {
          *architecture = a.architecture;
          return a.family;
        }
      }
    }
    return unsupported(f.source() + ": model_type " + brief(*type) + " is not supported (supported: " + supported_list() +
                       ")");
  }
  return f.missing("architectures");
}

// RoPE, after transformers' RotaryEmbeddingConfigMixin: rope_scaling (v4) wins over rope_parameters (v5);
// rope_theta comes from the dict, else the top-level field, else the family default; the type from
// `rope_type`, else the legacy `type`, else "default".
Status parse_rope(const Fields& top, Family family, int max_position, ops::RopeScaling* rope) {
  const char* field = "rope_parameters";
  const json* params = nullptr;
  if (const json* scaling = top.find("rope_scaling")) {
    params = scaling;
    field = "rope_scaling";
  } else if (const json* p = top.find("rope_parameters")) {
    params = p;
  }
  json gpt_oss_default;
  if (params == nullptr && family == Family::kGptOss) {
    // GptOssConfig.__post_init__ fills this in when the config has no rope parameters at all.
    gpt_oss_default = {{"rope_type", "yarn"}, {"factor", 32.0}, {"beta_fast", 32.0}, {"beta_slow", 1.0},
                       {"truncate", false}, {"original_max_position_embeddings", 4096}};
    params = &gpt_oss_default;
  }
  json empty = json::object();
  if (params == nullptr) params = &empty;
  if (!params->is_object()) return top.error(field, "expected an object, found " + brief(*params));
  // A dict keyed by layer type ({"full_attention": {...}, "sliding_attention": {...}}) is per-layer RoPE.
  for (const char* key : {"full_attention", "sliding_attention"})
    if (params->contains(key))
      return unsupported(top.source() + ": field '" + field + "': per-layer-type RoPE parameters are not supported");

  Fields p(*params, top.source());
  auto sub = [&](const std::string& name) { return std::string(field) + "." + name; };

  // rope_theta
  const double default_theta = defaults_for(family).rope_theta;
  LMX_ASSIGN_OR_RETURN(double top_theta, top.number("rope_theta", default_theta));
  const json* theta_v = p.find("rope_theta");
  double theta = top_theta;
  if (theta_v != nullptr) {
    if (!theta_v->is_number()) return top.error(sub("rope_theta"), "expected a number, found " + brief(*theta_v));
    theta = theta_v->get<double>();
  }
  if (!(theta > 0.0)) return top.error(p.has("rope_theta") ? sub("rope_theta") : "rope_theta", "must be positive");
  rope->theta = theta;

  std::string type = "default";
  for (const char* key : {"rope_type", "type"}) {
    if (const json* t = p.find(key)) {
      if (!t->is_string()) return top.error(sub(key), "expected a string, found " + brief(*t));
      type = t->get<std::string>();
      break;
    }
  }
  // partial_rotary_factor may sit in the dict or at the top level.
  for (const Fields* where : {static_cast<const Fields*>(&p), &top}) {
    if (const json* prf = where->find("partial_rotary_factor")) {
      if (!prf->is_number() || prf->get<double>() != 1.0)
        return unsupported(top.source() + ": partial_rotary_factor " + brief(*prf) +
                           " is not supported (rotary dim must equal head_dim)");
    }
  }

  // original_max_position_embeddings: top-level field first (as transformers does for Phi-3-style configs),
  // then the dict, then max_position_embeddings.
  auto original_max = [&]() -> Result<int> {
    if (top.has("original_max_position_embeddings")) return top.integer("original_max_position_embeddings", std::nullopt);
    if (const json* v = p.find("original_max_position_embeddings"))
      return top.integer_value(sub("original_max_position_embeddings"), *v, 1);
    return max_position;
  };
  auto sub_number = [&](const char* name, std::optional<double> fallback) -> Result<double> {
    const json* v = p.find(name);
    if (v == nullptr) {
      if (!fallback) return top.missing(sub(name));
      return *fallback;
    }
    if (!v->is_number()) return top.error(sub(name), "expected a number, found " + brief(*v));
    return v->get<double>();
  };

  if (type == "default") {
    rope->type = ops::RopeScaling::Type::kDefault;
    return Status::Ok();
  }
  if (type == "yarn") {
    rope->type = ops::RopeScaling::Type::kYarn;
    LMX_ASSIGN_OR_RETURN(rope->original_max_position, original_max());
    if (p.has("factor")) {
      LMX_ASSIGN_OR_RETURN(rope->factor, sub_number("factor", std::nullopt));
    } else {
      rope->factor = double(max_position) / double(rope->original_max_position);
    }
    if (!(rope->factor > 0.0)) return top.error(sub("factor"), "must be positive");
    // transformers: `beta_fast = get("beta_fast") or 32` — a 0 also means the default.
    LMX_ASSIGN_OR_RETURN(double beta_fast, sub_number("beta_fast", 32.0));
    LMX_ASSIGN_OR_RETURN(double beta_slow, sub_number("beta_slow", 1.0));
    rope->beta_fast = beta_fast != 0.0 ? beta_fast : 32.0;
    rope->beta_slow = beta_slow != 0.0 ? beta_slow : 1.0;
    LMX_ASSIGN_OR_RETURN(rope->truncate, p.boolean("truncate", true));
    auto get_mscale = [](double scale, double mscale) { return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0; };
    if (p.has("attention_factor")) {
      LMX_ASSIGN_OR_RETURN(rope->attention_factor, sub_number("attention_factor", std::nullopt));
    } else {
      LMX_ASSIGN_OR_RETURN(double mscale, sub_number("mscale", 0.0));
      LMX_ASSIGN_OR_RETURN(double mscale_all_dim, sub_number("mscale_all_dim", 0.0));
      rope->attention_factor = (mscale != 0.0 && mscale_all_dim != 0.0)
                                   ? get_mscale(rope->factor, mscale) / get_mscale(rope->factor, mscale_all_dim)
                                   : get_mscale(rope->factor, 1.0);
    }
    return Status::Ok();
  }
  if (type == "llama3") {
    rope->type = ops::RopeScaling::Type::kLlama3;
    LMX_ASSIGN_OR_RETURN(rope->original_max_position, original_max());
    LMX_ASSIGN_OR_RETURN(rope->factor, sub_number("factor", std::nullopt));
    LMX_ASSIGN_OR_RETURN(rope->low_freq_factor, sub_number("low_freq_factor", std::nullopt));
    LMX_ASSIGN_OR_RETURN(rope->high_freq_factor, sub_number("high_freq_factor", std::nullopt));
    if (!(rope->factor > 0.0)) return top.error(sub("factor"), "must be positive");
    if (!(rope->high_freq_factor > rope->low_freq_factor) || !(rope->low_freq_factor > 0.0))
      return top.error(sub("high_freq_factor"), "must exceed low_freq_factor, and both must be positive");
    return Status::Ok();
  }
  return unsupported(top.source() + ": field '" + sub("rope_type") + "': RoPE type '" + type +
                     "' is not supported (supported: default, yarn, llama3)");
}

Result<std::vector<int>> token_ids(const Fields& f, const char* name) {
  std::vector<int> ids;
  const json* v = f.find(name);
  if (v == nullptr) return ids;
  if (v->is_array()) {
    for (const json& e : *v) {
      LMX_ASSIGN_OR_RETURN(int id, f.integer_value(name, e, 0));
      ids.push_back(id);
    }
    return ids;
  }
  LMX_ASSIGN_OR_RETURN(int id, f.integer_value(name, *v, 0));
  ids.push_back(id);
  return ids;
}

// The expert count: transformers maps `num_experts` and `num_local_experts` onto one attribute
// (attribute_map), and its v5 save_pretrained writes `num_local_experts` even for Qwen3-MoE, whose
// published configs say `num_experts`. Either is accepted; both must then agree.
Result<int> expert_count(const Fields& f, int fallback, int min_value) {
  const bool local = f.has("num_local_experts"), plain = f.has("num_experts");
  if (local && plain) {
    LMX_ASSIGN_OR_RETURN(int a, f.integer("num_local_experts", std::nullopt, min_value));
    LMX_ASSIGN_OR_RETURN(int b, f.integer("num_experts", std::nullopt, min_value));
    if (a != b)
      return f.error("num_local_experts", std::to_string(a) + " disagrees with num_experts " + std::to_string(b));
    return a;
  }
  return f.integer(local ? "num_local_experts" : "num_experts", fallback, min_value);
}

// layer_types: a list of "sliding_attention" / "full_attention", one per layer.
Result<std::vector<bool>> layer_types(const Fields& f, int num_layers) {
  const json* v = f.find("layer_types");
  if (v == nullptr) return std::vector<bool>();
  if (!v->is_array()) return f.error("layer_types", "expected a list, found " + brief(*v));
  if (int(v->size()) != num_layers)
    return f.error("layer_types", "expected " + std::to_string(num_layers) + " entries (num_hidden_layers), found " +
                                      std::to_string(v->size()));
  std::vector<bool> sliding;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& e = (*v)[i];
    if (e == "sliding_attention") {
      sliding.push_back(true);
    } else if (e == "full_attention") {
      sliding.push_back(false);
    } else {
      return f.error("layer_types[" + std::to_string(i) + "]",
                     "expected \"sliding_attention\" or \"full_attention\", found " + brief(e));
    }
  }
  return sliding;
}

// The shortest decimal that reads back as the same float (1e-05, not 9.999999747378752e-06), so written
// configs look like Hugging Face's and give transformers the same value.
double shortest(float value) {
  char text[32];
  for (int digits = 6; digits <= 9; ++digits) {
    std::snprintf(text, sizeof(text), "%.*g", digits, double(value));
    double d = std::strtod(text, nullptr);
    if (float(d) == value) return d;
  }
  return double(value);
}

}  // namespace

std::string_view family_name(Family family) {
  switch (family) {
    case Family::kGptOss: return "gpt_oss";
    case Family::kQwen3Moe: return "qwen3_moe";
    case Family::kMixtral: return "mixtral";
    case Family::kQwen3: return "qwen3";
    case Family::kLlama: return "llama";
  }
  return "?";
}

Result<ModelConfig> parse_model_config(const std::string& json_text, const std::string& source) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    return invalid_argument(source + ": not valid JSON: " + e.what());
  }
  if (!root.is_object()) return invalid_argument(source + ": expected a JSON object, found " + std::string(root.type_name()));
  Fields f(root, source);

  ModelConfig c;
  LMX_ASSIGN_OR_RETURN(c.family, family_of(f, &c.architecture));
  const FamilyDefaults defaults = defaults_for(c.family);
  const bool gpt_oss = c.family == Family::kGptOss;

  if (const json* q = f.find("quantization_config")) {
    // GPT-OSS ships MXFP4 experts, which the loader dequantizes; other schemes are not implemented.
    std::string method = q->is_object() && q->contains("quant_method") ? brief(q->at("quant_method")) : brief(*q);
    if (!(gpt_oss && q->is_object() && q->value("quant_method", json()) == "mxfp4"))
      return unsupported(source + ": field 'quantization_config': quantization " + method +
                         " is not supported (only GPT-OSS mxfp4 experts)");
    c.mxfp4_checkpoint = true;
  }
  LMX_ASSIGN_OR_RETURN(std::string act, f.string("hidden_act", std::string("silu")));
  if (act != "silu") return unsupported(source + ": field 'hidden_act': activation '" + act + "' is not supported (silu)");

  LMX_ASSIGN_OR_RETURN(c.vocab_size, f.integer("vocab_size", std::nullopt));
  LMX_ASSIGN_OR_RETURN(c.hidden_size, f.integer("hidden_size", std::nullopt));
  LMX_ASSIGN_OR_RETURN(c.num_layers, f.integer("num_hidden_layers", std::nullopt));
  LMX_ASSIGN_OR_RETURN(c.num_heads, f.integer("num_attention_heads", std::nullopt));
  LMX_ASSIGN_OR_RETURN(c.num_kv_heads, f.integer("num_key_value_heads", c.num_heads));
  if (c.num_heads % c.num_kv_heads != 0)
    return f.error("num_key_value_heads", "num_attention_heads " + std::to_string(c.num_heads) +
                                              " is not a multiple of num_key_value_heads " + std::to_string(c.num_kv_heads));
  if (f.has("head_dim")) {
    LMX_ASSIGN_OR_RETURN(c.head_dim, f.integer("head_dim", std::nullopt));
  } else if (defaults.head_dim > 0 && !root.contains("head_dim")) {
    c.head_dim = defaults.head_dim;  // GptOssConfig / Qwen3Config class defaults, not hidden/heads
  } else {
    if (c.hidden_size % c.num_heads != 0)
      return f.error("head_dim", "absent, and hidden_size " + std::to_string(c.hidden_size) +
                                     " is not a multiple of num_attention_heads " + std::to_string(c.num_heads));
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.head_dim % 2 != 0) return f.error("head_dim", "must be even for rotary embeddings, found " + std::to_string(c.head_dim));
  LMX_ASSIGN_OR_RETURN(double eps, f.number("rms_norm_eps", double(defaults.rms_norm_eps)));
  if (!(eps > 0.0)) return f.error("rms_norm_eps", "must be positive");
  c.rms_norm_eps = float(eps);
  LMX_ASSIGN_OR_RETURN(c.max_position_embeddings, f.integer("max_position_embeddings", defaults.max_position_embeddings));
  LMX_ASSIGN_OR_RETURN(c.tie_word_embeddings, f.boolean("tie_word_embeddings", false));
  // eos may be one id or a list; an absent key takes the config class default, an explicit null means none.
  LMX_ASSIGN_OR_RETURN(c.eos_token_ids, token_ids(f, "eos_token_id"));
  if (!root.contains("eos_token_id") && defaults.eos_token_id >= 0) c.eos_token_ids = {defaults.eos_token_id};
  LMX_ASSIGN_OR_RETURN(std::vector<int> bos, token_ids(f, "bos_token_id"));
  if (bos.size() > 1) return f.error("bos_token_id", "expected one id, found " + std::to_string(bos.size()));
  c.bos_token_id = bos.empty() ? -1 : bos[0];
  if (!root.contains("bos_token_id")) c.bos_token_id = defaults.bos_token_id;
  LMX_ASSIGN_OR_RETURN(c.attention_bias, f.boolean("attention_bias", defaults.attention_bias));

  // Feed-forward and routing per family.
  switch (c.family) {
    case Family::kGptOss: {
      LMX_ASSIGN_OR_RETURN(c.intermediate_size, f.integer("intermediate_size", std::nullopt));
      LMX_ASSIGN_OR_RETURN(c.num_experts, expert_count(f, 128, 1));
      const char* topk_field = f.has("num_experts_per_tok") ? "num_experts_per_tok" : "experts_per_token";
      LMX_ASSIGN_OR_RETURN(c.experts_per_token, f.integer(topk_field, 4));
      c.moe_intermediate_size = c.intermediate_size;
      c.routing = ops::RoutingRule::kTopKThenSoftmax;
      c.norm_topk_prob = false;  // softmax over the k chosen logits already sums to 1
      c.moe_activation = ops::MoeActivation::kGptOssClamped;
      c.gate_up_layout = ops::GateUpLayout::kInterleaved;
      LMX_ASSIGN_OR_RETURN(double alpha, f.number("swiglu_alpha", 1.702));
      LMX_ASSIGN_OR_RETURN(double limit, f.number("swiglu_limit", 7.0));
      if (!(limit > 0.0)) return f.error("swiglu_limit", "must be positive");
      c.swiglu_alpha = float(alpha);
      c.swiglu_limit = float(limit);
      c.router_bias = true;
      c.expert_bias = true;
      c.attention_sinks = true;
      break;
    }
    case Family::kQwen3Moe: {
      LMX_ASSIGN_OR_RETURN(c.num_experts, expert_count(f, 128, 0));
      if (c.num_experts == 0)
        return unsupported(source + ": field 'num_experts': 0 (a Qwen3-MoE config without experts) is not supported");
      LMX_ASSIGN_OR_RETURN(c.experts_per_token, f.integer("num_experts_per_tok", 8));
      LMX_ASSIGN_OR_RETURN(c.moe_intermediate_size, f.integer("moe_intermediate_size", 768));
      LMX_ASSIGN_OR_RETURN(c.intermediate_size, f.integer("intermediate_size", 6144));
      LMX_ASSIGN_OR_RETURN(c.norm_topk_prob, f.boolean("norm_topk_prob", false));
      // Layers where Qwen3MoeDecoderLayer builds a dense MLP instead of the MoE block.
      LMX_ASSIGN_OR_RETURN(int step, f.integer("decoder_sparse_step", 1));
      std::set<int> mlp_only;
      if (const json* v = f.find("mlp_only_layers")) {
        if (!v->is_array()) return f.error("mlp_only_layers", "expected a list of layer indices, found " + brief(*v));
        for (const json& e : *v) {
          LMX_ASSIGN_OR_RETURN(int layer, f.integer_value("mlp_only_layers", e, 0));
          mlp_only.insert(layer);
        }
      }
      for (int layer = 0; layer < c.num_layers; ++layer) {
        if (mlp_only.count(layer) || (layer + 1) % step != 0) {
          const char* field = mlp_only.count(layer) ? "mlp_only_layers" : "decoder_sparse_step";
          return unsupported(source + ": field '" + field + "': layer " + std::to_string(layer) +
                             " would be a dense MLP; mixed dense/MoE Qwen3-MoE models are not supported");
        }
      }
      c.routing = ops::RoutingRule::kSoftmaxThenTopK;
      c.qk_norm = true;
      break;
    }
    case Family::kMixtral: {
      LMX_ASSIGN_OR_RETURN(c.intermediate_size, f.integer("intermediate_size", 14336));
      LMX_ASSIGN_OR_RETURN(c.num_experts, expert_count(f, 8, 1));
      LMX_ASSIGN_OR_RETURN(c.experts_per_token, f.integer("num_experts_per_tok", 2));
      c.moe_intermediate_size = c.intermediate_size;
      c.routing = ops::RoutingRule::kSoftmaxThenTopK;
      c.norm_topk_prob = true;  // MixtralTopKRouter always renormalizes the top-k
      c.attention_bias = false;  // MixtralAttention has no biases whatever the config says
      break;
    }
    case Family::kQwen3:
    case Family::kLlama: {
      LMX_ASSIGN_OR_RETURN(c.intermediate_size, f.integer("intermediate_size", std::nullopt));
      c.qk_norm = c.family == Family::kQwen3;
      if (c.family == Family::kLlama) {
        LMX_ASSIGN_OR_RETURN(bool mlp_bias, f.boolean("mlp_bias", false));
        if (mlp_bias) return unsupported(source + ": field 'mlp_bias': true is not supported (MLP without biases only)");
      }
      break;
    }
  }
  if (c.is_moe() && c.experts_per_token > c.num_experts)
    return invalid_argument(source + ": field 'num_experts_per_tok': " + std::to_string(c.experts_per_token) +
                            " exceeds the number of experts " + std::to_string(c.num_experts));

  // Sliding-window attention: which layers, and the window.
  LMX_ASSIGN_OR_RETURN(std::vector<bool> declared, layer_types(f, c.num_layers));
  int window = 0;
  if (f.has("sliding_window")) {
    LMX_ASSIGN_OR_RETURN(window, f.integer("sliding_window", std::nullopt, 0));
  }
  c.layer_sliding.assign(size_t(c.num_layers), false);
  switch (c.family) {
    case Family::kGptOss:
      // Default pattern (GptOssConfig): even layers sliding, odd layers full.
      if (!root.contains("sliding_window")) window = 128;
      for (int i = 0; i < c.num_layers; ++i) c.layer_sliding[size_t(i)] = declared.empty() ? (i % 2 == 0) : bool(declared[size_t(i)]);
      break;
    case Family::kQwen3: {
      LMX_ASSIGN_OR_RETURN(bool use, f.boolean("use_sliding_window", false));
      if (!use) window = 0;
      LMX_ASSIGN_OR_RETURN(int max_window_layers, f.integer("max_window_layers", 28, 0));
      for (int i = 0; i < c.num_layers; ++i)
        c.layer_sliding[size_t(i)] = declared.empty() ? (window > 0 && i >= max_window_layers) : bool(declared[size_t(i)]);
      break;
    }
    case Family::kQwen3Moe: {
      LMX_ASSIGN_OR_RETURN(bool use, f.boolean("use_sliding_window", false));
      if (!use) window = 0;
      c.layer_sliding.assign(size_t(c.num_layers), true);
      break;
    }
    case Family::kMixtral:
      c.layer_sliding.assign(size_t(c.num_layers), true);
      break;
    case Family::kLlama:
      window = 0;
      break;
  }
  if (window == 0) c.layer_sliding.assign(size_t(c.num_layers), false);
  bool any_sliding = false;
  for (bool s : c.layer_sliding) any_sliding = any_sliding || s;
  c.sliding_window = any_sliding ? window : 0;

  LMX_RETURN_IF_ERROR(parse_rope(f, c.family, c.max_position_embeddings, &c.rope));
  return c;
}

Result<ModelConfig> load_model_config(const std::string& model_dir) {
  const std::string path = (std::filesystem::path(model_dir) / "config.json").string();
  LMX_ASSIGN_OR_RETURN(std::string text, io::read_text_file(path));
  return parse_model_config(text, path);
}

std::string model_config_to_json(const ModelConfig& c) {
  json j;
  j["architectures"] = {c.architecture.empty() ? [&] {
    for (const auto& a : kArchitectures)
      if (a.family == c.family) return std::string(a.architecture);
    return std::string();
  }() : c.architecture};
  j["model_type"] = defaults_for(c.family).model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = shortest(c.rms_norm_eps);
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = "bfloat16";
  j["dtype"] = "bfloat16";
  if (c.eos_token_ids.size() == 1) {
    j["eos_token_id"] = c.eos_token_ids[0];
  } else if (!c.eos_token_ids.empty()) {
    j["eos_token_id"] = c.eos_token_ids;
  } else {
    j["eos_token_id"] = nullptr;
  }
  j["bos_token_id"] = c.bos_token_id >= 0 ? json(c.bos_token_id) : json(nullptr);
  j["attention_bias"] = c.attention_bias;

  switch (c.family) {
    case Family::kGptOss:
      j["intermediate_size"] = c.moe_intermediate_size;
      j["num_local_experts"] = c.num_experts;
      j["num_experts_per_tok"] = c.experts_per_token;
      j["experts_per_token"] = c.experts_per_token;
      j["swiglu_alpha"] = shortest(c.swiglu_alpha);
      j["swiglu_limit"] = shortest(c.swiglu_limit);
      break;
    case Family::kQwen3Moe:
      j["intermediate_size"] = c.intermediate_size > 0 ? c.intermediate_size : c.moe_intermediate_size;
      j["moe_intermediate_size"] = c.moe_intermediate_size;
      j["num_experts"] = c.num_experts;
      j["num_experts_per_tok"] = c.experts_per_token;
      j["norm_topk_prob"] = c.norm_topk_prob;
      j["decoder_sparse_step"] = 1;
      j["mlp_only_layers"] = json::array();
      break;
    case Family::kMixtral:
      j["intermediate_size"] = c.moe_intermediate_size;
      j["num_local_experts"] = c.num_experts;
      j["num_experts_per_tok"] = c.experts_per_token;
      break;
    case Family::kQwen3:
    case Family::kLlama:
      j["intermediate_size"] = c.intermediate_size;
      break;
  }

  // Sliding window, in each family's own vocabulary.
  std::vector<std::string> types;
  for (bool s : c.layer_sliding) types.push_back(s && c.sliding_window > 0 ? "sliding_attention" : "full_attention");
  switch (c.family) {
    case Family::kGptOss:
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      j["layer_types"] = types;
      break;
    case Family::kQwen3:
      j["use_sliding_window"] = c.sliding_window > 0;
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      j["max_window_layers"] = c.num_layers;
      j["layer_types"] = types;
      break;
    case Family::kQwen3Moe:
      j["use_sliding_window"] = c.sliding_window > 0;
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      break;
    case Family::kMixtral:
      j["sliding_window"] = c.sliding_window > 0 ? json(c.sliding_window) : json(nullptr);
      break;
    case Family::kLlama:
      break;
  }

  // RoPE in the transformers v5 form (rope_theta inside rope_parameters).
  json rope = {{"rope_theta", c.rope.theta}};
  switch (c.rope.type) {
    case ops::RopeScaling::Type::kDefault:
      rope["rope_type"] = "default";
      break;
    case ops::RopeScaling::Type::kYarn:
      rope["rope_type"] = "yarn";
      rope["factor"] = c.rope.factor;
      rope["original_max_position_embeddings"] = c.rope.original_max_position;
      rope["beta_fast"] = c.rope.beta_fast;
      rope["beta_slow"] = c.rope.beta_slow;
      rope["truncate"] = c.rope.truncate;
      if (c.rope.attention_factor > 0.0) rope["attention_factor"] = c.rope.attention_factor;
      break;
    case ops::RopeScaling::Type::kLlama3:
      rope["rope_type"] = "llama3";
      rope["factor"] = c.rope.factor;
      rope["original_max_position_embeddings"] = c.rope.original_max_position;
      rope["low_freq_factor"] = c.rope.low_freq_factor;
      rope["high_freq_factor"] = c.rope.high_freq_factor;
      break;
  }
  j["rope_parameters"] = rope;
  return j.dump(2);
}

}  // namespace lmx::model
