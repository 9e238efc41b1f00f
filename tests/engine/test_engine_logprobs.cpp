// Logprobs through the engine on the tiny preset: in one mixed batch (base and adapters, greedy and sampled,
// logprobs off / 0 / 3 / 20), each request's tokens equal the same request without logprobs, and its
// per-token logprobs are the raw log_softmax of the very logits it was sampled from (return_logits), top-N
// ids exact. Out-of-range widths are refused with a message naming logprobs.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "engine_test_util.h"
#include "lora/adapter.h"
#include "model/presets.h"

namespace lmx::engine {
namespace {

struct Finished {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
  std::vector<TokenLogprobs> logprobs;
};

std::vector<Finished> run(Engine& engine, const std::vector<Request>& requests) {
  std::vector<uint64_t> ids;
  for (const Request& r : requests) {
    Result<uint64_t> id = engine.add_request(r);
    EXPECT_TRUE(id.ok()) << id.status().message();
    ids.push_back(id.ok() ? *id : 0);
  }
  for (int guard = 0; engine.has_work() && guard < 10000; ++guard) engine.step();
  std::vector<Finished> out;
  for (uint64_t id : ids) {
    std::unique_ptr<Sequence> seq = engine.take_finished(id);
    EXPECT_TRUE(seq) << "request " << id << " did not finish";
    Finished f;
    if (seq) {
      f.tokens.assign(seq->tokens.begin() + seq->prompt_len, seq->tokens.end());
      f.logits = seq->logits;
      f.logprobs = seq->token_logprobs;
    }
    out.push_back(std::move(f));
  }
  return out;
}

TEST(EngineLogprobs, RawLogSoftmaxOfTheSampledLogitsAndOutputsUnchanged) {
  Result<model::ModelWeights> weights = model::make_preset_model("tiny-moe", 7);
  ASSERT_TRUE(weights.ok()) << weights.status().message();
  cpu::CpuBackend backend(1);
  EngineConfig config;
  config.scheduler.max_num_seqs = 8;
  config.scheduler.max_model_len = 128;
  auto make = [&]() {
    Result<std::unique_ptr<Engine>> e = Engine::create(*weights, backend, config);
    EXPECT_TRUE(e.ok()) << e.status().message();
    const lora::BaseModelShapes shapes = lora_shapes(weights->config);
    for (int i = 0; i < 2; ++i) {
      Status s = (*e)->add_adapter(lora::make_dummy_adapter("a" + std::to_string(i), shapes, 8, 300 + uint64_t(i)));
      EXPECT_TRUE(s.ok()) << s.message();
    }
    return std::move(e).value();
  };
  const int widths[] = {-1, 0, 3, 20, 1, 20};
  std::vector<Request> with, without;
  for (int i = 0; i < 6; ++i) {
    Request r;
    r.adapter = i % 3 == 2 ? "" : "a" + std::to_string(i % 3);
    for (int t = 0; t < 4 + i; ++t) r.prompt_ids.push_back((i * 37 + t * 11) % 250 + 1);
    r.sampling.max_tokens = 7;
    r.sampling.ignore_eos = true;
    r.sampling.temperature = i % 2 ? 0.8f : 0.0f;
    r.sampling.top_p = i == 3 ? 0.9f : 1.0f;
    r.sampling.seed = 1000 + uint64_t(i);
    without.push_back(r);
    r.sampling.logprobs = widths[i];
    r.return_logits = true;
    with.push_back(r);
  }
  std::unique_ptr<Engine> engine = make();
  const std::vector<Finished> got = run(*engine, with);
  const std::vector<Finished> plain = run(*make(), without);
  for (size_t i = 0; i < with.size(); ++i) {
    SCOPED_TRACE("request " + std::to_string(i) + " logprobs " + std::to_string(widths[i]));
    ASSERT_EQ(got[i].tokens, plain[i].tokens);  // logprobs never change what is sampled
    if (widths[i] < 0) {
      EXPECT_TRUE(got[i].logprobs.empty());
      continue;
    }
    ASSERT_EQ(got[i].logprobs.size(), got[i].tokens.size());
    ASSERT_EQ(got[i].logits.size(), got[i].tokens.size());
    for (size_t k = 0; k < got[i].tokens.size(); ++k) {
      const std::vector<float>& row = got[i].logits[k];
      const TokenLogprobs& lp = got[i].logprobs[k];
      const double max_logit = *std::max_element(row.begin(), row.end());
      double sum = 0.0;
      for (float x : row) sum += std::exp(double(x) - max_logit);
      const double lse = max_logit + std::log(sum);
      const int32_t token = got[i].tokens[k];
      // docs/NUMERICS.md "raw logprobs".
      EXPECT_NEAR(lp.logprob, double(row[size_t(token)]) - lse, 1e-5 * (1.0 + std::abs(double(row[size_t(token)]) - lse)));
      ASSERT_EQ(int(lp.top_ids.size()), widths[i]);
      ASSERT_EQ(int(lp.top_logprobs.size()), widths[i]);
      std::vector<int32_t> order(row.size());
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return row[a] > row[b]; });
      for (int n = 0; n < widths[i]; ++n) {
        ASSERT_EQ(lp.top_ids[size_t(n)], order[size_t(n)]) << "token " << k << " top " << n;
        const double want = double(row[size_t(order[size_t(n)])]) - lse;
        EXPECT_NEAR(lp.top_logprobs[size_t(n)], want, 1e-5 * (1.0 + std::abs(want)));
      }
      if (with[i].sampling.temperature == 0.0f && widths[i] > 0) {
        EXPECT_EQ(lp.top_ids[0], token);  // greedy = the top-1 alternative
      }
    }
  }
}

// A vocabulary smaller than the width asked for lists every token (the op allows at most V columns).
TEST(EngineLogprobs, WidthIsCappedAtTheVocabulary) {
  Result<model::ModelWeights> weights = model::make_preset_model("tiny-moe", 7, /*vocab_size=*/8);
  ASSERT_TRUE(weights.ok()) << weights.status().message();
  cpu::CpuBackend backend(1);
  Result<std::unique_ptr<Engine>> engine = Engine::create(*weights, backend, EngineConfig{});
  ASSERT_TRUE(engine.ok()) << engine.status().message();
  Request r;
  r.prompt_ids = {1, 2, 3};
  r.sampling.max_tokens = 3;
  r.sampling.ignore_eos = true;
  r.sampling.logprobs = 20;
  const std::vector<Finished> got = run(**engine, {r});
  ASSERT_EQ(got[0].logprobs.size(), 3u);
  for (const TokenLogprobs& lp : got[0].logprobs) {
    ASSERT_EQ(lp.top_ids.size(), 8u);
    double mass = 0.0;
    for (float x : lp.top_logprobs) mass += std::exp(double(x));
    EXPECT_NEAR(mass, 1.0, 1e-5);  // all eight tokens: the whole distribution
  }
}

TEST(EngineLogprobs, OutOfRangeWidthIsRefused) {
  Result<model::ModelWeights> weights = model::make_preset_model("tiny-moe", 7);
  ASSERT_TRUE(weights.ok()) << weights.status().message();
  cpu::CpuBackend backend(1);
  Result<std::unique_ptr<Engine>> engine = Engine::create(*weights, backend, EngineConfig{});
  ASSERT_TRUE(engine.ok()) << engine.status().message();
  for (int width : {-2, 21}) {
    Request r;
    r.prompt_ids = {1, 2, 3};
    r.sampling.logprobs = width;
    Result<uint64_t> id = (*engine)->add_request(r);
    ASSERT_FALSE(id.ok());
    EXPECT_NE(id.status().message().find("logprobs"), std::string::npos) << id.status().message();
  }
}

}  // namespace
}  // namespace lmx::engine
