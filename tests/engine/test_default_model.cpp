// The built-in default model (models/default, trained by tools/train_default.py) against the Hugging Face
// reference the training script wrote (tests/fixtures/default_model.json): last-position logits within
// docs/NUMERICS.md and greedy tokens exactly, for the base model and every adapter in one mixed batch; every
// adapter visibly changes the continuation; and `loramux generate` without --model runs this model.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "engine_test_util.h"
#include "io/safetensors.h"
#include "lora/adapter.h"
#include "model/weights.h"

namespace lmx::engine {
namespace {

namespace fs = std::filesystem;
using testing::RunResult;

// docs/NUMERICS.md "Whole model vs Hugging Face transformers + PEFT": bf16-exact weights, fp32 math on both
// sides, only the summation order differs (the same constants as test_hf_parity.cpp).
constexpr double kLogitAtol = 2e-5;
constexpr double kLogitRtol = 1e-5;

fs::path model_dir() { return fs::path(LORAMUX_SOURCE_DIR) / "models" / "default"; }
fs::path fixture_file() { return fs::path(LORAMUX_SOURCE_DIR) / "tests" / "fixtures" / "default_model.json"; }

nlohmann::json read_fixture() {
  Result<std::string> text = io::read_text_file(fixture_file().string());
  EXPECT_TRUE(text.ok()) << text.status().message();
  return nlohmann::json::parse(text.ok() ? *text : "{}");
}

// Runs every fixture result (base and adapters, all prompts) as one mixed batch with one slot fewer than
// adapters, so that slots are evicted and reloaded on the way.
struct DefaultModelRun {
  nlohmann::json expected;
  std::vector<Request> requests;
  std::vector<RunResult> results;
};

DefaultModelRun run_default_model() {
  DefaultModelRun run;
  run.expected = read_fixture();
  Result<model::ModelWeights> weights = model::load_model(model_dir().string());
  EXPECT_TRUE(weights.ok()) << weights.status().message();
  if (!weights.ok()) return run;
  const auto adapter_names = run.expected["adapters"].get<std::vector<std::string>>();
  cpu::CpuBackend backend;
  EngineConfig config;
  config.max_loras = std::max<int>(1, int(adapter_names.size()) - 1);
  config.max_lora_rank = 64;
  config.scheduler.max_num_batched_tokens = 48;
  config.scheduler.max_model_len = 128;
  Result<std::unique_ptr<Engine>> engine = Engine::create(*weights, backend, config);
  EXPECT_TRUE(engine.ok()) << engine.status().message();
  if (!engine.ok()) return run;
  const lora::BaseModelShapes shapes = lora_shapes(weights->config);
  for (const std::string& name : adapter_names) {
    Result<lora::Adapter> adapter = lora::load_adapter((model_dir() / "adapters" / name).string(), name, shapes,
                                                       lora::AdapterLimits{.max_rank = 64});
    EXPECT_TRUE(adapter.ok()) << adapter.status().message();
    if (!adapter.ok()) return run;
    EXPECT_TRUE((*engine)->add_adapter(std::move(adapter).value()).ok());
  }
  const int max_new = run.expected["max_new_tokens"].get<int>();
  for (const auto& r : run.expected["results"]) {
    Request req;
    req.adapter = r["adapter"].is_null() ? "" : r["adapter"].get<std::string>();
    req.prompt_ids = run.expected["prompts"][r["prompt"].get<size_t>()]["ids"].get<std::vector<int32_t>>();
    req.sampling.max_tokens = max_new;
    req.sampling.ignore_eos = true;
    req.return_logits = true;
    run.requests.push_back(req);
  }
  run.results = testing::run_all(**engine, run.requests);
  return run;
}

std::string describe(const nlohmann::json& ref) {
  return "adapter " + (ref["adapter"].is_null() ? std::string("<base>") : ref["adapter"].get<std::string>()) +
         " prompt " + std::to_string(ref["prompt"].get<int>());
}

TEST(DefaultModel, FixtureNamesEveryShippedAdapter) {
  ASSERT_TRUE(fs::exists(model_dir() / "config.json")) << model_dir() << " is missing (tools/train_default.py)";
  ASSERT_TRUE(fs::exists(fixture_file())) << fixture_file() << " is missing (tools/train_default.py --fixtures-only)";
  std::vector<std::string> shipped;
  for (const auto& entry : fs::directory_iterator(model_dir() / "adapters"))
    if (entry.is_directory()) shipped.push_back(entry.path().filename().string());
  std::sort(shipped.begin(), shipped.end());
  EXPECT_EQ(read_fixture()["adapters"].get<std::vector<std::string>>(), shipped);
  EXPECT_GE(shipped.size(), 3u) << "the default model should show several adapters";
}

TEST(DefaultModel, LogitsAndGreedyTokensMatchTransformers) {
  DefaultModelRun run = run_default_model();
  ASSERT_EQ(run.results.size(), run.expected["results"].size());
  ASSERT_FALSE(run.results.empty());
  const double min_margin = run.expected["min_greedy_margin"].get<double>();
  double worst = 0.0;
  for (size_t i = 0; i < run.results.size(); ++i) {
    const auto& ref = run.expected["results"][i];
    const std::string what = describe(ref);
    // The generator keeps only prompts whose every greedy step is clear (margin >= min_margin); should a
    // regenerated fixture hold a closer step, tokens are compared up to it only (fp32 reorderings may flip it).
    const auto greedy = ref["greedy"].get<std::vector<int32_t>>();
    const auto margins = ref["greedy_margins"].get<std::vector<double>>();
    size_t exact = 0;
    while (exact < greedy.size() && margins[exact] >= min_margin) ++exact;
    ASSERT_GE(run.results[i].tokens.size(), exact) << what;
    EXPECT_EQ(std::vector<int32_t>(run.results[i].tokens.begin(), run.results[i].tokens.begin() + std::ptrdiff_t(exact)),
              std::vector<int32_t>(greedy.begin(), greedy.begin() + std::ptrdiff_t(exact)))
        << what;
    const auto last = ref["last_logits"].get<std::vector<double>>();
    ASSERT_FALSE(run.results[i].logits.empty()) << what;
    ASSERT_EQ(run.results[i].logits[0].size(), last.size()) << what;
    for (size_t v = 0; v < last.size(); ++v) {
      const double diff = std::fabs(double(run.results[i].logits[0][v]) - last[v]);
      worst = std::max(worst, diff);
      ASSERT_LE(diff, kLogitAtol + kLogitRtol * std::fabs(last[v])) << what << " vocab " << v;
    }
  }
  RecordProperty("max_abs_logit_diff", std::to_string(worst));
  std::printf("default model: %zu requests, max |logit - hf| = %.3g\n", run.results.size(), worst);
}

// The point of the default model: the same prompt continues differently through each adapter.
TEST(DefaultModel, EveryAdapterChangesTheGreedyContinuation) {
  DefaultModelRun run = run_default_model();
  ASSERT_EQ(run.results.size(), run.expected["results"].size());
  std::map<std::pair<int, std::string>, std::vector<int32_t>> tokens;  // (prompt, adapter) -> greedy
  for (size_t i = 0; i < run.results.size(); ++i)
    tokens[{run.expected["results"][i]["prompt"].get<int>(), run.requests[i].adapter}] = run.results[i].tokens;
  const int fixed_prompt = 0;
  const std::vector<int32_t>& base = tokens[{fixed_prompt, ""}];
  ASSERT_FALSE(base.empty());
  for (const std::string& name : run.expected["adapters"].get<std::vector<std::string>>()) {
    const std::vector<int32_t>& adapted = tokens[{fixed_prompt, name}];
    EXPECT_NE(adapted, base)
        << "adapter " << name << " continues prompt '" << run.expected["prompts"][fixed_prompt]["text"].get<std::string>()
        << "' exactly like the base model";
  }
}

// `loramux generate` with no --model runs models/default with its adapters registered by name, and a
// missing default model is a clear error.
std::pair<int, std::string> run_cli(const std::string& env, const std::string& args) {
  const char* bin = std::getenv("LORAMUX_BIN");
  EXPECT_NE(bin, nullptr) << "LORAMUX_BIN not set (ctest sets it)";
  if (!bin) return {-1, ""};
  FILE* pipe = popen((env + " " + bin + " " + args + " 2>&1").c_str(), "r");
  std::string out;
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

TEST(DefaultModel, GenerateWithoutModelUsesItAndItsAdapters) {
  const nlohmann::json expected = read_fixture();
  const auto& prompt_ids = expected["prompts"][0]["ids"];
  std::string ids;
  for (const auto& id : prompt_ids) ids += (ids.empty() ? "" : ",") + std::to_string(id.get<int>());
  const std::string max_new = std::to_string(expected["max_new_tokens"].get<int>());
  for (const auto& ref : expected["results"]) {
    if (ref["prompt"].get<int>() != 0) continue;
    const std::string adapter = ref["adapter"].is_null() ? "" : " --adapter " + ref["adapter"].get<std::string>();
    auto [code, out] = run_cli("", "generate --ignore-eos --max-tokens " + max_new + " --prompt-ids " + ids + adapter);
    ASSERT_EQ(code, 0) << out;
    const size_t brace = out.rfind("\n{");
    const nlohmann::json line = nlohmann::json::parse(out.substr(brace == std::string::npos ? 0 : brace + 1));
    const auto greedy = ref["greedy"].get<std::vector<int32_t>>();
    const auto margins = ref["greedy_margins"].get<std::vector<double>>();
    const auto got = line["token_ids"].get<std::vector<int32_t>>();
    for (size_t t = 0; t < greedy.size() && t < got.size() && margins[t] >= expected["min_greedy_margin"].get<double>(); ++t)
      ASSERT_EQ(got[t], greedy[t]) << describe(ref) << " token " << t << "\n" << out;
  }
  auto [code, out] = run_cli("LORAMUX_DEFAULT_MODEL=/nonexistent/default", "generate --max-tokens 1");
  EXPECT_NE(code, 0);
  EXPECT_NE(out.find("LORAMUX_DEFAULT_MODEL='/nonexistent/default'"), std::string::npos) << out;
  EXPECT_NE(out.find("config.json"), std::string::npos) << out;
}

}  // namespace
}  // namespace lmx::engine
