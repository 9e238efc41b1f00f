// Components the three real tokenizers do not use, checked against HF all the same: Qwen3's
// tokenizer.json edited (every Split behaviour +/- invert, ByteLevel add_prefix_space/use_regex,
// lstrip/rstrip/single_word/normalized added tokens, TemplateProcessing, NFKC/Replace/Prepend,
// ignore_merges) with the edits and reference ids from tools/make_tokenizer_fixtures.py.
#include <fstream>

#include "../common/temp_dir.h"
#include "tokenizer_test_util.h"

namespace lmx::tokenizer {
namespace {

using json = nlohmann::json;

TEST(TokenizerVariants, EditedQwen3MatchesHf) {
  LMX_GET_TOKENIZER(qwen, "qwen3");  // fails/skips like the others when the shared data is missing
  (void)qwen;
  const json base = json::parse(testing::read_file(testing::tokenizer_dir("qwen3") + "/tokenizer.json"));
  const json& texts = testing::reference()["variant_texts"];
  const json& variants = testing::reference()["variants"];
  ASSERT_GE(variants.size(), 16u);
  for (auto it = variants.begin(); it != variants.end(); ++it) {
    json spec = base;
    for (auto p = it.value()["patch"].begin(); p != it.value()["patch"].end(); ++p)
      spec[json::json_pointer(p.key())] = p.value();
    lmx::testing::TempDir dir("variant");
    std::ofstream(dir.file("tokenizer.json")) << spec.dump();
    Result<Tokenizer> tok = Tokenizer::load(dir.file("tokenizer.json"));
    ASSERT_TRUE(tok.ok()) << it.key() << ": " << tok.status().message();
    for (size_t i = 0; i < texts.size(); ++i) {
      EXPECT_EQ(tok->encode(texts[i].get<std::string>(), true), it.value()["ids"][i].get<std::vector<int32_t>>())
          << "variant " << it.key() << ", text " << i << ": " << texts[i].get<std::string>();
    }
  }
}

}  // namespace
}  // namespace lmx::tokenizer
