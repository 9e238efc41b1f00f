// The whole model on the CUDA backend (backends/cuda/cuda_backend.h) against the CPU backend and the
// Hugging Face fixtures (tests/fixtures): every family, base model and every adapter in one mixed batch
// with chunked prefill and slot eviction — the same engine run as tests/engine/test_hf_parity.cpp, only the
// backend differs. Greedy tokens must equal Hugging Face's; last-position logits agree within the bf16
// activation tolerance of docs/NUMERICS.md ("CUDA model vs the fp32 oracle").
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "../engine/engine_test_util.h"
#include "backends/cuda/cuda_backend.h"
#include "io/safetensors.h"
#include "lora/adapter.h"
#include "model/weights.h"

namespace lmx::engine {
namespace {

namespace fs = std::filesystem;
using testing::RunResult;

// bf16 activations through every layer of a tiny model: each rounding is 2^-9 relative and the layers
// compound it; 3% of the logits' scale (|x| + rms) is well below the fixtures' greedy gaps' scale and above
// what the bf16 path drifts (observed figures go to docs/perf-log.md with the first device run).
constexpr double kLogitTol = 0.03;

fs::path fixtures_dir() { return fs::path(LORAMUX_SOURCE_DIR) / "tests" / "fixtures"; }

std::vector<std::string> fixture_cases() {
  std::vector<std::string> cases;
  if (!fs::exists(fixtures_dir())) return cases;
  for (const auto& entry : fs::directory_iterator(fixtures_dir()))
    if (fs::exists(entry.path() / "expected.json")) cases.push_back(entry.path().filename().string());
  std::sort(cases.begin(), cases.end());
  return cases;
}

class CudaModel : public ::testing::TestWithParam<std::string> {};

TEST_P(CudaModel, GreedyTokensMatchTransformersLogitsClose) {
  int devices = 0;
  ASSERT_EQ(cudaGetDeviceCount(&devices), cudaSuccess) << "no CUDA device: Cuda* tests need a GPU";
  const fs::path dir = fixtures_dir() / GetParam();
  Result<std::string> text = io::read_text_file((dir / "expected.json").string());
  ASSERT_TRUE(text.ok()) << text.status().message();
  const nlohmann::json expected = nlohmann::json::parse(*text);
  Result<model::ModelWeights> weights = model::load_model((dir / "model").string());
  ASSERT_TRUE(weights.ok()) << weights.status().message();

  const std::vector<std::string> adapter_names = expected["adapters"].get<std::vector<std::string>>();
  cuda::CudaBackend backend;
  EngineConfig config;
  config.max_loras = std::max<int>(1, int(adapter_names.size()) - 1);  // one fewer slot than adapters: eviction
  config.max_lora_rank = 64;
  config.scheduler.max_num_batched_tokens = 40;  // chunked prefill beside decodes
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
  std::vector<Request> requests;
  for (const auto& r : expected["results"]) {
    Request req;
    req.adapter = r["adapter"].is_null() ? "" : r["adapter"].get<std::string>();
    req.prompt_ids = prompts[r["prompt"].get<size_t>()];
    req.sampling.max_tokens = expected["max_new_tokens"].get<int>();
    req.sampling.ignore_eos = true;
    req.return_logits = true;
    requests.push_back(req);
  }
  const std::vector<RunResult> results = testing::run_all(**engine, requests);
  ASSERT_EQ(results.size(), requests.size());
  double worst = 0.0;
  int greedy_mismatches = 0;
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& ref = expected["results"][i];
    const std::string what = GetParam() + " adapter " + (requests[i].adapter.empty() ? "<base>" : requests[i].adapter) +
                             " prompt " + std::to_string(ref["prompt"].get<int>());
    if (results[i].tokens != ref["greedy"].get<std::vector<int32_t>>()) ++greedy_mismatches;
    EXPECT_EQ(results[i].tokens, ref["greedy"].get<std::vector<int32_t>>()) << what;
    const auto last = ref["last_logits"].get<std::vector<double>>();
    ASSERT_FALSE(results[i].logits.empty()) << what;
    ASSERT_EQ(results[i].logits[0].size(), last.size()) << what;
    double sum_squares = 0.0;
    for (double v : last) sum_squares += v * v;
    const double rms = std::sqrt(sum_squares / double(last.size()));
    for (size_t v = 0; v < last.size(); ++v) {
      const double diff = std::fabs(double(results[i].logits[0][v]) - last[v]);
      worst = std::max(worst, diff / (std::fabs(last[v]) + rms));
      ASSERT_LE(diff, kLogitTol * (std::fabs(last[v]) + rms)) << what << " vocab " << v;
    }
  }
  std::printf("%s on cuda: %zu requests, %d greedy mismatches, worst scaled logit error %.3g\n", GetParam().c_str(),
              results.size(), greedy_mismatches, worst);
}

INSTANTIATE_TEST_SUITE_P(CudaFixtures, CudaModel, ::testing::ValuesIn(fixture_cases()),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
}  // namespace lmx::engine
