// TextCodec over the tokenizer (see tokenizer_text.h).
#include "server/tokenizer_text.h"

#include "tokenizer/incremental_decoder.h"

namespace lmx::server {
namespace {

// One request's detokenization. Special tokens (EOS, Harmony's channel markers) are left out of the text,
// as vLLM's default skip_special_tokens does; their ids still reach the client in token_ids.
class DecoderStream : public TextCodec::Stream {
 public:
  DecoderStream(const tokenizer::Tokenizer& tokenizer, std::vector<std::string> stop)
      : decoder_(tokenizer, std::move(stop), /*skip_special_tokens=*/true) {}
  std::string add(int32_t token) override { return decoder_.push(token).text; }
  bool stopped() const override { return decoder_.stopped(); }
  std::string flush() override { return decoder_.finish().text; }

 private:
  tokenizer::IncrementalDecoder decoder_;
};

}  // namespace

Result<std::unique_ptr<TokenizerText>> TokenizerText::load(const std::string& dir, const std::string& chat_template_file) {
  // The template first: a bad --chat-template fails before the (slower) tokenizer load.
  Result<tokenizer::ChatTemplate> chat = tokenizer::load_chat_template(dir, chat_template_file);
  if (!chat.ok() && !chat_template_file.empty()) return chat.status().with_context("--chat-template " + chat_template_file);
  Result<tokenizer::Tokenizer> tok = tokenizer::Tokenizer::load(dir);
  if (!tok.ok()) return tok.status();
  std::unique_ptr<TokenizerText> text(new TokenizerText(std::move(tok).value()));
  if (chat.ok()) text->chat_template_ = std::move(chat).value();
  else text->chat_template_problem_ = chat.status().message();
  return text;
}

Result<std::vector<int32_t>> TokenizerText::encode(const std::string& text) const {
  // As HF's tokenizer(text): the post-processor's special tokens (e.g. DeepSeek's BOS) are added.
  return tokenizer_.encode(text, /*add_special_tokens=*/true);
}

Result<std::string> TokenizerText::render_chat_text(const std::vector<ChatMessage>& messages) const {
  if (!chat_template_) return unsupported("this model has no chat template: " + chat_template_problem_);
  nlohmann::ordered_json list = nlohmann::ordered_json::array();
  for (const ChatMessage& m : messages) list.push_back({{"role", m.role}, {"content", m.content}});
  return chat_template_->render(list, {{"add_generation_prompt", true}});
}

Result<std::vector<int32_t>> TokenizerText::render_chat(const std::vector<ChatMessage>& messages) const {
  LMX_ASSIGN_OR_RETURN(std::string prompt, render_chat_text(messages));
  // The template writes the special tokens itself (apply_chat_template tokenizes without adding any).
  return tokenizer_.encode(prompt, /*add_special_tokens=*/false);
}

std::unique_ptr<TextCodec::Stream> TokenizerText::start(const std::vector<std::string>& stop) const {
  return std::make_unique<DecoderStream>(tokenizer_, stop);
}

const std::string& TokenizerText::chat_template_origin() const {
  static const std::string kNone;
  return chat_template_ ? chat_template_->origin() : kNone;
}

}  // namespace lmx::server
