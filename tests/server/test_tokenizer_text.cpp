// TokenizerText, the server's TextCodec over src/tokenizer, on the real Qwen3 tokenizer: text prompts
// encode as HF's tokenizer(text) does, chat renders with the generation prompt and tokenizes without
// added specials, streams never end a piece inside a UTF-8 character and concatenate to the full decode,
// stop strings cut across token boundaries without being emitted, and --chat-template overrides.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "../common/temp_dir.h"
#include "server/tokenizer_text.h"

namespace lmx::server {
namespace {

// LORAMUX_SHARED_DATA: the ../shared/data tests/CMakeLists.txt found at configure time ("" when none).
const std::string kQwen3 = std::string(LORAMUX_SHARED_DATA) + "/tokenizers/qwen3";
// Missing data skips when this build found none (or LORAMUX_NO_SHARED_DATA is set), else fails.
bool shared_data_optional() { return std::string(LORAMUX_SHARED_DATA).empty() || std::getenv("LORAMUX_NO_SHARED_DATA"); }

// The Qwen3 codec, loaded once for the binary; nullptr (after FAIL/SKIP by the caller) when absent.
const TokenizerText* qwen3() {
  static const std::unique_ptr<TokenizerText> codec = [] {
    Result<std::unique_ptr<TokenizerText>> r = TokenizerText::load(kQwen3, "");
    return r.ok() ? std::move(r).value() : nullptr;
  }();
  return codec.get();
}

#define LMX_GET_QWEN3(var)                                                                                   \
  const TokenizerText* var = qwen3();                                                                        \
  if (var == nullptr) {                                                                                      \
    if (shared_data_optional()) GTEST_SKIP() << "no " << kQwen3;                                             \
    FAIL() << "cannot load " << kQwen3 << " (set LORAMUX_NO_SHARED_DATA=1 on a machine without ../shared)"; \
  }

bool valid_utf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = s[i];
    size_t n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xe ? 3 : (c >> 3) == 0x1e ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) >> 6) != 0x2) return false;
    i += n;
  }
  return true;
}

// Every piece the stream returns, then flush() unless it stopped.
std::vector<std::string> stream_pieces(const TextCodec& codec, const std::vector<int32_t>& ids,
                                       const std::vector<std::string>& stop, bool* stopped) {
  std::unique_ptr<TextCodec::Stream> stream = codec.start(stop);
  std::vector<std::string> pieces;
  for (int32_t id : ids) {
    pieces.push_back(stream->add(id));
    if (stream->stopped()) break;
  }
  *stopped = stream->stopped();
  if (!*stopped) pieces.push_back(stream->flush());
  return pieces;
}

std::string join(const std::vector<std::string>& pieces) {
  std::string s;
  for (const std::string& p : pieces) s += p;
  return s;
}

TEST(TokenizerText, EncodesPromptsAndRendersChat) {
  LMX_GET_QWEN3(codec);
  const std::string text = "Hello, wörld! 你好 <|im_end|>";
  Result<std::vector<int32_t>> ids = codec->encode(text);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(*ids, codec->tokenizer().encode(text, true));
  EXPECT_EQ(ids->back(), *codec->tokenizer().token_to_id("<|im_end|>"));  // special-token text is the token

  ASSERT_TRUE(codec->has_chat_template());
  const std::vector<ChatMessage> messages = {{"system", "You are terse."}, {"user", "2+2?"}};
  Result<std::string> rendered = codec->render_chat_text(messages);
  ASSERT_TRUE(rendered.ok()) << rendered.status().message();
  EXPECT_EQ(*rendered, "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
                       "<|im_start|>assistant\n");
  Result<std::vector<int32_t>> chat = codec->render_chat(messages);
  ASSERT_TRUE(chat.ok());
  EXPECT_EQ(*chat, codec->tokenizer().encode(*rendered, false));
}

TEST(TokenizerText, StreamPiecesAreWholeCharactersAndConcatenateToTheDecode) {
  LMX_GET_QWEN3(codec);
  const tokenizer::Tokenizer& tok = codec->tokenizer();
  // Byte-level tokens split multi-byte characters; fed one id at a time they must never show half of one.
  std::vector<int32_t> ids = tok.encode("naïve café — 你好世界 🎉🎉 ok", false);
  ids.push_back(*tok.token_to_id("<|im_end|>"));  // special: skipped in the text
  bool stopped = false;
  std::vector<std::string> pieces = stream_pieces(*codec, ids, {}, &stopped);
  EXPECT_FALSE(stopped);
  for (const std::string& p : pieces) EXPECT_TRUE(valid_utf8(p)) << p;
  EXPECT_EQ(join(pieces), tok.decode(ids, true));
  EXPECT_EQ(join(pieces), "naïve café — 你好世界 🎉🎉 ok");
}

TEST(TokenizerText, StopStringsCutAcrossTokenBoundariesAndAreNotEmitted) {
  LMX_GET_QWEN3(codec);
  const tokenizer::Tokenizer& tok = codec->tokenizer();
  const std::string text = "The quick brown fox jumps over the lazy dog.";
  const std::vector<int32_t> ids = tok.encode(text, false);
  // "wn fo" spans the " brown" / " fox" tokens.
  for (const std::vector<std::string>& stop : std::vector<std::vector<std::string>>{{"wn fo"}, {"zzz", "lazy"}, {"dog."}}) {
    bool stopped = false;
    std::string out = join(stream_pieces(*codec, ids, stop, &stopped));
    size_t at = std::string::npos;
    for (const std::string& s : stop) at = std::min(at, text.find(s));
    EXPECT_TRUE(stopped) << stop[0];
    EXPECT_EQ(out, text.substr(0, at)) << stop[0];
  }
  bool stopped = true;
  EXPECT_EQ(join(stream_pieces(*codec, ids, {"cat"}, &stopped)), text);  // held-back "" released at the end
  EXPECT_FALSE(stopped);
  // A prefix of a stop string at the very end is released by flush.
  std::vector<int32_t> partial = tok.encode("fox jumps ov", false);
  EXPECT_EQ(join(stream_pieces(*codec, partial, {"over the"}, &stopped)), "fox jumps ov");
}

TEST(TokenizerText, ChatTemplateOverrideAndErrors) {
  if (!std::filesystem::exists(kQwen3)) {
    if (shared_data_optional()) GTEST_SKIP() << "no " << kQwen3;
    FAIL() << "missing " << kQwen3;
  }
  lmx::testing::TempDir dir("tokenizer_text");
  std::ofstream(dir.file("plain.jinja"))
      << "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}";
  Result<std::unique_ptr<TokenizerText>> codec = TokenizerText::load(kQwen3, dir.file("plain.jinja"));
  ASSERT_TRUE(codec.ok()) << codec.status().message();
  Result<std::string> rendered = (*codec)->render_chat_text({{"user", "hi"}});
  ASSERT_TRUE(rendered.ok());
  EXPECT_EQ(*rendered, "[user] hi\n[assistant] ");

  std::ofstream(dir.file("broken.jinja")) << "{% for m in messages %}{{ m.content }";
  Result<std::unique_ptr<TokenizerText>> broken = TokenizerText::load(kQwen3, dir.file("broken.jinja"));
  ASSERT_FALSE(broken.ok());
  EXPECT_NE(broken.status().message().find("--chat-template"), std::string::npos) << broken.status().message();
  EXPECT_FALSE(TokenizerText::load(kQwen3, dir.file("missing.jinja")).ok());
  EXPECT_FALSE(TokenizerText::load(dir.str(), "").ok());  // no tokenizer.json

  // A tokenizer directory without any template serves completions only; chat says why.
  std::filesystem::copy_file(kQwen3 + "/tokenizer.json", dir.file("tokenizer.json"));
  Result<std::unique_ptr<TokenizerText>> bare = TokenizerText::load(dir.str(), "");
  ASSERT_TRUE(bare.ok()) << bare.status().message();
  EXPECT_FALSE((*bare)->has_chat_template());
  Result<std::vector<int32_t>> chat = (*bare)->render_chat({{"user", "hi"}});
  ASSERT_FALSE(chat.ok());
  EXPECT_NE(chat.status().message().find("no chat template"), std::string::npos) << chat.status().message();
}

}  // namespace
}  // namespace lmx::server
