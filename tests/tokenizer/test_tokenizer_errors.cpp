// Load failures name the file, the JSON path and what was expected vs found: missing and malformed
// files, unsupported components, bad merges. Also a tiny hand-written tokenizer.json that loads and
// merges as expected (both merge encodings), so the error cases differ from it in one field each.
#include <fstream>

#include "../common/temp_dir.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer_test_util.h"

namespace lmx::tokenizer {
namespace {

using json = nlohmann::json;

json tiny_tokenizer() {
  return json::parse(R"({
    "version": "1.0", "truncation": null, "padding": null,
    "added_tokens": [{"id": 5, "content": "<eos>", "single_word": false, "lstrip": false, "rstrip": false,
                      "normalized": false, "special": true}],
    "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
    "post_processor": null,
    "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
    "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
              "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
              "vocab": {"a": 0, "b": 1, "ab": 2, "Ġ": 3, "Ġab": 4},
              "merges": ["a b", ["Ġ", "ab"]]}
  })");
}

std::string write(const lmx::testing::TempDir& dir, const std::string& text) {
  std::ofstream(dir.file("tokenizer.json")) << text;
  return dir.str();
}

Status load_status(const json& spec) {
  lmx::testing::TempDir dir("tok");
  Result<Tokenizer> tok = Tokenizer::load(write(dir, spec.dump()));
  return tok.ok() ? Status::Ok() : tok.status();
}

TEST(TokenizerLoad, TinyTokenizerMergesBothEncodings) {
  lmx::testing::TempDir dir("tok");
  Result<Tokenizer> tok = Tokenizer::load(write(dir, tiny_tokenizer().dump()));
  ASSERT_TRUE(tok.ok()) << tok.status().message();
  EXPECT_EQ(tok->encode("ab ab<eos>", false), (std::vector<int32_t>{2, 4, 5}));
  EXPECT_EQ(tok->decode(std::vector<int32_t>{2, 4, 5}, false), "ab ab<eos>");
  EXPECT_EQ(tok->decode(std::vector<int32_t>{2, 4, 5}, true), "ab ab");
  EXPECT_EQ(tok->encode("abc", false), (std::vector<int32_t>{2}));  // 'c' is not in the vocabulary: dropped, as HF
  EXPECT_EQ(tok->bos_id(), -1);
}

TEST(TokenizerLoad, MissingFile) {
  Result<Tokenizer> tok = Tokenizer::load("/nonexistent/model");
  ASSERT_FALSE(tok.ok());
  EXPECT_NE(tok.status().message().find("/nonexistent/model: no such file or directory"), std::string::npos) << tok.status().message();
  EXPECT_EQ(tok.status().code(), StatusCode::kNotFound);
}

TEST(TokenizerLoad, MalformedJson) {
  lmx::testing::TempDir dir("tok");
  Result<Tokenizer> tok = Tokenizer::load(write(dir, "{\"model\": {\"type\": \"BPE\", "));
  ASSERT_FALSE(tok.ok());
  EXPECT_NE(tok.status().message().find("tokenizer.json: malformed JSON"), std::string::npos) << tok.status().message();
}

TEST(TokenizerLoad, MalformedConfig) {
  lmx::testing::TempDir dir("tok");
  write(dir, tiny_tokenizer().dump());
  std::ofstream(dir.file("tokenizer_config.json")) << "{ not json";
  Result<Tokenizer> tok = Tokenizer::load(dir.str());
  ASSERT_FALSE(tok.ok());
  EXPECT_NE(tok.status().message().find("tokenizer_config.json: malformed JSON"), std::string::npos);
}

void expect_error(const json& spec, std::initializer_list<const char*> fragments) {
  Status s = load_status(spec);
  ASSERT_FALSE(s.ok());
  for (const char* f : fragments) EXPECT_NE(s.message().find(f), std::string::npos) << "'" << f << "' not in: " << s.message();
}

TEST(TokenizerLoad, UnsupportedComponentsAreNamed) {
  json spec = tiny_tokenizer();
  spec["model"]["type"] = "WordPiece";
  expect_error(spec, {"tokenizer.json", "model.type", "unsupported model 'WordPiece'"});

  spec = tiny_tokenizer();
  spec["pre_tokenizer"] = json::parse(R"({"type": "Sequence", "pretokenizers": [{"type": "Metaspace"}]})");
  expect_error(spec, {"pre_tokenizer.pretokenizers[0].type", "unsupported pre-tokenizer 'Metaspace'"});

  spec = tiny_tokenizer();
  spec["normalizer"] = json::parse(R"({"type": "Lowercase"})");
  expect_error(spec, {"normalizer.type", "unsupported normalizer 'Lowercase'"});

  spec = tiny_tokenizer();
  spec["decoder"] = json::parse(R"({"type": "WordPiece"})");
  expect_error(spec, {"decoder.type", "unsupported decoder 'WordPiece'"});

  spec = tiny_tokenizer();
  spec["post_processor"] = json::parse(R"({"type": "BertProcessing"})");
  expect_error(spec, {"post_processor.type", "unsupported post-processor 'BertProcessing'"});

  spec = tiny_tokenizer();
  spec["pre_tokenizer"] = json::parse(R"({"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated"})");
  expect_error(spec, {"without a final ByteLevel"});

  spec = tiny_tokenizer();
  spec["pre_tokenizer"] = json::parse(R"({"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": "(unclosed"}, "behavior": "Isolated"}, {"type": "ByteLevel"}]})");
  expect_error(spec, {"pre_tokenizer.pretokenizers[0].pattern", "regex does not compile"});
}

TEST(TokenizerLoad, BadMergesAreNamed) {
  json spec = tiny_tokenizer();
  spec["model"]["merges"] = json::parse(R"(["a b", "a x"])");
  expect_error(spec, {"model.merges[1]", "token 'x' is not in model.vocab"});

  spec = tiny_tokenizer();
  spec["model"]["merges"] = json::parse(R"(["a b c"])");
  expect_error(spec, {"model.merges[0]", "expected \"left right\" (one space)", "found \"a b c\""});

  spec = tiny_tokenizer();
  spec["model"]["merges"] = json::parse(R"([["a"]])");
  expect_error(spec, {"model.merges[0]", "found [\"a\"]"});

  spec = tiny_tokenizer();
  spec["model"].erase("vocab");
  expect_error(spec, {"model.vocab", "expected an object"});
}

}  // namespace
}  // namespace lmx::tokenizer
