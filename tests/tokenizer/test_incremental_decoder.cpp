// Streaming detokenization: pieces concatenate to the full decode, never end inside a UTF-8 character,
// and stop strings (spanning token boundaries, multi-byte, several at once) are withheld and cut, over
// random id streams that split characters byte by byte and interleave added tokens.
#include <random>

#include "tokenizer/incremental_decoder.h"
#include "tokenizer/utf8.h"
#include "tokenizer_test_util.h"

namespace lmx::tokenizer {
namespace {

struct Streamed {
  std::string text;
  bool stopped = false;
};

Streamed stream(const Tokenizer& tok, const std::vector<int32_t>& ids, std::vector<std::string> stops, bool skip) {
  IncrementalDecoder decoder(tok, std::move(stops), skip);
  Streamed out;
  for (int32_t id : ids) {
    IncrementalDecoder::Piece piece = decoder.push(id);
    EXPECT_TRUE(is_valid_utf8(piece.text)) << "a piece ends inside a character";
    out.text += piece.text;
    if (piece.stopped) {
      out.stopped = true;
      return out;
    }
  }
  IncrementalDecoder::Piece last = decoder.finish();
  EXPECT_TRUE(is_valid_utf8(last.text));
  out.text += last.text;
  return out;
}

// A random id stream over `text`: each character either encoded normally or as its single-byte tokens
// (so multi-byte characters and emoji are split across pushes), with added tokens sprinkled in.
std::vector<int32_t> random_stream(const Tokenizer& tok, const std::string& text, std::mt19937& rng,
                                   const std::vector<int32_t>& added) {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    const size_t n = std::min(text.size() - i, size_t(1 + rng() % 6));
    const std::string chunk = text.substr(i, n);
    i += n;
    if (rng() % 2 == 0) {
      for (unsigned char b : chunk) ids.push_back(*tok.token_to_id(std::string(1, char(b))));
    } else {
      // Bytes of a chunk that cuts a character are not valid text to encode: fall back to byte tokens.
      if (is_valid_utf8(chunk)) {
        for (int32_t id : tok.encode(chunk, false)) ids.push_back(id);
      } else {
        for (unsigned char b : chunk) ids.push_back(*tok.token_to_id(std::string(1, char(b))));
      }
    }
    if (!added.empty() && rng() % 8 == 0) ids.push_back(added[rng() % added.size()]);
  }
  return ids;
}

std::vector<std::string> stream_texts() {
  std::vector<std::string> texts;
  for (const auto& s : testing::reference()["corpus"]) texts.push_back(s.get<std::string>());
  return texts;
}

class Streaming : public ::testing::TestWithParam<std::string> {};

TEST_P(Streaming, ConcatenationEqualsDecodeOverRandomSplits) {
  LMX_GET_TOKENIZER(tok, GetParam());
  std::mt19937 rng(7);
  std::vector<int32_t> added;
  for (int32_t id = 0; id < tok->vocab_size(); ++id)
    if (tok->is_added(id) && added.size() < 40) added.push_back(id);
  for (const std::string& text : stream_texts()) {
    for (int trial = 0; trial < 3; ++trial) {
      const std::vector<int32_t> ids = random_stream(*tok, text, rng, trial == 0 ? std::vector<int32_t>{} : added);
      for (bool skip : {false, true}) {
        Streamed s = stream(*tok, ids, {}, skip);
        EXPECT_FALSE(s.stopped);
        ASSERT_EQ(s.text, tok->decode(ids, skip)) << "text: " << text;
      }
    }
  }
}

TEST_P(Streaming, InvalidAndTruncatedBytesMatchDecode) {
  LMX_GET_TOKENIZER(tok, GetParam());
  std::mt19937 rng(11);
  for (int trial = 0; trial < 2000; ++trial) {
    std::vector<int32_t> ids;
    const size_t n = 1 + rng() % 12;
    for (size_t k = 0; k < n; ++k) {
      // Mostly bytes >= 0x80 so that lead bytes, continuation bytes and cut sequences meet.
      const int b = rng() % 4 == 0 ? int(rng() % 128) : int(0x80 + rng() % 128);
      ids.push_back(*tok->token_to_id(std::string(1, char(b))));
      if (rng() % 10 == 0) ids.push_back(tok->eos_id());
    }
    for (bool skip : {false, true}) ASSERT_EQ(stream(*tok, ids, {}, skip).text, tok->decode(ids, skip));
  }
}

TEST_P(Streaming, StopStringsAreCutAndNeverEmitted) {
  LMX_GET_TOKENIZER(tok, GetParam());
  std::mt19937 rng(3);
  for (const std::string& text : stream_texts()) {
    const std::vector<int32_t> ids = random_stream(*tok, text, rng, {});
    const std::string full = tok->decode(ids, false);
    if (full.size() < 2) continue;
    // Stop strings: a substring of the text (whole characters), plus one that never occurs.
    size_t a = rng() % full.size(), len = 1 + rng() % 8;
    while (a > 0 && (static_cast<unsigned char>(full[a]) & 0xC0) == 0x80) --a;
    size_t b = std::min(full.size(), a + len);
    while (b < full.size() && (static_cast<unsigned char>(full[b]) & 0xC0) == 0x80) ++b;
    const std::string stop = full.substr(a, b - a);
    const std::vector<std::string> stops = {"\x01never\x02", stop};
    Streamed s = stream(*tok, ids, stops, false);
    const size_t first = full.find(stop);
    EXPECT_TRUE(s.stopped) << "stop '" << stop << "' in: " << full;
    EXPECT_EQ(s.text, full.substr(0, first)) << "stop '" << stop << "'";
    EXPECT_EQ(s.text.find(stop), std::string::npos);
    // Without a matching stop string the whole text streams out.
    Streamed none = stream(*tok, ids, {"\x01never\x02"}, false);
    EXPECT_FALSE(none.stopped);
    EXPECT_EQ(none.text, full);
  }
}

INSTANTIATE_TEST_SUITE_P(Hf, Streaming, ::testing::Values("gpt-oss", "qwen3", "deepseek-v3"), [](const auto& info) {
  std::string n = info.param;
  for (char& c : n)
    if (c == '-') c = '_';
  return n;
});

TEST(StreamingStop, WithholdsOnlyPossibleStopPrefixes) {
  LMX_GET_TOKENIZER(tok, "qwen3");
  auto byte_id = [&](char c) { return *tok->token_to_id(std::string(1, c)); };
  IncrementalDecoder d(*tok, {"END", "ENOUGH"}, false);
  EXPECT_EQ(d.push(byte_id('a')).text, "a");
  EXPECT_EQ(d.push(byte_id('E')).text, "");   // could start END / ENOUGH
  EXPECT_EQ(d.push(byte_id('N')).text, "");
  EXPECT_EQ(d.push(byte_id('X')).text, "ENX");  // no longer a prefix: released at once
  EXPECT_EQ(d.push(byte_id('E')).text, "");
  IncrementalDecoder::Piece p = d.push(byte_id('N'));
  EXPECT_EQ(p.text, "");
  p = d.push(byte_id('D'));
  EXPECT_TRUE(p.stopped);
  EXPECT_EQ(p.text, "");
  EXPECT_TRUE(d.push(byte_id('z')).stopped);

  // A multi-byte stop string split across byte tokens; the emoji before it is never cut.
  IncrementalDecoder e(*tok, {"é!"}, false);
  std::string out;
  for (unsigned char c : std::string("😀éé!tail")) {
    IncrementalDecoder::Piece piece = e.push(*tok->token_to_id(std::string(1, char(c))));
    EXPECT_TRUE(is_valid_utf8(piece.text));
    out += piece.text;
    if (piece.stopped) break;
  }
  EXPECT_EQ(out, "😀é");
  // At the end of the sequence held text is released.
  IncrementalDecoder f(*tok, {"END"}, false);
  EXPECT_EQ(f.push(byte_id('E')).text, "");
  EXPECT_EQ(f.finish().text, "E");
}

}  // namespace
}  // namespace lmx::tokenizer
