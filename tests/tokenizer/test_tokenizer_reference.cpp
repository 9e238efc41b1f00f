// Encode and decode against Hugging Face `tokenizers` on the three real tokenizers (GPT-OSS o200k,
// Qwen3, DeepSeek-V3): the sonnets (whole and per line), the committed corpus, random byte strings and
// arbitrary id sequences. Reference ids: tools/make_tokenizer_fixtures.py.
#include <random>

#include "tokenizer_test_util.h"

namespace lmx::tokenizer {
namespace {

using testing::reference;
using json = nlohmann::json;

std::vector<int32_t> ids_of(const json& j) { return j.get<std::vector<int32_t>>(); }

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

class RealTokenizer : public ::testing::TestWithParam<std::string> {
 protected:
  const json& ref() { return reference()["tokenizers"][GetParam()]; }
};

TEST_P(RealTokenizer, SonnetWholeTextMatchesHf) {
  LMX_GET_TOKENIZER(tok, GetParam());
  const std::string sonnet = testing::read_file(testing::shared_data_dir() + "/sonnet.txt");
  EXPECT_EQ(tok->encode(sonnet, false), ids_of(ref()["sonnet"]));
  EXPECT_EQ(tok->decode(tok->encode(sonnet, false), false), sonnet);  // byte-level BPE is lossless
}

TEST_P(RealTokenizer, SonnetLinesMatchHf) {
  LMX_GET_TOKENIZER(tok, GetParam());
  const std::string sonnet = testing::read_file(testing::shared_data_dir() + "/sonnet.txt");
  const json& expected = ref()["sonnet_lines"];
  size_t line = 0, start = 0;
  for (;; ++line) {
    const size_t end = sonnet.find('\n', start);
    const std::string text = sonnet.substr(start, end == std::string::npos ? std::string::npos : end - start);
    ASSERT_LT(line, expected.size());
    EXPECT_EQ(tok->encode(text, false), ids_of(expected[line])) << "sonnet line " << line << ": " << text;
    if (end == std::string::npos) break;
    start = end + 1;
  }
  EXPECT_EQ(line + 1, expected.size());
}

TEST_P(RealTokenizer, CorpusMatchesHf) {
  LMX_GET_TOKENIZER(tok, GetParam());
  const json& corpus = reference()["corpus"];
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i].get<std::string>();
    EXPECT_EQ(tok->encode(text, false), ids_of(ref()["corpus"][i])) << "corpus line " << i << ": " << text;
  }
  for (size_t i = 0; i < ref()["corpus_special"].size(); ++i)
    EXPECT_EQ(tok->encode(corpus[i].get<std::string>(), true), ids_of(ref()["corpus_special"][i])) << "line " << i;
}

TEST_P(RealTokenizer, RandomBytesMatchHfOnReplacedText) {
  LMX_GET_TOKENIZER(tok, GetParam());
  const json& strings = reference()["random_bytes_hex"];
  for (size_t i = 0; i < strings.size(); ++i) {
    const std::string bytes = from_hex(strings[i].get<std::string>());
    EXPECT_EQ(tok->encode(bytes, false), ids_of(ref()["random_bytes"][i])) << "byte string " << i << ": "
                                                                            << strings[i].get<std::string>();
  }
}

TEST_P(RealTokenizer, DecodeMatchesHf) {
  LMX_GET_TOKENIZER(tok, GetParam());
  const json& corpus = reference()["corpus"];
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::vector<int32_t> ids = ids_of(ref()["corpus"][i]);
    const std::string keep = ref()["corpus_decode"][i].is_null() ? corpus[i].get<std::string>()
                                                                 : ref()["corpus_decode"][i].get<std::string>();
    const std::string skip = ref()["corpus_decode_skip"][i].is_null() ? keep
                                                                      : ref()["corpus_decode_skip"][i].get<std::string>();
    EXPECT_EQ(tok->decode(ids, false), keep) << "corpus line " << i;
    EXPECT_EQ(tok->decode(ids, true), skip) << "corpus line " << i;
  }
  for (size_t i = 0; i < ref()["decode_ids"].size(); ++i) {
    const std::vector<int32_t> ids = ids_of(ref()["decode_ids"][i]);
    EXPECT_EQ(tok->decode(ids, false), ref()["decode_keep"][i].get<std::string>()) << "id sequence " << i;
    EXPECT_EQ(tok->decode(ids, true), ref()["decode_skip"][i].get<std::string>()) << "id sequence " << i;
  }
}

TEST_P(RealTokenizer, RoundTripIsLosslessOnValidUtf8) {
  LMX_GET_TOKENIZER(tok, GetParam());
  const json& corpus = reference()["corpus"];
  for (size_t i = 0; i < corpus.size(); ++i) {
    const std::string text = corpus[i].get<std::string>();
    // Qwen3 normalizes to NFC, so its round trip returns the NFC form: compare with HF's decode there.
    const std::string expected = ref()["corpus_decode"][i].is_null() ? text : ref()["corpus_decode"][i].get<std::string>();
    EXPECT_EQ(tok->decode(tok->encode(text, false), false), expected) << "corpus line " << i;
    if (GetParam() != "qwen3") {
      EXPECT_EQ(expected, text) << "corpus line " << i;
    }
  }
}

TEST_P(RealTokenizer, CacheDoesNotChangeResults) {
  LMX_GET_TOKENIZER(tok, GetParam());
  // Encoding the corpus twice (second time from the cache), and interleaved, gives the same ids.
  const json& corpus = reference()["corpus"];
  for (int pass = 0; pass < 2; ++pass)
    for (size_t i = 0; i < corpus.size(); i += 7)
      EXPECT_EQ(tok->encode(corpus[i].get<std::string>(), false), ids_of(ref()["corpus"][i])) << "pass " << pass;
}

INSTANTIATE_TEST_SUITE_P(Hf, RealTokenizer, ::testing::Values("gpt-oss", "qwen3", "deepseek-v3"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n)
                             if (c == '-') c = '_';
                           return n;
                         });

TEST(SpecialTokens, IdsFromConfigAndMatchingInText) {
  {
    LMX_GET_TOKENIZER(tok, "gpt-oss");
    EXPECT_EQ(tok->bos_id(), 199998);  // <|startoftext|>
    EXPECT_EQ(tok->eos_id(), *tok->token_to_id("<|return|>"));
    EXPECT_TRUE(tok->is_special(tok->eos_id()));
    EXPECT_EQ(tok->vocab_size(), 200019);  // HF get_vocab_size(with_added_tokens=True)
  }
  {
    LMX_GET_TOKENIZER(tok, "qwen3");
    EXPECT_EQ(tok->bos_id(), -1);  // bos_token: null
    EXPECT_EQ(tok->eos_id(), 151645);  // <|im_end|>
    EXPECT_EQ(tok->vocab_size(), 151669);
    const std::vector<int32_t> ids = tok->encode("<|im_start|>user\nhi<|im_end|>", false);
    EXPECT_EQ(ids.front(), 151644);
    EXPECT_EQ(ids.back(), 151645);
    EXPECT_EQ(tok->decode(ids, true), "user\nhi");
    const int32_t think = *tok->token_to_id("<think>");
    EXPECT_TRUE(tok->is_added(think));
    EXPECT_FALSE(tok->is_special(think));  // kept by skip_special_tokens
    EXPECT_EQ(tok->decode(std::vector<int32_t>{think}, true), "<think>");
  }
  {
    LMX_GET_TOKENIZER(tok, "deepseek-v3");
    EXPECT_EQ(tok->bos_id(), 0);
    EXPECT_EQ(tok->eos_id(), 1);
    EXPECT_EQ(tok->vocab_size(), 128815);
  }
}

}  // namespace
}  // namespace lmx::tokenizer
