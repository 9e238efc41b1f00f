// SSE framing and OpenAI stream chunk interpretation (see sse.h).
#include "loadgen/sse.h"

#include <nlohmann/json.hpp>

namespace lmx::loadgen {

std::vector<std::string> SseParser::feed(std::string_view bytes) {
  std::vector<std::string> out;
  for (char c : bytes) {
    if (c != '\n') {
      line_.push_back(c);
      continue;
    }
    std::string_view line(line_);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    take_line(line, &out);
    line_.clear();
  }
  return out;
}

void SseParser::take_line(std::string_view line, std::vector<std::string>* out) {
  if (line.empty()) {  // end of event
    if (has_data_) out->push_back(std::move(data_));
    data_.clear();
    has_data_ = false;
    return;
  }
  if (line.front() == ':') return;  // comment (keep-alive pings)
  const size_t colon = line.find(':');
  const std::string_view field = line.substr(0, colon);
  if (field != "data") return;
  std::string_view value = colon == std::string_view::npos ? std::string_view() : line.substr(colon + 1);
  if (!value.empty() && value.front() == ' ') value.remove_prefix(1);
  if (has_data_) data_.push_back('\n');
  data_.append(value);
  has_data_ = true;
}

StreamChunk parse_stream_chunk(std::string_view data) {
  StreamChunk chunk;
  if (data == "[DONE]") {
    chunk.done = true;
    return chunk;
  }
  const nlohmann::json j = nlohmann::json::parse(data, nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    chunk.error = "stream event is not a JSON object: " + std::string(data.substr(0, 200));
    return chunk;
  }
  if (auto e = j.find("error"); e != j.end() && !e->is_null()) {
    const bool has_message = e->is_object() && e->contains("message") && (*e)["message"].is_string();
    chunk.error = has_message ? (*e)["message"].get<std::string>() : e->dump();
    return chunk;
  }
  if (auto choices = j.find("choices"); choices != j.end() && choices->is_array() && !choices->empty()) {
    const nlohmann::json& choice = choices->front();
    if (choice.is_object()) {
      if (auto text = choice.find("text"); text != choice.end() && text->is_string()) chunk.text = text->get<std::string>();
      if (auto delta = choice.find("delta"); delta != choice.end() && delta->is_object()) {
        if (auto content = delta->find("content"); content != delta->end() && content->is_string())
          chunk.text = content->get<std::string>();
        // Reasoning models stream their thinking in its own field; it is output all the same.
        for (const char* field : {"reasoning_content", "reasoning"})
          if (auto r = delta->find(field); r != delta->end() && r->is_string()) chunk.text += r->get<std::string>();
      }
      if (auto ids = choice.find("token_ids"); ids != choice.end() && ids->is_array()) {
        chunk.tokens_from_ids = true;
        chunk.tokens = int(ids->size());
      } else if (!chunk.text.empty()) {
        chunk.tokens = 1;
      }
      chunk.has_output = chunk.tokens > 0;
    }
  }
  if (auto usage = j.find("usage"); usage != j.end() && usage->is_object()) {
    auto read = [&](const char* field, std::optional<int>* out) {
      if (auto v = usage->find(field); v != usage->end() && v->is_number_integer()) *out = v->get<int>();
    };
    read("prompt_tokens", &chunk.prompt_tokens);
    read("completion_tokens", &chunk.completion_tokens);
  }
  return chunk;
}

}  // namespace lmx::loadgen
