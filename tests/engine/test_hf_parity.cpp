// Model-level truth: for every case in tests/fixtures (tiny models of each family with PEFT adapters,
// reference outputs from Hugging Face transformers + peft, see tests/fixtures/README.md), our engine on
// the cpu backend reproduces the last-position logits within docs/NUMERICS.md and the greedy tokens
// exactly — for the base model and every adapter, all requests run together as one mixed batch.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "engine_test_util.h"
#include "io/safetensors.h"
#include "lora/adapter.h"
#include "model/weights.h"

namespace lmx::engine {
namespace {

namespace fs = std::filesystem;
using testing::RunResult;

// docs/NUMERICS.md "cpu forward vs transformers fp32": same bf16-exact inputs, fp32 math on both sides;
// only summation order differs.
constexpr double kLogitAtol = 2e-5;
constexpr double kLogitRtol = 1e-5;

fs::path fixtures_dir() { return fs::path(LORAMUX_SOURCE_DIR) / "tests" / "fixtures"; }

std::vector<std::string> fixture_cases() {
  std::vector<std::string> cases;
  if (!fs::exists(fixtures_dir())) return cases;
  for (const auto& entry : fs::directory_iterator(fixtures_dir()))
    if (fs::exists(entry.path() / "expected.json")) cases.push_back(entry.path().filename().string());
  std::sort(cases.begin(), cases.end());
  return cases;
}

nlohmann::json read_json(const fs::path& path) {
  Result<std::string> text = io::read_text_file(path.string());
  EXPECT_TRUE(text.ok()) << text.status().message();
  return nlohmann::json::parse(text.ok() ? *text : "{}");
}

class HfParity : public ::testing::TestWithParam<std::string> {};

TEST_P(HfParity, LogitsAndGreedyTokensMatchTransformers) {
  const fs::path dir = fixtures_dir() / GetParam();
  nlohmann::json expected = read_json(dir / "expected.json");
  Result<model::ModelWeights> weights = model::load_model((dir / "model").string());
  ASSERT_TRUE(weights.ok()) << weights.status().message();

  std::vector<std::string> adapter_names = expected["adapters"].get<std::vector<std::string>>();
  cpu::CpuBackend backend;
  EngineConfig config;
  config.max_loras = std::max<int>(1, int(adapter_names.size()) - 1);  // one fewer slot than adapters: eviction too
  config.max_lora_rank = 64;
  config.scheduler.max_num_batched_tokens = 40;  // longer prompts prefill in chunks beside decodes
  config.scheduler.max_model_len = 64;
  Result<std::unique_ptr<Engine>> engine = Engine::create(*weights, backend, config);
  ASSERT_TRUE(engine.ok()) << engine.status().message();
  const lora::BaseModelShapes shapes = lora_shapes(weights->config);
  for (const std::string& name : adapter_names) {
    Result<lora::Adapter> adapter =
        lora::load_adapter((dir / "adapters" / name).string(), name, shapes, lora::AdapterLimits{.max_rank = 64});
    ASSERT_TRUE(adapter.ok()) << adapter.status().message();
    ASSERT_TRUE((*engine)->add_adapter(std::move(adapter).value()).ok());
  }

  const auto prompts = expected["prompts"].get<std::vector<std::vector<int32_t>>>();
  const int max_new = expected["max_new_tokens"].get<int>();
  std::vector<Request> requests;
  for (const auto& r : expected["results"]) {
    Request req;
    req.adapter = r["adapter"].is_null() ? "" : r["adapter"].get<std::string>();
    req.prompt_ids = prompts[r["prompt"].get<size_t>()];
    req.sampling.max_tokens = max_new;
    req.sampling.ignore_eos = true;
    req.return_logits = true;
    requests.push_back(req);
  }
  std::vector<RunResult> results = testing::run_all(**engine, requests);

  double worst = 0.0;
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& ref = expected["results"][i];
    std::string what = GetParam() + " adapter " + (requests[i].adapter.empty() ? "<base>" : requests[i].adapter) +
                       " prompt " + std::to_string(ref["prompt"].get<int>());
    auto greedy = ref["greedy"].get<std::vector<int32_t>>();
    EXPECT_EQ(results[i].tokens, greedy) << what;
    auto last = ref["last_logits"].get<std::vector<double>>();
    ASSERT_FALSE(results[i].logits.empty()) << what;
    ASSERT_EQ(results[i].logits[0].size(), last.size()) << what;
    for (size_t v = 0; v < last.size(); ++v) {
      double diff = std::fabs(double(results[i].logits[0][v]) - last[v]);
      worst = std::max(worst, diff);
      ASSERT_LE(diff, kLogitAtol + kLogitRtol * std::fabs(last[v])) << what << " vocab " << v;
    }
  }
  RecordProperty("max_abs_logit_diff", std::to_string(worst));
  std::printf("%s: %zu requests, max |logit - hf| = %.3g\n", GetParam().c_str(), results.size(), worst);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, HfParity, ::testing::ValuesIn(fixture_cases()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

TEST(HfParityFixtures, EveryFamilyIsPresent) {
  std::vector<std::string> cases = fixture_cases();
  for (const char* family : {"gpt_oss", "qwen3_moe_fused", "qwen3_moe_per_expert", "mixtral", "qwen3_dense", "llama"})
    EXPECT_NE(std::find(cases.begin(), cases.end(), family), cases.end()) << "missing fixture case " << family;
}

// transformers' MXFP4 dequantization, recorded per expert tensor in its own layout [E, in, out]; ours is
// [E, out, in] bf16. The fixture rounds floats to 7 significant digits, so values are compared to a
// relative 1e-6: neighbouring bf16 values differ by 2^-8 relative, so this still pins every bit.
TEST(HfParityFixtures, Mxfp4DequantizationIsBitExact) {
  const fs::path dir = fixtures_dir() / "gpt_oss";
  if (!fs::exists(dir / "expected.json")) GTEST_SKIP() << "no gpt_oss fixture";
  nlohmann::json expected = read_json(dir / "expected.json");
  ASSERT_TRUE(expected.contains("mxfp4_dequant"));
  Result<model::ModelWeights> weights = model::load_model((dir / "model").string());
  ASSERT_TRUE(weights.ok()) << weights.status().message();
  int checked = 0;
  for (const auto& [name, info] : expected["mxfp4_dequant"].items()) {
    // name: model.layers.{l}.mlp.experts.{gate_up_proj|down_proj}
    int layer = std::stoi(name.substr(name.find("layers.") + 7));
    const model::LayerWeights& lw = weights->layers[size_t(layer)];
    const Tensor& ours = name.find("gate_up") != std::string::npos ? lw.gate_up : lw.down;  // [E, out, in]
    auto shape = info["shape"].get<std::vector<int64_t>>();                                 // [E, in, out]
    ASSERT_EQ(shape.size(), 3u);
    ASSERT_EQ(ours.dim(0), shape[0]);
    ASSERT_EQ(ours.dim(1), shape[2]) << name;
    ASSERT_EQ(ours.dim(2), shape[1]) << name;
    auto at = [&](int64_t e, int64_t in, int64_t out) {
      return double(bf16_to_f32(ours.ptr<bf16>()[(e * ours.dim(1) + out) * ours.dim(2) + in]));
    };
    double sum = 0, abs_sum = 0;
    for (int64_t e = 0; e < shape[0]; ++e)
      for (int64_t i = 0; i < shape[1]; ++i)
        for (int64_t o = 0; o < shape[2]; ++o) {
          sum += at(e, i, o);
          abs_sum += std::fabs(at(e, i, o));
        }
    auto near = [](double a, double b) { return std::fabs(a - b) <= 1e-6 * std::max(std::fabs(a), std::fabs(b)); };
    EXPECT_PRED2(near, sum, info["sum"].get<double>()) << name;
    EXPECT_PRED2(near, abs_sum, info["abs_sum"].get<double>()) << name;
    for (const auto& sample : info["samples"]) {
      int64_t flat = sample[0].get<int64_t>();
      int64_t o = flat % shape[2], i = (flat / shape[2]) % shape[1], e = flat / (shape[1] * shape[2]);
      EXPECT_PRED2(near, at(e, i, o), sample[1].get<double>()) << name << " flat index " << flat;
    }
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

}  // namespace
}  // namespace lmx::engine
