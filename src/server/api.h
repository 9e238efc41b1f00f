// The OpenAI schema as the server speaks it: request bodies parsed and validated into engine requests, and
// the JSON of responses, stream chunks and errors. Pure functions (no I/O, no engine), so every rule is
// unit-tested in tests/server. Who calls: http_server.cpp.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/request.h"

namespace lmx::server {

// An error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}, sent with `status`.
struct ApiError {
  int status = 400;
  std::string message;
  std::string param;  // the offending field, "" when none
};
ApiError bad_request(std::string message, std::string param = "");
nlohmann::json error_json(const ApiError& error);
// Every response body goes through this: invalid UTF-8 in an echoed string is replaced, never thrown.
std::string dump_json(const nlohmann::json& j);

// What request bodies are validated against.
struct ModelInfo {
  std::string served_name;  // `model` value that selects the base model
  int max_model_len = 0;
  int vocab_size = 0;
  bool has_tokenizer = false;      // text prompts and stop strings
  bool has_chat_template = false;  // /v1/chat/completions
};

struct ChatMessage {
  std::string role;
  std::string content;
};

enum class Endpoint { kCompletions, kChat };

// A validated /v1/completions or /v1/chat/completions request. Exactly one of prompt_ids, prompt_text,
// messages is the prompt; text and messages are encoded by the server's text codec before submission.
struct GenerateRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;  // as given ("" = base)
  std::vector<int32_t> prompt_ids;
  std::optional<std::string> prompt_text;
  std::vector<ChatMessage> messages;
  engine::SamplingOptions sampling;
  bool max_tokens_given = false;  // else: 16 for completions, the rest of the context for chat
  std::vector<std::string> stop;  // stop strings (need a tokenizer)
  bool stream = false;
  bool include_usage = false;     // stream_options.include_usage
};

// Parse a request body; the error names the field (param) and says what was expected.
std::optional<ApiError> parse_generate_request(std::string_view body, Endpoint endpoint, const ModelInfo& model,
                                               GenerateRequest* out);
// After the prompt is in ids: vocabulary, length against max_model_len, the default max_tokens.
std::optional<ApiError> finalize_prompt(const ModelInfo& model, GenerateRequest* request);

// POST /v1/load_lora_adapter {lora_name, lora_path} and /v1/unload_lora_adapter {lora_name}.
struct AdapterRequest {
  std::string name;
  std::string path;  // load only
};
std::optional<ApiError> parse_adapter_request(std::string_view body, bool needs_path, const ModelInfo& model,
                                              AdapterRequest* out);

// Response pieces. `id` is "cmpl-..." / "chatcmpl-...", `created` unix seconds.
struct ResponseHeader {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string id;
  int64_t created = 0;
  std::string model;
};
struct Usage {
  int prompt_tokens = 0;
  int completion_tokens = 0;
};
nlohmann::json usage_json(const Usage& usage);

// One generated token's logprobs as a response shows them. Token texts are the token's own bytes (the
// server's TextCodec::token_text), or "token_id:ID" without a tokenizer (vLLM's convention).
struct LogprobEntry {
  std::string token;
  float logprob = 0.0f;
};
struct TokenLogprobView {
  LogprobEntry sampled;
  std::vector<LogprobEntry> top;  // [N] most likely first
  int text_offset = 0;            // completions: characters (code points) of the completion text before it
};
// choices[].logprobs for `endpoint`: completions' legacy {tokens, token_logprobs, top_logprobs (one
// {text: logprob} object per token: the top N and the sampled token), text_offset}; chat's {content:
// [{token, logprob, bytes, top_logprobs: [N x {token, logprob, bytes}]}]}. -inf is sent as -9999.0 (vLLM).
nlohmann::json logprobs_json(Endpoint endpoint, const std::vector<TokenLogprobView>& tokens);

// A whole (non-streamed) response: one choice with text, token_ids, finish_reason and `logprobs` (null
// when not requested).
nlohmann::json full_response(const ResponseHeader& h, const std::string& text, const std::vector<int32_t>& token_ids,
                             engine::FinishReason finish, const Usage& usage, const nlohmann::json& logprobs = nullptr);
// One stream chunk with new text/ids (and their logprobs); finish kNone = not finished. `with_usage_null`
// adds "usage": null (OpenAI's convention for chunks before the usage chunk when include_usage is set).
nlohmann::json stream_chunk(const ResponseHeader& h, const std::string& text, const std::vector<int32_t>& token_ids,
                            engine::FinishReason finish, bool with_usage_null, bool first_chat_chunk,
                            const nlohmann::json& logprobs = nullptr);
// The last chunk when include_usage: no choices, the usage.
nlohmann::json usage_chunk(const ResponseHeader& h, const Usage& usage);
// "data: <json>\n\n"
std::string sse_event(const nlohmann::json& j);

}  // namespace lmx::server
