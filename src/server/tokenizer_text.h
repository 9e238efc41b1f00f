// TokenizerText: the TextCodec (server/text.h) over src/tokenizer — Tokenizer for prompts, ChatTemplate for
// chat messages (add_generation_prompt), IncrementalDecoder per request for streamed text and stop strings.
// Does not decide where the files come from (apps/serve.cpp resolves --tokenizer / --chat-template / the
// model directory) nor check the model's vocabulary (serve does, at load).
#pragma once
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "server/text.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace lmx::server {

class TokenizerText : public TextCodec {
 public:
  // `dir` holds tokenizer.json (+ tokenizer_config.json). The chat template is `chat_template_file` when
  // non-empty (an error if it does not parse), else the directory's own; a directory without one serves
  // completions only (chat_template_problem() says why), and one whose template does not parse likewise.
  static Result<std::unique_ptr<TokenizerText>> load(const std::string& dir, const std::string& chat_template_file);

  Result<std::vector<int32_t>> encode(const std::string& text) const override;
  Result<std::vector<int32_t>> render_chat(const std::vector<ChatMessage>& messages) const override;
  bool has_chat_template() const override { return chat_template_.has_value(); }
  std::unique_ptr<Stream> start(const std::vector<std::string>& stop) const override;
  std::string token_text(int32_t id) const override { return tokenizer_.token_bytes(id); }

  // The rendered prompt text of `messages` (what render_chat tokenizes).
  Result<std::string> render_chat_text(const std::vector<ChatMessage>& messages) const;
  const tokenizer::Tokenizer& tokenizer() const { return tokenizer_; }
  const std::string& chat_template_origin() const;  // "" without a template
  const std::string& chat_template_problem() const { return chat_template_problem_; }

 private:
  TokenizerText(tokenizer::Tokenizer tokenizer) : tokenizer_(std::move(tokenizer)) {}

  tokenizer::Tokenizer tokenizer_;
  std::optional<tokenizer::ChatTemplate> chat_template_;
  std::string chat_template_problem_;  // why there is no template
};

}  // namespace lmx::server
