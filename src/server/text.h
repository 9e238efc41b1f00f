// The server's seam to the tokenizer: encoding text prompts, rendering chat messages through the model's
// template, and per-request incremental detokenization with stop strings. A server without one (nullptr)
// serves token-id prompts only: choices carry `token_ids` and empty text. Implemented by TokenizerText
// (server/tokenizer_text.h) over src/tokenizer; http_server.cpp sees only this interface.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "server/api.h"

namespace lmx::server {

class TextCodec {
 public:
  // One request's output text, token by token.
  class Stream {
   public:
    virtual ~Stream() = default;
    // Newly printable text after `token` (may be empty while a UTF-8 sequence or a possible stop string is
    // incomplete). After a stop string matched, stopped() is true and no more text is returned.
    virtual std::string add(int32_t token) = 0;
    virtual bool stopped() const = 0;
    // Held-back text at the end of the sequence (not after a stop).
    virtual std::string flush() = 0;
  };

  virtual ~TextCodec() = default;
  virtual Result<std::vector<int32_t>> encode(const std::string& text) const = 0;
  // unsupported() when the model has no chat template.
  virtual Result<std::vector<int32_t>> render_chat(const std::vector<ChatMessage>& messages) const = 0;
  virtual bool has_chat_template() const = 0;
  virtual std::unique_ptr<Stream> start(const std::vector<std::string>& stop) const = 0;
  // One token's own bytes, as logprobs show it (special tokens included; may be part of a UTF-8 character).
  virtual std::string token_text(int32_t id) const = 0;
};

}  // namespace lmx::server
