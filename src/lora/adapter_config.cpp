// adapter_config.json parsing and PEFT's name-matching rules (peft/utils/other.py get_pattern_key,
// peft/tuners/tuners_utils.py check_target_module_exists), re-stated for std::regex.
// Regexes are compiled with libstdc++'s polynomial (Thompson NFA) executor where available, and patterns
// are bounded in size, so a hostile config can neither overflow the stack nor backtrack for ever.
#include "lora/adapter_config.h"

#include <cmath>
#include <regex>

#include <nlohmann/json.hpp>

namespace lmx::lora {
namespace {

// Insertion order matters: rank_pattern/alpha_pattern take the first matching key, as Python dicts do.
using json = nlohmann::ordered_json;

constexpr size_t kMaxPatternChars = 512;
constexpr double kMaxRepeatProduct = 1000;  // product of all {m,n} upper bounds in one pattern

std::string in_quotes(std::string_view s) {
  std::string out(1, '\'');  // built by appending: GCC 12 warns falsely (-Wrestrict) on "'" + std::string
  out.append(s);
  out.push_back('\'');
  return out;
}

std::string type_of(const json& v) { return v.type_name(); }

// A JSON value for an error message: bounded in length, invalid UTF-8 replaced rather than thrown on.
std::string shown(const json& v) {
  std::string text = v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > 120) text = text.substr(0, 117) + "...";
  return text;
}

// Reject patterns whose compiled automaton could grow large: {m,n} repeats copy their operand, so chained
// or nested repeats multiply. PEFT's patterns are short alternations of module names.
Status check_pattern_size(const std::string& pattern, const std::string& where) {
  if (pattern.size() > kMaxPatternChars)
    return invalid_argument(where + ": pattern of " + std::to_string(pattern.size()) + " characters, loramux accepts at most " +
                            std::to_string(kMaxPatternChars));
  double product = 1;
  for (size_t i = 0; i < pattern.size(); ++i) {
    if (pattern[i] == '\\') {
      ++i;
      continue;
    }
    if (pattern[i] != '{') continue;
    double bound = 0;
    size_t j = i + 1;
    for (; j < pattern.size() && pattern[j] != '}'; ++j) {
      char c = pattern[j];
      if (c >= '0' && c <= '9') {
        double value = 0;
        while (j < pattern.size() && pattern[j] >= '0' && pattern[j] <= '9') value = value * 10 + (pattern[j++] - '0');
        bound = std::max(bound, value);
        --j;
      } else if (c == ',') {
        bound += 1;  // "{n,}": unbounded above, counted as one more copy plus a loop
      }
    }
    product *= std::max(bound, 1.0);
    if (product > kMaxRepeatProduct)
      return invalid_argument(where + ": repeat counts in pattern " + in_quotes(pattern) +
                              " multiply beyond " + std::to_string(int(kMaxRepeatProduct)) + ", loramux refuses it");
    i = j;
  }
  return Status::Ok();
}

Result<std::regex> compile(const std::string& pattern, const std::string& where) {
  LMX_RETURN_IF_ERROR(check_pattern_size(pattern, where));
  auto flags = std::regex::ECMAScript;
#if defined(__GLIBCXX__)
  flags |= std::regex_constants::__polynomial;  // BFS executor: linear in the input, no back-references
#endif
  try {
    return std::regex(pattern, flags);
  } catch (const std::regex_error& e) {
    return invalid_argument(where + ": pattern " + in_quotes(pattern) + " is not a regex loramux can compile (" +
                            e.what() + "; Python-only syntax such as (?P<..>) or look-behind is not supported)");
  }
}

Status check_compiles(const std::string& pattern, const std::string& where) {
  Result<std::regex> re = compile(pattern, where);
  return re.ok() ? Status::Ok() : re.status();
}

// Python's re.match(rf"(.*\.)?({pattern})$", key): `pattern` is a module-name suffix, as a regex.
Result<bool> matches_suffix_pattern(const std::string& pattern, const std::string& key, const std::string& where) {
  LMX_ASSIGN_OR_RETURN(std::regex re, compile("(.*\\.)?(" + pattern + ")", where));
  return std::regex_match(key, re);
}

Result<bool> matches_full(const std::string& pattern, const std::string& key, const std::string& where) {
  LMX_ASSIGN_OR_RETURN(std::regex re, compile(pattern, where));
  return std::regex_match(key, re);
}

bool matches_name_list(const std::vector<std::string>& names, const std::string& key) {
  for (const std::string& n : names) {
    if (key == n) return true;
    if (key.size() > n.size() && key.compare(key.size() - n.size(), n.size(), n) == 0 &&
        key[key.size() - n.size() - 1] == '.')
      return true;
  }
  return false;
}

// ---- field readers: each names the field and says what it expected and found ----

struct Reader {
  const json& root;
  const std::string& source;

  std::string where(const char* field) const { return source + ": field '" + field + "'"; }
  bool present(const char* field) const { return root.contains(field) && !root.at(field).is_null(); }

  Status integer(const char* field, int* out, int min_value) const {
    if (!present(field)) return Status::Ok();
    const json& v = root.at(field);
    int64_t value = 0;
    if (v.is_number_integer()) {
      value = v.get<int64_t>();
    } else if (v.is_number_float() && std::isfinite(v.get<double>()) && v.get<double>() == std::floor(v.get<double>()) &&
               std::fabs(v.get<double>()) < 1e9) {
      value = int64_t(v.get<double>());
    } else {
      return invalid_argument(where(field) + ": expected an integer, found " + shown(v));
    }
    if (value < min_value || value > (1 << 30))
      return invalid_argument(where(field) + ": expected an integer >= " + std::to_string(min_value) + ", found " +
                              std::to_string(value));
    *out = int(value);
    return Status::Ok();
  }

  Status number(const char* field, double* out) const {
    if (!present(field)) return Status::Ok();
    const json& v = root.at(field);
    if (!v.is_number() || !std::isfinite(v.get<double>()))
      return invalid_argument(where(field) + ": expected a finite number, found " + shown(v));
    *out = v.get<double>();
    return Status::Ok();
  }

  Status boolean(const char* field, bool* out) const {
    if (!present(field)) return Status::Ok();
    const json& v = root.at(field);
    if (!v.is_boolean()) return invalid_argument(where(field) + ": expected true or false, found " + shown(v));
    *out = v.get<bool>();
    return Status::Ok();
  }

  Status string(const char* field, std::string* out) const {
    if (!present(field)) return Status::Ok();
    const json& v = root.at(field);
    if (!v.is_string()) return invalid_argument(where(field) + ": expected a string, found " + type_of(v));
    *out = v.get<std::string>();
    return Status::Ok();
  }

  // A list of strings, or (when `regex` is given) alternatively one regex string.
  Status names(const char* field, std::vector<std::string>* list, std::optional<std::string>* regex) const {
    if (!present(field)) return Status::Ok();
    const json& v = root.at(field);
    if (v.is_string() && regex != nullptr) {
      *regex = v.get<std::string>();
      return check_compiles(**regex, where(field));
    }
    if (!v.is_array())
      return invalid_argument(where(field) + ": expected a list of names" + (regex ? " or a regex string" : "") +
                              ", found " + type_of(v));
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_string())
        return invalid_argument(where(field) + "[" + std::to_string(i) + "]: expected a string, found " + type_of(v[i]));
      list->push_back(v[i].get<std::string>());
    }
    return Status::Ok();
  }
};

Status must_be_absent_or_empty(const json& root, const std::string& source, const char* field, const char* why) {
  if (!root.contains(field)) return Status::Ok();
  const json& v = root.at(field);
  bool empty = v.is_null() || (v.is_array() && v.empty()) || (v.is_object() && v.empty()) ||
               (v.is_boolean() && !v.get<bool>()) || (v.is_string() && v.get<std::string>().empty());
  if (empty) return Status::Ok();
  return unsupported(source + ": field '" + field + "' is " + shown(v) + ": " + why);
}

}  // namespace

Status parse_adapter_config(std::string_view text, const std::string& source, AdapterConfig* out) {
  *out = AdapterConfig{};
  out->source = source;
  json root = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (root.is_discarded()) return invalid_argument(source + ": not valid JSON");
  if (!root.is_object()) return invalid_argument(source + ": expected a JSON object, found " + type_of(root));
  Reader rd{root, source};

  std::string peft_type;
  LMX_RETURN_IF_ERROR(rd.string("peft_type", &peft_type));
  if (peft_type != "LORA")
    return unsupported(source + ": field 'peft_type': expected \"LORA\", found " +
                       (rd.present("peft_type") ? in_quotes(peft_type) : std::string("nothing")));

  LMX_RETURN_IF_ERROR(rd.integer("r", &out->r, 1));
  LMX_RETURN_IF_ERROR(rd.number("lora_alpha", &out->lora_alpha));
  LMX_RETURN_IF_ERROR(rd.boolean("use_rslora", &out->use_rslora));
  LMX_RETURN_IF_ERROR(rd.names("target_modules", &out->target_modules, &out->target_modules_regex));
  LMX_RETURN_IF_ERROR(rd.names("exclude_modules", &out->exclude_modules, &out->exclude_modules_regex));
  LMX_RETURN_IF_ERROR(rd.names("target_parameters", &out->target_parameters, nullptr));
  LMX_RETURN_IF_ERROR(rd.string("base_model_name_or_path", &out->base_model_name_or_path));
  LMX_RETURN_IF_ERROR(rd.string("peft_version", &out->peft_version));

  for (const char* field : {"rank_pattern", "alpha_pattern"}) {
    if (!rd.present(field)) continue;
    const json& v = root.at(field);
    if (!v.is_object()) return invalid_argument(rd.where(field) + ": expected an object {pattern: value}, found " + type_of(v));
    for (auto it = v.begin(); it != v.end(); ++it) {
      std::string where = rd.where(field) + " key " + in_quotes(it.key());
      LMX_RETURN_IF_ERROR(check_compiles("(.*\\.)?(" + it.key() + ")", where));
      const json& value = it.value();
      if (std::string_view(field) == "rank_pattern") {
        if (!value.is_number_integer() || value.get<int64_t>() < 1 || value.get<int64_t>() > (1 << 30))
          return invalid_argument(where + ": expected a positive integer rank, found " + shown(value));
        out->rank_pattern.emplace_back(it.key(), int(value.get<int64_t>()));
      } else {
        if (!value.is_number() || !std::isfinite(value.get<double>()))
          return invalid_argument(where + ": expected a finite number, found " + shown(value));
        out->alpha_pattern.emplace_back(it.key(), value.get<double>());
      }
    }
  }

  if (rd.present("layers_to_transform")) {
    const json& v = root.at("layers_to_transform");
    auto one = [&](const json& item, const std::string& where) -> Status {
      if (!item.is_number_integer() || item.get<int64_t>() < 0 || item.get<int64_t>() > (1 << 30))
        return invalid_argument(where + ": expected a layer index >= 0, found " + shown(item));
      out->layers_to_transform.push_back(int(item.get<int64_t>()));
      return Status::Ok();
    };
    if (v.is_array()) {
      for (size_t i = 0; i < v.size(); ++i)
        LMX_RETURN_IF_ERROR(one(v[i], rd.where("layers_to_transform") + "[" + std::to_string(i) + "]"));
    } else {
      LMX_RETURN_IF_ERROR(one(v, rd.where("layers_to_transform")));
    }
  }
  if (rd.present("layers_pattern")) {
    const json& v = root.at("layers_pattern");
    if (v.is_string()) {
      if (!v.get<std::string>().empty()) out->layers_pattern.push_back(v.get<std::string>());
    } else {
      LMX_RETURN_IF_ERROR(rd.names("layers_pattern", &out->layers_pattern, nullptr));
    }
    for (const std::string& p : out->layers_pattern)
      LMX_RETURN_IF_ERROR(check_compiles(p, rd.where("layers_pattern")));
  }
  if (out->target_modules_regex && !out->layers_to_transform.empty())
    return invalid_argument(rd.where("layers_to_transform") + ": cannot be used when 'target_modules' is a regex string");

  // What loramux cannot reproduce exactly is refused, each with the field and the reason.
  std::string bias = "none";
  LMX_RETURN_IF_ERROR(rd.string("bias", &bias));
  if (bias != "none")
    return unsupported(rd.where("bias") + ": expected \"none\", found " + in_quotes(bias) +
                       " (trained base-model biases are not served)");
  bool flag = false;
  LMX_RETURN_IF_ERROR(rd.boolean("use_dora", &flag));
  if (flag) return unsupported(rd.where("use_dora") + ": DoRA adapters are not supported (expected false, found true)");
  flag = false;
  LMX_RETURN_IF_ERROR(rd.boolean("lora_bias", &flag));
  if (flag) return unsupported(rd.where("lora_bias") + ": LoRA bias terms are not supported (expected false, found true)");
  flag = false;
  LMX_RETURN_IF_ERROR(rd.boolean("fan_in_fan_out", &flag));
  if (flag)
    return unsupported(rd.where("fan_in_fan_out") +
                       ": expected false, found true (Conv1D-style transposed layers do not exist in loramux models)");
  LMX_RETURN_IF_ERROR(must_be_absent_or_empty(root, source, "modules_to_save",
                                              "fully fine-tuned modules are not supported, only LoRA pairs"));
  LMX_RETURN_IF_ERROR(must_be_absent_or_empty(root, source, "trainable_token_indices",
                                              "trainable token embeddings are not supported"));
  LMX_RETURN_IF_ERROR(must_be_absent_or_empty(root, source, "layer_replication", "layer replication is not supported"));
  LMX_RETURN_IF_ERROR(must_be_absent_or_empty(root, source, "alora_invocation_tokens",
                                              "activated LoRA (aLoRA) is not supported"));
  for (const char* variant : {"use_qalora", "use_bdlora", "velora_config", "kasa_config", "monteclora_config"})
    LMX_RETURN_IF_ERROR(must_be_absent_or_empty(root, source, variant, "this LoRA variant is not supported"));
  if (rd.present("init_lora_weights") && root.at("init_lora_weights").is_string()) {
    std::string init = root.at("init_lora_weights").get<std::string>();
    for (const char* modifies_base : {"pissa", "olora", "corda", "loftq", "lora_ga"})
      if (init.rfind(modifies_base, 0) == 0)
        return unsupported(rd.where("init_lora_weights") + ": " + in_quotes(init) +
                           " changes the base weights; save the adapter with path_initial_model_for_weight_conversion "
                           "to convert it to plain LoRA");
  }

  if (rd.present("loramux_fused_lora_a_dim")) {
    int dim = 0;
    LMX_RETURN_IF_ERROR(rd.integer("loramux_fused_lora_a_dim", &dim, 1));
    if (dim != 1 && dim != 2)
      return invalid_argument(rd.where("loramux_fused_lora_a_dim") + ": expected 1 or 2, found " + std::to_string(dim));
    out->fused_lora_a_dim = dim;
  }
  if (out->target_modules.empty() && !out->target_modules_regex && out->target_parameters.empty())
    return invalid_argument(source + ": neither 'target_modules' nor 'target_parameters' names anything");
  return Status::Ok();
}

Result<int> rank_for(const AdapterConfig& config, const std::string& key) {
  for (const auto& [pattern, rank] : config.rank_pattern) {
    LMX_ASSIGN_OR_RETURN(bool hit, matches_suffix_pattern(pattern, key, config.source + ": rank_pattern key " + in_quotes(pattern)));
    if (hit) return rank;
  }
  return config.r;
}

Result<double> alpha_for(const AdapterConfig& config, const std::string& key) {
  for (const auto& [pattern, alpha] : config.alpha_pattern) {
    LMX_ASSIGN_OR_RETURN(bool hit, matches_suffix_pattern(pattern, key, config.source + ": alpha_pattern key " + in_quotes(pattern)));
    if (hit) return alpha;
  }
  return config.lora_alpha;
}

// PEFT's layer index of `key`: the first numbered path segment that follows a segment matching a
// layers_pattern entry, or with no pattern the first numbered segment after the second segment
// ("model.layers.3..." -> 3). -1 when there is none (PEFT then does not target the module).
static Result<int> layer_index_of(const AdapterConfig& config, const std::string& key) {
  std::vector<std::string> segments;
  for (size_t pos = 0;;) {
    size_t dot = key.find('.', pos);
    segments.push_back(key.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos));
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  auto is_index = [](const std::string& s) {
    if (s.empty() || s.size() > 9) return false;
    for (char c : s)
      if (c < '0' || c > '9') return false;
    return true;
  };
  for (size_t i = 1; i + 1 < segments.size(); ++i) {
    if (!is_index(segments[i])) continue;
    if (config.layers_pattern.empty()) {
      if (i >= 2) return std::stoi(segments[i]);
      continue;
    }
    for (const std::string& p : config.layers_pattern) {
      LMX_ASSIGN_OR_RETURN(bool hit, matches_full(p, segments[i - 1], config.source + ": layers_pattern"));
      if (hit) return std::stoi(segments[i]);
    }
  }
  return -1;
}

Result<bool> targets_module(const AdapterConfig& config, const std::string& key) {
  if (config.exclude_modules_regex) {
    LMX_ASSIGN_OR_RETURN(bool excluded, matches_full(*config.exclude_modules_regex, key, config.source + ": exclude_modules"));
    if (excluded) return false;
  } else if (matches_name_list(config.exclude_modules, key)) {
    return false;
  }
  if (config.target_modules_regex)
    return matches_full(*config.target_modules_regex, key, config.source + ": target_modules");
  if (!matches_name_list(config.target_modules, key)) return false;
  if (config.layers_to_transform.empty()) return true;
  LMX_ASSIGN_OR_RETURN(int layer, layer_index_of(config, key));
  for (int l : config.layers_to_transform)
    if (l == layer) return true;
  return false;
}

bool targets_parameter(const AdapterConfig& config, const std::string& key) {
  return matches_name_list(config.target_parameters, key);
}

bool parse_peft_version(const std::string& version, int out[3]) {
  out[0] = out[1] = out[2] = 0;
  size_t i = 0;
  for (int part = 0; part < 3; ++part) {
    if (i >= version.size() || version[i] < '0' || version[i] > '9') return part > 0;
    int value = 0;
    while (i < version.size() && version[i] >= '0' && version[i] <= '9' && value < 100000) value = value * 10 + (version[i++] - '0');
    out[part] = value;
    if (i < version.size() && version[i] == '.') ++i;
    else return true;
  }
  return true;
}

}  // namespace lmx::lora
