// ChatTemplate: a model's Jinja chat template, loaded from a Hugging Face directory (chat_template.jinja or
// tokenizer_config.json) or a --chat-template file, and rendered to the prompt text exactly as transformers'
// apply_chat_template(..., tokenize=False) renders it. Tokenizing the text is Tokenizer's job, not this one's.
// Used by the server (chat completions), `loramux generate --messages` and tests.
#pragma once
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "core/status.h"

namespace lmx::jinja {
struct Program;
}

namespace lmx::tokenizer {

class ChatTemplate {
 public:
  // Parse a template; unsupported Jinja syntax fails here with "<origin>:<line>: <what>".
  static Result<ChatTemplate> parse(const std::string& source, const std::string& origin);

  // Render `messages` (an array of {role, content, ...} objects) with the template variables in `extra`:
  // tools, add_generation_prompt, enable_thinking, documents, or any other keyword the template reads.
  // As transformers does: null-valued message keys are dropped, reasoning is aliased across
  // reasoning_content/thinking/reasoning, `tools`/`documents` default to None, add_generation_prompt to
  // false, and the special tokens (bos_token, eos_token, ...) from tokenizer_config.json are defined unless
  // `extra` overrides them. Errors (raise_exception, undefined values used strictly, bad input) name the line.
  // ordered_json, because Python dicts keep key order and `tools | tojson` must print keys in request order.
  Result<std::string> render(const nlohmann::ordered_json& messages, const nlohmann::ordered_json& extra) const;

  const std::string& origin() const { return origin_; }
  // Special-token variables the template sees (bos_token, eos_token, pad_token, unk_token, ...).
  const nlohmann::ordered_json& special_tokens() const { return special_tokens_; }
  void set_special_tokens(nlohmann::ordered_json tokens) { special_tokens_ = std::move(tokens); }

 private:
  friend Result<ChatTemplate> load_chat_template(const std::string&, const std::string&);
  std::shared_ptr<const jinja::Program> program_;
  // tokenizer_config.json may ship a named "tool_use" template, which transformers picks when tools are given.
  std::shared_ptr<const jinja::Program> tool_use_program_;
  std::string origin_;
  nlohmann::ordered_json special_tokens_ = nlohmann::ordered_json::object();
};

// The template of a Hugging Face model directory: `override_file` when non-empty (--chat-template FILE),
// else <dir>/chat_template.jinja, else tokenizer_config.json's "chat_template" (a string, or a list of
// {name, template} where "default" is used and "tool_use" is kept for requests with tools).
// Special tokens come from tokenizer_config.json (strings or {"content": ...} AddedToken objects).
Result<ChatTemplate> load_chat_template(const std::string& model_dir, const std::string& override_file);

}  // namespace lmx::tokenizer
