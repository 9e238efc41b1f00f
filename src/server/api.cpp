// OpenAI request parsing/validation and response JSON (see api.h).
#include "server/api.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/sampling.h"

namespace lmx::server {

using nlohmann::json;

ApiError bad_request(std::string message, std::string param) { return {400, std::move(message), std::move(param)}; }

namespace {

const char* error_type(int status) {
  switch (status) {
    case 401: return "authentication_error";
    case 404: return "not_found_error";
    case 409: return "conflict_error";
    case 413: return "request_too_large";
    case 429: return "rate_limit_error";
    case 503: return "service_unavailable";
    default: return status >= 500 ? "server_error" : "invalid_request_error";
  }
}

// Field readers: absent or null leaves `out` alone; a wrong type or value is an error naming the field.
std::optional<ApiError> read_int(const json& body, const char* field, int64_t lo, int64_t hi, std::optional<int64_t>* out) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer()) return bad_request(std::string(field) + " must be an integer", field);
  int64_t v;
  if (it->is_number_unsigned()) {
    uint64_t u = it->get<uint64_t>();
    v = u > uint64_t(std::numeric_limits<int64_t>::max()) ? std::numeric_limits<int64_t>::max() : int64_t(u);
  } else {
    v = it->get<int64_t>();
  }
  if (v < lo || v > hi)
    return bad_request(std::string(field) + " must be in [" + std::to_string(lo) + ", " + std::to_string(hi) + "], got " +
                           std::to_string(v), field);
  *out = v;
  return std::nullopt;
}

std::optional<ApiError> read_float(const json& body, const char* field, std::optional<double>* out) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) return bad_request(std::string(field) + " must be a number", field);
  double v = it->get<double>();
  if (!std::isfinite(v)) return bad_request(std::string(field) + " must be finite", field);
  *out = v;
  return std::nullopt;
}

std::optional<ApiError> read_bool(const json& body, const char* field, bool* out) {
  auto it = body.find(field);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) return bad_request(std::string(field) + " must be true or false", field);
  *out = it->get<bool>();
  return std::nullopt;
}

bool is_int_array(const json& j) {
  if (!j.is_array()) return false;
  for (const json& x : j)
    if (!x.is_number_integer()) return false;
  return true;
}

std::optional<ApiError> read_token_ids(const json& j, const char* field, std::vector<int32_t>* out) {
  for (const json& x : j) {
    if (x.is_number_unsigned() ? x.get<uint64_t>() > uint64_t(std::numeric_limits<int32_t>::max())
                               : (x.get<int64_t>() < std::numeric_limits<int32_t>::min() ||
                                  x.get<int64_t>() > std::numeric_limits<int32_t>::max()))
      return bad_request(std::string(field) + " holds a token id outside the int32 range", field);
    out->push_back(int32_t(x.get<int64_t>()));
  }
  return std::nullopt;
}

// `prompt` as the OpenAI API allows it: a string, an array of token ids, or a batch of one of either.
std::optional<ApiError> read_prompt(const json& body, GenerateRequest* out) {
  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return bad_request("prompt is required", "prompt");
  const json* p = &*it;
  if (p->is_array() && !p->empty() && (p->front().is_array() || p->front().is_string())) {
    if (p->size() != 1) return bad_request("prompt: only one prompt per request is supported", "prompt");
    p = &p->front();
  }
  if (p->is_string()) {
    out->prompt_text = p->get<std::string>();
    if (out->prompt_text->empty()) return bad_request("prompt is empty", "prompt");
    return std::nullopt;
  }
  if (!is_int_array(*p)) return bad_request("prompt must be a string or an array of integer token ids", "prompt");
  if (p->empty()) return bad_request("prompt is empty", "prompt");
  return read_token_ids(*p, "prompt", &out->prompt_ids);
}

std::optional<ApiError> read_messages(const json& body, GenerateRequest* out) {
  auto it = body.find("messages");
  if (it == body.end() || !it->is_array() || it->empty())
    return bad_request("messages must be a non-empty array of {role, content}", "messages");
  for (size_t i = 0; i < it->size(); ++i) {
    const json& m = (*it)[i];
    std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string())
      return bad_request(where + " must be an object with a string role", "messages");
    ChatMessage msg{m["role"].get<std::string>(), ""};
    const json& content = m.contains("content") ? m["content"] : json();
    if (content.is_string()) {
      msg.content = content.get<std::string>();
    } else if (content.is_array()) {  // content parts: only text parts are supported
      for (const json& part : content) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
          return bad_request(where + ".content: only text parts are supported", "messages");
        msg.content += part["text"].get<std::string>();
      }
    } else if (!content.is_null()) {
      return bad_request(where + ".content must be a string or an array of text parts", "messages");
    }
    out->messages.push_back(std::move(msg));
  }
  return std::nullopt;
}

// Logprobs: completions take `logprobs: N` (the legacy API; false = off); chat takes `logprobs: true` with
// `top_logprobs: N`. Either way N is in [0, kMaxTopLogprobs] and becomes SamplingOptions::logprobs.
std::optional<ApiError> read_logprobs(const json& body, Endpoint endpoint, engine::SamplingOptions* so) {
  constexpr int64_t kMax = ops::kMaxTopLogprobs;
  const std::string range = "[0, " + std::to_string(kMax) + "]";
  auto lp = body.find("logprobs");
  const bool given = lp != body.end() && !lp->is_null();
  std::optional<int64_t> top;
  if (endpoint == Endpoint::kCompletions) {
    if (body.contains("top_logprobs") && !body["top_logprobs"].is_null())
      return bad_request("top_logprobs belongs to /v1/chat/completions; here logprobs: N asks for N alternatives",
                         "top_logprobs");
    if (!given || *lp == false) return std::nullopt;
    if (!lp->is_number_integer()) return bad_request("logprobs must be an integer in " + range + " or null", "logprobs");
    if (auto e = read_int(body, "logprobs", 0, kMax, &top)) return e;
    so->logprobs = int(*top);
    return std::nullopt;
  }
  bool wanted = false;
  if (auto e = read_bool(body, "logprobs", &wanted)) return e;
  if (auto e = read_int(body, "top_logprobs", 0, kMax, &top)) return e;
  if (top && *top > 0 && !wanted) return bad_request("top_logprobs needs logprobs: true", "top_logprobs");
  if (wanted) so->logprobs = int(top.value_or(0));
  return std::nullopt;
}

// Options this server does not implement are refused by name rather than silently ignored.
std::optional<ApiError> refuse_unsupported(const json& body) {
  auto set = [&](const char* f) { return body.contains(f) && !body[f].is_null(); };
  if (set("n") && !(body["n"].is_number_integer() && body["n"].get<int64_t>() == 1))
    return bad_request("n: only n=1 is supported", "n");
  if (set("best_of") && !(body["best_of"].is_number_integer() && body["best_of"].get<int64_t>() == 1))
    return bad_request("best_of: only best_of=1 is supported", "best_of");
  if (set("echo") && body["echo"] != false) return bad_request("echo is not supported", "echo");
  for (const char* f : {"presence_penalty", "frequency_penalty", "repetition_penalty"})
    if (set(f) && !(body[f].is_number() && body[f].get<double>() == (std::string(f) == "repetition_penalty" ? 1.0 : 0.0)))
      return bad_request(std::string(f) + " is not supported", f);
  if (set("logit_bias") && !(body["logit_bias"].is_object() && body["logit_bias"].empty()))
    return bad_request("logit_bias is not supported", "logit_bias");
  if (set("suffix")) return bad_request("suffix is not supported", "suffix");
  return std::nullopt;
}

}  // namespace

json error_json(const ApiError& e) {
  return {{"error",
           {{"message", e.message},
            {"type", error_type(e.status)},
            {"param", e.param.empty() ? json(nullptr) : json(e.param)},
            {"code", e.status}}}};
}

std::string dump_json(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

std::optional<ApiError> parse_generate_request(std::string_view body_text, Endpoint endpoint, const ModelInfo& model,
                                               GenerateRequest* out) {
  *out = GenerateRequest{};
  out->endpoint = endpoint;
  // nlohmann rejects ill-formed UTF-8 inside strings, so invalid UTF-8 is a malformed body here.
  json body = json::parse(body_text, nullptr, false);
  if (body.is_discarded()) return bad_request("the body is not valid JSON (or not valid UTF-8)");
  if (!body.is_object()) return bad_request("the body must be a JSON object");

  if (auto it = body.find("model"); it != body.end() && !it->is_null()) {
    if (!it->is_string()) return bad_request("model must be a string", "model");
    out->model = it->get<std::string>();
  }
  if (endpoint == Endpoint::kCompletions) {
    if (auto e = read_prompt(body, out)) return e;
  } else {
    if (auto e = read_messages(body, out)) return e;
  }
  if (auto e = refuse_unsupported(body)) return e;
  if (auto e = read_logprobs(body, endpoint, &out->sampling)) return e;

  engine::SamplingOptions& so = out->sampling;
  std::optional<int64_t> max_tokens, top_k, seed;
  std::optional<double> temperature, top_p;
  const char* max_field = "max_tokens";
  if (endpoint == Endpoint::kChat && body.contains("max_completion_tokens") && !body["max_completion_tokens"].is_null())
    max_field = "max_completion_tokens";
  if (auto e = read_int(body, max_field, 1, std::numeric_limits<int32_t>::max(), &max_tokens)) return e;
  if (auto e = read_float(body, "temperature", &temperature)) return e;
  if (auto e = read_float(body, "top_p", &top_p)) return e;
  if (auto e = read_int(body, "top_k", -1, std::numeric_limits<int32_t>::max(), &top_k)) return e;
  if (auto e = read_int(body, "seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max(), &seed)) return e;
  if (auto e = read_bool(body, "ignore_eos", &so.ignore_eos)) return e;
  if (auto e = read_bool(body, "stream", &out->stream)) return e;
  if (max_tokens) {
    so.max_tokens = int(*max_tokens);
    out->max_tokens_given = true;
  }
  if (temperature) {
    if (*temperature < 0) return bad_request("temperature must be >= 0", "temperature");
    so.temperature = float(*temperature);
  }
  if (top_p) {
    if (!(*top_p > 0 && *top_p <= 1)) return bad_request("top_p must be in (0, 1]", "top_p");
    so.top_p = float(*top_p);
  }
  if (top_k) so.top_k = *top_k < 0 ? 0 : int(*top_k);  // vLLM's -1 = off, like 0
  if (seed) so.seed = uint64_t(*seed);

  if (auto it = body.find("stop_token_ids"); it != body.end() && !it->is_null()) {
    if (!is_int_array(*it)) return bad_request("stop_token_ids must be an array of integer token ids", "stop_token_ids");
    if (auto e = read_token_ids(*it, "stop_token_ids", &so.stop_token_ids)) return e;
    for (int32_t id : so.stop_token_ids)
      if (id < 0 || id >= model.vocab_size)
        return bad_request("stop_token_ids: " + std::to_string(id) + " is outside the vocabulary [0, " +
                               std::to_string(model.vocab_size) + ")", "stop_token_ids");
  }
  if (auto it = body.find("stop"); it != body.end() && !it->is_null()) {
    if (it->is_string()) {
      out->stop.push_back(it->get<std::string>());
    } else if (it->is_array()) {
      for (const json& s : *it) {
        if (!s.is_string()) return bad_request("stop must be a string or an array of strings", "stop");
        out->stop.push_back(s.get<std::string>());
      }
    } else {
      return bad_request("stop must be a string or an array of strings", "stop");
    }
    for (const std::string& s : out->stop)
      if (s.empty()) return bad_request("stop strings must not be empty", "stop");
    if (!out->stop.empty() && !model.has_tokenizer)
      return bad_request("stop strings need a tokenizer and this model has none; use stop_token_ids", "stop");
  }
  if (auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return bad_request("stream_options must be an object", "stream_options");
    if (!out->stream) return bad_request("stream_options is only allowed when stream is true", "stream_options");
    if (auto e = read_bool(*it, "include_usage", &out->include_usage)) {
      e->param = "stream_options.include_usage";
      return e;
    }
  }
  if (out->prompt_text && !model.has_tokenizer)
    return bad_request("text prompts need a tokenizer and this model has none (serve it with --tokenizer DIR); send "
                       "prompt as an array of token ids", "prompt");
  if (endpoint == Endpoint::kChat && !model.has_chat_template)
    return bad_request(model.has_tokenizer
                           ? "this model has no chat template (serve it with --chat-template FILE); use /v1/completions"
                           : "this model has no tokenizer and so no chat template (serve it with --tokenizer DIR); use "
                             "/v1/completions with token ids", "messages");
  if (!out->prompt_ids.empty()) return finalize_prompt(model, out);
  return std::nullopt;
}

std::optional<ApiError> finalize_prompt(const ModelInfo& model, GenerateRequest* r) {
  const int64_t n = int64_t(r->prompt_ids.size());
  if (n == 0) return bad_request("prompt is empty", "prompt");
  for (size_t i = 0; i < r->prompt_ids.size(); ++i) {
    int32_t id = r->prompt_ids[i];
    if (id < 0 || id >= model.vocab_size)
      return bad_request("prompt token " + std::to_string(i) + " is " + std::to_string(id) + ", outside the vocabulary [0, " +
                             std::to_string(model.vocab_size) + ")", "prompt");
  }
  if (!r->max_tokens_given) {
    // OpenAI's completions default is 16; chat generates until the context is full (or a stop).
    int64_t rest = model.max_model_len - n;
    r->sampling.max_tokens = int(r->endpoint == Endpoint::kChat ? rest : std::min<int64_t>(16, rest));
  }
  if (n + std::max(r->sampling.max_tokens, 1) > model.max_model_len)
    return bad_request("This model's maximum context length is " + std::to_string(model.max_model_len) +
                           " tokens. However, you requested " + std::to_string(n + r->sampling.max_tokens) + " tokens (" +
                           std::to_string(n) + " in the prompt, " + std::to_string(r->sampling.max_tokens) +
                           " in the completion). Please reduce the prompt or max_tokens.",
                       r->max_tokens_given ? "max_tokens" : "prompt");
  return std::nullopt;
}

std::optional<ApiError> parse_adapter_request(std::string_view body_text, bool needs_path, const ModelInfo& model,
                                              AdapterRequest* out) {
  json body = json::parse(body_text, nullptr, false);
  if (body.is_discarded()) return bad_request("the body is not valid JSON (or not valid UTF-8)");
  if (!body.is_object()) return bad_request("the body must be a JSON object");
  auto name = body.find("lora_name");
  if (name == body.end() || !name->is_string() || name->get<std::string>().empty())
    return bad_request("lora_name must be a non-empty string", "lora_name");
  out->name = name->get<std::string>();
  if (out->name.size() > 256) return bad_request("lora_name is longer than 256 characters", "lora_name");
  for (unsigned char c : out->name)
    if (c < 0x20 || c == 0x7f) return bad_request("lora_name must not contain control characters", "lora_name");
  if (out->name == model.served_name)
    return bad_request("lora_name '" + out->name + "' is the base model's name", "lora_name");
  if (needs_path) {
    auto path = body.find("lora_path");
    if (path == body.end() || !path->is_string() || path->get<std::string>().empty())
      return bad_request("lora_path must be a non-empty string", "lora_path");
    out->path = path->get<std::string>();
  }
  return std::nullopt;
}

json usage_json(const Usage& u) {
  return {{"prompt_tokens", u.prompt_tokens},
          {"completion_tokens", u.completion_tokens},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

namespace {

json finish_json(engine::FinishReason finish) {
  if (finish == engine::FinishReason::kNone) return nullptr;
  return engine::finish_reason_name(finish);
}

json header_json(const ResponseHeader& h, bool chunk) {
  const char* object = h.endpoint == Endpoint::kChat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion";
  return {{"id", h.id}, {"object", object}, {"created", h.created}, {"model", h.model}};
}

}  // namespace

namespace {

// vLLM's stand-in for -inf, which JSON cannot carry.
double logprob_value(float logprob) { return std::max(double(logprob), -9999.0); }

json token_bytes_json(const std::string& token) {
  json bytes = json::array();
  for (unsigned char c : token) bytes.push_back(int(c));
  return bytes;
}

}  // namespace

json logprobs_json(Endpoint endpoint, const std::vector<TokenLogprobView>& tokens) {
  if (endpoint == Endpoint::kChat) {
    json content = json::array();
    for (const TokenLogprobView& t : tokens) {
      json top = json::array();
      for (const LogprobEntry& e : t.top)
        top.push_back({{"token", e.token}, {"logprob", logprob_value(e.logprob)}, {"bytes", token_bytes_json(e.token)}});
      content.push_back({{"token", t.sampled.token},
                         {"logprob", logprob_value(t.sampled.logprob)},
                         {"bytes", token_bytes_json(t.sampled.token)},
                         {"top_logprobs", top}});
    }
    return {{"content", content}, {"refusal", nullptr}};
  }
  json texts = json::array(), values = json::array(), tops = json::array(), offsets = json::array();
  for (const TokenLogprobView& t : tokens) {
    texts.push_back(t.sampled.token);
    values.push_back(logprob_value(t.sampled.logprob));
    json top = json::object();
    for (const LogprobEntry& e : t.top) top[e.token] = logprob_value(e.logprob);
    top[t.sampled.token] = logprob_value(t.sampled.logprob);  // as vLLM: the sampled token is always listed
    tops.push_back(top);
    offsets.push_back(t.text_offset);
  }
  return {{"tokens", texts}, {"token_logprobs", values}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json full_response(const ResponseHeader& h, const std::string& text, const std::vector<int32_t>& token_ids,
                   engine::FinishReason finish, const Usage& usage, const json& logprobs) {
  json j = header_json(h, false);
  json choice = {{"index", 0}, {"logprobs", logprobs}, {"finish_reason", finish_json(finish)}, {"token_ids", token_ids}};
  if (h.endpoint == Endpoint::kChat) choice["message"] = {{"role", "assistant"}, {"content", text}};
  else choice["text"] = text;
  j["choices"] = json::array({choice});
  j["usage"] = usage_json(usage);
  return j;
}

json stream_chunk(const ResponseHeader& h, const std::string& text, const std::vector<int32_t>& token_ids,
                  engine::FinishReason finish, bool with_usage_null, bool first_chat_chunk, const json& logprobs) {
  json j = header_json(h, true);
  json choice = {{"index", 0}, {"logprobs", logprobs}, {"finish_reason", finish_json(finish)}, {"token_ids", token_ids}};
  if (h.endpoint == Endpoint::kChat) {
    json delta = {{"content", text}};
    if (first_chat_chunk) delta["role"] = "assistant";
    choice["delta"] = delta;
  } else {
    choice["text"] = text;
  }
  j["choices"] = json::array({choice});
  if (with_usage_null) j["usage"] = nullptr;
  return j;
}

json usage_chunk(const ResponseHeader& h, const Usage& usage) {
  json j = header_json(h, true);
  j["choices"] = json::array();
  j["usage"] = usage_json(usage);
  return j;
}

std::string sse_event(const json& j) { return "data: " + dump_json(j) + "\n\n"; }

}  // namespace lmx::server
