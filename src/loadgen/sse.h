// Server-sent events as OpenAI-compatible servers stream them: bytes in (any split), `data:` payloads out,
// and what one payload means for a benchmark (output tokens, usage, error, end). Pure, unit-tested;
// used by the bench client for every streamed response.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lmx::loadgen {

// Splits a byte stream into events (blank-line separated, LF or CRLF) and returns each event's data
// (its `data:` lines joined with "\n", one leading space after the colon dropped). Comment lines
// (":...") and other fields (event:, id:, retry:) are ignored; events without data yield nothing.
class SseParser {
 public:
  std::vector<std::string> feed(std::string_view bytes);
  // Bytes held waiting for the end of their line or event (an unterminated event at stream end).
  bool has_partial_event() const { return !line_.empty() || !data_.empty() || has_data_; }

 private:
  void take_line(std::string_view line, std::vector<std::string>* out);
  std::string line_;
  std::string data_;
  bool has_data_ = false;
};

// One streamed payload of /v1/completions or /v1/chat/completions.
struct StreamChunk {
  bool done = false;                 // "[DONE]"
  std::optional<std::string> error;  // {"error": {...}} — the message
  bool has_output = false;           // a choice carried text or token ids
  int tokens = 0;                    // token_ids in the choice; 1 when the server sends text without ids
  bool tokens_from_ids = false;
  std::string text;                  // choices[0].text or .delta.content
  std::optional<int> prompt_tokens;      // usage.prompt_tokens
  std::optional<int> completion_tokens;  // usage.completion_tokens
};

// Interprets one event's data. A payload that is not JSON, or a JSON error object, gives `error`.
StreamChunk parse_stream_chunk(std::string_view data);

}  // namespace lmx::loadgen
