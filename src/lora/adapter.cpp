// load_adapter: reads a PEFT LoRA directory, validates every tensor against the base model and converts
// each module family to loramux's canonical pairs (a [R, in] / [E, R, in], b [out, R] / [E, out, R] f32,
// scaling folded into b, delta = b·a). The PEFT layout rules it relies on are stated next to the code that
// applies them; tests/lora checks them against adapters saved by PEFT itself.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <set>
#include <sstream>

#include "core/log.h"
#include "core/rng.h"
#include "io/safetensors.h"
#include "lora/adapter.h"
#include "lora/adapter_config.h"
#include "lora/adapter_internal.h"

namespace lmx::lora {

// ---------------------------------------------------------------------------------------------------
// Shared helpers

namespace detail {

void ContentHasher::add(const void* data, size_t size) {
  const auto* p = static_cast<const uint8_t*>(data);
  constexpr uint64_t kPrime = 0x100000001b3ull;  // FNV-1a's 64-bit prime, applied per word
  size_t i = 0;
  for (; i + 8 <= size; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    lane1_ = ((lane1_ ^ w) * kPrime);
    lane1_ = (lane1_ << 29) | (lane1_ >> 35);
    lane2_ = mix64(lane2_ ^ w);
  }
  uint64_t tail = 0;
  std::memcpy(&tail, p + i, size - i);
  tail ^= uint64_t(size) << 56 ^ uint64_t(size);
  lane1_ = mix64(lane1_ ^ tail);
  lane2_ = mix64(lane2_ + tail + 0x632be59bd9b4e019ull);
  total_ += size;
}

std::string ContentHasher::hex() const {
  uint64_t h1 = mix64(lane1_ ^ total_);
  uint64_t h2 = mix64(lane2_ ^ h1);
  static const char* kDigits = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[15 - i] = kDigits[(h1 >> (4 * i)) & 15];
    out[31 - i] = kDigits[(h2 >> (4 * i)) & 15];
  }
  return out;
}

std::string_view target_label(ops::LoraTarget target) {
  switch (target) {
    case ops::LoraTarget::kQ: return "q_proj";
    case ops::LoraTarget::kK: return "k_proj";
    case ops::LoraTarget::kV: return "v_proj";
    case ops::LoraTarget::kO: return "o_proj";
    case ops::LoraTarget::kGate: return "mlp.gate_proj";
    case ops::LoraTarget::kUp: return "mlp.up_proj";
    case ops::LoraTarget::kDown: return "mlp.down_proj";
    case ops::LoraTarget::kMoeGateUp: return "experts.gate_up";
    case ops::LoraTarget::kMoeDown: return "experts.down";
    case ops::LoraTarget::kCount: break;
  }
  return "?";
}

bool is_moe_target(ops::LoraTarget target) {
  return target == ops::LoraTarget::kMoeGateUp || target == ops::LoraTarget::kMoeDown;
}

}  // namespace detail

namespace {

using ops::LoraTarget;
namespace fs = std::filesystem;

constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";
constexpr const char* kKeyPrefix = "base_model.model.";

std::string in_quotes(std::string_view s) {
  std::string out(1, '\'');  // built by appending: GCC 12 warns falsely (-Wrestrict) on "'" + std::string
  out.append(s);
  out.push_back('\'');
  return out;
}


// A row-major f32 matrix read from a safetensors view.
struct Matrix {
  int64_t rows = 0, cols = 0;
  std::vector<float> values;  // [rows, cols]
  float at(int64_t r, int64_t c) const { return values[size_t(r * cols + c)]; }
};

// ---------------------------------------------------------------------------------------------------
// Tensor names. PEFT saves "base_model.model.<module>.lora_A.weight" (adapter name removed); with two
// target_parameters on one module the wrappers nest, and the inner one's tensors gain ".base_layer".

enum class Proj { kGate, kUp, kDown };

enum class KeyKind {
  kLinear,     // attention or dense MLP: `target` says which
  kExpert,     // one expert's Linear module: `expert`, `proj`
  kFused,      // a ParamWrapper on mlp.experts: `depth` 0 = outer, 1 = inner (".base_layer")
};

struct ParsedKey {
  KeyKind kind = KeyKind::kLinear;
  int layer = 0;
  LoraTarget target = LoraTarget::kQ;
  int expert = -1;
  Proj proj = Proj::kGate;
  int depth = 0;
  std::string module;  // module path without "base_model.model." (PEFT's key for rank/alpha patterns)
  bool is_a = true;
};

bool parse_index(std::string_view s, int* out) {
  if (s.empty() || s.size() > 9) return false;
  int v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  *out = v;
  return true;
}

std::vector<std::string_view> split_dots(std::string_view s) {
  std::vector<std::string_view> parts;
  size_t pos = 0;
  while (true) {
    size_t dot = s.find('.', pos);
    parts.push_back(s.substr(pos, dot == std::string_view::npos ? std::string_view::npos : dot - pos));
    if (dot == std::string_view::npos) break;
    pos = dot + 1;
  }
  return parts;
}

std::string join(const std::vector<std::string_view>& parts, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end; ++i) {
    if (i > begin) out += '.';
    out += parts[i];
  }
  return out;
}

const char* kSupportedModules =
    "supported: self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj (dense models), "
    "mlp.experts.{e}.{gate,up,down}_proj (qwen3_moe), block_sparse_moe.experts.{e}.w{1,2,3} (mixtral), "
    "mlp.experts via target_parameters (fused experts)";

// Parse one tensor name and check that the module exists in this family. `where` prefixes errors.
Status parse_key(const std::string& name, const BaseModelShapes& base, const std::string& where, ParsedKey* key) {
  std::string_view rest = name;
  if (rest.rfind(kKeyPrefix, 0) == 0) rest.remove_prefix(std::strlen(kKeyPrefix));
  std::vector<std::string_view> parts = split_dots(rest);
  size_t n = parts.size();
  if (n < 3 || parts[n - 1] != "weight" || (parts[n - 2] != "lora_A" && parts[n - 2] != "lora_B")) {
    if (n >= 2 && (parts[n - 2] == "lora_A" || parts[n - 2] == "lora_B") && parts[n - 1] == "bias")
      return unsupported(where + ": LoRA bias terms (lora_bias=True) are not supported");
    if (rest.find("lora_magnitude_vector") != std::string_view::npos)
      return unsupported(where + ": DoRA magnitude vectors are not supported");
    if (rest.find("lora_embedding_") != std::string_view::npos)
      return unsupported(where + ": LoRA on embeddings is not supported; " + kSupportedModules);
    return invalid_argument(where + ": not a LoRA weight: expected '<module>.lora_A.weight' or '<module>.lora_B.weight'");
  }
  key->is_a = parts[n - 2] == "lora_A";
  size_t module_end = n - 2;
  key->module = join(parts, 0, module_end);
  const std::string module_text = in_quotes(key->module);

  if (module_end < 4 || parts[0] != "model" || parts[1] != "layers" || !parse_index(parts[2], &key->layer))
    return unsupported(where + ": unsupported target module " + module_text +
                       " (only modules inside model.layers.{l} are LoRA targets; embeddings, LM head and norms are "
                       "not); " + kSupportedModules);
  if (key->layer >= base.num_layers)
    return out_of_range(where + ": layer index " + std::to_string(key->layer) + " is out of range: the base model has " +
                        std::to_string(base.num_layers) + " layers");
  // Module path below model.layers.{l}.
  std::vector<std::string_view> sub(parts.begin() + 3, parts.begin() + long(module_end));
  const bool moe = base.num_experts > 0;
  auto module_is = [&](std::initializer_list<std::string_view> want) {
    if (sub.size() != want.size()) return false;
    size_t i = 0;
    for (std::string_view w : want)
      if (sub[i++] != w && w != "*") return false;
    return true;
  };

  if (module_is({"self_attn", "*"})) {
    static const std::pair<std::string_view, LoraTarget> kAttn[] = {
        {"q_proj", LoraTarget::kQ}, {"k_proj", LoraTarget::kK}, {"v_proj", LoraTarget::kV}, {"o_proj", LoraTarget::kO}};
    for (const auto& [leaf, target] : kAttn) {
      if (sub[1] != leaf) continue;
      key->kind = KeyKind::kLinear;
      key->target = target;
      return Status::Ok();
    }
  }
  if (module_is({"mlp", "*"})) {
    static const std::pair<std::string_view, LoraTarget> kDense[] = {
        {"gate_proj", LoraTarget::kGate}, {"up_proj", LoraTarget::kUp}, {"down_proj", LoraTarget::kDown}};
    for (const auto& [leaf, target] : kDense) {
      if (sub[1] != leaf) continue;
      if (base.in_features[size_t(target)] == 0)
        return invalid_argument(where + ": module " + module_text + " is a dense MLP projection, but the base model (" +
                                base.family + ") has mixture-of-experts MLPs: adapter for another architecture?");
      key->kind = KeyKind::kLinear;
      key->target = target;
      return Status::Ok();
    }
  }
  // Per-expert Linear modules: Qwen3-MoE (transformers 4) and Mixtral (transformers 4, w1/w3/w2).
  bool qwen_expert = module_is({"mlp", "experts", "*", "*"});
  bool mixtral_expert = module_is({"block_sparse_moe", "experts", "*", "*"});
  if (qwen_expert || mixtral_expert) {
    static const std::pair<std::string_view, Proj> kQwen[] = {
        {"gate_proj", Proj::kGate}, {"up_proj", Proj::kUp}, {"down_proj", Proj::kDown}};
    static const std::pair<std::string_view, Proj> kMixtral[] = {{"w1", Proj::kGate}, {"w3", Proj::kUp}, {"w2", Proj::kDown}};
    bool leaf_ok = false;
    for (const auto& [leaf, proj] : (qwen_expert ? kQwen : kMixtral)) {
      if (sub[3] != leaf) continue;
      key->proj = proj;
      leaf_ok = true;
    }
    int expert = 0;
    if (leaf_ok && parse_index(sub[2], &expert)) {
      const char* want_family = qwen_expert ? "qwen3_moe" : "mixtral";
      if (!moe)
        return invalid_argument(where + ": module " + module_text + " is a mixture-of-experts expert, but the base model (" +
                                base.family + ") is dense: adapter for another architecture?");
      if (base.family != want_family)
        return invalid_argument(where + ": module " + module_text + " uses " + want_family +
                                "'s per-expert module names, but the base model is " + base.family +
                                ": adapter for another architecture?");
      if (expert >= base.num_experts)
        return out_of_range(where + ": expert index " + std::to_string(expert) + " is out of range: the base model has " +
                            std::to_string(base.num_experts) + " experts per layer");
      key->kind = KeyKind::kExpert;
      key->expert = expert;
      return Status::Ok();
    }
  }
  // Fused 3D expert parameters (target_parameters): mlp.experts[.base_layer].
  if (module_is({"mlp", "experts"}) || module_is({"mlp", "experts", "base_layer"})) {
    if (!moe)
      return invalid_argument(where + ": module " + module_text + " holds fused expert parameters, but the base model (" +
                              base.family + ") is dense: adapter for another architecture?");
    key->kind = KeyKind::kFused;
    key->depth = sub.size() == 3 ? 1 : 0;
    return Status::Ok();
  }
  if (module_is({"mlp", "experts", "base_layer", "base_layer"}))
    return unsupported(where + ": more than two parameters of " + join(parts, 0, 5) +
                       " are targeted; loramux supports gate_up_proj and down_proj");
  std::string leaf = sub.empty() ? "" : std::string(sub.back());
  if (leaf == "gate" || leaf == "router")
    return unsupported(where + ": unsupported target module " + module_text +
                       ": LoRA on the MoE router is not supported; " + kSupportedModules);
  return unsupported(where + ": unsupported target module " + module_text + "; " + kSupportedModules);
}

// ---------------------------------------------------------------------------------------------------
// Reading tensors

Status read_matrix(const io::SafetensorsFile& file, const std::string& name, const std::string& where, Matrix* out) {
  LMX_ASSIGN_OR_RETURN(Tensor t, file.tensor(name));
  if (t.ndim != 2) return invalid_argument(where + ": expected a 2-D tensor, found " + t.dims_str());
  if (t.dtype != DType::F32 && t.dtype != DType::BF16 && t.dtype != DType::F16)
    return unsupported(where + ": dtype " + std::string(dtype_name(t.dtype)) + ", expected F32, BF16 or F16");
  out->rows = t.shape[0];
  out->cols = t.shape[1];
  size_t n = size_t(t.numel());
  out->values.resize(n);
  const auto* bytes = static_cast<const uint8_t*>(t.data);  // possibly unaligned: read through memcpy
  for (size_t i = 0; i < n; ++i) {
    float v;
    if (t.dtype == DType::F32) {
      std::memcpy(&v, bytes + 4 * i, 4);
    } else {
      uint16_t h;
      std::memcpy(&h, bytes + 2 * i, 2);
      v = t.dtype == DType::BF16 ? bf16_to_f32(bf16{h}) : f16_to_f32(h);
    }
    if (!std::isfinite(v))
      return invalid_argument(where + ": element [" + std::to_string(i / size_t(out->cols)) + ", " +
                              std::to_string(i % size_t(out->cols)) + "] is " + (std::isnan(v) ? "NaN" : "Inf"));
    out->values[i] = v;
  }
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------------------
// The loader proper

struct ModuleTensors {
  ParsedKey key;              // of whichever of A/B was seen first
  std::string a_name, b_name;
};

// One expert projection of one layer.
struct ExpertLora {
  Matrix a, b;  // [r, in], [out, r]
  int rank = 0;
  float scaling = 0;
};

struct FusedTensors {
  std::string a_name, b_name;
  Matrix a, b;  // PEFT: [r·E, x], [y, r·E]
};

enum class FusedParam { kGateUp, kDown };

// How PEFT oriented a fused pair relative to the true linear map of the expert.
//  kDirect:     lora_A is [r·E, in], lora_B is [out, r·E]   -> a = A, b = B
//  kTransposed: lora_A is [r·E, out], lora_B is [in, r·E]   -> a = Bᵀ, b = Aᵀ
enum class FusedOrientation { kUnknown, kDirect, kTransposed };

class Loader {
 public:
  Loader(const std::string& dir, const BaseModelShapes& base, const AdapterLimits& limits, const AdapterConfig& config,
         const io::SafetensorsFile& file)
      : base_(base), limits_(limits), config_(config), file_(file) {
    file_label_ = (fs::path(dir) / kWeightsFile).string();
  }

  Status run(Adapter* adapter);

 private:
  std::string where(const std::string& tensor) const { return file_label_ + ": tensor " + in_quotes(tensor); }
  // `limit_factor` 2 for a fused gate_up_proj: like a merged per-expert gate/up it may hold 2r (PEFT's own
  // v4->v5 conversion gives it rank 2r), and its slot capacity is 2 * max_rank.
  Status expected_rank(const std::string& key, int found, const std::string& where_text, int* rank,
                       int limit_factor = 1) const;
  Result<float> scaling_for(const std::string& key, int rank) const;
  Status check_layer_selected(const ParsedKey& key, const std::string& tensor) const;
  Status load_linear(const ModuleTensors& m, Adapter* adapter);
  Status load_expert(const ModuleTensors& m);
  Status build_expert_layers(Adapter* adapter);
  Status build_fused_layers(Adapter* adapter);
  Result<FusedOrientation> orientation_from_metadata(const std::string& example, int64_t dim) const;

  const BaseModelShapes& base_;
  const AdapterLimits& limits_;
  const AdapterConfig& config_;
  const io::SafetensorsFile& file_;
  std::string file_label_;
  // layer -> proj -> expert -> pair (per-expert Linear modules)
  std::map<int, std::map<Proj, std::map<int, ExpertLora>>> experts_;
  // layer -> depth -> tensors (fused parameters)
  std::map<int, std::map<int, FusedTensors>> fused_;
};

Status Loader::expected_rank(const std::string& key, int found, const std::string& where_text, int* rank,
                             int limit_factor) const {
  LMX_ASSIGN_OR_RETURN(int want, rank_for(config_, key));
  if (found != want)
    return invalid_argument(where_text + ": rank mismatch vs " + config_.source + ": expected r=" + std::to_string(want) +
                            " (from 'r' or 'rank_pattern' for " + in_quotes(key) + "), found " + std::to_string(found));
  if (found > limit_factor * limits_.max_rank)
    return out_of_range(where_text + ": rank " + std::to_string(found) + " is above the limit (--max-lora-rank " +
                        std::to_string(limits_.max_rank) + (limit_factor > 1 ? ", doubled for gate_up_proj)" : ")"));
  *rank = found;
  return Status::Ok();
}

Result<float> Loader::scaling_for(const std::string& key, int rank) const {
  LMX_ASSIGN_OR_RETURN(double alpha, alpha_for(config_, key));
  double scaling = config_.use_rslora ? alpha / std::sqrt(double(rank)) : alpha / double(rank);
  return float(scaling);
}

// layers_to_transform restricts target_modules (not target_parameters) in PEFT. A tensor outside the
// selected layers would be ignored by PEFT, so serving it would differ from PEFT: the files disagree.
Status Loader::check_layer_selected(const ParsedKey& key, const std::string& tensor) const {
  if (config_.layers_to_transform.empty()) return Status::Ok();
  for (int l : config_.layers_to_transform)
    if (l == key.layer) return Status::Ok();
  std::string list;
  for (int l : config_.layers_to_transform) list += (list.empty() ? "" : ", ") + std::to_string(l);
  return invalid_argument(where(tensor) + ": layer " + std::to_string(key.layer) + " is not in " + config_.source +
                          "'s layers_to_transform [" + list + "]: config and weights disagree");
}

Status Loader::load_linear(const ModuleTensors& m, Adapter* adapter) {
  const ParsedKey& key = m.key;
  LMX_RETURN_IF_ERROR(check_layer_selected(key, m.a_name));
  Matrix a, b;
  LMX_RETURN_IF_ERROR(read_matrix(file_, m.a_name, where(m.a_name), &a));
  LMX_RETURN_IF_ERROR(read_matrix(file_, m.b_name, where(m.b_name), &b));
  const int in = base_.in_features[size_t(key.target)];
  const int out = base_.out_features[size_t(key.target)];
  if (b.cols != a.rows)
    return invalid_argument(where(m.b_name) + ": rank mismatch between lora_A and lora_B: lora_A has " +
                            std::to_string(a.rows) + " rows, lora_B has " + std::to_string(b.cols) + " columns");
  int rank = 0;
  LMX_RETURN_IF_ERROR(expected_rank(key.module, int(std::min<int64_t>(a.rows, 1 << 30)), where(m.a_name), &rank));
  if (a.cols != in)
    return invalid_argument(where(m.a_name) + ": wrong shape: expected [" + std::to_string(rank) + ", " + std::to_string(in) +
                            "] (in_features of " + std::string(detail::target_label(key.target)) + " = " +
                            std::to_string(in) + "), found [" + std::to_string(a.rows) + ", " + std::to_string(a.cols) + "]");
  if (b.rows != out)
    return invalid_argument(where(m.b_name) + ": wrong shape: expected [" + std::to_string(out) + ", " + std::to_string(rank) +
                            "] (out_features of " + std::string(detail::target_label(key.target)) + " = " +
                            std::to_string(out) + "), found [" + std::to_string(b.rows) + ", " + std::to_string(b.cols) + "]");
  LMX_ASSIGN_OR_RETURN(float scaling, scaling_for(key.module, rank));
  LoraPair pair;
  pair.rank = rank;
  pair.scaling = scaling;
  pair.a = OwnedTensor::host(DType::F32, {rank, in});
  pair.b = OwnedTensor::host(DType::F32, {out, rank});
  std::memcpy(pair.a.view.data, a.values.data(), a.values.size() * sizeof(float));
  float* bp = pair.b.view.ptr<float>();
  for (size_t i = 0; i < b.values.size(); ++i) bp[i] = b.values[i] * scaling;
  adapter->layers[size_t(key.layer)][size_t(key.target)] = std::move(pair);
  return Status::Ok();
}

Status Loader::load_expert(const ModuleTensors& m) {
  const ParsedKey& key = m.key;
  LMX_RETURN_IF_ERROR(check_layer_selected(key, m.a_name));
  ExpertLora e;
  LMX_RETURN_IF_ERROR(read_matrix(file_, m.a_name, where(m.a_name), &e.a));
  LMX_RETURN_IF_ERROR(read_matrix(file_, m.b_name, where(m.b_name), &e.b));
  const int H = base_.hidden_size, I = base_.moe_intermediate_size;
  const int in = key.proj == Proj::kDown ? I : H;
  const int out = key.proj == Proj::kDown ? H : I;
  const char* what = key.proj == Proj::kGate ? "gate" : key.proj == Proj::kUp ? "up" : "down";
  if (e.b.cols != e.a.rows)
    return invalid_argument(where(m.b_name) + ": rank mismatch between lora_A and lora_B: lora_A has " +
                            std::to_string(e.a.rows) + " rows, lora_B has " + std::to_string(e.b.cols) + " columns");
  LMX_RETURN_IF_ERROR(expected_rank(key.module, int(std::min<int64_t>(e.a.rows, 1 << 30)), where(m.a_name), &e.rank));
  if (e.a.cols != in)
    return invalid_argument(where(m.a_name) + ": wrong shape: expected [" + std::to_string(e.rank) + ", " +
                            std::to_string(in) + "] (in_features of expert " + what + " projection), found [" +
                            std::to_string(e.a.rows) + ", " + std::to_string(e.a.cols) + "]");
  if (e.b.rows != out)
    return invalid_argument(where(m.b_name) + ": wrong shape: expected [" + std::to_string(out) + ", " +
                            std::to_string(e.rank) + "] (out_features of expert " + what + " projection), found [" +
                            std::to_string(e.b.rows) + ", " + std::to_string(e.b.cols) + "]");
  LMX_ASSIGN_OR_RETURN(e.scaling, scaling_for(key.module, e.rank));
  experts_[key.layer][key.proj][key.expert] = std::move(e);
  return Status::Ok();
}

// Per-expert modules -> kMoeGateUp / kMoeDown. gate and up merge block-diagonally, exactly as PEFT's own
// transformers-v5 conversion fuses them (peft/utils/transformers_weight_conversion.py, PeftConcatenate):
//   a[e] = [A_gate[e]; A_up[e]]  (rank R_gate + R_up),
//   b[e] rows of gate use columns [0, R_gate), rows of up use [R_gate, R_gate + R_up), zeros elsewhere,
// with the rows placed where the base gate_up weight keeps them (halves or interleaved).
// Decision: an expert without tensors (a regex target_modules can pick a subset of experts) gets zero
// rows, i.e. no delta, which is what PEFT computes for an untargeted module. Experts with a lower rank
// (rank_pattern per expert) are zero-padded to the largest rank of the layer.
Status Loader::build_expert_layers(Adapter* adapter) {
  const int E = base_.num_experts, H = base_.hidden_size, I = base_.moe_intermediate_size;
  for (auto& entry : experts_) {
    const int layer = entry.first;
    auto& by_proj = entry.second;  // a plain reference: clang 14 cannot capture structured bindings
    auto max_rank = [&](Proj p) {
      int r = 0;
      auto it = by_proj.find(p);
      if (it != by_proj.end())
        for (const auto& [e, lora] : it->second) r = std::max(r, lora.rank);
      return r;
    };
    const int r_gate = max_rank(Proj::kGate), r_up = max_rank(Proj::kUp), r_down = max_rank(Proj::kDown);
    if (r_gate + r_up > 0) {
      const int R = r_gate + r_up;
      LoraPair pair;
      pair.rank = R;
      pair.a = OwnedTensor::host(DType::F32, {E, R, H});
      pair.b = OwnedTensor::host(DType::F32, {E, 2 * I, R});
      std::memset(pair.a.view.data, 0, pair.a.view.nbytes());
      std::memset(pair.b.view.data, 0, pair.b.view.nbytes());
      float* a = pair.a.view.ptr<float>();
      float* b = pair.b.view.ptr<float>();
      std::set<float> scalings;
      for (Proj p : {Proj::kGate, Proj::kUp}) {
        auto it = by_proj.find(p);
        if (it == by_proj.end()) continue;
        const int col0 = p == Proj::kGate ? 0 : r_gate;
        for (const auto& [e, lora] : it->second) {
          scalings.insert(lora.scaling);
          for (int k = 0; k < lora.rank; ++k)
            std::memcpy(a + (size_t(e) * R + col0 + k) * H, &lora.a.values[size_t(k) * H], sizeof(float) * H);
          for (int i = 0; i < I; ++i) {
            int row = base_.gate_up_interleaved ? 2 * i + (p == Proj::kUp) : (p == Proj::kUp ? I + i : i);
            for (int k = 0; k < lora.rank; ++k)
              b[(size_t(e) * 2 * I + row) * R + col0 + k] = lora.b.at(i, k) * lora.scaling;
          }
        }
      }
      pair.scaling = scalings.size() == 1 ? *scalings.begin() : 0.0f;
      adapter->layers[size_t(layer)][size_t(LoraTarget::kMoeGateUp)] = std::move(pair);
    }
    if (r_down > 0) {
      const int R = r_down;
      LoraPair pair;
      pair.rank = R;
      pair.a = OwnedTensor::host(DType::F32, {E, R, I});
      pair.b = OwnedTensor::host(DType::F32, {E, H, R});
      std::memset(pair.a.view.data, 0, pair.a.view.nbytes());
      std::memset(pair.b.view.data, 0, pair.b.view.nbytes());
      float* a = pair.a.view.ptr<float>();
      float* b = pair.b.view.ptr<float>();
      std::set<float> scalings;
      for (const auto& [e, lora] : by_proj[Proj::kDown]) {
        scalings.insert(lora.scaling);
        for (int k = 0; k < lora.rank; ++k)
          std::memcpy(a + (size_t(e) * R + k) * I, &lora.a.values[size_t(k) * I], sizeof(float) * I);
        for (int o = 0; o < H; ++o)
          for (int k = 0; k < lora.rank; ++k) b[(size_t(e) * H + o) * R + k] = lora.b.at(o, k) * lora.scaling;
      }
      pair.scaling = scalings.size() == 1 ? *scalings.begin() : 0.0f;
      adapter->layers[size_t(layer)][size_t(LoraTarget::kMoeDown)] = std::move(pair);
    }
  }
  return Status::Ok();
}

// PEFT version comparison helper: a < b.
bool version_less(const int a[3], const int b[3]) {
  for (int i = 0; i < 3; ++i)
    if (a[i] != b[i]) return a[i] < b[i];
  return false;
}

// When every fused pair is square (in == out), shapes cannot tell the two PEFT layouts apart. The layout
// PEFT used follows from (peft/tuners/lora/layer.py, ParamWrapper):
//  * PEFT <= 0.19.0 sized lora_A by dim 1 of the [E, d1, d2] parameter, always.
//  * PEFT >= 0.19.1 (huggingface/peft#3165) swaps when the experts module lacks `is_transposed=True`, i.e.
//    sizes lora_A by dim 2 for [E, out, in] parameters (transformers-5 Qwen3-MoE/Mixtral) and, for GPT-OSS,
//    by dim 1 with transformers >= 5 (is_transposed=True) but by dim 2 with transformers 4 (no attribute).
// The boundary release is reported as 0.19.0 by some and 0.19.1 by others, so 0.19.0 itself is not
// decided here; neither is GPT-OSS on PEFT >= 0.19.1 (the transformers version is not recorded).
Result<FusedOrientation> Loader::orientation_from_metadata(const std::string& example, int64_t dim) const {
  const bool storage_in_out = base_.family == "gpt_oss";  // [E, in, out]; others [E, out, in]
  int lora_a_dim = 0;
  std::string reason;
  if (config_.fused_lora_a_dim) {
    lora_a_dim = *config_.fused_lora_a_dim;
  } else {
    int v[3] = {0, 0, 0};
    const bool has_version = !config_.peft_version.empty();
    if (has_version && !parse_peft_version(config_.peft_version, v))
      return invalid_argument(config_.source + ": field 'peft_version': cannot read version " + in_quotes(config_.peft_version));
    static const int k0190[3] = {0, 19, 0}, k0191[3] = {0, 19, 1};
    if (!has_version || version_less(v, k0190)) {
      lora_a_dim = 1;
    } else if (!version_less(v, k0191) && !storage_in_out) {
      lora_a_dim = 2;
    } else {
      reason = storage_in_out ? "PEFT " + config_.peft_version +
                                    " oriented GPT-OSS experts by the transformers version, which the adapter does not record"
                              : "PEFT 0.19.0 is reported on both sides of the layout change";
    }
  }
  if (lora_a_dim == 0)
    return invalid_argument(file_label_ + ": fused expert LoRA " + in_quotes(example) + " is square (in = out = " +
                            std::to_string(dim) + "), so its layout cannot be told from shapes, and " + reason +
                            ". Add \"loramux_fused_lora_a_dim\": 1 or 2 to " + config_.source +
                            ": the dim of the [E, d1, d2] expert parameter that lora_A's width matches");
  // Which dim of the stored parameter is the true input.
  const int in_dim = storage_in_out ? 1 : 2;
  return lora_a_dim == in_dim ? FusedOrientation::kDirect : FusedOrientation::kTransposed;
}

// Fused 3D expert parameters (PEFT ParamWrapper). For E experts and rank r, PEFT stores
//   lora_A [r·E, x]: row e·r + k is rank k of expert e (expert slowest; reshape(E, r, x)),
//   lora_B [y, r·E]: column k·E + e is rank k of expert e (expert fastest; reshape(y, r, E)),
// and the delta of expert e is B_e·A_e in the orientation PEFT assumed. Which of the two pairs is
// gate_up and which is down is read from the shapes ({H, 2I} vs {I, H} never coincide), not from the
// nesting order, which PEFT derives from parameter registration order.
Status Loader::build_fused_layers(Adapter* adapter) {
  const int E = base_.num_experts, H = base_.hidden_size, I = base_.moe_intermediate_size;
  struct Identified {
    int layer;
    FusedParam param;
    FusedTensors* tensors;
    int rank;
    FusedOrientation evidence;
  };
  std::vector<Identified> pairs;
  for (auto& [layer, by_depth] : fused_) {
    std::set<FusedParam> seen;
    for (auto& [depth, t] : by_depth) {
      LMX_RETURN_IF_ERROR(read_matrix(file_, t.a_name, where(t.a_name), &t.a));
      LMX_RETURN_IF_ERROR(read_matrix(file_, t.b_name, where(t.b_name), &t.b));
      const int64_t x = t.a.cols, y = t.b.rows;
      auto fits = [&](int64_t in, int64_t out) { return (x == in && y == out) || (x == out && y == in); };
      FusedParam param;
      if (fits(H, 2 * I)) {
        param = FusedParam::kGateUp;
      } else if (fits(I, H)) {
        param = FusedParam::kDown;
      } else {
        return invalid_argument(where(t.a_name) + ": wrong shape: lora_A [r*E, x] and lora_B [y, r*E] must have {x, y} = {" +
                                std::to_string(H) + ", " + std::to_string(2 * I) + "} (gate_up_proj) or {" +
                                std::to_string(I) + ", " + std::to_string(H) + "} (down_proj), found x = " +
                                std::to_string(x) + ", y = " + std::to_string(y));
      }
      const char* param_name = param == FusedParam::kGateUp ? "gate_up_proj" : "down_proj";
      if (!seen.insert(param).second)
        return invalid_argument(where(t.a_name) + ": layer " + std::to_string(layer) + " has two fused LoRA pairs shaped like " +
                                param_name);
      if (t.b.cols != t.a.rows)
        return invalid_argument(where(t.b_name) + ": rank mismatch between lora_A and lora_B: lora_A has " +
                                std::to_string(t.a.rows) + " rows, lora_B has " + std::to_string(t.b.cols) + " columns");
      if (t.a.rows % E != 0 || t.a.rows == 0)
        return invalid_argument(where(t.a_name) + ": wrong shape: expected [r*E, " + std::to_string(x) + "] with E = " +
                                std::to_string(E) + " experts, found " + std::to_string(t.a.rows) +
                                " rows (not a multiple of E)");
      std::string key = "model.layers." + std::to_string(layer) + ".mlp.experts." + param_name;
      if (!targets_parameter(config_, key))
        log_warn(where(t.a_name) + ": looks like " + param_name + ", which " + config_.source +
                 "'s target_parameters does not list; loading it anyway");
      int rank = 0;
      LMX_RETURN_IF_ERROR(expected_rank(key, int(std::min<int64_t>(t.a.rows / E, 1 << 30)), where(t.a_name), &rank,
                                        param == FusedParam::kGateUp ? 2 : 1));
      const int64_t in = param == FusedParam::kGateUp ? H : I;
      const int64_t out = param == FusedParam::kGateUp ? 2 * I : H;
      FusedOrientation evidence = FusedOrientation::kUnknown;
      if (in != out) evidence = x == in ? FusedOrientation::kDirect : FusedOrientation::kTransposed;
      pairs.push_back({layer, param, &t, rank, evidence});
    }
  }
  if (pairs.empty()) return Status::Ok();

  // One orientation for the whole adapter: it is a property of the PEFT/transformers versions that saved it.
  FusedOrientation orientation = FusedOrientation::kUnknown;
  const Identified* decided_by = nullptr;
  for (const Identified& p : pairs) {
    if (p.evidence == FusedOrientation::kUnknown) continue;
    if (orientation != FusedOrientation::kUnknown && p.evidence != orientation)
      return invalid_argument(file_label_ + ": fused expert LoRA pairs disagree on layout: " + in_quotes(p.tensors->a_name) +
                              " has lora_A sized by " + (p.evidence == FusedOrientation::kDirect ? "in" : "out") +
                              "_features, " + in_quotes(decided_by->tensors->a_name) + " the other way");
    orientation = p.evidence;
    decided_by = &p;
  }
  if (orientation == FusedOrientation::kUnknown) {
    const Identified& p = pairs.front();
    LMX_ASSIGN_OR_RETURN(orientation, orientation_from_metadata(p.tensors->a_name, p.tensors->a.cols));
  }

  for (const Identified& p : pairs) {
    const FusedTensors& t = *p.tensors;
    const int r = p.rank;
    const int in = p.param == FusedParam::kGateUp ? H : I;
    const int out = p.param == FusedParam::kGateUp ? 2 * I : H;
    const char* param_name = p.param == FusedParam::kGateUp ? "gate_up_proj" : "down_proj";
    std::string key = "model.layers." + std::to_string(p.layer) + ".mlp.experts." + param_name;
    LMX_ASSIGN_OR_RETURN(float scaling, scaling_for(key, r));
    LoraPair pair;
    pair.rank = r;
    pair.scaling = scaling;
    pair.a = OwnedTensor::host(DType::F32, {E, r, in});
    pair.b = OwnedTensor::host(DType::F32, {E, out, r});
    float* a = pair.a.view.ptr<float>();
    float* b = pair.b.view.ptr<float>();
    // Loops run along the rows of PEFT's tensors (sequential reads); writes scatter over E blocks.
    const int64_t rE = int64_t(r) * E;
    const Matrix& A = t.a;  // [r·E, in] (direct) or [r·E, out] (transposed)
    const Matrix& B = t.b;  // [out, r·E] (direct) or [in, r·E] (transposed)
    if (orientation == FusedOrientation::kDirect) {
      for (int64_t row = 0; row < rE; ++row)  // row = e·r + k: expert slowest
        std::memcpy(a + row * in, &A.values[size_t(row * in)], sizeof(float) * size_t(in));
      // Blocks of rows of B stay in cache while each expert's contiguous rows of b are written.
      constexpr int64_t kRowBlock = 64;
      for (int64_t o0 = 0; o0 < out; o0 += kRowBlock)
        for (int64_t e = 0; e < E; ++e)
          for (int64_t o = o0; o < std::min<int64_t>(out, o0 + kRowBlock); ++o) {
            const float* src = &B.values[size_t(o * rE + e)];  // column k·E + e: expert fastest
            float* dst = b + (e * out + o) * r;
            for (int64_t k = 0; k < r; ++k) dst[k] = src[k * E] * scaling;
          }
    } else {
      for (int64_t i = 0; i < in; ++i) {
        const float* src = &B.values[size_t(i * rE)];
        for (int64_t k = 0; k < r; ++k)
          for (int64_t e = 0; e < E; ++e) a[(e * r + k) * in + i] = src[k * E + e];
      }
      for (int64_t e = 0; e < E; ++e)
        for (int64_t k = 0; k < r; ++k) {
          const float* src = &A.values[size_t((e * r + k) * out)];  // row e·r + k: expert slowest
          for (int64_t o = 0; o < out; ++o) b[(e * out + o) * r + k] = src[o] * scaling;
        }
    }
    const LoraTarget target = p.param == FusedParam::kGateUp ? LoraTarget::kMoeGateUp : LoraTarget::kMoeDown;
    if (adapter->layers[size_t(p.layer)][size_t(target)])
      return invalid_argument(where(t.a_name) + ": layer " + std::to_string(p.layer) +
                              " has both per-expert modules and fused expert parameters for " + param_name);
    adapter->layers[size_t(p.layer)][size_t(target)] = std::move(pair);
  }
  return Status::Ok();
}

Status Loader::run(Adapter* adapter) {
  adapter->layers.assign(size_t(base_.num_layers), {});
  // Group tensors by module; every lora_A needs its lora_B and vice versa.
  std::map<std::string, ModuleTensors> modules;
  for (const auto& [name, info] : file_.tensors()) {
    ParsedKey key;
    LMX_RETURN_IF_ERROR(parse_key(name, base_, where(name), &key));
    ModuleTensors& m = modules[key.module];
    if (m.a_name.empty() && m.b_name.empty()) m.key = key;
    (key.is_a ? m.a_name : m.b_name) = name;
  }
  if (modules.empty()) return invalid_argument(file_label_ + ": holds no LoRA tensors");
  for (const auto& [module, m] : modules) {
    if (m.b_name.empty()) return invalid_argument(where(m.a_name) + ": missing lora_B for this lora_A (module " + in_quotes(module) + ")");
    if (m.a_name.empty()) return invalid_argument(where(m.b_name) + ": missing lora_A for this lora_B (module " + in_quotes(module) + ")");
  }
  // Tensors decide what is loaded; target_modules is only cross-checked (PEFT itself rewrites it when it
  // converts MoE adapters between transformers generations), with one warning for all mismatches.
  bool any_fused = false;
  size_t untargeted = 0;
  std::string first_untargeted;
  for (const auto& [module, m] : modules) {
    if (m.key.kind != KeyKind::kFused) {
      LMX_ASSIGN_OR_RETURN(bool targeted, targets_module(config_, module));
      if (!targeted && untargeted++ == 0) first_untargeted = module;
    }
    switch (m.key.kind) {
      case KeyKind::kLinear: LMX_RETURN_IF_ERROR(load_linear(m, adapter)); break;
      case KeyKind::kExpert: LMX_RETURN_IF_ERROR(load_expert(m)); break;
      case KeyKind::kFused:
        fused_[m.key.layer][m.key.depth] = FusedTensors{m.a_name, m.b_name, {}, {}};
        any_fused = true;
        break;
    }
  }
  if (untargeted > 0)
    log_warn(file_label_ + ": " + std::to_string(untargeted) + " module(s), e.g. " + in_quotes(first_untargeted) +
             ", are not selected by " + config_.source + "'s target_modules/layers_to_transform; loading them anyway");
  LMX_RETURN_IF_ERROR(build_expert_layers(adapter));
  LMX_RETURN_IF_ERROR(build_fused_layers(adapter));
  adapter->format = any_fused ? AdapterFormat::kFusedParameters : AdapterFormat::kModules;
  adapter->max_rank = 0;
  for (const auto& layer : adapter->layers)
    for (const auto& pair : layer)
      if (pair) adapter->max_rank = std::max(adapter->max_rank, pair->rank);
  return Status::Ok();
}

}  // namespace

Result<Adapter> load_adapter(const std::string& dir, const std::string& name, const BaseModelShapes& base,
                             const AdapterLimits& limits) {
  const std::string context = "adapter " + in_quotes(name);
  if (limits.max_rank < 1)
    return invalid_argument(context + ": max LoRA rank must be >= 1, got " + std::to_string(limits.max_rank));
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return not_found(context + ": " + dir + ": not a directory");
  const std::string config_path = (fs::path(dir) / kConfigFile).string();
  const std::string weights_path = (fs::path(dir) / kWeightsFile).string();
  if (!fs::exists(config_path, ec)) return not_found(context + ": " + config_path + ": missing (not a PEFT adapter directory?)");
  if (!fs::exists(weights_path, ec)) {
    if (fs::exists(fs::path(dir) / "adapter_model.bin", ec))
      return unsupported(context + ": " + weights_path + ": missing; adapter_model.bin (pickle) is not read, re-save with "
                         "safe_serialization=True");
    return not_found(context + ": " + weights_path + ": missing");
  }
  Result<std::string> config_text = io::read_text_file(config_path);
  if (!config_text.ok()) return config_text.status().with_context(context);
  AdapterConfig config;
  LMX_RETURN_IF_ERROR(parse_adapter_config(*config_text, config_path, &config).with_context(context));
  Result<io::SafetensorsFile> file = io::SafetensorsFile::open(weights_path);
  if (!file.ok()) return file.status().with_context(context);

  Adapter adapter;
  adapter.name = name;
  adapter.dir = dir;
  adapter.base_model_name = config.base_model_name_or_path;
  adapter.file_bytes = file->mapping()->size();
  detail::ContentHasher hasher;
  hasher.add(config_text->data(), config_text->size());
  hasher.add(file->mapping()->data(), file->mapping()->size());
  adapter.content_hash = hasher.hex();

  Loader loader(dir, base, limits, config, *file);
  LMX_RETURN_IF_ERROR(loader.run(&adapter).with_context(context));
  return adapter;
}

}  // namespace lmx::lora
