// `loramux tokenize` end to end through the built binary (LORAMUX_BIN, set by ctest): encode JSON
// strings to id arrays equal to the HF reference, --decode back, and clear errors for a bad model dir
// or a bad input line.
#include <array>
#include <cstdio>
#include <fstream>

#include "../common/temp_dir.h"
#include "tokenizer_test_util.h"

namespace lmx::tokenizer {
namespace {

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

CliRun run_tokenize(const std::string& args, const std::string& input) {
  const char* bin = std::getenv("LORAMUX_BIN");
  EXPECT_NE(bin, nullptr) << "LORAMUX_BIN not set (ctest sets it)";
  CliRun r;
  if (!bin) return r;
  lmx::testing::TempDir dir("tokcli");
  std::ofstream(dir.file("in.txt")) << input;
  const std::string cmd = std::string(bin) + " tokenize " + args + " < " + dir.file("in.txt") + " 2> " + dir.file("err.txt");
  FILE* pipe = popen(cmd.c_str(), "r");
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) r.out.append(buf.data(), n);
  const int status = pclose(pipe);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.err = testing::read_file(dir.file("err.txt"));
  return r;
}

TEST(TokenizeCli, EncodesAndDecodesLikeHf) {
  if (!std::filesystem::exists(testing::tokenizer_dir("qwen3"))) {
    if (testing::shared_data_optional()) GTEST_SKIP() << "no shared data";
    FAIL() << "missing " << testing::tokenizer_dir("qwen3");
  }
  const nlohmann::json& corpus = testing::reference()["corpus"];
  const nlohmann::json& ids = testing::reference()["tokenizers"]["qwen3"]["corpus"];
  std::string input, expected;
  for (size_t i = 0; i < 30; ++i) {
    input += corpus[i].dump() + "\n";
    expected += ids[i].dump() + "\n";
  }
  CliRun enc = run_tokenize("--model " + testing::tokenizer_dir("qwen3"), input);
  ASSERT_EQ(enc.exit_code, 0) << enc.err;
  EXPECT_EQ(enc.out, expected);

  CliRun dec = run_tokenize("--model " + testing::tokenizer_dir("qwen3") + " --decode", enc.out);
  ASSERT_EQ(dec.exit_code, 0) << dec.err;
  std::string decoded_expected;
  const nlohmann::json& decodes = testing::reference()["tokenizers"]["qwen3"]["corpus_decode"];
  for (size_t i = 0; i < 30; ++i) decoded_expected += (decodes[i].is_null() ? corpus[i] : decodes[i]).dump() + "\n";
  EXPECT_EQ(dec.out, decoded_expected);

  // --no-special on decode drops special tokens.
  CliRun skip = run_tokenize("--model " + testing::tokenizer_dir("qwen3") + " --decode --no-special", "[151644, 9707]\n");
  EXPECT_EQ(skip.out, "\"Hello\"\n");
}

TEST(TokenizeCli, BadInputLineIsReportedAndOthersContinue) {
  if (!std::filesystem::exists(testing::tokenizer_dir("qwen3"))) {
    if (testing::shared_data_optional()) GTEST_SKIP() << "no shared data";
    FAIL() << "missing " << testing::tokenizer_dir("qwen3");
  }
  CliRun r = run_tokenize("--model " + testing::tokenizer_dir("qwen3"), "\"Hello\"\n[1,2]\n{oops\n\"Hello\"\n");
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.out, "[9707]\nnull\nnull\n[9707]\n");
  EXPECT_NE(r.err.find("stdin line 2: expected a JSON string, found array"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("stdin line 3:"), std::string::npos) << r.err;
}

TEST(TokenizeCli, MissingOrMalformedTokenizerJson) {
  lmx::testing::TempDir dir("tokcli");
  CliRun missing = run_tokenize("--model " + dir.str(), "\"x\"\n");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.err.find(dir.str() + "/tokenizer.json: no tokenizer.json"), std::string::npos) << missing.err;
  std::ofstream(dir.file("tokenizer.json")) << "{\"model\": [";
  CliRun bad = run_tokenize("--model " + dir.str(), "\"x\"\n");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.err.find("tokenizer.json: malformed JSON"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace lmx::tokenizer
