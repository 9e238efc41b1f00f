// The moe_lora entries of a kernel-configs folder against what the launchers take (check_moe_lora_knobs): the
// committed configs/kernels pass; every out-of-range value and an unknown knob fail with the entry, the knob,
// the value and what was expected; and through engine::make_backend a bad file fails the CUDA backend's
// construction with the --kernel-configs context before any device work. Host code: these run without a GPU
// (hence no Cuda prefix: scripts/test runs them in CI).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "backends/cuda/moe_gemm.cuh"
#include "backends/cuda/tune.h"
#include "engine/setup.h"
#include "ops/kernel_configs.h"

namespace lmx::test {
namespace {

const std::string kShape = "H=2880,I=2880,E=32,K=4,S=8,R=32";

ops::KernelConfigs one_entry(ops::KernelKnobs knobs) {
  ops::KernelConfigs configs;
  configs.set(cuda::kMoeLoraOp, kShape, 256, std::move(knobs));
  return configs;
}

TEST(MoeLoraKnobs, CommittedConfigsPass) {
  Result<ops::KernelConfigs> loaded = ops::KernelConfigs::load_dir(std::string(LORAMUX_SOURCE_DIR) + "/configs/kernels");
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  ASSERT_FALSE(loaded.value().empty());
  const Status s = cuda::check_moe_lora_knobs(loaded.value());
  EXPECT_TRUE(s.ok()) << s.message();
}

TEST(MoeLoraKnobs, EveryPathAndKnobInRangePasses) {
  for (int64_t path : {0, 1}) {
    for (int64_t block_n : {64, 128}) {
      for (int64_t bulk : {0, 1}) {
        for (int64_t persistent : {0, 1}) {
          const Status s = cuda::check_moe_lora_knobs(
              one_entry({{"path", path}, {"pdl", 0}, {"order", 1}, {"split_k", 64}, {"expand_block_n", block_n},
                         {"expand_chunks", 1024}, {"expand_bulk", bulk}, {"expand_persistent", persistent}}));
          EXPECT_TRUE(s.ok()) << s.message();
        }
      }
    }
  }
}

TEST(MoeLoraKnobs, OutOfRangeNamesTheEntryKnobAndValue) {
  struct Bad {
    const char* knob;
    int64_t value;
    const char* expected;
  };
  const Bad cases[] = {{"path", 2, "expected 0 (direct) or 1 (tiled)"},
                       {"path", -1, "expected 0 (direct)"},
                       {"pdl", 2, "expected 0 or 1"},
                       {"order", -1, "expected 0 (tile-fastest) or 1 (piece-fastest)"},
                       {"split_k", 65, "expected 0 (by size) to 64"},
                       {"expand_block_n", 96, "expected 64 or 128"},
                       {"expand_chunks", -2, "expected 0 (by size) to 1024"},
                       {"expand_chunks", 1025, "expected 0 (by size) to 1024"},
                       {"expand_bulk", 2, "expected 0 (cp.async) or 1 (bulk copies)"},
                       {"expand_persistent", -1, "expected 0 (a piece per CTA) or 1 (resident CTAs walk the pieces)"}};
  for (const Bad& bad : cases) {
    SCOPED_TRACE(std::string(bad.knob) + " = " + std::to_string(bad.value));
    ops::KernelKnobs knobs = {{"path", 1}};
    knobs[bad.knob] = bad.value;
    const Status s = cuda::check_moe_lora_knobs(one_entry(knobs));
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
    EXPECT_NE(s.message().find("moe_lora " + kShape + " max_tokens 256"), std::string::npos) << s.message();
    EXPECT_NE(s.message().find(std::string("knob ") + bad.knob + " = " + std::to_string(bad.value)), std::string::npos)
        << s.message();
    EXPECT_NE(s.message().find(bad.expected), std::string::npos) << s.message();
  }
}

// A tuned entry's expand knobs reach the MoE block's config; knobs it leaves out keep the built-in defaults.
TEST(MoeLoraKnobs, ApplySetsTheExpandForm) {
  cuda::MoeBlockConfig defaults;
  EXPECT_TRUE(defaults.lora.expand_bulk);
  EXPECT_TRUE(defaults.lora.expand_persistent);
  for (int64_t persistent : {0, 1}) {
    cuda::MoeBlockConfig config;
    const ops::KernelKnobs knobs = {{"path", 1}, {"expand_chunks", 32}, {"expand_persistent", persistent}};
    cuda::apply_moe_lora_knobs(&knobs, &config);
    EXPECT_EQ(config.lora.expand_persistent, persistent == 1);
    EXPECT_TRUE(config.lora.expand_bulk);
    EXPECT_EQ(config.lora.expand_chunks, 32);
    EXPECT_EQ(config.lora_path, 1);
  }
  cuda::MoeBlockConfig config;
  const ops::KernelKnobs cp_async = {{"path", 1}, {"expand_bulk", 0}};
  cuda::apply_moe_lora_knobs(&cp_async, &config);
  EXPECT_FALSE(config.lora.expand_bulk);
}

TEST(MoeLoraKnobs, UnknownKnobIsNamed) {
  const Status s = cuda::check_moe_lora_knobs(one_entry({{"path", 1}, {"splitk", 4}}));
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.message().find("unknown knob 'splitk'"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("split_k"), std::string::npos) << s.message();  // the known ones are listed
}

TEST(MoeLoraKnobs, OtherOpsAreNotChecked) {
  ops::KernelConfigs configs;
  configs.set("moe_gemm", kShape, 16, {{"anything", 12345}});
  const Status s = cuda::check_moe_lora_knobs(configs);
  EXPECT_TRUE(s.ok()) << s.message();
}

// A folder whose file holds a knob out of range fails the CUDA backend (no GPU needed: the check comes first).
TEST(MoeLoraKnobs, BadFolderFailsTheBackendWithItsContext) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / "lmx_bad_kernel_configs";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "moe_lora.json") << R"({"op": "moe_lora", "shapes": {")" << kShape
                                       << R"(": [{"max_tokens": 64, "knobs": {"path": 1, "expand_block_n": 96}}]}})";
  Result<std::unique_ptr<ops::Backend>> backend = engine::make_backend("cuda", dir.string());
  std::filesystem::remove_all(dir);
  ASSERT_FALSE(backend.ok());
  const std::string message = backend.status().message();
  EXPECT_NE(message.find("--kernel-configs"), std::string::npos) << message;
  EXPECT_NE(message.find("knob expand_block_n = 96: expected 64 or 128"), std::string::npos) << message;
  EXPECT_NE(message.find("max_tokens 64"), std::string::npos) << message;
}

}  // namespace
}  // namespace lmx::test
