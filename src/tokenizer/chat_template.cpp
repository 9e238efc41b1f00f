// Chat rendering on top of the Jinja interpreter: finding a model's template, building the variables
// transformers passes to it, and normalizing messages the way apply_chat_template does (transformers 5.x:
// _normalize_chat_messages, _alias_reasoning_fields, render_jinja_template). The interpreter is jinja_*.cpp.
#include "tokenizer/chat_template.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "tokenizer/jinja_ast.h"

namespace lmx::tokenizer {
namespace {

Result<std::string> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return io_error("cannot read chat template file '" + path + "'");
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// One message as transformers hands it to the template.
Result<jinja::Value> normalize_message(const nlohmann::ordered_json& message, std::size_t index) {
  if (!message.is_object()) return invalid_argument("messages[" + std::to_string(index) + "] is not an object");
  jinja::Object out;
  // Keys whose value is null are dropped (templates handle a missing key, not a None one).
  for (auto it = message.begin(); it != message.end(); ++it)
    if (!it.value().is_null()) out.items.emplace_back(it.key(), jinja::from_json(it.value()));
  // Reasoning under any of its names is exposed as both `reasoning_content` (what most templates read) and
  // `thinking` (what gpt-oss templates read): {"thinking": r, **message, "reasoning_content": r}.
  const jinja::Value* reasoning = nullptr;
  for (const char* key : {"reasoning_content", "thinking", "reasoning"})
    if (!reasoning) reasoning = out.find(key);
  if (reasoning) {
    jinja::Value r = *reasoning;
    jinja::Object aliased;
    aliased.items.emplace_back("thinking", r);
    for (auto& [k, v] : out.items) aliased.set(k, v);
    aliased.set("reasoning_content", r);
    out = std::move(aliased);
  }
  return jinja::Value::from_object(std::move(out));
}

std::string token_content(const nlohmann::ordered_json& token) {
  if (token.is_string()) return token.get<std::string>();
  if (token.is_object() && token.contains("content") && token["content"].is_string()) return token["content"].get<std::string>();
  return {};
}

}  // namespace

Result<ChatTemplate> ChatTemplate::parse(const std::string& source, const std::string& origin) {
  LMX_ASSIGN_OR_RETURN(auto program, jinja::parse(source, origin));
  ChatTemplate t;
  t.program_ = std::move(program);
  t.origin_ = origin;
  return t;
}

Result<std::string> ChatTemplate::render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& extra) const {
  if (!messages.is_array()) return invalid_argument("chat messages must be a JSON array");
  if (messages.empty()) return invalid_argument("cannot render an empty conversation");
  if (!extra.is_null() && !extra.is_object()) return invalid_argument("chat template variables must be a JSON object");
  jinja::Array normalized;
  for (std::size_t i = 0; i < messages.size(); ++i) {
    LMX_ASSIGN_OR_RETURN(auto message, normalize_message(messages[i], i));
    normalized.push_back(std::move(message));
  }
  bool has_tools = extra.is_object() && extra.contains("tools") && !extra["tools"].is_null();
  if (has_tools && !extra["tools"].is_array()) return invalid_argument("'tools' must be a JSON array");
  // The order of render(messages=..., tools=..., documents=..., add_generation_prompt=..., **kwargs) in
  // transformers, where kwargs = special tokens overridden by the caller's keywords.
  jinja::Object vars;
  vars.set("messages", jinja::Value::from_array(std::move(normalized)));
  vars.set("tools", jinja::Value::none());
  vars.set("documents", jinja::Value::none());
  vars.set("add_generation_prompt", jinja::Value::from_bool(false));
  for (auto it = special_tokens_.begin(); it != special_tokens_.end(); ++it) vars.set(it.key(), jinja::from_json(it.value()));
  if (extra.is_object())
    for (auto it = extra.begin(); it != extra.end(); ++it) vars.set(it.key(), jinja::from_json(it.value()));
  const jinja::Program& program = has_tools && tool_use_program_ ? *tool_use_program_ : *program_;
  return jinja::render(program, vars);
}

Result<ChatTemplate> load_chat_template(const std::string& model_dir, const std::string& override_file) {
  namespace fs = std::filesystem;
  nlohmann::ordered_json config = nlohmann::ordered_json::object();
  const fs::path config_path = fs::path(model_dir) / "tokenizer_config.json";
  if (!model_dir.empty() && fs::exists(config_path)) {
    LMX_ASSIGN_OR_RETURN(std::string text, read_file(config_path.string()));
    config = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object()) return invalid_argument(config_path.string() + ": not a JSON object");
  }
  Result<ChatTemplate> loaded = invalid_argument("no chat template");
  if (!override_file.empty()) {
    LMX_ASSIGN_OR_RETURN(std::string source, read_file(override_file));
    loaded = ChatTemplate::parse(source, override_file);
  } else if (fs::path jinja_path = fs::path(model_dir) / "chat_template.jinja"; fs::exists(jinja_path)) {
    LMX_ASSIGN_OR_RETURN(std::string source, read_file(jinja_path.string()));
    loaded = ChatTemplate::parse(source, jinja_path.string());
  } else if (config.contains("chat_template")) {
    const auto& field = config["chat_template"];
    const std::string origin = config_path.string() + " chat_template";
    if (field.is_string()) {
      loaded = ChatTemplate::parse(field.get<std::string>(), origin);
    } else if (field.is_array()) {
      std::string default_source, tool_use_source;
      for (const auto& entry : field) {
        if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") || !entry["template"].is_string())
          return invalid_argument(origin + ": list entries must be {\"name\", \"template\"} objects");
        if (entry["name"] == "default") default_source = entry["template"].get<std::string>();
        if (entry["name"] == "tool_use") tool_use_source = entry["template"].get<std::string>();
      }
      if (default_source.empty()) return invalid_argument(origin + ": the list of templates has none named \"default\"");
      loaded = ChatTemplate::parse(default_source, origin + "[default]");
      if (loaded.ok() && !tool_use_source.empty()) {
        LMX_ASSIGN_OR_RETURN(auto tool_use, jinja::parse(tool_use_source, origin + "[tool_use]"));
        loaded->tool_use_program_ = std::move(tool_use);
      }
    } else {
      return invalid_argument(origin + ": must be a string or a list of {name, template}");
    }
  } else {
    return not_found("no chat template in '" + model_dir + "' (neither chat_template.jinja nor tokenizer_config.json "
                     "\"chat_template\"); pass --chat-template FILE");
  }
  if (!loaded.ok()) return loaded.status();
  // The special tokens transformers exposes as template variables (its special_tokens_map).
  nlohmann::ordered_json tokens = nlohmann::ordered_json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (!config.contains(key)) continue;
    std::string content = token_content(config[key]);
    if (!content.empty()) tokens[key] = content;
  }
  loaded->set_special_tokens(std::move(tokens));
  return loaded;
}

}  // namespace lmx::tokenizer
