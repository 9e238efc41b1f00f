// KernelConfigs: the `--kernel-configs DIR` JSON files (bucket lookup, round trip through save/load, and an
// error naming file, field and expected vs found for each kind of bad input).
#include "ops/kernel_configs.h"

#include <gtest/gtest.h>

#include <fstream>

#include "../common/temp_dir.h"

namespace lmx::ops {
namespace {

const char* kMoeLora = R"({
  "op": "moe_lora",
  "notes": {"device": "NVIDIA H200"},
  "shapes": {
    "H=2880,I=2880,E=32,K=4,R=32": [
      {"max_tokens": 16, "knobs": {"path": 0, "split_k": 8}},
      {"max_tokens": 1, "knobs": {"path": 0, "split_k": 12}},
      {"max_tokens": 256, "knobs": {"path": 1, "split_k": 4, "pdl": 1}}
    ]
  }
})";

TEST(KernelConfigs, BucketLookupPicksSmallestBucketAtLeastTokens) {
  KernelConfigs configs;
  ASSERT_TRUE(configs.add_json(kMoeLora, "moe_lora.json").ok());
  const std::string shape = shape_key({{"H", 2880}, {"I", 2880}, {"E", 32}, {"K", 4}, {"R", 32}});
  EXPECT_EQ(shape, "H=2880,I=2880,E=32,K=4,R=32");
  ASSERT_NE(configs.find("moe_lora", shape, 1), nullptr);
  EXPECT_EQ(configs.find("moe_lora", shape, 1)->at("split_k"), 12);
  EXPECT_EQ(configs.find("moe_lora", shape, 2)->at("split_k"), 8);
  EXPECT_EQ(configs.find("moe_lora", shape, 16)->at("split_k"), 8);
  EXPECT_EQ(configs.find("moe_lora", shape, 17)->at("split_k"), 4);
  EXPECT_EQ(configs.find("moe_lora", shape, 100000)->at("pdl"), 1);  // past the largest: the largest
  EXPECT_EQ(configs.find("moe_lora", "H=2048,I=768,E=128,K=8,R=32", 16), nullptr);
  EXPECT_EQ(configs.find("moe_gemm", shape, 16), nullptr);
  EXPECT_EQ(configs.entries(), 3u);
}

TEST(KernelConfigs, SaveThenLoadRoundTrips) {
  testing::TempDir dir("kernel_configs");
  KernelConfigs configs;
  configs.set("moe_gemm", "H=64,I=32,E=8,K=2", 16, {{"block_m", 16}, {"stages", 4}});
  configs.set("moe_gemm", "H=64,I=32,E=8,K=2", 4096, {{"block_m", 64}, {"stages", 3}});
  configs.set("moe_lora", "H=64,I=32,E=8,K=2,R=16", 1, {{"split_k", 2}});
  configs.set_note("device", "test");
  ASSERT_TRUE(configs.save_dir(dir.file("out")).ok());
  Result<KernelConfigs> loaded = KernelConfigs::load_dir(dir.file("out"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  EXPECT_EQ(loaded->entries(), 3u);
  EXPECT_EQ(loaded->find("moe_gemm", "H=64,I=32,E=8,K=2", 17)->at("block_m"), 64);
  EXPECT_EQ(loaded->find("moe_gemm", "H=64,I=32,E=8,K=2", 3)->at("stages"), 4);
  EXPECT_EQ(loaded->find("moe_lora", "H=64,I=32,E=8,K=2,R=16", 9)->at("split_k"), 2);
}

TEST(KernelConfigs, MergeKeepsOtherShapesAndReplacesEqualBuckets) {
  KernelConfigs a, b;
  a.set("moe_lora", "S=8", 16, {{"split_k", 2}});
  a.set("moe_lora", "S=4", 16, {{"split_k", 3}});
  b.set("moe_lora", "S=8", 16, {{"split_k", 5}});
  b.set("moe_lora", "S=8", 64, {{"split_k", 6}});
  a.merge(b);
  EXPECT_EQ(a.entries(), 3u);
  EXPECT_EQ(a.find("moe_lora", "S=8", 16)->at("split_k"), 5);
  EXPECT_EQ(a.find("moe_lora", "S=8", 64)->at("split_k"), 6);
  EXPECT_EQ(a.find("moe_lora", "S=4", 16)->at("split_k"), 3);
}

TEST(KernelConfigs, EmptyDirectoryMeansDefaultsMissingDirectoryIsAnError) {
  testing::TempDir dir("kernel_configs");
  Result<KernelConfigs> empty = KernelConfigs::load_dir(dir.str());
  ASSERT_TRUE(empty.ok());
  EXPECT_TRUE(empty->empty());
  Result<KernelConfigs> missing = KernelConfigs::load_dir(dir.file("nope"));
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("nope"), std::string::npos);
}

void expect_error(const std::string& text, const std::string& needle) {
  KernelConfigs configs;
  const Status s = configs.add_json(text, "bad.json");
  ASSERT_FALSE(s.ok()) << text;
  EXPECT_NE(s.message().find("bad.json"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find(needle), std::string::npos) << "expected '" << needle << "' in: " << s.message();
  EXPECT_TRUE(configs.empty()) << "a rejected file must change nothing";
}

TEST(KernelConfigs, BadFilesAreRejectedNamingTheField) {
  expect_error("{", "not valid JSON");
  expect_error("[]", "expected an object");
  expect_error(R"({"op": "Moe Lora", "shapes": {}})", "op: expected a name");
  expect_error(R"({"op": "x", "shape": {}})", "shape: expected one of the fields");
  expect_error(R"({"op": "x"})", "shapes: expected an object");
  expect_error(R"({"op": "x", "shapes": {"H=1": {}}})", "shapes[\"H=1\"]: expected an array");
  expect_error(R"({"op": "x", "shapes": {"H=1": [{"max_tokens": 0, "knobs": {}}]}})",
               "max_tokens: expected an integer >= 1");
  expect_error(R"({"op": "x", "shapes": {"H=1": [{"max_tokens": 4, "knobs": {"split_k": "8"}}]}})",
               "knobs.split_k: expected an integer, found \"8\"");
  expect_error(R"({"op": "x", "shapes": {"H=1": [{"max_tokens": 4, "knobs": {}}, {"max_tokens": 4, "knobs": {}}]}})",
               "a bucket not listed before");
  expect_error(R"({"op": "x", "shapes": {"H=1": [{"max_tokens": 4, "knobs": {}, "extra": 1}]}})",
               "[0]: expected {\"max_tokens\"");
}

TEST(KernelConfigs, LoadDirNamesTheFileOfABadEntry) {
  testing::TempDir dir("kernel_configs");
  std::ofstream(dir.file("a.json")) << kMoeLora;
  std::ofstream(dir.file("b.json")) << R"({"op": "moe_gemm", "shapes": {"H=1": [{"max_tokens": 1, "knobs": {"b": 1.5}}]}})";
  Result<KernelConfigs> loaded = KernelConfigs::load_dir(dir.str());
  ASSERT_FALSE(loaded.ok());
  EXPECT_NE(loaded.status().message().find("b.json"), std::string::npos) << loaded.status().message();
  EXPECT_NE(loaded.status().message().find("knobs.b"), std::string::npos) << loaded.status().message();
}

// The built-in defaults the engine loads for --device cuda (configs/kernels, from `loramux tune` on the
// H200) must stay loadable, and hold the yardstick's shape.
TEST(KernelConfigs, CommittedDefaultsLoadAndCoverTheYardstickShape) {
  Result<KernelConfigs> loaded = KernelConfigs::load_dir(std::string(LORAMUX_SOURCE_DIR) + "/configs/kernels");
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  for (int64_t tokens : {1, 16, 256, 4096}) {
    const KernelKnobs* knobs = loaded->find("moe_lora", "H=2880,I=2880,E=32,K=4,S=8,R=32", tokens);
    ASSERT_NE(knobs, nullptr) << "T " << tokens;
  }
}

}  // namespace
}  // namespace lmx::ops
